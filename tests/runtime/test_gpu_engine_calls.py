"""The calls an engine makes, from torch tensors on the GPU: run() on torch's current stream,
returning torch tensors; plan() from host lengths with the page table left on the device
(padded with -1); one graph-stable wrapper serving every batch size in torch.cuda.graph; a
workspace the caller owns, sized before allocation. Each is checked against the float64
reference or against the bits of the plain call."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import reference_decode
from splitkv.testing import block_table_of, scattered_page_table

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for torch", allow_module_level=True)

HQ, HK, D, PAGE = 32, 8, 128, 16


def bits(t):
    return t.view(torch.int16).cpu().numpy()


def batch(seed: int, lens):
    rng = np.random.default_rng(seed)
    table, pool = scattered_page_table(np.asarray(lens), PAGE, rng, 2)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(len(lens), HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(pool, PAGE, HK, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(pool, PAGE, HK, D, device="cuda", generator=gen).to(torch.bfloat16)
    return table, q, k, v


def reference(table, q, k, v):
    f64 = [t.float().cpu().numpy().astype(np.float64) for t in (q, k, v)]
    return reference_decode(f64[0], f64[1], f64[2], table)[0]


def check_close(out, want, what: str):
    got = out.float().cpu().numpy()
    assert np.isfinite(got).all(), what
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2, err_msg=what)


def test_run_from_torch_uses_torchs_stream_and_returns_torch_tensors():
    from splitkv import BatchDecodeWrapper

    table, q, k, v = batch(0, [3000, 700, 9, 15000])
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16")
    w.plan(table, num_splits=4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())       # q, k, v were made on the default one
    with torch.cuda.stream(side):
        out, lse = w.run(q, k, v, return_lse=True)       # no stream=: torch's current (side)
        assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert out.shape == (4, HQ, D) and lse.shape == (4, HQ)
    side.synchronize()
    check_close(out, reference(table, q, k, v), "run() on a torch side stream")
    again = w.run(q, k, v)                               # the default stream
    torch.cuda.synchronize()
    assert np.array_equal(bits(again), bits(out))


@pytest.mark.parametrize("layout", ["block_table", "kv_indices"])
def test_plan_reads_a_device_page_table_in_place(layout):
    """plan() from host lengths and the page table on the device (a -1 padded block table, or
    FlashInfer's kv_indices): the bits of the same plan with the host table."""
    from splitkv import BatchDecodeWrapper

    table, q, k, v = batch(1, [4100, 17, 0, 900, 33000])
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16")
    w.plan(table, num_splits=8)                          # split: later chunks read the table
    host = w.run(q, k, v)
    if layout == "block_table":
        device_table = torch.from_numpy(block_table_of(table, 2100 + 7)).cuda()
        w.plan(seq_lens=table.kv_lens, block_table=device_table, num_splits=8)
    else:
        indices = torch.from_numpy(table.kv_indices.astype(np.int32)).cuda()
        w.plan(kv_indptr=table.kv_indptr, kv_indices=indices,
               kv_last_page_len=table.kv_last_page_len, num_splits=8)
    assert not w.pages_in_record                         # no page ids on the host
    out = w.run(q, k, v)
    torch.cuda.synchronize()
    assert np.array_equal(bits(out), bits(host))
    w.plan(seq_lens=table.kv_lens, block_table=torch.from_numpy(
        block_table_of(table, 2100)).cuda())         # the planner's own choice
    check_close(w.run(q, k, v), reference(table, q, k, v), f"{layout}, adaptive plan")


def test_a_device_table_is_checked_before_any_launch():
    from splitkv import BatchDecodeWrapper

    table, *_ = batch(2, [100, 200])
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16")
    device_table = torch.from_numpy(block_table_of(table, 16)).cuda()
    with pytest.raises(TypeError, match="block_table: expected an int32"):
        w.plan(seq_lens=table.kv_lens, block_table=device_table.long())
    with pytest.raises(ValueError, match="seq_lens: request 1 has 300"):
        w.plan(seq_lens=[100, 300], block_table=device_table[:, :16])
    with pytest.raises(TypeError, match="seq_lens: expected a host"):
        w.plan(seq_lens=torch.tensor([100, 200]).cuda(), block_table=device_table)
    g = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16", use_cuda_graph=True, max_batch_size=4,
                           max_num_pages=64)
    with pytest.raises(ValueError, match="plan_on_device"):
        g.plan(seq_lens=table.kv_lens, block_table=device_table)


def test_one_graph_stable_wrapper_serves_every_batch_size_in_torch_graphs():
    """An engine's pattern: one wrapper and its workspace, a graph per batch size, each holding
    plan_on_device() over views of the engine's buffers and run() over q[:n]; replays follow the
    lengths as they change, and match the float64 reference."""
    from splitkv import BatchDecodeWrapper

    max_batch, width = 16, 260
    rng = np.random.default_rng(3)
    lens0 = rng.integers(1, 3800, max_batch)
    table, q, k, v = batch(3, lens0 + 2 * 97)     # pages for the steps' growth
    seq_lens = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    block_table = torch.from_numpy(block_table_of(table, width)).cuda()
    out = torch.full((max_batch, HQ, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16", use_cuda_graph=True,
                           max_batch_size=max_batch, max_num_pages=max_batch * width)
    sizes = (1, 4, 16)
    seq_lens.copy_(torch.from_numpy(lens0.astype(np.int32)))
    w.plan_on_device(seq_lens=seq_lens, block_table=block_table)   # the first call: eager
    graphs = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for n in sizes:
        graphs[n] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[n], stream=stream):
            w.plan_on_device(seq_lens=seq_lens[:n], block_table=block_table[:n])
            w.run(q[:n], k, v, out=out[:n])
    for step in range(3):
        lens = lens0 + 97 * step
        seq_lens.copy_(torch.from_numpy(lens.astype(np.int32)))
        for n in sizes:
            out.fill_(float("nan"))
            graphs[n].replay()
            torch.cuda.synchronize()
            sub = type(table).from_block_table(block_table_of(table, width)[:n], lens[:n],
                                               PAGE)
            check_close(out[:n], reference(sub, q[:n], k, v), f"step {step}, batch {n}")
            assert torch.isnan(out[n:].float()).all(), "rows past the batch were written"
    assert w.device_plan_state()["error"] is None


def test_a_caller_owned_workspace_gives_the_same_bits():
    from splitkv import BatchDecodeWrapper, workspace_size

    table, q, k, v = batch(4, [30000, 200, 9000])
    size = workspace_size(HQ, HK, D, max_batch_size=3, max_chunks=48)
    buffer = torch.empty(size, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16", workspace_buffer=buffer)
    own = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16")
    for strategy in ("split_merge", "fused", "split_merge"):
        own.plan(table, num_splits=16, strategy=strategy)
        want = own.run(q, k, v)
        w.plan(table, num_splits=16, strategy=strategy)
        got = w.run(q, k, v)
        torch.cuda.synchronize()
        assert np.array_equal(bits(got), bits(want)), strategy
    assert w.workspace_bytes == size
    small = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16",
                               workspace_buffer=torch.empty(4096, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="workspace_buffer: this plan needs"):
        small.plan(table, num_splits=16, strategy="split_merge")


@pytest.mark.parametrize("multi_token", [False, True])
def test_q_read_in_place_from_a_fused_qkv_projection(multi_token):
    """q as a slice of a fused QKV projection's output ([rows, (HQ + 2 HK) x D], q first) is
    read in place, with the bits of its contiguous copy; multi-token rows too."""
    from splitkv import BatchDecodeWrapper

    table, q, k, v = batch(5, [5000, 300, 70])
    qo_indptr = np.array([0, 3, 4, 6]) if multi_token else None
    rows = 6 if multi_token else 3
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(rows, (HQ + 2 * HK) * D, device="cuda", generator=gen).to(torch.bfloat16)
    view = qkv[:, :HQ * D].view(rows, HQ, D)
    assert not view.is_contiguous() and view.stride() == ((HQ + 2 * HK) * D, D, 1)
    w = BatchDecodeWrapper(HQ, HK, D, PAGE, "bfloat16")
    w.plan(table, num_splits=4, qo_indptr=qo_indptr)
    strided = w.run(view, k, v)
    contiguous = w.run(view.contiguous(), k, v)
    torch.cuda.synchronize()
    assert np.array_equal(bits(strided), bits(contiguous))
    with pytest.raises(ValueError, match="q: expected"):
        w.run(view.transpose(0, 1).contiguous().transpose(0, 1), k, v)
