"""The planner plans for every GPU users run, with the profile such a GPU gets (the shipped fit
on the H200 and the H100, the roofline prior elsewhere) and its SM count and limits
(``core.architectures``): over the standard and class shapes and random ragged batches, 16-bit
and fp8 K/V, every plan covers every request, launches within CUDA's grid limits, merges in
clusters only from compute capability 9.0 (where the wrapper lets it), runs a build whose
shared memory the GPU's block has (``core.builds.decode_build``), and sizes a finite
workspace. CPU only."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pytest

from splitkv.bench.cases import CLASS_CASES, STANDARD_CASES
from splitkv.core import validation as V
from splitkv.core.architectures import ARCHITECTURES, GPU_SMS, device_properties
from splitkv.core.builds import PlanGrid, decode_build, row_tiles_for
from splitkv.core.geometry import MAX_HEADS_PER_CTA, ctas_per_kv_head
from splitkv.core.problem import DecodeProblem
from splitkv.planner import choose_plan
from splitkv.planner.kin import shipped_profiles
from splitkv.planner.profile_lookup import load_profile
from splitkv.planner.profiles import PROFILE_ENV, prior_profile
from splitkv.runtime.workspace import workspace_size

GPUS = sorted(GPU_SMS)
SHIPPED = {p.device_name for p in shipped_profiles()}
KV_DTYPES = ("", "float8_e4m3fn")


@pytest.fixture
def profile_of(monkeypatch, tmp_path):
    """``load_profile`` as a wrapper on that GPU calls it, with no user cache or override."""
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def load(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_profile(device_name=name, num_sms=GPU_SMS[name][1])
    return load


def cases_problems() -> list[DecodeProblem]:
    return [DecodeProblem(np.array(c.kv_lens), c.num_qo_heads, c.num_kv_heads, c.head_dim,
                          c.page_size) for c in STANDARD_CASES + CLASS_CASES]


def ragged_problems(seed: int, count: int = 16) -> list[DecodeProblem]:
    """Random ragged batches: 1-300 requests of lognormal lengths (empty ones too), GQA
    groups 1-16, head_dim 64/128/256, pages 1/16/64."""
    rng = np.random.default_rng(seed)
    problems = []
    for _ in range(count):
        batch = int(rng.integers(1, 300))
        lens = np.minimum(rng.lognormal(7.5, 1.5, batch).astype(np.int64), 131072)
        lens[rng.random(batch) < 0.05] = 0
        hk = int(rng.choice([1, 2, 4, 8]))
        group = int(rng.choice([1, 2, 4, 8, 16]))
        problems.append(DecodeProblem(lens, hk * group, hk, int(rng.choice([64, 128, 256])),
                                      int(rng.choice([1, 16, 64]))))
    return problems


def check_launchable(plan, kv_dtype: str, dev, cc: int) -> None:
    p = plan.problem
    # a plan for every request: each has chunks, and they cover its tokens
    assert plan.merge_indptr.size == p.batch_size + 1
    assert (np.diff(plan.merge_indptr) >= 1).all()
    tokens = np.bincount(plan.chunk_request, plan.chunk_end - plan.chunk_start,
                         minlength=p.batch_size)
    assert (tokens == p.kv_lens).all()
    # clusters only where the GPU has them, and of the sizes the kernels build
    assert plan.cluster_size in ((0, 2, 4, 8) if cc >= 90 else (0,))
    # CUDA's grid: the partial kernel's CTAs and the merge kernel's
    group = p.num_qo_heads // p.num_kv_heads
    ctas = plan.num_work_items * ctas_per_kv_head(group)
    assert 0 < ctas <= V.MAX_GRID_CTAS
    assert -(-p.batch_size * p.num_qo_heads * p.head_dim // 512) <= V.MAX_GRID_CTAS
    # the build this plan runs fits the GPU's block
    sizes = plan.chunk_end - plan.chunk_start
    grid = PlanGrid(ctas, float(sizes.mean()), plan.cluster_size,
                    row_tiles_for(min(group, MAX_HEADS_PER_CTA)))
    build = decode_build(p.dtype, p.head_dim, group, p.page_size, kv_dtype, grid, dev)
    assert build.shared_bytes <= ARCHITECTURES[cc].shared_per_block_optin, (build, dev.name)
    assert (build.cluster > 0) == (plan.cluster_size > 0)
    # finite workspace, within what workspace_size says a wrapper of this batch needs
    need = workspace_size(p.num_qo_heads, p.num_kv_heads, p.head_dim,
                          max_batch_size=max(p.batch_size, 1), max_chunks=plan.num_chunks)
    assert 0 <= plan.workspace_bytes <= need < 2**40
    assert math.isfinite(plan.predicted_us) and plan.predicted_us > 0


@pytest.mark.parametrize("name", GPUS)
def test_each_gpu_plans_launchable_plans(name, profile_of):
    cc, sms = GPU_SMS[name]
    dev = device_properties(name)
    profile = profile_of(name)
    assert profile.num_sms == sms
    assert profile.is_prior == (name not in SHIPPED)
    problems = cases_problems() + ragged_problems(sms)
    models = [profile.cost_model(kv or None).with_clusters(cc >= 90 and profile.clusters)
              for kv in KV_DTYPES]
    if cc >= 90:
        # a calibrated model with clusters (the H200's fit at this GPU's SMs), as a GPU of
        # 9.0 or newer gets once calibrated: its cluster plans must launch there too
        fitted = replace(profile_of("NVIDIA H200"), device_name=name, num_sms=sms)
        models += [fitted.cost_model(kv or None) for kv in KV_DTYPES]
    clustered = 0
    for kv_dtype, model in zip(KV_DTYPES * 2, models):
        for problem in problems:
            plan = choose_plan(problem, model)
            check_launchable(plan, kv_dtype, dev, cc)
            clustered += plan.cluster_size > 0
    assert (clustered > 0) == (cc >= 90)


@pytest.mark.parametrize("name", GPUS)
def test_plans_follow_the_sm_count(name):
    """The prior's plans scale with the GPU: a lone long request splits into chunks that fill
    the SMs (at least one CTA an SM, at most a few waves), and a batch that fills the GPU
    already is not split."""
    cc, sms = GPU_SMS[name]
    model = prior_profile(name, sms).cost_model().with_clusters(False)
    lone = choose_plan(DecodeProblem(np.array([131072]), 32, 8, 128, 16), model)
    assert sms <= lone.num_work_items * ctas_per_kv_head(4) <= 8 * sms
    full = choose_plan(DecodeProblem(np.full(4 * sms, 2048), 32, 8, 128, 16), model)
    assert full.num_chunks == 4 * sms
