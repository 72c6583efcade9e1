"""The cost model's features: what each column counts, the statistics rows it reads, its unit,
and how the rows are computed for many candidates at once.

How the kernels run (what the features describe): one CTA per work item (chunk x kv head, and
x ceil(group / 64) head tiles for very large GQA groups). A CTA streams its chunk's K and V in
tiles of 64 tokens (128 for the builds of 8 warps or 32 tokens a warp:
``core.builds``), so a partly filled last tile costs a whole tile of compute but only its
real bytes of memory. About ``ctas_per_sm`` CTAs are resident per SM at head_dim 128 (more at
64, fewer at 256: ``resident_ctas``), so the GPU has ``num_sms * resident_ctas`` *slots*; items
are dealt onto the slots in waves. A CTA pays a fixed
start-up (Q load, page-table reads, pipeline fill). Requests cut into several chunks leave fp32
partials (``num_qo_heads x (head_dim + 1) x 4`` B per chunk, the +1 is the log-sum-exp) that a
second launch merges ('split_merge') or that the last CTA of each (request, kv head) merges
('fused', a serial tail that grows with the number of chunks).

Time units: microseconds. Byte counts are turned into microseconds at the device's streaming
bandwidth (``bandwidth_gbps``), or at one slot's share of it (``bandwidth_gbps / slots``) for
work that one CTA does alone, or at one SM's share (``bandwidth_gbps / num_sms``) for the work
of the busiest SM, so a fitted coefficient near 1 means "at the roofline".

The critical path is counted per SM, not per slot: the CTAs resident on one SM share its load
pipes and tensor cores, so two CTAs of n tokens on one SM take about as long as one CTA of 2n
tokens alone on it (measured: docs/design/cost-model.md, "The measurements behind the
columns"). Counting per slot would credit a split that doubles the CTAs on half-idle SMs with
halving the critical path. Unequal chunks add a tail: CTAs are dealt in grid order (the plan's
launch order, by default the longest chunks first: ``execution.launch_order``), and list
scheduling's makespan is up to mean load + largest item; ``tail_us`` carries what the largest
chunk exceeds the mean by.

The columns are declared once, in ``FEATURES`` (name, row, unit, which strategies pay it);
everything else is derived from that table: ``FEATURE_NAMES``, the gather index and scale, the
units, and the planner on the device's columns (``runtime.device_planner.feature_table_source``).
The rows they read are declared once too, as expressions (``ROW_EXPRESSIONS``), which both the
host's NumPy and the device's C++ are compiled from.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..core.execution import MERGE_CLUSTER, clustered
from ..core.builds import LONG_CHUNK_TOKENS, DeviceProperties, PlanGrid, decode_build, row_tiles_for
from ..core.geometry import TILE_TOKENS, ctas_per_kv_head, rows_per_cta
from ..core.variants import KernelVariant
from ..core.validation import STRATEGIES
from .expressions import RowProgram, at_least_one, ceil, eq, ge, inputs, maximum, minimum
from .stats import (ONE, S_MAX_CHUNK_TILES, S_MAX_CHUNK_TOKENS, S_MAX_SPLITS, S_NUM_CHUNKS,
                    S_ODD_CHUNKS, S_TOTAL_TILES, S_TOTAL_TOKENS, STAT_NAMES,
                    decomposition_stats, indices, rows_of)


# The planner scores dozens of candidates on every decode step, several strategies per
# decomposition. So the features are computed in two steps, each a few whole-row NumPy calls
# (at these sizes a call costs more than its arithmetic):
#   row_features   per decomposition, whatever the strategy: a [len(FEATURE_ROWS), n] array
#                  whose first rows are the stats and the rest values derived from them;
#   gather_features per candidate (decomposition, strategy): each feature is one of those
#                  rows (its ``Feature.row``, by strategy) times its unit, or times 0 where the
#                  strategy does not pay it (``strategy_scale``).
# Each value is the same bits as the plain formulas (``waves``, ``critical_path``): the same
# IEEE operations in the same order, and multiplying by 1 or 0 is exact.

# Chunks from which a lone CTA's streaming rate, not its start-up, sets its time (lone_cta_us).
LONE_CTA_MIN_TOKENS = 1024

# The derived rows, each written once, as an expression (``expressions``) of a
# decomposition's statistics, its 'clustered' row (filled by hand, ``execution.clustered``:
# 0 on the device, whose grids have no clusters) and the call's constants. ``row_features``
# computes them with NumPy, and the planner on the device with the C++ that
# ``runtime.device_planner.row_table_source`` writes from the same expressions, operation for
# operation, so both round alike. A new row is one entry of ROW_EXPRESSIONS (and the column
# of FEATURES that reads it); a value named below and used twice is computed once.
ROW_INPUTS = STAT_NAMES + ("clustered",)
ROW_CONSTANTS = ("items_per_chunk", "slots", "num_sms", "stream_ratio", "batch_size")
_s, _c = inputs(*ROW_INPUTS), inputs(*ROW_CONSTANTS)
_items = _s.num_chunks * _c.items_per_chunk              # work items (CTAs)
_tokens = _s.total_tokens * _c.items_per_chunk           # every CTA's tokens (W)
_tiles = _s.total_tiles * _c.items_per_chunk
_some_items = at_least_one(_items)                       # a divisor: 0 only with no chunk
_sm_waves = ceil(_items / _c.num_sms)                    # waves(items, num_sms)
_one_plus_split = minimum(_s.max_splits, 2.0)            # max_splits >= 1: 1 + (max_splits > 1)
_split = _one_plus_split - 1.0
_mean_tokens = _tokens / _some_items                     # the mean chunk's tokens
_largest = _s.max_chunk_tokens                           # L, the largest chunk's tokens
# critical_path per SM: max(largest, sm waves x mean)
_crit_tokens = maximum(_mean_tokens * _sm_waves, _largest)
ROW_EXPRESSIONS = {
    "one": 1.0,
    "one_plus_split": _one_plus_split,
    "split": _split,
    "split_x_max_splits": _split * _s.max_splits,
    "split_x_requests": _split * _c.batch_size,
    "waves": ceil(_items / _c.slots),                    # waves(items, slots)
    "crit_tokens": _crit_tokens,
    "crit_tiles": maximum(_tiles / _some_items * _sm_waves, _s.max_chunk_tiles),
    "tail_tokens": _largest - _mean_tokens,              # largest - mean chunk
    # max(rho L, W + rho max(0, L - W / min(items, slots))), rho = stream_ratio
    "stream_tokens": maximum(
        maximum(_largest - _tokens / minimum(_some_items, _c.slots), 0.0) * _c.stream_ratio
        + _tokens, _c.stream_ratio * _largest),
    # crit_tokens where one SM wave holds every item and the largest chunk is long
    "lone_tokens": ge(_largest, float(LONE_CTA_MIN_TOKENS)) * eq(_sm_waves, 1.0) * _crit_tokens,
}
ROW_PROGRAM = RowProgram(ROW_EXPRESSIONS, ROW_INPUTS, ROW_CONSTANTS)
# Rows are addressed by name: the stats rows by ``stats``' S_ constants (they come first).
FEATURE_ROWS = ROW_PROGRAM.names
R_CLUSTERED = FEATURE_ROWS.index("clustered")

# What a row's count is multiplied by (``feature_constants`` computes them for one shape on
# one machine): 'count' 1; 'token_*' one token of one kv head's K and V bytes at the device's
# bandwidth ('token'), one SM's share ('token_sm') or one slot's ('token_slot'); 'kv_token' the
# same for all kv heads; 'tile' head_dim / 128 and 'tile_rows' that x query heads per CTA;
# 'partials' a chunk's fp32 partials written and read back; 'cta_partials_slot' one CTA's
# partials at one slot's bandwidth; 'wide' head_dim / 128 - 1 past 128; 'merge_ctas' the merge
# kernel's CTAs of a request per SM.
UNITS = ("count", "kv_token", "token_sm", "token_slot", "token", "tile", "tile_rows",
         "partials", "cta_partials_slot", "wide", "merge_ctas")


@dataclass(frozen=True)
class Feature:
    """One column: the ``FEATURE_ROWS`` row it reads, times its unit (``UNITS``).
    ``paid_by``: the one strategy that pays it (None: all; the others read 0);
    ``split_merge_row``: the row a 'split_merge' candidate reads instead; ``ticket``: a plan
    that merges in clusters does not pay it (it writes no partials and takes no ticket)."""

    name: str
    row: str
    unit: str
    paid_by: str | None = None
    split_merge_row: str | None = None
    ticket: bool = False


FEATURES = (
    # kernel launches in the graph: 2 for 'split_merge' with a split request, else 1.
    Feature("launches", "one", "count", split_merge_row="one_plus_split"),
    # all K and V bytes / device bandwidth (contention for DRAM).
    Feature("kv_us", "total_tokens", "kv_token"),
    # bytes of the most loaded SM / one SM's bandwidth (the critical path).
    Feature("crit_us", "crit_tokens", "token_sm"),
    # 64-token tiles on the most loaded SM (partial tiles count whole), x head_dim / 128:
    # per-tile work that is not memory traffic. A model whose ``tile_rule`` is 'fp8' counts the
    # tiles fp8's builds run (``count_build_tiles``): a 128-token tile as two of 64, so
    # a chunk of 100 tokens costs one such tile, as a chunk of 50 does.
    Feature("crit_tiles", "crit_tiles", "tile"),
    # the same x query heads per CTA: compute that grows with the GQA group.
    Feature("crit_tile_rows", "crit_tiles", "tile_rows"),
    # CTAs the most loaded slot runs one after the other (each pays a start-up).
    Feature("waves", "waves", "count"),
    # fp32 partials written and read back / device bandwidth.
    Feature("partial_us", "split_chunks", "partials", ticket=True),
    # bytes one merging CTA reads in 'fused' (max chunks x group x (head_dim+1) x 4 B) / one
    # slot's bandwidth.
    Feature("fused_tail_us", "split_x_max_splits", "cta_partials_slot", paid_by="fused",
            ticket=True),
    # 1 when 'fused' merges anything (the ticket atomic, fences, the extra pass).
    Feature("fused_merges", "split", "count", paid_by="fused", ticket=True),
    # max chunks of a request when 'split_merge' merges: the merge kernel's warp walks a row's
    # partials one dependent L2 round trip after another.
    Feature("merge_chain", "split_x_max_splits", "count", paid_by="split_merge"),
    # (largest chunk - mean chunk) bytes of one CTA / one slot's bandwidth: the scheduling
    # tail of unequal chunks (0 when every chunk is the same size).
    Feature("tail_us", "tail_tokens", "token_slot"),
    # 1 when the plan merges inside thread-block clusters (its execution's merge is 'cluster';
    # for the planner's candidates, ``execution.clustered`` on a GPU with clusters); such a
    # plan writes no partials and takes no ticket, so its ``ticket`` columns are 0.
    Feature("cluster_merges", "clustered", "count", paid_by="fused"),
    # crit_us again when no SM runs two CTAs at once (work items <= num_sms) and the largest
    # chunk has at least ``LONE_CTA_MIN_TOKENS`` tokens. A CTA alone on its SM keeps half the
    # loads in flight that two do, so it streams below the SM's share of the bandwidth: such a
    # grid runs a few percent slower than the same work as two CTAs per SM, which crit_us alone
    # predicts equal (docs/design/cost-model.md). A short chunk's time is mostly its start-up,
    # which a second CTA does not shorten. Cluster plans count too (all were measured as ticket
    # plans).
    Feature("lone_cta_us", "lone_tokens", "token_sm"),
    # the grid's streaming time: while it is full (min(items, slots) CTAs at once) the grid
    # reads at the device's bandwidth, and the largest CTA only its share; what that CTA has
    # left past its share it then streams alone, at ``LONE_CTA_GBPS``; and never less than that
    # CTA alone. In tokens of one kv head, max(rho L, W + rho max(0, L - W / min(items,
    # slots))), rho the device's bandwidth over LONE_CTA_GBPS, L the largest CTA's tokens, W all
    # CTAs' tokens; times one token's bytes / the bandwidth. The per-SM critical path (crit_us)
    # charges the largest CTA at a whole SM's rate, where in a full grid of ragged chunks it
    # streams at its share (docs/design/cost-model.md: a grid of 516 CTAs with one of 3,682
    # tokens ran 74.7 us where crit_us predicted 61.8). W counts every CTA's tokens, so a group
    # past 64 query heads (several CTAs a kv head, the second reading from L2) counts each; fp8
    # fits use the same rho over 16-bit bytes (a lone fp8 CTA's rate was not measured apart).
    Feature("stream_us", "stream_tokens", "token"),
    # waves again, x (head_dim / 128 - 1) past head_dim 128 (0 at 128 and below): a CTA of
    # head_dim 256 fills a pipeline of tiles twice as wide, and alone on its SM (one CTA an SM)
    # nothing hides that start-up. Without it the H200 fit predicted head_dim 256 plans 6-25%
    # fast, the more so the more waves (docs/design/cost-model.md).
    Feature("wide_waves", "waves", "wide"),
    # 'split_merge' plans that merge: the merge kernel's CTAs per SM. Its grid is a thread per
    # (request, query head, 4 dims), 128 a CTA, over the whole batch, split or not, so 256
    # requests of 32 heads launch 2,048 CTAs however few split. Measured on the H200: 4-10 us
    # of merge kernel at 128-256 requests (benchmarks/results/h200-merge-cost.json); launches
    # and merge_chain are per call. Where the grid differs: a graph-stable wrapper launches it
    # over its capacity for every strategy, so its model holds 0 (``Profile.cost_model``); the
    # compact_merge experiment covers the split requests only (this overcounts); 8-warp builds'
    # merge CTAs hold 256 threads (half the CTAs; only lone grids, small batches, run them).
    Feature("merge_grid", "split_x_requests", "merge_ctas", paid_by="split_merge"),
)
# Profiles fitted before a column existed hold 0 for it (profiles.FEATURES_ADDED_LATER).

FEATURE_NAMES = tuple(f.name for f in FEATURES)
# The table by index, checked as it is read (a row, unit or strategy not known fails at import):
# each feature's row; (feature, row) where 'split_merge' reads another; (feature, strategy code)
# where one strategy alone pays it; each feature's unit (index in UNITS).
FEATURE_SOURCE = np.array(indices(FEATURE_ROWS, *(f.row for f in FEATURES)))
_SPLIT_MERGE_ROWS = tuple((i, FEATURE_ROWS.index(f.split_merge_row))
                          for i, f in enumerate(FEATURES) if f.split_merge_row)
_PAID_BY = tuple((i, STRATEGIES.index(f.paid_by)) for i, f in enumerate(FEATURES) if f.paid_by)
_UNIT_OF = tuple(UNITS.index(f.unit) for f in FEATURES)
F_CLUSTER_MERGES, F_MERGE_GRID = indices(FEATURE_NAMES, "cluster_merges", "merge_grid")
# The features a clustered fused merge does not pay, for the one it pays instead
# (F_CLUSTER_MERGES): neighbours in the table, so that one NumPy call zeroes them.
F_TICKET = rows_of(FEATURE_NAMES, *(f.name for f in FEATURES if f.ticket))
# Dims of the merge kernel's rows one CTA merges: 128 threads of 4 dims (merge_grid).
MERGE_DIMS_PER_CTA = 4 * 128
# What one CTA alone streams, GB/s (stream_us): chosen on the H200 sweep alone, where the
# held-out error was lowest (docs/design/cost-model.md; 50-70 fit alike).
LONE_CTA_GBPS = 70.0

SPLIT_MERGE = STRATEGIES.index("split_merge")

# How a model counts tiles (``CostModel.tile_rule``): '' 64-token tiles everywhere (the 16-bit
# fits, whose 8-warp lone grids of 128-token tiles are rare in the sweep, the graph-stable
# fits, and fits made before the rule); 'fp8' the tiles of the builds fp8 K/V's per-shape plans
# run (``core.builds.decode_build``, which the runtime compiles); 'fp8_multi_token' the same for
# multi-token plans (``CostModel.for_multi_token``; a profile never holds it). The fp8 H200 fit
# counting them: fit RMS 8.4 -> 8.0%, held-out 7.1 -> 6.7%, eval 59 -> 62 of 68 shapes within
# 5% (docs/design/cost-model.md).
TILE_RULES = ("", "fp8", "fp8_multi_token")
# The plans whose builds a rule counts the tiles of: (K/V dtype, multi-token). Both fp8
# formats build alike; '' reads no build.
_RULE_BUILDS = {"fp8": ("float8_e4m3fn", False), "fp8_multi_token": ("float8_e4m3fn", True)}
# build_tile_units when every tile is 64 tokens
PLAIN_TILES = (1, 1, 1, 1)


def check_tile_rule(tile_rule) -> str:
    if tile_rule not in TILE_RULES:
        raise ValueError(f"tile_rule: expected one of {list(TILE_RULES)}, got {tile_rule!r}")
    return tile_rule


@functools.lru_cache(maxsize=256)
def build_tile_units(tile_rule: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     page_size: int, num_sms: int) -> tuple[int, int, int, int]:
    """64-token tiles in one tile of the build a plan of this shape runs, as ``tile_rule``
    counts them (``PLAIN_TILES`` for ''): for grids that give some SM two CTAs, of short and
    of long chunks (a mean of ``LONG_CHUNK_TOKENS`` or more), then for lone grids, short and
    long. The builds are ``core.builds.decode_build``'s, the runtime's own decision, for the
    model's device as a profile records it (its SMs: every default build is taken to fit)."""
    if not check_tile_rule(tile_rule):
        return PLAIN_TILES
    kv_dtype, multi_token = _RULE_BUILDS[tile_rule]
    group = num_qo_heads // num_kv_heads
    row_tiles = row_tiles_for(rows_per_cta(group))
    device = DeviceProperties(num_sms)
    units = tuple(decode_build("bfloat16", head_dim, group, page_size, kv_dtype,
                               PlanGrid(ctas, mean, row_tiles=row_tiles,
                                        variant=KernelVariant(multi_token=multi_token)),
                               device).tile_tokens
                  // TILE_TOKENS
                  for ctas in (num_sms + 1, num_sms) for mean in (0.0, LONG_CHUNK_TOKENS))
    if not set(units) <= {1, 2}:
        raise ValueError(f"tile_rule {tile_rule!r}: tiles of {units} x 64 tokens; the cost "
                         "model counts tiles of 64 or 128")
    return units


def count_build_tiles(rows, units, items_per_chunk: int, num_sms: int) -> None:
    """Turn the stats rows' 64-token tile counts (``rows[S_TOTAL_TILES]``,
    ``rows[S_MAX_CHUNK_TILES]``, one column per decomposition) into the tiles the builds run
    (``build_tile_units``), in 64-token units: where a column's build streams 128-token tiles,
    each chunk of an odd number of tiles runs one more half (``S_ODD_CHUNKS``), and the
    largest chunk's count rounds up to even. Splitting a 100-token request then saves no tile.
    In place."""
    if units == PLAIN_TILES:
        return
    if len(set(units)) == 1:
        long = ONE                              # every grid
    else:
        lone = rows[S_NUM_CHUNKS] * float(items_per_chunk) <= num_sms   # no SM runs two
        if units == (1, 1, 2, 2):
            long = lone                         # only grids that give no SM two CTAs
        else:                                   # by grid and by the chunks' mean length
            chunks = rows[S_TOTAL_TOKENS] >= float(LONG_CHUNK_TOKENS) * rows[S_NUM_CHUNKS]
            long = np.take(np.array(units, dtype=np.float64) - 1.0, 2 * lone + chunks)
    rows[S_TOTAL_TILES] += rows[S_ODD_CHUNKS] * long
    rows[S_MAX_CHUNK_TILES] += np.mod(rows[S_MAX_CHUNK_TILES], 2.0) * long


def waves(num_items, slots):
    """CTAs the busiest slot runs in turn when ``num_items`` CTAs are dealt onto ``slots``.

    FlashAttention's wave quantization: 300 equal items on 264 slots take 2 full waves, so
    they run at 300 / (2 * 264) = 57% efficiency; 264 items run at 100%.
    """
    return np.ceil(np.divide(num_items, slots))


def critical_path(total, largest, num_items, slots):
    """Work on the most loaded slot: at least the largest item, and at least one mean item per
    wave. Exact for equal items; for ragged items it stands in for the GPU's back-filling.
    Element-wise on arrays (one entry per candidate plan).

    Worked example, H200 (132 SMs x 2 = 264 slots), one request of 32k tokens, 8 kv heads,
    head_dim 128 (one token of one kv head = 512 B of K and V), one slot ~ 4460/264 = 16.9 GB/s:
      no split        8 items; 8 of 264 slots work; critical slot 32768 tok = 16 MiB ~ 990 us.
      1024-tok chunks 256 items, 1 wave; critical slot 1024 tok = 512 KiB ~ 31 us.
      512-tok chunks  512 items, 2 waves; 2 x 512 tok: the same bytes, one more start-up, and
                      twice the partials: no better.
      768-tok chunks  344 items, 2 waves; 2 x 768 tok: 50% worse than 1024 (the wave tail).
    """
    return np.maximum(largest, waves(num_items, slots) * (total / np.maximum(num_items, 1)))


# CTAs an SM holds at each head_dim, relative to head_dim 128's (a profile's ``ctas_per_sm``).
# The default 16-bit builds on sm_90 hold 4 at head_dim 64 with one row tile (3 stages under a
# 128-register cap: ``core.builds.default_occupancy``), 3 with two row tiles (154
# registers, 64 KiB of shared memory), 2 with four (182), 2 at 96 (188 registers, 72 KiB), 2 at
# 128 (219 registers, 96 KiB) and 1 at 256 (160 KiB); fp8's hold 4, 2 and 1.
# tests/kernels/test_kernels_compile.py pins the 16-bit ones against what NVRTC reports. (One
# count for every head_dim overstated head_dim 256's slots twice and understated 64's:
# docs/design/cost-model.md.)
# The plan is chosen before its build, so a build that holds fewer than the default's is
# counted as the default: the unified max at head_dim 64 (158 registers: 3 an SM), forced
# experiments. GPUs of less shared memory an SM than the H200's (A100, sm_86/89) hold fewer at
# head_dim 64 too; their prior profiles keep ctas_per_sm 2 until calibrated.
RESIDENCY_VS_HEAD_DIM_128 = {64: 1.5, 96: 1.0, 128: 1.0, 256: 0.5}
# head_dim 64 by row tiles (16 query heads each): 1 -> 4 an SM, 2 -> 3, 4 (182 registers) -> 2
RESIDENCY_D64_BY_ROW_TILES = {1: 2.0, 2: 1.5, 4: 1.0}


def resident_ctas(head_dim: int, ctas_per_sm: int, rows: int = 16) -> int:
    """CTAs an SM holds for ``head_dim`` and ``rows`` query heads a CTA, given ``ctas_per_sm``
    at head_dim 128."""
    if head_dim == 64:
        factor = RESIDENCY_D64_BY_ROW_TILES[1 if rows <= 16 else 2 if rows <= 32 else 4]
    else:
        factor = RESIDENCY_VS_HEAD_DIM_128.get(head_dim, 1.0)
    return max(1, int(ctas_per_sm * factor + 0.5))


@functools.lru_cache(maxsize=256)
def feature_constants(num_qo_heads, num_kv_heads, head_dim, num_sms, ctas_per_sm,
                      bandwidth_gbps) -> tuple[int, int, np.ndarray]:
    """(work items per chunk, slots, units [len(FEATURE_NAMES), 1]) of one shape on one
    machine. Each feature is a statistic times its unit (bytes -> microseconds, tiles ->
    tile-equivalents); they are the same on every decode step, so they are computed once."""
    group = num_qo_heads // num_kv_heads
    rows = rows_per_cta(group)
    items_per_chunk = num_kv_heads * ctas_per_kv_head(group)
    slots = num_sms * resident_ctas(head_dim, ctas_per_sm, rows)
    bw = bandwidth_gbps * 1e3                      # bytes per microsecond
    slot_bw = bw / slots
    token_bytes = head_dim * 2 * 2                 # K and V, 2-byte elements, one kv head
    partial_bytes = (head_dim + 1) * 4             # fp32 o and lse, one query head
    sm_bw = bw / num_sms
    unit = {"count": 1.0, "kv_token": num_kv_heads * token_bytes / bw,
            "token_sm": token_bytes / sm_bw, "token_slot": token_bytes / slot_bw,
            "token": token_bytes / bw, "tile": head_dim / 128,
            "tile_rows": rows * head_dim / 128,
            "partials": 2 * num_qo_heads * partial_bytes / bw,
            "cta_partials_slot": rows * partial_bytes / slot_bw,
            "wide": max(0.0, head_dim / 128 - 1.0),
            "merge_ctas": num_qo_heads * head_dim / MERGE_DIMS_PER_CTA / num_sms}
    values = [unit[name] for name in UNITS]
    units = np.array([values[u] for u in _UNIT_OF], dtype=np.float64)[:, None]
    units.setflags(write=False)
    return items_per_chunk, slots, units


def new_feature_rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """An uninitialised ``FEATURE_ROWS`` array of n decompositions (and ``ROW_PROGRAM``'s
    scratch rows past them), and its stats rows (a view to fill before ``row_features``)."""
    rows = ROW_PROGRAM.new_rows(n)
    return rows, rows[:len(STAT_NAMES)]


def row_features(rows, items_per_chunk, slots, num_sms, stream_ratio, some_items=False,
                 cluster_batch_size=0, batch_size=0) -> np.ndarray:
    """Fill the derived rows of a ``new_feature_rows`` array from its stats
    (``ROW_EXPRESSIONS``); returns it. ``stream_ratio``: the device's bandwidth over a lone
    CTA's (``stream_ratio_of``), for stream_us. ``some_items``: every column has at least one
    chunk (the planner's rows), so the guard of the mean against 0 items can be skipped.
    ``cluster_batch_size``: the batch size when the GPU has clusters and some row may use
    them, else 0 (the 'clustered' row is then 0). ``batch_size``: the requests of every
    column (the merge kernel's grid spans them all)."""
    if cluster_batch_size:
        clustered(rows[R_CLUSTERED], rows[S_NUM_CHUNKS], rows[S_MAX_CHUNK_TOKENS],
                  rows[S_MAX_SPLITS], cluster_batch_size, items_per_chunk)
    else:
        rows[R_CLUSTERED] = 0.0
    return ROW_PROGRAM.fill(rows, _float_array(items_per_chunk), _float_array(slots),
                            _float_array(num_sms), _float_array(stream_ratio),
                            _float_array(batch_size), some_items=some_items)


def stream_ratio_of(bandwidth_gbps: float) -> float:
    """stream_us's rho: the device's bandwidth over what one CTA alone streams."""
    return float(bandwidth_gbps) / LONE_CTA_GBPS


@functools.lru_cache(maxsize=64)
def _float_array(value) -> np.ndarray:
    """``value`` as a read-only 0-d float array (see ``stats.ONE``)."""
    array = np.array(float(value))
    array.setflags(write=False)
    return array


def strategy_scale(units, strategy_code, n: int) -> np.ndarray:
    """``[len(FEATURE_NAMES), n]``: each feature's unit, or 0 where the strategy (code: index
    in ``STRATEGIES``, [n] or one for all) does not pay it (``Feature.paid_by``)."""
    scale = np.repeat(units, n, axis=1)
    pays = {}
    for f, code in _PAID_BY:
        if code not in pays:
            pays[code] = np.equal(strategy_code, code)
        scale[f] *= pays[code]
    return scale


def feature_index(n: int, columns, strategy_code) -> np.ndarray:
    """``gather_features``' index into a flattened [len(FEATURE_ROWS), n] ``row_features``
    array: feature f of candidate j (``columns[j]``, ``strategy_code[j]``, or one for all) is
    row ``FEATURES[f].row`` of its column, or its ``split_merge_row`` for 'split_merge'."""
    columns = np.asarray(columns)
    source = np.repeat(FEATURE_SOURCE[:, None], columns.size, axis=1)
    merges = np.equal(strategy_code, SPLIT_MERGE)
    for f, row in _SPLIT_MERGE_ROWS:
        source[f] = np.where(merges, row, source[f])
    return source * n + columns[None, :]


def gather_features(rows, index, scale, clusters=False) -> np.ndarray:
    """Features ``[len(FEATURE_NAMES), m]`` of m candidates: ``rows.take(index)`` (see
    ``feature_index``) times ``strategy_scale``; with ``clusters``, a candidate that merges in
    clusters drops the ticket merge's features."""
    x = rows.take(index)
    x *= scale
    if clusters:
        x[F_TICKET] *= 1.0 - x[F_CLUSTER_MERGES]
    return x


def features_from_stats(num_qo_heads, num_kv_heads, head_dim, strategy_code, stats, *,
                        num_sms, ctas_per_sm, bandwidth_gbps, batch_size=0,
                        clusters=False, clustered_as=None, tile_rule="",
                        page_size=16) -> np.ndarray:
    """Feature matrix ``[n, len(FEATURE_NAMES)]`` of n candidates from their ``stats``
    ``[len(STAT_NAMES), n]`` and strategy codes (index in ``STRATEGIES``; [n] or one for all).
    The planner computes the statistics of many candidates at once in closed form;
    ``plan_features`` computes them from a built plan. ``batch_size``: the decompositions'
    requests (merge_grid's; and the clusters'). ``clusters``: the GPU merges suitable fused
    plans in clusters;
    ``clustered_as``: 1.0 or 0.0, whether the candidates merge in clusters, when that is known
    (a built plan's execution) rather than derived; ``tile_rule``: ``CostModel.tile_rule``, of
    the plans' ``page_size``."""
    ipc, slots, units = feature_constants(num_qo_heads, num_kv_heads, head_dim, num_sms,
                                          ctas_per_sm, bandwidth_gbps)
    n = np.shape(stats)[1]
    rows, stat_rows = new_feature_rows(n)
    stat_rows[:] = stats
    count_build_tiles(rows, build_tile_units(tile_rule, num_qo_heads, num_kv_heads, head_dim,
                                             page_size, num_sms), ipc, num_sms)
    index = feature_index(n, np.arange(n), strategy_code)
    cluster_batch_size = batch_size if clusters and clustered_as is None else 0
    row_features(rows, ipc, slots, num_sms, stream_ratio_of(bandwidth_gbps),
                 cluster_batch_size=cluster_batch_size, batch_size=batch_size)
    if clustered_as is not None:
        rows[R_CLUSTERED] = clustered_as
    return gather_features(rows, index, strategy_scale(units, strategy_code, n),
                           clusters=clusters).T


def plan_features(problem, chunk_tokens, chunks_per_request, strategy, *, num_sms=132,
                  ctas_per_sm=2, bandwidth_gbps=4460.0, clusters=False,
                  merge: str | None = None, tile_rule: str = "") -> np.ndarray:
    """Feature vector of one decomposition: per-chunk token counts, chunks per request and the
    strategy ('single', 'split_merge' or 'fused'). ``merge``: the plan's merge mode
    (``Plan.merge``), which says whether it merges in clusters; None: as ``execution.decide``
    would on a GPU with (``clusters``) or without thread-block clusters. ``tile_rule``: how
    tiles are counted (``CostModel.tile_rule``)."""
    stats = decomposition_stats(chunk_tokens, chunks_per_request)
    if merge is not None:
        clusters = merge == MERGE_CLUSTER
        if clusters and strategy != "fused":
            raise ValueError(f"merge: a {strategy!r} plan cannot merge in clusters")
    x = features_from_stats(problem.num_qo_heads, problem.num_kv_heads, problem.head_dim,
                            STRATEGIES.index(strategy), stats[:, None], num_sms=num_sms,
                            ctas_per_sm=ctas_per_sm, bandwidth_gbps=bandwidth_gbps,
                            batch_size=len(chunks_per_request), clusters=clusters,
                            clustered_as=None if merge is None else float(clusters),
                            tile_rule=check_tile_rule(tile_rule), page_size=problem.page_size)
    return x[0]


