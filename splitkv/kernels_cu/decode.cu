// Split-KV decode attention over a paged KV cache: the partial kernel, the fused variant, and
// the merge kernel.
//
// decode_partial: one CTA per work item (chunk, kv head, head tile), flat grid, heads fastest. It
// streams the chunk's tokens of K and V for that kv head through shared memory (cp.async, STAGES
// tiles of 64 tokens in flight, page-table lookups per token) and computes attention for all
// query heads of the GQA group at once on tensor cores: S = Q K^T and O += P V with mma.m16n8k16,
// query heads packed into the 16 MMA rows (HEAD_TILES row tiles of 16), so every K/V byte is read
// once per group. It writes either the final output (request not split) or an fp32 partial state
// (partial_o, partial_lse). With `fused`, the last CTA of a (request, kv head, head tile) to
// finish then merges all partials of that output itself.
//
// With CLUSTER = S > 1 (sm_90+; every request cut into exactly S chunks), the S CTAs of one
// (request, kv head, head tile) form a thread-block cluster: each leaves its partial state in
// its own shared memory, and after a cluster barrier they merge them by reading each other's
// shared memory. No workspace, no fence, no atomic ticket: the fused merge's round trips to L2
// are what short batch-1 calls spend most of their time on.
//
// merge_partials: one thread per (request, qo head, 4 dims) of a split request; merges its
// partials.
//
// Compile-time parameters: SPLITKV_BF16, HEAD_DIM, HEAD_TILES (1, 2, 4), STAGES, NUM_WARPS,
// MAX_REGISTERS, CLUSTER, RECORD_PAGES.
#include "softmax_state.cuh"

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef HEAD_TILES
#error "HEAD_TILES must be defined"
#endif
#ifndef STAGES
#error "STAGES must be defined"
#endif

#ifndef NUM_WARPS
#error "NUM_WARPS must be defined"
#endif
#define TILE_N (16 * NUM_WARPS)                // tokens per pipeline stage
#define NUM_THREADS (NUM_WARPS * 32)
#define WARPS_N (NUM_WARPS / HEAD_TILES)       // warps sharing one row tile split the tokens
#define TOK_PER_WARP (TILE_N / WARPS_N)
#define SUBTILES (TOK_PER_WARP / 16)
#define GROUP_THREADS (32 * HEAD_TILES)        // the warps that read the same tokens
#define ROWS (16 * HEAD_TILES)                 // query heads per CTA
#define DCHUNKS (HEAD_DIM / 8)                 // 16-byte chunks per row
#define KSTEPS (HEAD_DIM / 16)
#define DTILES (HEAD_DIM / 8)
#define PIPELINE_BYTES (STAGES * TILE_N * HEAD_DIM * 2 * 2)   // K and V tiles of every stage
#ifndef RECORD_PAGES
#error "RECORD_PAGES must be defined"
#endif
#define RECORD_INT4 (2 + RECORD_PAGES / 4)     // a chunk record: header, then the page ids
static_assert(RECORD_PAGES % 4 == 0 && RECORD_PAGES / 4 <= NUM_THREADS, "record copy");

// Shared-memory tile rows are HEAD_DIM halves; chunk c of row r lives at chunk c ^ (r & 7), so
// the 8 rows one ldmatrix reads fall in 8 different bank groups.
__device__ __forceinline__ u32 tile_offset_bytes(int row, int chunk) {
  return (u32)(row * HEAD_DIM + ((chunk ^ (row & 7)) << 3)) * 2u;
}

// MAX_REGISTERS > 0 caps the registers per thread (so that more CTAs fit on an SM); 0 leaves
// the choice to the compiler. (ptxas did not honour __launch_bounds__'s minimum-CTA hint.)
#ifndef MAX_REGISTERS
#define MAX_REGISTERS 0
#endif
#if MAX_REGISTERS > 0
#define PARTIAL_BOUNDS __maxnreg__(MAX_REGISTERS)
#else
#define PARTIAL_BOUNDS __launch_bounds__(NUM_THREADS, 1)
#endif

// CLUSTER > 1: the CTAs of one output are a cluster of that size (see above); 0 or 1: no cluster.
#ifndef CLUSTER
#define CLUSTER 0
#endif
#if CLUSTER > 1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "CLUSTER needs sm_90 or newer"
#endif
#define PARTIAL_CLUSTER __cluster_dims__(CLUSTER, 1, 1)
#else
#define PARTIAL_CLUSTER
#endif

extern "C" __global__ void PARTIAL_BOUNDS PARTIAL_CLUSTER
decode_partial(const u16* __restrict__ q, const u16* __restrict__ k_cache,
               const u16* __restrict__ v_cache, long long page_stride, long long token_stride,
               const int* __restrict__ kv_indices, const int4* __restrict__ chunk_info,
               u16* __restrict__ out, float* __restrict__ lse_out, float* __restrict__ partial_o,
               float* __restrict__ partial_lse, unsigned* __restrict__ counters,
               int num_qo_heads, int num_kv_heads, int head_tiles, int page_size, float scale_log2,
               int fused, int pages_in_record, int pdl_early) {
  // The K/V tiles start at the very beginning of shared memory, 128-byte aligned: no static
  // __shared__ variable may precede them. (A 4-byte flag once shifted them by 16 bytes, and
  // every 512-byte cp.async of a warp then touched twice the L2 sectors and three times the
  // shared-memory wavefronts it needs: the kernel was L2-bound at ~83% of the read bandwidth.)
  extern __shared__ __align__(128) unsigned char smem[];

  // One flat grid, kv heads (and head tiles) fastest: the CTAs that read the same tokens of
  // different heads run side by side, so together they sweep whole token rows of a page.
  // In a cluster grid, the CLUSTER chunks of one request (and head item) are neighbours instead.
  const int heads_per_chunk = num_kv_heads * head_tiles;
#if CLUSTER > 1
  const int rank = blockIdx.x % CLUSTER;                 // %cluster_ctarank of a 1-D cluster
  const int item = blockIdx.x / CLUSTER;                 // (request, head item)
  const int record_index = item / heads_per_chunk * CLUSTER + rank;
  const int head_item = item % heads_per_chunk;
#else
  const int record_index = blockIdx.x / heads_per_chunk;
  const int head_item = blockIdx.x % heads_per_chunk;
#endif
  const int kvh = head_item / head_tiles;
  const int htile = head_item % head_tiles;
  const int group = num_qo_heads / num_kv_heads;
  const int head0 = kvh * group + htile * ROWS;
  const int rows_valid = min(ROWS, group - htile * ROWS);
  // The chunk record, RECORD_INT4 int4: [0] = (request, first token, end token, first
  // page-table entry of the request), [1] = (first chunk of the request, end chunk, this
  // chunk's index in the plan, -): records are in the wrapper's launch order (by default the
  // longest chunks first; plan order for clusters), so the partial rows come from that index;
  // [2..] = the page ids of the chunk's first RECORD_PAGES pages. With `pages_in_record` (chunks start on a page
  // boundary, and the first STAGES tiles fit in those pages) the page ids go to shared memory
  // alongside the header loads: the first K/V copies wait for one round trip, not two.
  const int4* record = chunk_info + RECORD_INT4 * record_index;
  int* record_pages = reinterpret_cast<int*>(smem + PIPELINE_BYTES);
  if (pages_in_record) {
    if (threadIdx.x < RECORD_PAGES / 4)
      cp_async16(smem_u32(record_pages) + threadIdx.x * 16, record + 2 + threadIdx.x, 16);
    cp_async_commit();
  }
  const int4 info = record[0];
  const int4 info2 = record[1];
  // With PDL, the next kernel in the stream may launch once every CTA of this grid has allowed
  // it: here (`pdl_early`) or when its streaming is done (below). Either way it waits for this
  // grid's end before reading anything this grid writes.
  if (pdl_early) allow_dependent_launch();
  const int req = info.x, tok_begin = info.y, tok_end = info.z;
  const int* pages = kv_indices + info.w;
  const int merge_lo = info2.x, merge_hi = info2.y;
  const int n_chunks = merge_hi - merge_lo;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  const int g = lane >> 2, t = lane & 3;

  u16* k_smem = reinterpret_cast<u16*>(smem);
  u16* v_smem = k_smem + STAGES * TILE_N * HEAD_DIM;
  const u32 k_smem_u32 = smem_u32(k_smem), v_smem_u32 = smem_u32(v_smem);

  const int num_tiles = (tok_end - tok_begin + TILE_N - 1) / TILE_N;
  const i64 head_offset = (i64)kvh * HEAD_DIM;

  // Each token group (the HEAD_TILES warps that share warp_n) copies only the rows it reads
  // itself and waits only on its own barrier: the groups are independent pipelines, so one
  // group's late copy does not stall the others (as a CTA-wide barrier per tile did).
  // Page-table entries are fetched one tile ahead of the copies that need them, so the
  // dependent lookup latency overlaps the math of the current tile instead of stalling it.
  constexpr int LOADS = TOK_PER_WARP * DCHUNKS / GROUP_THREADS;  // 16-byte copies per thread per tile
  const int group_tid = warp_m * 32 + lane;
  const int my_chunk = group_tid % DCHUNKS;
  const int my_row0 = warp_n * TOK_PER_WARP + group_tid / DCHUNKS;  // rows my_row0 + i * ROW_STEP
  constexpr int ROW_STEP = GROUP_THREADS / DCHUNKS;
  auto group_sync = [&]() {
    if (HEAD_TILES == 1) {
      __syncwarp();
    } else {
      named_barrier_sync<GROUP_THREADS>(1 + warp_n);
    }
  };
  int pg[LOADS], slot[LOADS];
  const bool step_within_page = page_size >= ROW_STEP;
  // from_record: the entries come from the record's copy in shared memory, where page index 0
  // is the chunk's first page (a page boundary). The main loop passes a literal false.
  auto fetch_pages = [&](int tile, bool from_record) {
    const int tok0 = tok_begin + tile * TILE_N + my_row0;
    const int* table = from_record ? record_pages : pages;
    const int base = from_record ? tok_begin : 0;
    int pidx = (tok0 - base) / page_size, off = tok0 - base - pidx * page_size;  // one division per tile
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int tok = tok0 + i * ROW_STEP;
      if (i > 0) {
        if (step_within_page) {
          off += ROW_STEP;
          if (off >= page_size) { off -= page_size; ++pidx; }
        } else {
          pidx = (tok - base) / page_size;
          off = tok - base - pidx * page_size;
        }
      }
      pg[i] = (tile < num_tiles && tok < tok_end) ? table[pidx] : -1;
      slot[i] = off;
    }
  };
  // Issue the copies of a tile into `stage` from the fetched entries; tokens past the chunk
  // are zero-filled without reading.
  auto issue_tile = [&](int stage) {
    const u32 stage_bytes = (u32)(stage * TILE_N * HEAD_DIM * 2);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int row = my_row0 + i * ROW_STEP;
      const bool valid = pg[i] >= 0;
      const i64 off = valid ? (i64)pg[i] * page_stride + (i64)slot[i] * token_stride + head_offset + my_chunk * 8 : 0;
      const u32 dst = stage_bytes + tile_offset_bytes(row, my_chunk);
      cp_async16(k_smem_u32 + dst, k_cache + off, valid ? 16 : 0);
      cp_async16(v_smem_u32 + dst, v_cache + off, valid ? 16 : 0);
    }
  };

  float o[DTILES][4];
#pragma unroll
  for (int i = 0; i < DTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // Rows g and g+8; d holds this lane's share of each denominator until the end.
  SoftmaxState state[2] = {SoftmaxState::empty(), SoftmaxState::empty()};

  if (pages_in_record) {   // the record's page ids are in shared memory
    cp_async_wait<0>();
    __syncthreads();
  }
  // Programmatic dependent launch: the chunk records and the page table are the wrapper's own
  // uploads, complete before this kernel could start (a copy on this stream before the kernel
  // ahead of it, or an event this stream waited on), so they were read above; q,
  // the K/V cache and the workspace may be written by the kernel just before (or read by it:
  // the previous merge reads the partials this kernel overwrites), so they wait for its end.
  wait_for_prior_grid();
  // Q as MMA A-fragments, one row tile per warp; rows past the group are zero. (Loaded with
  // ld_after_wait_u32: with PDL, q may be the previous kernel's output.)
  u32 qf[KSTEPS][4];
  {
    const int r0 = warp_m * 16 + g, r1 = r0 + 8;
    const u16* q_rows = q + ((i64)req * num_qo_heads + head0) * HEAD_DIM;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int c0 = ks * 16 + 2 * t, c1 = c0 + 8;
      qf[ks][0] = r0 < rows_valid ? ld_after_wait_u32(q_rows + r0 * HEAD_DIM + c0) : 0u;
      qf[ks][1] = r1 < rows_valid ? ld_after_wait_u32(q_rows + r1 * HEAD_DIM + c0) : 0u;
      qf[ks][2] = r0 < rows_valid ? ld_after_wait_u32(q_rows + r0 * HEAD_DIM + c1) : 0u;
      qf[ks][3] = r1 < rows_valid ? ld_after_wait_u32(q_rows + r1 * HEAD_DIM + c1) : 0u;
    }
  }

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    fetch_pages(s, pages_in_record);
    if (s < num_tiles) issue_tile(s);
    cp_async_commit();
  }
  fetch_pages(STAGES - 1, pages_in_record);

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<STAGES - 2>();
    group_sync();  // the group's rows of tile `tile` are visible; stage (tile-1) % STAGES is free
    {
      const int next = tile + STAGES - 1;
      if (next < num_tiles) issue_tile(next % STAGES);
      cp_async_commit();
      fetch_pages(next + 1, false);
    }
    const int stage = tile % STAGES;
    const u32 ks_base = k_smem_u32 + (u32)(stage * TILE_N * HEAD_DIM * 2);
    const u32 vs_base = v_smem_u32 + (u32)(stage * TILE_N * HEAD_DIM * 2);
    const int tile_tok0 = tok_begin + tile * TILE_N;

    // S = Q K^T for this warp's tokens: s[st][nt] holds tokens n0 + 8 nt + 2t (+1), rows g, g+8.
    float s[SUBTILES][2][4];
#pragma unroll
    for (int st = 0; st < SUBTILES; ++st) {
      const int n0 = warp_n * TOK_PER_WARP + st * 16;
      // Even and odd k-steps accumulate separately: two shorter MMA dependency chains.
      float acc[2][2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) acc[h][nt][0] = acc[h][nt][1] = acc[h][nt][2] = acc[h][nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const int r = n0 + (lane & 7) + ((lane >> 4) << 3);
        const int c = ks * 2 + ((lane >> 3) & 1);
        u32 b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3, ks_base + tile_offset_bytes(r, c));
        mma_16816(acc[ks & 1][0], qf[ks], b0, b1);
        mma_16816(acc[ks & 1][1], qf[ks], b2, b3);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[st][nt][e] = acc[0][nt][e] + acc[1][nt][e];
    }

    // Online softmax over the tile, in base 2; masked tokens get -inf.
    float tile_max[2] = {SPLITKV_NEG_INF, SPLITKV_NEG_INF};
    const bool partial_tile = tile_tok0 + TILE_N > tok_end;   // only the last tile is masked
#pragma unroll
    for (int st = 0; st < SUBTILES; ++st)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[st][nt][e] * scale_log2;
          if (partial_tile) {
            const int tok = tile_tok0 + warp_n * TOK_PER_WARP + st * 16 + nt * 8 + 2 * t + (e & 1);
            v = tok < tok_end ? v : SPLITKV_NEG_INF;
          }
          s[st][nt][e] = v;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], v);
        }
    float alpha[2], m_use[2];
    bool max_moved = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_before = state[r].m;
      alpha[r] = state[r].raise_max(tile_max[r]);
      max_moved |= state[r].m != m_before;
      m_use[r] = state[r].offset();
    }
    // Rescaling O is needed only when some row's max moved; after the first tiles it rarely does.
    if (__any_sync(0xffffffffu, max_moved)) {
#pragma unroll
      for (int i = 0; i < DTILES; ++i) {
        o[i][0] *= alpha[0]; o[i][1] *= alpha[0];
        o[i][2] *= alpha[1]; o[i][3] *= alpha[1];
      }
    }

    // O += P V. The S accumulators of two 8-token n-tiles are exactly the A fragment of P.
#pragma unroll
    for (int st = 0; st < SUBTILES; ++st) {
      float p[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[nt][e] = fast_exp2(s[st][nt][e] - m_use[e >> 1]);
          state[e >> 1].d += p[nt][e];
        }
      const u32 a[4] = {pack2(p[0][0], p[0][1]), pack2(p[0][2], p[0][3]),
                        pack2(p[1][0], p[1][1]), pack2(p[1][2], p[1][3])};
      const int n0 = warp_n * TOK_PER_WARP + st * 16;
#pragma unroll
      for (int dp = 0; dp < DTILES / 2; ++dp) {
        const int r = n0 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int c = dp * 2 + (lane >> 4);
        u32 b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3, vs_base + tile_offset_bytes(r, c));
        mma_16816(o[2 * dp], a, b0, b1);
        mma_16816(o[2 * dp + 1], a, b2, b3);
      }
    }
  }
  if (!pdl_early) allow_dependent_launch();   // this CTA's streaming is done
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers are reused below

  // Combine the warps that share a row tile (they saw different tokens) through shared memory.
  float* so = reinterpret_cast<float*>(smem);                 // [NUM_WARPS][16][HEAD_DIM]
  float* sm = so + NUM_WARPS * 16 * HEAD_DIM;                 // [NUM_WARPS][16]
  float* sd = sm + NUM_WARPS * 16;                            // [NUM_WARPS][16]
  float* cl_o = sd + NUM_WARPS * 16;                          // [ROWS][HEAD_DIM], cluster only
  float* cl_lse = cl_o + ROWS * HEAD_DIM;                     // [ROWS], cluster only
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    state[r].d += __shfl_xor_sync(0xffffffffu, state[r].d, 1);
    state[r].d += __shfl_xor_sync(0xffffffffu, state[r].d, 2);
  }
  {
    float* wo = so + warp * 16 * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < DTILES; ++i) {
      const int col = i * 8 + 2 * t;
      *reinterpret_cast<float2*>(wo + g * HEAD_DIM + col) = make_float2(o[i][0], o[i][1]);
      *reinterpret_cast<float2*>(wo + (g + 8) * HEAD_DIM + col) = make_float2(o[i][2], o[i][3]);
    }
    if (t == 0) {
      sm[warp * 16 + g] = state[0].m; sm[warp * 16 + g + 8] = state[1].m;
      sd[warp * 16 + g] = state[0].d; sd[warp * 16 + g + 8] = state[1].d;
    }
  }
  __syncthreads();

  const bool direct = n_chunks == 1;
  for (int idx = tid; idx < ROWS * (HEAD_DIM / 4); idx += NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    if (row >= rows_valid) continue;
    const int mt = row >> 4, lr = row & 15;
    float m = SPLITKV_NEG_INF;
#pragma unroll
    for (int wn = 0; wn < WARPS_N; ++wn) m = fmaxf(m, sm[(mt * WARPS_N + wn) * 16 + lr]);
    float d = 0.f, a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
    for (int wn = 0; wn < WARPS_N; ++wn) {
      const int w = mt * WARPS_N + wn;
      const float scale = state_weight(sm[w * 16 + lr], m);
      d += sd[w * 16 + lr] * scale;
      const float4 v = *reinterpret_cast<const float4*>(so + (w * 16 + lr) * HEAD_DIM + dim);
      a0 += v.x * scale; a1 += v.y * scale; a2 += v.z * scale; a3 += v.w * scale;
    }
    const float inv = d > 0.f ? 1.f / d : 0.f;
    const float lse2 = SoftmaxState{m, d}.lse2();
    const int head = head0 + row;
    if (CLUSTER > 1) {
      *reinterpret_cast<float4*>(cl_o + row * HEAD_DIM + dim) = make_float4(a0 * inv, a1 * inv, a2 * inv, a3 * inv);
      if (dim == 0) cl_lse[row] = lse2;
    } else if (direct) {
      store4(out + ((i64)req * num_qo_heads + head) * HEAD_DIM + dim, a0 * inv, a1 * inv, a2 * inv, a3 * inv);
      if (lse_out != nullptr && dim == 0) lse_out[(i64)req * num_qo_heads + head] = lse2 * SPLITKV_LN2;
    } else {
      const i64 prow = (i64)info2.z * num_qo_heads + head;
      *reinterpret_cast<float4*>(partial_o + prow * HEAD_DIM + dim) = make_float4(a0 * inv, a1 * inv, a2 * inv, a3 * inv);
      if (dim == 0) partial_lse[prow] = lse2;
    }
  }
#if CLUSTER > 1
  // Every CTA of the cluster has its partial in its shared memory; each merges a share of the
  // output slots (row, 4 dims) from all of them, in rank order.
  cluster_sync();
  const u32 cl_o_u32 = smem_u32(cl_o), cl_lse_u32 = smem_u32(cl_lse);
  for (int idx = rank + CLUSTER * tid; idx < rows_valid * (HEAD_DIM / 4); idx += CLUSTER * NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    float lse2[CLUSTER];
    float4 po[CLUSTER];
#pragma unroll
    for (int j = 0; j < CLUSTER; ++j) {
      lse2[j] = ld_cluster(cluster_map(cl_lse_u32 + row * 4, j));
      po[j] = ld_cluster4(cluster_map(cl_o_u32 + (row * HEAD_DIM + dim) * 4, j));
    }
    MergeAccumulator merged;
    merged.add(lse2, po);
    const i64 out_row = (i64)req * num_qo_heads + head0 + row;
    const float lse_all = merged.finish(out + out_row * HEAD_DIM + dim);
    if (lse_out != nullptr && dim == 0) lse_out[out_row] = lse_all * SPLITKV_LN2;
  }
  cluster_sync();  // no CTA exits while another may still read its shared memory
  return;
#endif
  if (direct || !fused) return;

  // Fused merge. Release: every thread fences its own partial stores, then the barrier makes
  // all those fences happen-before thread 0's atomic. The CTA whose ticket is n_chunks - 1 saw
  // every other CTA's increment, hence (by their fences) every other CTA's partials. atomicInc
  // with limit n_chunks - 1 wraps the counter back to 0 on that last arrival, so the next launch
  // and every CUDA-graph replay start from zero without a memset.
  __threadfence();
  __syncthreads();
  bool last_arrival = false;
  if (tid == 0) {
    const unsigned slot = ((unsigned)req * num_kv_heads + kvh) * head_tiles + htile;
    const unsigned ticket = atomicInc(counters + slot, (unsigned)(n_chunks - 1));
    last_arrival = ticket == (unsigned)(n_chunks - 1);
  }
  if (!__syncthreads_or(last_arrival)) return;   // thread 0's answer, for the whole CTA
  __threadfence();  // acquire: the partial reads below (ld.cg, from L2) come after the ticket
  for (int idx = tid; idx < rows_valid * (HEAD_DIM / 4); idx += NUM_THREADS) {
    const int row = idx / (HEAD_DIM / 4), dim = (idx % (HEAD_DIM / 4)) * 4;
    const int head = head0 + row;
    const i64 out_row = (i64)req * num_qo_heads + head;
    const float lse2 = merge_slot<HEAD_DIM>(partial_o, partial_lse, merge_lo, merge_hi, head,
                                            num_qo_heads, dim, out + out_row * HEAD_DIM);
    if (lse_out != nullptr && dim == 0) lse_out[out_row] = lse2 * SPLITKV_LN2;
  }
}

// One thread per (request, qo head, 4 dims) of the batch; rows of unsplit requests are skipped.
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
merge_partials(const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
               const int* __restrict__ merge_indptr, u16* __restrict__ out,
               float* __restrict__ lse_out, int batch_size, int num_qo_heads) {
  allow_dependent_launch();
  wait_for_prior_grid();   // the partials are the previous kernel's output
  const int slot = blockIdx.x * NUM_THREADS + threadIdx.x;
  const int row = slot / (HEAD_DIM / 4), dim = (slot % (HEAD_DIM / 4)) * 4;
  if (row >= batch_size * num_qo_heads) return;
  const int req = row / num_qo_heads, head = row % num_qo_heads;
  const int lo = merge_indptr[req], hi = merge_indptr[req + 1];
  if (hi - lo <= 1) return;  // the partial kernel wrote this row directly
  const float lse2 = merge_slot<HEAD_DIM>(partial_o, partial_lse, lo, hi, head, num_qo_heads, dim,
                                          out + (i64)row * HEAD_DIM);
  if (lse_out != nullptr && dim == 0) lse_out[row] = lse2 * SPLITKV_LN2;
}
