"""How the decode kernel cuts its work: what the runtime launches and the planner's cost model
describes, named once. Must match the defines of ``kernels_cu/decode.cu`` (the runtime passes
them to NVRTC)."""

import numpy as np

WARPS_PER_CTA = 4                   # NUM_WARPS (8 warps x 128-token tiles measured slower)
TILE_TOKENS = 16 * WARPS_PER_CTA    # tokens per pipeline stage (TILE_N)
THREADS_PER_CTA = 32 * WARPS_PER_CTA
MAX_HEADS_PER_CTA = 64              # query heads one CTA computes (16 x the largest HEAD_TILES)
RECORD_PAGES = 24                   # page ids carried in each chunk's record (decode.cu)
RECORD_HEADER_INTS = 8              # a chunk record: two int4 of header, then the page ids
RECORD_INTS = RECORD_HEADER_INTS + RECORD_PAGES


def ctas_per_kv_head(group_size: int) -> int:
    """CTAs that share one (chunk, kv head): GQA groups past 64 heads launch more of them."""
    return -(-group_size // MAX_HEADS_PER_CTA)

# When a 'fused' plan merges inside thread-block clusters (sm_90+) instead of with the atomic
# ticket. Measured on the H200 (benchmarks/NOTES.md): the cluster merge saves ~1-1.5 us of
# round trips to L2, but clusters cost streaming time when CTAs run long, when a grid holds
# many clusters of 4 or 8 (b8_n8k as 64 clusters of 4: 69 -> 92 us; 4 x 609 tokens as 32 of 8:
# 9.3 -> 13.8 us), and clusters of 16 (non-portable) were slower everywhere. So: 2, 4 or 8
# chunks per request, each at most 1,024 tokens, and clusters of 4 or 8 only in grids of at
# most 64 CTAs.
CLUSTER_SIZES = (2, 4, 8)
CLUSTER_MAX_CHUNK_TOKENS = 1024
CLUSTER_MAX_WIDE_CTAS = 64


def fused_cluster_size(strategy: str, chunks_per_request, longest_chunk: int, num_ctas: int) -> int:
    """S when a 'fused' plan merges inside thread-block clusters: every request is cut into
    exactly S chunks, S one of ``CLUSTER_SIZES``, none longer than ``CLUSTER_MAX_CHUNK_TOKENS``,
    and a grid of ``num_ctas`` CTAs at most ``CLUSTER_MAX_WIDE_CTAS`` when S > 2. 0 otherwise
    (the fused merge then uses the atomic ticket)."""
    if strategy != "fused" or len(chunks_per_request) == 0 or longest_chunk > CLUSTER_MAX_CHUNK_TOKENS:
        return 0
    s = int(chunks_per_request[0])
    if s not in CLUSTER_SIZES or (s > 2 and num_ctas > CLUSTER_MAX_WIDE_CTAS):
        return 0
    return s if all(int(c) == s for c in chunks_per_request) else 0


def plan_cluster_size(plan) -> int:
    """``fused_cluster_size`` of a built plan: the cluster size its fused merge runs in on a GPU
    with clusters (0: the atomic ticket, or no fused merge)."""
    # the cheap tests first: plan() asks on every decode step
    if plan.strategy != "fused" or plan.num_chunks == 0:
        return 0
    batch = plan.problem.batch_size
    s = plan.num_chunks // batch
    if s not in CLUSTER_SIZES or s * batch != plan.num_chunks or int(plan.merge_indptr[1]) != s:
        return 0
    longest = int((plan.chunk_end - plan.chunk_start).max())
    group = plan.problem.num_qo_heads // plan.problem.num_kv_heads
    return fused_cluster_size(plan.strategy, plan.chunks_per_request, longest,
                              plan.num_work_items * ctas_per_kv_head(group))


LAUNCH_ORDERS = ("longest_chunks", "longest_requests", "plan")


def launch_order(chunk_request, chunk_tokens, kv_lens, policy: str = "longest_chunks"):
    """Plan indices of a plan's chunks in the order the kernel's grid runs them. The GPU deals
    CTAs onto its SMs in grid order, so a long piece of work dealt last runs alone after the
    rest finished; running the long work first leaves only short work for the end (LPT list
    scheduling). Sorts are stable: ties, and so a uniform plan, keep plan order.

    'longest_chunks': the longest chunks first, whatever their request (LPT on work items);
    'longest_requests': the chunks of the longest requests first, each request's chunks
        together;
    'plan': plan order (requests in batch order).
    H200 (benchmarks/results/h200-launch-order.log), five ragged batches, longest chunks first
    against plan order: the planner's plans 2.6% faster on average (up to 5.6%), unsplit plans
    0.4-24% faster; a grid that ends in many short chunks can lose ~3% (their start-up is no
    longer hidden behind other CTAs' streaming). Longest requests first measured about the same.
    Cluster grids must keep plan order: a cluster's CTAs are neighbours.
    """
    if policy == "plan":
        return np.arange(len(chunk_tokens))
    if policy == "longest_chunks":
        key = np.asarray(chunk_tokens)
    elif policy == "longest_requests":
        key = np.asarray(kv_lens, dtype=np.int64)[np.asarray(chunk_request, dtype=np.intp)]
    else:
        raise ValueError(f"launch_order: expected one of {LAUNCH_ORDERS}, got {policy!r}")
    return np.argsort(-key, kind="stable")
