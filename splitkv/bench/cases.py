"""The standard cases (names, shapes and ragged lengths), with the peers' numbers measured on
one H200 on 2026-11-29 (FlashInfer 0.3.1, vLLM's Triton kernel at its best split, cuDNN SDPA)
for comparison (microseconds per call)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RAGGED_B32 = [2623, 1653, 3648, 1041, 3200, 6690, 2792, 1711, 2317, 8665, 1207, 1927, 1989, 557,
              4407, 880, 7824, 2685, 1287, 438, 4244, 5400, 1889, 1276, 2444, 520, 3909, 4031, 611,
              6923, 1353, 12903]


@dataclass(frozen=True)
class Case:
    name: str
    kv_lens: tuple[int, ...]
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    best_paged_peer_us: float | None = None   # best of FlashInfer / FlashInfer TC / vLLM
    cudnn_us: float | None = None             # cuDNN SDPA, contiguous KV (not the same job)

    @property
    def equal_lengths(self) -> bool:
        return len(set(self.kv_lens)) == 1


def _eq(name, b, n, peer, cudnn, hq=32, hk=8, d=128, page=16):
    return Case(name, (n,) * b, hq, hk, d, page, best_paged_peer_us=peer, cudnn_us=cudnn)


STANDARD_CASES = [
    _eq("b1_n1k", 1, 1024, 8.6, 7.6),
    _eq("b1_n8k", 1, 8192, 17.9, 15.3),
    _eq("b1_n32k", 1, 32768, 42.3, 37.9),
    _eq("b1_n128k", 1, 131072, 135.9, 128.4),
    _eq("b8_n8k", 8, 8192, 72.0, 67.4),
    _eq("b8_n32k", 8, 32768, 257.1, 245.8),
    _eq("b32_n2k", 32, 2048, 69.2, 65.0),
    _eq("b32_n8k", 32, 8192, 253.3, 243.9),
    _eq("b128_n2k", 128, 2048, 264.2, 245.4),
    _eq("mha_b1_n32k", 1, 32768, 129.3, 127.1, hq=32, hk=32),
    _eq("g8_b1_n32k", 1, 32768, 42.5, 38.0, hq=64, hk=8),
    Case("ragged_b32", tuple(RAGGED_B32), best_paged_peer_us=139.5),
]

# The best fp8 peer on the H200 (of XQA, FlashInfer's CUDA-core and tensor-core decode, e4m3
# K/V with scale 1, bf16 q and output), microseconds.
FP8_BEST_PEER_US = {"b1_n1k": 6.6, "b1_n8k": 14.9, "b1_n32k": 37.0, "b1_n128k": 109.4,
                    "b8_n8k": 51.6, "b8_n32k": 183.2, "b32_n2k": 37.9, "b32_n8k": 133.1,
                    "b128_n2k": 133.0, "mha_b1_n32k": 86.2, "g8_b1_n32k": 37.3,
                    "ragged_b32": 151.8}

# Classes of shape outside the standard set, where splitkv trailed (no published peer: SDPA
# and, with --flashinfer, FlashInfer are measured in the run). `--cases classes` selects them.
CLASS_CASES = [
    _eq("d256_b8_n8k", 8, 8192, None, None, hq=16, hk=8, d=256),      # Gemma-like head_dim 256
    _eq("d64_b64_n4k", 64, 4096, None, None, d=64),                    # head_dim 64, large batch
    _eq("p1_b8_n8k", 8, 8192, None, None, page=1),                     # page size 1
    _eq("p64_b8_n8k", 8, 8192, None, None, page=64),
    _eq("g16_b8_n8k", 8, 8192, None, None, hq=128, hk=8),              # GQA group 16
    _eq("g32_b32_n8k", 32, 8192, None, None, hq=64, hk=2),             # group 32 (MQA-like)
    _eq("short_b256_n384", 256, 384, None, None),                      # hundreds of short requests
    _eq("b1_n3k", 1, 3072, None, None),                                # batch 1, a few thousand
]
CASE_GROUPS = {"standard": STANDARD_CASES, "classes": CLASS_CASES}

# Latency targets (microseconds) for the short cases.
LATENCY_TARGETS_US = {"b1_n1k": 4.5, "b1_n8k": 12.0, "b1_n32k": 36.0}


def select(names: str | None) -> list[Case]:
    """The cases named (comma-separated case names, or a group: 'standard', 'classes'); the
    standard cases by default."""
    if not names:
        return list(STANDARD_CASES)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    by_name = {c.name: c for c in STANDARD_CASES + CLASS_CASES}
    unknown = [n for n in wanted if n not in by_name and n not in CASE_GROUPS]
    if unknown or not wanted:
        shown = ", ".join(repr(n) for n in unknown) if unknown else repr(names)
        raise ValueError(f"--cases: unknown case(s) {shown}; known: groups "
                         f"{', '.join(sorted(CASE_GROUPS))} and cases "
                         f"{', '.join(sorted(by_name))}")
    out = []
    for n in wanted:
        for case in CASE_GROUPS.get(n, [by_name.get(n)]):
            if case not in out:
                out.append(case)
    return out


def ragged_b256_lengths() -> np.ndarray:
    """The plan-cost batch, a ragged batch of 256 requests: 256 log-normal lengths
    (median ~2k tokens, clipped to 16..32k; seed 0), many short requests and a few long ones."""
    lens = np.random.default_rng(0).lognormal(np.log(2048), 1.2, 256)
    return np.clip(lens, 16, 32768).astype(np.int64)
