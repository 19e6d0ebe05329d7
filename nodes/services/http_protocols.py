"""The two request shapes a reward service speaks: rlflow's JSON scoring protocol and an OpenAI-compatible
server (vLLM's ``vllm serve``, or any other) used as an LLM judge; bodies in, replies checked.

JSON scoring protocol (``http_reward``): ``POST <url>`` with
``{"prompts": [str], "responses": [str], "answers": [str]}`` (``answers`` only when the node binds
``answer``), one entry per sample; the reply is ``{"scores": [number]}``, one finite number per sample in
the same order.

OpenAI-compatible judge (``judge_reward``): ``POST <base>/chat/completions`` with one user message per
request (``{"model", "messages": [{"role": "user", "content": text}], "max_tokens", "temperature"}``), or
``POST <base>/completions`` with a list of prompts (``{"model", "prompt": [text], ...}``, replies matched by
each choice's ``index``); the text of each sample is the node's template filled with ``{prompt}``,
``{response}`` and ``{answer}``, and its score is the first match of a regular expression's group 1 in
the reply (OpenAI API reference, "Chat Completions" and "Completions").
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

from rlflow.nodes.services.http_client import ServiceFailure

__all__ = [
    "JUDGE_APIS",
    "TEMPLATE_FIELDS",
    "fill_template",
    "judge_bodies",
    "judge_score",
    "parse_judge_texts",
    "parse_scores",
    "score_bodies",
    "score_pattern_mistakes",
    "template_mistakes",
]

JUDGE_APIS = ("chat", "completions")
"""The OpenAI endpoints a judge may call, below the base URL: ``/chat/completions``, ``/completions``."""
TEMPLATE_FIELDS = ("prompt", "response", "answer")


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def score_bodies(
    prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str] | None, per_request: int
) -> list[dict[str, Any]]:
    """The JSON scoring protocol's request bodies: samples in order, ``per_request`` a body (the last one
    shorter); ``answers`` left out of each body when ``None``."""
    out: list[dict[str, Any]] = []
    for part in _chunks(len(responses), per_request):
        body: dict[str, Any] = {
            "prompts": [prompts[i] for i in part],
            "responses": [responses[i] for i in part],
        }
        if answers is not None:
            body["answers"] = [answers[i] for i in part]
        out.append(body)
    return out


def parse_scores(n: int) -> Callable[[Any], list[float]]:
    """The reply check of a body of ``n`` samples: ``{"scores": [n finite numbers]}`` -> the floats.

    The returned function raises :class:`ServiceFailure` ``("reply", why)`` for any other shape."""

    def parse(data: Any) -> list[float]:
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            got = f"{len(scores)} scores" if isinstance(scores, list) else f"{_short(data)}"
            raise ServiceFailure("reply", f'expected {{"scores": [{n} numbers]}}, got {got}')
        out: list[float] = []
        for i, s in enumerate(scores):
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s):
                raise ServiceFailure("reply", f"scores[{i}] is {s!r}, not a finite number")
            out.append(float(s))
        return out

    return parse


def _short(data: Any) -> str:
    text = repr(data)
    return text if len(text) <= 120 else text[:117] + "..."


def template_mistakes(template: str) -> list[str]:
    """Why ``template`` cannot be filled (``str.format`` syntax with the fields :data:`TEMPLATE_FIELDS`
    only; literal braces doubled), as messages; ``[]`` when it can."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return [f"is not a format string ({e}; write a literal brace as {{{{ or }}}})"]
    bad = [f for f in fields if f not in TEMPLATE_FIELDS]
    if bad:
        return [f"names {{{bad[0]}}}; a template may name only {{prompt}}, {{response}} and {{answer}}"]
    return []


def fill_template(template: str, prompt: str, response: str, answer: str) -> str:
    """``template`` with ``{prompt}``, ``{response}`` and ``{answer}`` filled (values are not re-parsed, so
    braces inside them are kept as they are)."""
    return template.format(prompt=prompt, response=response, answer=answer)


def score_pattern_mistakes(pattern: str) -> list[str]:
    """Why ``pattern`` cannot read a score (it must compile and have a group 1), as messages."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        return [f"is not a regular expression ({e})"]
    if compiled.groups < 1:
        return ["has no group: the score is read from group 1, e.g. 'Score: *(-?[0-9.]+)'"]
    return []


def judge_score(text: str, pattern: str) -> float | None:
    """The score in a judge's reply: group 1 of the first match of ``pattern`` as a finite float, or None
    when nothing matches or the group is not a number (``"Score: 7"`` with ``Score: *(-?[0-9.]+)`` -> 7.0;
    ``"no idea"`` -> None)."""
    m = re.search(pattern, text)
    if m is None or m.group(1) is None:
        return None
    try:
        value = float(m.group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def judge_bodies(
    api: str, model: str, texts: Sequence[str], *, max_tokens: int, temperature: float, per_request: int
) -> list[dict[str, Any]]:
    """The judge's request bodies: one per text for ``chat``; ``per_request`` texts a body for
    ``completions``."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": temperature}
    if api == "chat":
        return [{**common, "messages": [{"role": "user", "content": t}]} for t in texts]
    return [{**common, "prompt": [texts[i] for i in part]} for part in _chunks(len(texts), per_request)]


def parse_judge_texts(api: str, n: int) -> Callable[[Any], list[str]]:
    """The reply check of a judge body of ``n`` texts: the ``n`` generated texts, in the body's order.

    The returned function raises :class:`ServiceFailure` ``("reply", why)`` for a reply that is not an
    OpenAI completion of that shape (a choice without text is ``""``: the judge said nothing, which scores
    as unparsed, not as a broken service)."""

    def parse(data: Any) -> list[str]:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) < n:
            raise ServiceFailure(
                "reply", f"expected an OpenAI completion with {n} choices, got {_short(data)}"
            )
        out = [""] * n
        for k, choice in enumerate(choices[:n] if api == "chat" else choices):
            if not isinstance(choice, dict):
                raise ServiceFailure("reply", f"choice {k} is {_short(choice)}, not an object")
            i = k if api == "chat" else choice.get("index", k)
            if not isinstance(i, int) or not 0 <= i < n:
                raise ServiceFailure("reply", f"choice {k} has index {i!r}, outside 0..{n - 1}")
            text = (choice.get("message") or {}).get("content") if api == "chat" else choice.get("text")
            out[i] = text if isinstance(text, str) else ""
        return out

    return parse
