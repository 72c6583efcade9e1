"""How the decode kernel cuts its work: what the runtime launches and the planner's cost model
describes, named once. Must match the defines of ``kernels_cu/decode.cu`` (the runtime passes
them to NVRTC)."""

WARPS_PER_CTA = 4                   # NUM_WARPS; 8 (128-token tiles) for lone fp8 CTAs only
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


LONG_TILE_TOKENS = 2 * TILE_TOKENS   # a tile of 8 warps x 16 tokens, or of 4 warps x 32


def fp8_tile_tokens(head_dim: int, rows_per_cta: int, lone: bool,
                    multi_token: bool = False) -> int:
    """Tokens of one K/V tile in the default fp8 build of a per-shape plan: 128 in a lone grid
    (no SM runs two CTAs: 8 warps of 16 tokens) and, for single-token decode, at head_dim 128
    with one row tile (4 warps of 32), else 64. The rule of ``runtime.features.plan_warps`` and
    ``default_tile_per_warp`` (tests/core/test_validation.py checks they agree), for the cost model
    to count the tiles a plan runs."""
    if lone or (head_dim == 128 and rows_per_cta <= 16 and not multi_token):
        return LONG_TILE_TOKENS
    return TILE_TOKENS
