"""The KV caches vLLM and SGLang hand their backends, read on the GPU through
``torch.ops.splitkv.paged_decode`` exactly as the two plugins read them (neither engine installs
on the GPU machine, so the views are made here the way each plugin makes them): vLLM's
FlashAttention cache, ``[blocks, kv_heads, block_size, 2 * head_size]`` in two memory orders,
whose K and V halves are strided NHD pages; SGLang's token pool ``[rows, kv_heads, head_dim]``
as one-token pages; an fp8 cache with device scales. Each against the float64 reference, in a
CUDA graph replayed on new lengths."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv import PageTable, reference_decode

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device for torch", allow_module_level=True)

from splitkv.integrations import torch_ops  # noqa: E402

HQ, HK, D, BLOCK, BLOCKS = 16, 4, 128, 16, 64
ROWS = 6


def vllm_cache(order: str, gen) -> torch.Tensor:
    """A layer's cache as vLLM's FlashAttention backend sees it, [blocks, kv_heads, block_size,
    2 * D], over memory in ``order`` (block-major tokens then heads, or heads then tokens)."""
    if order == "tokens_then_heads":
        raw = torch.randn(BLOCKS, BLOCK, HK, 2 * D, device="cuda", generator=gen)
        return raw.to(torch.bfloat16).transpose(1, 2)
    raw = torch.randn(BLOCKS, HK, BLOCK, 2 * D, device="cuda", generator=gen)
    return raw.to(torch.bfloat16)


def halves(cache):
    """The vLLM plugin's K and V views: [blocks, block_size, kv_heads, D] each, in place."""
    pages = cache.transpose(1, 2)
    return pages[..., :D], pages[..., D:]


def lengths(rng, n):
    return rng.integers(1, BLOCK * 6, n).astype(np.int32)


def block_table(rng, lens) -> np.ndarray:
    table = np.full((len(lens), 8), -1, np.int32)
    free = rng.permutation(BLOCKS)
    used = 0
    for r, n in enumerate(lens):
        pages = -(-int(n) // BLOCK)
        table[r, :pages] = free[used:used + pages]
        used += pages
    return table


def reference(q, k, v, lens, table, page_size, **kw):
    pt = PageTable.from_block_table(table, lens, page_size)
    f64 = [t.float().cpu().numpy().astype(np.float64) for t in (q, k, v)]
    return torch.from_numpy(reference_decode(f64[0], f64[1], f64[2], pt, **kw)[0])


def close(out, ref, atol=2e-2):
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=atol, rtol=0)


def replay_a_block_table_session(order: str, seed: int, **variants) -> None:
    """A block-table session of the op over vLLM's cache in ``order``, planned on the device:
    eager (the first plan allocates), then one torch graph replayed as the lengths and the table
    change in place, each output against the float64 reference; ``variants``: the session's
    (and the reference's) ``alibi_slopes`` and ``logits_soft_cap``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = halves(vllm_cache(order, gen))
    seq_lens = torch.zeros(ROWS, dtype=torch.int32, device="cuda")
    table = torch.full((ROWS, 8), -1, dtype=torch.int32, device="cuda")
    q = torch.randn(ROWS, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    handle = torch_ops.new_session(num_qo_heads=HQ, num_kv_heads=HK, head_dim=D,
                                   page_size=BLOCK, dtype=torch.bfloat16, layout="block_table",
                                   capacity=8, width=8, sm_scale=D ** -0.5, **variants)

    def step():
        return torch.ops.splitkv.paged_decode(q, k, v, [seq_lens, table], None, handle, True)

    def load(seed):
        r = np.random.default_rng(seed)
        lens = lengths(r, ROWS)
        t = block_table(r, lens)
        seq_lens.copy_(torch.from_numpy(lens))
        table.copy_(torch.from_numpy(t))
        return lens, t

    lens, t = load(seed + 1)
    close(step(), reference(q, k, v, lens, t, BLOCK, **variants))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in (seed + 2, seed + 3):
        lens, t = load(replay)
        graph.replay()
        torch.cuda.synchronize()
        close(out, reference(q, k, v, lens, t, BLOCK, **variants))
    torch_ops.close_session(handle)


@pytest.mark.parametrize("order", ["tokens_then_heads", "heads_then_tokens"])
def test_vllms_flash_attention_cache_read_in_place_in_a_graph(order):
    replay_a_block_table_session(order, 1)


def test_an_alibi_session_in_a_graph_replays_new_lengths_with_its_slopes():
    """The torch op with ALiBi (vLLM's alibi_slopes): planned on the device inside the captured
    graph, each request biased at its own position, against the float64 reference. With a soft
    cap, so that the output depends on the position (alone, the bias at the query's position
    is the same for every key and cancels in the softmax)."""
    from splitkv.core.variants import alibi_slopes

    replay_a_block_table_session("tokens_then_heads", 5, alibi_slopes=alibi_slopes(HQ).tolist(),
                                 logits_soft_cap=2.0)


def test_sglangs_token_pool_as_one_token_pages():
    gen = torch.Generator(device="cuda").manual_seed(5)
    rng = np.random.default_rng(5)
    pool = 8192
    k_buf = torch.randn(pool, HK, D, device="cuda", generator=gen).to(torch.float16)
    v_buf = torch.randn(pool, HK, D, device="cuda", generator=gen).to(torch.float16)
    lens = rng.integers(1, 700, ROWS)
    rows = rng.permutation(pool)[:lens.sum()].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = torch.randn(ROWS, HQ, D, device="cuda", generator=gen).to(torch.float16)
    handle = torch_ops.new_session(num_qo_heads=HQ, num_kv_heads=HK, head_dim=D, page_size=1,
                                   dtype=torch.float16, layout="indptr", capacity=8,
                                   width=pool, sm_scale=D ** -0.5, window_left=255)
    k, v = k_buf.view(-1, 1, HK, D), v_buf.view(-1, 1, HK, D)
    out = torch.ops.splitkv.paged_decode(
        q, k, v, [torch.from_numpy(indptr).cuda(), torch.from_numpy(rows).cuda()], None,
        handle, True)
    pt = PageTable.from_flashinfer(indptr, rows, np.ones(ROWS, np.int32), 1)
    f64 = [t.float().cpu().numpy().astype(np.float64) for t in (q, k, v)]
    ref = reference_decode(f64[0], f64[1], f64[2], pt, window_left=255)[0]
    close(out, torch.from_numpy(ref))


def test_an_fp8_cache_with_device_scales_read_when_the_kernel_runs():
    gen = torch.Generator(device="cuda").manual_seed(7)
    rng = np.random.default_rng(7)
    values = torch.randn(BLOCKS, BLOCK, HK, D, device="cuda", generator=gen)
    # engines keep fp8 caches as uint8 codes
    k = (values * 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    v = (values * -0.25).to(torch.float8_e4m3fn).view(torch.uint8)
    k_scale = torch.tensor([1.5], device="cuda")
    v_scale = torch.tensor([0.75], device="cuda")
    lens = lengths(rng, ROWS)
    t = block_table(rng, lens)
    q = torch.randn(ROWS, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    handle = torch_ops.new_session(num_qo_heads=HQ, num_kv_heads=HK, head_dim=D,
                                   page_size=BLOCK, dtype=torch.bfloat16, layout="block_table",
                                   capacity=8, width=8, sm_scale=D ** -0.5,
                                   kv_dtype="float8_e4m3fn")
    tables = [torch.from_numpy(lens).cuda(), torch.from_numpy(t).cuda()]
    out = torch.ops.splitkv.paged_decode(q, k, v, tables, None, handle, True, k_scale, v_scale)
    codes = [x.cpu().numpy() for x in (k, v)]
    pt = PageTable.from_block_table(t, lens, BLOCK)
    q64 = q.float().cpu().numpy().astype(np.float64)
    ref = reference_decode(q64, codes[0], codes[1], pt, kv_dtype="float8_e4m3fn", k_scale=1.5,
                           v_scale=0.75)[0]
    close(out, torch.from_numpy(ref))
    k_scale.fill_(3.0)                          # a new value, read at the next run
    out = torch.ops.splitkv.paged_decode(q, k, v, tables, None, handle, False, k_scale, v_scale)
    ref = reference_decode(q64, codes[0], codes[1], pt, kv_dtype="float8_e4m3fn", k_scale=3.0,
                           v_scale=0.75)[0]
    close(out, torch.from_numpy(ref))
