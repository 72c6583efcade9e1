"""After ``warmup()`` nothing compiles in serving: a soak of plans with changing batch sizes,
lengths, soft caps and page-table forms, per-shape (16-bit and fp8, clusters where the GPU has
them) and graph-stable (planned on the device), adds no compiled module to the process."""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
pytestmark = pytest.mark.gpu

from splitkv import BatchDecodeWrapper  # noqa: E402
from splitkv.runtime import modules  # noqa: E402
from splitkv.runtime.device_planner import _KERNELS as PLANNERS  # noqa: E402
from splitkv.testing import scattered_page_table  # noqa: E402

STEPS = 10_000      # decode steps planned in all: a third each for bf16, fp8 and the device


def compiled() -> int:
    return len(modules._CACHE) + len(PLANNERS)


@pytest.mark.parametrize("kv_dtype", [None, "float8_e4m3fn"])
def test_per_shape_plans_after_warmup_compile_nothing(kv_dtype):
    wrapper = BatchDecodeWrapper(32, 8, 128, 16, kv_dtype=kv_dtype)
    count = wrapper.warmup(logits_soft_cap=True)
    assert count >= 2
    before = compiled()
    rng = np.random.default_rng(0)
    for step in range(STEPS // 3):
        lens = rng.integers(1, rng.choice([64, 2048, 40000]), rng.integers(1, 129))
        table, _ = scattered_page_table(lens, 16, rng, 0)
        wrapper.plan(table, logits_soft_cap=30.0 if step % 3 == 0 else None)
    assert compiled() == before


def test_graph_stable_plans_on_the_device_after_warmup_compile_nothing():
    wrapper = BatchDecodeWrapper(32, 8, 128, 16, use_cuda_graph=True, max_batch_size=256,
                                 max_num_pages=256 * 64)
    assert wrapper.warmup() == 1
    before = compiled()
    rng = np.random.default_rng(1)
    seq_lens = cupy.zeros(256, dtype=cupy.int32)
    table = cupy.asarray(rng.permutation(256 * 64).reshape(256, 64).astype(np.int32))
    k = cupy.zeros((256 * 64, 16, 8, 128), dtype=cupy.uint16)     # bfloat16 zeros
    q = cupy.zeros((256, 32, 128), dtype=cupy.uint16)
    for _ in range(STEPS // 3):
        rows = int(rng.integers(1, 257))
        seq_lens[:rows] = cupy.asarray(rng.integers(1, 64 * 16, rows).astype(np.int32))
        wrapper.plan_on_device(seq_lens=seq_lens[:rows], block_table=table[:rows])
        wrapper.run(q[:rows], k, k)          # each batch size's grid: bound, never compiled
    cupy.cuda.get_current_stream().synchronize()
    assert wrapper.device_plan_state()["error"] is None
    assert compiled() == before


def test_warmup_names_what_it_refuses():
    wrapper = BatchDecodeWrapper(32, 8, 128, 16, use_cuda_graph=True, max_batch_size=8,
                                 max_num_pages=64)
    with pytest.raises(ValueError, match="max_q_len"):
        wrapper.warmup(max_q_len=4)
    with pytest.raises(ValueError, match="unified_max"):
        wrapper.warmup(unified_max=True)
    with pytest.raises(TypeError, match="logits_soft_cap"):
        wrapper.warmup(logits_soft_cap=30.0)
