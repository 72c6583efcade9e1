"""GPU decode against the float64 reference. Marked `gpu`: conftest.py skips them, with the
reason, where there is no usable GPU."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.core.execution import grid_order
from splitkv.core.plan import plan_chunk_tokens, plan_from_chunk_counts
from splitkv.core.problem import DecodeProblem
from splitkv.core.reference import to_float64
from splitkv.measure.test_data import random_device_array, scattered_page_table
from splitkv.runtime.experiments import DecodeExperiments
from splitkv.runtime.wrapper import BatchDecodeWrapper

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

TOL = {"bfloat16": 1e-2, "float16": 5e-3}
POISON = 0xFFFF  # a NaN in both float16 and bfloat16


def rel_err(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def host(arr, dtype):
    return to_float64(arr)      # uint16 arrays hold bfloat16 bits


def make_case(rng, lens, hq, hk, d, page, dtype):
    pt, num_pages = scattered_page_table(lens, page, rng)
    q = random_device_array((len(lens), hq, d), dtype, rng)
    k = random_device_array((num_pages, page, hk, d), dtype, rng)
    v = random_device_array((num_pages, page, hk, d), dtype, rng)
    return pt, q, k, v


def poisoned(shape, dtype):
    out = cupy.empty(shape, dtype=cupy.float16 if dtype == "float16" else cupy.uint16)
    out.view(cupy.uint16).fill(POISON)
    return out


def run_checked(w, pt, q, k, v, dtype, **plan_kw):
    plan = w.plan(pt, **plan_kw)
    out = poisoned(q.shape, dtype)
    lse = cupy.full(q.shape[:2], np.nan, dtype=cupy.float32)
    w.run(q, k, v, out=out, lse=lse)
    cupy.cuda.runtime.deviceSynchronize()
    o = host(out, dtype)
    assert not np.isnan(o).any(), f"unwritten or NaN outputs with {plan}"
    return plan, o, lse.get()


def check_against_reference(rng, lens, hq, hk, d, page, dtype, strategies=("single", "split_merge", "fused"),
                            splits=(1, 3, 16)):
    pt, q, k, v = make_case(rng, lens, hq, hk, d, page, dtype)
    ref_o, ref_lse = reference_decode(q.get(), k.get(), v.get(), pt)
    w = BatchDecodeWrapper(hq, hk, d, page, dtype)
    results = {}
    for strategy in strategies:
        for n in splits:
            if strategy == "single" and n != 1:
                continue
            if strategy != "single" and n == 1:
                continue
            plan, o, lse = run_checked(w, pt, q, k, v, dtype, num_splits=n, strategy=strategy)
            err = rel_err(o, ref_o)
            assert err < TOL[dtype], f"rel err {err:.2e} for {plan}"
            finite = np.isfinite(ref_lse)
            assert np.array_equal(np.isfinite(lse), finite)
            np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)
            results[(strategy, n)] = o
    return results


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 5, 8, 32])
def test_matches_reference_ragged(dtype, head_dim, group):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}-{head_dim}-{group}".encode()))
    # head_dim 96 moved off 64's pages: page 16 for groups 5, 8 and 32 (one, two row tiles)
    page = [1, 16, 64][(head_dim // 64 + group + (head_dim == 96)) % 3]
    lens = [1, max(1, page - 1), page, page + 1, 1000, 0, 77]
    hk = 2
    check_against_reference(rng, lens, hk * group, hk, head_dim, page, dtype)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_page_sizes_equal_lengths(page):
    rng = np.random.default_rng(page)
    check_against_reference(rng, [1000] * 3, 32, 8, 128, page, "bfloat16")


@pytest.mark.parametrize("dtype,group", [("bfloat16", 4), ("float16", 8), ("bfloat16", 64)])
def test_long_context_128k(dtype, group):
    rng = np.random.default_rng(7)
    check_against_reference(rng, [131072], group, 1, 128, 16, dtype,
                            strategies=("split_merge", "fused"), splits=(64,))


def test_mqa_group_64_and_beyond():
    rng = np.random.default_rng(3)
    check_against_reference(rng, [500, 3000], 96, 1, 128, 16, "bfloat16", splits=(1, 5))


@pytest.mark.parametrize("hq,hk,d,dtype", [(32, 8, 128, "bfloat16"), (64, 8, 128, "float16"),
                                            (8, 8, 64, "bfloat16"), (16, 1, 256, "float16")])
def test_every_split_count_and_fused_equals_split_merge(hq, hk, d, dtype):
    """The fused merge gives the merge kernel's bits, for 1 to 16 rows a CTA and 2 to 64
    chunks (several MERGE_BATCH passes)."""
    rng = np.random.default_rng(11)
    res = check_against_reference(rng, [5000, 17, 2500], hq, hk, d, 16, dtype,
                                  splits=(1, 2, 3, 7, 16, 33, 64))
    base = res[("single", 1)]
    for (strategy, n), o in res.items():
        assert rel_err(o, base) < 1e-2
        if strategy == "fused":
            np.testing.assert_array_equal(o, res[("split_merge", n)])


@pytest.mark.parametrize("strategy", ["single", "split_merge", "fused"])
def test_launch_order_changes_no_bit(strategy):
    """A ragged plan's chunks run in another order than the plan's (longest requests or chunks
    first), each writing its partials by its plan index: outputs and lse are bit-identical to
    plan order, and match the reference."""
    rng = np.random.default_rng(21)
    lens = [3000, 17, 700, 0, 9000, 64, 1500]
    pt, q, k, v = make_case(rng, lens, 32, 8, 128, 16, "bfloat16")
    ref_o, _ = reference_decode(q.get(), k.get(), v.get(), pt)
    plan = plan_chunk_tokens(DecodeProblem.from_page_table(pt, 32, 8, 128),
                             1 << 30 if strategy == "single" else 512, strategy, align=64)
    results = {}
    for policy in ("plan", "longest_requests", "longest_chunks"):
        w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", launch_order=policy)
        _, o, lse = run_checked(w, pt, q, k, v, "bfloat16", plan=plan)
        assert rel_err(o, ref_o) < TOL["bfloat16"]
        assert (grid_order(w.current_plan)[:3] != np.arange(3)).any() == (policy != "plan")
        results[policy] = (o, lse)
    for o, lse in results.values():
        np.testing.assert_array_equal(o, results["plan"][0])
        np.testing.assert_array_equal(lse, results["plan"][1])


@pytest.mark.parametrize("hq,hk,d,dtype", [(32, 8, 128, "bfloat16"), (8, 2, 64, "float16"),
                                            (96, 1, 128, "bfloat16"), (4, 4, 256, "float16"),
                                            (32, 8, 96, "bfloat16")])
def test_cluster_merge_matches_reference_and_ticket_merge(hq, hk, d, dtype):
    """Fused plans with 2, 4 or 8 short chunks per request merge inside thread-block clusters
    on sm_90+ (where execution.fused_cluster_size allows): the same answer as the atomic-ticket
    merge, to the bit."""
    from splitkv.core.execution import CLUSTER_MAX_WIDE_CTAS
    from splitkv.core.geometry import ctas_per_kv_head
    from splitkv.runtime import device_info

    if int(device_info()["cc"]) < 90:
        pytest.skip("thread-block clusters need compute capability 9.0")
    rng = np.random.default_rng(hq * d)
    # the short request first: a longest-first launch order would move the long request's
    # chunks ahead of it and break the clusters, so the wrapper must keep plan order for them
    pt, q, k, v = make_case(rng, [9, 1000], hq, hk, d, 16, dtype)
    ref_o, ref_lse = reference_decode(q.get(), k.get(), v.get(), pt)
    clustered = BatchDecodeWrapper(hq, hk, d, 16, dtype)
    ticket = BatchDecodeWrapper(hq, hk, d, 16, dtype, use_clusters=False)
    problem = DecodeProblem.from_page_table(pt, hq, hk, d, dtype)
    sizes = []
    for n in (2, 4, 8):
        plan = plan_from_chunk_counts(problem, [n, n], "fused")
        _, o, lse = run_checked(clustered, pt, q, k, v, dtype, plan=plan)
        ctas = plan.num_work_items * ctas_per_kv_head(hq // hk)   # chunks of < 1,024 tokens
        assert clustered.cluster_size == (n if n == 2 or ctas <= CLUSTER_MAX_WIDE_CTAS else 0)
        sizes.append(clustered.cluster_size)
        if clustered.cluster_size:
            np.testing.assert_array_equal(grid_order(clustered.current_plan), np.arange(plan.num_chunks))
        assert rel_err(o, ref_o) < TOL[dtype], f"{plan}"
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-3)
        _, o_ticket, lse_ticket = run_checked(ticket, pt, q, k, v, dtype, plan=plan)
        assert ticket.cluster_size == 0
        # the ticket grid does run the long request's chunks first
        assert not np.array_equal(grid_order(ticket.current_plan), np.arange(plan.num_chunks))
        np.testing.assert_array_equal(o, o_ticket)
        np.testing.assert_array_equal(lse, lse_ticket)
    assert sizes[0] == 2 and max(sizes) >= 4      # pairs always, and a wider cluster too


@pytest.mark.parametrize("page", [4, 16, 32])
@pytest.mark.parametrize("align", [1, 64])
def test_first_pages_from_the_record_or_the_table(page, align):
    """Chunks starting on a page boundary take their first tiles' page ids from the chunk
    record; unaligned chunks and small pages look them up: the same answer either way."""
    rng = np.random.default_rng(page * align)
    pt, q, k, v = make_case(rng, [1500, 999, 37], 16, 4, 128, page, "bfloat16")
    ref_o, _ = reference_decode(q.get(), k.get(), v.get(), pt)
    w = BatchDecodeWrapper(16, 4, 128, page, "bfloat16")
    problem = DecodeProblem.from_page_table(pt, 16, 4, 128)
    for strategy in ("split_merge", "fused"):
        plan = plan_from_chunk_counts(problem, [5, 3, 2], strategy, align=align)
        _, o, _ = run_checked(w, pt, q, k, v, "bfloat16", plan=plan)
        assert rel_err(o, ref_o) < TOL["bfloat16"], f"{plan}"
        # 3 tiles of 64 tokens span at most 24 pages of >= 8 tokens; 64-aligned chunks start
        # on a page boundary
        assert w.pages_in_record == (align == 64 and page >= 8)


def test_extreme_logits_no_nan():
    rng = np.random.default_rng(5)
    pt, q, k, v = make_case(rng, [3000, 64], 8, 2, 128, 16, "float16")
    q = (q.astype(cupy.float32) * 40).astype(cupy.float16)   # scores of order 1e3
    ref_o, _ = reference_decode(q.get(), k.get(), v.get(), pt)
    w = BatchDecodeWrapper(8, 2, 128, 16, "float16")
    for n in (1, 8):
        _, o, lse = run_checked(w, pt, q, k, v, "float16", num_splits=n)
        assert np.isfinite(lse).all()
        assert rel_err(o, ref_o) < 2e-2


def test_zero_length_and_empty_batch():
    rng = np.random.default_rng(2)
    pt, q, k, v = make_case(rng, [0, 10, 0], 8, 2, 64, 16, "bfloat16")
    w = BatchDecodeWrapper(8, 2, 64, 16, "bfloat16")
    _, o, lse = run_checked(w, pt, q, k, v, "bfloat16", num_splits=2, strategy="fused")
    assert (o[0] == 0).all() and (o[2] == 0).all() and np.isneginf(lse[[0, 2]]).all()
    pt0, q0, k0, v0 = make_case(rng, [], 8, 2, 64, 16, "bfloat16")
    w.plan(pt0)
    out = w.run(q0, k0, v0)
    assert out.shape == (0, 8, 64)


def test_graph_replay_matches_eager():
    rng = np.random.default_rng(9)
    pt, q, k, v = make_case(rng, [4000, 900], 32, 8, 128, 16, "bfloat16")
    w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    for strategy in ("fused", "split_merge"):
        w.plan(pt, num_splits=8, strategy=strategy)
        eager = poisoned(q.shape, "bfloat16")
        w.run(q, k, v, out=eager)
        out = poisoned(q.shape, "bfloat16")
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            w.run(q, k, v, out=out, stream=stream)
            graph = stream.end_capture()
            for _ in range(100):
                graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(out.get(), eager.get())


@pytest.mark.parametrize("strategy,splits", [("single", 1), ("split_merge", 8), ("fused", 8),
                                             ("fused", 2)])
def test_pdl_chain_reads_the_previous_output(strategy, splits):
    """Programmatic dependent launch: each call's q is the previous call's output, so a kernel
    that read q (or reused the workspace) before the previous kernel ended would differ. The
    chain with PDL (both triggers) equals the chain without it, to the bit, eagerly and
    replayed from a graph (fused/2 on short chunks runs in clusters on sm_90). Planned on the
    run stream: a run on another stream waits on plan()'s event, which would serialise it and
    hide a race."""
    from splitkv.runtime import device_info

    if int(device_info()["cc"]) < 90:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    rng = np.random.default_rng(31)
    lens = [900, 1000, 600] if (strategy, splits) == ("fused", 2) else [900, 2500, 40]
    pt, q, k, v = make_case(rng, lens, 32, 8, 128, 16, "bfloat16")
    links = 12

    def chain(w, stream, graph):
        with stream:
            bufs = [q.copy()] + [poisoned(q.shape, "bfloat16") for _ in range(links)]
            if graph:
                stream.begin_capture()
            for i in range(links):
                w.run(bufs[i], k, v, out=bufs[i + 1], stream=stream)
            if graph:
                stream.end_capture().launch(stream)
        stream.synchronize()
        return [b.get() for b in bufs[1:]]

    results = {}
    for mode in (False, "late", "early"):
        stream = cupy.cuda.Stream(non_blocking=True)
        w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", pdl=bool(mode),
                               experiments=DecodeExperiments(pdl_trigger=mode or "late"))
        w.plan(pt, num_splits=splits, strategy=strategy, stream=stream)
        assert w.pdl_active == bool(mode)
        assert w.cluster_size == (2 if (strategy, splits) == ("fused", 2) else 0)
        results[mode] = (chain(w, stream, graph=False), chain(w, stream, graph=True))
    for mode in ("late", "early"):
        for plain, fast in zip(results[False], results[mode]):
            for a, b in zip(plain, fast):
                np.testing.assert_array_equal(a, b)


def test_experiment_knobs_and_spread_share_no_kernel_state():
    """DecodeExperiments (pipeline depth, register cap, PDL trigger and spreading) change how the
    kernel runs, not its answer; planning never changes an attribute of the kernel every
    wrapper shares (the shared-memory opt-in covers the spread size from the load on)."""
    from splitkv.runtime.modules import get_decode_kernels

    rng = np.random.default_rng(17)
    pt, q, k, v = make_case(rng, [900, 3000], 32, 8, 128, 16, "bfloat16")
    ref_o, _ = reference_decode(q.get(), k.get(), v.get(), pt)
    base = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16")
    kernels = get_decode_kernels(base.base_build)
    opt_in = kernels.partial.max_dynamic_shared_size_bytes
    assert opt_in >= kernels.one_per_sm_shared_bytes >= kernels.build.shared_bytes
    _, o_base, _ = run_checked(base, pt, q, k, v, "bfloat16", num_splits=4, strategy="fused")
    for experiments in (DecodeExperiments(pdl_spread=True), DecodeExperiments(pdl_spread=False),
                        DecodeExperiments(pdl_trigger="early", pdl_spread=True),
                        DecodeExperiments(stages=2, max_registers=168)):
        w = BatchDecodeWrapper(32, 8, 128, 16, "bfloat16", experiments=experiments)
        _, o, _ = run_checked(w, pt, q, k, v, "bfloat16", num_splits=4, strategy="fused")
        assert rel_err(o, ref_o) < TOL["bfloat16"], f"{experiments}"
        if experiments.stages is None:
            np.testing.assert_array_equal(o, o_base)     # same kernel, other launches
    assert kernels.partial.max_dynamic_shared_size_bytes == opt_in


def test_run_from_a_thread_that_never_touched_cuda():
    """The launches make the plan's driver context current where the calling thread has none
    (the driver launches in the current context)."""
    import threading

    rng = np.random.default_rng(19)
    pt, q, k, v = make_case(rng, [700, 40], 16, 4, 64, 16, "float16")
    w = BatchDecodeWrapper(16, 4, 64, 16, "float16")
    w.plan(pt, num_splits=3, strategy="split_merge")
    expect = w.run(q, k, v)
    cupy.cuda.runtime.deviceSynchronize()
    out = cupy.empty_like(expect)
    errors = []

    def worker():
        try:
            w.run(q, k, v, out=out)
        except Exception as exc:      # reported below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    cupy.cuda.runtime.deviceSynchronize()
    np.testing.assert_array_equal(out.get(), expect.get())


def test_torch_tensors_zero_copy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(4)
    pt, q, k, v = make_case(rng, [700, 1500], 16, 4, 128, 16, "float16")
    w = BatchDecodeWrapper(16, 4, 128, 16, "float16")
    w.plan(pt, num_splits=4)
    ref = w.run(q, k, v)
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    tout = torch.empty_like(tq)
    w.run(tq, tk, tv, out=tout)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(tout.cpu().numpy(), ref.get())
    # bfloat16 tensors, which CuPy itself cannot hold, go through by pointer.
    tqb, tkb, tvb = (x.to(torch.bfloat16) for x in (tq, tk, tv))
    wb = BatchDecodeWrapper(16, 4, 128, 16, "bfloat16")
    wb.plan(pt, num_splits=4)
    outb = torch.empty_like(tqb)
    wb.run(tqb, tkb, tvb, out=outb)
    torch.cuda.synchronize()
    ref_o, _ = reference_decode(tqb.float().cpu().numpy(), tkb.float().cpu().numpy(),
                                tvb.float().cpu().numpy(), pt)
    assert rel_err(outb.float().cpu().numpy(), ref_o) < TOL["bfloat16"]


def test_bad_inputs_rejected_before_launch():
    rng = np.random.default_rng(1)
    pt, q, k, v = make_case(rng, [100, 200], 8, 2, 64, 16, "float16")
    w = BatchDecodeWrapper(8, 2, 64, 16, "float16")
    with pytest.raises(RuntimeError, match="plan"):
        w.run(q, k, v)
    w.plan(pt)
    with pytest.raises(ValueError, match="q"):
        w.run(q[:1], k, v)
    with pytest.raises(TypeError, match="k_cache"):
        w.run(q, k.astype(cupy.float32), v)
    with pytest.raises(ValueError, match="k_cache"):
        w.run(q, k[:2], v[:2])
    with pytest.raises(TypeError, match="q"):
        w.run(q.get(), k, v)
    with pytest.raises(ValueError, match="page_size"):
        BatchDecodeWrapper(8, 2, 64, 32, "float16").plan(pt)


def test_plan_takes_flashinfer_and_vllm_arrays():
    """plan() with FlashInfer's arrays or vLLM's block table gives the PageTable's bits."""
    rng = np.random.default_rng(31)
    pt, q, k, v = make_case(rng, [700, 33, 1500], 16, 4, 128, 16, "bfloat16")
    w = BatchDecodeWrapper(16, 4, 128, 16, "bfloat16")
    _, base, base_lse = run_checked(w, pt, q, k, v, "bfloat16", num_splits=4)
    width = int(np.diff(pt.kv_indptr).max())
    block_table = np.zeros((pt.batch_size, width), dtype=np.int64)
    for b in range(pt.batch_size):
        pages = pt.kv_indices[pt.kv_indptr[b]:pt.kv_indptr[b + 1]]
        block_table[b, :pages.size] = pages
    for layout in (dict(kv_indptr=pt.kv_indptr, kv_indices=pt.kv_indices,
                        kv_last_page_len=pt.kv_last_page_len),
                   dict(block_table=block_table, seq_lens=pt.kv_lens)):
        w.plan(num_splits=4, **layout)
        out = poisoned(q.shape, "bfloat16")
        lse = cupy.full(q.shape[:2], np.nan, dtype=cupy.float32)
        w.run(q, k, v, out=out, lse=lse)
        np.testing.assert_array_equal(host(out, "bfloat16"), base)
        np.testing.assert_array_equal(lse.get(), base_lse)
