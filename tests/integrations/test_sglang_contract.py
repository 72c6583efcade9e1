"""``splitkv.integrations.sglang`` against the real SGLang package, on the CPU: the plugin entry
point and SGLang's own loader, registry and CLI choices; the configuration checks; the batch
tables built from SGLang's ``req_to_token``; ``forward_decode`` over SGLang's real KV pool
(splitkv's CPU path runs its float64 reference) against a float64 attention computed here; the
CUDA-graph hooks against the eager path; prefill through SGLang's own prefill/decode split, or
the refusal. Skipped where sglang is not installed (as in CI)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (pip install splitkv[sglang])")
torch = pytest.importorskip("torch")

from sglang.srt.arg_groups import choices  # noqa: E402
from sglang.srt.layers.attention import attention_registry  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

import splitkv.integrations.sglang as skv  # noqa: E402
from splitkv.integrations import torch_ops  # noqa: E402
from splitkv.integrations.sglang import backend as B  # noqa: E402

CONTEXT, POOL = 64, 512


# --------------------------------------------------------------------------- the engine's side
def make_runner(dtype=torch.float16, kv_dtype=None, head_dim=64, num_kv_heads=2, layers=2,
                prefill="triton", **overrides):
    """A model runner with what SGLang's backends read from it, and SGLang's real pools."""
    pool = MHATokenToKVPool(size=POOL, page_size=1, dtype=kv_dtype or dtype,
                            head_num=num_kv_heads, head_dim=head_dim, layer_num=layers,
                            device="cpu", enable_memory_saver=False)
    fields = dict(
        model_config=SimpleNamespace(head_dim=head_dim, is_encoder_decoder=False,
                                     context_len=CONTEXT),
        use_mla_backend=False, dtype=dtype, kv_cache_dtype=kv_dtype or dtype,
        token_to_kv_pool=pool, device="cpu", page_size=1,
        req_to_token_pool=ReqToTokenPool(size=16, max_context_len=CONTEXT, device="cpu",
                                         enable_memory_saver=False),
        prefill_attention_backend_str=prefill, decode_attention_backend_str="splitkv")
    fields.update(overrides)
    return SimpleNamespace(**fields)


def decode_batch(runner, lens, seed=0, mode=ForwardMode.DECODE):
    """A decode batch as SGLang's scheduler makes it: request slots, each request's token rows
    in ``req_to_token`` (the new token's row last, also ``out_cache_loc``), lengths counting
    the new token. A stand-in with ForwardBatch's real field names."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int64)
    slots = torch.randperm(runner.req_to_token_pool.size, generator=gen)[:len(lens)]
    rows = torch.randperm(POOL, generator=gen)[:int(lens.sum())] + 1   # row 0: padding's
    table = runner.req_to_token_pool.req_to_token
    start = 0
    for slot, n in zip(slots.tolist(), lens.tolist()):
        table[slot, :n] = rows[start:start + n].to(table.dtype)
        start += n
    last = torch.cumsum(lens, 0) - 1
    return SimpleNamespace(
        forward_mode=mode, batch_size=len(lens), req_pool_indices=slots, seq_lens=lens,
        seq_lens_cpu=lens.clone(), seq_lens_sum=int(lens.sum()), out_cache_loc=rows[last],
        out_cache_loc_is_physical=False, encoder_out_cache_loc=None, spec_info=None)


def test_the_stand_in_uses_forward_batch_field_names():
    names = {f.name for f in dataclasses.fields(ForwardBatch)}
    batch = decode_batch(make_runner(), [3, 5])
    assert set(vars(batch)) - {"seq_lens_cpu", "spec_info"} <= names
    assert {"seq_lens_cpu", "spec_info"} <= names


def layer(layer_id=0, heads=4, kv_heads=2, head_dim=64, **options):
    return RadixAttention(heads, head_dim, head_dim ** -0.5, kv_heads, layer_id, **options)


def reference(runner, batch, lyr, q, sinks=None):
    """float64 decode attention over SGLang's pool as the engine means it: each request's rows
    from req_to_token, the window (sliding_window_size tokens before the query), the tanh soft
    cap, the sinks in the denominator."""
    pool = runner.token_to_kv_pool
    kb, vb = (buf.to(torch.float64) for buf in (pool.get_key_buffer(lyr.layer_id),
                                                pool.get_value_buffer(lyr.layer_id)))
    scale_k = float(lyr.k_scale_float or 1.0) if runner.kv_cache_dtype != runner.dtype else 1.0
    scale_v = float(lyr.v_scale_float or 1.0) if runner.kv_cache_dtype != runner.dtype else 1.0
    heads, group = lyr.tp_q_head_num, lyr.tp_q_head_num // lyr.tp_k_head_num
    q = q.view(-1, heads, lyr.head_dim).to(torch.float64)
    out = torch.empty_like(q)
    for b, (slot, n) in enumerate(zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist())):
        rows = runner.req_to_token_pool.req_to_token[slot, :n].long()
        first = 0 if lyr.sliding_window_size < 0 else max(0, n - 1 - lyr.sliding_window_size)
        rows = rows[first:]
        for h in range(heads):
            k, v = kb[rows, h // group] * scale_k, vb[rows, h // group] * scale_v
            s = (k @ q[b, h]) * lyr.scaling
            if lyr.logit_cap:
                s = lyr.logit_cap * torch.tanh(s / lyr.logit_cap)
            m = s.max() if sinks is None else torch.maximum(s.max(), sinks[h].double())
            w = torch.exp(s - m)
            den = w.sum() + (0 if sinks is None else torch.exp(sinks[h].double() - m))
            out[b, h] = (w @ v) / den
    return out.reshape(q.shape[0], -1)


def new_kv(batch, kv_heads=2, head_dim=64, dtype=torch.float16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch.batch_size, kv_heads, head_dim, generator=gen).to(dtype)
            for _ in range(2)]


def fill_pool(runner, seed=2):
    gen = torch.Generator().manual_seed(seed)
    pool = runner.token_to_kv_pool
    for buffers in (pool.k_buffer, pool.v_buffer):
        for buf in buffers:
            values = torch.randn(buf.shape, generator=gen)
            buf.copy_(values.to(pool.dtype).view(buf.dtype))


# --------------------------------------------------------------------------- registration
def test_the_entry_point_is_in_sglangs_group_and_loads_register():
    from importlib.metadata import entry_points

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    found = {ep.name: ep for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert GENERAL_PLUGINS_GROUP == "sglang.srt.plugins"
    assert found["splitkv"].value == "splitkv.integrations.sglang:register"
    assert found["splitkv"].load() is skv.register


def test_sglangs_loader_registers_the_backend_and_the_cli_accepts_it(monkeypatch):
    import argparse

    from sglang.srt import plugins
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "splitkv")
    monkeypatch.delitem(attention_registry.ATTENTION_BACKENDS, "splitkv", raising=False)
    plugins.load_plugins()
    assert attention_registry.ATTENTION_BACKENDS["splitkv"] is skv.create_backend
    assert choices.ATTENTION_BACKEND_CHOICES.count("splitkv") == 1
    skv.register()                                   # again: the choice is not repeated
    assert choices.ATTENTION_BACKEND_CHOICES.count("splitkv") == 1
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--decode-attention-backend", "splitkv",
                              "--prefill-attention-backend", "triton"])
    assert args.decode_attention_backend == "splitkv"
    with pytest.raises(SystemExit):                 # the parser does check the choices
        parser.parse_args(["--model-path", "m", "--decode-attention-backend", "splitkv-x"])


def test_register_imports_nothing_heavy_of_splitkv():
    code = ("import sys; import splitkv.integrations.sglang as s; s.register(); "
            "print(sorted(m for m in sys.modules if m.startswith(('splitkv.integrations.torch_ops',"
            " 'splitkv.integrations.sglang.backend', 'splitkv.runtime', 'cupy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]"


def test_the_factory_builds_the_backend():
    backend = attention_registry.ATTENTION_BACKENDS.get("splitkv", skv.create_backend)(
        make_runner())
    assert isinstance(backend, B.SplitKVAttnBackend)
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    assert isinstance(backend, AttentionBackend)


# --------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("overrides,match", [
    (dict(use_mla_backend=True), "MLA"),
    (dict(head_dim=80), "head_dim: 80"),
    (dict(head_dim=96, kv_dtype=torch.float8_e4m3fn), r"float8_e4m3fn \(fp8\) at head_dim 96"),
    (dict(dtype=torch.float32), "dtype: torch.float32"),
    (dict(prefill="splitkv"), "--prefill-attention-backend"),
    (dict(model_config=SimpleNamespace(head_dim=64, is_encoder_decoder=True, context_len=64)),
     "encoder-decoder"),
])
def test_the_configuration_check_refuses_by_name(overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        B.SplitKVAttnBackend(make_runner(**overrides))


def test_the_kv_cache_dtype_must_be_the_models_or_fp8():
    runner = make_runner()
    runner.kv_cache_dtype = torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype: torch.bfloat16"):
        B.check_runner(runner)
    runner.token_to_kv_pool.use_hnd = True
    runner.kv_cache_dtype = runner.dtype
    with pytest.raises(ValueError, match="'hnd' KV layout"):
        B.check_runner(runner)


@pytest.mark.parametrize("options,match", [
    (dict(head_dim=80), "head_dim 80"),
    (dict(is_cross_attention=True), "cross attention"),
    (dict(logit_cap=5.0, logit_capping_method="relu"), "logit_capping_method"),
])
def test_layers_splitkv_does_not_run_are_refused(options, match):
    head_dim = options.pop("head_dim", 64)
    with pytest.raises(ValueError, match=match):
        B.layer_spec(layer(head_dim=head_dim, **options), torch.float16)
    with pytest.raises(TypeError, match="q: dtype torch.float32"):
        B.layer_spec(layer(), torch.float32)


def test_the_layer_spec_is_splitkvs_options():
    spec = B.layer_spec(layer(logit_cap=30.0, sliding_window_size=127), torch.bfloat16)
    assert (spec.window_left, spec.logits_soft_cap, spec.num_qo_heads) == (127, 30.0, 4)
    assert B.layer_spec(layer(), torch.float16).window_left == -1


# --------------------------------------------------------------------------- the tables
def test_the_batch_becomes_kv_indptr_and_kv_indices():
    runner = make_runner()
    backend = B.SplitKVAttnBackend(runner)
    batch = decode_batch(runner, [5, 1, 9, 3])
    backend.init_forward_metadata(batch)
    md = backend.forward_metadata
    assert md.kv_indptr.tolist() == [0, 5, 6, 15, 18]
    want = torch.cat([runner.req_to_token_pool.req_to_token[s, :n] for s, n in
                      zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist())])
    assert md.kv_indices[:18].tolist() == want.tolist()
    assert md.kv_indices.dtype == torch.int32 and (md.capacity, md.graph) == (8, False)


# --------------------------------------------------------------------------- forward_decode
@pytest.mark.parametrize("options", [
    dict(), dict(sliding_window_size=4), dict(logit_cap=3.0), dict(sinks=True),
    dict(heads=8, kv_heads=1),
])
def test_forward_decode_matches_a_float64_reference(options):
    heads, kv_heads = options.pop("heads", 4), options.pop("kv_heads", 2)
    use_sinks = options.pop("sinks", False)
    runner = make_runner(num_kv_heads=kv_heads)
    fill_pool(runner)
    backend = B.SplitKVAttnBackend(runner)
    batch = decode_batch(runner, [7, 1, 12, 30])
    backend.init_forward_metadata(batch)
    gen = torch.Generator().manual_seed(3)
    layers = [layer(i, heads, kv_heads, **options) for i in range(2)]
    sinks = torch.randn(heads, generator=gen) if use_sinks else None
    for lyr in layers:
        q = torch.randn(batch.batch_size, heads * 64, generator=gen).half()
        k, v = new_kv(batch, kv_heads, seed=lyr.layer_id + 10)
        out = backend.forward_decode(q, k, v, lyr, batch, sinks=sinks)
        rows = batch.out_cache_loc
        assert torch.equal(runner.token_to_kv_pool.get_key_buffer(lyr.layer_id)[rows], k)
        assert out.shape == (4, heads * 64) and out.dtype == torch.float16
        torch.testing.assert_close(out.double(), reference(runner, batch, lyr, q, sinks),
                                   atol=2e-3, rtol=2e-3)
    (handle, first), = backend.sessions.values()
    session = torch_ops.get_session(handle)
    assert (first, session.plans, session.runs) == (0, 1, 2)   # one plan per step


@pytest.mark.skipif(not B.SESSIONS_TAKE_FP8, reason="torch_ops has no fp8 sessions here")
def test_forward_decode_reads_an_fp8_pool_with_its_scales():
    runner = make_runner(kv_dtype=torch.float8_e4m3fn)
    fill_pool(runner)
    backend = B.SplitKVAttnBackend(runner)
    batch = decode_batch(runner, [6, 11])
    backend.init_forward_metadata(batch)
    lyr = layer()
    lyr.k_scale, lyr.v_scale = torch.tensor([0.5]), torch.tensor([2.0])
    lyr.k_scale_float, lyr.v_scale_float = 0.5, 2.0
    q = torch.randn(2, 4 * 64, generator=torch.Generator().manual_seed(4)).half()
    k, v = new_kv(batch)
    out = backend.forward_decode(q, k, v, lyr, batch)
    torch.testing.assert_close(out.double(), reference(runner, batch, lyr, q), atol=2e-3,
                               rtol=2e-3)


def test_a_new_step_plans_again():
    runner = make_runner()
    fill_pool(runner)
    backend = B.SplitKVAttnBackend(runner)
    lyr = layer()
    for lens, seed in (([4, 9], 5), ([13, 2, 2], 6)):
        batch = decode_batch(runner, lens, seed=seed)
        backend.init_forward_metadata(batch)
        q = torch.randn(len(lens), 256, generator=torch.Generator().manual_seed(seed)).half()
        out = backend.forward_decode(q, *new_kv(batch, seed=seed), lyr, batch)
        torch.testing.assert_close(out.double(), reference(runner, batch, lyr, q), atol=2e-3,
                                   rtol=2e-3)


# --------------------------------------------------------------------------- CUDA graphs
def test_the_graph_hooks_fill_what_the_eager_path_does():
    runner = make_runner()
    fill_pool(runner)
    backend = B.SplitKVAttnBackend(runner)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    capture = decode_batch(runner, [1, 1, 1, 1], seed=7)
    backend.init_forward_metadata_out_graph(capture, in_capture=True)
    backend.init_forward_metadata_in_graph(capture)
    captured = backend.forward_metadata
    lyr = layer()
    for lens, seed in (([8, 3, 20], 8), ([2, 2, 40], 9)):
        live = decode_batch(runner, lens, seed=seed)
        backend.init_forward_metadata(live)
        eager = backend.forward_metadata
        q = torch.randn(4, 256, generator=torch.Generator().manual_seed(seed)).half()
        want = backend.forward_decode(q[:3], *new_kv(live, seed=seed), lyr, live)
        # replay: the runner pads to the captured size (slot 0, the fill length), then calls
        # the host hook; the captured fill runs on the same buffers
        padded = SimpleNamespace(**vars(live))
        padded.batch_size = 4
        padded.req_pool_indices = torch.cat([live.req_pool_indices, torch.zeros(1).long()])
        padded.seq_lens = torch.cat([live.seq_lens, torch.ones(1).long()])
        padded.out_cache_loc = torch.cat([live.out_cache_loc, torch.zeros(1).long()])
        backend.init_forward_metadata_out_graph(padded)
        backend.init_forward_metadata_in_graph(padded)
        md = backend.forward_metadata
        assert md.kv_indptr.data_ptr() == captured.kv_indptr.data_ptr()
        assert md.kv_indices.data_ptr() == captured.kv_indices.data_ptr()
        total = sum(lens)
        assert md.kv_indptr[:4].tolist() == eager.kv_indptr.tolist()
        assert md.kv_indices[:total].tolist() == eager.kv_indices[:total].tolist()
        got = backend.forward_decode(q, None, None, lyr, padded)
        torch.testing.assert_close(got[:3], want, atol=0, rtol=0)
    graph_sessions = [key for key in backend.sessions if key[-1]]
    assert len(graph_sessions) == 1


# --------------------------------------------------------------------------- prefill
class PrefillBackend:
    """A prefill backend SGLang's split runs extend batches on (records what reached it)."""

    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, forward_batch):
        self.calls.append("metadata")

    def forward(self, *args, **kwargs):
        self.calls.append("forward")
        return "prefill"

    needs_cpu_seq_lens = True
    extend_dummy_seqs_capped_by_req_pool = False


def test_sglangs_split_sends_extend_to_the_prefill_backend(monkeypatch):
    from sglang.srt.layers.attention import hybrid_attn_backend
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend

    # the speculative settings a server publishes at start (none here)
    monkeypatch.setattr(hybrid_attn_backend, "get_spec",
                        lambda: SimpleNamespace(speculative_attention_mode="prefill"))
    runner = make_runner(kv_index_translator=None)
    ours, prefill = B.SplitKVAttnBackend(runner), PrefillBackend()
    split = HybridAttnBackend(model_runner=runner, prefill_backend=prefill, decode_backend=ours)
    extend = decode_batch(runner, [5, 6], mode=ForwardMode.EXTEND)
    split.init_forward_metadata(extend)
    assert prefill.calls == ["metadata"] and ours.forward_metadata is None
    batch = decode_batch(runner, [5, 6])
    split.init_forward_metadata(batch)
    assert ours.forward_metadata.kv_indptr.tolist() == [0, 5, 11]
    q = torch.zeros(11, 256).half()
    assert split.forward(q, None, None, layer(), extend) == "prefill"
    assert prefill.calls == ["metadata", "forward"]


def test_as_the_only_backend_extend_is_refused_clearly():
    runner = make_runner()
    backend = B.SplitKVAttnBackend(runner)
    extend = decode_batch(runner, [5, 6], mode=ForwardMode.EXTEND)
    with pytest.raises(NotImplementedError, match="--prefill-attention-backend"):
        backend.init_forward_metadata(extend)
    with pytest.raises(NotImplementedError, match="--prefill-attention-backend"):
        backend.forward(torch.zeros(11, 256).half(), None, None, layer(), extend)
    verify = decode_batch(runner, [5], mode=ForwardMode.TARGET_VERIFY)
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY is not supported"):
        backend.init_forward_metadata(verify)
