"""How the decode kernel cuts its work: what the runtime launches and the planner's cost model
describes, named once. Must match the defines of ``kernels_cu/decode.cu`` (the runtime passes
them to NVRTC)."""

WARPS_PER_CTA = 4                   # NUM_WARPS (8 warps x 128-token tiles measured slower)
TILE_TOKENS = 16 * WARPS_PER_CTA    # tokens per pipeline stage (TILE_N)
THREADS_PER_CTA = 32 * WARPS_PER_CTA
MAX_HEADS_PER_CTA = 64              # query heads one CTA computes (16 x the largest HEAD_TILES)


def ctas_per_kv_head(group_size: int) -> int:
    """CTAs that share one (chunk, kv head): GQA groups past 64 heads launch more of them."""
    return -(-group_size // MAX_HEADS_PER_CTA)

# Cluster sizes the fused merge can run as (thread-block clusters, sm_90+). 16 is past the
# portable 8; the H100/H200 allow it when the kernel opts in and two CTAs fit on an SM.
CLUSTER_SIZES = (2, 4, 8, 16)
MAX_PORTABLE_CLUSTER = 8


def fused_cluster_size(strategy: str, chunks_per_request, max_cluster: int = 16) -> int:
    """S when a 'fused' plan can merge inside thread-block clusters: every request is cut into
    exactly S chunks, S one of ``CLUSTER_SIZES`` up to ``max_cluster``. 0 otherwise (ragged
    chunk counts, no split, or another strategy), and the fused merge uses the atomic ticket."""
    if strategy != "fused" or len(chunks_per_request) == 0:
        return 0
    s = int(chunks_per_request[0])
    if s not in CLUSTER_SIZES or s > max_cluster:
        return 0
    return s if all(int(c) == s for c in chunks_per_request) else 0
