"""How a plan runs on the GPU, decided in one place: how its partial states merge and in which
order the grid runs its chunks. The planner decides when it builds a plan (``decide``), the
``Plan`` carries the answer (``Plan.execution``), the cost model predicts from it and the
runtime executes it.

Merge modes:
  none          no request is split: the partial kernel writes the output.
  merge_kernel  'split_merge': a second kernel merges the partials in the workspace.
  ticket        'fused': the last CTA of each (request, kv head) to finish, found with an
                atomic ticket, merges the partials from the workspace.
  cluster       'fused' on sm_90+: the S chunks of a request run as one thread-block cluster
                and merge through distributed shared memory (no workspace, no ticket).

When a fused plan may merge in clusters (``fused_cluster_size``): every request cut into
exactly S chunks, S in ``CLUSTER_SIZES``, no chunk longer than ``CLUSTER_MAX_CHUNK_TOKENS``,
and for S > 2 a grid of at most ``CLUSTER_MAX_WIDE_CTAS`` CTAs. Clusters save the ticket's round
trips to L2 but cost streaming time when CTAs run long or when a grid holds many wide clusters
(the measurements are in docs/design/kernel.md, the cluster merge).

Launch orders (``LAUNCH_ORDERS``): the GPU deals CTAs onto its SMs in grid order, so a long
piece of work dealt last runs alone after the rest finished; running the long work first
leaves only short work for the end (LPT list scheduling). Cluster grids keep plan order: a
cluster's CTAs must be neighbours in the grid.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .geometry import ctas_per_kv_head

MERGE_NONE, MERGE_KERNEL, MERGE_TICKET, MERGE_CLUSTER = "none", "merge_kernel", "ticket", "cluster"
MERGE_MODES = (MERGE_NONE, MERGE_KERNEL, MERGE_TICKET, MERGE_CLUSTER)

CLUSTER_SIZES = (2, 4, 8)
CLUSTER_MAX_CHUNK_TOKENS = 1024
CLUSTER_MAX_WIDE_CTAS = 64

LAUNCH_ORDERS = ("longest_chunks", "longest_requests", "plan")
DEFAULT_LAUNCH_ORDER = "longest_chunks"


@dataclass(frozen=True)
class Execution:
    """How one plan runs: its merge mode, the cluster size S of a 'cluster' merge (else 0),
    and the order of its chunks in the grid."""

    merge: str = MERGE_NONE
    cluster_size: int = 0
    launch_order: str = DEFAULT_LAUNCH_ORDER

    def __post_init__(self):
        if self.merge not in MERGE_MODES:
            raise ValueError(f"merge: expected one of {MERGE_MODES}, got {self.merge!r}")
        if (self.merge == MERGE_CLUSTER) != (self.cluster_size in CLUSTER_SIZES):
            raise ValueError(f"cluster_size: a 'cluster' merge needs one of {CLUSTER_SIZES}, "
                             f"any other merge 0; got {self.cluster_size!r} for {self.merge!r}")
        if self.launch_order not in LAUNCH_ORDERS:
            raise ValueError(f"launch_order: expected one of {LAUNCH_ORDERS}, "
                             f"got {self.launch_order!r}")
        if self.merge == MERGE_CLUSTER and self.launch_order != "plan":
            raise ValueError("launch_order: a 'cluster' merge runs in plan order")

    def describe(self) -> str:
        """The merge, in words (``splitkv plan`` prints it)."""
        return {MERGE_NONE: "none (every request in one chunk)",
                MERGE_KERNEL: "a second kernel",
                MERGE_TICKET: "by the last CTA of each request (atomic ticket)",
                MERGE_CLUSTER: f"in thread-block clusters of {self.cluster_size}, through "
                               "distributed shared memory (sm_90+)"}[self.merge]


def check_launch_order(launch_order: str) -> str:
    if launch_order not in LAUNCH_ORDERS:
        raise ValueError(f"launch_order: expected one of {LAUNCH_ORDERS}, got {launch_order!r}")
    return launch_order


def fused_cluster_size(strategy: str, chunks_per_request, longest_chunk: int, num_ctas: int) -> int:
    """S when a 'fused' plan may merge inside thread-block clusters of S (the rule in the module
    docstring), 0 otherwise."""
    if strategy != "fused" or len(chunks_per_request) == 0 or longest_chunk > CLUSTER_MAX_CHUNK_TOKENS:
        return 0
    s = int(chunks_per_request[0])
    if s not in CLUSTER_SIZES or (s > 2 and num_ctas > CLUSTER_MAX_WIDE_CTAS):
        return 0
    return s if all(int(c) == s for c in chunks_per_request) else 0


def plan_cluster_size(plan) -> int:
    """``fused_cluster_size`` of a built plan: the cheap tests first, as planning asks on every
    decode step."""
    if plan.strategy != "fused" or plan.num_chunks == 0:
        return 0
    batch = plan.problem.batch_size
    s = plan.num_chunks // batch
    if s not in CLUSTER_SIZES or s * batch != plan.num_chunks or int(plan.merge_indptr[1]) != s:
        return 0
    counts = plan.chunks_per_request
    if (counts != s).any():                 # one NumPy call, not a Python loop over requests
        return 0
    longest = int((plan.chunk_end - plan.chunk_start).max())
    group = plan.problem.num_qo_heads // plan.problem.num_kv_heads
    # every request has s chunks: the first request's count stands for all
    return fused_cluster_size(plan.strategy, counts[:1], longest,
                              plan.num_work_items * ctas_per_kv_head(group))


def decide(plan, *, clusters: bool = False, launch_order: str = DEFAULT_LAUNCH_ORDER) -> Execution:
    """How ``plan`` runs on a GPU that has thread-block clusters (``clusters``) with the grid
    order ``launch_order`` asked for (cluster grids always run in plan order)."""
    # every request has at least one chunk, so more chunks than requests means a split
    if plan.num_chunks <= plan.problem.batch_size:
        return _execution(MERGE_NONE, 0, launch_order)
    if plan.strategy == "split_merge":
        return _execution(MERGE_KERNEL, 0, launch_order)
    size = plan_cluster_size(plan) if clusters else 0
    if size:
        return _execution(MERGE_CLUSTER, size, "plan")
    return _execution(MERGE_TICKET, 0, launch_order)


# Every valid Execution, made once: ``decide`` runs on every plan, and building and checking a
# frozen dataclass costs more than the rest of it.
_EXECUTIONS = {(e.merge, e.cluster_size, e.launch_order): e for e in (
    *(Execution(merge, 0, order) for merge in (MERGE_NONE, MERGE_KERNEL, MERGE_TICKET)
      for order in LAUNCH_ORDERS),
    *(Execution(MERGE_CLUSTER, size, "plan") for size in CLUSTER_SIZES))}


def _execution(merge: str, cluster_size: int, launch_order) -> Execution:
    """``Execution(merge, cluster_size, launch_order)``, the shared one when it is valid."""
    try:
        return _EXECUTIONS[merge, cluster_size, launch_order]
    except (KeyError, TypeError):           # invalid: the constructor says why
        return Execution(merge, cluster_size, launch_order)


def may_cluster(clusters: bool, max_len: int) -> bool:
    """Whether any decomposition of a batch whose longest request has ``max_len`` tokens can
    merge in clusters: at most the largest cluster size of the longest chunks."""
    return clusters and max_len <= max(CLUSTER_SIZES) * CLUSTER_MAX_CHUNK_TOKENS


# 1 at the cluster sizes, indexed by a chunk count (larger counts clip to the final 0).
_CLUSTER_SIZE_OK = np.zeros(max(CLUSTER_SIZES) + 2)
_CLUSTER_SIZE_OK[list(CLUSTER_SIZES)] = 1.0
_CLUSTER_SIZE_OK.setflags(write=False)


def clustered(out, num_chunks, max_chunk_tokens, max_splits, batch_size: int,
              items_per_chunk: int) -> np.ndarray:
    """``fused_cluster_size(...) > 0`` of many decompositions at once, in closed form, as 1.0 or
    0.0 into ``out`` (the planner's candidates, given their statistics as float rows): every
    request has max_splits chunks (the counts, each at most max_splits, sum to batch_size x
    max_splits), max_splits is a cluster size, no chunk is longer than
    ``CLUSTER_MAX_CHUNK_TOKENS``, and clusters wider than 2 have a small grid."""
    np.take(_cluster_sizes_ok(batch_size, items_per_chunk), max_splits.astype(np.intp),
            mode="clip", out=out)
    out *= np.equal(num_chunks, max_splits * float(batch_size))
    out *= np.less_equal(max_chunk_tokens, CLUSTER_MAX_CHUNK_TOKENS)
    return out


@functools.lru_cache(maxsize=256)
def _cluster_sizes_ok(batch_size: int, items_per_chunk: int) -> np.ndarray:
    """``_CLUSTER_SIZE_OK`` less the sizes past 2 whose grid of batch_size x S chunks exceeds
    ``CLUSTER_MAX_WIDE_CTAS``: where every request has S chunks, the grid's test depends on S
    alone, so ``clustered`` reads it from this table (the same on every step of a batch)."""
    ok = _CLUSTER_SIZE_OK.copy()
    for size in CLUSTER_SIZES:
        if size > 2 and size * batch_size * items_per_chunk > CLUSTER_MAX_WIDE_CTAS:
            ok[size] = 0.0
    ok.setflags(write=False)
    return ok


def launch_order(chunk_request, chunk_tokens, kv_lens, policy: str = DEFAULT_LAUNCH_ORDER):
    """Plan indices of a plan's chunks in the order the kernel's grid runs them. Sorts are
    stable: ties, and so a uniform plan, keep plan order.

    'longest_chunks': the longest chunks first, whatever their request (LPT on work items);
    'longest_requests': the chunks of the longest requests first, each request's chunks
        together;
    'plan': plan order (requests in batch order).
    """
    if policy == "plan":
        return np.arange(len(chunk_tokens))
    if policy == "longest_chunks":
        key = np.asarray(chunk_tokens)
    elif policy == "longest_requests":
        key = np.asarray(kv_lens, dtype=np.int64)[np.asarray(chunk_request, dtype=np.intp)]
    else:
        raise ValueError(f"launch_order: expected one of {LAUNCH_ORDERS}, got {policy!r}")
    return np.argsort(-key, kind="stable")


def grid_order(plan) -> np.ndarray:
    """Plan indices of ``plan``'s chunks in grid order, by its execution's launch order."""
    if plan.execution.launch_order == "longest_chunks":    # the default, with one call fewer:
        return np.argsort(plan.chunk_start - plan.chunk_end, kind="stable")   # -(chunk tokens)
    return launch_order(plan.chunk_request, plan.chunk_end - plan.chunk_start,
                        plan.problem.kv_lens, plan.execution.launch_order)
