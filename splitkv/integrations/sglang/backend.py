"""SGLang's decode attention through splitkv: :class:`SplitKVAttnBackend`.

SGLang's KV pool is token-addressed (``req_to_token[request slot, position]`` is a token's row in
the per-layer buffers ``[rows, num_kv_heads, head_dim]``), whatever its ``--page-size``: so a
batch is FlashInfer's layout with one-token pages (splitkv's ``"indptr"`` layout),
``kv_indptr = [0, cumsum(seq_lens)]`` and ``kv_indices`` each request's rows in order, built on
the device from ``req_to_token``. Each layer writes its new K/V with the pool's own
``set_kv_buffer``, then calls ``torch.ops.splitkv.paged_decode`` (``splitkv.integrations.
torch_ops``), which plans on the device in the first layer of each kind (so a CUDA graph captures
the plan with the forward) and reads the pool's buffers in place.

CUDA graphs (SGLang 0.5.23's hooks): ``init_cuda_graph_state`` allocates the persistent tables;
``init_forward_metadata_out_graph`` (host, before capture and before each replay) points the
metadata at views of them for the batch size; ``init_forward_metadata_in_graph`` (captured)
fills them from ``req_to_token`` with ops of fixed shape.

Prefill (extend) is not splitkv's: run SGLang with ``--prefill-attention-backend`` set to another
backend; as the only backend, splitkv refuses at construction and at any extend batch.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from splitkv.core.validation import FP8_HEAD_DIMS, SUPPORTED_HEAD_DIMS
from splitkv.integrations import torch_ops

from . import NAME

DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: torch_ops' sessions take fp8 caches where they have ``kv_dtype``
SESSIONS_TAKE_FP8 = "kv_dtype" in inspect.signature(torch_ops.DecodeSession.__init__).parameters
PREFILL_HINT = ("splitkv runs decode batches only; pass a prefill backend as well, e.g. "
                "--decode-attention-backend splitkv --prefill-attention-backend fa3 (or "
                "flashinfer, triton)")


# --------------------------------------------------------------------------- configuration
def check_runner(model_runner) -> dict:
    """What the model runner asks of the backend, refused by name where splitkv does not run
    it; returns the settings the backend keeps (dtype, kv_dtype, context_len)."""
    if getattr(model_runner, "use_mla_backend", False):
        raise ValueError("model: MLA attention is not supported by splitkv (use_mla_backend); "
                         "expected a model with multi-head or grouped-query attention")
    config = model_runner.model_config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("model: encoder-decoder models (cross attention) are not supported by "
                         "splitkv; expected a decoder-only model")
    head_dim = getattr(config, "head_dim", None)
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: {head_dim!r} is not supported by splitkv; expected one of "
                         f"{SUPPORTED_HEAD_DIMS}")
    if model_runner.dtype not in DTYPES:
        raise TypeError(f"dtype: {model_runner.dtype} is not supported by splitkv; expected "
                        f"torch.float16 or torch.bfloat16")
    kv = model_runner.kv_cache_dtype
    if kv in FP8_DTYPES:
        if not SESSIONS_TAKE_FP8:
            raise ValueError(f"kv_cache_dtype: {kv} (fp8) is not supported by this splitkv "
                             f"install; expected the model's dtype ({model_runner.dtype})")
        if head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"kv_cache_dtype: {kv} (fp8) at head_dim {head_dim} is not "
                             f"supported by splitkv; expected head_dim one of {FP8_HEAD_DIMS} "
                             f"with fp8, or the model's dtype ({model_runner.dtype})")
        kv_dtype = kv
    elif kv == model_runner.dtype:
        kv_dtype = None
    else:
        raise ValueError(f"kv_cache_dtype: {kv} is not supported by splitkv; expected the "
                         f"model's dtype ({model_runner.dtype}), torch.float8_e4m3fn or "
                         f"torch.float8_e5m2")
    pool = model_runner.token_to_kv_pool
    layout = "hnd" if getattr(pool, "use_hnd", False) else getattr(pool, "kv_cache_layout", None)
    if layout not in (None, "nhd"):
        raise ValueError(f"token_to_kv_pool: the {layout!r} KV layout is not supported by "
                         f"splitkv; expected the token-major 'nhd' pool")
    if type(pool).__name__ in ("SWAKVPool", "HybridSWAKVPool") or hasattr(pool, "swa_kv_pool"):
        raise ValueError(f"token_to_kv_pool: {type(pool).__name__} (a separate sliding-window "
                         f"pool) is not supported by splitkv; expected one pool for all layers "
                         f"(splitkv applies sliding windows itself)")
    prefill = getattr(model_runner, "prefill_attention_backend_str", None)
    if prefill == NAME:
        raise ValueError(f"prefill_attention_backend: {NAME!r}: {PREFILL_HINT}")
    return {"dtype": model_runner.dtype, "kv_dtype": kv_dtype,
            "context_len": int(config.context_len)}


@dataclass(frozen=True)
class LayerSpec:
    """One kind of layer: a decode session serves every layer with the same spec."""
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sm_scale: float
    logits_soft_cap: float | None
    window_left: int


def layer_spec(layer, q_dtype) -> LayerSpec:
    """``layer`` (a RadixAttention) as splitkv's decode options, refused by name where splitkv
    does not run it. ``sliding_window_size`` is already exclusive (the tokens before the query
    it sees), which is splitkv's ``window_left``; -1 or None: no window."""
    head_dim, v_head_dim = layer.qk_head_dim, layer.v_head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS or v_head_dim != head_dim:
        raise ValueError(f"layer {layer.layer_id}: head_dim {head_dim} / v_head_dim {v_head_dim} "
                         f"is not supported by splitkv; expected equal head dims, one of "
                         f"{SUPPORTED_HEAD_DIMS}")
    if layer.is_cross_attention or getattr(layer.attn_type, "value", layer.attn_type) != "decoder":
        raise ValueError(f"layer {layer.layer_id}: attn_type {layer.attn_type} (cross attention: "
                         f"{layer.is_cross_attention}) is not supported by splitkv; expected "
                         f"causal decoder self-attention")
    if q_dtype not in DTYPES:
        raise TypeError(f"q: dtype {q_dtype} is not supported by splitkv; expected torch.float16 "
                        f"or torch.bfloat16")
    for name, bad in (("use_irope", bool(getattr(layer, "use_irope", False))),
                      ("pos_encoding_mode", getattr(layer, "pos_encoding_mode", "NONE") != "NONE"),
                      ("xai_temperature_len", getattr(layer, "xai_temperature_len", -1) > 0)):
        if bad:
            raise ValueError(f"layer {layer.layer_id}: {name}={getattr(layer, name)!r} is not "
                             f"supported by splitkv; expected its default")
    cap = float(layer.logit_cap or 0.0)
    if not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"layer {layer.layer_id}: logit_cap: expected a finite number >= 0, "
                         f"got {layer.logit_cap!r}")
    if cap and getattr(layer, "logit_capping_method", "tanh") != "tanh":
        raise ValueError(f"layer {layer.layer_id}: logit_capping_method "
                         f"{layer.logit_capping_method!r} is not supported; expected 'tanh'")
    window = layer.sliding_window_size
    window_left = -1 if window is None or window < 0 else int(window)
    return LayerSpec(int(layer.tp_q_head_num), int(layer.tp_k_head_num), int(head_dim), q_dtype,
                     float(layer.scaling), cap or None, window_left)


# --------------------------------------------------------------------------- the batch's tables
def fill_kv_tables(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, positions):
    """``kv_indptr[:bs + 1] = [0, cumsum(seq_lens)]`` and ``kv_indices[:total]`` each request's
    token rows in order (from ``req_to_token``), with ops of fixed shape only (capturable): a
    ``[bs, len(positions)]`` gather, scattered to its places; positions past a request's length
    go to the last entry of ``kv_indices``, which is never read (it must be longer than any
    batch's total). ``positions``: ``arange(max length)`` on the device."""
    bs = seq_lens.shape[0]
    lens = seq_lens.to(torch.int64)
    kv_indptr[:1].zero_()
    kv_indptr[1:bs + 1].copy_(torch.cumsum(lens, 0))
    cols = positions[None, :]
    rows = req_to_token[req_pool_indices.to(torch.int64)[:, None],
                        cols.clamp(max=req_to_token.shape[1] - 1)]
    dest = torch.where(cols < lens[:, None], kv_indptr[:bs, None].to(torch.int64) + cols,
                       kv_indices.shape[0] - 1)
    kv_indices.index_put_((dest.reshape(-1),), rows.reshape(-1).to(kv_indices.dtype))
    return kv_indptr[:bs + 1], kv_indices


@dataclass
class DecodeMetadata:
    """A step's plan inputs: ``kv_indptr [bs + 1]``, ``kv_indices`` (rows of one-token pages;
    entries past ``kv_indptr[-1]`` unused) and the session shape they are planned in."""
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    capacity: int
    width: int
    graph: bool


class SplitKVAttnBackend(AttentionBackend):
    """SGLang's ``AttentionBackend`` for decode batches, run by splitkv (module docstring)."""

    def __init__(self, model_runner):
        super().__init__()
        settings = check_runner(model_runner)
        self.dtype, self.kv_dtype = settings["dtype"], settings["kv_dtype"]
        self.data_type = model_runner.kv_cache_dtype
        self.max_context_len = settings["context_len"]
        self.device = torch.device(model_runner.device)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata: DecodeMetadata | None = None
        self.graph_tables: dict[str, torch.Tensor] | None = None
        self.specs: dict[int, LayerSpec] = {}
        self.sessions = torch_ops.LayerSessions()
        self._scales: dict[tuple, torch.Tensor] = {}

    # ----------------------------------------------------------------- eager steps
    def _refuse_mode(self, forward_mode) -> None:
        speculative = forward_mode.is_target_verify() or "DRAFT" in forward_mode.name
        if not speculative and (forward_mode.is_extend() or forward_mode.is_mixed()):
            raise NotImplementedError(f"forward_mode {forward_mode.name}: {PREFILL_HINT}")
        raise NotImplementedError(f"forward_mode {forward_mode.name} is not supported by "
                                  f"splitkv; expected DECODE or IDLE (speculative decoding and "
                                  f"other modes need another decode backend)")

    def _is_decode(self, forward_batch) -> bool:
        """True for a decode batch; False (no metadata) for an idle one; any other mode is
        refused by name."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return False
        if not mode.is_decode():
            self._refuse_mode(mode)
        return True

    def init_forward_metadata(self, forward_batch):
        if not self._is_decode(forward_batch):
            return
        bs = forward_batch.batch_size
        total = forward_batch.seq_lens_sum
        total = int(total) if total is not None else int(forward_batch.seq_lens.sum())
        host = forward_batch.seq_lens_cpu
        longest = int(host.max()) if host is not None and bs else self.max_context_len
        positions = torch.arange(max(longest, 1), device=self.device)
        indptr = torch.empty(bs + 1, dtype=torch.int32, device=self.device)
        indices = torch.empty(total + 1, dtype=torch.int32, device=self.device)
        fill_kv_tables(self.req_to_token, forward_batch.req_pool_indices,
                       forward_batch.seq_lens[:bs], indptr, indices, positions)
        # a session per power-of-two batch and table size, so few exist and each fits
        self.forward_metadata = DecodeMetadata(
            indptr, indices, torch_ops.pow2_capacity(bs, 8),
            torch_ops.pow2_capacity(total + 1, 4096), graph=False)

    # ----------------------------------------------------------------- CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Persistent tables for every captured batch size up to ``max_bs`` (one query token a
        request). ``kv_indices`` holds ``max_bs`` full contexts and one never-read entry."""
        if max_num_tokens != max_bs:
            raise ValueError(f"max_num_tokens: expected {max_bs} (one token a request: splitkv "
                             f"captures plain decode only), got {max_num_tokens}")
        zeros = lambda n: torch.zeros(n, dtype=torch.int32, device=self.device)  # noqa: E731
        self.graph_tables = {
            "kv_indptr": zeros(max_bs + 1),
            "kv_indices": zeros(max_bs * self.max_context_len + 1),
            "positions": torch.arange(self.max_context_len, device=self.device)}
        self.graph_capacity = max_bs

    def get_cuda_graph_seq_len_fill_value(self):
        return 1      # padded rows attend over one token (slot 0's first), never empty rows

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before a capture and before each replay: the metadata views for this batch size."""
        if not self._is_decode(forward_batch):
            return
        if self.graph_tables is None:
            raise RuntimeError("init_cuda_graph_state: expected before the CUDA-graph hooks")
        t, bs = self.graph_tables, forward_batch.batch_size
        self.forward_metadata = DecodeMetadata(t["kv_indptr"][:bs + 1], t["kv_indices"],
                                               self.graph_capacity, t["kv_indices"].shape[0],
                                               graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Captured: fill the persistent tables from ``req_to_token`` (fixed shapes)."""
        if not forward_batch.forward_mode.is_decode():
            return
        t, bs = self.graph_tables, forward_batch.batch_size
        fill_kv_tables(self.req_to_token, forward_batch.req_pool_indices[:bs],
                       forward_batch.seq_lens[:bs], t["kv_indptr"], t["kv_indices"],
                       t["positions"])

    # ----------------------------------------------------------------- the layers
    def _spec(self, layer, q_dtype) -> LayerSpec:
        spec = self.specs.get(layer.layer_id)
        if spec is None or spec.dtype != q_dtype:
            spec = self.specs[layer.layer_id] = layer_spec(layer, q_dtype)
        return spec

    def _session(self, spec: LayerSpec, md: DecodeMetadata, layer_id: int) -> tuple[int, bool]:
        """(the session's handle, whether this layer plans: the first layer that used it plans
        it in every step, so a captured step holds its plan too)."""
        def options():
            made = dict(num_qo_heads=spec.num_qo_heads, num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_dim, page_size=1, dtype=spec.dtype,
                        layout="indptr", capacity=md.capacity, width=md.width,
                        sm_scale=spec.sm_scale, logits_soft_cap=spec.logits_soft_cap,
                        window_left=spec.window_left)
            if self.kv_dtype is not None:
                made["kv_dtype"] = self.kv_dtype
            return made

        return self.sessions.session((spec, md.capacity, md.width, md.graph), layer_id, options)

    def _scale(self, layer, name: str):
        """An fp8 cache's scale as a device tensor (read when the kernel runs), or None (1)."""
        scale = getattr(layer, name, None)
        if isinstance(scale, torch.Tensor):
            return scale
        value = getattr(layer, f"{name}_float", None)
        if value is None:
            return None
        key = (layer.layer_id, name, float(value))
        if key not in self._scales:
            self._scales[key] = torch.tensor([float(value)], device=self.device)
        return self._scales[key]

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       sinks=None, **kwargs):
        """Write the new K/V into SGLang's pool, then decode over it with splitkv. q ``[bs,
        heads * head_dim]``; ``sinks``: [heads] logits (gpt-oss) or None."""
        extra = sorted(name for name, value in kwargs.items() if value is not None)
        if extra:
            raise ValueError(f"forward_decode: {', '.join(extra)} not supported by splitkv; "
                             f"expected none")
        spec = self._spec(layer, q.dtype)
        if k is not None and save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer),
                                                k, v, layer.k_scale, layer.v_scale)
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("forward_decode: no metadata; expected init_forward_metadata "
                               "(or the CUDA-graph hooks) for this batch first")
        handle, plans = self._session(spec, md, layer.layer_id)
        heads, kv_heads, dim = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, 1, kv_heads, dim)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id).view(-1, 1, kv_heads,
                                                                              dim)
        scales = ()
        if self.kv_dtype is not None:
            scales = (self._scale(layer, "k_scale"), self._scale(layer, "v_scale"))
        out = torch.ops.splitkv.paged_decode(q.reshape(-1, heads, dim), k_cache, v_cache,
                                             [md.kv_indptr, md.kv_indices], sinks, handle, plans,
                                             *scales)
        return out.view(-1, heads * dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        raise NotImplementedError(f"forward_extend: {PREFILL_HINT}")

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True):
        raise NotImplementedError(f"forward_mixed: {PREFILL_HINT}")

    def close(self) -> None:
        """Forget the decode sessions (their buffers and wrappers)."""
        self.sessions.close()
