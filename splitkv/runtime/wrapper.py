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
``plan()``.

The plan says how it runs (``Plan.execution``: merge mode, cluster size, launch order); the
wrapper executes that. Its parts: ``records`` (chunk records and the upload), ``workspace``,
``features`` (what the GPU offers), ``launch`` (``cuLaunchKernelEx``), ``kernel_abi`` (the
kernels' argument structs).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..core import validation as V
from ..core.execution import check_launch_order, grid_order
from ..core.geometry import THREADS_PER_CTA, ctas_per_kv_head
from ..core.plan import Plan
from ..core.problem import DecodeProblem, PageTable
from .arrays import as_cupy_stream, as_device_array, cupy_storage_dtype
from .experiments import DecodeExperiments
from .features import check_option, one_per_sm_shared_bytes, sm90_option, spreads_one_per_sm
from .kernel_abi import DecodeParams
from .kernel_source import DecodeVariant
from .launch import DecodeLaunch, KernelLaunch, current_context
from .modules import get_decode_kernels
from .records import (PlanUpload, chunk_records, first_pages, pages_fit_record,  # noqa: F401
                      record_pages_needed)
from .workspace import Workspace

LOG2E = 1.4426950408889634


class BatchDecodeWrapper:
    """Decode attention over a paged KV cache (NHD layout) with an adaptive split-KV plan.

    Shapes: q [batch, num_qo_heads, head_dim]; k_cache, v_cache [num_pages, page_size,
    num_kv_heads, head_dim] (a view with other page/token strides works if rows stay 16-byte
    aligned); out [batch, num_qo_heads, head_dim] in the input dtype; lse [batch, num_qo_heads]
    float32, natural log. Inputs float16 or bfloat16 (bfloat16 may be given as uint16 bits).

    profile: the cost-model profile plans are chosen with (a Profile, or a path); None: the one
        shipped for this device.
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
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 dtype="bfloat16", profile=None, use_clusters: bool | None = None,
                 launch_order: str = "longest_chunks", pdl: bool | None = None,
                 experiments: DecodeExperiments | None = None):
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
        self.variant = DecodeVariant.for_problem(self.dtype, self.head_dim, self.group_size,
                                                 experiments.stages or 0,
                                                 experiments.max_registers or 0)
        self.ctas_per_kv_head = ctas_per_kv_head(self.group_size)
        self._profile = profile
        self._plan: Plan | None = None
        self._launch: DecodeLaunch | None = None
        self._upload = PlanUpload()
        self._workspace = Workspace(self.head_dim)

    # ------------------------------------------------------------------ plan
    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    @property
    def cluster_size(self) -> int:
        """Cluster size the current plan's fused merge runs in; 0 when it uses none."""
        return self._plan.cluster_size if self._plan is not None else 0

    @property
    def pdl_active(self) -> bool:
        """Whether the current plan launches with programmatic dependent launch."""
        return self._launch is not None and self._launch.pdl

    @property
    def pages_in_record(self) -> bool:
        """Whether the current plan's first tiles take their page ids from the chunk records."""
        return self._launch is not None and bool(self._launch.params.pages_in_record)

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
        clusters = sm90_option("use_clusters", self.use_clusters, "thread-block clusters")
        if plan is not None:
            V.check_instance("plan", plan, Plan)
            V.check_plan_for_table(plan, page_table, num_qo_heads=self.num_qo_heads,
                                   num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                   dtype=self.dtype)
            chosen = plan.with_execution(clusters=clusters, launch_order=self.launch_order)
        else:
            from ..planner import choose_plan

            problem = DecodeProblem.from_page_table(page_table, self.num_qo_heads,
                                                    self.num_kv_heads, self.head_dim, self.dtype)
            model = self.profile.cost_model()
            if not clusters:                     # predict the ticket merge that will run
                model = model.with_clusters(False)
            chosen = choose_plan(problem, model, num_splits, strategy,
                                 launch_order=self.launch_order)
        sm_scale_log2 = float(np.float32(V.check_sm_scale(sm_scale, self.head_dim) * LOG2E))
        max_page = int(page_table.kv_indices.max()) if page_table.kv_indices.size else -1
        if max_page >= 2**31:
            raise ValueError("page_table: page indices must be < 2**31")

        s = as_cupy_stream(stream)
        kernels = get_decode_kernels(replace(self.variant, cluster=chosen.cluster_size))
        stages = kernels.variant.stages
        in_record = pages_fit_record(chosen, self.page_size, stages)
        records = chunk_records(chosen, page_table, grid_order(chosen),
                                record_pages_needed(self.page_size, stages) if in_record else 0)
        meta = self._upload.upload(records, page_table, chosen, s)
        self._workspace.ensure(chosen, self.ctas_per_kv_head, s)
        self._upload.ready.record(s)          # run() on another stream waits for the uploads
        self._launch = self._bind(chosen, kernels, meta, in_record, sm_scale_log2)
        self._device_id = cupy.cuda.runtime.getDevice()
        self._plan_stream_ptr = s.ptr
        self._plan, self._max_page = chosen, max_page
        return chosen

    def _bind(self, plan: Plan, kernels, meta: dict, pages_in_record: bool,
              sm_scale_log2: float) -> DecodeLaunch:
        """The plan's launches and its DecodeParams, all but the tensors."""
        pdl = sm90_option("pdl", self.pdl, "programmatic dependent launch")
        ws = self._workspace
        params = DecodeParams(
            kv_indices=meta["kv_indices"], records=meta["records"],
            merge_indptr=meta["merge_indptr"], partial_o=ws.partial_o.data.ptr,
            partial_lse=ws.partial_lse.data.ptr, counters=ws.counters.data.ptr,
            batch_size=plan.problem.batch_size, num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, ctas_per_kv_head=self.ctas_per_kv_head,
            page_size=self.page_size, sm_scale_log2=sm_scale_log2,
            ticket_merge=int(plan.merge == "ticket"), pages_in_record=int(pages_in_record),
            pdl_early_trigger=int(pdl and self.experiments.pdl_trigger == "early"))
        grid = plan.num_chunks * self.num_kv_heads * self.ctas_per_kv_head
        shared = kernels.variant.shared_bytes
        spread = self.experiments.pdl_spread
        if spread is None:
            spread = spreads_one_per_sm(grid, plan.cluster_size)
        if pdl and spread:
            shared = kernels.one_per_sm_shared_bytes
        partial = KernelLaunch(kernels.partial, grid, THREADS_PER_CTA, shared, pdl=pdl)
        merge = None
        if plan.merge == "merge_kernel":
            # one thread per (request, qo head, 4 dims)
            slots = plan.problem.batch_size * self.num_qo_heads * (self.head_dim // 4)
            merge = KernelLaunch(kernels.merge, -(-slots // THREADS_PER_CTA), THREADS_PER_CTA, 0,
                                 pdl=pdl)
        return DecodeLaunch(params, partial, merge, current_context())

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
        if s.ptr != self._plan_stream_ptr and not s.is_capturing():
            # Order this stream after plan()'s upload. Not inside a graph capture: a wait on an
            # event recorded outside it would pull outside work into the graph, and a host wait
            # is what the default (global) capture mode forbids. A captured run reads the
            # records when the graph replays, so the replay is what must follow plan()'s
            # upload, as any work queued after it on the plan's stream does.
            s.wait_event(self._upload.ready)
        if batch:
            self._launch(qa.ptr, ka.ptr, va.ptr, ka.strides[0], ka.strides[1], oa.ptr, lse_ptr,
                         s.ptr)
        return (out, lse) if want_lse else out
