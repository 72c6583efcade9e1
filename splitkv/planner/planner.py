"""Choosing a plan: enumerate decompositions, predict each with the cost model, keep the cheapest.

Candidates (each a way to cut every request's KV into chunks):
  no split          one chunk per request, strategy 'single'.
  chunk tokens c    one chunk size for the whole batch (FlashInfer's idea): request b gets
                    ceil(len_b / c) near-equal chunks, so long requests get more chunks and
                    work items stay within ~2x of each other across a ragged batch. c runs
                    over powers of two from 64 tokens (one tile), 16 and 32 for tiny
                    contexts, and the multiples of 64 that fill 1..4 whole waves.
  num splits s      every request cut into s chunks (vLLM's fixed split), for s that fill
                    whole waves of the GPU (FlashAttention's heuristic) and a few small ones.
Every split candidate is tried with 'split_merge' and with 'fused'.

Planning runs on every decode step, so it is cheap: the statistics the features need are
computed for all candidates at once from the ``kv_lens`` array (a [candidates x requests]
array, never a per-chunk one), and only the winner is built as a ``Plan``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .. import validation as V
from ..plan import Plan, plan_chunk_tokens, plan_fixed_splits, plan_from_chunk_counts
from ..problem import DecodeProblem
from .cost_model import HEAD_TILE, STAT_NAMES, TILE_TOKENS, CostModel, features_from_stats

NO_SPLIT, CHUNK_TOKENS, NUM_SPLITS = "no split", "chunk tokens", "num splits"
TINY_CONTEXT = 2048        # up to this longest request, 16- and 32-token chunks are tried too
MAX_WAVES = 32


def max_useful_items(slots: int) -> int:
    """Work items beyond which a finer cut cannot pay: with W full waves, the wave tail that
    better balance removes is at most 1/W of the time, while every extra CTA adds a start-up
    and every extra chunk its partials. At 32 waves (8,448 CTAs on an H200) that is 3%."""
    return MAX_WAVES * slots


def chunk_token_candidates(max_len: int, total_tokens: int, items_per_chunk: int,
                           batch_size: int, slots: int) -> list[int]:
    """Chunk sizes worth trying, largest first: powers of two of tokens that split the longest
    request, from one 64-token tile (16 and 32 too when contexts are tiny), dropping sizes
    whose cut would exceed ``max_useful_items`` (the largest size is always kept).

    Example: 256 requests of ~17k tokens, 8 kv heads, 264 slots: a 4096-token chunk makes at
    least 4.4M / 4096 x 8 = 8,500 CTAs, past 32 waves, so 8192 and 16384 are tried.
    """
    smallest = 16 if max_len <= TINY_CONTEXT else TILE_TOKENS
    limit = max_useful_items(slots)
    sizes = []
    c = 1 << (max(max_len - 1, 1).bit_length() - 1)       # largest power of two < max_len
    while c >= smallest:
        if sizes and max(batch_size, total_tokens / c) * items_per_chunk > limit:
            break
        sizes.append(c)
        c //= 2
    return sizes


def wave_filling_chunk_tokens(total_tokens: int, batch_size: int, items_per_chunk: int,
                              slots: int, max_len: int, max_waves: int = 4) -> list[int]:
    """Chunk sizes (multiples of 64 tokens) that fill about j whole waves, j = 1..max_waves:
    FlashInfer's rule (the smallest chunk whose sum of ceil(len / chunk) x kv heads fits the
    grid) in closed form, counting half a chunk of waste per request.

    Worked example, ANCHORS.md's ragged_b32 (103,044 tokens in 32 requests, 8 kv heads, 264
    slots): 2 waves hold 66 chunks; 66 - 32 / 2 = 50 chunks of 103044 / 50 = 2061 -> 2112
    tokens; 3 waves: 1280 tokens; 4 waves: 896. Powers of two would jump from 1024 (about
    123 chunks, 3.7 waves) to 2048 (about 65 chunks, just under 2 waves).
    """
    sizes = set()
    for j in range(1, max_waves + 1):
        chunks = j * slots // items_per_chunk - batch_size / 2
        if chunks > 0:
            c = -(-int(total_tokens / chunks) // TILE_TOKENS) * TILE_TOKENS
            if TILE_TOKENS <= c < max_len:
                sizes.add(c)
    return sorted(sizes, reverse=True)


def wave_filling_splits(num_items: int, slots: int, max_waves: int = 4) -> list[int]:
    """Split counts that make whole waves: the largest s with num_items * s <= j * slots, for
    j = 1..max_waves, plus 2, 3 and 4; only counts above 1, ascending, within
    ``max_useful_items``.

    Worked example (H200, 264 slots): one request with 8 kv heads (8 items unsplit) fills one
    wave at s = 33 (264 items) and two at s = 66; s = 34 would start a second wave for 8 items
    and cost nearly twice as much. 32 requests x 8 kv heads = 256 items: s = 2 gives 512 items
    in 2 waves (97% full), s = 3 gives 768 in 3 waves.
    """
    if num_items <= 0:
        return []
    fills = {(j * slots) // num_items for j in range(1, max_waves + 1)} | {2, 3, 4}
    return sorted(s for s in fills if s > 1 and s * num_items <= max_useful_items(slots))


@dataclass(frozen=True)
class Candidate:
    """One decomposition and strategy, with its predicted time."""

    kind: str               # NO_SPLIT, CHUNK_TOKENS or NUM_SPLITS
    value: int              # chunk tokens, or num splits; 1 for NO_SPLIT
    strategy: str
    predicted_us: float | None = None

    def build(self, problem: DecodeProblem) -> Plan:
        if self.kind == NO_SPLIT:
            plan = plan_from_chunk_counts(problem, np.ones(problem.batch_size, np.int64),
                                          self.strategy)
        elif self.kind == CHUNK_TOKENS:
            plan = plan_chunk_tokens(problem, self.value, self.strategy,
                                     align=min(self.value, TILE_TOKENS))
        else:
            plan = plan_fixed_splits(problem, self.value, self.strategy, align=TILE_TOKENS)
        return plan if self.predicted_us is None else plan.with_prediction(self.predicted_us)

    @property
    def label(self) -> str:
        """'no split', or e.g. 'chunk tokens 1024 fused'; ``from_label`` reads it back."""
        return NO_SPLIT if self.kind == NO_SPLIT else f"{self.kind} {self.value} {self.strategy}"

    @classmethod
    def from_label(cls, label: str) -> "Candidate":
        if label == NO_SPLIT:
            return cls(NO_SPLIT, 1, "single")
        *kind, value, strategy = label.split()
        kind = " ".join(kind)
        if kind not in (CHUNK_TOKENS, NUM_SPLITS) or not value.isdigit():
            raise ValueError(f"label: expected 'no split' or '<chunk tokens|num splits> N "
                             f"<strategy>', got {label!r}")
        return cls(kind, int(value), V.check_strategy(strategy))

    def __str__(self) -> str:
        what = self.kind if self.kind == NO_SPLIT else f"{self.kind} {self.value}"
        pred = "n/a" if self.predicted_us is None else f"{self.predicted_us:9.2f} us"
        return f"{what:<18} {self.strategy:<12} {pred}"


NO_SPLIT_CHUNK = float(2 ** 60)     # a chunk size no request reaches: one chunk each


def _row_stats(lens: np.ndarray, copies: int, max_len: float, total: float, chunk: np.ndarray,
               cap: np.ndarray, tiny) -> np.ndarray:
    """``STAT_NAMES`` of every candidate row, [7, rows], in closed form from the lengths.

    Rows aligned to the 64-token tile (plan_from_chunk_counts with align 64) come first:
    request b gets k = min(ceil(len_b / chunk), cap) chunks, with chunk = 2**60 for no split,
    the chunk size and cap = inf for a chunk-size row, chunk = 64 and cap = s for s splits
    (s chunks, fewer for a request of fewer tiles); an empty request is one empty chunk.
    Then one row per chunk size in ``tiny`` (16 or 32 tokens, aligned to itself).

    ``lens`` (float) holds each request once, or one request standing for ``copies`` equal
    ones; ``max_len`` and ``total`` are the batch's longest request and total tokens. The
    same numbers as ``decomposition_stats`` of the built plan, exactly.
    """
    n = lens.size
    ones = np.ones(n)
    units = np.ceil(lens * (1.0 / TILE_TOKENS))          # tiles of each request
    r = chunk.size
    k = np.minimum(np.ceil(np.maximum(lens, 1.0) / chunk[:, None]), cap[:, None])
    st = np.empty((7, r + len(tiny)))
    st[1] = total
    st[2] = units.sum() * copies
    a = st[:, :r]
    k.dot(ones, out=a[0])
    # chunks of split requests = all chunks - requests in one chunk; sum(min(k, 2)) = 2n - those
    a[5] = (a[0] + np.minimum(k, 2.0).dot(ones) - 2 * n) * copies
    a[0] *= copies
    k.max(axis=1, out=a[6])
    # A request's chunks have q or q + 1 tiles; the last is a largest, short of its tiles by
    # pad = units * 64 - len tokens; another largest chunk is full unless (units - 1) % k == 0,
    # that is unless k * ceil(units / k) - units == k - 1.
    max_units = np.ceil(units / k)
    max_units.max(axis=1, out=a[4])
    k_minus_1 = k - 1.0
    np.multiply(k, max_units, out=k)
    k -= units
    sole_largest = k == k_minus_1
    max_units *= TILE_TOKENS
    max_units -= sole_largest * (units * TILE_TOKENS - lens)
    max_units.max(axis=1, out=a[3])

    if len(tiny):
        # Chunks of 16 or 32 tokens aligned to themselves: every chunk is one partial tile.
        c = np.asarray(tiny, dtype=np.float64)
        kt = np.ceil(lens / c[:, None])                  # 0 for an empty request
        t = st[:, r:]
        empty = n - np.count_nonzero(lens)
        kt.dot(ones, out=t[2])
        t[5] = (t[2] + np.minimum(kt, 2.0).dot(ones) - 2 * (n - empty)) * copies
        t[2] *= copies                                   # one tile per non-empty chunk
        t[0] = t[2] + empty * copies
        t[3] = np.minimum(c, max_len)
        t[4] = 1.0
        kt.max(axis=1, out=t[6])
    return st


def _candidates(problem: DecodeProblem, max_len: int, total: int, slots: int, num_splits,
                strategy):
    """Rows (kind, value) in ``_row_stats`` order, the (chunk, cap) arrays and tiny chunk
    sizes that give them, and the pairs to try: (row index per pair, strategy code per pair,
    strategy name per pair)."""
    if num_splits is not None and num_splits > 1:
        return ([(NUM_SPLITS, num_splits)], np.array([float(TILE_TOKENS)]),
                np.array([float(num_splits)]), [], _pairs(1, False, strategy))
    if num_splits == 1 or strategy == "single":
        return ([(NO_SPLIT, 1)], np.array([NO_SPLIT_CHUNK]), np.array([np.inf]), [],
                _pairs(1, True, strategy or "single"))
    items_per_chunk = problem.num_kv_heads * -(-problem.group_size // HEAD_TILE)
    sizes = chunk_token_candidates(max_len, total, items_per_chunk, problem.batch_size, slots)
    fills = wave_filling_chunk_tokens(total, problem.batch_size, items_per_chunk, slots, max_len)
    big = [c for c in sizes if c >= TILE_TOKENS]
    big += [c for c in fills if c not in big]
    tiny = [c for c in sizes if c < TILE_TOKENS]
    max_units = -(-max_len // TILE_TOKENS)
    splits = [s for s in wave_filling_splits(problem.batch_size * items_per_chunk, slots)
              if s <= max_units]
    rows = ([(NO_SPLIT, 1)] + [(CHUNK_TOKENS, c) for c in big] + [(NUM_SPLITS, s) for s in splits]
            + [(CHUNK_TOKENS, c) for c in tiny])
    chunk = np.array([NO_SPLIT_CHUNK] + big + [TILE_TOKENS] * len(splits), dtype=np.float64)
    cap = np.array([np.inf] * (1 + len(big)) + splits, dtype=np.float64)
    return rows, chunk, cap, tiny, _pairs(len(rows), True, strategy)


@functools.lru_cache(maxsize=256)
def _pairs(num_rows: int, first_is_no_split: bool, strategy):
    """(row index, strategy code, strategy name) of every candidate. Unforced, the no-split
    row runs as 'single' and every split row as 'split_merge' and as 'fused' (every split row
    splits the longest request, by construction)."""
    if strategy is not None:
        pairs = [(r, strategy) for r in range(num_rows)]
    else:
        pairs = [(0, "single")] if first_is_no_split else []
        pairs += [(r, s) for r in range(len(pairs), num_rows) for s in ("split_merge", "fused")]
    rows = np.array([r for r, _ in pairs])
    codes = np.array([V.STRATEGIES.index(s) for _, s in pairs])
    rows.setflags(write=False)
    codes.setflags(write=False)
    return rows, codes, tuple(s for _, s in pairs)


def _predict_all(problem: DecodeProblem, model: CostModel, num_splits=None, strategy=None):
    """Rows, then per pair: its row index, its strategy, its predicted us."""
    lens = problem.kv_lens
    copies = 1
    if lens.size > 1 and lens[0] == lens[-1] and np.all(lens == lens[0]):
        lens, copies = lens[:1], lens.size
    lens = lens.astype(np.float64)
    max_len, total = int(lens.max()), int(lens.sum()) * copies
    rows, chunk, cap, tiny, (pair_rows, codes, strategies) = \
        _candidates(problem, max_len, total, model.slots, num_splits, strategy)
    stats = _row_stats(lens, copies, max_len, total, chunk, cap, tiny)
    x = features_from_stats(problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                            codes, stats[:, pair_rows], num_sms=model.num_sms,
                            ctas_per_sm=model.ctas_per_sm, bandwidth_gbps=model.bandwidth_gbps)
    return rows, pair_rows, strategies, x @ model.coef_


def _as_cost_model(profile) -> CostModel:
    if profile is None:
        from .profiles import default_profile
        profile = default_profile()
    if isinstance(profile, CostModel):
        return profile
    return profile.cost_model()


def _check_request(problem, num_splits, strategy):
    V.check_instance("problem", problem, DecodeProblem)
    if num_splits is not None:
        num_splits = V.check_int("num_splits", num_splits, 1)
    if strategy is not None:
        V.check_strategy(strategy)
        if strategy == "single" and num_splits is not None and num_splits > 1:
            raise ValueError(f"strategy: 'single' cannot split a request; num_splits="
                             f"{num_splits} needs 'split_merge' or 'fused'")
    return num_splits, strategy


def rank_candidates(problem: DecodeProblem, profile=None, num_splits: int | None = None,
                    strategy: str | None = None) -> list[Candidate]:
    """Every candidate with its predicted time, cheapest first (ties keep enumeration order:
    fewer splits first)."""
    num_splits, strategy = _check_request(problem, num_splits, strategy)
    model = _as_cost_model(profile)
    if problem.batch_size == 0:
        return [_empty_candidate(problem, model, strategy)]
    rows, pair_rows, strategies, predicted = _predict_all(problem, model, num_splits, strategy)
    return [Candidate(*rows[pair_rows[i]], strategies[i], float(predicted[i]))
            for i in np.argsort(predicted, kind="stable")]


def _empty_candidate(problem, model, strategy) -> Candidate:
    strategy = strategy or "single"
    x = features_from_stats(problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                            V.STRATEGIES.index(strategy), np.zeros((len(STAT_NAMES), 1)),
                            num_sms=model.num_sms, ctas_per_sm=model.ctas_per_sm,
                            bandwidth_gbps=model.bandwidth_gbps)
    return Candidate(NO_SPLIT, 1, strategy, float(x[0] @ model.coef_))


def choose_plan(problem: DecodeProblem, profile=None, num_splits: int | None = None,
                strategy: str | None = None) -> Plan:
    """The cheapest plan the cost model knows for ``problem``, with ``predicted_us`` set.

    profile: a ``Profile``, a fitted ``CostModel``, or None for ``load_profile()``'s answer.
    num_splits: force every request into this many chunks (fewer where a request is shorter
        than that many tiles); 1 means no split.
    strategy: force 'single', 'split_merge' or 'fused'.
    Deterministic: the same problem and profile give the same plan.
    """
    num_splits, strategy = _check_request(problem, num_splits, strategy)
    model = _as_cost_model(profile)
    if problem.batch_size == 0:
        return _empty_candidate(problem, model, strategy).build(problem)
    rows, pair_rows, strategies, predicted = _predict_all(problem, model, num_splits, strategy)
    i = int(np.argmin(predicted))
    return Candidate(*rows[pair_rows[i]], strategies[i], float(predicted[i])).build(problem)
