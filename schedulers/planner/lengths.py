"""The generation length model: how many decode steps a batch takes when responses end early.

A generate call runs until its longest row ends (or ``max_new_tokens``), so its decode steps are the
*maximum* of its rows' response lengths, not their mean; with many rows the longest sits near the cap.
Model: each response length is ``min(X, G)`` with ``X`` exponential (rate ``λ``) and ``G`` the node's
``max_new_tokens`` — the capped exponential, whose mean is ``(1 − e^{−λG}) / λ``; the data's (or a
profile's) mean response length ``μ`` fixes ``λ``. ``μ ≥ G`` means every response runs to the cap
(``λ = 0``: the model without early ends). The expected longest of ``n`` independent rows is
``E[max] = ∫₀^G 1 − (1 − e^{−λx})ⁿ dx`` (the tail integral of the maximum's distribution, whose CDF is
``F(x)ⁿ``); uncapped it is ``μ · Hₙ`` (Hₙ the harmonic number, Rényi's representation of exponential
order statistics). The exponential tail is an assumption of this model, not a measurement: its tail is
heavier than a normal's and lighter than the long tails reasoning models show (a profile of the data
set's lengths would replace it).

A node whose rows are split over ``d`` replicas (data-parallel ranks, each generating its ``b`` rows in
``m`` calls one after another) ends when its slowest replica does: the node's decode steps are the
replicas' *maximum* of their calls' summed longest rows. Its expectation is at least
``(m − 1)·E[max of b] + E[max of d·b]`` (:func:`slowest_replica_steps`: the first ``m − 1`` calls at their
mean, the last call the longest over every replica's last call, i.e. of ``d·b`` rows), exact for ``m = 1``
(the maximum over replicas of each one's longest row is the longest of all ``d·b`` rows) and what a
work-balancing generator reaches (a replica that ends early takes more rows: NeMo-Aligner's
``batch_iterator.use_flask``); the variance of the first ``m − 1`` calls' sum is left out. At scale this
is what keeps a generation from shrinking with the replicas: fewer rows per replica shorten each
replica's expected longest row, but not the longest of the node's rows, which its span waits for.

Packed micro-batches (a node's ``max_tokens_per_micro_batch``) compute each row's real tokens and, per
sequence, attention over its own length; their price needs the second moment of a response,
``E[min(X, G)²] = ∫₀^G 2x·P(X > x) dx = (2/λ²)·(1 − e^{−λG}·(1 + λG))`` (the tail integral of ``X²``),
``G²`` at ``λ = 0``.

A decode loop that drops finished rows from its forwards (the built-in loop's compaction) computes, at
step ``s``, only the rows still generating. Over a call of ``b`` rows that lasts until the longest of
``r ≥ b`` rows ends (``r = b``, or ``d·b`` for the last call of the slowest replica), the expected seconds
of its decode steps are ``∫₁^G P(max of r > s) · step(live(s), s) ds`` (:func:`compacted_decode_s`): a step
``s`` happens with the probability that the call lasts that long, and then runs
``live(s) = b·P(X > s) / P(max of b > s)`` rows — the expected survivors among the call's own rows given
that one of them is still going (≥ 1; ``b·e^{−λs}`` early on, one row in the tail). Integrated, the steps
number about ``E[max of r] − 1`` and the row-steps ``b·E[min(X, G) − 1]``, as the loop does (a continuous
length model of whole tokens: off by under a step). The first token comes from
the prefill (the integral starts at ``s = 1``).

Interruptible generation (a generate node's ``interrupt_every: S``, ``rlflow.nodes.partial``) cuts an
iteration's responses into ``J = ⌈G / S⌉`` segments, each its own call: segment ``j`` resubmits every row
still going after ``j·S`` tokens (prompt and tokens so far, prefilled again under the newer weights) for at
most ``S_j = min(S, G − j·S)`` more tokens. Its rows are the ``P(X > j·S) = e^{−λ·j·S}`` share of the
node's (:func:`survival`) and, the exponential being memoryless, what each samples in the segment is again
``min(X, S_j)`` with the same rate: a call of mean ``(1 − e^{−λ·S_j}) / λ`` capped at ``S_j``
(:func:`segment_mean`). A segment call runs until its longest row ends or fills the segment, so over ``r``
rows its steps are ``∫_{jS}^{jS+S_j} P(max of r > x) dx`` (:func:`window_longest`; ``r`` the node's rows
counted from the iteration's start): summed over the segments, exactly the whole call's ``E[max of r]``.
The rows running at each token ``s`` are the same rows as in one uninterrupted call, so a compacting
loop's decode seconds are :func:`compacted_decode_s` over each segment's window, less the segment's first
token, which its prefill gives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

__all__ = [
    "capped_exponential_rate",
    "compacted_decode_s",
    "expected_longest",
    "expected_square",
    "segment_mean",
    "slowest_replica_steps",
    "survival",
    "window_longest",
]

_POINTS = 256  # Simpson panels of the E[max] integral (even)


@lru_cache(maxsize=4096)
def capped_exponential_rate(mean: float, cap: float) -> float:
    """The rate ``λ`` (per token) of the exponential whose values capped at ``cap`` average ``mean``
    tokens; 0 when ``mean >= cap`` (every response runs to the cap).

    Raises:
        ValueError: ``mean`` or ``cap`` not positive.
    """
    if mean <= 0 or cap <= 0:
        raise ValueError(f"mean ({mean}) and cap ({cap}) must be positive")
    if mean >= cap:
        return 0.0

    def capped_mean(rate: float) -> float:
        return -math.expm1(-rate * cap) / rate

    lo, hi = 1e-12 / cap, 1.0 / mean  # capped_mean(hi) < mean: the uncapped mean is already 1/rate
    for _ in range(200):  # bisection: capped_mean falls from cap (rate → 0) to 0
        mid = math.sqrt(lo * hi)
        if capped_mean(mid) > mean:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-12:
            break
    return math.sqrt(lo * hi)


@lru_cache(maxsize=4096)
def expected_longest(mean: float, cap: float, rows: float) -> float:
    """Expected longest of ``rows`` responses (tokens) of mean ``mean`` capped at ``cap`` (module
    docstring); ``cap`` when ``mean >= cap``, ``mean`` for one row. Fractional ``rows`` (an average
    micro-batch) are used as they are.

    Raises:
        ValueError: ``mean`` or ``cap`` not positive, or ``rows`` below 1.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    rate = capped_exponential_rate(mean, cap)
    if rate == 0.0:
        return float(cap)
    # beyond ``upper`` P(max > x) < rows · e^(−40): integrate where the mass is (a cap far in the tail)
    upper = min(float(cap), (math.log(rows) + 40.0) / rate)
    step = upper / _POINTS

    def survival(x: float) -> float:  # P(max > x)
        return 1.0 - (-math.expm1(-rate * x)) ** rows

    total = survival(0.0) + survival(upper)
    for i in range(1, _POINTS):
        total += (4 if i % 2 else 2) * survival(i * step)
    return total * step / 3


@lru_cache(maxsize=4096)
def expected_square(mean: float, cap: float) -> float:
    """Expected square (tokens²) of one response of mean ``mean`` capped at ``cap`` (module docstring):
    ``(2/λ²)·(1 − e^{−λG}·(1 + λG))``; ``cap²`` when ``mean >= cap``. At least ``mean²`` (Jensen).

    Raises:
        ValueError: ``mean`` or ``cap`` not positive.
    """
    rate = capped_exponential_rate(mean, cap)
    if rate == 0.0:
        return float(cap) * cap
    y = rate * cap
    # 1 − e^{−y}(1 + y), by its series where the difference would cancel (y < 1e-3: error < y⁵/30)
    tail = y * y / 2 - y**3 / 3 + y**4 / 8 if y < 1e-3 else -math.expm1(-y) - y * math.exp(-y)
    return 2.0 * tail / (rate * rate)


def slowest_replica_steps(mean: float, cap: float, rows: float, replicas: int, calls: int = 1) -> float:
    """Expected decode tokens of a node's slowest replica (module docstring): ``replicas`` replicas each
    generate ``calls`` calls of ``rows`` rows one after another; ``(calls − 1)·E[max of rows] + E[max of
    replicas·rows]`` (tokens, each call's longest row capped at ``cap``).

    Raises:
        ValueError: ``mean`` or ``cap`` not positive, ``rows`` below 1, ``replicas`` or ``calls`` below 1.
    """
    if replicas < 1 or calls < 1:
        raise ValueError(f"replicas ({replicas}) and calls ({calls}) must be >= 1")
    each = expected_longest(mean, cap, rows)
    return (calls - 1) * each + expected_longest(mean, cap, rows * replicas)


def survival(mean: float, cap: float, tokens: float) -> float:
    """``P(min(X, G) > tokens)``: the share of responses of mean ``mean`` capped at ``cap`` still going
    after ``tokens`` tokens, ``e^{−λ·tokens}`` below the cap, 0 at it (1 below it when ``mean >= cap``).

    Raises:
        ValueError: ``mean`` or ``cap`` not positive.
    """
    if tokens >= cap:
        return 0.0
    return math.exp(-capped_exponential_rate(mean, cap) * max(tokens, 0.0))


def segment_mean(mean: float, cap: float, budget: float) -> float:
    """Mean tokens a response still going samples in a segment of at most ``budget`` tokens (module
    docstring, interruptible generation): ``(1 − e^{−λ·budget}) / λ``, the rate ``λ`` of responses of
    mean ``mean`` capped at ``cap`` (memoryless); ``budget`` when ``mean >= cap``.

    Raises:
        ValueError: ``mean``, ``cap`` or ``budget`` not positive.
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    rate = capped_exponential_rate(mean, cap)
    return float(budget) if rate == 0.0 else -math.expm1(-rate * budget) / rate


def window_longest(mean: float, cap: float, rows: float, lo: float, hi: float) -> float:
    """Expected tokens the longest of ``rows`` responses (mean ``mean``, capped at ``cap``) spends between
    ``lo`` and ``hi`` tokens: ``∫_lo^hi P(max of rows > x) dx`` (Simpson, 64 panels; the module docstring's
    segment steps). Over ``[0, cap]`` it is :func:`expected_longest`.

    Raises:
        ValueError: ``mean`` or ``cap`` not positive, ``rows`` below 1.
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    rate = capped_exponential_rate(mean, cap)
    hi = min(float(hi), float(cap))
    if hi <= lo:
        return 0.0
    if rate == 0.0:
        return hi - lo
    panels = 64
    step = (hi - lo) / panels

    def above(x: float) -> float:  # P(max > x)
        return 1.0 - (-math.expm1(-rate * x)) ** rows

    total = above(lo) + above(hi)
    for i in range(1, panels):
        total += (4 if i % 2 else 2) * above(lo + i * step)
    return total * step / 3


def compacted_decode_s(
    mean: float,
    cap: float,
    rows: float,
    waited: float,
    step_s: Callable[[float, float], float],
    lo: float = 0.0,
    hi: float | None = None,
) -> float:
    """Expected seconds of the decode steps of one call of ``rows`` rows on a loop that drops finished
    rows, the call lasting until the longest of ``waited`` (>= ``rows``) rows ends (module docstring):
    ``∫₁^G P(max of waited > s) · step_s(live(s), s) ds`` by Simpson's rule over 32 panels, ``step_s(live,
    s)`` the seconds of a step of ``live`` rows (fractional: an expectation) at ``s`` tokens into the
    response. At ``mean >= cap`` (no early ends) every step runs all ``rows``. ``lo``, ``hi``: the tokens
    of one segment of an interrupted call (module docstring), whose steps are those from ``lo + 1`` (its
    prefill gives token ``lo + 1``) to ``hi``; rows and ``s`` still counted from the response's start.

    Raises:
        ValueError: ``mean`` or ``cap`` not positive, ``rows`` below 1 or ``waited`` below ``rows``.
    """
    if rows < 1 or waited < rows:
        raise ValueError(f"need 1 <= rows ({rows}) <= waited ({waited})")
    rate = capped_exponential_rate(mean, cap)
    # beyond ``upper`` the call goes on with probability < e^(−16) ≈ 1e-7 (P(max > s) ≤ waited · e^(−λs))
    upper = float(cap) if rate == 0.0 else min(float(cap), (math.log(waited) + 16.0) / rate)
    upper = upper if hi is None else min(upper, float(hi))
    first = lo + 1.0
    if upper <= first:
        return 0.0
    panels = 32
    step = (upper - first) / panels

    def term(s: float) -> float:
        alive = math.exp(-rate * s)  # P(X > s), below the cap
        goes_on = 1.0 - (1.0 - alive) ** waited  # P(max of waited > s)
        own = 1.0 - (1.0 - alive) ** rows
        live = rows * alive / own if own > 0.0 else 1.0
        return goes_on * step_s(max(live, 1.0), s) if goes_on > 0.0 else 0.0

    total = term(first) + term(upper)
    for i in range(1, panels):
        total += (4 if i % 2 else 2) * term(first + i * step)
    return total * step / 3
