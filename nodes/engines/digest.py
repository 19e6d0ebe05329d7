"""Exact, layout-blind digests of weight tensors: proof that an engine holds the bytes it was sent.

A weight sync into a vLLM engine is verified by digests instead of a forward (the probe,
:mod:`rlflow.nodes.engines.probe`, runs once, on the engine's first reload): inside the engine's worker,
every parameter as vLLM holds it after its own name and layout mapping (fused ``qkv_proj``/``gate_up_proj``,
GPT-2's transposed ``Conv1D`` weights, a vocabulary padded with zero rows) is compared with the sum of the
digests of the sent tensors vLLM loaded into it (:class:`~rlflow.nodes.engines.vllm_worker.ReloadCheck`).

:func:`tensor_digest` is a pair of sums over a tensor's elements read as unsigned integers (their bits):
``(Σ u, Σ u²) mod 2³²``. Both are blind to the order of the elements and to zero elements, so the digest of a
concatenation, a transpose or a zero-padded copy is the sum of its parts' digests: vLLM's mapping needs no
re-implementation here. What that blindness cannot see (elements landing in the wrong place) is a property
of vLLM's mapping code, not of the values; the probe on the first reload checks it
(:meth:`~rlflow.nodes.engines.vllm_engine.VllmEngine.sync`).

False acceptance: a tensor whose bytes differ from what was sent passes only if both sums agree.
A change of one element is always caught (``Σ u`` moves by ``u' − u``, non-zero mod 2³² for distinct 32-bit
words); a change of two elements is caught unless it swaps them (``Σ u`` and ``Σ u²`` fix the pair). For an
unstructured change (stale weights, a garbled or partial copy) the two sums are independent 32-bit
residues and agree by chance with probability about 2⁻⁶⁴ per tensor. They are not a cryptographic hash:
a deliberate collision is easy to build, which a sync does not need to fear.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["CHUNK_ELEMENTS", "Digest", "add_digests", "digest_text", "tensor_digest"]

Digest = tuple[int, int]
"""``(Σ u mod 2³², Σ u² mod 2³²)`` over a tensor's elements read as unsigned integers
(:func:`tensor_digest`)."""

CHUNK_ELEMENTS = 1 << 16
"""Elements squared at a time on the CPU (a 256 KiB buffer that stays in cache, instead of a temporary the
size of the tensor)."""

_MASK = 0xFFFFFFFF
_UINT = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}


def tensor_digest(t: torch.Tensor) -> Digest:
    """The digest of ``t``'s elements (any shape, strides, device or dtype): ``(Σ u, Σ u²) mod 2³²`` where
    ``u`` is each element's bits as an unsigned integer (1-, 2- and 4-byte dtypes; an 8-byte element counts
    as its two 4-byte words). Order-blind and zero-blind: ``tensor_digest(cat(a, b)) ==
    add_digests([tensor_digest(a), tensor_digest(b)])``, and a transpose or zero padding leaves it as it is.

    Cost: one pass over the tensor; on the CPU ≈ 0.3 s per 10⁸ elements on one core (numpy, chunked).
    """
    t = t.detach()
    size = t.element_size()
    if size == 8:
        t = t.contiguous().view(torch.int32)
        size = 4
    if t.device.type != "cpu":
        return _torch_digest(t.view(_UINT[size][0]))
    words = t.view(_UINT[size][0]).numpy().view(_UINT[size][1]) if t.numel() else np.zeros(0, np.uint32)
    flat = np.ravel(words, order="K")  # memory order: a view for any permutation of a dense tensor
    s1 = int(np.add.reduce(flat, dtype=np.uint32))
    s2 = 0
    buf = np.empty(min(CHUNK_ELEMENTS, flat.size), dtype=np.uint32)
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        part = flat[start : start + CHUNK_ELEMENTS]
        out = buf[: part.size]
        np.multiply(part, part, out=out, dtype=np.uint32)
        s2 += int(np.add.reduce(out, dtype=np.uint32))
    return s1 & _MASK, s2 & _MASK


def _torch_digest(words: torch.Tensor) -> Digest:
    """:func:`tensor_digest` on an accelerator: int64 arithmetic (wrapping mod 2⁶⁴, a multiple of 2³²)."""
    mask = {torch.uint8: 0xFF, torch.int16: 0xFFFF, torch.int32: _MASK}[words.dtype]
    u = words.reshape(-1).to(torch.int64) & mask
    return int(u.sum()) & _MASK, int((u * u).sum()) & _MASK


def add_digests(digests: Iterable[Digest]) -> Digest:
    """The digest of the concatenation of tensors with these digests (componentwise sum mod 2³²)."""
    s1 = s2 = 0
    for a, b in digests:
        s1, s2 = s1 + a, s2 + b
    return s1 & _MASK, s2 & _MASK


def digest_text(d: Digest) -> str:
    """A digest as 16 hex digits (for error messages)."""
    return f"{d[0]:08x}{d[1]:08x}"
