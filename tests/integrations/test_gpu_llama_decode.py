"""splitkv inside a real model's decode loop: ``examples/llama_paged_decode.py`` with the
splitkv backend on the GPU (its default shape: 4 layers, 8/2 heads, head_dim 128, 6 ragged
requests, 79 decode steps), with and without CUDA graphs, judged against the model's own
decode. The tolerances are the example's: every step's logits within ``LOGIT_TOLERANCE`` of
the model's, no mismatch, at most ``MAX_NEAR_TIE_FRACTION`` of the steps near-ties."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.llama_example import load_example  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

example = load_example()


def has_graph_mode() -> bool:
    from splitkv import BatchDecodeWrapper

    return "use_cuda_graph" in inspect.signature(BatchDecodeWrapper.__init__).parameters


def check(res: dict) -> None:
    steps = res["steps_judged"]
    assert res["decode_steps"] >= 64 and steps == res["decode_tokens"]
    assert res["mismatches"] == 0, res
    assert res["max_logit_error"] <= res["logit_tolerance"], res
    assert res["near_ties"] <= example.MAX_NEAR_TIE_FRACTION * steps, res
    assert res["passed"]


@pytest.mark.parametrize("dtype,graphs", [("bfloat16", False), ("bfloat16", True),
                                          ("float16", False), ("bfloat16", "on_device")])
def test_splitkv_decode_matches_the_models_own(dtype, graphs, capsys):
    if graphs and not has_graph_mode():
        pytest.skip("splitkv has no graph-stable mode (BatchDecodeWrapper(use_cuda_graph=True)) yet")
    res = example.main(["--backend", "splitkv", "--dtype", dtype,
                        "--graphs" if graphs else "--no-graphs"]
                       + (["--plan-on-device"] if graphs == "on_device" else []))
    check(res)
    if graphs:
        assert res["graph_captures"] == 0, "the timed pass should only replay the warm-up's graphs"
    with capsys.disabled():
        print(f"\n{dtype}, graphs {graphs}: {res['decode_tokens_per_s']:.0f} decode tokens/s, "
              f"{res['near_ties']} near-ties of {res['steps_judged']} steps, "
              f"max logit error {res['max_logit_error']:.3g}")
