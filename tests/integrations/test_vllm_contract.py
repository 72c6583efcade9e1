"""splitkv's vLLM backend against the real vLLM package (its registry, plugin loader, config
objects, KV cache allocator and batch description), on the CPU: the entry point, what
``register()`` imports, the configuration check, the KV cache vLLM allocates, the metadata
builder, and the forward pass (decode rows against a float64 computation written here; the
other rows reach vLLM's FlashAttention, which cannot run here, so it is replaced by a recorder).
Skipped where vLLM is not installed (as in CI)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.attention.backend import (AttentionCGSupport, AttentionType,  # noqa: E402
                                       CommonAttentionMetadata)
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor,  # noqa: E402
                                        compute_layout_strides, create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

import splitkv.integrations.vllm as plugin  # noqa: E402
from splitkv.integrations import torch_ops  # noqa: E402
from splitkv.integrations.vllm import backend as B  # noqa: E402

PLUGIN_FILE = Path(plugin.__file__)


class DeviceCapability:
    """What vLLM's platform hands validate_configuration (major, minor)."""

    def __init__(self, major, minor):
        self.major, self.minor = major, minor


# --------------------------------------------------------------------------- the entry point
def test_the_entry_point_registers_splitkv_in_vllms_registry():
    from importlib.metadata import entry_points

    from vllm.config.attention import AttentionConfig
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    (ours,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "splitkv"]
    assert ours.value == "splitkv.integrations.vllm:register"
    loaded = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)       # vLLM's own loader
    assert loaded["splitkv"] is plugin.register
    assert loaded["splitkv"]() == "SPLITKV"
    member = AttentionBackendEnum["SPLITKV"]                      # a member of its own
    assert member is not AttentionBackendEnum.CUSTOM
    assert member.get_path() == "splitkv.integrations.vllm.backend.SplitKVBackend"
    assert member.get_class() is B.SplitKVBackend
    assert B.SplitKVBackend.get_name() == member.name           # the layer looks it up so
    # what --attention-backend SPLITKV (or splitkv) becomes in vLLM's config
    assert AttentionConfig(backend="splitkv").backend is member
    assert plugin.register() == "SPLITKV"                         # again: no error, same path
    assert AttentionBackendEnum["SPLITKV"] is member
    with pytest.raises(ValueError, match="Unknown attention backend"):
        AttentionBackendEnum["SPLITKV_UNREGISTERED"]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                          "print('\\n'.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


HEAVY = ("torch", "cupy", "cupyx", "cupy_backends", "splitkv.runtime", "splitkv.planner",
         "splitkv.integrations.torch_ops", "splitkv.integrations.vllm.backend")


def _heavy(modules) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_register_imports_nothing_heavy_of_its_own():
    """Importing the plugin imports none of torch, CuPy or splitkv's runtime; calling
    ``register()`` adds nothing beyond what importing vLLM's registry module imports itself
    (vLLM's, not splitkv's: its package may bring torch)."""
    assert _heavy(_modules_after("import splitkv.integrations.vllm")) == []
    registry = _modules_after("import vllm.v1.attention.backends.registry")
    registered = _modules_after("import splitkv.integrations.vllm as p\n"
                                "assert p.register() == 'SPLITKV'")
    assert _heavy(registered - registry) == []
    assert "splitkv.integrations.vllm.backend" not in registered
    top = [node for node in ast.parse(PLUGIN_FILE.read_text()).body
           if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [getattr(node, "module", None) for node in top] == ["__future__"]


# --------------------------------------------------------------------------- the configuration
def _reasons(**changes):
    config = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16,
                  has_sink=False, attn_type=AttentionType.DECODER, has_sliding_window=False)
    capability = changes.pop("capability", DeviceCapability(9, 0))
    config.update(changes)
    # as vLLM's CUDA platform calls it
    return B.SplitKVBackend.validate_configuration(
        device_capability=capability, **AttentionSelectorConfig(**config)._asdict())


@pytest.mark.parametrize("changes", [
    {}, {"head_size": 64}, {"head_size": 96}, {"head_size": 256}, {"dtype": torch.float16},
    {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": None},
    {"kv_cache_dtype": "bfloat16"}, {"block_size": 32}, {"block_size": None},
    {"has_sink": True}, {"has_sliding_window": True}, {"capability": DeviceCapability(8, 0)},
])
def test_the_configuration_check_accepts(changes):
    assert _reasons(**changes) == []


@pytest.mark.parametrize("changes,named", [
    ({"head_size": 80}, "head_size: 80"),
    ({"head_size": 512}, "head_size: 512"),
    ({"dtype": torch.float32}, "dtype: torch.float32"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype: 'fp8_e5m2'"),
    ({"kv_cache_dtype": "fp8", "head_size": 96}, "kv_cache_dtype: fp8 at head_size 96"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype: float16 with a torch.bfloat16"),
    ({"block_size": 8}, "block_size: 8"),
    ({"use_mla": True}, "use_mla: MLA"),
    ({"attn_type": AttentionType.ENCODER}, "attn_type: "),
    ({"attn_type": AttentionType.ENCODER_ONLY}, "attn_type: "),
    ({"attn_type": AttentionType.ENCODER_DECODER}, "attn_type: "),
    ({"has_sink": True, "capability": DeviceCapability(8, 0)}, "sinks: "),
    ({"capability": DeviceCapability(7, 5)}, "compute capability"),
    ({"use_sparse": True}, "sparse"),
    ({"use_non_causal": True}, "non-causal"),
])
def test_the_configuration_check_refuses_by_name(changes, named):
    reasons = _reasons(**changes)
    assert any(named in reason for reason in reasons), reasons
    assert not any(r in ("head_size not supported", "MLA not supported") for r in reasons)


def test_the_layer_refuses_an_fp8_cache_at_head_size_96():
    B.SplitKVImpl(8, 96, 0.1, 2, None, None, "auto")
    with pytest.raises(ValueError, match="kv_cache_dtype: fp8 at head_size 96"):
        B.SplitKVImpl(8, 96, 0.1, 2, None, None, "fp8")


def test_the_layer_takes_alibi_and_refuses_other_attention_types():
    slopes = [2.0 ** -(i + 1) for i in range(8)]
    layer = B.SplitKVImpl(8, 128, 0.1, 2, slopes, None, "auto")
    assert layer.alibi_slopes == tuple(slopes) and layer._delegate_args[4] == slopes
    assert B.SplitKVImpl(8, 128, 0.1, 2, torch.tensor(slopes), None, "auto").alibi_slopes \
        == tuple(slopes)
    with pytest.raises(ValueError, match="alibi_slopes"):
        B.SplitKVImpl(8, 128, 0.1, 2, slopes[:4], None, "auto")
    with pytest.raises(NotImplementedError, match="attn_type"):
        B.SplitKVImpl(8, 128, 0.1, 2, None, None, "auto", attn_type=AttentionType.ENCODER)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype"):
        B.SplitKVImpl(8, 128, 0.1, 2, None, None, "fp8_e5m2")


def test_the_backend_declares_what_vllm_reads():
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    assert B.SplitKVMetadataBuilder._cudagraph_support is \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert AttentionMetadataBuilder._cudagraph_support is AttentionCGSupport.NEVER
    assert B.SplitKVBackend.forward_includes_kv_cache_update is False
    assert B.SplitKVBackend.supports_block_size(16) and B.SplitKVBackend.supports_block_size(48)
    assert not B.SplitKVBackend.supports_block_size(8)
    assert not B.SplitKVBackend.is_mla() and B.SplitKVBackend.supports_sink()


# --------------------------------------------------------------------------- the KV cache
def vllm_kv_cache(spec, num_blocks: int, layout: KVCacheLayout, num_layers: int = 2):
    """Per-layer caches as vLLM's allocator views its backing buffer for ``layout``."""
    strides = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(num_layers)],
                           layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)


@pytest.mark.parametrize("layout", B.KV_LAYOUTS)
def test_the_kv_cache_is_flash_attentions(layout):
    """The cache vLLM allocates for a FlashAttention layer (its spec unchanged by either
    backend), with K and V where FlashAttention's forward reads them."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert B.SplitKVBackend.customize_spec(spec) == FlashAttentionBackend.customize_spec(spec)
    assert get_supported_kv_cache_layouts([B.SplitKVBackend, FlashAttentionBackend])[0] is \
        KVCacheLayout.LBNHC                      # vLLM's default: both backends' first choice
    cache = vllm_kv_cache(spec, 5, layout)[1]
    assert tuple(cache.shape) == (5, 2, 16, 128) and cache.dtype == torch.bfloat16
    impl = B.SplitKVImpl(4, 64, 0.125, 2, None, None, "auto")
    key, value = torch.randn(3, 2, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16()
    slots = torch.tensor([17, 79, -1])              # block 1 offset 1, block 4 offset 15, none
    impl.do_kv_cache_update(Layer(), key, value, cache, slots)
    k_fa, v_fa = cache.transpose(1, 2).split(64, dim=-1)       # FlashAttention's reading
    assert torch.equal(k_fa[1, 1], key[0]) and torch.equal(v_fa[4, 15], value[1])
    assert int((k_fa != 0).any(-1).sum()) == 4                  # 2 tokens x 2 heads, no more
    k, v = B.kv_views(cache, 64)
    assert tuple(k.shape) == (5, 16, 2, 64) and k.stride(-1) == 1
    assert torch.equal(k, k_fa) and torch.equal(v, v_fa)
    assert k.data_ptr() == cache.data_ptr()                      # in place, no copy


# --------------------------------------------------------------------------- the builder
class Layer:
    """The attention layer's scales, as vLLM's Attention module holds them."""

    def __init__(self, k_scale=1.0, v_scale=1.0):
        self._k_scale = torch.tensor([k_scale], dtype=torch.float32)
        self._v_scale = torch.tensor([v_scale], dtype=torch.float32)


def vllm_config():
    """vLLM's defaults (no model: the builder reads the scheduler and compilation configs)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def batch(query_lens, seq_lens, num_blocks: int, block_size: int, rng, width: int = 8):
    """vLLM's description of a step: requests in order, a random block table (distinct
    blocks), the new tokens' slots."""
    query_lens, seq_lens = np.asarray(query_lens), np.asarray(seq_lens)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    table = np.zeros((len(seq_lens), width), dtype=np.int32)
    order = rng.permutation(num_blocks)
    used = 0
    for r, n in enumerate(seq_lens):
        pages = -(-int(n) // block_size)
        table[r, :pages] = order[used:used + pages]
        used += pages
    slots = []
    for r, (q, n) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(n - q, n):
            slots.append(table[r, pos // block_size] * block_size + pos % block_size)
    qsl_t = torch.from_numpy(qsl)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t.clone(), query_start_loc_cpu=qsl_t,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)), num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_table_tensor=torch.from_numpy(table),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens.astype(np.int32)))


class Recorder:
    """Stands in for vLLM's FlashAttention builder or impl (which need a GPU)."""

    def __init__(self, fill: float = 7.0):
        self.calls, self.fill = [], fill

    def build(self, common_prefix_len, cm, fast_build=False):
        self.calls.append(cm)
        return ("flash-attention metadata", cm.num_reqs)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        self.calls.append((query, key, value, attn_metadata, output))
        return output.fill_(self.fill)


def make_builder(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype)
    return B.SplitKVMetadataBuilder(spec, ["model.layers.0.attn"], vllm_config(),
                                    torch.device("cpu")), spec


def test_the_builder_turns_vllms_batch_into_splitkvs_plan_inputs(monkeypatch):
    rng = np.random.default_rng(0)
    builder, spec = make_builder()
    assert builder.reorder_batch_threshold == 1                  # decode-first batches
    assert builder.get_cudagraph_support(builder.vllm_config, spec) is \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert builder.sessions.capacity == builder.vllm_config.scheduler_config.max_num_seqs
    delegate = Recorder()
    monkeypatch.setattr(builder, "prefill_builder", lambda: delegate)
    cm = batch([1, 1, 1, 5, 3], [7, 20, 33, 12, 3], 40, 16, rng)
    m = builder.build(0, cm)
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills, m.num_prefill_tokens) == \
        (3, 3, 2, 8)
    seq_lens, table = m.decode_tables()
    assert seq_lens.tolist() == [7, 20, 33] and seq_lens.dtype == torch.int32
    assert torch.equal(table, cm.block_table_tensor[:3])
    assert seq_lens.data_ptr() == cm.seq_lens.data_ptr()         # vLLM's buffers, in place
    assert table.data_ptr() == cm.block_table_tensor.data_ptr()
    (rest,) = delegate.calls                                      # the other rows, rebased
    assert rest.num_reqs == 2 and rest.num_actual_tokens == 8
    assert rest.query_start_loc_cpu.tolist() == [0, 5, 8]
    assert rest.query_start_loc.tolist() == [0, 5, 8]
    assert rest.seq_lens.tolist() == [12, 3]
    assert torch.equal(rest.block_table_tensor, cm.block_table_tensor[3:])
    assert torch.equal(rest.slot_mapping, cm.slot_mapping[3:])
    assert m.prefill == ("flash-attention metadata", 2)
    decode_only = builder.build(0, batch([1, 1], [5, 9], 40, 16, rng))
    assert (decode_only.num_decodes, decode_only.num_prefills, decode_only.prefill) == \
        (2, 0, None)
    assert len(delegate.calls) == 1                               # not asked for decodes
    prefill_only = builder.build(0, batch([4, 2], [4, 9], 40, 16, rng))
    assert (prefill_only.num_decodes, prefill_only.num_prefills) == (0, 2)


# --------------------------------------------------------------------------- forward
def float64_decode(q, k_pages, v_pages, seq_lens, table, scale, window=None, soft_cap=None,
                   sinks=None):
    """Decode attention in float64, written from the definitions: request r's query attends
    to its last positions (all, or the last ``window``), through its blocks."""
    rows, heads, dim = q.shape
    group = heads // k_pages.shape[2]
    block = k_pages.shape[1]
    out = np.zeros((rows, heads, dim))
    for r in range(rows):
        n = int(seq_lens[r])
        positions = np.arange(0 if window is None else max(0, n - window), n)
        pages, offsets = table[r, positions // block], positions % block
        for h in range(heads):
            k = k_pages[pages, offsets, h // group]
            v = v_pages[pages, offsets, h // group]
            s = k @ q[r, h] * scale
            if soft_cap:
                s = soft_cap * np.tanh(s / soft_cap)
            top = s.max() if sinks is None else max(s.max(), sinks[h])
            p = np.exp(s - top)
            den = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[r, h] = p @ v / den
    return out


def filled_cache(spec, num_blocks, layout, rng, fp8=False):
    cache = vllm_kv_cache(spec, num_blocks, layout)[0]
    if fp8:      # codes of values in [-2, 2] (no NaN codes)
        values = torch.from_numpy(rng.uniform(-2, 2, cache.shape)).to(torch.float8_e4m3fn)
        cache.copy_(values.view(torch.uint8))
    else:
        cache.copy_(torch.from_numpy(rng.standard_normal(cache.shape)).to(cache.dtype))
    return cache


def as_float64(pages: torch.Tensor, fp8: bool) -> np.ndarray:
    if fp8:
        pages = pages.view(torch.float8_e4m3fn)
    return pages.to(torch.float64).numpy()


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC])
@pytest.mark.parametrize("variant", [
    {},
    {"sliding_window": 9, "logits_soft_cap": 3.0},
    {"sinks": True},
    {"kv_cache_dtype": "fp8", "k_scale": 0.5, "v_scale": 1.5},
])
def test_decode_rows_match_float64(layout, variant, monkeypatch):
    rng = np.random.default_rng(1)
    variant = dict(variant)
    fp8 = variant.get("kv_cache_dtype") == "fp8"
    heads, kv_heads, dim, block = 8, 2, 64, 16
    spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=dim,
                             dtype=torch.uint8 if fp8 else torch.float16)
    builder = B.SplitKVMetadataBuilder(spec, ["l0", "l1"], vllm_config(), torch.device("cpu"))
    delegate = Recorder()
    monkeypatch.setattr(builder, "prefill_builder", lambda: delegate)
    sinks = torch.from_numpy(rng.standard_normal(heads)).float() if variant.pop("sinks", 0) \
        else None
    layer = Layer(variant.pop("k_scale", 1.0), variant.pop("v_scale", 1.0))
    scale = dim ** -0.5
    impl = B.SplitKVImpl(heads, dim, scale, kv_heads, None, variant.get("sliding_window"),
                         variant.get("kv_cache_dtype", "auto"),
                         variant.get("logits_soft_cap"), sinks=sinks)
    cache = filled_cache(spec, 40, layout, rng, fp8)
    cm = batch([1, 1, 1, 1], [1, 17, 40, 64], 40, block, rng)
    key = torch.from_numpy(rng.standard_normal((4, kv_heads, dim))).half()
    value = torch.from_numpy(rng.standard_normal((4, kv_heads, dim))).half()
    impl.do_kv_cache_update(layer, key, value, cache, cm.slot_mapping)
    m = builder.build(0, cm)
    q = torch.from_numpy(rng.standard_normal((4, heads, dim))).half()
    out = torch.full((4, heads, dim), float("nan"), dtype=torch.float16)
    assert impl.forward(layer, q, key, value, cache, m, out) is out
    k_pages, v_pages = (as_float64(t, fp8) for t in B.kv_views(cache, dim))
    k_pages, v_pages = k_pages * float(layer._k_scale), v_pages * float(layer._v_scale)
    want = float64_decode(q.double().numpy(), k_pages, v_pages, cm.seq_lens.numpy(),
                          cm.block_table_tensor.numpy(), scale, variant.get("sliding_window"),
                          variant.get("logits_soft_cap"),
                          None if sinks is None else sinks.double().numpy())
    np.testing.assert_allclose(out.double().numpy(), want, atol=2e-3, rtol=2e-3)
    # the new token is in the cache where the row reads it (its last position)
    last = cm.seq_lens[2] - 1
    page, offset = cm.block_table_tensor[2, last // block], last % block
    stored = as_float64(B.kv_views(cache, dim)[0][page, offset], fp8) * float(layer._k_scale)
    np.testing.assert_allclose(stored, key[2].double().numpy(), rtol=0.07 if fp8 else 1e-3,
                               atol=0.02 if fp8 else 1e-3)
    assert delegate.calls == []                                   # decodes only: no delegate
    # a second layer of the same configuration reuses the step's plan
    session = torch_ops.get_session(next(iter(m.sessions.handles.values())))
    plans = session.plans
    impl.forward(layer, q, key, value, cache, m, torch.empty_like(out))
    assert session.plans == plans == 1


def test_prefill_and_mixed_rows_reach_flash_attention(monkeypatch):
    rng = np.random.default_rng(2)
    heads, kv_heads, dim, block = 4, 1, 128, 16
    builder, spec = make_builder(block, kv_heads, dim, torch.bfloat16)
    metadata_delegate = Recorder()
    monkeypatch.setattr(builder, "prefill_builder", lambda: metadata_delegate)
    impl = B.SplitKVImpl(heads, dim, 0.1, kv_heads, None, None, "auto")
    forward_delegate = Recorder(fill=7.0)
    monkeypatch.setattr(impl, "prefill_impl", lambda: forward_delegate)
    cache = filled_cache(spec, 20, KVCacheLayout.LBNHC, rng)
    cm = batch([1, 1, 6, 2], [30, 9, 6, 18], 20, block, rng)
    m = builder.build(0, cm)
    q = torch.from_numpy(rng.standard_normal((10, heads, dim))).bfloat16()
    key = torch.zeros(10, kv_heads, dim, dtype=torch.bfloat16)
    out = torch.zeros(10, heads, dim, dtype=torch.bfloat16)
    impl.forward(Layer(), q, key, key, cache, m, out)
    ((fq, fk, fv, fmeta, fout),) = forward_delegate.calls
    assert fmeta is m.prefill and fmeta == ("flash-attention metadata", 2)
    assert torch.equal(fq, q[2:10]) and fq.data_ptr() == q[2:].data_ptr()
    assert fout.data_ptr() == out[2:].data_ptr()                   # written in place
    assert bool((out[2:] == 7).all())
    k_pages, v_pages = (t.double().numpy() for t in B.kv_views(cache, dim))
    want = float64_decode(q[:2].double().numpy(), k_pages, v_pages, cm.seq_lens.numpy()[:2],
                          cm.block_table_tensor.numpy()[:2], 0.1)
    np.testing.assert_allclose(out[:2].double().numpy(), want, atol=2e-2, rtol=2e-2)
    # a prefill-only step: FlashAttention only
    forward_delegate.calls.clear()
    m = builder.build(0, batch([3, 5], [3, 5], 20, block, rng))
    out = torch.zeros(8, heads, dim, dtype=torch.bfloat16)
    impl.forward(Layer(), q[:8], key[:8], key[:8], cache, m, out)
    assert len(forward_delegate.calls) == 1 and bool((out == 7).all())


def test_the_delegate_is_vllms_flash_attention(monkeypatch):
    """Without a stand-in, the builder and the layer reach vLLM's own FlashAttention classes
    (made with the layer's arguments), whatever they then do on this machine."""
    from vllm.v1.attention.backends import flash_attn

    made = {}

    class Impl:
        def __init__(self, *args, **kwargs):
            made["impl"] = (args, kwargs)

    class Builder:
        def __init__(self, *args):
            made["builder"] = args

    monkeypatch.setattr(flash_attn, "FlashAttentionImpl", Impl)
    monkeypatch.setattr(flash_attn, "FlashAttentionMetadataBuilder", Builder)
    sinks = torch.zeros(8)
    impl = B.SplitKVImpl(8, 128, 0.1, 2, None, 4096, "fp8", 30.0, sinks=sinks)
    assert isinstance(impl.prefill_impl(), Impl)
    args, kwargs = made["impl"]
    assert args == (8, 128, 0.1, 2, None, 4096, "fp8", 30.0, AttentionType.DECODER, None)
    assert kwargs["sinks"] is sinks
    assert impl.window_left == 4095 and impl.kv_dtype == "fp8_e4m3"
    builder, spec = make_builder()
    assert isinstance(builder.prefill_builder(), Builder)
    assert made["builder"][0] is spec and made["builder"][1] == ["model.layers.0.attn"]


def test_the_profiling_run_writes_zeros():
    impl = B.SplitKVImpl(4, 64, 0.1, 1, None, None, "auto")
    out = torch.ones(3, 4, 64)
    assert bool((impl.forward(Layer(), out, None, None, None, None, out) == 0).all())
