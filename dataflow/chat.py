"""Chat templates: message-list fields rendered with the tokenizer's own template, into token ids and masks.

A tokenized data field whose values are message lists (``[{"role": "user", "content": "..."}, ...]``, the
conversational format of TRL and verl) is rendered with the tokenizer's chat template
(``tokenizer.apply_chat_template``) instead of being tokenized as plain text:

- ``prompt``: the messages with ``add_generation_prompt=True`` (the template's assistant header ends the
  prompt, so a sampler continues with the assistant's reply);
- any other tokenized field (``response``, ``chosen``, ``rejected``, ...): the messages continue the row's
  ``prompt`` conversation and must begin with the assistant's. Their tokens are those of the whole rendered
  conversation after the rendered prompt; the mask is 1 exactly on the assistant's tokens (each assistant
  message's content and the template's end-of-turn tokens after it) and 0 on the other roles' turns and on
  the assistant headers between them. No EOS is appended: the template's own end-of-turn tokens end a reply.

The text a template renders is tokenized with ``add_special_tokens=False``: the template writes its own
special tokens (a ``{{ bos_token }}`` of the template is the only BOS; the tokenizer adds no second one),
which is what ``apply_chat_template(..., tokenize=True)`` does. Each step of a conversation must render as
a token prefix of the next (true of templates whose turns end in special tokens); a template that rewrites
earlier turns (e.g. one dropping past reasoning) is refused with a :class:`DataError` naming the row.
A plain-string field is not touched here (:func:`rlflow.dataflow.data.make_batch` tokenizes it as before).

Sources: Hugging Face chat templates (``transformers`` ``apply_chat_template``); TRL's conversational
dataset format (prompt/completion, prompt/chosen/rejected) and completion-only loss; verl's prompt lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlflow.dataflow.errors import DataError

__all__ = [
    "ROLES",
    "check_conversations",
    "check_messages",
    "continuation_ids",
    "has_chat_template",
    "is_conversation_column",
    "prompt_ids",
]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (OpenAI's chat format, as TRL and verl read it)."""

Message = dict[str, Any]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has a chat template (``tokenizer.chat_template`` set, e.g. from its
    ``tokenizer_config.json`` or ``chat_template.jinja``)."""
    return bool(getattr(tokenizer, "chat_template", None))


def is_conversation_column(values: Sequence[Any], key: str) -> bool:
    """Whether the values of field ``key`` are message lists (then every row must be one).

    Raises:
        DataError: some rows hold lists and others do not (names the key and the first row of each kind).
    """
    lists = [isinstance(v, list | tuple) for v in values]
    if all(lists) and lists:
        return True
    if any(lists):
        i, j = lists.index(True), lists.index(False)
        raise DataError(
            f"data.fields.{key}: row {i} holds a message list but row {j} holds {values[j]!r}; a field is "
            "either text in every row or a list of {role, content} messages in every row"
        )
    return False


def _clean(message: Any, key: str, row: int, index: int) -> Message:
    """A message as a plain dict without the null keys a columnar reader adds (pyarrow gives every message
    of a column every key any message has), checked: ``role`` one of :data:`ROLES`, ``content`` a string."""
    where = f"data.fields.{key}: row {row}, message {index}"
    if not isinstance(message, Mapping):
        raise DataError(f"{where}: expected a {{role, content}} mapping, got {message!r}")
    out = {str(k): v for k, v in message.items() if v is not None or k in ("role", "content")}
    for name in ("role", "content"):
        if out.get(name) is None:
            raise DataError(f"{where}: no '{name}' (a message is {{role, content}}); got {message!r}")
    if out["role"] not in ROLES:
        raise DataError(f"{where}: unknown role {out['role']!r}; roles: {', '.join(ROLES)}")
    if not isinstance(out["content"], str):
        raise DataError(f"{where}: 'content' must be a string, got {out['content']!r}")
    return out


def check_messages(value: Any, key: str, row: int) -> list[Message]:
    """Row ``row`` of field ``key`` as a checked, non-empty message list (null keys dropped).

    Raises:
        DataError: not a list, an empty list, or a message without ``role``/``content``, with a role not in
            :data:`ROLES` or with non-string content (names the key, row and message).
    """
    if not isinstance(value, list | tuple):
        raise DataError(f"data.fields.{key}: row {row}: expected a list of messages, got {value!r}")
    if not value:
        raise DataError(f"data.fields.{key}: row {row}: the message list is empty")
    return [_clean(m, key, row, j) for j, m in enumerate(value)]


def _need_template(tokenizer: Any, key: str) -> None:
    if tokenizer is not None and has_chat_template(tokenizer):
        return
    name = getattr(tokenizer, "name_or_path", "") or "<tokenizer>"
    raise DataError(
        f"data.fields.{key} holds message lists, but the data tokenizer '{name}' (data.tokenizer) has no "
        "chat template to render them with; give it one ('chat_template' in its tokenizer_config.json, or a "
        "chat_template.jinja file in its directory) or write the field as plain text"
    )


def _render(tokenizer: Any, messages: list[Message], generation: bool, key: str, row: int) -> list[int]:
    """Token ids of ``messages`` as the template renders them (its special tokens only)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as e:  # the template's own checks (raise_exception) and jinja errors
        raise DataError(f"data.fields.{key}: row {row}: the chat template refuses it: {e}") from e
    return [int(t) for t in tokenizer(str(text), add_special_tokens=False)["input_ids"]]


def prompt_ids(tokenizer: Any, values: Sequence[Any], key: str = "prompt") -> list[list[int]]:
    """The token ids of each row's messages rendered with ``add_generation_prompt=True``.

    Raises:
        DataError: no chat template, a malformed message (:func:`check_messages`), or a template error.
    """
    _need_template(tokenizer, key)
    return [_render(tokenizer, check_messages(v, key, i), True, key, i) for i, v in enumerate(values)]


def _extend(ids: list[int], mask: list[int], longer: list[int], bit: int, key: str, row: int) -> None:
    if longer[: len(ids)] != ids:
        raise DataError(
            f"data.fields.{key}: row {row}: the chat template does not render the conversation so far as "
            "the start of the next turn's rendering (it rewrites earlier turns), so the reply's tokens "
            "cannot be told apart from the prompt's; rlflow cannot train on this template's conversations"
        )
    mask += [bit] * (len(longer) - len(ids))
    ids += longer[len(ids) :]


def continuation_ids(
    tokenizer: Any, prompts: Sequence[Any] | None, values: Sequence[Any], key: str
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids ``[row][token]`` of each row's reply messages ``values`` after its ``prompts`` messages
    (the rendering of ``prompt + reply`` less that of ``prompt`` with the generation prompt), and their
    masks: 1 on the assistant's tokens, 0 on other turns and the assistant headers between turns.

    Raises:
        DataError: no ``prompt`` message lists to continue, a reply not starting with an assistant message,
            a malformed message, no chat template, or a template that is not prefix-consistent.
    """
    _need_template(tokenizer, key)
    if prompts is None or len(prompts) != len(values):
        raise DataError(
            f"data.fields.{key} holds message lists, which continue the conversation of field 'prompt'; "
            "the data has no 'prompt' field (map one in data.fields)"
        )
    seqs: list[list[int]] = []
    masks: list[list[int]] = []
    for i, (prompt, value) in enumerate(zip(prompts, values, strict=True)):
        if not isinstance(prompt, list | tuple):
            raise DataError(
                f"data.fields.{key}: row {i} holds messages but its prompt is {prompt!r}: a reply given as "
                "messages needs the prompt as messages too"
            )
        conversation = check_messages(prompt, "prompt", i)
        reply = check_messages(value, key, i)
        if reply[0]["role"] != "assistant":
            raise DataError(
                f"data.fields.{key}: row {i}: the reply's first message has role {reply[0]['role']!r}; it "
                "must be the assistant's (the prompt ends where the assistant's turn starts)"
            )
        ids = _render(tokenizer, conversation, True, key, i)
        start = len(ids)
        mask = [0] * start
        for j, message in enumerate(reply):
            assistant = message["role"] == "assistant"
            if assistant and j > 0:  # the assistant header between turns: template, not trained
                _extend(ids, mask, _render(tokenizer, conversation, True, key, i), 0, key, i)
            conversation.append(message)
            _extend(ids, mask, _render(tokenizer, conversation, False, key, i), int(assistant), key, i)
        seqs.append(ids[start:])
        masks.append(mask[start:])
    return seqs, masks


def check_conversations(
    columns: Mapping[str, Sequence[Any]], tokenize: Sequence[str], tokenizer: Any, source: str
) -> None:
    """Check, over every row before anything starts, the tokenized fields given as message lists: each row
    a well-formed message list (:func:`check_messages`), a tokenizer with a chat template, and a reply field
    whose prompt is messages too and whose first message is the assistant's; and the template itself on the
    first row (it renders, and a reply's conversation renders prefix by prefix: :func:`continuation_ids`).

    Raises:
        DataError: the first mistake, prefixed with the data ``source`` (file or generator).
    """
    try:
        for key in tokenize:
            values = columns.get(key)
            if values is None or not is_conversation_column(values, key):
                continue
            _need_template(tokenizer, key)
            for i, value in enumerate(values):
                check_messages(value, key, i)
                if key == "prompt":
                    continue
                prompt = columns.get("prompt")
                if prompt is None or not isinstance(prompt[i], list | tuple):
                    raise DataError(
                        f"data.fields.{key}: row {i} holds messages, which continue the row's 'prompt' "
                        "conversation; give the prompt as messages too"
                    )
                if value[0].get("role") != "assistant":
                    raise DataError(
                        f"data.fields.{key}: row {i}: the reply's first message has role "
                        f"{value[0].get('role')!r}; it must be the assistant's"
                    )
            if key == "prompt":
                prompt_ids(tokenizer, values[:1])
            else:
                continuation_ids(tokenizer, columns["prompt"][:1], values[:1], key)
    except DataError as e:
        raise DataError(f"data '{source}': {e}") from None
