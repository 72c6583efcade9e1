"""Greedy decode of a Llama model whose attention runs over a paged KV cache through splitkv.

Needs PyTorch and transformers; the splitkv backend needs a CUDA GPU (the reference one runs on
the CPU).

    PYTHONPATH=$PWD python3 examples/llama_paged_decode.py                  # GPU, splitkv, eager
    PYTHONPATH=$PWD python3 examples/llama_paged_decode.py --graphs         # one CUDA graph per bucket
    PYTHONPATH=$PWD python3 examples/llama_paged_decode.py --graphs --plan-on-device  # no host planning
    PYTHONPATH=$PWD python3 examples/llama_paged_decode.py --backend reference --device cpu \\
        --dtype float32 --layers 2 --warmup-passes 0          # CPU: exact attention, any dtype

The model is ``transformers``' Llama with random weights (seeded, nothing downloaded). The
example does what a serving engine does around the attention kernel:

- prefill: the model's own forward over each prompt; the K/V it returns (after RoPE) are copied
  into pages of a pool, vLLM-style (``k_cache``/``v_cache`` per layer, ``[num_pages, page_size,
  num_kv_heads, head_dim]``, pages drawn from a shuffled free list);
- decode: one step for the whole ragged batch with the model's own modules (embedding, norms,
  projections, rotary embedding, MLP, head); each layer writes the new token's K/V into its
  request's page slot, then attends over the paged cache through a backend: ``splitkv``
  (``BatchDecodeWrapper``, GPU) or ``reference`` (``splitkv.reference_decode``, float64 NumPy,
  any device). Requests leave the batch when they have their tokens, and their pages return to
  the pool;
- the check: the model decoding by itself with its own cache (``model.generate`` for the
  tokens, and the same loop fed this example's tokens for the logits of every step).

The step is split in a host part (the block table, ``plan()``) and a device part (everything
after ``plan()``), which reads only fixed-size tensors: ``--graphs`` captures the device part
once per batch bucket in a ``torch.cuda.graph`` and replays it at every step (needs splitkv's
graph-stable mode, ``BatchDecodeWrapper(use_cuda_graph=True, max_batch_size=B,
max_num_pages=P)``). With ``--plan-on-device`` the host part only copies the block table and the
sequence lengths into fixed device tensors: the graph itself starts with
``plan_on_device()``, the planning kernel that chooses the plan from those tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np

try:
    import torch
    import transformers  # noqa: F401  (the model below is a transformers Llama)
except ImportError as exc:   # said by main() after the arguments are checked (--help works)
    torch = None
    MISSING_IMPORT = exc

# One tolerance, in logits, per model dtype, for two checks: every decode step's logits must be
# within it of the model's own (max over the vocabulary), and a step whose argmax differs from
# the model's is a near-tie, not a mismatch, when the model's top logit beats its logit for
# this example's token by less than it (for a runner-up pick, the top-2 gap). The logits here
# lie within about +-2, where bfloat16's spacing is 2**-7 = 0.0078 (float16's 2**-10), and
# half the steps have a top-2 gap under 0.03: bfloat16 near-ties are common. Measured on the
# CPU (reference backend, default shape, seeds 0-3): bfloat16 logits within 0.016, 4-10 of 312
# steps near-ties with gaps of 0 to 0.016; float16 within 0.002, no near-tie.
LOGIT_TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
# At most this fraction of the decode steps may be near-ties for a run to pass (3.2% at most
# in the measurements above).
MAX_NEAR_TIE_FRACTION = 0.1


# --------------------------------------------------------------------------- model
def build_model(args):
    """A Llama model with seeded random weights, in ``args.dtype`` on ``args.device``.

    Its eos token is None: every request decodes exactly its ``max_new_tokens``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation=args.model_attn)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).eval()
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


def cache_keyword(model) -> str:
    """The keyword the model's forward takes its cache by: ``cache`` where it has one
    (transformers 5.24 has, and deprecates ``past_key_values``), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output):
    """The cache a forward with ``use_cache=True`` returns, under either name."""
    return output["cache"] if "cache" in output else output["past_key_values"]


# --------------------------------------------------------------------------- requests
@dataclass
class Request:
    """One prompt being decoded. ``num_cached``: tokens whose K/V are in the paged cache;
    ``generated[-1]`` is the next token to feed (its K/V are not cached yet)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    @property
    def max_cached(self) -> int:
        """Tokens it will ever cache: the last generated token is never fed back."""
        return len(self.prompt) + self.max_new_tokens - 1


def make_requests(prompt_lens, max_new_tokens, vocab: int, seed: int) -> list[Request]:
    """Random prompts (seeded) of the given lengths, each with its own number of new tokens."""
    if len(prompt_lens) != len(max_new_tokens):
        raise ValueError(f"--prompt-lens has {len(prompt_lens)} entries, --max-new-tokens "
                         f"{len(max_new_tokens)}")
    rng = np.random.default_rng(seed)
    return [Request(i, rng.integers(0, vocab, n).tolist(), m)
            for i, (n, m) in enumerate(zip(prompt_lens, max_new_tokens))]


def reset(requests: list[Request]) -> None:
    """Forget what a previous pass generated."""
    for r in requests:
        r.generated, r.num_cached = [], 0


# --------------------------------------------------------------------------- paged cache
class PagedKVCache:
    """Per-layer K/V page pools and the pages each request owns.

    ``k[l]``, ``v[l]``: ``[num_pages, page_size, num_kv_heads, head_dim]`` (NHD, splitkv's and
    vLLM's layout), allocated once: a CUDA graph keeps their addresses. A token's flat slot is
    ``page * page_size + offset``. The first ``scratch_pages`` pages of the pool take the K/V
    that padding rows of a bucket write; no request ever owns them.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int,
                 num_kv_heads: int, head_dim: int, dtype, device, scratch_pages: int, seed: int):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_pages, self.page_size, self.scratch_pages = num_pages, page_size, scratch_pages
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        """Every request page free again, in the same shuffled order on every pass."""
        rng = np.random.default_rng(self.seed)
        self.free = (self.scratch_pages + rng.permutation(self.num_pages - self.scratch_pages)).tolist()
        self.pages: dict[int, list[int]] = {}

    def reserve(self, rid: int, num_tokens: int) -> None:
        """Give request ``rid`` pages for ``num_tokens`` tokens (taken from the free list)."""
        pages = self.pages.setdefault(rid, [])
        while len(pages) * self.page_size < num_tokens:
            if not self.free:
                raise RuntimeError("paged KV cache: out of pages")
            pages.append(self.free.pop())

    def release(self, rid: int) -> None:
        """A finished request's pages go back to the pool (reused first)."""
        self.free.extend(reversed(self.pages.pop(rid)))

    def slots(self, rid: int, positions) -> np.ndarray:
        """Flat slots of request ``rid``'s tokens at ``positions``."""
        positions = np.asarray(positions, dtype=np.int64)
        pages = np.asarray(self.pages[rid], dtype=np.int64)
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    def scratch_slot(self, row: int) -> int:
        """Where padding row ``row`` of a bucket writes its K/V: slot ``row`` of the scratch
        pages (distinct per row, so no two rows of one step write the same slot)."""
        if row >= self.scratch_pages * self.page_size:
            raise ValueError(f"row {row}: only {self.scratch_pages} scratch pages")
        return row

    def write(self, layer: int, slots, k, v) -> None:
        """k, v: ``[n, num_kv_heads, head_dim]``, written at flat ``slots`` (a long tensor [n])."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def block_table(self, rids: list[int], rows: int, width: int) -> np.ndarray:
        """vLLM ``block_table`` ``[rows, width]`` int32: row b lists request ``rids[b]``'s pages;
        rows past ``len(rids)`` (bucket padding) and entries past a request's pages hold 0 and
        are never read (their ``seq_lens`` does not reach them)."""
        table = np.zeros((rows, width), dtype=np.int32)
        for b, rid in enumerate(rids):
            table[b, :len(self.pages[rid])] = self.pages[rid]
        return table


def pool_size(requests: list[Request], page_size: int, spare: int, scratch: int) -> int:
    """Pages for every request at its longest, a few spare ones and the scratch pages."""
    need = sum(-(-r.max_cached // page_size) for r in requests)
    return need + spare + scratch


# --------------------------------------------------------------------------- attention backends
class ReferenceAttention:
    """``splitkv.reference_decode``: exact float64 NumPy attention on the host, for any device
    and dtype. Slow (it converts the whole pool per layer), fine for a small model."""

    def __init__(self, page_size: int, num_pages: int):
        self.page_size, self.num_pages = page_size, num_pages

    def plan(self, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        from splitkv import PageTable

        self.page_table = PageTable.from_block_table(block_table, seq_lens, self.page_size,
                                                     num_pages=self.num_pages)

    def __call__(self, q, k_cache, v_cache):
        """q: ``[batch, num_qo_heads, head_dim]``; returns the same shape and dtype."""
        from splitkv import reference_decode

        host = [t.detach().to("cpu", torch.float64).numpy() for t in (q, k_cache, v_cache)]
        out, _ = reference_decode(*host, self.page_table)
        return torch.from_numpy(out).to(device=q.device, dtype=q.dtype)


class SplitKVAttention:
    """splitkv's ``BatchDecodeWrapper`` on the GPU. ``plan()`` once per step (host work and one
    upload on the current stream) serves every layer's ``run()``.

    With ``graphs``, one graph-stable wrapper per batch bucket (``use_cuda_graph=True,
    max_batch_size=bucket, max_num_pages=pool``): its ``plan()`` rewrites the wrapper's persistent device buffers
    and its ``run()`` launches a fixed grid, so a graph captured once replays at every step.
    ``out`` is one buffer for every layer (each layer's o_proj reads it before the next layer's
    run writes it), allocated once so a graph keeps its address.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, num_pages: int, dtype: str, device, max_batch: int, graphs: bool,
                 on_device: bool = False):
        self.shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self.num_pages, self.dtype, self.graphs = num_pages, dtype, graphs
        self.on_device, self.device = on_device, device
        self.batch_tensors: dict[int, tuple] = {}    # per bucket: seq_lens, block_table
        self.out = torch.empty((max_batch, num_qo_heads, head_dim), dtype=getattr(torch, dtype),
                               device=device)
        self.wrappers: dict[int, object] = {}

    def wrapper_for(self, batch: int):
        """The wrapper of this batch size's bucket (one for all sizes without graphs)."""
        from splitkv import BatchDecodeWrapper

        key = batch if self.graphs else 0
        if key not in self.wrappers:
            # capacity: the bucket's rows, and page-table entries for every page of the pool
            options = ({"use_cuda_graph": True, "max_batch_size": batch,
                        "max_num_pages": self.num_pages} if self.graphs else {})
            try:
                self.wrappers[key] = BatchDecodeWrapper(*self.shape, dtype=self.dtype, **options)
            except TypeError as exc:
                if self.graphs:
                    raise RuntimeError("--graphs needs splitkv's graph-stable mode "
                                       f"(BatchDecodeWrapper(use_cuda_graph=True)): {exc}") from exc
                raise
        return self.wrappers[key]

    def plan(self, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """The host part of a step: plan() on the host, or (``on_device``) only the copy of
        the batch into the bucket's fixed tensors that ``begin_step`` plans from."""
        from splitkv import PageTable

        self.active = self.wrapper_for(len(seq_lens))
        if self.on_device:
            key = (len(seq_lens), block_table.shape[1])
            if key not in self.batch_tensors:
                self.batch_tensors[key] = (
                    torch.zeros(len(seq_lens), dtype=torch.int32, device=self.device),
                    torch.zeros(block_table.shape, dtype=torch.int32, device=self.device))
            self.step_tensors = self.batch_tensors[key]
            for tensor, host in zip(self.step_tensors, (seq_lens, block_table)):
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(host, dtype=np.int32)))
            return
        table = PageTable.from_block_table(block_table, seq_lens, self.shape[3],
                                           num_pages=self.num_pages)
        self.active.plan(table, stream=torch.cuda.current_stream())

    def begin_step(self) -> None:
        """The device part's first work (captured with it): the planning kernel, when planning
        on the device."""
        if self.on_device:
            seq_lens, block_table = self.step_tensors
            self.active.plan_on_device(seq_lens=seq_lens, block_table=block_table,
                                       stream=torch.cuda.current_stream())

    def __call__(self, q, k_cache, v_cache):
        """q: contiguous ``[batch, num_qo_heads, head_dim]``; returns a view of ``out``."""
        out = self.out[:q.shape[0]]
        self.active.run(q, k_cache, v_cache, out=out, stream=torch.cuda.current_stream())
        return out


# --------------------------------------------------------------------------- the decode step
def attention_block(layer_idx: int, attn, x, cos, sin, slots, cache: PagedKVCache, attend):
    """The attention half of a decoder layer for one new token per row.

    x: ``[batch, hidden]`` (normed); cos, sin: ``[batch, 1, head_dim]``; slots: long ``[batch]``.
    The new K/V (after RoPE, as the model caches them) go into the cache before the attention,
    so the token attends to itself. Returns o_proj's output ``[batch, hidden]``.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, d = x.shape[0], attn.head_dim
    # [batch, heads, seq=1, head_dim]: the layout apply_rotary_pos_emb broadcasts cos/sin over
    q = attn.q_proj(x).view(batch, -1, 1, d)
    k = attn.k_proj(x).view(batch, -1, 1, d)
    v = attn.v_proj(x).view(batch, -1, d)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    cache.write(layer_idx, slots, k[:, :, 0], v)
    out = attend(q[:, :, 0].contiguous(), cache.k[layer_idx], cache.v[layer_idx])
    return attn.o_proj(out.reshape(batch, -1))


def decoder_layer(layer_idx: int, layer, hidden, cos, sin, slots, cache, attend):
    """One ``LlamaDecoderLayer`` with the paged attention: pre-norm residual blocks."""
    hidden = hidden + attention_block(layer_idx, layer.self_attn,
                                      layer.input_layernorm(hidden), cos, sin, slots, cache, attend)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def decode_forward(model, cache: PagedKVCache, attend, token_ids, positions, slots):
    """The device part of a decode step: every tensor it reads has a fixed size per bucket.

    token_ids, positions, slots: long ``[batch]`` (the token fed, its position, its flat cache
    slot). Returns logits ``[batch, vocab]``.
    """
    getattr(attend, "begin_step", lambda: None)()
    hidden = model.model.embed_tokens(token_ids)
    cos, sin = model.model.rotary_emb(hidden, positions[:, None])
    for i, layer in enumerate(model.model.layers):
        hidden = decoder_layer(i, layer, hidden, cos, sin, slots, cache, attend)
    return model.lm_head(model.model.norm(hidden))


@dataclass
class StepInputs:
    """The host side of one step for a bucket of ``rows`` rows (the live requests first, then
    padding rows that attend to nothing and write their K/V into the scratch page).

    device_inputs: int64 ``[3, rows]``: token ids, positions, flat slots (one copy to the GPU).
    block_table: int32 ``[rows, width]``; seq_lens: int32 ``[rows]``, the new token counted.
    """

    rids: list[int]
    device_inputs: np.ndarray
    block_table: np.ndarray
    seq_lens: np.ndarray


def step_inputs(live: list[Request], cache: PagedKVCache, rows: int, width: int) -> StepInputs:
    """Reserve each live request a slot for the token it feeds now and describe the step."""
    inputs = np.zeros((3, rows), dtype=np.int64)
    seq_lens = np.zeros(rows, dtype=np.int32)
    for b, r in enumerate(live):
        cache.reserve(r.rid, r.num_cached + 1)
        inputs[:, b] = r.generated[-1], r.num_cached, cache.slots(r.rid, [r.num_cached])[0]
        seq_lens[b] = r.num_cached + 1
    for b in range(len(live), rows):
        inputs[2, b] = cache.scratch_slot(b)
    rids = [r.rid for r in live]
    return StepInputs(rids, inputs, cache.block_table(rids, rows, width), seq_lens)


class EagerStep:
    """Runs the device part of a step for one bucket as it comes. ``inputs`` is a fixed tensor
    ``[3, rows]`` that each step's host inputs are copied into (what a graph would read)."""

    def __init__(self, forward, rows: int, device):
        self.forward = forward
        self.inputs = torch.zeros((3, rows), dtype=torch.long, device=device)
        self.captures = 0

    def __call__(self, host_inputs: np.ndarray):
        """Returns logits ``[rows, vocab]``."""
        self.inputs.copy_(torch.from_numpy(host_inputs))
        return self.forward(*self.inputs)


class GraphStep(EagerStep):
    """The device part of a step captured once in a CUDA graph, then replayed.

    The first call runs the step eagerly (a warm-up: kernels compiled, cuBLAS set up), captures
    it on the current stream (the one ``plan()`` ran on), then replays it. The warm-up and the
    replay write the same K/V into the same slots, so running the step twice changes nothing.
    The logits come back in the graph's own output tensor, overwritten by the next replay.
    """

    def __init__(self, forward, rows: int, device):
        super().__init__(forward, rows, device)
        self.graph = None

    def __call__(self, host_inputs: np.ndarray):
        self.inputs.copy_(torch.from_numpy(host_inputs))
        if self.graph is None:
            self.forward(*self.inputs)                  # warm-up
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=torch.cuda.current_stream()):
                self.logits = self.forward(*self.inputs)
            self.captures += 1
        self.graph.replay()
        return self.logits


def bucket_for(batch: int, buckets: list[int] | None) -> int:
    """Rows of the step for ``batch`` live requests: the smallest bucket that holds them, or
    exactly ``batch`` without buckets."""
    if not buckets:
        return batch
    fits = [b for b in buckets if b >= batch]
    if not fits:
        raise ValueError(f"batch of {batch} requests is larger than the largest bucket {max(buckets)}")
    return min(fits)


# --------------------------------------------------------------------------- the decoder
@dataclass
class Generation:
    """What one pass produced: per request its generated tokens (the prefill's first) and the
    logits ``[max_new_tokens - 1, vocab]`` float32 of its decode steps; per step the wall time
    and the live requests."""

    tokens: dict[int, list[int]]
    logits: dict[int, np.ndarray]
    step_seconds: list[float]
    step_batch: list[int]
    captures: int

    @property
    def decode_tokens(self) -> int:
        return int(sum(self.step_batch))


class PagedDecoder:
    """Prefill with the model's own forward, then decode the ragged batch over the paged cache.

    Everything it allocates for the device part (the cache, the step inputs, the graphs) lives
    as long as the decoder, so a second pass replays the first pass's graphs."""

    def __init__(self, model, cache: PagedKVCache, attention, buckets, graphs: bool, device):
        self.model, self.cache, self.attention = model, cache, attention
        self.buckets, self.graphs, self.device = buckets, graphs, device
        self.steps: dict[int, EagerStep] = {}

    def step_for(self, rows: int) -> EagerStep:
        """The device part of a step of ``rows`` rows, made the first time it is needed."""
        if rows not in self.steps:
            kind = GraphStep if self.graphs else EagerStep
            self.steps[rows] = kind(self.forward, rows, self.device)
        return self.steps[rows]

    def forward(self, token_ids, positions, slots):
        return decode_forward(self.model, self.cache, self.attention, token_ids, positions, slots)

    def captures(self) -> int:
        return sum(step.captures for step in self.steps.values())

    def prefill(self, r: Request) -> None:
        """The model's own forward over the prompt; its cached K/V (``[1, kv_heads, len,
        head_dim]``, after RoPE) are copied into the request's pages; its last logits give the
        first generated token."""
        ids = torch.tensor([r.prompt], device=self.device)
        output = self.model(input_ids=ids, use_cache=True)
        self.cache.reserve(r.rid, len(r.prompt))
        slots = torch.from_numpy(self.cache.slots(r.rid, np.arange(len(r.prompt)))).to(self.device)
        for i, layer in enumerate(returned_cache(output).layers):
            self.cache.write(i, slots, layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        r.num_cached = len(r.prompt)
        r.generated = [int(output.logits[0, -1].argmax())]

    def decode_step(self, live: list[Request], width: int):
        """One step for the live requests: host part, then the device part. Returns the next
        token of each and their logits ``[len(live), vocab]`` (float32, a copy: a graph's
        output is overwritten by its next replay)."""
        inputs = step_inputs(live, self.cache, bucket_for(len(live), self.buckets), width)
        self.attention.plan(inputs.block_table, inputs.seq_lens)
        logits = self.step_for(len(inputs.seq_lens))(inputs.device_inputs)[:len(live)]
        return logits.argmax(-1).tolist(), logits.to(torch.float32, copy=True)

    def generate(self, requests: list[Request]) -> Generation:
        """One pass over the requests, from an empty cache."""
        reset(requests)
        self.cache.reset()
        captures_before = self.captures()
        width = max(-(-r.max_cached // self.cache.page_size) for r in requests)
        for r in requests:
            self.prefill(r)
        logits = {r.rid: [] for r in requests}
        times, batch = [], []
        live = [r for r in requests if not r.done]
        while live:
            start = time.perf_counter()
            tokens, step_logits = self.decode_step(live, width)      # .tolist() waits for the GPU
            times.append(time.perf_counter() - start)
            batch.append(len(live))
            for r, token, row in zip(live, tokens, step_logits):
                r.generated.append(token)
                r.num_cached += 1
                logits[r.rid].append(row)
                if r.done:
                    self.cache.release(r.rid)
            live = [r for r in live if not r.done]
        return Generation({r.rid: list(r.generated) for r in requests},
                          {rid: stack_rows(rows) for rid, rows in logits.items()},
                          times, batch, self.captures() - captures_before)


def stack_rows(rows) -> np.ndarray:
    """Per-step logits rows (tensors [vocab]) as one float32 array [steps, vocab]."""
    return torch.stack(rows).cpu().numpy() if rows else np.zeros((0, 0), np.float32)


# --------------------------------------------------------------------------- ground truth
def model_greedy(model, prompt: list[int], max_new_tokens: int, device) -> list[int]:
    """The model's own greedy decode (``generate``, its own attention and cache)."""
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def model_step_logits(model, prompt: list[int], tokens: list[int], device) -> np.ndarray:
    """The logits the model's own decode loop gives at each decode step when fed ``tokens``
    (teacher forcing: every step is judged on this example's prefix, so one flipped near-tie
    does not make the rest incomparable). Returns float32 ``[len(tokens) - 1, vocab]``."""
    keyword = cache_keyword(model)
    output = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    cache, rows = returned_cache(output), []
    for token in tokens[:-1]:
        output = model(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                       **{keyword: cache})
        cache = returned_cache(output)
        rows.append(output.logits[0, -1].float())
    return stack_rows(rows)


@dataclass
class Comparison:
    """Decode steps judged against the model's own logits on the same prefix."""

    equal: int = 0
    near_ties: int = 0
    mismatches: int = 0
    identical_requests: int = 0          # whole sequence equal to model.generate
    max_logit_error: float = 0.0         # max |logit - model's logit| over all steps
    tie_gaps: list[float] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return self.equal + self.near_ties + self.mismatches


def judge_steps(ours: list[int], our_logits: np.ndarray, ref_logits: np.ndarray,
                tol: float, result: Comparison) -> None:
    """Add one request's decode steps to ``result``. ``ours[1:]`` are the decode tokens;
    ``our_logits``, ``ref_logits``: ``[len(ours) - 1, vocab]``."""
    for step, token in enumerate(ours[1:]):
        ref = ref_logits[step]
        best = int(ref.argmax())
        if token == best:
            result.equal += 1
        elif ref[best] - ref[token] < tol:
            result.near_ties += 1
            result.tie_gaps.append(float(ref[best] - ref[token]))
        else:
            result.mismatches += 1
    if len(ref_logits):
        result.max_logit_error = max(result.max_logit_error,
                                     float(np.abs(our_logits - ref_logits).max()))


def compare(model, requests: list[Request], gen: Generation, tol: float, device) -> Comparison:
    """This example's tokens and logits against the model decoding by itself."""
    result = Comparison()
    for r in requests:
        ours = gen.tokens[r.rid]
        if model_greedy(model, r.prompt, r.max_new_tokens, device) == ours:
            result.identical_requests += 1
        ref_logits = model_step_logits(model, r.prompt, ours, device)
        judge_steps(ours, gen.logits[r.rid], ref_logits, tol, result)
    return result


# --------------------------------------------------------------------------- main
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[:2]))
    ap.add_argument("--backend", choices=["splitkv", "reference"], default="splitkv")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="model dtype (splitkv takes bfloat16 or float16)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=False,
                    help="capture the device part of a step once per batch bucket (CUDA)")
    ap.add_argument("--plan-on-device", action=argparse.BooleanOptionalAction, default=False,
                    help="with --graphs: plan inside the graph (splitkv's plan_on_device), no "
                         "plan() on the host")
    ap.add_argument("--buckets", type=int_list, default=None,
                    help="batch buckets, e.g. 1,2,4,8 (default with --graphs: powers of two up "
                         "to the batch; without: none, each step exactly the live requests)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--model-attn", choices=["eager", "sdpa"], default="eager",
                    help="the model's own attention implementation (prefill, ground truth)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prompt-lens", type=int_list, default=[5, 23, 40, 12, 31, 17])
    ap.add_argument("--max-new-tokens", type=int_list, default=[80, 33, 65, 20, 72, 48],
                    help="tokens each request generates, one per prompt, counted as "
                         "transformers' generate counts them: the prefill's token included, so "
                         "a request decodes max_new_tokens - 1 steps (the defaults: 79 steps "
                         "for the longest)")
    ap.add_argument("--warmup-passes", type=int, default=1,
                    help="whole passes run before the timed one (compiles, captures)")
    ap.add_argument("--logit-tol", type=float, default=None,
                    help=f"logit tolerance (default by dtype: {LOGIT_TOLERANCE})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the result dict here")
    return ap


def default_buckets(batch: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that holds the whole batch."""
    buckets = [1]
    while buckets[-1] < batch:
        buckets.append(2 * buckets[-1])
    return buckets


def make_attention(args, num_pages: int, max_rows: int):
    if args.backend == "reference":
        return ReferenceAttention(args.page_size, num_pages)
    return SplitKVAttention(args.heads, args.kv_heads, args.head_dim, args.page_size,
                            num_pages, args.dtype, args.device, max_rows, args.graphs,
                            args.plan_on_device)


POSITIVE_OPTIONS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab",
                    "page_size")


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuse what cannot make a meaningful run, naming the option (exit status 2)."""
    for name in POSITIVE_OPTIONS:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got "
                         f"{getattr(args, name)}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads: expected a multiple of --kv-heads={args.kv_heads}, got {args.heads}")
    if not args.prompt_lens or min(args.prompt_lens) < 1:
        parser.error(f"--prompt-lens: expected positive lengths, got {args.prompt_lens}")
    if len(args.max_new_tokens) != len(args.prompt_lens):
        parser.error(f"--max-new-tokens: expected one count per prompt ({len(args.prompt_lens)}), "
                     f"got {len(args.max_new_tokens)}")
    if min(args.max_new_tokens) < 1 or max(args.max_new_tokens) < 2:
        parser.error("--max-new-tokens: expected counts >= 1 and at least one >= 2 (a decode "
                     f"step to check), got {args.max_new_tokens}")
    if args.buckets is not None and (not args.buckets or min(args.buckets) < 1):
        parser.error(f"--buckets: expected positive batch sizes, got {args.buckets}")
    if args.warmup_passes < 0:
        parser.error(f"--warmup-passes: expected 0 or more, got {args.warmup_passes}")
    if args.logit_tol is not None and not args.logit_tol > 0:
        parser.error(f"--logit-tol: expected a positive tolerance, got {args.logit_tol}")
    if args.plan_on_device and not (args.graphs and args.backend == "splitkv"):
        parser.error("--plan-on-device: needs --graphs and the splitkv backend")
    if args.backend == "splitkv" and args.dtype == "float32":
        parser.error("--dtype: the splitkv backend takes bfloat16 or float16, got float32")


def check_environment(args) -> None:
    """What the run needs from the machine, said in one line before any work."""
    if torch is None:
        sys.exit(f"llama_paged_decode.py needs PyTorch and transformers (the model is a "
                 f"transformers Llama, on the CPU too): pip install torch transformers "
                 f"({MISSING_IMPORT})")
    on_cuda = torch.device(args.device).type == "cuda"
    if args.graphs and not on_cuda:
        sys.exit("--graphs needs a CUDA device (--device cuda)")
    if args.backend == "splitkv" and not on_cuda:
        sys.exit(f"--backend splitkv needs a CUDA device, got --device {args.device} (on the CPU: "
                 "--backend reference --device cpu --dtype float32)")
    if on_cuda and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: PyTorch sees no CUDA device (on the CPU: --backend "
                 "reference --device cpu --dtype float32)")


def timed_pass(decoder: PagedDecoder, requests: list[Request], warmup_passes: int):
    """``warmup_passes`` untimed passes (kernels compile, graphs are captured), then the timed
    one. Returns (its Generation, the first pass's decode seconds or None)."""
    first = None
    for _ in range(warmup_passes):
        warm = decoder.generate(requests)
        first = sum(warm.step_seconds) if first is None else first
    gen = decoder.generate(requests)
    if warmup_passes and warm.tokens != gen.tokens:
        raise RuntimeError("the timed pass generated other tokens than the warm-up pass")
    return gen, first


def summarize(args, requests, gen: Generation, first_pass_s: float | None, result: Comparison,
              tol: float) -> dict:
    """The result dict: counts of the comparison, throughput, and the tokens."""
    seconds = float(sum(gen.step_seconds))
    return {
        "backend": args.backend, "graphs": args.graphs, "dtype": args.dtype,
        "plan_on_device": args.plan_on_device,
        "device": str(args.device), "requests": len(requests),
        "decode_steps": len(gen.step_seconds), "decode_tokens": gen.decode_tokens,
        "steps_judged": result.steps, "tokens_equal": result.equal,
        "near_ties": result.near_ties, "mismatches": result.mismatches,
        "logit_tolerance": tol, "max_near_tie_fraction": MAX_NEAR_TIE_FRACTION,
        "tie_gaps": [round(g, 5) for g in result.tie_gaps],
        "identical_to_generate": result.identical_requests,
        "max_logit_error": result.max_logit_error,
        "decode_seconds": seconds, "decode_tokens_per_s": gen.decode_tokens / max(seconds, 1e-12),
        "first_pass_decode_seconds": first_pass_s, "graph_captures": gen.captures,
        "passed": (result.mismatches == 0 and result.max_logit_error <= tol
                   and result.near_ties <= MAX_NEAR_TIE_FRACTION * result.steps),
        "tokens": gen.tokens,
    }


def print_summary(res: dict) -> None:
    mode = ("graphs, planned on the device" if res.get("plan_on_device") else "graphs"
            ) if res["graphs"] else "no graphs"
    first = res["first_pass_decode_seconds"]
    print(f"{res['backend']} ({mode}, {res['dtype']} on {res['device']}): {res['requests']} "
          f"requests, {res['decode_steps']} decode steps, {res['decode_tokens']} decode tokens")
    print(f"  tokens equal {res['tokens_equal']}/{res['steps_judged']}, near-ties "
          f"{res['near_ties']} (model's top-1 logit minus its logit for our token < "
          f"{res['logit_tolerance']}; gaps {res['tie_gaps']}), mismatches {res['mismatches']}")
    print(f"  requests identical to model.generate: {res['identical_to_generate']}/"
          f"{res['requests']}; max |logit - model's logit| {res['max_logit_error']:.3g} "
          f"(tolerance {res['logit_tolerance']})")
    print(f"  decode {res['decode_tokens_per_s']:.1f} tokens/s ({res['decode_seconds'] * 1e3:.1f} ms"
          + (f"; first pass {first * 1e3:.1f} ms" if first is not None else "")
          + f"; graphs captured in the timed pass: {res['graph_captures']})")
    print("  PASS" if res["passed"] else "  FAIL")


def main(argv=None) -> dict:
    """Run the example; returns the summary dict (also printed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    check_environment(args)
    buckets = args.buckets or (default_buckets(len(args.prompt_lens)) if args.graphs else None)
    tol = args.logit_tol if args.logit_tol is not None else LOGIT_TOLERANCE[args.dtype]
    model = build_model(args)
    requests = make_requests(args.prompt_lens, args.max_new_tokens, args.vocab, args.seed)
    max_rows = bucket_for(len(requests), buckets)
    scratch = -(-max_rows // args.page_size)
    num_pages = pool_size(requests, args.page_size, spare=4, scratch=scratch)
    # Graph capture is not allowed on the legacy default stream: run on a stream of our own.
    stream = torch.cuda.stream(torch.cuda.Stream()) if args.graphs else contextlib.nullcontext()
    with torch.no_grad(), stream:
        cache = PagedKVCache(args.layers, num_pages, args.page_size, args.kv_heads, args.head_dim,
                             getattr(torch, args.dtype), args.device, scratch, args.seed + 1)
        attention = make_attention(args, num_pages, max_rows)
        decoder = PagedDecoder(model, cache, attention, buckets, args.graphs, args.device)
        gen, first_pass_s = timed_pass(decoder, requests, args.warmup_passes)
        result = compare(model, requests, gen, tol, args.device)
    res = summarize(args, requests, gen, first_pass_s, result, tol)
    print_summary(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
