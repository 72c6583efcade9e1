"""Plan-then-run decode attention on the GPU: a facade that plans (``planner``), builds
(``compiled_builds``), uploads (``records``), fills the kernels' argument (``params``) and launches
(``launch``), in the order ``streams`` keeps.

    wrapper = BatchDecodeWrapper(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                 dtype="bfloat16")
    wrapper.plan(PageTable.from_block_table(block_table, seq_lens, 16))   # host work + 1 upload
    for layer in layers:                                                # launches only
        out = wrapper.run(q[layer], k_cache[layer], v_cache[layer])

``run()`` only launches (no host wait; no allocation when ``out`` is given), so it can be
captured in a CUDA graph; a graph-stable wrapper (``graph_stable.py``) keeps one graph valid
across plans. The plan says how it runs (``Plan.execution``); the wrapper executes that."""

from __future__ import annotations


from ..core import fp8
from ..core import unified_max as UM
from ..core import validation as V
from ..core import variants as VA
from ..core.execution import MERGE_KERNEL, check_launch_order
from ..core.geometry import ctas_per_kv_head
from ..core.layouts import check_kv_layout
from ..core.plan import Plan
from ..core.problem import DecodeProblem, PageTable
from ..core.variants import KernelVariant
from . import GPUUnavailableError, require_gpu
from .compiled_builds import base_build
from .device_features import check_option, sm90_option
from .experiments import DecodeExperiments
from .kernel_source import KernelBuild
from .launch import DecodeLaunch, bind_decode_launch
from .page_tables import is_device_array, plan_page_table
from .params import LaunchGrid, decode_params, sm_scale_log2, soft_cap_log2, unified_max_log2
from .per_shape import per_shape_plan
from .records import PlanUpload, alibi_bits, query_rows_array
from .run_inputs import DecodeShape, run_inputs, run_stream
from .streams import PlanStreams
from .unified_counter import FallbackCounter
from .workspace import Workspace

# planner.choose_plan, imported on the first plan() (the planner reads profiles with PyYAML,
# which importing the runtime does not load) and kept, not imported again on every step
_choose_plan = None


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
    use_cuda_graph, max_batch_size, max_num_pages, max_chunks, max_q_len: a graph-stable wrapper
        and its capacity: with ``use_cuda_graph=True`` this constructor returns a
        ``GraphStableDecodeWrapper`` (runtime/graph_stable.py, where they are described).
    kv_dtype: None (K/V in ``dtype``), or an fp8 format for the caches: 'float8_e4m3fn' or
        'float8_e5m2' (vLLM's 'fp8_e4m3' / 'fp8_e5m2' too; torch.float8_* dtypes): K and V are
        uint8 codes (or torch float8 tensors), dequantized in the kernel; ``run()`` takes their
        scales. q and the output stay ``dtype``.
    kv_layout: 'NHD' (pages of [page_size, num_kv_heads, head_dim], the default) or 'HND'
        (FlashInfer's name: pages of [num_kv_heads, page_size, head_dim]), read in place; either
        may be a strided view (padded heads or tokens, a slice of a combined K/V array).
    workspace_buffer: a contiguous device array (any dtype, 256-byte aligned) that holds the
        split plans' partial states and counters, as FlashInfer's float workspace; size it with
        ``splitkv.workspace_size``. None: the wrapper allocates its own, grown as plans need.
    """

    def __new__(cls, *args, use_cuda_graph=False, **kwargs):
        if cls is BatchDecodeWrapper and use_cuda_graph is True:
            from .graph_stable import GraphStableDecodeWrapper

            cls = GraphStableDecodeWrapper
        return super().__new__(cls)

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", profile=None, use_clusters: bool | None = None,
                 launch_order: str = "longest_chunks", pdl: bool | None = None,
                 experiments: DecodeExperiments | None = None, *, use_cuda_graph: bool = False,
                 max_batch_size: int | None = None, max_num_pages: int | None = None,
                 max_chunks: int | None = None, kv_dtype=None, kv_layout: str = "NHD",
                 max_q_len: int | None = None, workspace_buffer=None):
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
        V.check_head_dim_for_kv(self.head_dim, self.kv_dtype)
        self.kv_layout = check_kv_layout(kv_layout)
        self._shape = DecodeShape(self.num_qo_heads, self.num_kv_heads, self.head_dim,
                                  self.page_size, self.dtype, self.kv_dtype, self.kv_layout)
        self._device_id = None                # the device of the plan, once planned
        self.base_build = base_build(self.dtype, self.head_dim, self.group_size, self.page_size,
                                     self.kv_dtype, experiments)
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
        self._bound_build: KernelBuild | None = None   # the build _bind() launched
        self._query_rows = None               # the current plan's multi-token rows, if any
        self._upload = PlanUpload()
        self._workspace = Workspace(self.head_dim, workspace_buffer)
        self._device_table = None             # a plan's page table kept on the device
        self._unified_fallbacks = FallbackCounter()   # the unified max's fallbacks
        # every use of the buffers (plan uploads, runs), ordered across streams
        self._streams = PlanStreams()
        self._pages_in_record = False
        self._run_after_device_plan = False   # the next run follows the planning kernel
        self.use_cuda_graph = check_option("use_cuda_graph", use_cuda_graph) or False
        self._init_capacity(max_batch_size, max_num_pages, max_chunks, max_q_len)

    def _init_capacity(self, max_batch_size, max_num_pages, max_chunks, max_q_len) -> None:
        """A per-shape wrapper has no capacity: each given is refused, naming it."""
        given = {"max_batch_size": max_batch_size, "max_num_pages": max_num_pages,
                 "max_chunks": max_chunks}
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(f"{extra[0]}: a capacity is for a graph-stable wrapper; pass "
                             "use_cuda_graph=True")
        if max_q_len is not None:
            raise ValueError("max_q_len: a capacity is for a graph-stable wrapper (pass "
                             "use_cuda_graph=True); per-shape wrappers take any qo_indptr")
        self._capacity, self._max_q_len = None, 1
        self.ctas_per_kv_head = ctas_per_kv_head(self.group_size)

    @property
    def max_chunks(self) -> int | None:
        """A graph-stable wrapper's chunks per plan (its fixed grid); None otherwise."""
        return None

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
    def kernel_build(self) -> KernelBuild | None:
        """The build the current plan's partial kernel runs (its warps, stages, cluster size):
        a per-shape plan whose CTAs are one per SM or fewer runs 8 warps where 4 are
        issue-bound (``core.builds.plan_warps``); None before a plan."""
        return self._bound_build if self._launch is not None else None

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
        from ..planner.profile_lookup import load_profile
        from ..planner.profiles import Profile

        if not isinstance(self._profile, Profile):
            # None, or a path the constructor read: loaded here to be checked against the device
            from .._first_use_source import first_use_source
            from . import device_info

            require_gpu("BatchDecodeWrapper.profile")
            info = device_info()
            # a device with no profile is probed once (cached), unless $SPLITKV_FIRST_USE=off:
            # by splitkv.measure's probes, which splitkv/__init__.py installs (the runtime
            # never imports the measuring code)
            self._profile = load_profile(path=self._profile, device_name=info["name"],
                                         num_sms=info["num_sms"], first_use=first_use_source())
        self._resolved_profile = self._profile
        return self._profile

    def plan(self, page_table: PageTable | None = None, *, kv_indptr=None, kv_indices=None,
             kv_last_page_len=None, block_table=None, seq_lens=None,
             num_splits: int | None = None, strategy: str | None = None,
             plan: Plan | None = None, sm_scale: float | None = None, stream=None,
             window_left: int | None = None, logits_soft_cap: float | None = None,
             qo_indptr=None, unified_max: float | None = None,
             attention_chunk_size: int | None = None, alibi_slopes=None) -> Plan:
        """Choose and upload the decomposition for this batch (host work plus one upload);
        returns the plan as it runs. docs/api.md has every argument and error.

        The batch's pages: a ``PageTable``; FlashInfer's ``kv_indptr`` [batch + 1],
        ``kv_indices``, ``kv_last_page_len`` [batch]; or vLLM's ``block_table`` [batch, max
        pages] and ``seq_lens`` [batch]. The lengths are host arrays; the table itself
        (``block_table`` or ``kv_indices``) may be a device int32 array, read in place.
        ``num_splits`` / ``strategy`` force the planner's hand; ``plan`` bypasses it.
        ``stream``: the stream you run (or replay) on (default: torch's current stream when an
        array given is a torch tensor, else CuPy's). The variants (``core.variants``):
        ``window_left`` (each query sees its last window_left + 1 tokens; the plan covers only
        those), ``logits_soft_cap`` (s -> cap * tanh(s / cap), a build of its own),
        ``qo_indptr`` (multi-token decode: 1 to 16 query rows a request, causal among
        themselves; run()'s q has qo_indptr[-1] rows), ``unified_max`` (FlashDecoding++'s phi:
        scores offset by phi, a CTA leaving its band falls back to the running max; per-shape
        wrappers only), ``attention_chunk_size`` (chunked local attention: each query sees the
        keys of its own chunk; the plan covers only those; one query row a request),
        ``alibi_slopes`` (ALiBi: [num_qo_heads] slopes, host or CuPy; a build of its own,
        which a graph-stable wrapper keeps on or off as its first plan had it).
        """
        layout = dict(kv_indptr=kv_indptr, kv_indices=kv_indices,
                      kv_last_page_len=kv_last_page_len, block_table=block_table,
                      seq_lens=seq_lens)
        try:
            require_gpu("BatchDecodeWrapper.plan()")
        except GPUUnavailableError:   # a bad argument is named first, as on a GPU
            _check_host_arguments(self, page_table, layout, num_splits=num_splits,
                                  strategy=strategy, plan=plan, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, unified_max=unified_max,
                                  attention_chunk_size=attention_chunk_size,
                                  alibi_slopes=alibi_slopes)
            raise
        self._check_plans_on_host()
        page_table = plan_page_table(page_table, self.page_size, **layout)
        on_device = page_table.kv_indices is None      # the caller's table, read in place
        s = run_stream(stream, *layout.values(), qo_indptr)   # torch's with torch tensors
        soft_cap = soft_cap_log2(logits_soft_cap)
        phi = UM.check_unified_max(unified_max)
        slopes = VA.check_alibi_slopes(self.num_qo_heads, alibi_slopes)
        if phi is not None and self.use_cuda_graph:
            raise ValueError("unified_max: graph-stable wrappers do not take it yet (their "
                             "captured launch holds one build); use a per-shape wrapper")
        query_rows = VA.plan_query_rows(qo_indptr, page_table.kv_lens,
                                        max_q_len=self._max_q_len,
                                        graph_stable=self.use_cuda_graph,
                                        given_plan=plan is not None)
        # query rows a request the kernels are sized for: a graph-stable wrapper's captured
        # launch holds its capacity's, whatever the plan
        rows = self._kernel_rows(query_rows)
        chunk = VA.check_chunk_size(attention_chunk_size)
        VA.refuse_chunks_with_rows(chunk, rows)
        heads = self.num_qo_heads * rows
        if heads > V.MAX_HEADS:
            raise ValueError(f"qo_indptr: {rows} query rows x {self.num_qo_heads} heads exceed "
                             f"MAX_HEADS={V.MAX_HEADS} rows a kv head can hold")
        window = -1 if window_left is None else window_left
        plan_window = window
        if query_rows is not None:   # the plan covers every row's window; each row masks its own
            plan_window = VA.covering_window_left(
                V.check_int("window_left", window, -1, V.MAX_KV_LEN, "MAX_KV_LEN"), rows)
        # a device table's page ids are the caller's (unread here, as plan_on_device's)
        max_page = (int(page_table.kv_indices.max())
                    if not on_device and page_table.kv_indices.size else -1)
        self._check_fits(page_table, max_page, s)
        clusters = self._clusters()
        if plan is not None:
            V.check_instance("plan", plan, Plan)
            V.check_plan_for_table(plan, page_table, num_qo_heads=self.num_qo_heads,
                                   num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                   dtype=self.dtype, window_left=window_left,
                                   attention_chunk_size=(None if attention_chunk_size is None
                                                         else chunk))
            chosen = plan.with_execution(clusters=clusters, launch_order=self.launch_order)
        else:
            global _choose_plan
            if _choose_plan is None:
                from ..planner import choose_plan as _choose_plan

            problem = DecodeProblem.from_page_table(
                page_table, heads, self.num_kv_heads, self.head_dim, self.dtype,
                window_left=plan_window, attention_chunk_size=chunk)
            model = self.profile.cost_model(self.kv_dtype, graph_stable=self.use_cuda_graph)
            if not clusters:                     # predict the ticket merge that will run
                model = model.with_clusters(False)
            if query_rows is not None:           # the builds' tiles of multi-token plans
                model = model.for_multi_token()
            chosen = _choose_plan(problem, model, num_splits, strategy,
                                  launch_order=self.launch_order,
                                  max_chunks=self._plan_max_chunks(page_table.batch_size))
        scale_log2 = sm_scale_log2(sm_scale, self.head_dim)
        if max_page >= 2**31:
            raise ValueError("page_table: page indices must be < 2**31")

        self._streams.before_plan(s)   # runs on other streams may still read the buffers
        read_rows = query_rows        # the rows the build reads: ALiBi, each query's position
        if read_rows is None and slopes is not None:
            read_rows = VA.query_rows(None, page_table.kv_lens)
        rows_array = (None if read_rows is None
                      else query_rows_array(read_rows, page_table.kv_lens, window))
        self._upload_plan(chosen, page_table, s, sm_scale_log2=scale_log2, max_page=max_page,
                          soft_cap_log2=soft_cap, rows_array=rows_array, query_rows=query_rows,
                          phi=phi, heads=heads, alibi=slopes)
        self._streams.plan_stream = s
        self._plan, self._max_page = chosen, max_page
        return chosen

    def warmup(self, *, logits_soft_cap: bool = False, max_q_len: int | None = None,
               unified_max: bool = False, alibi: bool = False) -> int:
        """Do before serving what the first plans would otherwise do in the middle of it:
        resolve the cost model (a GPU with no profile is probed here), compile every build
        this wrapper's plans can run on the current device, and, for a graph-stable wrapper,
        the planning kernel. After it no ``plan()`` or ``plan_on_device()`` with these options
        compiles. ``logits_soft_cap``: whether plans will take a soft cap (the builds with and
        without it are compiled); ``max_q_len``: the most query rows a request (multi-token
        decode; a graph-stable wrapper's is its own); ``unified_max``, ``alibi``: whether plans
        take it (``plan(alibi_slopes=)``): its builds in place of those without.
        Returns the number of decode builds, compiled now or earlier in this process."""
        require_gpu("BatchDecodeWrapper.warmup()")
        from .compiled_builds import compile_reachable

        for name, value in (("logits_soft_cap", logits_soft_cap), ("unified_max", unified_max),
                            ("alibi", alibi)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected True or False (whether plans will take "
                                f"it), got {value!r}")
        if unified_max and self.use_cuda_graph:
            raise ValueError("unified_max: graph-stable wrappers do not take it (their plans "
                             "refuse it)")
        rows = self._warmup_rows(max_q_len)
        self.profile            # noqa: B018  (resolved, probed where the GPU has no profile)
        count = compile_reachable(
            self.base_build, self.experiments, page_size=self.page_size,
            group_size=self.group_size, soft_caps=(False, True) if logits_soft_cap else (False,),
            max_q_len=rows, unified_max=unified_max, clusters=self._clusters(),
            graph_stable=self.use_cuda_graph, alibi=alibi)
        self._warm_planner()
        return count

    def _warmup_rows(self, max_q_len) -> int:
        """warmup()'s query rows a request: up to 16 (multi-token decode), 1 by default."""
        if max_q_len is None:
            return 1
        return V.check_int("max_q_len", max_q_len, 1, VA.MAX_Q_LEN)

    def _warm_planner(self) -> None:
        """A per-shape wrapper plans on the host: no kernel to compile."""

    # the decisions a graph-stable wrapper makes otherwise (GraphStableDecodeWrapper)
    def _check_plans_on_host(self) -> None:
        """plan() may run: a per-shape wrapper always plans on the host."""

    def _kernel_rows(self, query_rows) -> int:
        """Query rows a request the kernels are sized for: the plan's."""
        return query_rows.max_q_len if query_rows is not None else 1

    def _plan_max_chunks(self, batch_size: int) -> int | None:
        """The most chunks a plan of ``batch_size`` requests may have (None: any)."""
        return None

    def _launch_for_rows(self, rows: int) -> DecodeLaunch:
        """The launches that run q of ``rows`` rows: the plan's."""
        return self._launch

    def _check_fits(self, page_table: PageTable, max_page: int, stream) -> None:
        """A per-shape wrapper's plans have no capacity to fit."""

    def _clusters(self) -> bool:
        """Whether plans may merge in thread-block clusters (``use_clusters`` on this GPU)."""
        return sm90_option("use_clusters", self.use_clusters, "thread-block clusters")

    def _ready_event(self):
        """The event after the current plan's upload."""
        return self._upload.ready

    def _planned(self) -> bool:
        return self._plan is not None

    def _plan_rows(self) -> int:
        """Rows the current plan writes: its requests, or its query rows (multi-token)."""
        if self._query_rows is not None:    # multi-token decode: q has each query row
            return self._query_rows.num_rows
        return self._plan.problem.batch_size

    def _run_rows(self) -> tuple[int, int]:
        """(fewest, most) rows of run()'s q, out and lse: a per-shape plan's own."""
        return self._plan_rows(), self._plan_rows()

    def _note_pool(self, k_cache) -> None:
        """A per-shape plan checks its page ids against each run's pool: nothing to keep."""

    def _upload_plan(self, chosen: Plan, page_table: PageTable, s, *, sm_scale_log2: float,
                     max_page: int, soft_cap_log2: float, rows_array, query_rows, phi,
                     heads: int, alibi=None) -> None:
        """plan() of a per-shape wrapper: the plan's build, its records and the one upload, the
        workspace, and the launches of its grid."""
        import cupy

        variant = KernelVariant(soft_cap=soft_cap_log2 > 0, multi_token=heads > self.num_qo_heads,
                                unified_max=phi is not None, alibi=alibi is not None)
        built = per_shape_plan(chosen, page_table, shape=self._shape, heads=heads,
                               base=self.base_build, experiments=self.experiments,
                               variant=variant, rows_array=rows_array)
        if alibi is not None:       # float32 slope x log2(e) a head, riding the plan's upload
            built.extra["alibi_slopes_log2"] = alibi_bits(alibi)
        kernels, per_kv_head, in_record = built.kernels, built.per_kv_head, built.pages_in_record
        meta = self._upload.upload(built.records, page_table, chosen, s, built.extra)
        if page_table.kv_indices is None:             # the caller's table, read in place
            meta["kv_indices"] = page_table.table.ptr
            self._device_table = page_table.table     # kept alive while the plan runs
        self._workspace.ensure(chosen, per_kv_head, s)
        if phi is not None:
            self._unified_fallbacks.zero(s)
        self._upload.ready.record(s)          # run() on another stream waits for the uploads
        unified = {} if phi is None else {"unified_max_log2": unified_max_log2(phi),
                                          "unified_fallbacks": self._unified_fallbacks.ptr}
        self._launch = self._bind(kernels, meta, LaunchGrid(
            chosen.num_chunks, chosen.problem.batch_size, heads, per_kv_head,
            merge=chosen.merge == MERGE_KERNEL, pages_in_record=in_record,
            cluster_size=chosen.cluster_size), sm_scale_log2, soft_cap_log2, **unified)
        self._query_rows = query_rows
        self._device_id = cupy.cuda.runtime.getDevice()
        self._pages_in_record = in_record

    def _bind(self, kernels, meta: dict, grid: LaunchGrid, sm_scale_log2: float,
              soft_cap_log2: float, **unified) -> DecodeLaunch:
        """The launches of ``grid`` and their DecodeParams, all but the tensors (``params``,
        ``launch``); ``meta``: the device pointers of the plan's buffers."""
        pdl = sm90_option("pdl", self.pdl, "programmatic dependent launch")
        params = decode_params(meta, self._workspace, grid, num_kv_heads=self.num_kv_heads,
                               page_size=self.page_size, q_group=self.group_size,
                               sm_scale_log2=sm_scale_log2, soft_cap_log2=soft_cap_log2,
                               pdl_early_trigger=pdl and self.experiments.pdl_trigger == "early",
                               **unified)
        spread = grid.spread if grid.spread is not None else self.experiments.pdl_spread
        launch = bind_decode_launch(kernels, params, grid, num_kv_heads=self.num_kv_heads,
                                    head_dim=self.head_dim, pdl=pdl, spread=spread)
        self._bound_build = kernels.build
        return launch

    def unified_max_fallbacks(self) -> int:
        """How many CTAs fell back from the unified max to the running max in the runs since
        the last ``plan(unified_max=)`` (a CTA is a chunk x kv head for groups up to 64 query
        heads); waits for those runs. 0 for a plan without it."""
        if self._launch is None or not self._launch.params.unified_fallbacks:
            return 0
        return self._unified_fallbacks.read()

    # planning on the device is a graph-stable wrapper's (GraphStableDecodeWrapper)
    def plan_on_device(self, **_) -> None:
        require_gpu("BatchDecodeWrapper.plan_on_device()")
        raise ValueError("plan_on_device: needs a graph-stable wrapper (use_cuda_graph=True "
                         "with its capacity)")

    def device_plan_state(self) -> dict:
        raise RuntimeError("device_plan_state: call plan_on_device() first")

    def clear_device_plan_error(self, stream=None) -> None:
        raise RuntimeError("clear_device_plan_error: call plan_on_device() first")

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
        if not self._planned():
            raise RuntimeError("run: call plan() (or, graph-stable, plan_on_device()) first")
        want_lse = return_lse or lse is not None
        io = run_inputs(self._shape, q, k_cache, v_cache, out=out, lse=lse, want_lse=want_lse,
                        stream=stream, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                        rows=self._run_rows(), max_page=self._max_page, device=self._device_id)
        self._streams.wait_for_plan(io.stream, self._ready_event())
        self._note_pool(io.k_cache)
        if io.rows:
            with self._streams.run_order(io.stream):
                launch = self._launch_for_rows(io.rows)
                launch(io.args, io.stream.ptr, plain=self._run_after_device_plan)
            self._run_after_device_plan = False
        return (io.out, io.lse) if want_lse else io.out


def _check_host_arguments(wrapper: BatchDecodeWrapper, page_table, layout: dict, *, num_splits,
                          strategy, plan, window_left, logits_soft_cap, unified_max,
                          attention_chunk_size, alibi_slopes) -> None:
    """plan()'s checks of host arguments, made where no GPU is before the missing GPU is
    named: an engine wired up on a machine without one sees its bad lengths, tables and
    variant values refused as a GPU would refuse them. A table on a device (a CUDA tensor
    where CuPy is missing) is a GPU's to check; a given ``plan`` makes the split arguments
    unread, as on a GPU."""
    if not any(is_device_array(layout[name]) for name in ("block_table", "kv_indices")):
        table = PageTable.from_layout(page_table, wrapper.page_size, **layout)
        if table.page_size != wrapper.page_size:
            raise ValueError(f"page_table: page_size {table.page_size} differs from the "
                             f"wrapper's page_size {wrapper.page_size}")
    if num_splits is not None and plan is None:
        V.check_int("num_splits", num_splits, 1, V.MAX_CHUNKS, "MAX_CHUNKS")
    if strategy is not None and plan is None:
        V.check_strategy(strategy)
    if window_left is not None:
        V.check_int("window_left", window_left, -1, V.MAX_KV_LEN, "MAX_KV_LEN")
    soft_cap_log2(logits_soft_cap)
    UM.check_unified_max(unified_max)
    VA.check_chunk_size(attention_chunk_size)
    VA.check_alibi_slopes(wrapper.num_qo_heads, alibi_slopes)
