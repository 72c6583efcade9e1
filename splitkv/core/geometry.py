"""How the decode kernel cuts its work: what the runtime launches and the planner's cost model
describes, named once. Must match the defines of ``kernels_cu/decode.cu`` (the runtime passes
them to NVRTC)."""

WARPS_PER_CTA = 4                   # NUM_WARPS; 8 (128-token tiles) for lone CTAs: core/builds.py
TILE_TOKENS = 16 * WARPS_PER_CTA    # tokens per pipeline stage (TILE_N)
THREADS_PER_CTA = 32 * WARPS_PER_CTA
MAX_HEADS_PER_CTA = 64              # query heads one CTA computes (16 x the largest ROW_TILES)
RECORD_PAGES = 24                   # page ids carried in each chunk record (ChunkRecord)


def ctas_per_kv_head(group_size: int, max_rows: int = MAX_HEADS_PER_CTA) -> int:
    """CTAs that share one (chunk, kv head): GQA groups past 64 heads (or past ``max_rows``,
    the rows_per_cta experiment's cap) launch more of them."""
    return -(-group_size // max_rows)


def rows_per_cta(group_size: int) -> int:
    """Query heads one CTA computes: the group, shared evenly by ``ctas_per_kv_head`` CTAs."""
    return -(-group_size // ctas_per_kv_head(group_size))
