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
computed for all candidates at once from the ``kv_lens`` array (``stats``: a [candidates x
requests] array, never a per-chunk one), and only the winner is built as a ``Plan``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..core import validation as V
from ..core.plan import (Plan, _chunk_arrays, _single_chunk_arrays, _uniform_chunk_arrays,
                    in_window, plan_chunk_tokens, plan_fixed_splits, plan_from_chunk_counts)
from ..core.problem import DecodeProblem
from ..core.execution import (DEFAULT_LAUNCH_ORDER, MERGE_CLUSTER, _execution,
                              check_launch_order, may_cluster)
from ..core.geometry import TILE_TOKENS
from .cost_model import CostModel
from .features import (PLAIN_TILES, R_CLUSTERED, build_tile_units, count_build_tiles,
                       feature_constants, feature_index, features_from_stats, gather_features,
                       new_feature_rows, row_features, strategy_scale, stream_ratio_of)
from .stats import (S_MAX_SPLITS, S_NUM_CHUNKS, STAT_NAMES, equal_candidate_stats, ones,
                    ragged_candidate_stats)

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
    c = 1 << (max(max_len - 1, 1).bit_length() - 1)       # largest power of two < max_len
    if c < smallest:
        return []
    # after the first, a size is kept while max(batch_size, total / c) x items <= the limit
    limit = max_useful_items(slots)
    sizes = [c]
    if batch_size * items_per_chunk <= limit:
        c //= 2
        while c >= smallest and total_tokens / c * items_per_chunk <= limit:
            sizes.append(c)
            c //= 2
    return sizes


def wave_filling_chunk_tokens(total_tokens: int, batch_size: int, items_per_chunk: int,
                              slots: int, max_len: int, max_waves: int = 4) -> list[int]:
    """Chunk sizes (multiples of 64 tokens) that fill about j whole waves, j = 1..max_waves:
    FlashInfer's rule (the smallest chunk whose sum of ceil(len / chunk) x kv heads fits the
    grid) in closed form, counting half a chunk of waste per request.

    Worked example, the standard case ragged_b32 (103,044 tokens in 32 requests, 8 kv heads, 264
    slots): 2 waves hold 66 chunks; 66 - 32 / 2 = 50 chunks of 103044 / 50 = 2061 -> 2112
    tokens; 3 waves: 1280 tokens; 4 waves: 896. Powers of two would jump from 1024 (about
    123 chunks, 3.7 waves) to 2048 (about 65 chunks, just under 2 waves).
    """
    sizes = []                      # more chunks for more waves: c never grows with j
    for chunks in _wave_chunk_counts(batch_size, items_per_chunk, slots, max_waves):
        c = -(-int(total_tokens / chunks) // TILE_TOKENS) * TILE_TOKENS
        if TILE_TOKENS <= c < max_len and (not sizes or c != sizes[-1]):
            sizes.append(c)
    return sizes


@functools.lru_cache(maxsize=256)
def _wave_chunk_counts(batch_size: int, items_per_chunk: int, slots: int,
                       max_waves: int) -> tuple[float, ...]:
    """The chunk counts of ``wave_filling_chunk_tokens`` (j waves, less half a chunk per
    request), the positive ones: the same on every step of a batch."""
    counts = (j * slots // items_per_chunk - batch_size / 2 for j in range(1, max_waves + 1))
    return tuple(c for c in counts if c > 0)


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

    def build(self, problem: DecodeProblem, *, clusters: bool = False,
              launch_order: str = DEFAULT_LAUNCH_ORDER) -> Plan:
        """The plan, run as ``execution.decide`` says for a GPU with (or without) clusters."""
        if self.kind == NO_SPLIT:
            plan = plan_from_chunk_counts(problem, np.ones(problem.batch_size, np.int64),
                                          self.strategy)
        elif self.kind == CHUNK_TOKENS:
            plan = plan_chunk_tokens(problem, self.value, self.strategy,
                                     align=min(self.value, TILE_TOKENS))
        else:
            plan = plan_fixed_splits(problem, self.value, self.strategy, align=TILE_TOKENS)
        plan = plan.with_execution(clusters=clusters, launch_order=launch_order)
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
# dtype objects, not the scalar types: NumPy converts a type to a dtype on every call.
_FLOAT64, _INT64 = np.dtype(np.float64), np.dtype(np.int64)


@functools.lru_cache(maxsize=256)
def _split_rows(num_items: int, slots: int) -> tuple[tuple[int, ...], np.ndarray]:
    """``wave_filling_splits`` and its [splits, 1] float array: the same on every step of a
    batch."""
    splits = tuple(wave_filling_splits(num_items, slots))
    caps = np.array(splits, dtype=_FLOAT64)[:, None]
    caps.setflags(write=False)
    return splits, caps


def _candidates(batch_size: int, max_len: int, total: int, items_per_chunk: int, slots: int,
                num_splits, strategy):
    """The rows to score, in ``stats.ragged_candidate_stats`` order: their values (1 for no
    split, chunk tokens, split counts), the slice of rows that are split counts and their
    counts [splits, 1], the chunk size of each row and the number of tiny rows; and the
    arguments of ``_pairs``.

    Unforced: no split, the chunk sizes of at least a tile, the split counts, the tiny chunk
    sizes. Row 0 is no split unless splits are forced; rows outside the split slice are chunk
    sizes."""
    if num_splits is not None and num_splits > 1:
        return ([num_splits], slice(0, 1), np.array([[float(num_splits)]]), [TILE_TOKENS], 0,
                (1, False, strategy))
    if num_splits == 1 or strategy == "single":
        return [1], slice(0, 0), _NO_CAPS, [NO_SPLIT_CHUNK], 0, (1, True, strategy or "single")
    sizes = chunk_token_candidates(max_len, total, items_per_chunk, batch_size, slots)
    tiny = [c for c in sizes if c < TILE_TOKENS] if max_len <= TINY_CONTEXT else []
    big = sizes[:len(sizes) - len(tiny)]                 # sizes run largest first
    big += [c for c in wave_filling_chunk_tokens(total, batch_size, items_per_chunk, slots,
                                                  max_len) if c not in big]
    splits, caps = _split_rows(batch_size * items_per_chunk, slots)
    max_units = -(-max_len // TILE_TOKENS)
    if splits and splits[-1] > max_units:                # only counts a request can take
        used = sum(s <= max_units for s in splits)
        splits, caps = splits[:used], caps[:used]
    first_split = 1 + len(big)
    values = [1, *big, *splits, *tiny]
    chunk = [NO_SPLIT_CHUNK, *big, *(TILE_TOKENS,) * len(splits), *tiny]
    return (values, slice(first_split, first_split + len(splits)), caps, chunk, len(tiny),
            (len(values), True, strategy))


_NO_CAPS = np.zeros((0, 1))


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


@functools.lru_cache(maxsize=1024)
def _pair_features(num_rows: int, first_is_no_split: bool, strategy, *shape):
    """``_pairs`` (row index and strategy name per pair) with ``gather_features``' index and
    scale for one ``feature_constants`` shape: the same on every step of a batch."""
    pair_rows, codes, strategies = _pairs(num_rows, first_is_no_split, strategy)
    index = feature_index(num_rows, pair_rows, codes)
    scale = strategy_scale(feature_constants(*shape)[2], codes, len(codes))
    index.setflags(write=False)
    scale.setflags(write=False)
    return pair_rows, strategies, index, scale


@dataclass
class _Scores:
    """Every candidate of one problem, scored (``_candidates``' rows; the chunk counts k
    [rows, requests] and tiles per request of ``stats.ragged_candidate_stats``, or when all
    lengths are equal ``stats.equal_candidate_stats``' k [rows, 1] and None), and per pair
    its row index, strategy and predicted us; ``num_chunks``: each row's chunk count;
    ``rows``: the ``row_features`` array the predictions were made from."""

    values: list
    splits: slice
    k: np.ndarray
    units: np.ndarray | None
    pair_rows: np.ndarray
    strategies: tuple
    predicted: np.ndarray
    num_chunks: np.ndarray
    rows: np.ndarray

    def row(self, row: int) -> tuple[str, int]:
        """(kind, value) of a row."""
        kind = (NUM_SPLITS if self.splits.start <= row < self.splits.stop
                else NO_SPLIT if row == 0 else CHUNK_TOKENS)
        return kind, self.values[row]

    def candidate(self, i: int) -> Candidate:
        return Candidate(*self.row(self.pair_rows[i]), self.strategies[i],
                         float(self.predicted[i]))

    def build(self, problem: DecodeProblem, i: int, clusters: bool, launch_order: str) -> Plan:
        """The plan of pair i, from the counts already computed: the same arrays as
        ``Candidate.build``, without its checks (the problem and the counts are valid)."""
        row = int(self.pair_rows[i])
        kind, value = self.row(row)
        lens = problem.read_lens
        align = min(value, TILE_TOKENS) if kind == CHUNK_TOKENS else TILE_TOKENS
        if kind == NO_SPLIT:
            arrays = _single_chunk_arrays(lens)
        elif self.units is None:
            arrays = _uniform_chunk_arrays(lens.size, int(lens[0]), int(self.k[row][0]), align)
        else:
            units = self.units.astype(_INT64) if align == TILE_TOKENS else None
            arrays = _chunk_arrays(lens, self.k[row].astype(_INT64), align, units)
        # ``decide`` tests a fused plan on a GPU with clusters from its arrays, at a cost; the
        # row's 'clustered' value is that test in closed form (``execution.clustered``), and
        # a clustered row has max_splits chunks in every request. So the plan is decided
        # without clusters, and a clustered one then given its cluster execution.
        strategy = self.strategies[i]
        size = (int(self.rows[S_MAX_SPLITS, row])
                if clusters and strategy == "fused" and self.rows[R_CLUSTERED, row] else 0)
        plan = Plan._trusted(problem, strategy, *in_window(problem, arrays),
                             predicted_us=self.predicted.item(i), launch_order=launch_order)
        if size:
            plan.__dict__["execution"] = _execution(MERGE_CLUSTER, size, "plan")
        return plan


def _score(problem: DecodeProblem, model: CostModel, num_splits=None, strategy=None,
           max_chunks=None) -> _Scores:
    """Predict every candidate: closed-form statistics per row, features per row, times per
    pair. Equal lengths (the common benchmark case) collapse to one request standing for all.
    Candidates of more than ``max_chunks`` chunks (a graph-stable wrapper's capacity) are
    predicted at +inf: never chosen, last in a ranking."""
    lens = problem.read_lens            # the tokens a call reads (a window's, with a window)
    batch_size = lens.size
    max_len = int(lens[lens.argmax()])                   # argmax: cheaper than a reduction
    min_len = int(lens[lens.argmin()])
    shape = (problem.num_qo_heads, problem.num_kv_heads, problem.head_dim, model.num_sms,
             model.ctas_per_sm, model.bandwidth_gbps)
    ipc, slots, _ = feature_constants(*shape)
    if min_len == max_len:
        total, lens_f = max_len * batch_size, None
    else:
        lens_f = lens.astype(_FLOAT64)
        total = int(lens_f.dot(ones(batch_size)))
    values, splits, caps, chunk, num_tiny, pair_key = \
        _candidates(batch_size, max_len, total, ipc, slots, num_splits, strategy)
    rows, stats = new_feature_rows(len(chunk))
    tile_units = build_tile_units(model.tile_rule, *shape[:3], problem.page_size, model.num_sms)
    odd = tile_units != PLAIN_TILES        # only a model that counts 128-token tiles needs them
    if lens_f is None:
        k = equal_candidate_stats(stats, max_len, batch_size, total, chunk, splits, caps,
                                  num_tiny, odd_chunks=odd)
        units = None
    else:
        divisors = np.array([*chunk, TILE_TOKENS], _FLOAT64)[:, None]
        k, units = ragged_candidate_stats(stats, lens_f, min_len, max_len, total, divisors,
                                          splits, caps, num_tiny, odd_chunks=odd)
    count_build_tiles(rows, tile_units, ipc, model.num_sms)
    pair_rows, strategies, index, scale = _pair_features(*pair_key, *shape)
    too_many = None if max_chunks is None else stats[S_NUM_CHUNKS][pair_rows] > max_chunks
    # Each prediction is the sum of the features times their coefficients in feature order
    # (a reduction over axis 0 of a C-order [features, pairs] array adds row after row): a
    # fixed order, so candidates with equal features tie exactly and the planner on the device
    # (kernels_cu/device_plan.cuh) rounds the same way; a matrix-vector product's order is
    # the BLAS library's.
    clusters = may_cluster(model.clusters, max_len)
    x = gather_features(row_features(rows, ipc, slots, model.num_sms,
                                     stream_ratio_of(model.bandwidth_gbps), some_items=True,
                                     cluster_batch_size=batch_size if clusters else 0,
                                     batch_size=batch_size),
                        index, scale, clusters=clusters)
    x *= model.coef_[:, None]
    if x.shape[1] > 1:
        predicted = np.add.reduce(x, axis=0)
    else:        # one column: NumPy would sum it pairwise, in another order
        total = 0.0
        for term in x[:, 0].tolist():
            total += term
        predicted = np.array([total])
    if too_many is not None:
        predicted[too_many] = np.inf
    return _Scores(values, splits, k, units, pair_rows, strategies, predicted,
                   stats[S_NUM_CHUNKS], rows)


def _as_cost_model(profile) -> CostModel:
    """A ``Profile``'s model, a ``CostModel`` itself, ``load_profile(path=...)``'s for a path,
    or ``default_profile()``'s for None."""
    if isinstance(profile, CostModel):          # first: what the wrapper passes on every step
        return profile
    from .profile_lookup import default_profile, load_profile
    from .profiles import Profile

    if profile is None:
        profile = default_profile()
    elif V.check_path_or("profile", profile, Profile,
                         "a Profile, a fitted CostModel, a path (str or os.PathLike) or None"):
        profile = load_profile(path=profile)
    return profile.cost_model()


def _check_request(problem, num_splits, strategy):
    V.check_instance("problem", problem, DecodeProblem)
    if num_splits is not None:
        num_splits = V.check_int("num_splits", num_splits, 1, V.MAX_CHUNKS, "MAX_CHUNKS")
    if strategy is not None:
        V.check_strategy(strategy)
        if strategy == "single" and num_splits is not None and num_splits > 1:
            raise ValueError(f"strategy: 'single' cannot split a request; num_splits="
                             f"{num_splits} needs 'split_merge' or 'fused'")
    return num_splits, strategy


def rank_candidates(problem: DecodeProblem, profile=None, num_splits: int | None = None,
                    strategy: str | None = None, *,
                    max_chunks: int | None = None) -> list[Candidate]:
    """Every candidate with its predicted time, cheapest first (ties keep enumeration order:
    fewer splits first); candidates of more than ``max_chunks`` chunks last, at +inf."""
    num_splits, strategy = _check_request(problem, num_splits, strategy)
    max_chunks = _check_max_chunks(problem, max_chunks)
    model = _as_cost_model(profile)
    if problem.batch_size == 0:
        return [_empty_candidate(problem, model, strategy)]
    scores = _score(problem, model, num_splits, strategy, max_chunks)
    return [scores.candidate(i) for i in np.argsort(scores.predicted, kind="stable")]


def _check_max_chunks(problem: DecodeProblem, max_chunks):
    if max_chunks is None:
        return None
    max_chunks = V.check_int("max_chunks", max_chunks, 1)
    if max_chunks < problem.batch_size:
        raise ValueError(f"max_chunks: {max_chunks} chunks cannot hold a batch of "
                         f"{problem.batch_size} requests (one chunk each at the least)")
    return max_chunks


def _empty_candidate(problem, model, strategy) -> Candidate:
    strategy = strategy or "single"
    x = features_from_stats(problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                            V.STRATEGIES.index(strategy), np.zeros((len(STAT_NAMES), 1)),
                            num_sms=model.num_sms, ctas_per_sm=model.ctas_per_sm,
                            bandwidth_gbps=model.bandwidth_gbps, clusters=model.clusters,
                            tile_rule=model.tile_rule, page_size=problem.page_size)
    return Candidate(NO_SPLIT, 1, strategy, float(x[0] @ model.coef_))


def choose_plan(problem: DecodeProblem, profile=None, num_splits: int | None = None,
                strategy: str | None = None, *, launch_order: str = DEFAULT_LAUNCH_ORDER,
                max_chunks: int | None = None) -> Plan:
    """The cheapest plan the cost model knows for ``problem``, with ``predicted_us`` set.

    profile: a ``Profile``, a fitted ``CostModel``, a profile file's path (str or
        ``os.PathLike``, read with ``load_profile(path=...)``), or None for
        ``load_profile()``'s answer.
    num_splits: force every request into this many chunks (fewer where a request is shorter
        than that many tiles); 1 means no split.
    strategy: force 'single', 'split_merge' or 'fused'.
    launch_order: the order the grid runs the chunks in (``execution.LAUNCH_ORDERS``).
    max_chunks: choose among plans of at most this many chunks (a graph-stable wrapper's
        capacity); at least the batch size, so the unsplit plan always fits.
    The plan's execution (``Plan.execution``) is how it runs on the model's GPU: a fused plan
    merges in clusters where the model's ``clusters`` says the GPU has them and the plan suits
    them. Deterministic: the same problem and profile give the same plan.
    """
    num_splits, strategy = _check_request(problem, num_splits, strategy)
    check_launch_order(launch_order)
    max_chunks = _check_max_chunks(problem, max_chunks)
    model = _as_cost_model(profile)
    if problem.batch_size == 0:
        return _empty_candidate(problem, model, strategy).build(
            problem, clusters=model.clusters, launch_order=launch_order)
    limit = None if max_chunks is None else min(max_chunks, V.MAX_CHUNKS)
    scores = _score(problem, model, num_splits, strategy, limit)
    best = int(scores.predicted.argmin())
    if limit is None and scores.num_chunks[scores.pair_rows[best]] > V.MAX_CHUNKS:
        # rare (forced splits of a huge batch): scored again within the limit, before any array
        scores = _score(problem, model, num_splits, strategy, V.MAX_CHUNKS)
        best = int(scores.predicted.argmin())
        if np.isinf(scores.predicted[best]):
            V.check_num_chunks("num_splits" if num_splits is not None else "strategy",
                               int(scores.num_chunks.min()))
    if limit is not None and np.isinf(scores.predicted[best]):
        raise ValueError(f"max_chunks: no plan of at most {limit} chunks matches "
                         f"num_splits={num_splits}, strategy={strategy!r} for "
                         f"{problem.batch_size} requests")
    return scores.build(problem, best, model.clusters, launch_order)
