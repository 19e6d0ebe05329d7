"""Build, under OUT, what examples/hub/grpo_chat.yaml reads, with no network and no Hub.

- ``OUT/hf``: a Hugging Face cache (``HF_HUB_CACHE``) laid out as ``huggingface_hub`` writes one, holding
  the model :data:`REPO_ID` at ``refs/main``: a tiny randomly initialised Llama and its tokenizer, the
  arithmetic tokenizer of ``examples/arith/tokenizer`` with four role tokens (``<|system|>``, ``<|user|>``,
  ``<|assistant|>``, ``<|tool|>``) and a chat template (:data:`CHAT_TEMPLATE`), the model's vocabulary sized
  to it (23 ids);
- ``OUT/arith_chat``: the arithmetic problems (1-digit ``+`` and ``-``, the ``arith`` generator's rows) as a
  ``datasets.DatasetDict`` written with ``save_to_disk``, splits ``train`` and ``test``, each row
  ``{"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}``.

Run: ``python examples/hub/make_local_hub.py OUT``, then ``HF_HUB_CACHE=OUT/hf HF_HUB_OFFLINE=1 rlflow run
examples/hub/grpo_chat.yaml`` (the graph reads the data set at ``out/hub/arith_chat``: OUT is ``out/hub``).

:func:`write_snapshot` is the one function that lays a local model directory into a cache as a Hub
snapshot (``tests/test_hub_models.py`` builds its caches with it too).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ID = "rlflow/arith-chat-tiny"
"""The Hub id examples/hub/grpo_chat.yaml names (``models.actor.path``); it exists in the local cache only."""

ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Each turn ``<|role|>content<eos>`` after one ``<bos>``; the generation prompt ``<|assistant|>``. A turn
ends with the tokenizer's EOS, so generation stops where the template ends the assistant's turn."""

# The tiny Llama of examples/grpo.yaml (0.1 M weights); vocab_size is the tokenizer's length.
MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 64,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
}  # fmt: skip

# The data set: every 1-digit + and - problem without a negative answer (155), 30 held out.
PROBLEMS = {"digits": 1, "ops": "+-", "train_size": 125, "eval_size": 30, "seed": 0}


def chat_tokenizer() -> Any:
    """The arithmetic tokenizer with :data:`ROLE_TOKENS` as special tokens and :data:`CHAT_TEMPLATE` (a
    ``transformers`` fast tokenizer, 23 ids: the 19 of ``examples/arith/tokenizer``, then the roles)."""
    from rlflow.nodes.tasks.arith_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_snapshot(
    cache: str | Path, repo_id: str, folder: str | Path, ref: str = "main", commit: str | None = None
) -> Path:
    """Lay the files of ``folder`` into the Hugging Face cache ``cache`` as a snapshot of model ``repo_id``
    that ``refs/<ref>`` names, the way ``huggingface_hub`` writes one (``models--<org>--<name>/`` holding
    ``blobs/<sha256>``, one per file, ``snapshots/<commit>/<file>`` a relative link to its blob and
    ``refs/<ref>`` the commit), so ``huggingface_hub.snapshot_download(repo_id, revision=ref)`` finds it
    offline.

    ``commit``: the snapshot's commit hash (40 hex digits); default one derived from the files' names and
    contents (the same folder, the same commit). Returns the snapshot's directory.
    """
    cache, folder = Path(cache), Path(folder)
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in folder.iterdir() if p.is_file())
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    if commit is None:
        commit = hashlib.sha1("".join(f"{n}\0{d}\n" for n, d in digests.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in files:
        blob = repo / "blobs" / digests[file.name]
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = snapshot / file.name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def write_model(cache: str | Path, repo_id: str = REPO_ID, seed: int = 0) -> Path:
    """The tiny Llama (:data:`MODEL_CONFIG`, weights from ``seed``) and :func:`chat_tokenizer` written as
    ``repo_id``'s ``main`` in the cache ``cache``; the snapshot's directory."""
    from rlflow.nodes.models import build_model, save_pretrained
    from rlflow.nodes.tasks.hf_tokenizer import save_tokenizer_dir

    tokenizer = chat_tokenizer()
    config = {**MODEL_CONFIG, "vocab_size": len(tokenizer)}
    with tempfile.TemporaryDirectory() as staged:
        save_pretrained(build_model(config=config, seed=seed), None, staged)
        save_tokenizer_dir(tokenizer, staged)
        return write_snapshot(cache, repo_id, staged)


def write_dataset(out: str | Path) -> Path:
    """The arithmetic problems (:data:`PROBLEMS`) with message-list prompts, saved with ``save_to_disk``
    at ``out`` as splits ``train`` and ``test``; returns ``out``."""
    from datasets import Dataset, DatasetDict, disable_progress_bars

    from rlflow.nodes.tasks.arith import arith

    def rows(split: str) -> Dataset:
        problems = arith(split, **PROBLEMS)
        return Dataset.from_list(
            [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in problems]
        )

    disable_progress_bars()
    DatasetDict({"train": rows("train"), "test": rows("eval")}).save_to_disk(str(out))
    return Path(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {Path(argv[0]).name} OUT  (writes OUT/hf, a Hugging Face cache, and OUT/arith_chat)")
        return 2
    out = Path(argv[1])
    snapshot = write_model(out / "hf")
    print(f"wrote model {REPO_ID} at {snapshot}")
    print(f"wrote data set {write_dataset(out / 'arith_chat')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
