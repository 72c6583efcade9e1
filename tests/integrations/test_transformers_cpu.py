"""splitkv in transformers' continuous batching, on the CPU: the registration, the route each
call takes, the arrays handed to splitkv, the mask of the delegated batches, and whole
``generate_batch`` runs of the five model families, where the decode call is splitkv's float64
reference (the op's CPU path). Run against transformers 5.17 and the newest release
(``.ci/run``); skipped where torch or transformers are not installed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.transformers_models import (MODELS, NEAR_TIE_GAP, build_model,  # noqa: E402
                                         compile_case, generate, judge, random_prompts)

import splitkv.integrations.transformers as skv  # noqa: E402
from splitkv.integrations import torch_ops  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_memory(monkeypatch):
    """transformers sizes its paged cache from the accelerator's free memory; on the CPU it
    finds none. The tests give their cache sizes, and this gives it room."""
    from transformers.generation.continuous_batching import cache

    monkeypatch.setattr(cache.PagedAttentionMemoryHandler, "get_available_memory",
                        lambda self: 1 << 30)


def test_registration_is_what_set_attn_implementation_accepts():
    assert skv.register() == "splitkv"
    assert {"splitkv", "paged|splitkv"} <= skv.registered_names()
    model = build_model("llama", num_hidden_layers=1)
    model.set_attn_implementation("splitkv")
    assert model.config._attn_implementation == "splitkv"
    with pytest.raises(ValueError, match="not supported"):
        model.set_attn_implementation("splitkv-unregistered")
    for bad in ("paged|splitkv", "", 3):
        with pytest.raises(ValueError, match="name: expected a plain name"):
            skv.register(bad)


def test_continuous_batching_keeps_splitkv_and_leaves_other_names_alone():
    """The manager's gate keeps a splitkv model on splitkv (with the paged| prefix where the
    release runs paged names), and calls transformers' own gate for every other name."""
    from transformers.generation.continuous_batching.continuous_api import \
        ContinuousBatchingManager

    skv.register()
    gate = ContinuousBatchingManager.switch_to_cb_friendly_attn
    assert gate.__wrapped__ is not gate
    manager = object.__new__(ContinuousBatchingManager)
    model = build_model("llama", num_hidden_layers=1)
    model.set_attn_implementation("splitkv")
    gate(manager, model)
    expected = "paged|splitkv" if skv.uses_paged_prefix() else "splitkv"
    assert model.config._attn_implementation == expected
    model.set_attn_implementation("eager")          # transformers' own: becomes paged|eager
    gate(manager, model)
    assert model.config._attn_implementation == "paged|eager"
    skv.register()                                   # registering again wraps nothing twice
    assert ContinuousBatchingManager.switch_to_cb_friendly_attn is gate


@pytest.mark.parametrize("kind,kept", [("llama", 32), ("mistral", None)])
def test_the_decode_fast_path_opens_for_registered_names_only(kind, kept):
    """A block table for splitkv where every attention type of the model supports one
    (transformers 5.18+ gives sliding-window groups none; 5.17 decides that in its cache)."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization

    skv.register()
    gate = initialization.ensure_decode_fast_path_is_available
    assert gate.__wrapped__ is not gate
    ours, theirs = build_model(kind, num_hidden_layers=1).config, \
        build_model(kind, num_hidden_layers=1).config
    ours._attn_implementation_internal = "splitkv"
    theirs._attn_implementation_internal = "sdpa"
    if kept is None:                 # 5.18+ asks its allocators; 5.17 decides in its cache
        kept = 0 if hasattr(initialization, "ATTN_TYPE_TO_ALLOCATOR") else 32
    for config, blocks in ((ours, kept), (theirs, 0)):
        cb = ContinuousBatchingConfig(max_blocks_per_request=32)
        gate(config, cb, True)
        assert cb.max_blocks_per_request == blocks
    skv.register()
    assert initialization.ensure_decode_fast_path_is_available is gate


@pytest.mark.parametrize("tokens,table,max_q,seqs,gathered,route", [
    (8, "t", 1, 8, False, "block_table"),    # the decode fast path (both releases)
    (8, None, 1, 8, False, "token_table"),   # decode-only, not padded (5.17)
    (8, None, 1, 8, True, "gathered"),       # decode-only, not padded (5.23+)
    (8, None, 3, 4, False, "token_rows"),    # a small prefill or mixed batch
    (80, None, 40, 4, True, "delegate"),     # a larger one
    (64, None, 64, 64, True, "token_rows"),  # padded (CUDA graphs): one row a token
    (65, None, 65, 65, False, "delegate"),   # past TOKEN_ROWS_LIMIT
    (1, None, 1, 1, False, "token_table"),
])
def test_the_route_follows_host_values(tokens, table, max_q, seqs, gathered, route):
    assert skv.decode_route(tokens, table, max_q, seqs, gathered=gathered) == route


def test_the_mask_is_transformers_own():
    """varlen_mask against transformers' build_attention_mask (what paged|sdpa gets), with
    chunked prefills, decodes, a sliding window and padding rows and keys."""
    from transformers.generation.continuous_batching.utils import build_attention_mask

    q_lens, k_lens = [5, 1, 3, 1], [9, 7, 3, 20]
    for window in (1, 4):
        cu_q, cu_k = [0], [0]
        for q, k in zip(q_lens, k_lens):
            cu_q.append(cu_q[-1] + q)
            cu_k.append(cu_k[-1] + k)
        num_q, num_k = cu_q[-1] + 3, cu_k[-1] + 5                       # padding
        theirs = torch.full((1, 1, num_q, num_k), torch.finfo(torch.float32).min)
        build_attention_mask(theirs, cu_q, cu_k, sliding_window=window)
        ours = skv.varlen_mask(torch.tensor(cu_q + [cu_q[-1]] * 2, dtype=torch.int32),
                               torch.tensor(cu_k + [cu_k[-1]] * 2, dtype=torch.int32),
                               num_q, num_k, window, torch.float32)
        assert torch.equal(ours, theirs), window


def test_decode_arrays():
    """The new token's slot from the block table (trash for padding rows), and the token
    slots of a sliding-window group with the new tokens' placeholders replaced."""
    table = torch.tensor([[3, 7, -1], [5, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([18, 16, 0], dtype=torch.int32)
    slots = skv.next_slots(seq_lens, table, 16, trash=999)
    assert slots.tolist() == [7 * 16 + 1, 5 * 16 + 15, 999]
    read = torch.tensor([40, 41, 7, 8, 9, 7], dtype=torch.int64)   # sentinel 7 ends each request
    read[2] = 50                                                    # a real slot
    write = torch.tensor([42, 60])
    cu_k = torch.tensor([0, 3, 6], dtype=torch.int32)
    out = skv.token_slots(read, write, cu_k, sentinel=7)
    assert out.dtype == torch.int32 and out.tolist() == [40, 41, 50, 8, 9, 60]


def test_a_session_names_what_it_refuses():
    with pytest.raises(ValueError, match="layout"):
        torch_ops.DecodeSession(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype=torch.float32, layout="csr", capacity=4, width=4,
                                sm_scale=0.1)
    with pytest.raises(ValueError, match="page_size"):
        torch_ops.DecodeSession(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype=torch.float32, layout="indptr", capacity=4, width=4,
                                sm_scale=0.1)
    s = torch_ops.DecodeSession(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype=torch.float32, layout="block_table", capacity=2, width=4,
                                sm_scale=0.1)
    lens, table = torch.zeros(3, dtype=torch.int32), torch.zeros((3, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="q: expected 1 to 2 rows"):
        s.plan([lens, table], 3)
    with pytest.raises(ValueError, match="handle"):
        torch_ops.get_session(-5)


def test_the_cpu_path_refuses_what_the_gpu_wrapper_refuses():
    """A configuration or an input the GPU path would refuse is refused on the CPU path too,
    by name, before anything runs: an engine's CPU tests then fail where its GPU run would."""
    config = dict(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                  dtype=torch.float16, layout="block_table", capacity=2, width=4, sm_scale=0.1)
    for bad, match in (({"num_kv_heads": 3}, "num_qo_heads: 4 is not a multiple"),
                       ({"num_qo_heads": -1}, "num_qo_heads"),
                       ({"head_dim": 80}, "head_dim: 80 is not supported"),
                       ({"dtype": torch.int32}, "torch.float32 on CPU tensors only")):
        with pytest.raises((ValueError, TypeError), match=match):
            torch_ops.DecodeSession(**{**config, **bad})
    s = torch_ops.DecodeSession(**config)
    table = torch.tensor([[0, 1, -1, -1], [2, -1, -1, -1]], dtype=torch.int32)
    with pytest.raises(TypeError, match="seq_lens: expected a torch.int32"):
        s.plan([torch.tensor([17.9, 3.0]), table], 2)       # never truncated to 17
    s.plan([torch.tensor([17, 3], dtype=torch.int32), table], 2)
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    k = v = torch.zeros(3, 16, 2, 64, dtype=torch.float16)
    half = dict(dtype=torch.float16)
    for args, error, match in (
            ((torch.zeros(2, 2, 64, **half), k, v), ValueError, r"q: expected shape \[2, 4, 64\]"),
            ((torch.zeros(2, 4, 32, **half), k, v), ValueError, r"q: expected shape"),
            ((q.float(), k, v), TypeError, "q: expected torch.float16"),
            ((q, torch.zeros(3, 16, 4, 64, **half), v), ValueError, "k_cache: expected shape"),
            ((q, k, v.bfloat16()), TypeError, "v_cache: expected torch.float16")):
        with pytest.raises(error, match=match):
            s.run(*args, None)
    assert s.run(q, k, v, None).shape == (2, 4, 64)


def test_a_session_with_chunked_attention_decodes_each_requests_last_chunk():
    """DecodeSession(attention_chunk_size=) on the CPU path: the float64 reference over each
    request's last chunk (what the GPU path plans on the device)."""
    from splitkv import PageTable, reference_decode

    s = torch_ops.DecodeSession(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype=torch.float32, layout="block_table", capacity=3, width=4,
                                sm_scale=0.125, attention_chunk_size=20)
    lens = torch.tensor([40, 21, 7], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1], [5, -1, -1, -1]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 64, generator=gen)
    k, v = (torch.randn(6, 16, 2, 64, generator=gen) for _ in range(2))
    s.plan([lens, table], 3)
    out = s.run(q, k, v, None)
    pt = PageTable.from_block_table(table.clamp(min=0).numpy(), lens.numpy(), 16)
    want, _ = reference_decode(q.double().numpy(), k.double().numpy(), v.double().numpy(), pt,
                               0.125, attention_chunk_size=20)
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-5)
    whole, _ = reference_decode(q.double().numpy(), k.double().numpy(), v.double().numpy(), pt,
                                0.125)
    assert not np.allclose(want[0], whole[0])          # 40 tokens: its chunk is its last 20
    with pytest.raises(ValueError, match="attention_chunk_size"):
        torch_ops.DecodeSession(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype=torch.float32, layout="block_table", capacity=2, width=4,
                                sm_scale=0.1, attention_chunk_size=-3)


def test_a_session_with_alibi_biases_each_head_by_its_slope():
    """DecodeSession(alibi_slopes=) on the CPU path: the float64 reference with the same
    slopes (a list, or a torch tensor); a slope count other than the heads' is refused."""
    from splitkv import PageTable, reference_decode
    from splitkv.core.variants import alibi_slopes

    slopes = alibi_slopes(4).tolist()
    lens = torch.tensor([40, 21, 7], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1], [5, -1, -1, -1]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 64, generator=gen)
    k, v = (torch.randn(6, 16, 2, 64, generator=gen) for _ in range(2))
    pt = PageTable.from_block_table(table.clamp(min=0).numpy(), lens.numpy(), 16)
    want, _ = reference_decode(q.double().numpy(), k.double().numpy(), v.double().numpy(), pt,
                               0.125, alibi_slopes=slopes)
    plain, _ = reference_decode(q.double().numpy(), k.double().numpy(), v.double().numpy(), pt,
                                0.125)
    assert not np.allclose(want, plain)
    for given in (slopes, torch.tensor(slopes)):
        s = torch_ops.DecodeSession(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                    dtype=torch.float32, layout="block_table", capacity=3,
                                    width=4, sm_scale=0.125, alibi_slopes=given)
        s.plan([lens, table], 3)
        np.testing.assert_allclose(s.run(q, k, v, None).double().numpy(), want, rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(ValueError, match="alibi_slopes"):
        torch_ops.DecodeSession(num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype=torch.float32, layout="block_table", capacity=2, width=4,
                                sm_scale=0.1, alibi_slopes=slopes[:3])


# sequences longer than the sliding window (16) and the page (16); one finishes early
PROMPT_LENS = [5, 23, 40, 12]


@pytest.mark.parametrize("kind", MODELS)
def test_generate_batch_decodes_the_models_own_tokens(kind):
    """float32 model, float64 decode attention: every token is the eager model's argmax on the
    same prefix. Full-attention models decode through the block table; sliding-window ones
    through the token table (5.17) or the gathered keys (5.23+); prompts go to the delegate."""
    skv.register()
    model = build_model(kind)
    prompts = random_prompts(PROMPT_LENS, seed=1)
    skv.route_counts.clear()
    ours = generate(model, "splitkv", prompts, 10, graphs=False, num_blocks=64)
    routes = dict(skv.route_counts)
    layers = model.config.num_hidden_layers
    if kind in ("llama", "qwen2", "phi3"):      # full attention
        decoded = routes.get("block_table", 0)
    else:                              # 5.17 reads the token slots; 5.18+ gathers the keys
        decoded = routes.get("token_table", 0) + routes.get("gathered", 0)
    assert decoded >= 9 * layers and routes.get("delegate", 0) >= layers, routes
    verdict = judge(model, prompts, ours, NEAR_TIE_GAP["float32"])
    assert verdict.mismatches == 0 and verdict.near_ties == 0, verdict
    if kind == "llama":               # transformers' sdpa is exact here (no soft cap, no sinks)
        sdpa = "paged|sdpa" if skv.uses_paged_prefix() else "sdpa"
        assert generate(model, sdpa, prompts, 10, graphs=False, num_blocks=64) == ours


def test_padding_rows_of_a_block_table_batch_change_no_cache_slot():
    """5.23+ leaves the cache write of a block-table batch to the attention: a padding row
    (length 0) must not write anywhere, and real rows land at their last position."""
    from splitkv.integrations.transformers.attention import _write_rows

    pages = torch.zeros(6, 4, 2, 8)                  # [pages, page_size, H_kv, D]
    v_pages = torch.zeros_like(pages)
    table = torch.tensor([[2, 5], [1, -1], [-1, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 3, 0], dtype=torch.int32)
    key = torch.arange(1, 4).float().view(1, 1, 3, 1).expand(1, 2, 3, 8)   # row r: r + 1
    before = pages.clone()
    _write_rows(pages, v_pages, key, key * 10, seq_lens, table)
    changed = (pages != before).any(-1).any(-1).nonzero().tolist()
    assert changed == [[1, 2], [5, 1]]               # row 1 at page 1 slot 2; row 0 at 5, 1
    assert pages[5, 1].eq(1).all() and pages[1, 2].eq(2).all()
    assert v_pages[5, 1].eq(10).all()


def test_torch_compile_fullgraph_traces_the_op_without_a_break():
    module, make = compile_case("cpu", torch.float32)
    with torch.no_grad():
        eager = module(*make())
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")(*make())
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_a_changed_private_hook_is_left_alone_with_one_warning(monkeypatch):
    """Where a release renames or re-signs a check that register() widens, transformers keeps
    its own check and the user is told once what is lost."""
    from transformers.generation.continuous_batching import initialization

    from splitkv.integrations.transformers import registration

    def resigned(config, cb_config):               # a release with another signature
        return None

    monkeypatch.setattr(initialization, "ensure_decode_fast_path_is_available", resigned)
    monkeypatch.setattr(registration, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="decode batches reach splitkv without a block"):
        skv.register()
    assert initialization.ensure_decode_fast_path_is_available is resigned
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        skv.register()                               # once only
