"""The plan: the explicit work decomposition the GPU (or the CPU executor) runs.

The KV of every request is cut into *chunks* (contiguous token ranges). One work item is
(chunk, kv head): it reads that range of K and V once for all query heads of the GQA group and
writes one partial state per query head. Chunks are stored sorted by request, so the partials
of request b are chunks ``merge_indptr[b] : merge_indptr[b+1]``, and the partial slot of
(chunk c, query head h) is ``c * num_qo_heads + h``.

Every request has at least one chunk; a zero-length request has one empty chunk, which writes
zeros and a log-sum-exp of ``-inf``.

Strategies:
  single       every request has exactly one chunk; the partial kernel writes the output.
  split_merge  partial kernel, then a merge kernel (requests with one chunk are written
               directly by the partial kernel and skipped by the merge).
  fused        one kernel; the last CTA to finish for each (request, kv head) merges (with
               an atomic ticket, or inside a thread-block cluster on sm_90+).

How the plan runs on the GPU (its merge mode and the grid's launch order) is its
``execution``, decided by ``splitkv.core.execution.decide``: plans built here assume a GPU without
clusters and the default launch order; the planner, and ``with_execution``, decide for a
given device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import validation as V
from .execution import DEFAULT_LAUNCH_ORDER, Execution, decide
from .problem import DecodeProblem


@dataclass(frozen=True, eq=False)
class Plan:
    problem: DecodeProblem
    strategy: str
    chunk_request: np.ndarray   # int32 [num_chunks]
    chunk_start: np.ndarray     # int32 [num_chunks], token offset inside the request
    chunk_end: np.ndarray       # int32 [num_chunks], exclusive
    merge_indptr: np.ndarray    # int32 [batch_size + 1]
    predicted_us: float | None = None
    execution: Execution | None = None   # None: ``decide``'s answer without clusters

    def __post_init__(self):
        V.check_instance("problem", self.problem, DecodeProblem)
        V.check_strategy(self.strategy)
        arrays = V.check_plan_chunks(self.chunk_request, self.chunk_start, self.chunk_end,
                                     self.merge_indptr, self.problem.kv_lens,
                                     self.problem.kv_begin if self.problem.windowed else None)
        for name, arr in zip(("chunk_request", "chunk_start", "chunk_end", "merge_indptr"), arrays):
            arr = np.ascontiguousarray(arr, dtype=np.int32)
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if self.strategy == "single" and self.num_chunks != self.problem.batch_size:
            raise ValueError("strategy: 'single' needs exactly one chunk per request, "
                             f"got {self.num_chunks} chunks for {self.problem.batch_size} requests")
        if self.execution is None:
            object.__setattr__(self, "execution", decide(self))
        else:
            V.check_instance("execution", self.execution, Execution)
            if self.execution != decide(self, clusters=self.execution.merge == "cluster",
                                        launch_order=self.execution.launch_order):
                raise ValueError(f"execution: {self.execution} is not how a "
                                 f"{self.strategy} plan of these chunks can run")

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_request.size)

    @property
    def chunks_per_request(self) -> np.ndarray:
        return np.diff(self.merge_indptr)

    @property
    def num_splits(self) -> int:
        """The largest number of chunks any request is cut into (1 = no split)."""
        return int(self.chunks_per_request.max()) if self.problem.batch_size else 0

    @property
    def num_work_items(self) -> int:
        return self.num_chunks * self.problem.num_kv_heads

    @property
    def needs_merge(self) -> bool:
        # every request has at least one chunk: more chunks than requests means a split
        return self.num_chunks > self.problem.batch_size

    @property
    def merge(self) -> str:
        """The merge mode (``execution.MERGE_MODES``)."""
        return self.execution.merge

    @property
    def workspace_bytes(self) -> int:
        """Device bytes of the float32 partial states the plan writes when it merges through
        memory (partial_o and partial_lse: num_chunks x num_qo_heads x (head_dim + 1) x 4); 0
        when every request is one chunk or the chunks merge in clusters. The fused merge's
        arrival counters add 4 bytes a (request, kv head, CTA), once a wrapper has them."""
        if self.merge not in ("merge_kernel", "ticket"):
            return 0
        p = self.problem
        return self.num_chunks * p.num_qo_heads * (p.head_dim + 1) * 4

    @property
    def cluster_size(self) -> int:
        """S when the plan merges in thread-block clusters of S, else 0."""
        return self.execution.cluster_size

    @property
    def launch_order(self) -> str:
        return self.execution.launch_order

    def with_prediction(self, predicted_us: float) -> "Plan":
        """The same plan with a predicted time; the arrays were checked once, not again."""
        plan = object.__new__(Plan)
        plan.__dict__.update(self.__dict__, predicted_us=float(predicted_us))
        return plan

    def with_execution(self, *, clusters: bool = False,
                       launch_order: str = DEFAULT_LAUNCH_ORDER) -> "Plan":
        """The same chunks, run as ``decide`` says for a GPU with (or without) thread-block
        clusters and the launch order asked for."""
        execution = decide(self, clusters=clusters, launch_order=launch_order)
        if execution == self.execution:
            return self
        plan = object.__new__(Plan)
        plan.__dict__.update(self.__dict__, execution=execution)
        return plan

    @classmethod
    def _trusted(cls, problem, strategy, chunk_request, chunk_start, chunk_end, merge_indptr,
                 predicted_us=None, *, clusters: bool = False,
                 launch_order: str = DEFAULT_LAUNCH_ORDER):
        """A plan built by this module's own decomposition functions, correct by construction:
        skips the checks a hand-built plan gets (they cost more than the planning itself). The
        arrays must be contiguous int32 (``_*_chunk_arrays`` make them so); they are frozen.
        Its execution is ``decide``'s for ``clusters`` and ``launch_order``."""
        plan = object.__new__(cls)
        for arr in (chunk_request, chunk_start, chunk_end, merge_indptr):
            arr.setflags(write=False)
        plan.__dict__.update(problem=problem, strategy=strategy, chunk_request=chunk_request,
                             chunk_start=chunk_start, chunk_end=chunk_end,
                             merge_indptr=merge_indptr, predicted_us=predicted_us)
        plan.__dict__["execution"] = decide(plan, clusters=clusters, launch_order=launch_order)
        return plan

    def summary(self) -> dict:
        sizes = (self.chunk_end - self.chunk_start).astype(np.int64)
        return {
            "strategy": self.strategy,
            "num_splits": self.num_splits,
            "num_chunks": self.num_chunks,
            "num_work_items": self.num_work_items,
            "chunk_tokens_max": int(sizes.max()) if sizes.size else 0,
            "chunk_tokens_min": int(sizes.min()) if sizes.size else 0,
            "merge": self.merge,
            "cluster_size": self.cluster_size,
            "launch_order": self.launch_order,
            "workspace_bytes": self.workspace_bytes,
            "predicted_us": self.predicted_us,
        }

    def __repr__(self) -> str:
        s = self.summary()
        pred = "n/a" if self.predicted_us is None else f"{self.predicted_us:.1f} us"
        merge = s["merge"] + (f" of {s['cluster_size']}" if s["cluster_size"] else "")
        return (f"Plan(strategy={s['strategy']}, num_splits={s['num_splits']}, merge={merge}, "
                f"work_items={s['num_work_items']} ({s['num_chunks']} chunks x "
                f"{self.problem.num_kv_heads} kv heads), chunk tokens "
                f"{s['chunk_tokens_min']}..{s['chunk_tokens_max']}, predicted={pred}, "
                f"problem={self.problem!r})")

    __str__ = __repr__


def plan_from_chunk_counts(problem: DecodeProblem, chunks_per_request, strategy: str,
                           align: int = 1) -> Plan:
    """Cut request b into ``chunks_per_request[b]`` near-equal token ranges.

    Boundaries are rounded to multiples of ``align`` tokens (a tile or a page) where the length
    allows, so no chunk straddles a tile needlessly; a chunk never ends up empty unless its
    request is. Every count must be at least 1 (a ValueError otherwise); a count above
    ``max(1, ceil(n / align))`` (more chunks than a request of n tokens has tiles; one for an
    empty request) is reduced to that. The plan may hold at most ``MAX_CHUNKS`` chunks, counted
    after that reduction and before any array is made.
    """
    V.check_instance("problem", problem, DecodeProblem)
    V.check_strategy(strategy)
    counts = V.check_chunk_counts(chunks_per_request, problem.batch_size)
    return _plan_from_counts(problem, counts, strategy, align, "chunks_per_request")


def _plan_from_counts(problem: DecodeProblem, counts: np.ndarray, strategy: str, align,
                      name: str) -> Plan:
    """``plan_from_chunk_counts`` for counts already checked (int64, each >= 1); a plan of too
    many chunks is blamed on ``name``."""
    lens = problem.read_lens
    align = V.check_int("align", align, 1, V.MAX_KV_LEN, "MAX_KV_LEN: no request is longer")
    # A request of n tokens cannot have more than ceil(n / align) non-empty chunks.
    max_chunks = np.maximum(1, -(-lens // align))
    counts = np.minimum(counts, max_chunks)
    if strategy == "single" and np.any(counts > 1):
        raise ValueError("strategy: 'single' cannot split a request; use 'split_merge' or 'fused'")
    V.check_num_chunks(name, int(counts.sum()))
    return Plan._trusted(problem, strategy, *in_window(problem, _chunk_arrays(lens, counts, align)))


def in_window(problem: DecodeProblem, arrays: tuple) -> tuple:
    """Chunk arrays cut over each request's read tokens (``read_lens``), moved to start at its
    window's first token; unchanged without a window."""
    if not problem.windowed:
        return arrays
    chunk_request, chunk_start, chunk_end, merge_indptr = arrays
    shift = problem.kv_begin[chunk_request].astype(_INT32)
    return chunk_request, chunk_start + shift, chunk_end + shift, merge_indptr


# dtype objects, not the scalar types: NumPy converts a type to a dtype on every call.
_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)

# The arrays of a decomposition, without checks: the counts must already be in
# 1..max(1, ceil(len / align)). Chunk i of a request of u tiles cut into k starts at tile
# floor(i * u / k) and ends where chunk i + 1 starts, the last at the request's length. A start
# never needs clipping to the length: floor(i * u / k) <= u - 1 for i < k, and (u - 1) * align
# < len. The planner calls these directly on every decode step, so they keep NumPy calls few.

def _single_chunk_arrays(lens: np.ndarray) -> tuple[np.ndarray, ...]:
    """One chunk per request."""
    n = lens.size
    indptr = np.arange(n + 1, dtype=_INT32)
    return indptr[:n], np.zeros(n, _INT32), lens.astype(_INT32), indptr


def _uniform_chunk_arrays(batch_size: int, length: int, count: int,
                          align: int) -> tuple[np.ndarray, ...]:
    """``batch_size`` requests of ``length`` tokens, each cut into ``count`` chunks: one
    request's boundaries, repeated."""
    bounds = np.arange(count + 1, dtype=_INT64)
    bounds *= -(-length // align)
    bounds //= count
    bounds *= align
    bounds[-1] = length
    chunk_start = np.empty((batch_size, count), _INT32)
    chunk_start[:] = bounds[:-1]
    chunk_end = np.empty((batch_size, count), _INT32)
    chunk_end[:] = bounds[1:]
    return (np.arange(batch_size, dtype=_INT32).repeat(count), chunk_start.reshape(-1),
            chunk_end.reshape(-1), np.arange(0, batch_size * count + 1, count, dtype=_INT32))


def _chunk_arrays(lens: np.ndarray, counts: np.ndarray, align: int,
                  units: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Request b (``lens`` int64) cut into ``counts[b]`` (int64) chunks; ``units``: each
    request's length in ``align`` units, ceil(len / align), if the caller has it (int64).
    NumPy methods, not the slower module functions, and int64 for the products (exact for any
    int32 length)."""
    n = lens.size
    merge_indptr = np.empty(n + 1, _INT32)
    merge_indptr[0] = 0
    ends = merge_indptr[1:]                              # one past each request's last chunk
    np.add.accumulate(counts, out=ends)
    total = int(ends[-1]) if n else 0
    if total == n:
        return _single_chunk_arrays(lens)
    chunk_request = np.arange(n, dtype=_INT32).repeat(counts)
    start = np.arange(total, dtype=_INT64)
    start -= (ends - counts).repeat(counts)             # chunk index inside its request
    if units is None:
        units = (lens + (align - 1)) // align
    start *= units.repeat(counts)
    start //= counts.repeat(counts)
    start *= align
    chunk_start = start.astype(_INT32)
    chunk_end = np.empty(total, _INT32)
    chunk_end[:-1] = chunk_start[1:]
    chunk_end.put(ends - 1, lens)
    return chunk_request, chunk_start, chunk_end, merge_indptr


def plan_fixed_splits(problem: DecodeProblem, num_splits: int, strategy: str | None = None,
                      align: int = 1) -> Plan:
    """Every request cut into ``num_splits`` chunks (fewer if it is too short); ``num_splits``
    and the plan's chunks in all at most ``MAX_CHUNKS``."""
    V.check_instance("problem", problem, DecodeProblem)
    num_splits = V.check_int("num_splits", num_splits, 1, V.MAX_CHUNKS, "MAX_CHUNKS")
    if strategy is None:
        strategy = "single" if num_splits == 1 else "split_merge"
    V.check_strategy(strategy)
    counts = np.full(problem.batch_size, num_splits, _INT64)
    return _plan_from_counts(problem, counts, strategy, align, "num_splits")


def plan_chunk_tokens(problem: DecodeProblem, chunk_tokens: int, strategy: str,
                      align: int = 1) -> Plan:
    """Balanced for ragged batches: one chunk size for all, so long requests get more chunks;
    at most ``MAX_CHUNKS`` chunks in all."""
    V.check_instance("problem", problem, DecodeProblem)
    chunk_tokens = V.check_int("chunk_tokens", chunk_tokens, 1, V.MAX_KV_LEN,
                               "MAX_KV_LEN: no request is longer")
    V.check_strategy(strategy)
    counts = np.maximum(1, -(-problem.read_lens // chunk_tokens))
    if strategy == "single":
        counts = np.ones_like(counts)
    return _plan_from_counts(problem, counts, strategy, align, "chunk_tokens")
