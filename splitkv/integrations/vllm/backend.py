"""The three classes vLLM (v1, 0.33) asks an attention backend for, and its metadata.

- :class:`SplitKVBackend`: what the backend takes (head sizes, dtypes, KV cache dtypes, block
  sizes, layouts, sinks, windows) and refuses, by name, through ``validate_configuration``.
- :class:`SplitKVMetadataBuilder`: once per step and KV cache group, on the host: reorders the
  batch decode-first (query length 1) and keeps vLLM's device ``seq_lens`` and
  ``block_table_tensor``; the rows after the decodes get vLLM's own FlashAttention metadata.
- :class:`SplitKVImpl`, per layer: ``do_kv_cache_update`` writes the new K/V with vLLM's own
  ``reshape_and_cache_flash`` (plain indexing on CPU tensors); ``forward`` runs the decode rows
  through ``torch.ops.splitkv.paged_decode`` (a graph-stable wrapper that plans on the device,
  in the first layer of each configuration a step) and the other rows through vLLM's
  ``FlashAttentionImpl``: splitkv does not prefill.

CUDA graphs: the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE``, so vLLM captures full graphs
of the decode-only batches; the builder runs outside them, which is why the planning is inside
the forward (a captured ``plan_on_device`` replays on the new lengths and table in place).

The KV cache is what vLLM allocates for FlashAttention: per layer a logical ``[blocks,
kv_heads, block_size, 2 * head_size]`` view (K then V along the last axis) whose strides follow
the resolved ``KVCacheLayout``; splitkv reads its K and V halves in place as strided NHD pages.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                       AttentionMetadata, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata, MultipleOf)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_layout import KVCacheLayout

from splitkv.core.validation import FP8_HEAD_DIMS, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from splitkv.core.variants import check_alibi_slopes

from .. import torch_ops
from . import NAME

#: KV cache dtypes: the model's own, or fp8 e4m3 (the fp8 vLLM's FlashAttention, which runs
#: the prefill rows, takes; splitkv's kernels read e5m2 as well)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
#: vLLM's fp8 cache names -> splitkv's kv_dtype
FP8_KV_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
#: K/V pages splitkv reads in place: every layout where a block's heads and tokens lie within
#: the block (not LHBNC, whose head stride spans all the blocks of a layer)
KV_LAYOUTS = (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC,
              KVCacheLayout.BLHNC, KVCacheLayout.BHLNC)
BLOCK_MULTIPLE = 16      # FlashAttention's, for the prefill rows on the same cache


def _flash_attention():
    """vLLM's FlashAttention backend module (imported on use: it needs a GPU to run)."""
    from vllm.v1.attention.backends import flash_attn

    return flash_attn


def _fp8_at_head_size(kv_cache_dtype, head_size) -> str | None:
    """Why an fp8 cache cannot run at ``head_size`` (splitkv's fp8 builds' head dims), or None."""
    if kv_cache_dtype in FP8_KV_DTYPES and head_size not in FP8_HEAD_DIMS:
        return (f"kv_cache_dtype: {kv_cache_dtype} at head_size {head_size}; splitkv's fp8 K/V "
                f"runs at head_size {FP8_HEAD_DIMS}")
    return None


class SplitKVBackend(AttentionBackend):
    """splitkv's decode, FlashAttention's prefill, on FlashAttention's KV cache."""

    supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(KV_CACHE_DTYPES)
    # the cache is written before forward(), by do_kv_cache_update (vLLM calls it)
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type["SplitKVImpl"]:
        return SplitKVImpl

    @staticmethod
    def get_builder_cls() -> type["SplitKVMetadataBuilder"]:
        return SplitKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return KV_LAYOUTS

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) >= (8, 0)

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):
        if kv_cache_dtype in ("float16", "bfloat16") and \
                getattr(torch, kv_cache_dtype) != dtype:
            return (f"kv_cache_dtype: {kv_cache_dtype} with a {dtype} model; splitkv reads K/V "
                    f"in the model's dtype or fp8 (expected 'auto')")
        if (why := _fp8_at_head_size(kv_cache_dtype, head_size)) is not None:
            return why
        if has_sink and (device_capability.major, device_capability.minor) < (9, 0):
            return ("sinks: the prefill rows run vLLM's FlashAttention, whose sinks need "
                    "compute capability 9.0 or newer")
        return None

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                               has_sink, use_sparse, use_mm_prefix, use_per_head_quant_scales,
                               device_capability, attn_type, **more) -> list[str]:
        """vLLM's checks (``AttentionBackend.validate_configuration``), with splitkv's refusals
        named: each reason says the argument and what splitkv expects."""
        named = []
        if head_size not in SUPPORTED_HEAD_DIMS:
            named.append(f"head_size: {head_size} is not supported; expected one of "
                         f"{SUPPORTED_HEAD_DIMS}")
        if dtype not in cls.supported_dtypes:
            named.append(f"dtype: {dtype} is not supported; expected one of "
                         f"{SUPPORTED_DTYPES}")
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
            why = (" (vLLM's FlashAttention, which runs the prefill rows, does not take it)"
                   if kv_cache_dtype == "fp8_e5m2" else "")
            named.append(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported{why}; expected "
                         f"one of {KV_CACHE_DTYPES}")
        if block_size is not None and block_size % BLOCK_MULTIPLE:
            named.append(f"block_size: {block_size} is not supported; expected a multiple of "
                         f"{BLOCK_MULTIPLE}")
        if use_mla:
            named.append("use_mla: MLA is not supported (splitkv decodes standard multi-head, "
                         "grouped-query and multi-query attention)")
        if attn_type != AttentionType.DECODER:
            named.append(f"attn_type: {attn_type} is not supported; expected decoder (no "
                         f"encoder, encoder-only or cross attention)")
        generic = {"head_size not supported", "dtype not supported",
                   "kv_cache_dtype not supported", "block_size not supported",
                   "MLA not supported", f"attention type {attn_type} not supported"}
        rest = super().validate_configuration(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            block_size=block_size, use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse,
            use_mm_prefix=use_mm_prefix, use_per_head_quant_scales=use_per_head_quant_scales,
            device_capability=device_capability, attn_type=attn_type, **more)
        return named + [reason for reason in rest if reason not in generic]


# --------------------------------------------------------------------------- metadata
class SessionPool:
    """The decode sessions (``torch_ops.DecodeSession``) of one KV cache group: one per layer
    configuration (heads, scale, window, soft cap, ALiBi slopes, dtype), each a graph-stable wrapper of
    ``capacity`` rows that serves every batch size vLLM captures."""

    def __init__(self, capacity: int, page_size: int):
        self.capacity, self.page_size = capacity, page_size
        self.handles: dict[tuple, int] = {}
        weakref.finalize(self, SessionPool._close, self.handles)

    def handle(self, impl: "SplitKVImpl", width: int, dtype) -> int:
        key = (impl.num_heads, impl.num_kv_heads, impl.head_size, dtype, impl.scale,
               impl.logits_soft_cap, impl.window_left, impl.kv_dtype, impl.alibi_slopes, width)
        if key not in self.handles:
            self.handles[key] = torch_ops.new_session(
                num_qo_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=impl.head_size, page_size=self.page_size, dtype=dtype,
                layout="block_table", capacity=self.capacity, width=width,
                sm_scale=impl.scale, logits_soft_cap=impl.logits_soft_cap,
                window_left=impl.window_left, kv_dtype=impl.kv_dtype,
                alibi_slopes=impl.alibi_slopes)
        return self.handles[key]

    @staticmethod
    def _close(handles: dict) -> None:
        for handle in handles.values():
            torch_ops.close_session(handle)


@dataclass
class SplitKVMetadata(AttentionMetadata):
    """One step of one KV cache group. The first ``num_decodes`` requests (one query token
    each) are splitkv's; the rest, ``prefill`` (vLLM's FlashAttention metadata of those rows),
    FlashAttention's."""

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    seq_lens: torch.Tensor          # int32 [num_reqs], device: tokens of each request
    block_table: torch.Tensor       # int32 [num_reqs, width], device: its blocks
    slot_mapping: torch.Tensor
    sessions: SessionPool
    prefill: object | None = None
    planned: set = field(default_factory=set)    # sessions planned in this step

    def decode_tables(self) -> list:
        """splitkv's plan inputs, views of vLLM's own buffers (stable under graphs)."""
        return [self.seq_lens[:self.num_decodes], self.block_table[:self.num_decodes]]


def rows_after(cm: CommonAttentionMetadata, first_req: int, first_token: int
               ) -> CommonAttentionMetadata:
    """The batch description of requests ``first_req..`` (tokens ``first_token..``), for the
    delegate's builder: vLLM's tensors sliced, the query offsets rebased to 0."""
    def cut(value):
        return None if value is None else value[first_req:]

    num_reqs = cm.num_reqs - first_req
    causal = cm.causal[first_req:] if isinstance(cm.causal, torch.Tensor) else cm.causal
    return CommonAttentionMetadata(
        query_start_loc=cm.query_start_loc[first_req:cm.num_reqs + 1] - first_token,
        query_start_loc_cpu=cm.query_start_loc_cpu[first_req:cm.num_reqs + 1] - first_token,
        seq_lens=cm.seq_lens[first_req:cm.num_reqs], num_reqs=num_reqs,
        num_actual_tokens=cm.num_actual_tokens - first_token,
        max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
        block_table_tensor=cm.block_table_tensor[first_req:cm.num_reqs],
        slot_mapping=cm.slot_mapping[first_token:], causal=causal,
        seq_lens_cpu_upper_bound=cut(cm.seq_lens_cpu_upper_bound),
        is_prefilling=cut(cm.is_prefilling), req_idx=cut(cm.req_idx),
        positions=None if cm.positions is None else cm.positions[first_token:])


class SplitKVMetadataBuilder(AttentionMetadataBuilder[SplitKVMetadata]):
    """Decode-first batches: splitkv's rows are the leading one-token requests."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # one query token is a decode (no speculative rows: the session plans one row each)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)
        capture = vllm_config.compilation_config.max_cudagraph_capture_size or 0
        capacity = max(vllm_config.scheduler_config.max_num_seqs, capture, 1)
        self.sessions = SessionPool(capacity, kv_cache_spec.block_size)
        self._prefill_builder = None
        self._warm = False

    def prefill_builder(self):
        """vLLM's FlashAttention metadata builder for the same group (made on first use)."""
        if self._prefill_builder is None:
            self._prefill_builder = _flash_attention().FlashAttentionMetadataBuilder(
                self.kv_cache_spec, self.layer_names, self.vllm_config, self.device)
        return self._prefill_builder

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SplitKVMetadata:
        cm = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = \
            split_decodes_and_prefills(cm, decode_threshold=1)
        if num_decodes and not self._warm:
            self._warm_sessions(cm, num_decodes)
        prefill = None
        if num_prefills:
            prefill = self.prefill_builder().build(
                0, rows_after(cm, num_decodes, num_decode_tokens), fast_build)
        return SplitKVMetadata(
            num_actual_tokens=cm.num_actual_tokens, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens, num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens, seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
            sessions=self.sessions, prefill=prefill)


    def _warm_sessions(self, cm: CommonAttentionMetadata, num_decodes: int) -> None:
        """Plan every layer's session once here, outside any graph: a session's first plan on
        the GPU allocates its buffers, which a capture must not do (vLLM 0.33 captures with no
        warm-up run by default, and the builder runs before the captured forward)."""
        if not cm.seq_lens.is_cuda or torch.cuda.is_current_stream_capturing():
            return
        layers = self.vllm_config.compilation_config.static_forward_context
        tables = [cm.seq_lens[:num_decodes], cm.block_table_tensor[:num_decodes]]
        dtype = self.vllm_config.model_config.dtype
        for name in self.layer_names:
            impl = getattr(layers.get(name), "impl", None)
            if isinstance(impl, SplitKVImpl):
                handle = self.sessions.handle(impl, tables[1].shape[1], dtype)
                torch_ops.get_session(handle).plan(tables, num_decodes)
        self._warm = True


# --------------------------------------------------------------------------- the layer
def kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a layer's ``[blocks, kv_heads, block_size, 2 * head_size]`` cache, each
    ``[blocks, block_size, kv_heads, head_size]`` (NHD pages, strided, in place)."""
    pages = kv_cache.transpose(1, 2)
    return pages[..., :head_size], pages[..., head_size:]


class SplitKVImpl(AttentionImpl[SplitKVMetadata]):
    """One attention layer: splitkv for its decode rows, vLLM's FlashAttentionImpl (built
    with the same arguments) for the others."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"attn_type: {attn_type} is not supported by splitkv "
                                      f"(expected decoder)")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise NotImplementedError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported "
                                      f"by splitkv (expected one of {KV_CACHE_DTYPES})")
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window: expected None or a positive int, got "
                             f"{sliding_window!r}")
        # ALiBi (vLLM's alibi_slopes: a list of floats, one a query head): kept as a tuple,
        # which also keys the layer's session
        if isinstance(alibi_slopes, torch.Tensor):
            alibi_slopes = alibi_slopes.detach().to("cpu", torch.float64).tolist()
        checked = check_alibi_slopes(num_heads, alibi_slopes)
        self.alibi_slopes = None if checked is None else tuple(checked.tolist())
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = FP8_KV_DTYPES.get(kv_cache_dtype)
        if (why := _fp8_at_head_size(kv_cache_dtype, head_size)) is not None:
            raise ValueError(why)
        # vLLM's window counts the query: it sees itself and the sliding_window - 1 before,
        # which is splitkv's window_left
        self.sliding_window = sliding_window
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.sinks = sinks
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self._delegate_args = (num_heads, head_size, scale, num_kv_heads,
                               None if self.alibi_slopes is None else list(self.alibi_slopes),
                               sliding_window,
                               kv_cache_dtype, logits_soft_cap, attn_type,
                               kv_sharing_target_layer_name)
        self._prefill_impl = None

    def prefill_impl(self):
        """vLLM's FlashAttentionImpl of this layer (made on first use)."""
        if self._prefill_impl is None:
            self._prefill_impl = _flash_attention().FlashAttentionImpl(
                *self._delegate_args, sinks=self.sinks)
        return self._prefill_impl

    def get_impl_variants(self) -> tuple:
        # FlashAttention's builder reads its impls' windows through this
        return (self,) if self._prefill_impl is None else (self, self._prefill_impl)

    # ----------------------------------------------------------------- the cache write
    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write the step's K/V at ``slot_mapping`` (block * block_size + offset; -1: none)."""
        k_cache, v_cache = kv_views(kv_cache, self.head_size)
        if kv_cache.is_cuda:
            from vllm import _custom_ops as ops

            ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping,
                                        self.kv_cache_dtype, layer._k_scale, layer._v_scale)
            return
        n = slot_mapping.shape[0]          # key and value may be padded past it
        slots = slot_mapping.to(torch.int64)
        keep = slots >= 0
        block, offset = slots[keep] // k_cache.shape[1], slots[keep] % k_cache.shape[1]
        for cache, new, scale in ((k_cache, key, layer._k_scale),
                                  (v_cache, value, layer._v_scale)):
            new = new[:n][keep]
            if self.kv_dtype is not None:
                new = _fp8_codes(new, scale)
            cache[block, offset] = new.to(cache.dtype)

    # ----------------------------------------------------------------- attention
    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: SplitKVMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [tokens, num_heads, head_size]; output [tokens, num_heads, head_size],
        written in place and returned."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("output_scale: fused output quantization is not "
                                      "supported by splitkv (expected None)")
        if attn_metadata is None:        # vLLM's profiling run
            return output.fill_(0)
        m = attn_metadata
        if m.num_decode_tokens:
            rows = m.num_decode_tokens
            out = self._decode(layer, query[:rows], kv_cache, m)
            output[:rows].copy_(out)
        if m.num_prefills:
            first, last = m.num_decode_tokens, m.num_actual_tokens
            self.prefill_impl().forward(
                layer, query[first:last], None if key is None else key[first:last],
                None if value is None else value[first:last], kv_cache, m.prefill,
                output[first:last])
        return output

    def _decode(self, layer, q: torch.Tensor, kv_cache: torch.Tensor, m: SplitKVMetadata):
        handle = m.sessions.handle(self, m.block_table.shape[1], q.dtype)
        plan = handle not in m.planned      # the first layer of this configuration plans
        m.planned.add(handle)
        k_cache, v_cache = kv_views(kv_cache, self.head_size)
        scales = (None, None) if self.kv_dtype is None else (layer._k_scale, layer._v_scale)
        return torch.ops.splitkv.paged_decode(q, k_cache, v_cache, m.decode_tables(),
                                              self.sinks, handle, plan, *scales)


def _fp8_codes(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) of values / scale, clamped to the format's range (CPU cache write)."""
    fp8 = torch.float8_e4m3fn
    limit = torch.finfo(fp8).max
    scaled = (values.float() / scale.float()).clamp(-limit, limit)
    return scaled.to(fp8).view(torch.uint8)
