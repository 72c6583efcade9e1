"""splitkv in transformers' continuous batching on the GPU: ``generate_batch`` of random-weight
Llama-, Qwen2-, Mistral-, Gemma-2-, gpt-oss- and Phi-3-style (head dim 96) models (bfloat16,
built offline), with transformers' CUDA graphs off and on, judged against the model's own eager
logits on the same prefix; Llama's tokens also against transformers' SDPA. And
``torch.compile(fullgraph=True)`` of an attention layer calling the custom op. Run on the transformers installed (5.17 on the GPU
machine) and on the newest release (``benchmarks/device_run.sh transformers_newest``).

Near-ties: a token that is not the judge's argmax passes when the judge's top logit beats it by
less than ``NEAR_TIE_GAP["bfloat16"]``, on at most ``MAX_NEAR_TIE_FRACTION`` of the steps
(``tests/helpers/transformers_models.py`` says why those values).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.transformers_models import (MODELS, NEAR_TIE_GAP, build_model,  # noqa: E402
                                         compile_case, generate, judge, random_prompts)

import splitkv.integrations.transformers as skv  # noqa: E402
from splitkv.integrations import torch_ops  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

# 8 requests; the longest is 64 + 24 tokens: past the sliding window (16) and many pages (16)
PROMPT_LENS = [5, 23, 40, 12, 31, 17, 64, 9]
NEW_TOKENS = 24
GAP = NEAR_TIE_GAP["bfloat16"]


def device_plan_errors() -> list:
    return [s.wrapper.device_plan_state()["error"] for s in torch_ops._SESSIONS.values()
            if s.wrapper is not None and s.plans]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("kind", MODELS)
def test_generate_batch_decodes_the_models_tokens(kind, graphs, capsys):
    skv.register()
    model = build_model(kind, dtype=torch.bfloat16, device="cuda")
    prompts = random_prompts(PROMPT_LENS, seed=2)
    skv.route_counts.clear()
    ours = generate(model, "splitkv", prompts, NEW_TOKENS, graphs=graphs)
    routes = dict(skv.route_counts)
    verdict = judge(model, prompts, ours, GAP)
    with capsys.disabled():
        print(f"\n{kind}, graphs {graphs}: routes {routes}; {verdict.equal}/{verdict.steps} "
              f"equal, near-ties {verdict.gaps}")
    assert verdict.passed(), verdict
    assert all(error is None for error in device_plan_errors())
    if kind in ("llama", "qwen2", "phi3"):            # full attention
        assert routes.get("block_table", 0) > 0      # transformers' block table, graphs or not
    elif not graphs:
        assert routes.get("token_table", 0) + routes.get("gathered", 0) > 0
    else:
        # sliding-window models get no block table: their padded decode batches run one row a
        # token through splitkv (under graphs the counts are the captures' calls, not steps)
        assert routes.get("token_rows", 0) > 0, routes
    if kind == "llama":
        sdpa = "paged|sdpa" if skv.uses_paged_prefix() else "sdpa"
        theirs = generate(model, sdpa, prompts, NEW_TOKENS, graphs=graphs)
        their_verdict = judge(model, prompts, theirs, GAP)
        assert their_verdict.passed(), their_verdict
        tied = verdict.tied_requests | their_verdict.tied_requests
        for i in range(len(prompts)):
            if i not in tied:                        # no near-tie in either run: same tokens
                assert ours[i] == theirs[i], i


def test_torch_compile_fullgraph_matches_eager():
    module, make = compile_case("cuda", torch.bfloat16)
    with torch.no_grad():
        eager = module(*make())
        compiled = torch.compile(module, fullgraph=True)(*make())
    torch.cuda.synchronize()
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=0, atol=2e-2)
