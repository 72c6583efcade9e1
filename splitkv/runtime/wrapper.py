"""Plan-then-run decode attention on the GPU.

    wrapper = BatchDecodeWrapper(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                 dtype="bfloat16")
    wrapper.plan(PageTable.from_block_table(block_table, seq_lens, 16))   # host work + 1 upload
    for layer in layers:                                                # launches only
        out = wrapper.run(q[layer], k_cache[layer], v_cache[layer])

``plan()`` chooses the decomposition (the adaptive planner, or what the caller forces),
uploads it, and sizes the workspace. ``run()`` checks shapes and launches one or two kernels
on the caller's stream: no host synchronisation and, when ``out`` (and ``lse``) are given, no
allocation, so it can be captured in a CUDA graph and replayed; one plan serves every layer.
A captured graph holds the plan's grid and buffers: capture again after the next ``plan()``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import validation as V
from ..plan import Plan
from ..problem import DecodeProblem, PageTable
from .arrays import as_cupy_stream, as_device_array, cupy_storage_dtype
from ..execution import check_launch_order, grid_order
from ..geometry import (RECORD_HEADER_INTS, RECORD_INTS, RECORD_PAGES, THREADS_PER_CTA,
                        TILE_TOKENS, ctas_per_kv_head)
from .kernel_source import DecodeVariant
from .launch import FLOAT32, INT32, INT64, POINTER, PdlLaunch
from .modules import get_decode_kernels

LOG2E = 1.4426950408889634


def first_pages(page_table: PageTable, chunk_request, chunk_start,
                count: int = RECORD_PAGES) -> np.ndarray:
    """[num_chunks, count] page ids of each chunk's first pages (from the page holding its
    first token), carried in its record so the kernel need not look them up before its first
    copies. Entries past the request's last page repeat that page (never read)."""
    entries = (page_table.kv_indptr[chunk_request] + chunk_start // page_table.page_size)[:, None] \
        + np.arange(count)
    last = np.maximum(page_table.kv_indptr[np.asarray(chunk_request) + 1] - 1, 0)[:, None]
    if page_table.kv_indices.size == 0:
        return np.zeros(entries.shape, dtype=np.int32)
    return page_table.kv_indices[np.minimum(entries, last)]


def record_pages_needed(page_size: int, stages: int) -> int:
    """Pages the first ``stages`` tiles of a page-aligned chunk span."""
    return -(-stages * TILE_TOKENS // page_size)


def pages_fit_record(plan: Plan, page_size: int, stages: int) -> bool:
    """Whether the kernel may take its first ``stages`` tiles' page ids from the chunk
    records: every chunk starts on a page boundary and those tiles span at most RECORD_PAGES
    pages."""
    return (record_pages_needed(page_size, stages) <= RECORD_PAGES
            and not np.any(plan.chunk_start % page_size))


def chunk_records(plan: Plan, page_table: PageTable, order, record_pages: int) -> np.ndarray:
    """[num_chunks, RECORD_INTS] int32: the kernel's chunk records, one per CTA row of the grid,
    in ``order`` (plan indices in launch order). Record r describes chunk c = order[r]: its
    request, first and end token, the request's first page-table entry, the request's chunk
    range (where its partials are), c itself (the partial rows it writes) and, when
    ``record_pages`` > 0, the page ids of its first ``record_pages`` pages."""
    order = np.asarray(order, dtype=np.intp)
    req = plan.chunk_request[order]
    start = plan.chunk_start[order]
    records = np.zeros((plan.num_chunks, RECORD_INTS), dtype=np.int32)
    records[:, 0] = req
    records[:, 1] = start
    records[:, 2] = plan.chunk_end[order]
    records[:, 3] = page_table.kv_indptr[req]
    records[:, 4] = plan.merge_indptr[req]
    records[:, 5] = plan.merge_indptr[req + 1]
    records[:, 6] = order
    if record_pages:
        records[:, RECORD_HEADER_INTS:RECORD_HEADER_INTS + record_pages] = \
            first_pages(page_table, req, start, record_pages)
    return records


class BatchDecodeWrapper:
    """Decode attention over a paged KV cache (NHD layout) with an adaptive split-KV plan.

    Shapes: q [batch, num_qo_heads, head_dim]; k_cache, v_cache [num_pages, page_size,
    num_kv_heads, head_dim] (a view with other page/token strides works if rows stay 16-byte
    aligned); out [batch, num_qo_heads, head_dim] in the input dtype; lse [batch, num_qo_heads]
    float32, natural log. Inputs float16 or bfloat16 (bfloat16 may be given as uint16 bits).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", profile=None, stages: int | None = None,
                 max_registers: int | None = None, use_clusters: bool | None = None,
                 launch_order: str = "longest_chunks", pdl: bool | None = None):
        self.num_qo_heads, self.num_kv_heads = V.check_heads(num_qo_heads, num_kv_heads)
        self.head_dim = V.check_head_dim(head_dim)
        self.page_size = V.check_int("page_size", page_size, 1)
        self.dtype = V.check_dtype("dtype", dtype)
        self.group_size = self.num_qo_heads // self.num_kv_heads
        # `stages` (pipeline depth) and `max_registers` (per thread, 0 = the compiler's choice)
        # are tuning knobs for experiments; the defaults suit the H200.
        self.variant = DecodeVariant.for_problem(
            self.dtype, self.head_dim, self.group_size,
            0 if stages is None else V.check_int("stages", stages, 2),
            0 if max_registers is None else V.check_int("max_registers", max_registers, 0))
        self.head_tile_groups = ctas_per_kv_head(self.group_size)
        # None or True: a fused plan that suits clusters (execution.fused_cluster_size) merges
        # inside thread-block clusters when the GPU has them (sm_90+), True raising where it has
        # none; False: always the atomic ticket. A cluster variant compiles (about a second) the
        # first time a plan needs it.
        if use_clusters is not None and not isinstance(use_clusters, bool):
            raise TypeError(f"use_clusters: expected None, True or False, got {use_clusters!r}")
        self.use_clusters = use_clusters
        # The order the grid runs a ragged plan's chunks in (execution.launch_order): by default
        # the longest chunks first, so no long chunk starts late and runs alone.
        self.launch_order = check_launch_order(launch_order)
        # None or True: launch with programmatic dependent launch where the GPU has it (sm_90+;
        # True raises where it has none): a kernel's CTAs start while the kernel before it in
        # the stream finishes, read the plan's records, and wait for it before touching q, K/V
        # or the workspace (runtime/launch.py). False: plain launches.
        # "early" / "late" force where the partial kernel lets the next kernel launch (at its
        # start, or once its CTAs finished streaming; True and None: "late"), and like True
        # raise where the GPU has no PDL. Plan on the stream you run on: a run on another
        # stream waits for plan()'s upload with an event, which serialises it with the kernel
        # before it and forgoes the overlap.
        if pdl is not None and not isinstance(pdl, bool) and pdl not in PDL_TRIGGERS:
            raise ValueError(f"pdl: expected None, True, False or one of {PDL_TRIGGERS}, "
                             f"got {pdl!r}")
        self.pdl = pdl
        self.pdl_spread = None      # experiments: force _pdl_spread's answer
        self._profile = profile
        self._plan: Plan | None = None
        self._device_id: int | None = None
        self._meta_capacity = 0
        self._workspace_capacity = (0, 0)

    # ------------------------------------------------------------------ plan
    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    def plan(self, page_table: PageTable, *, num_splits: int | None = None,
             strategy: str | None = None, plan: Plan | None = None,
             sm_scale: float | None = None, stream=None) -> Plan:
        """Choose and upload the decomposition for this batch. Host work plus one upload.

        num_splits / strategy force the planner's hand; ``plan`` bypasses it, and runs with the
        execution (merge mode, launch order) this wrapper's options give it on this device
        (``Plan.with_execution``). Returns the plan as it runs.
        """
        import cupy

        V.check_instance("page_table", page_table, PageTable)
        if page_table.page_size != self.page_size:
            raise ValueError(f"page_table: page_size {page_table.page_size} differs from the "
                             f"wrapper's page_size {self.page_size}")
        problem = DecodeProblem.from_page_table(page_table, self.num_qo_heads, self.num_kv_heads,
                                                self.head_dim, self.dtype)
        clusters = self._clusters_enabled()
        if plan is not None:
            V.check_instance("plan", plan, Plan)
            V.check_plan_for_table(plan, page_table, num_qo_heads=self.num_qo_heads,
                                   num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                   dtype=self.dtype)
            chosen = plan.with_execution(clusters=clusters, launch_order=self.launch_order)
        else:
            from ..planner import choose_plan

            model = self.profile.cost_model()
            if not clusters:                     # predict the ticket merge that will run
                model = model.with_clusters(False)
            chosen = choose_plan(problem, model, num_splits, strategy,
                                 launch_order=self.launch_order)
        sm_scale_log2 = np.float32(V.check_sm_scale(sm_scale, self.head_dim) * LOG2E)
        max_page = int(page_table.kv_indices.max()) if page_table.kv_indices.size else -1
        if max_page >= 2**31:
            raise ValueError("page_table: page indices must be < 2**31")

        self._device_id = cupy.cuda.runtime.getDevice()
        s = as_cupy_stream(stream)
        self._kernels = get_decode_kernels(replace(self.variant, cluster=chosen.cluster_size))
        self._pages_in_record = pages_fit_record(chosen, self.page_size,
                                                 self._kernels.variant.stages)
        meta = self._upload(page_table, chosen, s)
        self._ensure_workspace(chosen, s)
        self._ready.record(s)          # run() on another stream waits for the upload
        self._plan_stream_ptr = s.ptr
        self._plan, self._max_page = chosen, max_page
        self._bind_arguments(chosen, meta, sm_scale_log2)
        return chosen

    @property
    def cluster_size(self) -> int:
        """Cluster size the current plan's fused merge runs in; 0 when it uses the ticket."""
        return self._kernels.variant.cluster if self._plan is not None else 0

    def _clusters_enabled(self) -> bool:
        """Whether fused plans may merge in clusters on the current device."""
        return _sm90_option("use_clusters", self.use_clusters, "thread-block clusters")

    def _pdl_enabled(self) -> bool:
        """Whether launches use programmatic dependent launch on the current device."""
        return _sm90_option("pdl", self.pdl, "programmatic dependent launch")

    @property
    def pdl_active(self) -> bool:
        """Whether the current plan launches with programmatic dependent launch."""
        return self._plan is not None and self._pdl_partial is not None

    def _pdl_spread(self, num_ctas: int) -> bool:
        """Whether a PDL launch of ``num_ctas`` CTAs reserves more than half an SM's shared
        memory, so that the CTA scheduler must place them one per SM: it places a PDL grid while
        the kernel before it still holds the SMs, and a grid that a plain launch spreads one
        CTA per SM can then land two to an SM (H200: b1_n32k fused/16 7% slower). Not for
        clusters of 4 or 8: each must find that many free SMs of one GPC at once, and spread
        they wait for the previous grid to leave (H200: b1_n1k fused/8 5.57 us unspread, 5.90
        spread; clusters of 2 gain from spreading like plain grids)."""
        if self.pdl_spread is not None:
            return self.pdl_spread
        from . import device_info

        return num_ctas <= device_info()["num_sms"] and self._kernels.variant.cluster <= 2

    def _one_per_sm_bytes(self, shared: int) -> int:
        """Dynamic shared memory that leaves no room for a second CTA on the SM."""
        from . import device_info

        info = device_info()
        spread = min(max(shared, info["shared_per_sm"] // 2 + 16), info["shared_per_block_optin"])
        kernel = self._kernels.partial
        if kernel.max_dynamic_shared_size_bytes < spread:
            kernel.max_dynamic_shared_size_bytes = spread
        return spread

    @property
    def profile(self):
        """The cost-model profile plans are chosen with: the one given (a Profile or a path),
        else ``load_profile``'s answer for this device."""
        if self._profile is None or isinstance(self._profile, str):
            from ..planner.profiles import load_profile
            from . import device_info

            info = device_info()
            self._profile = load_profile(path=self._profile, device_name=info["name"],
                                         num_sms=info["num_sms"])
        return self._profile

    def _upload(self, page_table: PageTable, plan: Plan, stream) -> dict:
        """All per-plan integer metadata in one pinned host buffer and one async copy. Both
        buffers keep their capacity across plans; before the pinned one is rewritten, the
        previous copy out of it must have finished (a host wait on that small copy only)."""
        import cupy

        pages = (record_pages_needed(self.page_size, self._kernels.variant.stages)
                 if self._pages_in_record else 0)
        chunk_info = chunk_records(plan, page_table, grid_order(plan), pages)
        parts = {"chunk_info": chunk_info.ravel(), "kv_indices": page_table.kv_indices,
                 "merge_indptr": plan.merge_indptr}
        sizes = [-(-max(1, a.size) // 4) * 4 for a in parts.values()]   # 16-byte aligned parts
        total = int(sum(sizes))
        if total > self._meta_capacity:
            self._meta_capacity = max(total, 2 * self._meta_capacity)
            self._meta_host = cupy.cuda.alloc_pinned_memory(self._meta_capacity * 4)
            self._meta_device = cupy.empty(self._meta_capacity, dtype=np.int32)
            self._ready = cupy.cuda.Event(disable_timing=True)
        else:
            self._ready.synchronize()
        host = np.frombuffer(self._meta_host, dtype=np.int32, count=total)
        offset, views = 0, {}
        for (name, arr), size in zip(parts.items(), sizes):
            host[offset:offset + arr.size] = arr
            views[name] = self._meta_device[offset:offset + size]
            offset += size
        self._meta_device[:total].set(host, stream=stream)
        return views

    def _ensure_workspace(self, plan: Plan, stream) -> None:
        import cupy

        # a cluster merge keeps its partials in shared memory: no workspace
        merges_in_memory = plan.merge in ("merge_kernel", "ticket")
        rows = plan.num_chunks * self.num_qo_heads if merges_in_memory else 1
        counters = max(1, plan.problem.batch_size * self.num_kv_heads * self.head_tile_groups)
        cap_rows, cap_counters = self._workspace_capacity
        if rows > cap_rows:
            self._partial_o = cupy.empty(rows * self.head_dim, dtype=np.float32)
            self._partial_lse = cupy.empty(rows, dtype=np.float32)
            cap_rows = rows
        if counters > cap_counters:
            # Zeroed once: a fused run leaves every ticket counter at 0 again (atomicInc wraps
            # on the last arrival), so later plans need no fill (a launch per plan() call).
            with stream:                # on the stream the kernels will follow
                self._counters = cupy.zeros(counters, dtype=np.uint32)
            cap_counters = counters
        self._workspace_capacity = (cap_rows, cap_counters)

    def _bind_arguments(self, plan: Plan, meta: dict, sm_scale_log2) -> None:
        """Everything a launch needs that does not depend on the tensors, built once per plan."""
        partial_grid = (plan.num_chunks * self.num_kv_heads * self.head_tile_groups,)
        shared = self._kernels.variant.shared_bytes
        pdl = self._pdl_enabled()
        # where a PDL partial kernel lets the next kernel launch: 'late' unless asked (see
        # PDL_TRIGGERS; measured on the H200, neither wins everywhere); plain launches ignore it
        pdl_early = pdl and self.pdl == "early"
        self._partial_launch = (partial_grid, (THREADS_PER_CTA,), shared)
        self._partial_tail = (meta["kv_indices"], meta["chunk_info"])
        self._partial_consts = (self._partial_o, self._partial_lse, self._counters,
                                np.int32(self.num_qo_heads), np.int32(self.num_kv_heads),
                                np.int32(self.head_tile_groups), np.int32(self.page_size),
                                sm_scale_log2, np.int32(plan.merge == "ticket"),
                                np.int32(self._pages_in_record), np.int32(pdl_early))
        self._merge_launch = None
        if plan.merge == "merge_kernel":
            # one thread per (request, qo head, 4 dims)
            slots = plan.problem.batch_size * self.num_qo_heads * (self.head_dim // 4)
            self._merge_launch = ((-(-slots // THREADS_PER_CTA),), (THREADS_PER_CTA,),
                                  (self._partial_o, self._partial_lse, meta["merge_indptr"]),
                                  (np.int32(plan.problem.batch_size), np.int32(self.num_qo_heads)))
        self._pdl_partial = self._pdl_merge = None
        if pdl:
            if self._pdl_spread(partial_grid[0]):
                shared = self._one_per_sm_bytes(shared)
            self._pdl_partial = PdlLaunch(self._kernels.partial, partial_grid,
                                          (THREADS_PER_CTA,), shared, PARTIAL_PARAMS)
            self._pdl_partial_tail = _plain(self._partial_tail)
            self._pdl_partial_consts = _plain(self._partial_consts)
            if self._merge_launch is not None:
                grid, block, head, tail = self._merge_launch
                self._pdl_merge = PdlLaunch(self._kernels.merge, grid, block, 0, MERGE_PARAMS)
                self._pdl_merge_args = (_plain(head), _plain(tail))

    # ------------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache, *, out=None, lse=None, return_lse: bool = False,
            stream=None):
        """Launch the planned kernels. Returns ``out`` or ``(out, lse)`` if ``return_lse`` or
        ``lse`` is given. Raises before any launch if an input does not match the plan."""
        import cupy

        plan = self._plan
        if plan is None:
            raise RuntimeError("run: call plan() first")
        batch = plan.problem.batch_size
        qa = as_device_array("q", q)
        ka = as_device_array("k_cache", k_cache)
        va = as_device_array("v_cache", v_cache)
        V.check_device_decode_arrays(qa, ka, va, batch_size=batch, num_qo_heads=self.num_qo_heads,
                                     num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                     page_size=self.page_size, dtype=self.dtype,
                                     max_page=self._max_page, device=self._device_id)
        want_lse = return_lse or lse is not None
        s = as_cupy_stream(stream)
        if out is None:
            with s:
                out = cupy.empty((batch, self.num_qo_heads, self.head_dim),
                                 dtype=cupy_storage_dtype(self.dtype))
        oa = as_device_array("out", out)
        V.check_device_output("out", oa, (batch, self.num_qo_heads, self.head_dim), self.dtype)
        lse_ptr = 0
        if want_lse:
            if lse is None:
                with s:
                    lse = cupy.empty((batch, self.num_qo_heads), dtype=np.float32)
            la = as_device_array("lse", lse)
            V.check_device_output("lse", la, (batch, self.num_qo_heads), "float32")
            lse_ptr = la.ptr
        if s.ptr != self._plan_stream_ptr:
            # Order this stream after plan()'s upload. Inside a graph capture a cross-stream
            # wait would pull outside work into the graph, so wait on the host instead.
            if s.is_capturing():
                self._ready.synchronize()
            else:
                s.wait_event(self._ready)
        if batch:
            self._launch(qa.ptr, ka.ptr, va.ptr, ka.strides[0], ka.strides[1], oa.ptr, lse_ptr, s)
        return (out, lse) if want_lse else out

    def _launch(self, q_ptr, k_ptr, v_ptr, page_stride, token_stride, out_ptr, lse_ptr, stream):
        if self._pdl_partial is not None:
            import cupy

            # the driver launches in the current context: make it the plan's device's (CuPy's
            # own launches look the device up the same way)
            with cupy.cuda.Device(self._device_id):
                self._pdl_partial((q_ptr, k_ptr, v_ptr, page_stride, token_stride,
                                   *self._pdl_partial_tail, out_ptr, lse_ptr,
                                   *self._pdl_partial_consts), stream.ptr)
                if self._pdl_merge is not None:
                    head, tail = self._pdl_merge_args
                    self._pdl_merge((*head, out_ptr, lse_ptr, *tail), stream.ptr)
            return
        ptr = np.uint64
        grid, block, shared = self._partial_launch
        self._kernels.partial(
            grid, block,
            (ptr(q_ptr), ptr(k_ptr), ptr(v_ptr), np.int64(page_stride), np.int64(token_stride),
             *self._partial_tail, ptr(out_ptr), ptr(lse_ptr), *self._partial_consts),
            shared_mem=shared, stream=stream)
        if self._merge_launch is not None:
            grid, block, head, tail = self._merge_launch
            self._kernels.merge(grid, block, (*head, ptr(out_ptr), ptr(lse_ptr), *tail),
                                stream=stream)


def _sm90_option(name: str, wanted, feature: str) -> bool:
    """An option that needs compute capability 9.0: None (use it where the device has it),
    False (never), or anything true (use it, raising where the device has none)."""
    from . import device_info

    info = device_info()
    has_it = int(info["cc"]) >= 90
    if wanted and not has_it:
        raise ValueError(f"{name}: {info['name']} (compute capability {info['cc']}) has no "
                         f"{feature}; it needs compute capability 9.0 or newer")
    return has_it and wanted is not False


def _plain(args) -> tuple:
    """Kernel arguments as plain Python numbers for ``PdlLaunch``: device arrays as their
    pointers, NumPy scalars as ints or floats."""
    return tuple(a.data.ptr if hasattr(a, "data") and hasattr(a.data, "ptr")
                 else float(a) if isinstance(a, (float, np.floating)) else int(a) for a in args)


# Where a PDL partial kernel lets the next kernel launch: 'early', as soon as its CTAs read
# their records; 'late', once every CTA finished streaming its chunk.
PDL_TRIGGERS = ("early", "late")

# The kernels' parameter kinds (decode.cu's decode_partial and merge_partials), for PdlLaunch.
PARTIAL_PARAMS = (*(POINTER,) * 3, INT64, INT64, *(POINTER,) * 7, *(INT32,) * 4, FLOAT32,
                  *(INT32,) * 3)
MERGE_PARAMS = (*(POINTER,) * 5, INT32, INT32)
