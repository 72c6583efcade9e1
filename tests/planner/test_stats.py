"""A decomposition's statistics: from a built plan, and in closed form for the planner's
candidate rows, checked against a plain per-chunk computation."""

import numpy as np
import pytest

from splitkv import DecodeProblem, plan_chunk_tokens, plan_fixed_splits, plan_from_chunk_counts
from splitkv.core.geometry import TILE_TOKENS
from splitkv.planner.stats import (S_ODD_CHUNKS, STAT_NAMES, decomposition_stats,
                                   equal_candidate_stats, ragged_candidate_stats, rows_of)

NO_SPLIT = 2.0 ** 60            # the chunk size of the no-split row: one chunk each


def reference_stats(chunk_tokens, chunks_per_request) -> dict:
    """``STAT_NAMES`` by name, chunk by chunk."""
    tokens = [int(t) for t in chunk_tokens]
    tiles = [-(-t // TILE_TOKENS) for t in tokens]
    counts = [int(k) for k in chunks_per_request]
    return {"num_chunks": len(tokens), "total_tokens": sum(tokens), "total_tiles": sum(tiles),
            "max_chunk_tokens": max(tokens, default=0), "max_chunk_tiles": max(tiles, default=0),
            "max_splits": max(counts, default=0),
            "split_chunks": sum(k for k in counts if k > 1),
            "odd_chunks": sum(t % 2 for t in tiles)}


def plan_stats(plan) -> dict:
    return reference_stats(plan.chunk_end - plan.chunk_start, plan.chunks_per_request)


def by_name(stats) -> dict:
    return dict(zip(STAT_NAMES, np.asarray(stats).tolist()))


def test_decomposition_stats_worked_example():
    # 5 chunks of 2 + 1 + 1 + 1 requests; 101 tokens are 2 tiles (3 chunks of one: odd)
    assert by_name(decomposition_stats([64, 101, 92, 32, 29], [2, 1, 1, 1])) == {
        "num_chunks": 5, "total_tokens": 318, "total_tiles": 7, "max_chunk_tokens": 101,
        "max_chunk_tiles": 2, "max_splits": 2, "split_chunks": 2, "odd_chunks": 3}
    assert by_name(decomposition_stats([], [])) == dict.fromkeys(STAT_NAMES, 0)


def test_rows_of_names_neighbours_only():
    assert rows_of(STAT_NAMES, "max_chunk_tokens", "max_chunk_tiles") == slice(3, 5)
    with pytest.raises(ValueError, match="neighbours"):
        rows_of(STAT_NAMES, "num_chunks", "total_tiles")


def random_rows(rng, max_len):
    """Candidate rows as the planner lays them out (no split, chunk sizes of a tile or more,
    split counts, then tiny chunk sizes): [(kind, value)], the split rows' slice and caps."""
    big = sorted({int(c) for c in rng.choice([64, 128, 256, 1024, 4096, 16384], 3)}
                 | {64 * int(rng.integers(1, 80))}, reverse=True)
    split = sorted({int(s) for s in rng.choice([2, 3, 4, 7, 33, 66, 200], 3)})
    tiny = [16, 32][:int(rng.integers(0, 3))] if max_len <= 2048 else []
    rows = ([("none", 1)] + [("chunk", c) for c in big] + [("split", s) for s in split]
            + [("tiny", c) for c in tiny])
    first = 1 + len(big)
    return rows, slice(first, first + len(split)), np.array(split, float)[:, None], len(tiny)


def built(problem, kind, value):
    """The plan a row stands for, by the public builders."""
    if kind == "none":
        return plan_from_chunk_counts(problem, np.ones(problem.batch_size, int), "single")
    if kind == "split":
        return plan_fixed_splits(problem, value, "fused", align=TILE_TOKENS)
    return plan_chunk_tokens(problem, value, "fused", align=min(value, TILE_TOKENS))


def random_lengths(rng, i):
    b = int(rng.integers(1, 48))
    hi = int([40, 2048, 9000, 70000][i % 4])
    kind = i % 3
    if kind == 0:
        return np.full(b, int(rng.integers(0, hi + 1)))                   # equal lengths
    lens = rng.integers(1, hi + 1, b)
    if kind == 2:
        lens[rng.random(b) < 0.3] = 0                                     # some empty
    return lens


def test_closed_forms_match_the_built_plans():
    """Every row's statistics, chunk counts and tiles per request as the plan it stands for,
    exactly; for equal lengths the plain-Python form agrees too."""
    rng = np.random.default_rng(5)
    edges = [np.zeros(3, int), np.zeros(1, int), np.ones(2, int), np.full(5, 64), [65, 0]]
    for lens in edges + [random_lengths(rng, i) for i in range(160)]:
        lens = np.asarray(lens)
        p = DecodeProblem(lens, 8, 8, 128, 16)
        max_len, min_len, total = int(lens.max()), int(lens.min()), int(lens.sum())
        rows, splits, caps, num_tiny = random_rows(rng, max_len)
        chunk = [NO_SPLIT if kind == "none" else TILE_TOKENS if kind == "split" else value
                 for kind, value in rows]
        plans = [built(p, kind, value) for kind, value in rows]
        want = {name: [plan_stats(plan)[name] for plan in plans] for name in STAT_NAMES}

        out = np.full((len(STAT_NAMES), len(rows)), np.nan)
        divisors = np.array([*chunk, TILE_TOKENS], float)[:, None]
        k, units = ragged_candidate_stats(out, lens.astype(float), min_len, max_len, total,
                                          divisors, splits, caps, num_tiny, odd_chunks=True)
        assert {name: row.tolist() for name, row in zip(STAT_NAMES, out)} == want, (lens, rows)
        # not asked for, the odd chunks are 0 and the rest the same
        unasked = np.full_like(out, np.nan)
        ragged_candidate_stats(unasked, lens.astype(float), min_len, max_len, total, divisors,
                               splits, caps, num_tiny)
        assert unasked[S_ODD_CHUNKS].tolist() == [0.0] * len(rows)
        unasked[S_ODD_CHUNKS] = out[S_ODD_CHUNKS]
        np.testing.assert_array_equal(unasked, out)
        for row, plan in enumerate(plans):
            np.testing.assert_array_equal(k[row], plan.chunks_per_request, err_msg=str(rows[row]))
        np.testing.assert_array_equal(units, -(-lens // TILE_TOKENS))

        if min_len == max_len:
            out = np.full((len(STAT_NAMES), len(rows)), np.nan)
            k = equal_candidate_stats(out, max_len, lens.size, total, chunk, splits, caps,
                                      num_tiny, odd_chunks=True)
            assert {name: row.tolist() for name, row in zip(STAT_NAMES, out)} == want, lens
            unasked = np.full_like(out, np.nan)
            equal_candidate_stats(unasked, max_len, lens.size, total, chunk, splits, caps,
                                  num_tiny)
            assert unasked[S_ODD_CHUNKS].tolist() == [0.0] * len(rows)
            assert k == [[int(plan.chunks_per_request[0])] for plan in plans]


def test_decomposition_stats_match_the_reference(rng):
    for _ in range(50):
        lens = rng.integers(0, 5000, int(rng.integers(1, 30)))
        plan = plan_from_chunk_counts(DecodeProblem(lens, 8, 8, 128, 16),
                                      rng.integers(1, 9, lens.size), "split_merge",
                                      align=int(rng.choice([1, 16, 64])))
        stats = decomposition_stats(plan.chunk_end - plan.chunk_start, plan.chunks_per_request)
        assert by_name(stats) == plan_stats(plan)
