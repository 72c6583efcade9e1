// Split-KV decode attention over a paged KV cache: the partial kernel (with its fused and
// cluster merges) and the merge kernel. Both take one DecodeParams (decode_params.cuh).
//
// decode_partial: one CTA per work item (chunk, kv head, one of the kv head's ctas_per_kv_head
// CTAs), flat grid, heads fastest. It streams the chunk's tokens of K and V for that kv head
// through shared memory (cp.async, STAGES tiles of TILE_N tokens in flight (16 a warp),
// page-table lookups per token) and computes attention for up to ROWS query heads of the GQA
// group at once on tensor cores: S = Q K^T and O += P V with mma.m16n8k16, query heads packed
// into the 16 MMA rows (ROW_TILES row tiles of 16), so every K/V byte is read once per group.
// It ends in one of four epilogues: a request in one chunk writes its output (write_output); a
// split request writes an fp32 partial state to the workspace (write_partial), and with
// RECORD_TICKET_MERGE the last CTA of a (request, kv head, CTA) to finish then merges all
// partials of that output itself (ticket_merge).
//
// Its stages, in order, each a function below: locate (the CTA's work item), KvPipeline (the
// page walk and the cp.async copies of K/V tiles), load_q (q as MMA fragments), and per tile
// qk_tile (S = Q K^T), the logits hooks (scale_scores with the Mask, then Variant's transform),
// update_max (the online softmax), pv_tile (P = exp2(S - m), O += P V); stream_pass runs the
// tiles; then store_warp_states and one epilogue (finish).
//
// With CLUSTER = S > 1 (sm_90+; every request cut into exactly S chunks), the S CTAs of one
// (request, kv head, CTA) form a thread-block cluster: each leaves its partial state in its own
// shared memory, and after a cluster barrier they merge them by reading each other's shared
// memory (cluster_merge). No workspace, no fence, no atomic ticket: the fused merge's round trips
// to L2 are what short batch-1 calls spend most of their time on.
//
// merge_partials: one thread per (request, qo head, 4 dims) of the batch (with
// DecodeParams::split_requests, of the split requests only); merges a split request's
// partials.
//
// KV_FP8 = 1 (e4m3fn) or 2 (e5m2): K and V are fp8 codes, copied as they are (16 dims of a row a
// 16-byte copy) into byte tiles, and widened in registers straight into the MMA B fragments
// (fp8_tile_offset, fp8_q_dim, fp8_v_dim below): no second pass through shared memory. The
// MMAs then run in float16, where every fp8 value is exact; a bfloat16 q is converted once,
// scaled by a power of two that the score scale undoes. K's scale joins the score scale and V's
// the output (per CTA: one kv head).
//
// Attention variants (Variant, the Mask types): the logits soft cap (a build of its own,
// SOFT_CAP) is applied to the scaled scores of each tile; a sink joins each output row's
// softmax where every final output is written (write_output_slot). Scores are NaN for any
// non-finite raw score (only the mask makes -inf), so a NaN or Inf in q or K makes its head NaN
// on every path.
//
// Multi-token decode (MULTI_TOKEN, a build of its own): a request's q_len query rows are the
// last q_len positions of its KV, causal among themselves. A CTA's MMA rows are then (query row,
// query head) pairs of its kv head, row-major ("virtual heads", DecodeParams::query_rows), so
// every K/V byte is still read once for all of a request's rows; each row masks the tokens past
// its own position (QueryRowsMask), and every final output is written through query_row.
//
// Compile-time parameters (decode_build.cuh turns them into Build): SPLITKV_BF16, HEAD_DIM,
// ROW_TILES (1, 2, 4), STAGES, NUM_WARPS, WARPS_D, MAX_REGISTERS, CLUSTER, RECORD_PAGES, KV_FP8,
// SOFT_CAP (1: the logits soft cap, its value in DecodeParams), MULTI_TOKEN, UNIFIED_MAX (1: the
// FlashDecoding++ unified max, below), Q_SMEM (1, an experiment: q's MMA fragments in shared
// memory, read back each tile, not registers), POW2_PAGES (1: page sizes are powers of two, so
// the page walk of pages smaller than a thread's row step shifts and masks instead of
// dividing), TILE_N (tokens per pipeline stage: 16 x NUM_WARPS by default; 32 x NUM_WARPS, an
// experiment, gives each warp two 16-token subtiles a tile, so the per-tile costs that do not
// scale with the bytes are paid half as often for rows of 128 bytes: 16-bit head_dim 64, fp8
// head_dim 128), DISSECT (the latency dissection's cuts, Cut).
#include "decode_build.cuh"
#include "decode_params.cuh"
#include "softmax_state.cuh"
#include "fp8.cuh"

// The unified max (FlashDecoding++): scores are offset by a fixed phi (params.unified_max_log2,
// base 2) instead of the running max, so a tile needs no max across lanes and O no rescaling;
// the CTA's states then have max phi and its warps combine by plain sums. Exact where every
// row's largest score m (over the CTA's tokens) keeps exp2(m - phi) in [2**-UNIFIED_LO,
// 2**UNIFIED_HI]: P fits its MMA type (float16 holds 2**15), is as precise as the running max
// gives it (float16's subnormals start 2**-14 down: a max at most 2**3 below 1 loses at most 3
// bits on tokens 2**-11 below it; bfloat16 has float's range) and O cannot overflow where the
// running max's would not. A CTA with a row outside (or a non-finite d or o) streams its tokens
// again with the running max: the fallback (core/unified_max.py is the host's side).
enum : int { UNIFIED_HI = 15 };
enum : int { UNIFIED_LO = SPLITKV_MMA_BF16 ? 60 : 3 };

// WARPS_D (an experiment, 16-bit K/V): warps that split the head dim of O = P V. Each warp
// of a group of WARPS_D computes the same scores (Q K^T over every dim) and softmax state,
// and accumulates O for its 1 / WARPS_D of the dims: a CTA of 8 warps keeps 64-token tiles
// (head_dim 256: 2 stages fit), and O's registers shrink by WARPS_D.
static_assert(WARPS_D == 1 || !(Build::fp8 || Build::unified_max),
              "WARPS_D > 1: 16-bit K/V and the running max only");
enum : int { NUM_THREADS = NUM_WARPS * 32 };
enum : int { WARPS_N = NUM_WARPS / (ROW_TILES * WARPS_D) };   // warps sharing one row tile's dims split the tokens
enum : int { TOK_PER_WARP = TILE_N / WARPS_N };
enum : int { SUBTILES = TOK_PER_WARP / 16 };
enum : int { GROUP_THREADS = 32 * ROW_TILES * WARPS_D };   // the warps that read the same tokens
enum : int { STATE_WARPS = NUM_WARPS / WARPS_D };          // warp states the epilogue combines
enum : int { ROWS = 16 * ROW_TILES };                      // query heads per CTA
enum : int { KV_BYTES = Build::fp8 ? 1 : 2 };
enum : int { ROW_BYTES = HEAD_DIM * KV_BYTES };            // one token's K (or V) row of one kv head
enum : int { DCHUNKS = ROW_BYTES / 16 };                   // 16-byte chunks per row
// The copy threads' chunk slots per row: DCHUNKS rounded up to a power of two (16 for head_dim
// 96's 12 chunks), so a row step is a whole number of rows; threads of slots past DCHUNKS copy
// nothing.
enum : int { COPY_SLOTS = DCHUNKS <= 4 ? 4 : DCHUNKS <= 8 ? 8 : DCHUNKS <= 16 ? 16 : 32 };
static_assert(COPY_SLOTS >= DCHUNKS && DCHUNKS <= 32, "16-byte chunks per row: at most 32");
static_assert(DCHUNKS % 4 == 0, "rows of whole groups of 4 chunks (the swizzles stay in a row)");
enum : int { KSTEPS = HEAD_DIM / 16 };
enum : int { DTILES = HEAD_DIM / 8 };
enum : int { DTILES_W = DTILES / WARPS_D };                // d-tiles of O one warp accumulates
enum : int { STAGE_BYTES = TILE_N * ROW_BYTES };           // K (or V) of one tile
enum : int { PIPELINE_BYTES = STAGES * STAGE_BYTES * 2 };  // K and V tiles of every stage
static_assert(RECORD_PAGES / 4 <= NUM_THREADS, "record copy: one 16-byte copy per thread");
static_assert(TILE_N % (16 * WARPS_N) == 0, "TILE_N: whole 16-token subtiles for every warp");
static_assert(ROW_TILES * WARPS_D * WARPS_N == NUM_WARPS, "warps: row tiles x WARPS_D x WARPS_N");

// Partials merged per pass of merge_workspace: each pass issues all its loads before using any,
// so merging up to this many partials costs one round trip to L2, not one per partial.
enum : int { MERGE_BATCH = 16 };

// A lane's share of one row's O accumulator fragments (dims i * 8 + 2t, +1 for every d-tile i),
// and four dims of a row, the unit every epilogue and merge works in.
using RowState = SoftmaxState<2 * DTILES_W>;
using SlotState = SoftmaxState<4>;

// Shared-memory tile rows are HEAD_DIM halves; chunk c of row r lives at chunk c ^ (r & 7), so
// the 8 rows one ldmatrix reads fall in 8 different bank groups. Rows of 12 chunks (head_dim
// 96, 192 bytes) start alternately at bank group 0 and 4: chunk c ^ ((r >> 1) & 3) stays within
// its row's 12 and puts the 8 rows in 8 groups too.
__device__ __forceinline__ u32 tile_offset_bytes(int row, int chunk) {
  const int swizzle = DCHUNKS % 8 == 0 ? row & 7 : (row >> 1) & 3;
  return (u32)(row * HEAD_DIM + ((chunk ^ swizzle) << 3)) * 2u;
}

// fp8 tile rows are HEAD_DIM bytes, in 16-byte chunks swizzled so that the main loop's fragment
// loads hit distinct banks: a K load reads chunks t + 4h of rows g (quarter-warp: rows 2q
// and 2q + 1, four chunks each), a V load one lane-g piece of rows 2t (+1, +8, +9) (quarter-warp:
// four rows, two chunks each).
__device__ __forceinline__ u32 fp8_tile_offset(int row, int chunk) {
  // 64-byte rows: rows 2q, 2q + 1 share no bank
  const int swizzle = HEAD_DIM == 64 ? (row >> 1) & 3 : ((row & 1) << 2) ^ (row & 6);
  return (u32)(row * HEAD_DIM + ((chunk ^ swizzle) << 4));
}

// The register path's layout of the head dim. Q K^T sums over the head dim in any order, so lane
// t's K bytes of a row are whole chunks t + 4h; k-step 4h + j takes word j of chunk h: its first
// two codes are the B fragment's k = 2t, 2t + 1, its last two k = 2t + 8, 2t + 9. Q's A fragments
// take the same dims (fp8_q_dim).
__device__ __forceinline__ int fp8_q_dim(int ks, int t) {
  return 16 * (t + 4 * (ks >> 2)) + 4 * (ks & 3);
}
// O = P V: lane g reads its V_PIECE_BYTES-byte pieces of each row; the output's n-tile i is byte
// i of every lane's pieces, so column c of n-tile i is dim fp8_v_dim(c, i).
enum : int { V_PIECE_BYTES = HEAD_DIM / 8 < 16 ? HEAD_DIM / 8 : 16 };
enum : int { V_PIECES = HEAD_DIM / 8 / V_PIECE_BYTES };
__device__ __forceinline__ u32 fp8_v_piece_offset(int row, int lane_g, int piece) {
  if constexpr (HEAD_DIM == 64) {
    return fp8_tile_offset(row, lane_g >> 1) + (lane_g & 1) * 8;
  } else {
    return fp8_tile_offset(row, lane_g + 8 * piece);
  }
}
__device__ __forceinline__ int fp8_v_dim(int column, int i) {
  return (i / V_PIECE_BYTES) * (8 * V_PIECE_BYTES) + column * V_PIECE_BYTES + i % V_PIECE_BYTES;
}
template <int WORDS>
__device__ __forceinline__ void ld_shared_words(u32 (&w)[WORDS], u32 addr) {
  static_assert(WORDS == 2 || WORDS == 4, "8- or 16-byte loads");
  if (WORDS == 4) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr));
  } else {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
  }
}

// A request's entry of DecodeParams::query_rows (MULTI_TOKEN): {first query row, q_len, KV
// length, window_left}.
__device__ __forceinline__ int4 request_rows(const DecodeParams& p, int req) {
  return __ldg(reinterpret_cast<const int4*>(p.query_rows) + req);
}
// The row of q and the output (query row x the model's heads + head) of virtual head `vhead`
// of request `req`; -1 past the request's q_len (a ragged batch's shorter requests).
__device__ __forceinline__ i64 query_row(const DecodeParams& p, int req, int vhead) {
  const int per_kv_head = p.num_qo_heads / p.num_kv_heads;
  const int kvh = vhead / per_kv_head, v = vhead - kvh * per_kv_head;
  const int j = v / p.q_group, head = kvh * p.q_group + (v - j * p.q_group);
  const int4 rows = request_rows(p, req);
  return j < rows.y ? (i64)(rows.x + j) * (p.num_kv_heads * p.q_group) + head : -1;
}

// The attention variant's hooks on the logits and the softmax, one a feature, each chosen at
// compile time from Build (ARCHITECTURE.md: how to add one).
struct Variant {
  // LogitsTransform, on each tile's scaled and masked scores: Gemma-2's soft cap (a build of
  // its own: the plain loop stays small). cap * tanh(s / cap) is monotonic, so the tile's max
  // is the cap of its max. A masked score stays -inf; +inf becomes NaN and NaN stays NaN, as
  // without a cap (a non-finite raw score must not be capped into a finite one). tanhf, not
  // 1 - 2 / (exp(2x) + 1): that cancels for small x, and a cap far above the scores would then
  // lose their precision (cap x 2**-24 absolute).
  enum : int { transforms_logits = Build::soft_cap };
  __device__ __forceinline__ static float transform_logit(float v, float cap, float inv_cap) {
    const float capped = cap * tanhf(v * inv_cap);
    return v == SPLITKV_NEG_INF ? v : v < -SPLITKV_NEG_INF ? capped : v - v;
  }
  // Sink: a head's sink logit (natural log; null: none) joins its softmax once, where its final
  // output is written, whatever merged.
  __device__ __forceinline__ static void join_sink(const DecodeParams& p, i64 row,
                                                   int num_heads, SlotState& state) {
    if (p.sinks != nullptr) {
      const int head = (int)(row % num_heads);
      state.add_logit(__uint_as_float(ld_after_wait_u32(p.sinks + head)) * SPLITKV_LOG2E);
    }
  }
};

// LogitsMask: the tokens each of a lane's rows (g, g + 8) sees; a tile that may hold others
// takes the masked path (partial_tile), where every score outside gets -inf. A plain build sees
// the chunk's tokens: only its last tile masks.
struct ChunkMask {
  int mask_from;    // the chunk's end
  __device__ __forceinline__ bool partial_tile(int tile_tok0) const {
    return tile_tok0 + TILE_N > mask_from;
  }
  __device__ __forceinline__ bool visible(int tok, int) const { return tok < mask_from; }
};
// MULTI_TOKEN: each row sees the tokens from row_lo (its window's first, 0 without one) to
// before row_end: its own position + 1 (and the chunk's end). Tiles reaching row 0's end, or
// starting before the last row's window start (the latest of the rows'), are masked.
struct QueryRowsMask {
  int row_end[2], row_lo[2];
  int mask_from, mask_below;
  __device__ __forceinline__ bool partial_tile(int tile_tok0) const {
    return tile_tok0 + TILE_N > mask_from || tile_tok0 < mask_below;
  }
  __device__ __forceinline__ bool visible(int tok, int r) const {
    return tok < row_end[r] && tok >= row_lo[r];
  }
};
using Mask = conditional<Build::multi_token, QueryRowsMask, ChunkMask>::type;

// Writes the output (and lse) of a merged state: four dims at `dim` of output row `row`
// (request x num_qo_heads + qo head; with MULTI_TOKEN, a virtual head, mapped by query_row).
__device__ __forceinline__ void write_output_slot(const DecodeParams& p, i64 row, int dim,
                                                  SlotState state) {
  int num_heads;
  if constexpr (Build::multi_token) {
    row = query_row(p, (int)(row / p.num_qo_heads), (int)(row % p.num_qo_heads));
    if (row < 0) return;
    num_heads = p.num_kv_heads * p.q_group;
  } else {
    num_heads = p.num_qo_heads;
  }
  Variant::join_sink(p, row, num_heads, state);
  const float4 o = state.output();
  store4(p.out + row * HEAD_DIM + dim, o.x, o.y, o.z, o.w);
  if (p.lse != nullptr && dim == 0) p.lse[row] = state.lse2() * SPLITKV_LN2;
}

// The workspace's partials lo..hi-1 of qo head `head`, four dims at `dim`, merged in that order
// (ld.cg: other CTAs of this launch may have written them).
__device__ __forceinline__ SlotState merge_workspace(const DecodeParams& p, int lo, int hi,
                                                     int head, int dim) {
  SlotState merged = SlotState::empty();
  for (int c0 = lo; c0 < hi; c0 += MERGE_BATCH) {
    float lse2[MERGE_BATCH];
    float4 o[MERGE_BATCH];
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j) {
      const i64 row = (i64)(c0 + j) * p.num_qo_heads + head;
      const bool valid = c0 + j < hi;
      lse2[j] = valid ? ld_cg(p.partial_lse + row) : SPLITKV_NEG_INF;
      o[j] = valid ? ld_cg4(p.partial_o + row * HEAD_DIM + dim) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    SlotState batch[MERGE_BATCH];
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j) batch[j] = SlotState::normalised(o[j], lse2[j]);
    merged.merge(batch);
  }
  return merged;
}

// Where four dims (dim, a multiple of 4) of warp-state row `row` live in WarpStates::o. With
// fp8 each lane holds runs of whole dims (fp8_v_dim) and stores them as float4s; the float4s of
// one aligned group of 8 are permuted by row parity and the lane's t (bits 3+ of the index), so
// the 8 lanes of a store phase hit 8 different bank groups.
__device__ __forceinline__ int state_offset(int row, int dim) {
  if constexpr (Build::fp8) {
    const int f4 = dim >> 2;
    const int swizzle = HEAD_DIM == 64 ? ((f4 >> 3) & 1) | ((row & 1) << 1)
                                       : ((f4 >> 3) & 3) | ((row & 1) << 2);
    return row * HEAD_DIM + ((f4 ^ swizzle) << 2);
  } else {
    return row * HEAD_DIM + dim;
  }
}

// After the main loop every warp leaves its unnormalised state of its 16 rows in the pipeline
// buffers: o [STATE_WARPS][16][HEAD_DIM] (state_offset), m and d [STATE_WARPS][16]; with
// WARPS_D > 1 the warps of one state each write their dims of it.
struct WarpStates {
  float* o;
  float* m;
  float* d;

  // The CTA's state of four dims of `row`: the WARPS_N warps of its row tile saw different
  // tokens; combined in warp order.
  __device__ __forceinline__ SlotState combined(int row, int dim) const {
    const int mt = row >> 4, lr = row & 15;
    SlotState parts[WARPS_N];
#pragma unroll
    for (int wn = 0; wn < WARPS_N; ++wn) {
      const int w = mt * WARPS_N + wn;
      const float4 v = *reinterpret_cast<const float4*>(o + state_offset(w * 16 + lr, dim));
      parts[wn] = {{v.x, v.y, v.z, v.w}, m[w * 16 + lr], d[w * 16 + lr]};
    }
    return SlotState::merged(parts);
  }
};

// Epilogues: `row` is a CTA row (qo head head0 + row), the slots are (row, 4 dims).

// A request in one chunk: the CTA's state is the output.
__device__ __forceinline__ void write_output(const DecodeParams& p, const WarpStates& warps,
                                             int req, int head0, int rows_valid) {
  for (int idx = threadIdx.x; idx < ROWS * (HEAD_DIM / 4); idx += NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    if (row >= rows_valid) continue;
    const int head = head0 + row;
    write_output_slot(p, (i64)req * p.num_qo_heads + head, dim, warps.combined(row, dim));
  }
}

// A chunk of a split request: its normalised partial goes to the workspace rows of its plan
// index.
__device__ __forceinline__ void write_partial(const DecodeParams& p, const WarpStates& warps,
                                              int plan_index, int head0, int rows_valid) {
  for (int idx = threadIdx.x; idx < ROWS * (HEAD_DIM / 4); idx += NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    if (row >= rows_valid) continue;
    const SlotState state = warps.combined(row, dim);
    const i64 prow = (i64)plan_index * p.num_qo_heads + (head0 + row);
    *reinterpret_cast<float4*>(p.partial_o + prow * HEAD_DIM + dim) = state.output();
    if (dim == 0) p.partial_lse[prow] = state.lse2();
  }
}

// After write_partial, with RECORD_TICKET_MERGE. Release: every thread fences its own partial stores,
// then the barrier makes all those fences happen-before thread 0's atomic. The CTA whose ticket
// is n_chunks - 1 saw every other CTA's increment, hence (by their fences) every other CTA's
// partials, and merges them all. atomicInc with limit n_chunks - 1 wraps the counter back to 0 on
// that last arrival, so the next launch and every CUDA-graph replay start from zero without a
// memset.
__device__ __forceinline__ void ticket_merge(const DecodeParams& p, int req, int head_item,
                                             int head0, int rows_valid,
                                             int merge_lo, int merge_hi) {
  const int n_chunks = merge_hi - merge_lo;
  __threadfence();
  __syncthreads();
  bool last_arrival = false;
  if (threadIdx.x == 0) {
    const unsigned slot = (unsigned)req * p.num_kv_heads * p.ctas_per_kv_head + head_item;
    const unsigned ticket = atomicInc(p.counters + slot, (unsigned)(n_chunks - 1));
    last_arrival = ticket == (unsigned)(n_chunks - 1);
  }
  if (!__syncthreads_or(last_arrival)) return;   // thread 0's answer, for the whole CTA
  __threadfence();  // acquire: the partial reads below (ld.cg, from L2) come after the ticket
  for (int idx = threadIdx.x; idx < rows_valid * (HEAD_DIM / 4); idx += NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    const int head = head0 + row;
    write_output_slot(p, (i64)req * p.num_qo_heads + head, dim,
                      merge_workspace(p, merge_lo, merge_hi, head, dim));
  }
}

// CLUSTER > 1: every CTA of the cluster leaves its normalised partial in its own shared memory
// (cl_o [ROWS][HEAD_DIM], cl_lse [ROWS]); after the barrier each merges a share of the output
// slots from all of them, in rank order.
__device__ __forceinline__ void cluster_merge(const DecodeParams& p, const WarpStates& warps,
                                              float* cl_o, float* cl_lse, int rank, int req,
                                              int head0, int rows_valid) {
  for (int idx = threadIdx.x; idx < ROWS * (HEAD_DIM / 4); idx += NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    if (row >= rows_valid) continue;
    const SlotState state = warps.combined(row, dim);
    *reinterpret_cast<float4*>(cl_o + row * HEAD_DIM + dim) = state.output();
    if (dim == 0) cl_lse[row] = state.lse2();
  }
  cluster_sync();
  const u32 cl_o_u32 = smem_u32(cl_o), cl_lse_u32 = smem_u32(cl_lse);
  for (int idx = rank + Build::cluster * threadIdx.x; idx < rows_valid * (HEAD_DIM / 4);
       idx += Build::cluster * NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    float lse2[Build::cluster];
    float4 o[Build::cluster];
#pragma unroll
    for (int j = 0; j < Build::cluster; ++j) {
      lse2[j] = ld_cluster(cluster_map(cl_lse_u32 + row * 4, j));
      o[j] = ld_cluster4(cluster_map(cl_o_u32 + (row * HEAD_DIM + dim) * 4, j));
    }
    SlotState parts[Build::cluster];
#pragma unroll
    for (int j = 0; j < Build::cluster; ++j) parts[j] = SlotState::normalised(o[j], lse2[j]);
    SlotState merged = SlotState::empty();
    merged.merge(parts);
    write_output_slot(p, (i64)req * p.num_qo_heads + head0 + row, dim, merged);
  }
  cluster_sync();  // no CTA exits while another may still read its shared memory
}

// Whether every query row of the CTA kept the unified max's band (UNIFIED_HI, UNIFIED_LO):
// each row's largest score over all the CTA's tokens (its lanes', then its warps' through
// `scratch`, NUM_WARPS x 16 floats of the free pipeline buffers), and a finite d and o x
// o_scale (fp8's v_scale, applied after) in every lane. A row with no query head (q_row null)
// or no token seen (-inf) is in band; `seen` says which rows saw a token (the others keep
// the empty state's m = -inf, so that a sink alone gives them its own LSE). One answer for the
// whole CTA (a barrier): all its threads stream again, or none.
__device__ __forceinline__ bool unified_rows_in_band(float* scratch, const RowState (&state)[2],
                                                     const float (&seen_max)[2],
                                                     const u16* const (&q_row)[2], float phi,
                                                     float o_scale, int warp, int warp_m, int g,
                                                     int t, bool upper_rows, bool (&seen)[2]) {
  float m[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = fmaxf(seen_max[r], __shfl_xor_sync(0xffffffffu, seen_max[r], 1));
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
    if (t == 0) scratch[warp * 16 + g + 8 * r] = m[r];
  }
  __syncthreads();
  bool out_of_band = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    seen[r] = false;
    if (q_row[r] == nullptr || (r == 1 && !upper_rows)) continue;
    float row_max = SPLITKV_NEG_INF;
#pragma unroll
    for (int wn = 0; wn < WARPS_N; ++wn)
      row_max = fmaxf(row_max, scratch[(warp_m * WARPS_N + wn) * 16 + g + 8 * r]);
    seen[r] = row_max != SPLITKV_NEG_INF;
    const float x = row_max - phi;
    out_of_band |= seen[r] && !(x >= -UNIFIED_LO && x <= UNIFIED_HI);
    bool finite = isfinite(state[r].d);
#pragma unroll
    for (int i = 0; i < 2 * DTILES_W; ++i) finite &= isfinite(state[r].o[i] * o_scale);
    out_of_band |= !finite;
  }
  return !__syncthreads_or(out_of_band);
}

// Page ids read with plain loads (a generic pointer: shared or global memory), or, from the page
// table in the main loop, through the read-only cache (what `const __restrict__` kernel arguments
// got without asking; struct members cannot be restrict).
struct PageIds {
  const int* ids;
  __device__ __forceinline__ int operator[](int i) const { return ids[i]; }
};
struct ReadOnlyPageIds {
  const int* ids;
  __device__ __forceinline__ int operator[](int i) const { return __ldg(ids + i); }
};

// The CTA's work item. One flat grid, kv heads (and their CTAs) fastest: the CTAs that read the
// same tokens of different heads run side by side, so together they sweep whole token rows of a
// page. In a cluster grid, the CLUSTER chunks of one request (and head item) are neighbours
// instead.
struct WorkItem {
  int rank;           // in the cluster (%cluster_ctarank of a 1-D cluster); 0 without one
  int record_index;   // the chunk record
  int kvh, head_cta;  // the kv head, and which of its ctas_per_kv_head CTAs
  // kvh x ctas_per_kv_head + head_cta: the ticket merge's counter takes this one value, so it
  // alone (not kvh and head_cta) stays live across the main loop for the epilogue
  int head_item;
  int group;          // query heads per kv head
  int head0;          // the CTA's first query head
  int rows_valid;     // its rows that hold a query head
};
__device__ __forceinline__ WorkItem locate(const DecodeParams& params) {
  WorkItem w;
  const int heads_per_chunk = params.num_kv_heads * params.ctas_per_kv_head;
  int head_item;
  if constexpr (Build::cluster > 1) {
    w.rank = blockIdx.x % Build::cluster;
    const int item = blockIdx.x / Build::cluster;                 // (request, head item)
    w.record_index = item / heads_per_chunk * Build::cluster + w.rank;
    head_item = item % heads_per_chunk;
  } else {
    w.rank = 0;
    w.record_index = blockIdx.x / heads_per_chunk;
    head_item = blockIdx.x % heads_per_chunk;
  }
  w.head_item = head_item;
  w.kvh = head_item / params.ctas_per_kv_head;
  w.head_cta = head_item % params.ctas_per_kv_head;
  w.group = params.num_qo_heads / params.num_kv_heads;
  w.head0 = w.kvh * w.group + w.head_cta * ROWS;
  w.rows_valid = min(ROWS, w.group - w.head_cta * ROWS);
  return w;
}

// This thread's place: its warp's row tile (warp_m), tokens (warp_n) and dims (warp_d, with
// WARPS_D > 1), the warp state it leaves (state_warp), and its lane's MMA row g and column t.
struct WarpRole {
  int tid, lane, warp, warp_m, warp_n, warp_d, state_warp, g, t;
};
__device__ __forceinline__ WarpRole warp_role() {
  WarpRole r;
  r.tid = threadIdx.x, r.lane = r.tid & 31, r.warp = r.tid >> 5;
  if constexpr (WARPS_D > 1) {
    r.warp_n = r.warp % WARPS_N, r.warp_d = r.warp / WARPS_N % WARPS_D;
    r.warp_m = r.warp / (WARPS_N * WARPS_D);
    r.state_warp = r.warp_m * WARPS_N + r.warp_n;   // its row tile's and tokens' state
  } else {
    r.warp_m = r.warp / WARPS_N, r.warp_n = r.warp % WARPS_N;
    r.warp_d = 0;
    r.state_warp = r.warp;
  }
  r.g = r.lane >> 2, r.t = r.lane & 3;
  return r;
}

// The page walk and the copies of K/V tiles. Each token group (the ROW_TILES x WARPS_D warps
// that share warp_n) copies only the rows it reads itself and waits only on its own barrier:
// the groups are independent pipelines, so one group's late copy does not stall the others (as
// a CTA-wide barrier per tile did). Page-table entries are fetched one tile ahead of the copies
// that need them, so the dependent lookup latency overlaps the math of the current tile instead
// of stalling it.
struct KvPipeline {
  enum : int {
    LOADS = TOK_PER_WARP * COPY_SLOTS / GROUP_THREADS,  // 16-byte copies per thread per tile
    ROW_STEP = GROUP_THREADS / COPY_SLOTS,             // rows my_row0 + i * ROW_STEP
  };
  u32 k_smem_u32, v_smem_u32;
  // the caches as bytes: offsets below are in elements, and an fp8 element is a byte
  const unsigned char* k_bytes;
  const unsigned char* v_bytes;
  int tok_begin, tok_end, num_tiles, page_size, page_shift, warp_n;
  int my_chunk, my_row0;
  int pg[LOADS], slot[LOADS];
  bool step_within_page;
  // Byte offsets within a page in 32 bits (the wrapper checks that a page spans under 2 GiB):
  // a copy's address is one wide multiply of its page id, one multiply-add and a 64-bit add.
  int page_bytes, token_bytes, lane_bytes;
  // This thread's first row of the next tile to fetch, as a page index and the offset in that
  // page, carried from tile to tile: no division per tile.
  int tile_pages, tile_rest, next_page, next_off;
  bool fetched_full;   // the fetched tile lies wholly inside the chunk: no row checks

  __device__ __forceinline__ KvPipeline(const DecodeParams& params, unsigned char* smem, int kvh,
                                        int tok_begin_, int tok_end_, int page_size_,
                                        int page_shift_, const WarpRole& role) {
    tok_begin = tok_begin_, tok_end = tok_end_, page_size = page_size_, page_shift = page_shift_;
    warp_n = role.warp_n;
    k_smem_u32 = smem_u32(smem), v_smem_u32 = k_smem_u32 + STAGES * STAGE_BYTES;
    k_bytes = reinterpret_cast<const unsigned char*>(params.k_cache);
    v_bytes = reinterpret_cast<const unsigned char*>(params.v_cache);
    num_tiles = (tok_end - tok_begin + TILE_N - 1) / TILE_N;
    const int group_tid = (role.warp_m * WARPS_D + role.warp_d) * 32 + role.lane;
    my_chunk = group_tid % COPY_SLOTS;
    my_row0 = warp_n * TOK_PER_WARP + group_tid / COPY_SLOTS;
    step_within_page = page_size >= ROW_STEP;
    page_bytes = (int)(params.page_stride * KV_BYTES);
    token_bytes = (int)(params.token_stride * KV_BYTES);
    lane_bytes = kvh * (int)(params.head_stride * KV_BYTES) + my_chunk * 16;
    tile_pages = TILE_N / page_size, tile_rest = TILE_N - tile_pages * page_size;
    next_page = (tok_begin + my_row0) / page_size;
    next_off = tok_begin + my_row0 - next_page * page_size;
    fetched_full = false;
  }

  // The group's rows of a tile are visible to the whole group.
  __device__ __forceinline__ void group_sync() const {
    if (GROUP_THREADS == 32) {
      __syncwarp();
    } else {
      named_barrier_sync<GROUP_THREADS>(1 + warp_n);
    }
  }

  template <class Table>
  __device__ __forceinline__ int page_id(Table table, int pidx) const {
    if constexpr (Build::cuts(CUT_PAGE_LOOKUP)) {
      return pidx;
    } else {
      return table[pidx];
    }
  }

  // The page ids and in-page offsets of this thread's rows of tile `tile` (-1: past the chunk).
  // The two ways through the pages (step within a page, or divide) and the masked last tile
  // are separate code paths chosen once per tile (fetch_pages): the compiler takes
  // DecodeParams' fields for values that may differ between threads and would not split them
  // off itself.
  template <class Table>
  __device__ __forceinline__ void walk(int tile, int tok0, Table table, int base_page, int pidx,
                                       int off, bool step, bool full) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int tok = tok0 + i * ROW_STEP;
      if (i > 0) {
        if (step) {
          off += ROW_STEP;
          if (off >= page_size) { off -= page_size; ++pidx; }
        } else if constexpr (Build::pow2_pages) {
          const int page = tok >> page_shift;
          pidx = page - base_page;
          off = tok & (page_size - 1);
        } else {
          const int page = tok / page_size;
          pidx = page - base_page;
          off = tok - page * page_size;
        }
      }
      pg[i] = (full || (tile < num_tiles && tok < tok_end)) ? page_id(table, pidx) : -1;
      slot[i] = off;
    }
  }

  // The page ids come from `table`: the record's copy in shared memory (its index 0 is the
  // chunk's first page, base_page = tok_begin / page_size) or the page table (base_page = 0).
  template <class Table>
  __device__ __forceinline__ void fetch_pages(int tile, Table table, int base_page) {
    const int tok0 = tok_begin + tile * TILE_N + my_row0;
    fetched_full = tok_begin + (tile + 1) * TILE_N <= tok_end;
    const int pidx = next_page - base_page, off = next_off;
    next_page += tile_pages;
    next_off += tile_rest;
    if (next_off >= page_size) { next_off -= page_size; ++next_page; }
    if (step_within_page) {
      if (fetched_full) walk(tile, tok0, table, base_page, pidx, off, true, true);
      else walk(tile, tok0, table, base_page, pidx, off, true, false);
    } else {
      if (fetched_full) walk(tile, tok0, table, base_page, pidx, off, false, true);
      else walk(tile, tok0, table, base_page, pidx, off, false, false);
    }
  }

  // Issue the copies of a tile into `stage` from the fetched entries; tokens past the chunk
  // are zero-filled without reading (a tile wholly inside the chunk has none).
  __device__ __forceinline__ void issue_copies(int stage, bool full) {
    const u32 stage_bytes = (u32)(stage * STAGE_BYTES);
    if (COPY_SLOTS != DCHUNKS && my_chunk >= DCHUNKS) return;   // a slot past the row
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int row = my_row0 + i * ROW_STEP;
      const bool valid = full || pg[i] >= 0;
      const i64 off = valid ? mul_wide(pg[i], page_bytes) + (slot[i] * token_bytes + lane_bytes) : 0;
      const u32 dst = stage_bytes + (Build::fp8 ? fp8_tile_offset(row, my_chunk)
                                                : tile_offset_bytes(row, my_chunk));
      const int bytes = Build::cuts(CUT_KV_READS) ? 0 : valid ? 16 : 0;
      cp_async16(k_smem_u32 + dst, k_bytes + off, bytes);
      cp_async16(v_smem_u32 + dst, v_bytes + off, bytes);
    }
  }
  __device__ __forceinline__ void issue_tile(int stage) {
    if (fetched_full) issue_copies(stage, true); else issue_copies(stage, false);
  }
};

// K's scale joins the scores' scale (base 2), V's the output (fp8; 1 otherwise).
struct KvScales {
  float v, score;
};
__device__ __forceinline__ KvScales kv_scales(const DecodeParams& params, int kvh) {
  if constexpr (Build::fp8) {
    const float k_scale = params.k_scale ? __uint_as_float(ld_after_wait_u32(params.k_scale + kvh * params.k_scale_stride))
                                         : params.k_scale_value;
    const float v_scale = params.v_scale ? __uint_as_float(ld_after_wait_u32(params.v_scale + kvh * params.v_scale_stride))
                                         : params.v_scale_value;
    return {v_scale, params.sm_scale_log2 * k_scale};
  } else {
    return {1.f, params.sm_scale_log2};
  }
}

// q as MMA A-fragments, one row tile per warp; rows past the group are zero.
struct QTile {
  u32 qf[KSTEPS][4];
  const u16* row[2];       // this lane's rows g and g + 8 of q; null: rows past the group
  const u16* rows;         // the plain build's: the CTA's first row of q
  float score_scale[2];    // rows g and g + 8's
  float alibi_slope[2];    // ALIBI: rows g and g + 8's slope x log2(e) (0: no query head)
  int alibi_position[2];   //   and their query's position in the request
  u32 smem;                // Q_SMEM: this lane's fragments in shared memory

  // k-step ks's A fragment: from the registers, or read back from shared memory (Q_SMEM)
  __device__ __forceinline__ void fragment(int ks, u32 (&a)[4]) const {
    if constexpr (Build::q_in_smem) {
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(smem + ks * 512));
    } else {
      a[0] = qf[ks][0]; a[1] = qf[ks][1]; a[2] = qf[ks][2]; a[3] = qf[ks][3];
    }
  }
};

// This lane's query rows r0 = g and r1 = g + 8 of its row tile, and the mask of the tokens each
// sees. With MULTI_TOKEN each is a query row's head (query_row) or nothing; false: every row of
// this CTA is past the request's q_len (a ragged batch's shorter request): it has no output and
// no partial, and so do this (request, kv head, CTA)'s CTAs of every chunk, which leave its
// ticket counter alone.
template <class MaskT>
__device__ __forceinline__ bool query_rows(const DecodeParams& params, const WorkItem& w, int req,
                                           int tok_end, int r0, int r1, QTile& q, MaskT& mask) {
  if constexpr (Build::multi_token) {
    const int4 req_rows = request_rows(params, req);
    if (w.head_cta * ROWS >= req_rows.y * params.q_group) return false;
    const int causal_start = req_rows.z - req_rows.y + 1;   // row 0's end: the first it masks
    const int window = req_rows.w;
    const int num_heads = params.num_kv_heads * params.q_group;   // a query row's heads
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r ? r1 : r0;
      const i64 qr = row < w.rows_valid ? query_row(params, req, w.head0 + row) : -1;
      q.row[r] = qr < 0 ? nullptr
                        : params.q + (qr / num_heads) * params.q_stride + (qr % num_heads) * HEAD_DIM;
      const int j = (w.head0 - w.kvh * w.group + row) / params.q_group;   // its query row
      mask.row_end[r] = min(tok_end, causal_start + j);
      mask.row_lo[r] = window < 0 ? 0 : causal_start - 1 + j - window;
      if constexpr (Build::alibi) {
        q.alibi_slope[r] = qr < 0 ? 0.f : __ldg(params.alibi_slopes_log2 + qr % num_heads);
        q.alibi_position[r] = causal_start - 1 + j;
      }
    }
    mask.mask_from = min(tok_end, causal_start);
    mask.mask_below = window < 0 ? 0 : req_rows.z - 1 - window;
  } else {
    q.rows = params.q + (i64)req * params.q_stride + w.head0 * HEAD_DIM;
    q.row[0] = r0 < w.rows_valid ? q.rows + r0 * HEAD_DIM : nullptr;
    q.row[1] = r1 < w.rows_valid ? q.rows + r1 * HEAD_DIM : nullptr;
    mask.mask_from = tok_end;
    if constexpr (Build::alibi) {       // one query, at the request's last position
      const int position = request_rows(params, req).z - 1;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = r ? r1 : r0;
        q.alibi_slope[r] = row < w.rows_valid ? __ldg(params.alibi_slopes_log2 + w.head0 + row)
                                              : 0.f;
        q.alibi_position[r] = position;
      }
    }
  }
  return true;
}

// q's fragments (ld_after_wait_u32: with PDL, q may be the previous kernel's output), each
// row's score scale, and with Q_SMEM the fragments in shared memory.
__device__ __forceinline__ void load_q(QTile& q, int r0, int r1, int rows_valid, float score_scale,
                                       unsigned char* smem, const WarpRole& role) {
  const int t = role.t;
  // (The plain build indexes q from the request's rows, as before the multi-token build: the
  // null-pointer form of the multi-token load made the fp8 kernel's main loop schedule worse.)
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const int c0 = Build::fp8 ? fp8_q_dim(ks, t) : ks * 16 + 2 * t;
    const int c1 = Build::fp8 ? c0 + 2 : c0 + 8;
    if constexpr (Build::multi_token) {
      q.qf[ks][0] = q.row[0] ? ld_after_wait_u32(q.row[0] + c0) : 0u;
      q.qf[ks][1] = q.row[1] ? ld_after_wait_u32(q.row[1] + c0) : 0u;
      q.qf[ks][2] = q.row[0] ? ld_after_wait_u32(q.row[0] + c1) : 0u;
      q.qf[ks][3] = q.row[1] ? ld_after_wait_u32(q.row[1] + c1) : 0u;
    } else {
      q.qf[ks][0] = r0 < rows_valid ? ld_after_wait_u32(q.rows + r0 * HEAD_DIM + c0) : 0u;
      q.qf[ks][1] = r1 < rows_valid ? ld_after_wait_u32(q.rows + r1 * HEAD_DIM + c0) : 0u;
      q.qf[ks][2] = r0 < rows_valid ? ld_after_wait_u32(q.rows + r0 * HEAD_DIM + c1) : 0u;
      q.qf[ks][3] = r1 < rows_valid ? ld_after_wait_u32(q.rows + r1 * HEAD_DIM + c1) : 0u;
    }
  }
  if constexpr (Build::fp8 && Build::bf16) {
    // bfloat16 q to float16 for the float16 MMAs, each row times 2**e that brings its largest
    // finite |q| into [2**14, 2**15): exact wherever float16 is normal (bfloat16 has fewer
    // mantissa bits); the row's score scale takes 2**-e. Infinities and NaN stay what they are.
#pragma unroll
    for (int r = 0; r < 2; ++r) {        // rows g (fragments 0, 2) and g + 8 (1, 3)
      u32 max_bits = 0;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int k = r; k < 4; k += 2)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const u32 bits = (q.qf[ks][k] >> (16 * half)) & 0x7FFFu;
            if (bits < 0x7F80u) max_bits = max(max_bits, bits);     // finite
          }
      max_bits = max(max_bits, __shfl_xor_sync(0xffffffffu, max_bits, 1));   // the row's lanes
      max_bits = max(max_bits, __shfl_xor_sync(0xffffffffu, max_bits, 2));
      const int e = max_bits == 0 ? 0 : min(64, 141 - (int)(max_bits >> 7));  // 141 = 127 + 14
      const float up = __int_as_float((127 + e) << 23);
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
        for (int k = r; k < 4; k += 2) {
          const u32 w = q.qf[ks][k];
          u32 h;
          asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h)
              : "f"(__uint_as_float(w & 0xFFFF0000u) * up), "f"(__uint_as_float(w << 16) * up));
          q.qf[ks][k] = h;
        }
      q.score_scale[r] = score_scale * __int_as_float((127 - e) << 23);
    }
  } else {
    q.score_scale[0] = q.score_scale[1] = score_scale;
  }
  if constexpr (Build::q_in_smem) {
    // Q's fragments to shared memory after the pipeline and the record's page ids, a 16-byte
    // word a lane a k-step, each warp its own (every lane reads back only what it wrote: no
    // barrier). At head_dim 256 the fragments are 64 registers, and the kernel spills without
    // this (docs/design/kernel.md, q in shared memory).
    q.smem = smem_u32(smem) + PIPELINE_BYTES + RECORD_PAGES * 4 +
             (u32)((role.warp * KSTEPS * 32 + role.lane) * 16);
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks)
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(q.smem + ks * 512),
                   "r"(q.qf[ks][0]), "r"(q.qf[ks][1]), "r"(q.qf[ks][2]), "r"(q.qf[ks][3]) : "memory");
  }
}

// S = Q K^T for this warp's tokens of a tile: s[st][nt] holds tokens n0 + 8 nt + 2t (+1), rows
// g, g + 8.
__device__ __forceinline__ void qk_tile(float (&s)[SUBTILES][2][4], const QTile& q, u32 ks_base,
                                        const WarpRole& role) {
  const int lane = role.lane, g = role.g, t = role.t;
#pragma unroll
  for (int st = 0; st < SUBTILES; ++st) {
    const int n0 = role.warp_n * TOK_PER_WARP + st * 16;
    // Even and odd k-steps accumulate separately: two shorter MMA dependency chains.
    float acc[2][2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) acc[h][nt][0] = acc[h][nt][1] = acc[h][nt][2] = acc[h][nt][3] = 0.f;
    if constexpr (Build::fp8) {
      // lane (g, t) widens row n0 + 8 nt + g's chunks t + 4h itself (fp8_q_dim's order)
#pragma unroll
      for (int h = 0; h < KSTEPS / 4; ++h) {
        u32 kw[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) ld_shared_words(kw[nt], ks_base + fp8_tile_offset(n0 + nt * 8 + g, t + 4 * h));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int ks = 4 * h + j;
          u32 qa[4];
          q.fragment(ks, qa);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            u32 b0, b1;
            fp8x4_to_half2x2(kw[nt][j], b0, b1);
            mma_16816(acc[ks & 1][nt], qa, b0, b1);
          }
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const int r = n0 + (lane & 7) + ((lane >> 4) << 3);
        const int c = ks * 2 + ((lane >> 3) & 1);
        u32 b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3, ks_base + tile_offset_bytes(r, c));
        u32 qa[4];
        q.fragment(ks, qa);
        mma_16816(acc[ks & 1][0], qa, b0, b1);
        mma_16816(acc[ks & 1][1], qa, b2, b3);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[st][nt][e] = acc[0][nt][e] + acc[1][nt][e];
  }
}

// The logits of a tile, in base 2: scaled, NaN for a non-finite raw score, with ALIBI the
// row's bias slope x (token - query position) (before the max: it is not monotonic in the
// score), masked to -inf where the mask says (masked: a tile that may hold tokens a row does
// not see), and each row's max. Rows g + 8 only where they hold a query head (upper).
__device__ __forceinline__ void scale_scores(float (&s)[SUBTILES][2][4], float (&tile_max)[2],
                                             const QTile& q, const Mask& mask,
                                             int tile_tok0, int warp_n, int t, bool masked,
                                             bool upper) {
#pragma unroll
  for (int st = 0; st < SUBTILES; ++st)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < (upper ? 4 : 2); ++e) {
        float v = s[st][nt][e] * q.score_scale[e >> 1];
        // a raw score of -inf (an Inf in q or K, or past float's range) is non-finite, so
        // NaN, as the host paths have it; only the mask below makes -inf
        v = v == SPLITKV_NEG_INF ? __int_as_float(0x7fc00000) : v;
        const int tok = tile_tok0 + warp_n * TOK_PER_WARP + st * 16 + nt * 8 + 2 * t + (e & 1);
        if constexpr (Build::alibi) {
          v += q.alibi_slope[e >> 1] * (float)(tok - q.alibi_position[e >> 1]);
        }
        if (masked) v = mask.visible(tok, e >> 1) ? v : SPLITKV_NEG_INF;
        s[st][nt][e] = v;
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], v);
      }
}

// Variant's logits transform on a tile's scores and its max (the soft cap's build only).
__device__ __forceinline__ void transform_scores(float (&s)[SUBTILES][2][4], float cap,
                                                 float inv_cap, bool upper) {
#pragma unroll
  for (int st = 0; st < SUBTILES; ++st)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < (upper ? 4 : 2); ++e)
        s[st][nt][e] = Variant::transform_logit(s[st][nt][e], cap, inv_cap);
}
__device__ __forceinline__ void transform_logits(const DecodeParams& params,
                                                 float (&s)[SUBTILES][2][4], float (&tile_max)[2],
                                                 bool upper_rows) {
  if constexpr (Variant::transforms_logits) {
    const float cap = params.logits_soft_cap_log2, inv_cap = 1.f / cap;
    if (upper_rows) transform_scores(s, cap, inv_cap, true); else transform_scores(s, cap, inv_cap, false);
    tile_max[0] = Variant::transform_logit(tile_max[0], cap, inv_cap);
    if (upper_rows) tile_max[1] = Variant::transform_logit(tile_max[1], cap, inv_cap);
  }
}

// The online softmax update (the running max): each row's max across its four lanes; d (and,
// where some row's max moved, O) rescaled; m_use: what the tile's scores are offset by.
__device__ __forceinline__ void update_max(RowState (&state)[2], float (&tile_max)[2],
                                           float (&m_use)[2], bool upper_rows) {
  float alpha[2] = {1.f, 1.f};
  bool max_moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (r == 1 && !upper_rows) break;
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    const float m_before = state[r].m;
    alpha[r] = state[r].raise_max(tile_max[r]);
    max_moved |= state[r].m != m_before;
    m_use[r] = state[r].offset();
  }
  // Rescaling O is needed only when some row's max moved; after the first tiles it rarely does.
  if (__any_sync(0xffffffffu, max_moved)) {
    state[0].scale_o(alpha[0]);
    if (upper_rows) state[1].scale_o(alpha[1]);
  }
}

// P = exp2(S - m) of subtile st into the rows' d (rows g + 8 only where upper; else zero).
__device__ __forceinline__ void exp_scores(float (&probs)[2][4], const float (&s)[2][4],
                                           const float (&m_use)[2], RowState (&state)[2],
                                           bool upper) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (e >= 2 && !upper) {
        probs[nt][e] = 0.f;
        continue;
      }
      probs[nt][e] = fast_exp2(s[nt][e] - m_use[e >> 1]);
      state[e >> 1].d += probs[nt][e];
    }
}

// O += P V. The S accumulators of two 8-token n-tiles are exactly the A fragment of P.
__device__ __forceinline__ void pv_tile(const float (&s)[SUBTILES][2][4], const float (&m_use)[2],
                                        RowState (&state)[2], u32 vs_base, bool upper_rows,
                                        const WarpRole& role) {
  const int lane = role.lane, g = role.g, t = role.t;
#pragma unroll
  for (int st = 0; st < SUBTILES; ++st) {
    float probs[2][4];
    if (upper_rows) exp_scores(probs, s[st], m_use, state, true); else exp_scores(probs, s[st], m_use, state, false);
    const u32 a[4] = {pack2_mma(probs[0][0], probs[0][1]), pack2_mma(probs[0][2], probs[0][3]),
                      pack2_mma(probs[1][0], probs[1][1]), pack2_mma(probs[1][2], probs[1][3])};
    const int n0 = role.warp_n * TOK_PER_WARP + st * 16;
    if constexpr (Build::fp8) {
      // The B fragments hold two tokens of one dim: lane (g, t) reads its pieces of rows
      // n0 + 2t, +1, +8, +9, pairs the rows' bytes of each dim (prmt), then widens the pairs.
#pragma unroll
      for (int piece = 0; piece < V_PIECES; ++piece) {
        u32 x[4][V_PIECE_BYTES / 4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
          ld_shared_words(x[r], vs_base + fp8_v_piece_offset(n0 + 2 * t + (r & 1) + (r >> 1) * 8, g, piece));
#pragma unroll
        for (int w = 0; w < V_PIECE_BYTES / 4; ++w) {
          u32 b[2][4];   // b[k][dim byte]: tokens 2t, 2t+1 (k = 0) or 2t+8, 2t+9 (k = 1)
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            fp8x4_to_half2x2(byte_perm(x[2 * k][w], x[2 * k + 1][w], 0x5140u), b[k][0], b[k][1]);
            fp8x4_to_half2x2(byte_perm(x[2 * k][w], x[2 * k + 1][w], 0x7362u), b[k][2], b[k][3]);
          }
#pragma unroll
          for (int d = 0; d < 4; ++d) {
            const int i = piece * V_PIECE_BYTES + 4 * w + d;   // n-tile: dims fp8_v_dim(column, i)
            mma_16816(state[0].o + 2 * i, state[1].o + 2 * i, a, b[0][d], b[1][d]);
          }
        }
      }
    } else {
#pragma unroll
      for (int dp = 0; dp < DTILES_W / 2; ++dp) {   // this warp's d-tiles of O
        const int r = n0 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int c = (role.warp_d * (DTILES_W / 2) + dp) * 2 + (lane >> 4);
        u32 b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3, vs_base + tile_offset_bytes(r, c));
        mma_16816(state[0].o + 4 * dp, state[1].o + 4 * dp, a, b0, b1);           // d-tile 2 dp
        mma_16816(state[0].o + 4 * dp + 2, state[1].o + 4 * dp + 2, a, b2, b3);   // 2 dp + 1
      }
    }
  }
}

// One pass over the chunk's tiles: the first STAGES - 1 tiles' copies, then per tile its QK,
// logits, softmax update and PV while the next tiles' copies fly. `unified` (the UNIFIED_MAX
// build's first pass): scores offset by phi, no max across lanes, no rescaling; each lane's
// largest scores go to seen_max.
__device__ __forceinline__ void stream_pass(const DecodeParams& params, KvPipeline& kv,
                                            const QTile& q, const Mask& mask,
                                            RowState (&state)[2], PageIds first_table,
                                            int first_base, const int* pages, bool upper_rows,
                                            bool unified, float phi, float (&seen_max)[2],
                                            const WarpRole& role) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    kv.fetch_pages(s, first_table, first_base);
    if (s < kv.num_tiles) kv.issue_tile(s);
    cp_async_commit();
  }
  kv.fetch_pages(STAGES - 1, first_table, first_base);

  int stage = STAGES - 1;   // tile % STAGES, carried
  for (int tile = 0; tile < kv.num_tiles; ++tile) {
    stage = stage == STAGES - 1 ? 0 : stage + 1;
    cp_async_wait<STAGES - 2>();
    kv.group_sync();  // the group's rows of tile `tile` are visible; stage (tile-1) % STAGES is free
    {
      const int next = tile + STAGES - 1;
      if (next < kv.num_tiles) kv.issue_tile(stage == 0 ? STAGES - 1 : stage - 1);   // next % STAGES
      cp_async_commit();
      kv.fetch_pages(next + 1, ReadOnlyPageIds{pages}, 0);
    }
    const u32 ks_base = kv.k_smem_u32 + (u32)(stage * STAGE_BYTES);
    const u32 vs_base = kv.v_smem_u32 + (u32)(stage * STAGE_BYTES);
    const int tile_tok0 = kv.tok_begin + tile * TILE_N;

    float s[SUBTILES][2][4];
    qk_tile(s, q, ks_base, role);

    // Online softmax over the tile, in base 2; masked tokens get -inf.
    float tile_max[2] = {SPLITKV_NEG_INF, SPLITKV_NEG_INF};
    if (mask.partial_tile(tile_tok0)) {
      if (upper_rows) scale_scores(s, tile_max, q, mask, tile_tok0, role.warp_n, role.t, true, true);
      else scale_scores(s, tile_max, q, mask, tile_tok0, role.warp_n, role.t, true, false);
    } else {
      if (upper_rows) scale_scores(s, tile_max, q, mask, tile_tok0, role.warp_n, role.t, false, true);
      else scale_scores(s, tile_max, q, mask, tile_tok0, role.warp_n, role.t, false, false);
    }
    transform_logits(params, s, tile_max, upper_rows);
    float m_use[2] = {phi, phi};
    if (unified) {              // a fixed offset: no max across lanes, no rescaling
      seen_max[0] = fmaxf(seen_max[0], tile_max[0]);
      seen_max[1] = fmaxf(seen_max[1], tile_max[1]);
    } else {
      update_max(state, tile_max, m_use, upper_rows);
    }
    pv_tile(s, m_use, state, vs_base, upper_rows, role);
  }
  // this CTA's streaming is done (a fallback pass only delays the end the next kernel waits for)
  if (!params.pdl_early_trigger && (!Build::unified_max || unified)) allow_dependent_launch();
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers are reused below
}

// The chunk's tiles into each row's state: one pass, or with UNIFIED_MAX the unified max's pass
// and, where a row falls outside its band, a second with the running max.
__device__ __forceinline__ void stream_chunk(const DecodeParams& params, unsigned char* smem,
                                             KvPipeline& kv, const QTile& q, const Mask& mask,
                                             RowState (&state)[2], PageIds first_table,
                                             int first_base, const int* pages, bool upper_rows,
                                             float v_scale, const WarpRole& role) {
  float seen_max[2] = {SPLITKV_NEG_INF, SPLITKV_NEG_INF};   // this lane's largest scores
  if constexpr (!Build::unified_max) {
    stream_pass(params, kv, q, mask, state, first_table, first_base, pages, upper_rows, false,
                0.f, seen_max, role);
  } else {
    const float phi = params.unified_max_log2;
    const int first_page = kv.next_page, first_off = kv.next_off;
    bool unified = true;
    for (;;) {
      stream_pass(params, kv, q, mask, state, first_table, first_base, pages, upper_rows,
                  unified, phi, seen_max, role);
      if (!unified) break;
      bool row_seen[2];
      if (!unified_rows_in_band(reinterpret_cast<float*>(smem), state, seen_max, q.row, phi,
                                v_scale, role.warp, role.warp_m, role.g, role.t, upper_rows,
                                row_seen)) {
        // the running max, from the first tile again (the record's page ids are still in place)
        if (role.tid == 0 && params.unified_fallbacks) atomicAdd(params.unified_fallbacks, 1u);
        unified = false;
        state[0] = RowState::empty();
        state[1] = RowState::empty();
        kv.next_page = first_page;
        kv.next_off = first_off;
        continue;
      }
      // each lane's state: offset phi (not yet summed over lanes); a row that saw no token stays empty
      state[0].m = row_seen[0] ? phi : SPLITKV_NEG_INF;
      state[1].m = row_seen[1] ? phi : SPLITKV_NEG_INF;
      break;
    }
  }
}

// Each warp's state of its 16 rows to shared memory, for the epilogue to combine the warps that
// share a row tile (they saw different tokens).
__device__ __forceinline__ WarpStates store_warp_states(unsigned char* smem, RowState (&state)[2],
                                                        float v_scale, const WarpRole& role) {
  const int g = role.g, t = role.t;
  float* so = reinterpret_cast<float*>(smem);
  const WarpStates warps = {so, so + STATE_WARPS * 16 * HEAD_DIM,
                            so + STATE_WARPS * 16 * (HEAD_DIM + 1)};
#pragma unroll
  for (int r = 0; r < 2; ++r) {   // the four lanes of a row saw different tokens
    state[r].d += __shfl_xor_sync(0xffffffffu, state[r].d, 1);
    state[r].d += __shfl_xor_sync(0xffffffffu, state[r].d, 2);
  }
  if constexpr (Build::fp8) {
#pragma unroll
    for (int i = 0; i < 2 * DTILES_W; ++i) {   // O = sum p v_stored x v_scale (d is unscaled)
      state[0].o[i] *= v_scale;
      state[1].o[i] *= v_scale;
    }
  }
  float* wo = warps.o + role.state_warp * 16 * HEAD_DIM;
#pragma unroll
  for (int i = 0; i < DTILES_W; ++i) {
    if constexpr (Build::fp8) {
      if (i % 4 != 0) continue;
      // column 2t + e of n-tiles i..i+3: four consecutive dims from fp8_v_dim
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float* o = state[r].o;
          *reinterpret_cast<float4*>(wo + state_offset(g + 8 * r, fp8_v_dim(2 * t + e, i))) =
              make_float4(o[2 * i + e], o[2 * i + 2 + e], o[2 * i + 4 + e], o[2 * i + 6 + e]);
        }
    } else {
      const int col = (role.warp_d * DTILES_W + i) * 8 + 2 * t;
      *reinterpret_cast<float2*>(wo + g * HEAD_DIM + col) = make_float2(state[0].o[2 * i], state[0].o[2 * i + 1]);
      *reinterpret_cast<float2*>(wo + (g + 8) * HEAD_DIM + col) = make_float2(state[1].o[2 * i], state[1].o[2 * i + 1]);
    }
  }
  if (t == 0 && role.warp_d == 0) {   // the WARPS_D warps of a state hold the same m and d
    const int w = role.state_warp;
    warps.m[w * 16 + g] = state[0].m; warps.m[w * 16 + g + 8] = state[1].m;
    warps.d[w * 16 + g] = state[0].d; warps.d[w * 16 + g + 8] = state[1].d;
  }
  __syncthreads();
  return warps;
}

// The epilogue of the chunk's output path: the cluster's merge, or the output (a request in
// one chunk), or the partial then, with RECORD_TICKET_MERGE, the last CTA's merge.
__device__ __forceinline__ void finish(const DecodeParams& params, const WarpStates& warps,
                                       const ChunkHeader& chunk, const WorkItem& w) {
  if constexpr (Build::cluster > 1) {
    float* cl_o = warps.d + STATE_WARPS * 16;                   // [ROWS][HEAD_DIM]
    cluster_merge(params, warps, cl_o, cl_o + ROWS * HEAD_DIM, w.rank, chunk.request, w.head0,
                  w.rows_valid);
  } else {
    if (chunk.chunk_end - chunk.chunk_begin == 1) {
      write_output(params, warps, chunk.request, w.head0, w.rows_valid);
      return;
    }
    write_partial(params, warps, chunk.plan_index, w.head0, w.rows_valid);
    if constexpr (!Build::cuts(CUT_TICKET_MERGE)) {
      if (chunk.flags & RECORD_TICKET_MERGE)
        ticket_merge(params, chunk.request, w.head_item, w.head0, w.rows_valid,
                     chunk.chunk_begin, chunk.chunk_end);
    }
  }
}

extern "C" __global__ void PARTIAL_BOUNDS PARTIAL_CLUSTER
decode_partial(const __grid_constant__ DecodeParams params) {
  // The K/V tiles start at the very beginning of shared memory, 128-byte aligned: no static
  // __shared__ variable may precede them. (A 4-byte flag once shifted them by 16 bytes, and
  // every 512-byte cp.async of a warp then touched twice the L2 sectors and three times the
  // shared-memory wavefronts it needs: the kernel was L2-bound at ~83% of the read bandwidth.)
  extern __shared__ __align__(128) unsigned char smem[];
  if constexpr (Build::cuts(CUT_ALL)) {
    if (blockDim.x > 0) return;
  }
  const int page_size = params.page_size;
  // the wrapper builds POW2_PAGES only for 2**k pages
  const int page_shift = Build::pow2_pages ? 31 - __clz(page_size) : 0;
  const WorkItem w = locate(params);
  // The chunk record (decode_params.cuh). With `pages_in_record` (chunks start on a page
  // boundary, and the first STAGES tiles fit in those pages) the page ids go to shared memory
  // alongside the header loads: the first K/V copies wait for one round trip, not two.
  const ChunkRecord* record = params.records + w.record_index;
  int* record_pages = reinterpret_cast<int*>(smem + PIPELINE_BYTES);
  if (params.pages_in_record) {
    if (threadIdx.x < RECORD_PAGES / 4)
      cp_async16(smem_u32(record_pages) + threadIdx.x * 16,
                 reinterpret_cast<const int4*>(record->first_pages) + threadIdx.x, 16);
    cp_async_commit();
  }
  const ChunkHeader chunk = load_header(record);
  if (chunk.request < 0) {   // an idle slot of a graph-stable grid
    if (params.pages_in_record) cp_async_wait<0>();
    // Ends only after the kernel before it: a grid of idle CTAs alone (an empty batch) must
    // not break the chain by which each PDL kernel's end implies its predecessors'.
    wait_for_prior_grid();
    return;
  }
  const bool record_pages_used = params.pages_in_record && (chunk.flags & RECORD_HAS_PAGES);
  // With PDL, the next kernel in the stream may launch once every CTA of this grid has allowed
  // it: here (`pdl_early_trigger`) or when its streaming is done (stream_pass). Either way it
  // waits for this grid's end before reading anything this grid writes.
  if (params.pdl_early_trigger) allow_dependent_launch();
  const int req = chunk.request, tok_begin = chunk.token_begin, tok_end = chunk.token_end;
  const int* pages = params.kv_indices + chunk.page_table_begin;
  const WarpRole role = warp_role();
  KvPipeline kv(params, smem, w.kvh, tok_begin, tok_end, page_size, page_shift, role);
  // Rows g and g+8 of this warp's row tile; d holds this lane's share of each denominator until
  // the end.
  RowState state[2] = {RowState::empty(), RowState::empty()};
  // Rows g + 8 hold query heads only in groups over 8 (or a later row tile): else their softmax
  // is skipped and their rows of P are zero (an MMA keeps its rows apart; they are never written).
  const bool upper_rows = role.warp_m * 16 + 8 < w.rows_valid;

  if (params.pages_in_record) {   // the record's page ids are in shared memory
    cp_async_wait<0>();
    __syncthreads();
  }
  // Programmatic dependent launch: the chunk records and the page table are the wrapper's own
  // uploads, complete before this kernel could start (a copy on this stream before the kernel
  // ahead of it, or an event this stream waited on), so they were read above; q,
  // the K/V cache and the workspace may be written by the kernel just before (or read by it:
  // the previous merge reads the partials this kernel overwrites), so they wait for its end.
  wait_for_prior_grid();
  const KvScales scales = kv_scales(params, w.kvh);
  QTile q;
  Mask mask;
  const int r0 = role.warp_m * 16 + role.g, r1 = r0 + 8;
  if (!query_rows(params, w, req, tok_end, r0, r1, q, mask)) return;
  load_q(q, r0, r1, w.rows_valid, scales.score, smem, role);

  // The first tiles' page ids: from the record (in shared memory) if it has them.
  const PageIds first_table = {record_pages_used ? record_pages : pages};
  const int first_base = record_pages_used ? tok_begin / page_size : 0;
  stream_chunk(params, smem, kv, q, mask, state, first_table, first_base, pages, upper_rows,
               scales.v, role);
  const WarpStates warps = store_warp_states(smem, state, scales.v, role);
  finish(params, warps, chunk, w);
}

// One thread per (request, qo head, 4 dims) of the batch; rows of unsplit requests are skipped.
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
merge_partials(const __grid_constant__ DecodeParams params) {
  allow_dependent_launch();
  wait_for_prior_grid();   // the partials are the previous kernel's output
  if constexpr (Build::cuts(CUT_MERGE_KERNEL)) {
    if (blockDim.x > 0) return;
  }
  const int slot = blockIdx.x * NUM_THREADS + threadIdx.x;
  const int slot_row = slot / (HEAD_DIM / 4), dim = (slot % (HEAD_DIM / 4)) * 4;
  const int head = slot_row % params.num_qo_heads;
  int req;
  if (params.split_requests) {        // the split requests' rows only (compact_merge)
    if (slot_row >= params.num_split_requests * params.num_qo_heads) return;
    req = __ldg(params.split_requests + slot_row / params.num_qo_heads);
  } else {
    if (slot_row >= params.batch_size * params.num_qo_heads) return;
    req = slot_row / params.num_qo_heads;
  }
  const int row = req * params.num_qo_heads + head;
  const int lo = __ldg(params.merge_indptr + req), hi = __ldg(params.merge_indptr + req + 1);
  if (hi - lo <= 1) return;  // the partial kernel wrote this row directly
  if constexpr (Build::multi_token) {
    if (query_row(params, req, head) < 0) return;   // past the request's query rows
  }
  write_output_slot(params, row, dim, merge_workspace(params, lo, hi, head, dim));
}
