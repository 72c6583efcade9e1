"""Plan-then-run decode attention on the GPU.

    wrapper = BatchDecodeWrapper(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                 dtype="bfloat16")
    wrapper.plan(PageTable.from_block_table(block_table, seq_lens, 16))   # host work + 1 upload
    for layer in layers:                                                # launches only
        out = wrapper.run(q[layer], k_cache[layer], v_cache[layer])

``plan()`` chooses the decomposition (the adaptive planner, or what the caller forces), uploads
it, sizes the workspace and builds the launches. ``run()`` checks shapes and launches one or two
kernels on the caller's stream: no host synchronisation and, when ``out`` (and ``lse``) are
given, no allocation, so it can be captured in a CUDA graph and replayed; one plan serves every
layer. A captured graph holds the plan's grid and buffers: capture again after the next
``plan()`` -- unless the wrapper is graph-stable (``use_cuda_graph=True``): then ``run()``
launches a fixed grid sized for a capacity, reading the current plan from buffers whose
addresses never change, and ``plan()`` rewrites those buffers, so one graph captured once
replays every later plan. Runs of one wrapper on several streams (or threads) are ordered one
after another (they share its workspace: ``records.StreamChain``).

``plan(qo_indptr=)`` is multi-token decode (1-16 query rows a request, causal among the new
tokens; ``max_q_len=`` sizes a graph-stable wrapper for it); ``window_left``,
``logits_soft_cap`` and ``run(sinks=)`` are the attention variants (``core.variants``).

The plan says how it runs (``Plan.execution``: merge mode, cluster size, launch order); the
wrapper executes that. Its parts: ``records`` (chunk records and the upload), ``workspace``,
``features`` (what the GPU offers), ``launch`` (``cuLaunchKernelEx``), ``kernel_abi`` (the
kernels' argument structs).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np

from ..core import fp8
from ..core import validation as V
from ..core.execution import MERGE_KERNEL, check_launch_order, grid_order
from ..core.geometry import MAX_HEADS_PER_CTA, RECORD_PAGES, WARPS_PER_CTA, ctas_per_kv_head
from ..core.plan import Plan
from ..core.problem import DecodeProblem, PageTable
from ..core.layouts import check_kv_layout
from ..core import unified_max as UM
from ..core import variants as VA
from ..core.variants import check_variant
from . import require_gpu
from .arrays import (as_cupy_stream, as_device_array, cupy_storage_dtype, nhd_view,
                     split_kv_arrays)
from .experiments import DecodeExperiments
from .features import (check_option, default_occupancy, default_pow2_pages, default_q_in_smem,
                       default_tile_per_warp, fitting_build, plan_warps, sm90_option,
                       spreads_one_per_sm)
from .kernel_abi import DecodeParams
from .kernel_source import DecodeVariant, row_tiles_for
from .launch import DecodeLaunch, KernelLaunch, current_context
from .modules import get_decode_kernels
from .records import (GraphPlanUpload, PlanUpload, StreamChain, chunk_records,  # noqa: F401
                      first_pages, pages_fit_record, query_rows_array, record_pages_needed)
from .workspace import Workspace

_NO_CHAIN = contextlib.nullcontext()     # a captured run: no ordering across streams

LOG2E = 1.4426950408889634


class BatchDecodeWrapper:
    """Decode attention over a paged KV cache (NHD or HND layout) with an adaptive split-KV plan.

    Shapes: q [batch, num_qo_heads, head_dim]; k_cache, v_cache [num_pages, page_size,
    num_kv_heads, head_dim] (a view with other page/token strides works if rows stay 16-byte
    aligned); out [batch, num_qo_heads, head_dim] in the input dtype; lse [batch, num_qo_heads]
    float32, natural log. Inputs float16 or bfloat16 (bfloat16 may be given as uint16 bits).

    profile: the cost-model profile plans are chosen with (a Profile, or a path: str or
        os.PathLike, read here: a missing or invalid file raises ``ProfileError`` at once);
        None: the calibrated or shipped one for this device.
    use_clusters: None or True: a fused plan that suits clusters (execution.fused_cluster_size)
        merges inside thread-block clusters where the GPU has them (sm_90+), True raising where
        it has none; False: always the atomic ticket. A cluster variant compiles (about a
        second) the first time a plan needs it.
    launch_order: the order the grid runs a ragged plan's chunks in (execution.LAUNCH_ORDERS):
        by default the longest chunks first, so no long chunk starts late and runs alone.
    pdl: None or True: launch with programmatic dependent launch where the GPU has it (sm_90+;
        True raises where it has none): a kernel's CTAs start while the kernel before it in the
        stream finishes, read the plan's records, and wait for it before touching q, K/V or the
        workspace (runtime/launch.py). False: plain launches. Plan on the stream you run on: a
        run on another stream waits for plan()'s upload with an event, which serialises it with
        the kernel before it and forgoes the overlap.
    experiments: tuning knobs for A/B runs (``DecodeExperiments``); None: the shipped kernel.
    use_cuda_graph: graph-stable (as FlashInfer's ``use_cuda_graph``): ``run()`` launches one
        fixed grid for the capacity below, whatever the plan, and ``plan()`` rewrites the plan
        buffers in place, so a CUDA graph captured once replays correctly after every later
        ``plan()``. Call ``plan()`` on the stream the graph replays on (its upload must come
        after the previous replay and before the next). The planner then chooses among plans
        that fit the capacity and merge without clusters; q, out and lse have
        ``max_batch_size`` rows (x ``max_q_len``; rows past the plan's are not written).
    max_batch_size, max_num_pages: the capacity of a graph-stable wrapper: requests per plan,
        and page-table entries (``kv_indices``) per plan. Required with ``use_cuda_graph``.
    kv_dtype: None (K/V in ``dtype``), or an fp8 format for the caches: 'float8_e4m3fn' or
        'float8_e5m2' (vLLM's 'fp8_e4m3' / 'fp8_e5m2' too; torch.float8_* dtypes): K and V are
        uint8 codes (or torch float8 tensors), dequantized in the kernel; ``run()`` takes their
        scales. q and the output stay ``dtype``.
    kv_layout: 'NHD' (pages of [page_size, num_kv_heads, head_dim], the default) or 'HND'
        (FlashInfer's name: pages of [num_kv_heads, page_size, head_dim]), read in place; either
        may be a strided view (padded heads or tokens, a slice of a combined K/V array).
    max_chunks: chunks per plan (the fixed grid is max_chunks x num_kv_heads x
        ctas_per_kv_head CTAs, and CTAs past the plan's chunks exit at once); default: at least
        max_batch_size, and 2 x SMs CTAs for a small batch's grid (one CTA per SM, see
        ``_graph_spreads``), 4 x SMs else.
    max_q_len: a graph-stable wrapper's query rows a request for multi-token decode (1 to 16;
        default 1): its captured launch runs the multi-token build sized for it, every plan
        takes ``qo_indptr`` of up to that many rows a request (or none: one row each), and q,
        out and lse have max_batch_size x max_q_len rows (rows past qo_indptr[-1] are not
        written). Per-shape wrappers take any ``qo_indptr`` without it. Its plans are the
        planner's own (``plan()`` refuses a ``plan=``).
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", profile=None, use_clusters: bool | None = None,
                 launch_order: str = "longest_chunks", pdl: bool | None = None,
                 experiments: DecodeExperiments | None = None, *, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_num_pages: int | None = None,
                 max_chunks: int | None = None, kv_dtype=None, kv_layout: str = "NHD",
                 max_q_len: int | None = None):
        self.num_qo_heads, self.num_kv_heads = V.check_heads(num_qo_heads, num_kv_heads)
        self.head_dim = V.check_head_dim(head_dim)
        self.page_size = V.check_int("page_size", page_size, 1)
        self.dtype = V.check_dtype("dtype", dtype)
        self.group_size = self.num_qo_heads // self.num_kv_heads
        self.use_clusters = check_option("use_clusters", use_clusters)
        self.launch_order = check_launch_order(launch_order)
        self.pdl = check_option("pdl", pdl)
        if experiments is None:
            experiments = DecodeExperiments()
        V.check_instance("experiments", experiments, DecodeExperiments)
        self.experiments = experiments
        self.kv_dtype = fp8.fp8_format("kv_dtype", kv_dtype)
        self.kv_layout = check_kv_layout(kv_layout)
        q_in_smem, pow2 = experiments.q_in_smem, experiments.pow2_pages
        if q_in_smem is None:
            q_in_smem = default_q_in_smem(self.head_dim)
        if pow2 is None:
            # the threads that share a tile's copies: its row tiles' warps (x dim_split's)
            pow2 = default_pow2_pages(self.page_size, self.head_dim,
                                      row_tiles_for(self.group_size) * (experiments.dim_split or 1),
                                      1 if self.kv_dtype else 2)
        self.variant = DecodeVariant.for_problem(self.dtype, self.head_dim, self.group_size,
                                                 experiments.stages or 0,
                                                 experiments.max_registers or 0,
                                                 kv_dtype=self.kv_dtype or "",
                                                 num_warps=(experiments.forced_warps
                                                            or WARPS_PER_CTA),
                                                 q_in_smem=int(q_in_smem), pow2_pages=int(pow2),
                                                 tile_per_warp=experiments.tile_per_warp or 16,
                                                 dim_split=experiments.dim_split or 1)
        if experiments.rows_per_cta and use_cuda_graph:
            raise ValueError("experiments: rows_per_cta is for per-shape wrappers (a graph-stable "
                             "grid is sized for the default rows a CTA)")
        if experiments.pow2_pages and self.page_size & (self.page_size - 1):
            raise ValueError(f"experiments: pow2_pages needs a page_size that is a power of two, "
                             f"got page_size={self.page_size}")
        from ..planner.profiles import Profile, read_profile

        if profile is not None and V.check_path_or("profile", profile, Profile,
                                                    "a Profile, a path (str or os.PathLike) or None"):
            read_profile(profile)   # a missing or unreadable file fails here, not at plan()
        self._profile = profile
        self._resolved_profile = None         # the Profile, once read and checked for the device
        self._plan: Plan | None = None
        self._launch: DecodeLaunch | None = None
        self._bound_variant: DecodeVariant | None = None   # the variant _bind() launched
        self._query_rows = None               # the current plan's multi-token rows, if any
        self._upload = PlanUpload()
        self._workspace = Workspace(self.head_dim)
        self._logits_soft_cap_log2 = 0.0      # plan()'s logits_soft_cap, as the kernels hold it
        self._launch_soft_cap = 0             # whether the bound launches are the cap's build
        self._unified_fallbacks = None        # the unified max's fallback counter (uint32 [1])
        self.use_cuda_graph = check_option("use_cuda_graph", use_cuda_graph) or False
        self._capacity = self._check_capacity(max_batch_size, max_num_pages, max_chunks)
        self._max_q_len = self._check_max_q_len(max_q_len)
        # a graph-stable multi-token grid: CTAs for max_q_len x the group a kv head
        self.ctas_per_kv_head = ctas_per_kv_head(self.group_size * self._max_q_len)
        if self._capacity is not None:
            batch, _, chunks = self._capacity
            if chunks is not None:
                V.check_grid_ctas("max_chunks", chunks * self.num_kv_heads * self.ctas_per_kv_head,
                                  "max_chunks x kv heads x CTAs a kv head")
            V.check_grid_ctas("max_batch_size", -(-batch * self.num_qo_heads * self._max_q_len
                                                  * self.head_dim // (4 * 128)),
                              "the merge kernel's: a thread per 4 dims of each request's heads")
        self._graph_upload: GraphPlanUpload | None = None
        self._graph_pool_pages: int | None = None    # pages of the K/V pool a run was given
        # every use of the buffers (plan uploads, runs), ordered across streams
        self._chain = StreamChain()
        self._pages_in_record = False
        self._plan_stream = None              # the stream of the last plan (or plan_on_device)
        self._device_planner = None           # plan_on_device()'s kernel, once bound
        self._device_plan_ready = None        # the event after the last eager plan_on_device()
        self._run_after_device_plan = False   # the next run follows the planning kernel

    def _check_capacity(self, max_batch_size, max_num_pages, max_chunks):
        """(max_batch_size, max_num_pages, max_chunks or None) of a graph-stable wrapper."""
        given = {"max_batch_size": max_batch_size, "max_num_pages": max_num_pages,
                 "max_chunks": max_chunks}
        if not self.use_cuda_graph:
            extra = [name for name, value in given.items() if value is not None]
            if extra:
                raise ValueError(f"{extra[0]}: a capacity is for a graph-stable wrapper; pass "
                                 "use_cuda_graph=True")
            return None
        for name in ("max_batch_size", "max_num_pages"):
            if given[name] is None:
                raise ValueError(f"{name}: a graph-stable wrapper (use_cuda_graph=True) needs "
                                 "its capacity: max_batch_size and max_num_pages")
        batch = V.check_int("max_batch_size", max_batch_size, 1)
        pages = V.check_int("max_num_pages", max_num_pages, 1)
        if max_chunks is not None:
            max_chunks = V.check_int("max_chunks", max_chunks, 1, V.MAX_CHUNKS, "MAX_CHUNKS")
            if max_chunks < batch:
                raise ValueError(f"max_chunks: {max_chunks} cannot hold a batch of "
                                 f"max_batch_size={batch} (one chunk per request at the least)")
        return batch, pages, max_chunks

    def _check_max_q_len(self, max_q_len) -> int:
        if max_q_len is None:
            return 1
        if not self.use_cuda_graph:
            raise ValueError("max_q_len: a capacity is for a graph-stable wrapper (pass "
                             "use_cuda_graph=True); per-shape wrappers take any qo_indptr")
        return V.check_int("max_q_len", max_q_len, 1, VA.MAX_Q_LEN, "MAX_Q_LEN")

    @property
    def max_chunks(self) -> int | None:
        """A graph-stable wrapper's chunks per plan (its fixed grid); None otherwise."""
        if self._capacity is None:
            return None
        batch, _, chunks = self._capacity
        if chunks is None:
            from . import device_info

            require_gpu("BatchDecodeWrapper.max_chunks")   # sized from the device's SMs
            # a spread grid: one wave of one CTA per SM, twice; else two waves of two
            waves = 2 * device_info()["num_sms"] * (1 if self._graph_spreads() else 2)
            chunks = max(batch, waves // (self.num_kv_heads * self.ctas_per_kv_head))
            self._capacity = (*self._capacity[:2], chunks)
        return chunks

    def _graph_spreads(self) -> bool:
        """Whether a graph-stable grid places one CTA per SM under PDL (see
        ``features.spreads_one_per_sm``): decided once, for the capacity, since the captured
        launch holds it. Yes when even a full batch unsplit leaves SMs idle, so that plans
        split to fill them (and those split requests' CTAs, whatever else the grid holds,
        must not land two to an SM); no for larger batches, whose plans fill the SMs twice.
        Never for fp8 K/V: a lone fp8 CTA streams far below an SM's share, so two to an SM on
        half the SMs lose little, while a spread grid runs plans of more CTAs than SMs in two
        rounds (H200: b8_n32k 187 us spread, 133 not, 133 per-shape; b1_n8k 12.7 vs 13.5;
        docs/design/fp8.md)."""
        from . import device_info

        if self.experiments.pdl_spread is not None:
            return self.experiments.pdl_spread
        if self.kv_dtype:
            return False
        items = self._capacity[0] * self.num_kv_heads * self.ctas_per_kv_head
        return items <= device_info()["num_sms"]

    # ------------------------------------------------------------------ plan
    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    @property
    def cluster_size(self) -> int:
        """Cluster size the current plan's fused merge runs in; 0 when it uses none."""
        return self._plan.cluster_size if self._plan is not None else 0

    @property
    def workspace_bytes(self) -> int:
        """Device bytes this wrapper's workspace holds (partial states and ticket counters):
        it grows to the largest plan's needs (``Plan.workspace_bytes``) and is kept; run()
        allocates nothing when its outputs are given."""
        return self._workspace.nbytes

    @property
    def kernel_variant(self) -> DecodeVariant | None:
        """The build the current plan's partial kernel runs (its warps, stages, cluster size):
        a per-shape plan whose CTAs are one per SM or fewer runs 8 warps where 4 are
        issue-bound (``features.plan_warps``); None before a plan."""
        return self._bound_variant if self._launch is not None else None

    @property
    def pdl_active(self) -> bool:
        """Whether the current plan launches with programmatic dependent launch."""
        return self._launch is not None and self._launch.pdl

    @property
    def pages_in_record(self) -> bool:
        """Whether the current plan's first tiles take their page ids from the chunk records."""
        return self._plan is not None and self._pages_in_record

    @property
    def profile(self):
        """The cost-model profile plans are chosen with: the one given (a Profile or a path),
        else ``load_profile``'s answer for this device."""
        if self._resolved_profile is not None:
            return self._resolved_profile
        from ..planner.profiles import Profile, load_profile

        if not isinstance(self._profile, Profile):
            # None, or a path the constructor read: loaded here to be checked against the device
            from . import device_info

            require_gpu("BatchDecodeWrapper.profile")
            info = device_info()
            self._profile = load_profile(path=self._profile, device_name=info["name"],
                                         num_sms=info["num_sms"])
        self._resolved_profile = self._profile
        return self._profile

    def plan(self, page_table: PageTable | None = None, *, kv_indptr=None, kv_indices=None,
             kv_last_page_len=None, block_table=None, seq_lens=None,
             num_splits: int | None = None, strategy: str | None = None,
             plan: Plan | None = None, sm_scale: float | None = None, stream=None,
             window_left: int | None = None, logits_soft_cap: float | None = None,
             qo_indptr=None, unified_max: float | None = None) -> Plan:
        """Choose and upload the decomposition for this batch. Host work plus one upload.

        The batch's pages: a ``PageTable``, or FlashInfer's ``kv_indptr`` [batch + 1],
        ``kv_indices`` [pages], ``kv_last_page_len`` [batch], or vLLM's ``block_table``
        [batch, max pages] and ``seq_lens`` [batch] (host integer arrays).
        num_splits / strategy force the planner's hand; ``plan`` bypasses it, and runs with the
        execution (merge mode, launch order) this wrapper's options give it on this device
        (``Plan.with_execution``). ``stream``: where the upload goes (CuPy or torch stream, or
        a handle; default CuPy's current stream): the stream you run (or replay) on.
        ``window_left`` (sliding window, FlashInfer's name): each request's query sees its last
        window_left + 1 tokens, and the plan covers only those (its cost follows the window);
        -1 or None: no window (with ``plan``, None takes the plan's). ``logits_soft_cap``
        (Gemma-2, FlashInfer's name): each score s = sm_scale q.k becomes cap * tanh(s / cap)
        before the softmax, in the runs after this plan; None or 0: no cap. The cap runs in a
        build of the kernels of its own; a graph-stable wrapper keeps its first plan's cap on or
        off (its value may change). ``qo_indptr`` (multi-token decode, FlashInfer's name: a
        host integer array [batch + 1]): request b has qo_indptr[b+1] - qo_indptr[b] query rows,
        1 to 16, the last positions of its KV, causal among themselves; ``run()``'s q, out and
        lse then have qo_indptr[-1] rows. Each request's KV is read once for all its rows: the
        kernel packs (query row, head) pairs into its MMA rows, so the plan's problem counts
        max_q_len x num_qo_heads query heads (a graph-stable wrapper's: its max_q_len's). With
        ``window_left`` each row sees its own window, and the plan covers every row's: window_left
        + max_q_len - 1 tokens back (``core.variants.covering_window_left``).
        ``unified_max`` (FlashDecoding++'s unified max value phi, natural-log units of the
        scaled scores): the runs offset scores by phi instead of the running max, and a CTA
        whose rows leave phi's band falls back to the running max (``core.unified_max``), so
        results are exact either way; None (the default): the running max. Per-shape wrappers
        only; ``unified_max_fallbacks()`` counts the fallbacks.
        Returns the plan as it runs.
        """
        require_gpu("BatchDecodeWrapper.plan()")
        import cupy

        if self._device_planner is not None:
            raise RuntimeError("plan: this wrapper plans on the device (plan_on_device() was "
                               "called); a wrapper plans one way or the other")

        page_table = PageTable.from_layout(
            page_table, self.page_size, kv_indptr=kv_indptr, kv_indices=kv_indices,
            kv_last_page_len=kv_last_page_len, block_table=block_table, seq_lens=seq_lens)
        if page_table.page_size != self.page_size:
            raise ValueError(f"page_table: page_size {page_table.page_size} differs from the "
                             f"wrapper's page_size {self.page_size}")
        s = as_cupy_stream(stream)
        soft_cap_log2 = self._soft_cap_log2(logits_soft_cap)
        phi = UM.check_unified_max(unified_max)
        if phi is not None and self.use_cuda_graph:
            raise ValueError("unified_max: graph-stable wrappers do not take it yet (their "
                             "captured launch holds one build); use a per-shape wrapper")
        query_rows = self._check_query_rows(qo_indptr, page_table, plan)
        # query rows a request the kernels are sized for: a graph-stable wrapper's captured
        # launch holds its capacity's, whatever the plan
        rows = (self._max_q_len if self.use_cuda_graph
                else query_rows.max_q_len if query_rows is not None else 1)
        heads = self.num_qo_heads * rows
        if heads > V.MAX_HEADS:
            raise ValueError(f"qo_indptr: {rows} query rows x {self.num_qo_heads} heads exceed "
                             f"MAX_HEADS={V.MAX_HEADS} rows a kv head can hold")
        window = -1 if window_left is None else window_left
        plan_window = window
        if query_rows is not None:   # the plan covers every row's window; each row masks its own
            plan_window = VA.covering_window_left(
                V.check_int("window_left", window, -1, V.MAX_KV_LEN, "MAX_KV_LEN"), rows)
        max_page = int(page_table.kv_indices.max()) if page_table.kv_indices.size else -1
        if self.use_cuda_graph:
            self._check_fits(page_table, max_page, s)
        # a graph-stable grid is one fixed launch: no cluster variant
        clusters = (not self.use_cuda_graph
                    and sm90_option("use_clusters", self.use_clusters, "thread-block clusters"))
        if plan is not None:
            V.check_instance("plan", plan, Plan)
            V.check_plan_for_table(plan, page_table, num_qo_heads=self.num_qo_heads,
                                   num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                   dtype=self.dtype, window_left=window_left)
            chosen = plan.with_execution(clusters=clusters, launch_order=self.launch_order)
        else:
            from ..planner import choose_plan

            problem = DecodeProblem.from_page_table(
                page_table, heads, self.num_kv_heads, self.head_dim, self.dtype,
                window_left=plan_window)
            model = self.profile.cost_model(self.kv_dtype, graph_stable=self.use_cuda_graph)
            if not clusters:                     # predict the ticket merge that will run
                model = model.with_clusters(False)
            if query_rows is not None:           # the builds' tiles of multi-token plans
                model = model.for_multi_token()
            chosen = choose_plan(problem, model, num_splits, strategy,
                                 launch_order=self.launch_order, max_chunks=self.max_chunks)
        sm_scale_log2 = float(np.float32(V.check_sm_scale(sm_scale, self.head_dim) * LOG2E))
        if max_page >= 2**31:
            raise ValueError("page_table: page indices must be < 2**31")

        self._follow_previous_plan_stream(s)
        self._chain.follow(s)          # runs on other streams may still read the buffers
        rows_array = (None if query_rows is None
                      else query_rows_array(query_rows, page_table.kv_lens, window))
        if self.use_cuda_graph:
            return self._plan_graph(chosen, page_table, s, sm_scale_log2, max_page, soft_cap_log2,
                                    rows_array)
        group = heads // self.num_kv_heads     # with multi-token decode, q_len x the group
        max_rows = self.experiments.rows_per_cta or MAX_HEADS_PER_CTA
        per_kv_head = ctas_per_kv_head(group, max_rows)
        ctas = chosen.num_work_items * per_kv_head
        V.check_grid_ctas("page_table", ctas, f"{chosen.num_chunks} chunks x "
                          f"{self.num_kv_heads} kv heads x {per_kv_head} CTAs a kv head")
        V.check_grid_ctas("page_table", -(-chosen.problem.batch_size * heads * self.head_dim
                                          // (4 * 128)),
                          "the merge kernel's: a thread per 4 dims of each request's heads")
        row_tiles = row_tiles_for(min(group, max_rows))
        sizes = chosen.chunk_end - chosen.chunk_start
        ex = self.experiments
        forced_warps = ex.forced_warps
        warps = plan_warps(self.kv_dtype, ctas, forced_warps, row_tiles=row_tiles,
                           page_size=self.page_size, head_dim=self.head_dim,
                           mean_chunk_tokens=float(sizes.mean()) if sizes.size else 0.0,
                           multi_token=query_rows is not None)
        tile_per_warp = ex.tile_per_warp or default_tile_per_warp(
            self.kv_dtype, self.head_dim, warps, row_tiles, query_rows is not None,
            forced=ex.stages is not None or forced_warps is not None)
        variant = default_occupancy(replace(
            self.variant, cluster=chosen.cluster_size, soft_cap=int(soft_cap_log2 > 0),
            num_warps=warps, stages=ex.stages or 0, row_tiles=row_tiles,
            tile_per_warp=tile_per_warp, multi_token=int(query_rows is not None),
            unified_max=int(phi is not None)), forced=ex.forces_occupancy)
        kernels = get_decode_kernels(fitting_build(
            variant, q_default=ex.q_in_smem is None, warps_default=forced_warps is None,
            stages=ex.stages or 0))
        stages = kernels.variant.stages
        tile = kernels.variant.tile_tokens
        in_record = pages_fit_record(chosen, self.page_size, stages, tile)
        records = chunk_records(chosen, page_table, grid_order(chosen),
                                record_pages_needed(self.page_size, stages, tile) if in_record else 0)
        extra = {} if rows_array is None else {"query_rows": rows_array}
        if self.experiments.compact_merge and chosen.merge == MERGE_KERNEL:
            extra["split_requests"] = np.flatnonzero(np.diff(chosen.merge_indptr) > 1)
        meta = self._upload.upload(records, page_table, chosen, s, extra)
        self._workspace.ensure(chosen, per_kv_head, s)
        if phi is not None:
            self._zero_unified_fallbacks(s)
        self._upload.ready.record(s)          # run() on another stream waits for the uploads
        self._launch = self._bind(kernels, meta, chosen.num_chunks, chosen.problem.batch_size,
                                  chosen.cluster_size, chosen.merge == "merge_kernel", in_record,
                                  sm_scale_log2, heads=heads, per_kv_head=per_kv_head)
        if phi is not None:
            params = self._launch.params
            params.unified_max_log2 = float(np.float32(phi * LOG2E))
            params.unified_fallbacks = self._unified_fallbacks.data.ptr
        self._query_rows = query_rows
        self._device_id = cupy.cuda.runtime.getDevice()
        self._pages_in_record = in_record
        self._plan_stream = s
        self._plan, self._max_page = chosen, max_page
        self._logits_soft_cap_log2 = soft_cap_log2
        return chosen

    def _zero_unified_fallbacks(self, s) -> None:
        """The unified max's fallback counter, zeroed on ``s`` before the plan's upload event
        is recorded: a run on another stream waits for that event, so its counts follow the
        zeroing."""
        import cupy

        with s:
            if self._unified_fallbacks is None:
                self._unified_fallbacks = cupy.zeros(1, np.uint32)
            else:
                self._unified_fallbacks.fill(0)

    def unified_max_fallbacks(self) -> int:
        """How many CTAs fell back from the unified max to the running max in the runs since
        the last ``plan(unified_max=)`` (a CTA is a chunk x kv head for groups up to 64 query
        heads); waits for those runs. 0 for a plan without it."""
        if self._launch is None or not self._launch.params.unified_fallbacks:
            return 0
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        return int(self._unified_fallbacks.get()[0])

    def _check_query_rows(self, qo_indptr, page_table: PageTable, plan):
        """plan()'s ``qo_indptr`` checked (``core.variants.query_rows``): the QueryRows the
        multi-token build reads, or None where the plain build runs (one query row a request,
        and not a graph-stable wrapper made for more)."""
        cap = self._max_q_len
        if qo_indptr is None and cap == 1:
            return None
        rows = VA.query_rows(qo_indptr, page_table.kv_lens)
        if self.use_cuda_graph and rows.max_q_len > cap:
            b = int(np.argmax(rows.count))
            raise ValueError(f"qo_indptr: request {b} has {rows.count[b]} query rows; this "
                             f"graph-stable wrapper's captured launch holds max_q_len={cap} "
                             "(BatchDecodeWrapper(..., max_q_len=))")
        if max(cap, rows.max_q_len) == 1:
            return None
        if plan is not None and cap > 1:
            raise ValueError("plan: a wrapper made with max_q_len > 1 plans its own rows (its "
                             "plans count max_q_len x num_qo_heads query heads); pass "
                             "num_splits / strategy instead")
        if plan is not None:
            raise ValueError("qo_indptr: pass num_splits / strategy rather than a plan; the "
                             "planner sizes a multi-token plan's rows itself")
        return rows

    def _graph_kernels(self, soft_cap_log2: float):
        """A graph-stable wrapper's kernels: bound with its first plan (the captured launches
        hold them), so later plans keep that plan's soft cap on or off."""
        soft_cap = int(soft_cap_log2 > 0)
        multi = self._max_q_len > 1
        if self._launch is not None and self._launch_soft_cap != soft_cap:
            raise ValueError(f"logits_soft_cap: a graph-stable wrapper keeps its first plan's "
                             f"soft cap {'on' if self._launch_soft_cap else 'off'} (its captured "
                             "launches hold that kernel); its value may change")
        self._launch_soft_cap = soft_cap
        return get_decode_kernels(fitting_build(default_occupancy(replace(
            self.variant, soft_cap=soft_cap, multi_token=int(multi),
            row_tiles=row_tiles_for(self.group_size * self._max_q_len)),
            forced=self.experiments.forces_occupancy),
            q_default=self.experiments.q_in_smem is None, warps_default=False))

    def _plan_graph(self, chosen: Plan, page_table: PageTable, s, sm_scale_log2: float,
                    max_page: int, soft_cap_log2: float, rows_array=None) -> Plan:
        """plan() of a graph-stable wrapper: the records written straight into a pinned buffer
        whose rest of the capacity holds idle records, uploaded into the fixed buffers; the
        launches are built once, for the capacity."""
        import cupy

        max_batch, max_pages, max_chunks = self._capacity[0], self._capacity[1], self.max_chunks
        batch = chosen.problem.batch_size
        if chosen.num_chunks > max_chunks:
            raise ValueError(f"plan: {chosen.num_chunks} chunks exceed the wrapper's "
                             f"max_chunks={max_chunks}")
        kernels = self._graph_kernels(soft_cap_log2)
        stages = kernels.variant.stages
        tile = kernels.variant.tile_tokens
        may_carry_pages = record_pages_needed(self.page_size, stages, tile) <= RECORD_PAGES
        in_record = pages_fit_record(chosen, self.page_size, stages, tile)
        # the merge kernel always runs: rows past the batch, and every row of a plan that has
        # no merge kernel, have no chunks to merge
        merge_indptr = np.zeros(max_batch + 1, dtype=np.int32)
        if chosen.merge == "merge_kernel":
            merge_indptr[:batch + 1] = chosen.merge_indptr
            merge_indptr[batch + 1:] = chosen.merge_indptr[-1]
        heads = self.num_qo_heads * self._max_q_len
        if self._graph_upload is None:
            upload = GraphPlanUpload(max_chunks, max_pages, max_batch,
                                     query_rows=self._max_q_len > 1)
            self._workspace.ensure_size(max_chunks * heads,
                                        max_batch * self.num_kv_heads * self.ctas_per_kv_head, s)
            self._launch = self._bind(kernels, upload.pointers, max_chunks, max_batch,
                                      0, True, may_carry_pages, sm_scale_log2,
                                      spread=self._graph_spreads(), heads=heads)
            self._device_id = cupy.cuda.runtime.getDevice()
            self._graph_upload = upload         # only once the launches are built
        elif sm_scale_log2 != self._launch.params.sm_scale_log2:
            raise ValueError("sm_scale: a graph-stable wrapper keeps the sm_scale of its first "
                             "plan (a captured launch holds it)")
        chunk_records(chosen, page_table, grid_order(chosen),
                      record_pages_needed(self.page_size, stages, tile) if in_record else 0,
                      out=self._graph_upload.next_records(chosen.num_chunks))
        if rows_array is not None:      # rows past the batch: none (q_len 0), as on the device
            full = np.zeros((max_batch, 4), np.int32)
            full[:, 3] = -1
            full[:batch] = rows_array
            rows_array = full
        self._graph_upload.upload(page_table.kv_indices, merge_indptr, s, query_rows=rows_array)
        self._pages_in_record = in_record
        self._plan_stream = s
        self._plan, self._max_page = chosen, max_page
        self._logits_soft_cap_log2 = soft_cap_log2
        return chosen

    def plan_on_device(self, *, seq_lens=None, block_table=None, kv_indptr=None,
                       kv_indices=None, kv_last_page_len=None, sm_scale: float | None = None,
                       stream=None, logits_soft_cap: float | None = None,
                       qo_indptr=None, window_left: int | None = None) -> None:
        """Plan on the GPU (graph-stable wrappers): enqueue the planning kernel on ``stream``.
        When it runs, it reads the batch from these device int32 arrays, chooses the plan with
        the same cost model as ``plan()`` (the same plan, bit for bit: tests/planner/test_device_plan.py)
        and writes the records the next ``run()`` calls read. No host work and no host wait, so
        it can be captured: one graph of ``plan_on_device()`` then ``run()`` per layer serves
        every decode step while the engine updates the arrays in place.

        The batch: vLLM's ``seq_lens`` [batch] and ``block_table`` [batch, max_pages]
        (contiguous), or FlashInfer's ``kv_indptr`` [batch + 1], ``kv_indices`` and
        ``kv_last_page_len`` [batch]; batch <= max_batch_size (pad with empty requests); the
        table may have any number of entries (``max_num_pages`` sizes only ``plan()``'s upload).
        The first call binds the arrays (their addresses go into
        the launches: later calls must pass the same arrays) and must not be captured; page ids
        are not range-checked. A request whose values are invalid (a negative length, more pages
        than its row, a bad kv_indptr or kv_last_page_len) is planned as empty and the error is
        kept on the device: ``device_plan_state()`` reads it. ``logits_soft_cap``: as in
        ``plan()``. ``qo_indptr`` (a wrapper made with ``max_q_len``): multi-token decode's
        device int32 [batch + 1], bound like the others (None: one row a request); a bad
        entry leaves every output of the batch unwritten (past it, rows may overlap), and the
        error is kept likewise.
        ``window_left``: as in ``plan()`` (each row its own window); a captured graph holds the
        window of its capture (the planning kernel's argument).
        """
        require_gpu("BatchDecodeWrapper.plan_on_device()")
        import cupy

        if not self.use_cuda_graph:
            raise ValueError("plan_on_device: needs a graph-stable wrapper (use_cuda_graph=True "
                             "with its capacity)")
        if self._plan is not None:
            raise RuntimeError("plan_on_device: this wrapper plans on the host (plan() was "
                               "called); a wrapper plans one way or the other")
        if qo_indptr is not None and self._max_q_len == 1:
            raise ValueError("qo_indptr: this graph-stable wrapper's captured launch holds one "
                             "query row a request; make it with max_q_len= for more")
        s = as_cupy_stream(stream)
        soft_cap_log2 = self._soft_cap_log2(logits_soft_cap)
        kernels = self._graph_kernels(soft_cap_log2)   # the cap's build, or the refusal to switch
        inputs = (seq_lens, block_table, kv_indptr, kv_indices, kv_last_page_len, qo_indptr)
        planner = self._device_planner
        # the very arrays of the first call (a decode loop's path) were checked then
        if planner is None or not planner.same_inputs(inputs, sm_scale):
            self._check_device_plan_inputs(inputs, sm_scale, s, kernels)
            planner = self._device_planner
        self._follow_previous_plan_stream(s)
        if not s.is_capturing():
            self._chain.follow(s)                # runs elsewhere may still read the records
        window = -1 if window_left is None else V.check_int(
            "window_left", window_left, -1, V.MAX_KV_LEN, "MAX_KV_LEN")
        planner.params.rows_window_left = window
        planner.params.window_left = (VA.covering_window_left(window, self._max_q_len)
                                      if self._max_q_len > 1 else window)
        planner.launch(s.ptr)
        self._logits_soft_cap_log2 = soft_cap_log2
        self._run_after_device_plan = True
        self._plan_stream = s
        if not s.is_capturing():
            self._device_plan_ready = self._device_plan_ready or cupy.cuda.Event(
                disable_timing=True)
            self._device_plan_ready.record(s)

    def _check_device_plan_inputs(self, inputs, sm_scale, s, kernels) -> None:
        """plan_on_device()'s checks of its arguments; binds the planner on the first call."""
        import cupy

        from .device_planner import device_batch

        seq_lens, block_table, kv_indptr, kv_indices, kv_last_page_len, qo_indptr = inputs
        device = cupy.cuda.runtime.getDevice()
        batch, arrays = device_batch(max_batch=self._capacity[0], device=device,
                                     seq_lens=seq_lens, block_table=block_table,
                                     kv_indptr=kv_indptr, kv_indices=kv_indices,
                                     kv_last_page_len=kv_last_page_len, qo_indptr=qo_indptr)
        sm_scale_log2 = float(np.float32(V.check_sm_scale(sm_scale, self.head_dim) * LOG2E))
        planner = self._device_planner
        if planner is None:
            if s.is_capturing():
                raise RuntimeError("plan_on_device: the first call binds the arrays and "
                                   "allocates; make it before capturing")
            planner = self._bind_device_planner(batch, arrays, sm_scale_log2, s, kernels)
            planner.remember(inputs, sm_scale)
        elif batch != planner.batch:
            raise ValueError("plan_on_device: the arrays differ from the first call's (a captured "
                             "launch holds their addresses); update those arrays in place")
        elif sm_scale_log2 != self._launch.params.sm_scale_log2:
            raise ValueError("sm_scale: a graph-stable wrapper keeps the sm_scale of its first "
                             "plan (a captured launch holds it)")

    def _bind_device_planner(self, batch, arrays, sm_scale_log2: float, s, kernels):
        """The first plan_on_device(): the fixed buffers, the planning kernel bound to the
        arrays, and the decode launches, which read the caller's page table in place."""
        import cupy

        from .device_planner import DevicePlanner, plan_params

        max_batch, max_chunks = self._capacity[0], self.max_chunks
        stages = kernels.variant.stages
        model = self.profile.cost_model(self.kv_dtype, graph_stable=True).with_clusters(False)
        heads = self.num_qo_heads * self._max_q_len   # virtual heads with max_q_len > 1
        params = plan_params(model, num_qo_heads=heads,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             page_size=self.page_size, stages=stages, max_batch=max_batch,
                             max_chunks=max_chunks, launch_order=self.launch_order,
                             tile_tokens=kernels.variant.tile_tokens)
        multi = self._max_q_len > 1
        upload = GraphPlanUpload(max_chunks, 0, max_batch, query_rows=multi)
        self._workspace.ensure_size(max_chunks * heads,
                                    max_batch * self.num_kv_heads * self.ctas_per_kv_head, s)
        planner = DevicePlanner(params, batch, upload.pointers["records"],
                                upload.pointers["merge_indptr"], s,
                                query_rows_ptr=upload.pointers["query_rows"] if multi else 0,
                                max_q_len=self._max_q_len)
        planner.arrays = arrays                  # kept alive while the kernel reads them
        meta = dict(upload.pointers, kv_indices=batch.pointers[3])
        self._launch = self._bind(kernels, meta, max_chunks, max_batch, 0, True,
                                  params.record_pages > 0, sm_scale_log2,
                                  spread=self._graph_spreads(), device_planned=True,
                                  heads=heads)
        self._device_id = cupy.cuda.runtime.getDevice()
        self._graph_upload = upload
        self._max_page = -1                      # page ids are the caller's (not checked)
        self._device_planner = planner           # last: a failure above leaves nothing bound
        return planner

    def device_plan_state(self) -> dict:
        """What the last ``plan_on_device()`` chose, read back from the device (waits for it):
        kind ('no split', 'chunk tokens', 'num splits') and value, strategy, merge,
        num_chunks, predicted_us, plans (made so far), and error: None, or what was invalid in
        the first plan since ``clear_device_plan_error()`` that met an invalid request (with
        error_request: one such request, not necessarily the lowest index)."""
        if self._device_planner is None:
            raise RuntimeError("device_plan_state: call plan_on_device() first")
        return self._device_planner.state()

    def clear_device_plan_error(self, stream=None) -> None:
        if self._device_planner is None:
            raise RuntimeError("clear_device_plan_error: call plan_on_device() first")
        self._device_planner.clear_error(as_cupy_stream(stream))

    @staticmethod
    def _soft_cap_log2(logits_soft_cap) -> float:
        """The soft cap as DecodeParams holds it: times log2(e), as a float32; 0: none."""
        if logits_soft_cap is None:
            return 0.0
        cap = check_variant(1, logits_soft_cap=logits_soft_cap).logits_soft_cap
        if cap is None:
            return 0.0
        with np.errstate(over="ignore"):
            value = float(np.float32(cap * LOG2E))
        if not np.isfinite(value) or value < np.finfo(np.float32).tiny:
            raise ValueError(f"logits_soft_cap: {logits_soft_cap!r} is outside float32's normal "
                             "range")
        return value

    def _sinks_pointer(self, sinks) -> int:
        """The device pointer of ``run()``'s sinks (0: none), checked."""
        if sinks is None:
            return 0
        return self._float32_device_array(
            "sinks", sinks, (self.num_qo_heads,),
            f"a contiguous float32 device array of {self.num_qo_heads} logits (one per query "
            "head)").ptr

    def _float32_device_array(self, name: str, value, sizes, expected: str):
        """``value`` as a contiguous 1-d float32 device array of one of ``sizes`` values, on
        the plan's device; else a ValueError naming ``name`` and saying ``expected``."""
        arr = as_device_array(name, value)
        if arr.dtype != "float32" or len(arr.shape) != 1 or arr.shape[0] not in sizes \
                or not arr.is_contiguous:
            raise ValueError(f"{name}: expected {expected}, got {arr.dtype} of shape "
                             f"{list(arr.shape)}")
        if arr.device is not None and self._device_id is not None and arr.device != self._device_id:
            raise ValueError(f"{name}: is on device {arr.device}, the plan on {self._device_id}")
        return arr

    def _scale(self, name: str, scale) -> tuple[int, float, int]:
        """An fp8 scale as DecodeParams holds it: (device pointer or 0, value, stride)."""
        if scale is None:
            return 0, 1.0, 0
        if self.kv_dtype is None:
            raise ValueError(f"{name}: scales are for fp8 caches; this wrapper's kv_dtype is None")
        if isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, bool):
            with np.errstate(over="ignore"):
                value = float(np.float32(scale))      # as the kernel holds it
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite value > 0 (as a float32), got "
                                 f"{scale!r}")
            return 0, value, 0
        arr = self._float32_device_array(
            name, scale, (1, self.num_kv_heads),
            f"a number, or a contiguous float32 device array of 1 value (per tensor) or "
            f"{self.num_kv_heads} (one per kv head)")
        return arr.ptr, 1.0, int(arr.shape[0] > 1)

    def _follow_previous_plan_stream(self, s) -> None:
        """A plan on another stream than the last one's: order it after the work queued on
        that stream (the runs there may still read the buffers this plan rewrites)."""
        previous = self._plan_stream
        if previous is None or previous.ptr == s.ptr or s.is_capturing() or previous.is_capturing():
            return           # (an event recorded in a capture would pull this stream into it)
        import cupy

        event = cupy.cuda.Event(disable_timing=True)
        event.record(previous)
        s.wait_event(event)

    def _check_fits(self, page_table: PageTable, max_page: int, stream) -> None:
        """A graph-stable wrapper's checks of a page table against its capacity, before any
        planning or upload."""
        max_batch, max_pages = self._capacity[0], self._capacity[1]
        if stream.is_capturing():
            raise RuntimeError("plan: a graph-stable wrapper's plan() must not be captured (its "
                               "upload would replay one plan forever); call it before each "
                               "replay, outside the capture")
        if page_table.batch_size > max_batch:
            raise ValueError(f"page_table: {page_table.batch_size} requests exceed the "
                             f"wrapper's max_batch_size={max_batch}")
        if page_table.kv_indices.size > max_pages:
            raise ValueError(f"page_table: {page_table.kv_indices.size} page-table entries "
                             f"exceed the wrapper's max_num_pages={max_pages}")
        if self._graph_pool_pages is not None and max_page >= self._graph_pool_pages:
            raise ValueError(f"page_table: page index {max_page} is past the K/V pool of "
                             f"{self._graph_pool_pages} pages that run() was given")

    def _ready_event(self):
        """The event after the current plan's upload."""
        if self._device_planner is not None:
            return self._device_plan_ready
        return self._graph_upload.ready if self.use_cuda_graph else self._upload.ready

    def _bind(self, kernels, meta: dict, num_chunks: int, batch_size: int, cluster_size: int,
              merge: bool, pages_in_record: bool, sm_scale_log2: float,
              spread: bool | None = None, device_planned: bool = False,
              heads: int | None = None, per_kv_head: int | None = None) -> DecodeLaunch:
        """The launches of a grid of ``num_chunks`` chunks and their DecodeParams, all but the
        tensors; ``merge``: with the merge kernel, over ``batch_size`` requests; ``spread``:
        one CTA per SM under PDL (None: the experiments' choice, else the grid's rule).
        ``heads`` and ``per_kv_head``: the kernels' query heads and CTAs per kv head (with
        multi-token decode, virtual heads: ``meta["query_rows"]`` maps them); default: the
        wrapper's."""
        pdl = sm90_option("pdl", self.pdl, "programmatic dependent launch")
        heads = heads or self.num_qo_heads
        per_kv_head = per_kv_head or self.ctas_per_kv_head
        ws = self._workspace
        params = DecodeParams(
            kv_indices=meta["kv_indices"], records=meta["records"],
            merge_indptr=meta["merge_indptr"], partial_o=ws.partial_o.data.ptr,
            partial_lse=ws.partial_lse.data.ptr, counters=ws.counters.data.ptr,
            batch_size=batch_size, num_qo_heads=heads,
            num_kv_heads=self.num_kv_heads, ctas_per_kv_head=per_kv_head,
            page_size=self.page_size, sm_scale_log2=sm_scale_log2,
            pages_in_record=int(pages_in_record),
            pdl_early_trigger=int(pdl and self.experiments.pdl_trigger == "early"),
            query_rows=meta.get("query_rows", 0), q_group=self.group_size,
            split_requests=meta.get("split_requests", 0),
            num_split_requests=int(meta.get("num_split_requests", 0)))
        grid = num_chunks * self.num_kv_heads * per_kv_head
        shared = kernels.variant.shared_bytes
        if spread is None:
            spread = self.experiments.pdl_spread
        if spread is None:
            spread = spreads_one_per_sm(grid, cluster_size)
        if pdl and spread:
            shared = kernels.one_per_sm_shared_bytes
        threads = kernels.variant.threads
        partial = KernelLaunch(kernels.partial, grid, threads, shared, pdl=pdl)
        plain = None
        if pdl and device_planned:
            plain = KernelLaunch(kernels.partial, grid, threads, kernels.variant.shared_bytes)
        merge_launch = None
        if merge:
            # one thread per (request, qo head, 4 dims); compact_merge: per split request's
            requests = meta.get("num_split_requests") or batch_size
            slots = requests * heads * (self.head_dim // 4)
            merge_launch = KernelLaunch(kernels.merge, -(-slots // threads), threads, 0, pdl=pdl)
        self._bound_variant = kernels.variant
        return DecodeLaunch(params, partial, merge_launch, current_context(), plain)

    # ------------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache=None, *, out=None, lse=None, return_lse: bool = False,
            stream=None, k_scale=None, v_scale=None, sinks=None):
        """Launch the planned kernels. Returns ``out`` or ``(out, lse)`` if ``return_lse`` or
        ``lse`` is given. Raises before any launch if an input does not match the plan.

        K/V: ``k_cache`` and ``v_cache`` (in the wrapper's ``kv_layout``), or ``v_cache=None``
        with a (k, v) pair or one combined array, FlashInfer's [pages, 2, ...] or vLLM's [2,
        pages, ...] (``core.layouts``), read in place.

        k_scale, v_scale (fp8 caches, ``kv_dtype``): K = code value x k_scale. None (1), a
        number (per tensor, held by a captured graph), or a device float32 array of 1 value
        (per tensor) or num_kv_heads values (per kv head), read when the kernel runs (so a
        graph sees new values).

        sinks (gpt-oss's attention sinks): a device float32 array of num_qo_heads logits
        (natural log, like the scaled scores; -inf: none for that head), read when the kernel
        runs. Each joins its head's softmax denominator with no value, once, whatever the plan
        splits, and the LSE returned includes it (``core.variants``). The logits soft cap is
        ``plan()``'s; a captured graph holds the cap and the sinks array of its capture."""
        require_gpu("BatchDecodeWrapper.run()")
        import cupy

        plan = self._plan
        if plan is None and self._device_planner is None:
            raise RuntimeError("run: call plan() (or, graph-stable, plan_on_device()) first")
        batch = self._capacity[0] if self.use_cuda_graph else plan.problem.batch_size
        if self.use_cuda_graph:               # capacity rows, for every query row of a request
            batch *= self._max_q_len
        elif self._query_rows is not None:    # multi-token decode: q has each query row
            batch = self._query_rows.num_rows
        qa = as_device_array("q", q)
        ka, va = split_kv_arrays(k_cache, v_cache)
        if self.kv_layout == "HND":          # [pages, heads, page, dim]: read as an NHD view
            ka, va = nhd_view("k_cache", ka), nhd_view("v_cache", va)
        V.check_device_decode_arrays(qa, ka, va, batch_size=batch, num_qo_heads=self.num_qo_heads,
                                     num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                     page_size=self.page_size, dtype=self.dtype,
                                     max_page=self._max_page, device=self._device_id,
                                     kv_dtype=self.kv_dtype)
        scales = (*self._scale("k_scale", k_scale), *self._scale("v_scale", v_scale))
        variant = (self._logits_soft_cap_log2, self._sinks_pointer(sinks))
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
        foreign = s.ptr != self._plan_stream.ptr and not s.is_capturing()
        if foreign and self._ready_event() is not None:
            # Order this stream after plan()'s upload. Not inside a graph capture: a wait on an
            # event recorded outside it would pull outside work into the graph, and a host wait
            # is what the default (global) capture mode forbids. A captured run reads the
            # records when the graph replays, so the replay is what must follow plan()'s
            # upload, as any work queued after it on the plan's stream does.
            s.wait_event(self._ready_event())
        if self.use_cuda_graph:     # later plans must stay within this pool
            pool = int(ka.shape[0])
            self._graph_pool_pages = pool if self._graph_pool_pages is None else min(
                pool, self._graph_pool_pages)
        if batch:
            # Runs share the workspace (partials, ticket counters) and plans rewrite the
            # records: a run on another stream than the last use's waits for it. Not inside a
            # capture (as above): the replay's order is the caller's.
            with (self._chain.use(s) if not s.is_capturing() else _NO_CHAIN):
                self._launch(qa.ptr, ka.ptr, va.ptr, ka.strides[0], ka.strides[1],
                             ka.strides[2], oa.ptr, lse_ptr, s.ptr,
                             plain=self._run_after_device_plan, scales=scales, variant=variant)
            self._run_after_device_plan = False
        return (out, lse) if want_lse else out

