"""``paged|splitkv`` on the CPU: the registration, the route each call takes, the arrays handed to
splitkv, the mask of the delegated batches, and whole ``generate_batch`` runs of the three model
families, where the decode call is splitkv's float64 reference (the op's CPU path). Skipped where
torch or transformers are not installed (as in CI)."""

from __future__ import annotations

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
    assert skv.register() == "paged|splitkv"
    model = build_model("llama", num_hidden_layers=1)
    model.set_attn_implementation("paged|splitkv")
    assert model.config._attn_implementation == "paged|splitkv"
    with pytest.raises(ValueError, match="not supported"):   # the key is the whole string
        model.set_attn_implementation("paged|splitkv-unregistered")
    with pytest.raises(ValueError, match="name: expected 'paged|"):
        skv.register("splitkv")


def test_the_decode_fast_path_opens_for_registered_names_only():
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization

    skv.register()
    gate = initialization.ensure_decode_fast_path_is_available
    assert gate.__wrapped__ is not gate
    ours, theirs = build_model("llama", num_hidden_layers=1).config, \
        build_model("llama", num_hidden_layers=1).config
    ours._attn_implementation_internal = "paged|splitkv"
    theirs._attn_implementation_internal = "paged|sdpa"
    for config, kept in ((ours, 32), (theirs, 0)):
        cb = ContinuousBatchingConfig(max_blocks_per_request=32)
        gate(config, cb, True)
        assert cb.max_blocks_per_request == kept
    skv.register()                                   # registering again wraps nothing twice
    assert initialization.ensure_decode_fast_path_is_available is gate


@pytest.mark.parametrize("tokens,table,max_q,seqs,route", [
    (8, "t", 1, 8, "block_table"),        # transformers' decode fast path
    (8, None, 1, 8, "token_table"),       # decode-only, not padded
    (8, None, 3, 4, "delegate"),          # prefill or mixed
    (64, None, 64, 64, "delegate"),       # padded (CUDA graphs): cannot tell, so delegated
    (1, None, 1, 1, "token_table"),
])
def test_the_route_follows_host_values(tokens, table, max_q, seqs, route):
    assert skv.decode_route(tokens, table, max_q, seqs) == route


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
    slots = skv._next_slots(seq_lens, table, 16, trash=999)
    assert slots.tolist() == [7 * 16 + 1, 5 * 16 + 15, 999]
    read = torch.tensor([40, 41, 7, 8, 9, 7], dtype=torch.int64)   # sentinel 7 ends each request
    read[2] = 50                                                    # a real slot
    write = torch.tensor([42, 60])
    cu_k = torch.tensor([0, 3, 6], dtype=torch.int32)
    out = skv._token_slots(read, write, cu_k, sentinel=7)
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


# sequences longer than the sliding window (16) and the page (16); one finishes early
PROMPT_LENS = [5, 23, 40, 12]


@pytest.mark.parametrize("kind", MODELS)
def test_generate_batch_decodes_the_models_own_tokens(kind):
    """float32 model, float64 decode attention: every token is the eager model's argmax on the
    same prefix. Llama decodes through the block table, the sliding-window models through the
    token table; the prompts go through the delegate."""
    skv.register()
    model = build_model(kind)
    prompts = random_prompts(PROMPT_LENS, seed=1)
    skv.route_counts.clear()
    ours = generate(model, "paged|splitkv", prompts, 10, graphs=False, num_blocks=64)
    routes = dict(skv.route_counts)
    layers = model.config.num_hidden_layers
    decode_route = "block_table" if kind == "llama" else "token_table"
    assert routes.get(decode_route, 0) >= 9 * layers and routes.get("delegate", 0) >= layers
    verdict = judge(model, prompts, ours, NEAR_TIE_GAP["float32"])
    assert verdict.mismatches == 0 and verdict.near_ties == 0, verdict
    if kind == "llama":               # paged|sdpa is exact here (no soft cap, no sinks)
        assert generate(model, "paged|sdpa", prompts, 10, graphs=False, num_blocks=64) == ours


def test_torch_compile_fullgraph_traces_the_op_without_a_break():
    module, make = compile_case("cpu", torch.float32)
    with torch.no_grad():
        eager = module(*make())
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")(*make())
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
