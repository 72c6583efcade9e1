"""Random-weight transformers models built offline from a config (no download), the
continuous-batching run of a prompt set, and the judge of its greedy tokens.

The models are small and shaped like the families splitkv must serve: ``llama`` (full
attention, GQA), ``qwen2`` (biases on the Q, K and V projections), ``mistral`` (a sliding window
on every layer), ``gemma2`` (alternating sliding-window and full layers, the logits soft cap) and
``gpt_oss`` (alternating sliding-window and full layers, attention sinks). The window is shorter
than the sequences, the soft cap is small enough to change the argmax, and the sinks are drawn
large enough to matter, so each feature is exercised.

The judge is the model's own ``eager`` attention (the only transformers path that applies sinks;
for the soft cap too) over each whole sequence at once: teacher forcing, so every decode step is
judged on the run's own prefix and one flipped near-tie does not make the rest incomparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

MODELS = ("llama", "qwen2", "mistral", "gemma2", "gpt_oss", "phi3")

# A decode step whose token is not the judge's argmax is a near-tie, not a mismatch, when the
# judge's top logit beats its logit for that token by less than this gap. The models' logits
# lie within about +-4, where bfloat16's spacing is 2**-6 = 0.016 at most: the bfloat16 runs
# (both the judge and the run round every layer) differ by a few spacings.
NEAR_TIE_GAP = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.02}
# At most this fraction of the judged steps may be near-ties.
MAX_NEAR_TIE_FRACTION = 0.1

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
SLIDING_WINDOW = 16
SOFT_CAP = 1.0


def build_model(kind: str, *, dtype=torch.float32, device="cpu", seed: int = 0, **overrides):
    """A ``kind`` model (one of MODELS) with seeded random weights, eval mode."""
    import transformers as tf

    options = dict(COMMON, **overrides)
    torch.manual_seed(seed)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**options))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**options, initializer_range=0.05))
        with torch.no_grad():          # the biases start at zero: give them something to do
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**options,
                                                       sliding_window=SLIDING_WINDOW))
    elif kind == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **options, sliding_window=SLIDING_WINDOW, attn_logit_softcapping=SOFT_CAP,
            final_logit_softcapping=None, query_pre_attn_scalar=options["head_dim"],
            initializer_range=0.05))
    elif kind == "gpt_oss":
        model = tf.GptOssForCausalLM(tf.GptOssConfig(
            **options, sliding_window=SLIDING_WINDOW, num_local_experts=4,
            # every expert on every token: a top-k routing flips on bfloat16 rounding (a
            # discrete choice), which would judge the router, not the attention
            num_experts_per_tok=4, initializer_range=0.05))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    elif kind == "phi3":
        # Phi-3's head dim, 96 (its fused qkv projection; the config's head_dim attribute is
        # what the attention reads)
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**dict(options, head_dim=96)))
    else:
        raise ValueError(f"kind: expected one of {MODELS}, got {kind!r}")
    return model.eval().to(device=device, dtype=dtype)


def random_prompts(lengths, vocab: int = COMMON["vocab_size"], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def generate(model, implementation: str, prompts, max_new_tokens: int, *, graphs: bool,
             block_size: int = 16, num_blocks: int = 256, max_batch_tokens: int = 256):
    """``model.generate_batch`` greedy with ``implementation``; returns the generated tokens,
    one list per prompt, in prompt order."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(implementation)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    # transformers 5.23 renamed block_size to page_size
    size = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ \
        else "block_size"
    cb = ContinuousBatchingConfig(**{size: block_size}, num_blocks=num_blocks,
                                  max_batch_tokens=max_batch_tokens, use_cuda_graph=graphs)
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=cb, progress_bar=False)
    by_index = {int(rid.rsplit("_", 1)[1]): o.generated_tokens for rid, o in out.items()}
    return [by_index[i] for i in range(len(prompts))]


@dataclass
class Judgement:
    steps: int = 0
    equal: int = 0
    near_ties: int = 0
    mismatches: int = 0
    gaps: list[float] = field(default_factory=list)
    tied_requests: set = field(default_factory=set)

    def passed(self, fraction: float = MAX_NEAR_TIE_FRACTION) -> bool:
        return self.mismatches == 0 and self.near_ties <= fraction * self.steps


def judge(model, prompts, generated, gap: float) -> Judgement:
    """Every generated token against the argmax of the model's own eager logits on the same
    prefix (one forward per request over prompt + generated tokens)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    result = Judgement()
    try:
        for i, (prompt, tokens) in enumerate(zip(prompts, generated)):
            ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:].float().cpu()
            for step, token in enumerate(tokens):
                row = logits[step]
                best = int(row.argmax())
                result.steps += 1
                if token == best:
                    result.equal += 1
                elif float(row[best] - row[token]) < gap:
                    result.near_ties += 1
                    result.gaps.append(round(float(row[best] - row[token]), 5))
                    result.tied_requests.add(i)
                else:
                    result.mismatches += 1
    finally:
        model.set_attn_implementation(previous)
    return result


class PagedAttention(torch.nn.Module):
    """A decode attention layer over a paged cache that calls splitkv through the custom op."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, handle: int):
        super().__init__()
        self.shape = (heads, kv_heads, head_dim)
        self.q = torch.nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v = torch.nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        self.handle = handle

    def forward(self, x, k_pool, v_pool, seq_lens, block_table):
        from splitkv.integrations.transformers import next_slots

        heads, kv_heads, d = self.shape
        rows, page_size = x.shape[0], k_pool.shape[1]
        slots = next_slots(seq_lens, block_table, page_size, trash=0)
        k_pool.view(-1, kv_heads, d).index_copy_(0, slots, self.k(x).view(rows, kv_heads, d))
        v_pool.view(-1, kv_heads, d).index_copy_(0, slots, self.v(x).view(rows, kv_heads, d))
        out = torch.ops.splitkv.paged_decode(self.q(x).view(rows, heads, d), k_pool, v_pool,
                                             [seq_lens, block_table], None, self.handle, True)
        return self.o(out.reshape(rows, -1))


def compile_case(device, dtype):
    """(module, make): a layer whose session holds 4 rows and 3 requests over a scattered
    pool of 16-token pages; ``make()`` gives fresh inputs (the layer writes its pools)."""
    from splitkv.integrations.torch_ops import new_session

    torch.manual_seed(0)
    heads, kv_heads, d, page = 8, 2, 64, 16
    handle = new_session(num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                                   page_size=page, dtype=dtype, layout="block_table",
                                   capacity=4, width=4, sm_scale=d ** -0.5)
    module = PagedAttention(128, heads, kv_heads, d, handle).to(device=device, dtype=dtype)
    pool = torch.randn(16, page, kv_heads, d, device=device, dtype=dtype)
    table = torch.tensor([[3, 9, 1, -1], [5, -1, -1, -1], [12, 4, 7, 2]], dtype=torch.int32,
                         device=device)
    lens = torch.tensor([20, 3, 64], dtype=torch.int32, device=device)
    x = torch.randn(3, 128, device=device, dtype=dtype)
    make = lambda: (x, pool.clone(), pool.clone() * 0.5, lens, table)   # noqa: E731
    return module, make
