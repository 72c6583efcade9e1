"""The Llama decode example's plumbing on the CPU: the paged cache, the ragged batch that
shrinks, bucket padding and the comparison, with splitkv's float64 reference as the attention.
Skipped where torch or transformers are not installed (as in CI)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.llama_example import load_example  # noqa: E402

example = load_example()

# 2 layers, GQA group 2, head_dim 64; requests cross page boundaries while decoding, and one
# finishes with its prefill token (it never enters the decode batch).
TINY = ["--backend", "reference", "--device", "cpu", "--dtype", "float32", "--layers", "2",
        "--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "64", "--vocab", "256", "--prompt-lens", "5,19,33,3",
        "--max-new-tokens", "14,5,9,1", "--warmup-passes", "0"]


def test_reference_attention_reproduces_the_models_own_greedy_decode():
    res = example.main(TINY)
    assert res["decode_steps"] == 13 and res["decode_tokens"] == 13 + 4 + 8
    assert res["mismatches"] == 0 and res["near_ties"] == 0
    assert res["identical_to_generate"] == 4
    assert res["max_logit_error"] < 1e-4          # float32 model, float64 attention
    assert res["passed"]
    assert [len(t) for t in res["tokens"].values()] == [14, 5, 9, 1]


def test_padding_to_buckets_and_a_second_pass_change_no_token():
    plain = example.main(TINY)
    padded = example.main(TINY + ["--buckets", "2,8", "--warmup-passes", "1"])
    assert padded["tokens"] == plain["tokens"]
    assert padded["max_logit_error"] < 1e-4


def test_a_step_pads_its_bucket_with_rows_that_read_nothing():
    cache = example.PagedKVCache(1, num_pages=12, page_size=4, num_kv_heads=1, head_dim=8,
                                 dtype=torch.float32, device="cpu", scratch_pages=2, seed=3)
    a = example.Request(0, prompt=[1] * 6, max_new_tokens=3, generated=[7], num_cached=6)
    b = example.Request(1, prompt=[2] * 3, max_new_tokens=2, generated=[9], num_cached=3)
    cache.reserve(0, 6)
    cache.reserve(1, 3)
    step = example.step_inputs([a, b], cache, rows=4, width=3)
    assert step.seq_lens.tolist() == [7, 4, 0, 0]
    assert step.device_inputs[0].tolist() == [7, 9, 0, 0]          # token ids
    assert step.device_inputs[1].tolist() == [6, 3, 0, 0]          # positions
    owned = {p for pages in cache.pages.values() for p in pages}
    assert owned.isdisjoint({0, 1}), "requests never own the scratch pages"
    slots = step.device_inputs[2]
    assert slots[0] == cache.pages[0][1] * 4 + 2 and slots[1] == cache.pages[1][0] * 4 + 3
    assert set(slots[2:] // 4) <= {0, 1} and len(set(slots[2:])) == 2
    assert (step.block_table[0, :2] == cache.pages[0]).all()
    assert (step.block_table[2:] == 0).all()


def test_finished_requests_give_their_pages_back():
    cache = example.PagedKVCache(1, num_pages=6, page_size=4, num_kv_heads=1, head_dim=8,
                                 dtype=torch.float32, device="cpu", scratch_pages=1, seed=0)
    cache.reserve(0, 9)                                             # 3 pages
    pages = list(cache.pages[0])
    cache.release(0)
    cache.reserve(1, 12)
    assert cache.pages[1] == pages, "freed pages are reused first, in the same order"
    assert np.unique(cache.pages[1]).size == 3 and 0 not in cache.pages[1]


class StandInWrapper:
    """Takes ``BatchDecodeWrapper``'s place to record how the example drives it (and attends
    with the float64 reference, on the CPU)."""

    made: list = []

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, page_size, dtype="bfloat16",
                 **options):
        self.options, self.plans, self.runs = options, [], 0
        StandInWrapper.made.append(self)

    def plan(self, page_table, *, stream=None):
        self.page_table = page_table
        self.plans.append(page_table.batch_size)

    def run(self, q, k_cache, v_cache, *, out, stream=None):
        from splitkv import reference_decode

        assert q.is_contiguous() and out.shape == q.shape
        o, _ = reference_decode(q.double().numpy(), k_cache.double().numpy(),
                                v_cache.double().numpy(), self.page_table)
        out.copy_(torch.from_numpy(o))
        self.runs += 1
        return out


def test_graph_path_plans_one_bucket_wrapper_per_step_and_runs_it_per_layer(monkeypatch):
    """What ``--graphs`` asks of splitkv, but the capture: one graph-stable wrapper per bucket
    (``use_cuda_graph=True, max_batch_size=bucket``), planned on every step with the bucket's
    padded table and run once per layer; the tokens are those of the reference backend."""
    import splitkv

    monkeypatch.setattr(splitkv, "BatchDecodeWrapper", StandInWrapper, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    StandInWrapper.made = []
    args = example.build_parser().parse_args(TINY)
    model = example.build_model(args)
    requests = example.make_requests(args.prompt_lens, args.max_new_tokens, args.vocab, args.seed)
    buckets = [1, 2, 4]
    num_pages = example.pool_size(requests, args.page_size, spare=4, scratch=1)
    cache = example.PagedKVCache(args.layers, num_pages, args.page_size, args.kv_heads,
                                 args.head_dim, torch.float32, "cpu", 1, args.seed + 1)
    attention = example.SplitKVAttention(args.heads, args.kv_heads, args.head_dim, args.page_size,
                                         num_pages, "float32", "cpu", 4, graphs=True)
    with torch.no_grad():
        gen = example.PagedDecoder(model, cache, attention, buckets, False, "cpu").generate(requests)
    assert gen.tokens == example.main(TINY)["tokens"]
    # 3 requests decode (one is done after its prefill): bucket 4, then 2 after 4 steps, then 1
    by_bucket = {w.options["max_batch_size"]: w for w in StandInWrapper.made}
    assert all(w.options["use_cuda_graph"] for w in StandInWrapper.made)
    assert sorted(by_bucket) == [1, 2, 4]
    assert {b: (set(w.plans), len(w.plans)) for b, w in by_bucket.items()} == \
        {4: ({4}, 4), 2: ({2}, 4), 1: ({1}, 5)}
    assert all(w.runs == args.layers * len(w.plans) for w in StandInWrapper.made)
