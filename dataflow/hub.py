"""Models and tokenizers named by Hugging Face Hub id: the local directory each such name stands for.

A graph file names a model's weights (``models.<m>.path``) and its tokenizer (``models.<m>.tokenizer``; the
data's, ``data.tokenizer``, is a model's) by a local directory or by a Hub id (``Qwen/Qwen3-0.6B``,
``gpt2``), with an optional revision (a branch, tag or commit): ``models.<m>.revision`` for the path, or
``<id>@<revision>`` in either key. The rule, for each string:

1. it names an existing directory (relative to the working directory): that directory;
2. else it is a valid Hub id (``huggingface_hub.utils.validate_repo_id``; ``@<revision>`` split off first):
   the directory of its snapshot in the Hugging Face cache, from ``huggingface_hub.snapshot_download``,
   which downloads it unless the Hub is offline (``HF_HUB_OFFLINE=1`` or ``TRANSFORMERS_OFFLINE=1``: the
   cache alone is read, ``local_files_only``). The cache is the library's (``HF_HOME``/``hub``, or
   ``HF_HUB_CACHE``, which is read from the environment when resolving, not only at the library's import);
3. else it is left as written, and the checks that report a missing directory (``rlflow validate``, model
   and tokenizer loading) name it.

:func:`resolve_hub_models` applies the rule to a whole :class:`~rlflow.dataflow.spec.GraphSpec` once, when
the graph is loaded (:func:`rlflow.dataflow.loader.load_graph`), before anything is planned, built or
started; the spec it returns holds directories only (a Hub id's ``revision`` is dropped: the snapshot's
directory, ``.../models--<org>--<name>/snapshots/<commit>``, names the commit), so every reader of a model or
tokenizer directory (model building, tokenizers, vLLM, workers, the planner, a checkpoint's record of the
graph) reads the snapshot, whoever reads it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from rlflow.dataflow.errors import GraphError, ModelError
from rlflow.dataflow.spec import GraphSpec

__all__ = ["HubRef", "hub_ref", "resolve_hub_dir", "resolve_hub_models"]

DEFAULT_REVISION = "main"
_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's truth values of an environment flag


class HubRef(NamedTuple):
    """A Hub id (``org/name`` or ``name``) and its revision (``None``: the default branch, ``main``)."""

    repo_id: str
    revision: str | None


def hub_ref(text: str) -> HubRef | None:
    """``text`` read as a Hub id with an optional ``@<revision>``; ``None`` when it is not one (a path with
    more than one ``/``, an absolute or dotted path, characters a repository name cannot hold). Whether a
    directory of that name exists is not looked at here."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id, at, revision = text.partition("@")
    if at and not revision:
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubRef(repo_id, revision or None)


def _offline() -> bool:
    """The Hub is offline: ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` as the environment holds them now,
    or as ``huggingface_hub`` read them at its import."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any((f or "").upper() in _TRUE for f in flags) or bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str | None:
    """``HF_HUB_CACHE`` as the environment holds it now; ``None``: unset, the library's own cache
    (``huggingface_hub.constants.HF_HUB_CACHE``: ``HF_HOME``/``hub`` as read at its import)."""
    cache = os.environ.get("HF_HUB_CACHE")
    return os.path.expanduser(cache) if cache else None


def _is_dir(text: str) -> bool:
    """``text`` names an existing directory; ``False`` for a name the OS refuses (too long, ...)."""
    try:
        return Path(text).is_dir()
    except (OSError, ValueError):
        return False


def resolve_hub_dir(text: str, where: str, revision: str | None = None) -> str:
    """The local directory ``text`` names (the rule of this module's docstring): ``text`` itself when it is
    an existing directory or not a Hub id, else the directory of the Hub id's snapshot in the cache.

    Args:
        text: a directory, or a Hub id (``org/name``, ``name``) with an optional ``@<revision>``.
        where: ``"<graph file>: <key>"``, the start of every message (``ppo.yaml: models.actor.path``).
        revision: the revision given apart (``models.<m>.revision``); ``None``: the one in ``text``, else
            ``main``.

    Raises:
        GraphError: a ``revision`` with a local directory or a string that is not a Hub id, or with an
            ``@<revision>`` in ``text`` too.
        ModelError: the Hub id does not resolve: not in the cache while offline or the Hub unreachable, no
            such repository or revision on the Hub, a gated or private one without access, an incomplete
            snapshot. One line, naming the id, its revision and how to get it.
    """
    if _is_dir(text):
        if revision is not None:
            raise GraphError(
                f"{where}: '{text}' is a local directory, so a revision ({revision!r}) picks nothing; drop "
                "the revision, or name a Hub id"
            )
        return text
    ref = hub_ref(text)
    if ref is None:
        if revision is not None:
            raise GraphError(
                f"{where}: '{text}' is neither a local directory nor a Hub id (org/name), so a revision "
                f"({revision!r}) picks nothing"
            )
        return text
    if revision is not None and ref.revision is not None:
        raise GraphError(
            f"{where}: '{text}' names revision {ref.revision!r} and the model's 'revision' says "
            f"{revision!r}; give it once"
        )
    return _snapshot(text, ref.repo_id, revision or ref.revision or DEFAULT_REVISION, where)


def _snapshot(text: str, repo_id: str, revision: str, where: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = _cache_dir()
    offline = _offline()
    get = (
        f"download it on a machine with network (`hf download {repo_id} --revision {revision}`) and point "
        "HF_HUB_CACHE at a cache holding it"
    )
    lead = (
        f"{where}: '{text}' is not a local directory (relative to {Path.cwd()}), so it is read as a Hub id; "
        f"Hub model '{repo_id}' (revision {revision})"
    )
    try:
        return str(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline))
    except LocalEntryNotFoundError as e:  # not in the cache, and offline or the Hub unreachable
        reason = (
            "the Hub is offline (HF_HUB_OFFLINE=1)" if offline else f"the Hub cannot be reached ({_first(e)})"
        )
        raise ModelError(
            f"{lead} is not in the Hugging Face cache {cache or constants.HF_HUB_CACHE} and {reason}; {get}"
        ) from None
    except GatedRepoError:
        raise ModelError(
            f"{lead} is gated: accept its terms on the Hub and log in (`hf auth login`, or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{lead} does not exist on the Hub (or is private: log in with `hf auth login`, or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelError(f"{lead} does not exist: the Hub has no such revision of '{repo_id}'") from None
    except Exception as e:  # an incomplete cached snapshot, an HTTP error, a full disk: one line, the cause
        raise ModelError(f"{lead} cannot be fetched: {type(e).__name__}: {_first(e)}") from e


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def resolve_hub_models(spec: GraphSpec) -> GraphSpec:
    """``spec`` with every Hub id of ``models.<m>.path`` and ``models.<m>.tokenizer`` replaced by its
    snapshot's directory (:func:`resolve_hub_dir`) and each resolved
    model's ``revision`` dropped; ``spec`` itself when it names no Hub id. Each id and revision is resolved
    once.

    Raises:
        GraphError, ModelError: as :func:`resolve_hub_dir`, the message starting ``<graph file>: <key>``.
    """
    source = spec.source or "<graph>"
    seen: dict[tuple[str, str | None], str] = {}

    def resolve(text: str | None, key: str, revision: str | None = None) -> str | None:
        if text is None:
            return None
        if (text, revision) not in seen:
            seen[text, revision] = resolve_hub_dir(text, f"{source}: {key}", revision)
        return seen[text, revision]

    models = {}
    for name, m in spec.models.items():
        key = f"models.{name}.path" if m.revision is None else f"models.{name}.path/revision"
        path = resolve(m.path, key, m.revision)
        tokenizer = resolve(m.tokenizer, f"models.{name}.tokenizer")
        if (path, tokenizer, None) != (m.path, m.tokenizer, m.revision):
            m = replace(m, path=path, tokenizer=tokenizer, revision=None)
        models[name] = m
    return spec if models == spec.models else replace(spec, models=models)
