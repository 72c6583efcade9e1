"""A graph-stable wrapper (``BatchDecodeWrapper(..., use_cuda_graph=True)``): a capacity, one
fixed grid for it, built at the first plan, and plan buffers at fixed addresses that each
``plan()`` rewrites (``records.GraphPlanUpload``), or that the planning kernel writes on the
device (``plan_on_device``), so one CUDA graph captured once replays every later plan."""

from __future__ import annotations

import numpy as np

from ..core import validation as V
from ..core import variants as VA
from ..core.execution import grid_order
from ..core.geometry import RECORD_PAGES, ctas_per_kv_head
from ..core.plan import Plan
from ..core.problem import PageTable
from ..core.variants import PLAIN, KernelVariant
from . import require_gpu
from .arrays import as_cupy_stream
from .compiled_builds import graph_kernels
from .page_tables import is_device_array
from .params import LaunchGrid, sm_scale_log2, soft_cap_log2
from .run_inputs import run_stream
from .records import (GraphPlanUpload, alibi_bits, chunk_records, pages_fit_record,
                      record_pages_needed)
from .wrapper import BatchDecodeWrapper


class GraphStableDecodeWrapper(BatchDecodeWrapper):
    """A ``BatchDecodeWrapper`` whose runs launch one fixed grid; its arguments are
    ``BatchDecodeWrapper``'s, and:

    use_cuda_graph: graph-stable (as FlashInfer's ``use_cuda_graph``): ``run()`` launches one
        fixed grid for the capacity below, whatever the plan, and ``plan()`` rewrites the plan
        buffers in place, so a CUDA graph captured once replays correctly after every later
        ``plan()``. Call ``plan()`` on the stream the graph replays on (its upload must come
        after the previous replay and before the next). The planner then chooses among plans
        that fit the capacity and merge without clusters; q, out and lse have
        ``max_batch_size`` rows (x ``max_q_len``; rows past the plan's are not written).
    max_batch_size, max_num_pages: the capacity of a graph-stable wrapper: requests per plan,
        and page-table entries (``kv_indices``) per plan. Required with ``use_cuda_graph``.
    max_chunks: chunks per plan (a grid is max_chunks x num_kv_heads x ctas_per_kv_head
        CTAs, and CTAs past the plan's chunks exit at once): given, one fixed grid for every
        batch. Default: a grid per batch size that runs (q's rows; an engine captures a graph
        per batch size), sized as a wrapper of that capacity would be (``max_chunks_for``): at
        least the batch, and 2 x SMs CTAs for a small batch (one CTA per SM, see
        ``_spreads``), 4 x SMs else; every grid shares the capacity's buffers.
    max_q_len: a graph-stable wrapper's query rows a request for multi-token decode (1 to 16;
        default 1): its captured launch runs the multi-token build sized for it, every plan
        takes ``qo_indptr`` of up to that many rows a request (or none: one row each), and q,
        out and lse have max_batch_size x max_q_len rows (rows past qo_indptr[-1] are not
        written). Per-shape wrappers take any ``qo_indptr`` without it. Its plans are the
        planner's own (``plan()`` refuses a ``plan=``).
    """

    def __init__(self, *args, use_cuda_graph: bool = True, **kwargs):
        if use_cuda_graph is not True:
            raise ValueError("use_cuda_graph: a GraphStableDecodeWrapper is graph-stable; "
                             "make a per-shape wrapper with BatchDecodeWrapper")
        super().__init__(*args, use_cuda_graph=True, **kwargs)

    def _init_capacity(self, max_batch_size, max_num_pages, max_chunks, max_q_len) -> None:
        self._capacity = self._check_capacity(max_batch_size, max_num_pages, max_chunks)
        self._max_q_len = self._check_max_q_len(max_q_len)
        # a graph-stable multi-token grid: CTAs for max_q_len x the group a kv head
        self.ctas_per_kv_head = ctas_per_kv_head(self.group_size * self._max_q_len)
        batch, _, chunks = self._capacity
        if chunks is not None:
            V.check_grid_ctas("max_chunks", chunks * self.num_kv_heads * self.ctas_per_kv_head,
                              "max_chunks x kv heads x CTAs a kv head")
        V.check_grid_ctas("max_batch_size", -(-batch * self.num_qo_heads * self._max_q_len
                                              * self.head_dim // (4 * 128)),
                          "the merge kernel's: a thread per 4 dims of each request's heads")
        self._launch_variant = PLAIN          # the hooks of the bound launches' build
        self._chunks_given = chunks is not None   # one fixed grid, else a grid per batch size
        self._launches: dict = {}             # requests a grid is built for -> its DecodeLaunch
        self._logits_soft_cap_log2 = 0.0      # the last plan's soft cap, in every grid's params
        self._grid_binding = None             # what binding a grid needs: kernels, buffers, ...
        self._graph_upload: GraphPlanUpload | None = None
        self._graph_pool_pages: int | None = None    # pages of the K/V pool a run was given
        self._device_planner = None           # plan_on_device()'s kernel, once bound
        self._device_plan_ready = None        # the event after the last eager plan_on_device()
        # plan_on_device()'s alibi_slopes last written to the buffer, as given and checked,
        # and the buffer's bits
        self._alibi_given = self._alibi_checked = self._alibi_bits = None

    def _warmup_rows(self, max_q_len) -> int:
        """A graph-stable wrapper's builds are sized for its own max_q_len."""
        if max_q_len is not None and max_q_len != self._max_q_len:
            raise ValueError(f"max_q_len: a graph-stable wrapper runs its own max_q_len="
                             f"{self._max_q_len}; got {max_q_len!r}")
        return self._max_q_len

    def _warm_planner(self) -> None:
        """plan_on_device()'s planning kernel."""
        from .device_planner import plan_kernel

        plan_kernel()

    def _check_capacity(self, max_batch_size, max_num_pages, max_chunks):
        """(max_batch_size, max_num_pages, max_chunks or None) of a graph-stable wrapper."""
        given = {"max_batch_size": max_batch_size, "max_num_pages": max_num_pages,
                 "max_chunks": max_chunks}
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
        return V.check_int("max_q_len", max_q_len, 1, VA.MAX_Q_LEN, "MAX_Q_LEN")

    @property
    def max_chunks(self) -> int:
        """Chunks per plan of the capacity (the largest grid's CTA rows, what the buffers
        hold)."""
        batch, _, chunks = self._capacity
        if chunks is None:
            chunks = self._default_chunks(batch)
            self._capacity = (*self._capacity[:2], chunks)
        return chunks

    def max_chunks_for(self, batch_size: int) -> int:
        """Chunks per plan of a batch of ``batch_size`` requests: the CTA rows of the grid that
        runs it (``max_chunks`` when it was given: one fixed grid)."""
        return self.max_chunks if self._chunks_given else self._default_chunks(
            self._grid_requests(batch_size))

    def _grid_requests(self, batch_size: int) -> int:
        """The requests the grid that runs a batch is built for: the batch's own, unless the
        wrapper has one fixed grid (max_chunks given, or multi-token rows, whose device plans
        fill the whole capacity)."""
        if self._chunks_given or self._max_q_len > 1:
            return self._capacity[0]
        return min(max(int(batch_size), 1), self._capacity[0])

    def _default_chunks(self, requests: int) -> int:
        """The default grid's chunks for ``requests``: a spread grid is one wave of one CTA
        per SM, twice; else two waves of two."""
        from . import device_info

        require_gpu("BatchDecodeWrapper.max_chunks")   # sized from the device's SMs
        waves = 2 * device_info()["num_sms"] * (1 if self._spreads(requests) else 2)
        return max(requests, waves // (self.num_kv_heads * self.ctas_per_kv_head))

    def _spreads(self, requests: int) -> bool:
        """Whether the grid built for ``requests`` places one CTA per SM under PDL (see
        ``device_features.spreads_one_per_sm``): decided per grid, since its captured launch
        holds it. Yes when even ``requests`` unsplit leave SMs idle, so that plans split to fill
        them (and those split requests' CTAs, whatever else the grid holds, must not land two
        to an SM); no for larger batches, whose plans fill the SMs twice.
        Never for fp8 K/V: a lone fp8 CTA streams far below an SM's share, so two to an SM on
        half the SMs lose little, while a spread grid runs plans of more CTAs than SMs in two
        rounds (H200: b8_n32k 187 us spread, 133 not, 133 per-shape; b1_n8k 12.7 vs 13.5;
        docs/design/fp8.md)."""
        from . import device_info

        if self.experiments.pdl_spread is not None:
            return self.experiments.pdl_spread
        if self.kv_dtype:
            return False
        items = requests * self.num_kv_heads * self.ctas_per_kv_head
        return items <= device_info()["num_sms"]

    # ------------------------------------------------------------------ plan
    def _check_plans_on_host(self) -> None:
        if self._device_planner is not None:
            raise RuntimeError("plan: this wrapper plans on the device (plan_on_device() was "
                               "called); a wrapper plans one way or the other")

    def _kernel_rows(self, query_rows) -> int:
        return self._max_q_len

    def _plan_max_chunks(self, batch_size: int) -> int:
        return self.max_chunks_for(batch_size)

    def _clusters(self) -> bool:
        return False                          # a graph-stable grid is one fixed launch

    def _check_fits(self, page_table: PageTable, max_page: int, stream) -> None:
        """A graph-stable wrapper's checks of a page table against its capacity, before any
        planning or upload."""
        max_batch, max_pages = self._capacity[0], self._capacity[1]
        if page_table.kv_indices is None:
            raise ValueError("block_table: a graph-stable wrapper's plan() copies a host page "
                             "table into its fixed buffers; with the table on the device, plan "
                             "with plan_on_device() (or pass a host table)")
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

    def _graph_kernels(self, soft_cap_log2: float, alibi: bool = False):
        """A graph-stable wrapper's kernels: bound with its first plan (the captured launches
        hold them), so later plans keep that plan's soft cap, and ALiBi, on or off."""
        variant = KernelVariant(soft_cap=soft_cap_log2 > 0, multi_token=self._max_q_len > 1,
                                alibi=alibi)
        if self._launch is not None and self._launch_variant != variant:
            bound = self._launch_variant
            name, on = (("logits_soft_cap", bound.soft_cap) if bound.soft_cap != variant.soft_cap
                        else ("alibi_slopes", bound.alibi))
            raise ValueError(f"{name}: a graph-stable wrapper keeps its first plan's "
                             f"{'soft cap' if name == 'logits_soft_cap' else 'ALiBi'} "
                             f"{'on' if on else 'off'} (its captured launches hold that "
                             "kernel); its values may change")
        self._launch_variant = variant
        return graph_kernels(self.base_build, self.experiments, variant=variant,
                             rows=self.group_size * self._max_q_len)

    def _upload_plan(self, chosen: Plan, page_table: PageTable, s, *, sm_scale_log2: float,
                     max_page: int, soft_cap_log2: float, rows_array, query_rows=None,
                     alibi=None, **_) -> None:
        """plan() of a graph-stable wrapper: the records written straight into a pinned buffer
        whose rest of the capacity holds idle records, uploaded into the fixed buffers; the
        launches are built once, for the capacity."""
        import cupy

        max_batch, max_pages, max_chunks = self._capacity[0], self._capacity[1], self.max_chunks
        batch = chosen.problem.batch_size
        grid_chunks = self.max_chunks_for(batch)
        if chosen.num_chunks > grid_chunks:
            raise ValueError(f"plan: {chosen.num_chunks} chunks exceed the {grid_chunks} of the "
                             f"grid that runs a batch of {batch} (max_chunks="
                             f"{max_chunks if self._chunks_given else None}; pass max_chunks= "
                             "for one larger fixed grid)")
        kernels = self._graph_kernels(soft_cap_log2, alibi is not None)
        stages = kernels.build.stages
        tile = kernels.build.tile_tokens
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
            upload = GraphPlanUpload(max_chunks, max_pages, max_batch, s,
                                     **self._upload_parts(alibi is not None))
            self._workspace.ensure_size(max_chunks * heads,
                                        max_batch * self.num_kv_heads * self.ctas_per_kv_head, s)
            self._grid_binding = (kernels, upload.pointers, may_carry_pages, False, sm_scale_log2)
            self._launch = self._grid_launch(max_batch)
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
        self._graph_upload.upload(page_table.kv_indices, merge_indptr, s, query_rows=rows_array,
                                  alibi_bits=None if alibi is None else alibi_bits(alibi))
        self._write_soft_cap(soft_cap_log2)   # last: a refused plan leaves the launches be
        self._pages_in_record = in_record
        self._query_rows = query_rows

    def plan_on_device(self, *, seq_lens=None, block_table=None, kv_indptr=None,
                       kv_indices=None, kv_last_page_len=None, sm_scale: float | None = None,
                       stream=None, logits_soft_cap: float | None = None,
                       qo_indptr=None, window_left: int | None = None,
                       attention_chunk_size: int | None = None, alibi_slopes=None) -> None:
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
        The first call allocates and must not be captured. Each call's arrays go into the
        launches it enqueues (a captured graph holds those of its capture, which must stay
        alive while it replays): a decode loop updates them in place, and an engine with a
        graph per batch size passes that size's views of its buffers (``seq_lens[:n]``,
        ``block_table[:n]``), each graph then replaying its own; ``run()``'s q and out may have
        any rows from the bound batch's up to the capacity. Page ids are not range-checked. A request whose values are invalid (a negative length, more pages
        than its row, a bad kv_indptr or kv_last_page_len) is planned as empty and the error is
        kept on the device: ``device_plan_state()`` reads it. ``logits_soft_cap``: as in
        ``plan()``. ``qo_indptr`` (a wrapper made with ``max_q_len``): multi-token decode's
        device int32 [batch + 1], bound like the others (None: one row a request); a bad
        entry leaves every output of the batch unwritten (past it, rows may overlap), and the
        error is kept likewise.
        ``window_left``: as in ``plan()`` (each row its own window); a captured graph holds the
        window of its capture (the planning kernel's argument). ``attention_chunk_size``: as in
        ``plan()`` (one query row a request), held by a captured graph likewise.
        ``alibi_slopes``: as in ``plan()``; ALiBi stays on or off as the first call had it, and
        the slopes are copied into the wrapper's buffer when they change, which a capture
        cannot do. The same array object again costs nothing (a decode loop's path) and is
        read as it was when first given: pass a new array for new slopes.
        """
        require_gpu("BatchDecodeWrapper.plan_on_device()")
        import cupy

        if self._plan is not None:
            raise RuntimeError("plan_on_device: this wrapper plans on the host (plan() was "
                               "called); a wrapper plans one way or the other")
        if qo_indptr is not None and self._max_q_len == 1:
            raise ValueError("qo_indptr: this graph-stable wrapper's captured launch holds one "
                             "query row a request; make it with max_q_len= for more")
        chunk = VA.check_chunk_size(attention_chunk_size)
        VA.refuse_chunks_with_rows(chunk, self._max_q_len)
        inputs = (seq_lens, block_table, kv_indptr, kv_indices, kv_last_page_len, qo_indptr)
        s = run_stream(stream, *inputs)           # torch tensors: torch's current stream
        soft_cap = soft_cap_log2(logits_soft_cap)
        slopes = self._device_alibi(alibi_slopes)
        # the build of the cap and ALiBi, or the refusal to switch
        kernels = self._graph_kernels(soft_cap, slopes is not None)
        planner = self._device_planner
        # the very arrays of the first call (a decode loop's path) were checked then
        if planner is None or not planner.same_inputs(inputs, sm_scale):
            self._check_device_plan_inputs(inputs, sm_scale, s, kernels)
            planner = self._device_planner
        # runs elsewhere may still read the records
        self._streams.before_plan(s, follow_runs=not s.is_capturing())
        self._write_alibi(alibi_slopes, slopes, s)
        window = -1 if window_left is None else V.check_int(
            "window_left", window_left, -1, V.MAX_KV_LEN, "MAX_KV_LEN")
        planner.params.attention_chunk_size = chunk
        planner.params.rows_window_left = window
        planner.params.window_left = (VA.covering_window_left(window, self._max_q_len)
                                      if self._max_q_len > 1 else window)
        self._write_soft_cap(soft_cap)
        planner.launch(s.ptr)
        self._run_after_device_plan = True
        self._streams.plan_stream = s
        if not s.is_capturing():
            self._device_plan_ready = self._device_plan_ready or cupy.cuda.Event(
                disable_timing=True)
            self._device_plan_ready.record(s)

    def _upload_parts(self, alibi: bool) -> dict:
        """The fixed buffers' optional parts: query rows for a multi-token grid or ALiBi (each
        request's position), and ALiBi's slopes."""
        return {"query_rows": self._max_q_len > 1 or alibi,
                "alibi_heads": self.num_qo_heads if alibi else 0}

    def _device_alibi(self, alibi_slopes):
        """plan_on_device()'s slopes, checked (float64 [num_qo_heads]) or None; the array last
        written, given again, is taken as it was then."""
        if alibi_slopes is None:
            return None
        if alibi_slopes is self._alibi_given:
            return self._alibi_checked
        if is_device_array(alibi_slopes):     # reading it back would wait (and break a capture)
            raise TypeError("alibi_slopes: plan_on_device() takes the slopes as host numbers "
                            f"(a list or a NumPy array), got a device array "
                            f"({type(alibi_slopes).__name__})")
        return VA.check_alibi_slopes(self.num_qo_heads, alibi_slopes)

    def _write_alibi(self, given, slopes, s) -> None:
        """Copy the slopes (``given``, checked) into the wrapper's buffer when they differ from
        those there; ``given`` is then remembered (``_device_alibi``)."""
        if given is None or given is self._alibi_given:
            return
        bits = alibi_bits(slopes)
        if self._alibi_bits is None or not np.array_equal(bits, self._alibi_bits):
            if s.is_capturing():
                raise ValueError("alibi_slopes: new slopes are copied into the wrapper's "
                                 "buffer, which a capture cannot hold; call plan_on_device() "
                                 "with them once before capturing")
            self._graph_upload.write_alibi(bits, s)
            self._alibi_bits = bits
        self._alibi_given, self._alibi_checked = given, slopes

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
        scale_log2 = sm_scale_log2(sm_scale, self.head_dim)
        planner = self._device_planner
        if planner is None:
            if s.is_capturing():
                raise RuntimeError("plan_on_device: the first call binds the arrays and "
                                   "allocates; make it before capturing")
            planner = self._bind_device_planner(batch, arrays, scale_log2, s, kernels)
        elif scale_log2 != self._launch.params.sm_scale_log2:
            raise ValueError("sm_scale: a graph-stable wrapper keeps the sm_scale of its first "
                             "plan (a captured launch holds it)")
        elif batch != planner.batch:             # other arrays (another batch size): rebind
            planner.bind(batch, arrays, max_chunks=self.max_chunks_for(batch.batch_size))
            self._grid_binding[1]["kv_indices"] = batch.pointers[3]
            for launch in self._launches.values():
                launch.params.kv_indices = batch.pointers[3]
        planner.remember(inputs, sm_scale)

    def _bind_device_planner(self, batch, arrays, sm_scale_log2: float, s, kernels):
        """The first plan_on_device(): the fixed buffers, the planning kernel bound to the
        arrays, and the decode launches, which read the caller's page table in place."""
        import cupy

        from .device_planner import DevicePlanner, plan_params

        max_batch, max_chunks = self._capacity[0], self.max_chunks
        stages = kernels.build.stages
        model = self.profile.cost_model(self.kv_dtype, graph_stable=True).with_clusters(False)
        heads = self.num_qo_heads * self._max_q_len   # virtual heads with max_q_len > 1
        params = plan_params(model, num_qo_heads=heads,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                             page_size=self.page_size, stages=stages, max_batch=max_batch,
                             max_chunks=max_chunks, launch_order=self.launch_order,
                             tile_tokens=kernels.build.tile_tokens)
        parts = self._upload_parts(kernels.build.variant.alibi)
        upload = GraphPlanUpload(max_chunks, 0, max_batch, s, **parts)
        self._workspace.ensure_size(max_chunks * heads,
                                    max_batch * self.num_kv_heads * self.ctas_per_kv_head, s)
        # the planning kernel writes the rows (ALiBi's: each request's position) where they
        # are read
        planner = DevicePlanner(params, batch, arrays, upload.pointers["records"],
                                upload.pointers["merge_indptr"], s,
                                query_rows_ptr=upload.pointers.get("query_rows", 0),
                                max_q_len=self._max_q_len)
        planner.bind(batch, arrays, max_chunks=self.max_chunks_for(batch.batch_size))
        meta = dict(upload.pointers, kv_indices=batch.pointers[3])
        self._grid_binding = (kernels, meta, params.record_pages > 0, True, sm_scale_log2)
        self._launch = self._grid_launch(max_batch)
        self._device_id = cupy.cuda.runtime.getDevice()
        self._graph_upload = upload
        self._max_page = -1                      # page ids are the caller's (not checked)
        self._device_planner = planner           # last: a failure above leaves nothing bound
        return planner

    def _grid_launch(self, requests: int):
        """The launches of the grid built for a batch of ``requests`` (bound once, then kept:
        a captured graph holds the one of its batch size); every grid shares the capacity's
        records, page table, merge_indptr and workspace."""
        key = self._grid_requests(requests)
        launch = self._launches.get(key)
        if launch is None:
            kernels, meta, pages_in_record, device_planned, scale_log2 = self._grid_binding
            launch = self._bind(kernels, meta, LaunchGrid(
                self.max_chunks_for(key), key, self.num_qo_heads * self._max_q_len,
                self.ctas_per_kv_head, merge=True, pages_in_record=pages_in_record,
                spread=self._spreads(key), device_planned=device_planned), scale_log2,
                self._logits_soft_cap_log2)
            self._launches[key] = launch
        return launch

    def _write_soft_cap(self, soft_cap_log2: float) -> None:
        """A plan's soft cap, written at plan time into every grid's launch (they outlive the
        plan; a captured graph holds the value of its capture) and kept for grids bound
        later."""
        self._logits_soft_cap_log2 = soft_cap_log2
        for launch in self._launches.values():
            launch.params.logits_soft_cap_log2 = soft_cap_log2

    def _launch_for_rows(self, rows: int):
        return self._grid_launch(-(-rows // self._max_q_len))

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

    # ------------------------------------------------------------------- run
    def _ready_event(self):
        if self._device_planner is not None:
            return self._device_plan_ready
        return self._graph_upload.ready

    def _planned(self) -> bool:
        return self._plan is not None or self._device_planner is not None

    def _run_rows(self) -> tuple[int, int]:
        """(fewest, most) rows of run()'s q: any batch from the plan's up to the capacity (an
        engine's graph per batch size; a replay must not meet a plan of more rows than its
        capture's q); a multi-token device plan's rows are the device's: the capacity's."""
        most = self._capacity[0] * self._max_q_len
        if self._device_planner is not None:
            fewest = most if self._max_q_len > 1 else self._device_planner.batch.batch_size
        else:
            fewest = self._plan_rows()
        return fewest, most

    def _note_pool(self, k_cache) -> None:
        """Later plans must stay within the smallest K/V pool a run was given."""
        pool = int(k_cache.shape[0])
        self._graph_pool_pages = pool if self._graph_pool_pages is None else min(
            pool, self._graph_pool_pages)
