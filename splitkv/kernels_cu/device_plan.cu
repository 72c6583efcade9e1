// The planning kernel: one CTA runs device_plan.cuh's planner over the batch in device memory
// and writes the plan's chunk records, merge_indptr and state for a graph-stable wrapper's
// fixed grid (runtime/device_planner.py launches it; the CPU tests run the same steps on one
// thread: tests/helpers/device_plan_host.cpp). Compiled with --fmad=false: the float64
// formulas round as NumPy's.
#define DEVICE_PLAN_HD __device__
#include "device_plan.cuh"

using namespace device_plan;

#define PLAN_THREADS 512
#define PLAN_WARPS (PLAN_THREADS / 32)

__device__ __forceinline__ i64 warp_sum(i64 v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ i64 warp_max(i64 v) {
  for (int o = 16; o; o >>= 1) {
    const i64 w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Exclusive prefix sum of one int per thread over the CTA; *total gets the sum.
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_totals[PLAN_WARPS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += x;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int t = lane < PLAN_WARPS ? warp_totals[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, t, o);
      if (lane >= o) t += x;
    }
    if (lane < PLAN_WARPS) warp_totals[lane] = t;    // inclusive over warps
  }
  __syncthreads();
  const int before = warp ? warp_totals[warp - 1] : 0;
  *total = warp_totals[PLAN_WARPS - 1];
  return before + inclusive - v;
}

// With DEVICE_PLAN_PHASES defined (benchmarks/device_plan_cost.py --phases), thread 0
// stamps the SM clock as the kernel starts, as each step below begins (the first step twice:
// again once its own request is read) and at the end, into device_plan_phases[0..9], so that
// the kernel's time splits by step; otherwise the stamps compile to nothing.
#define PLAN_STAMPS 10
#ifdef DEVICE_PLAN_PHASES
__device__ long long device_plan_phases[PLAN_STAMPS];
#define PLAN_PHASE(k) if (threadIdx.x == 0) device_plan_phases[k] = clock64();
#else
#define PLAN_PHASE(k)
#endif

extern "C" __global__ void __launch_bounds__(PLAN_THREADS, 1)
plan_decode(const __grid_constant__ DevicePlanParams p) {
  __shared__ Candidates cands;
  __shared__ RowSums sums[MAX_ROWS];
  __shared__ i64 per_warp[PLAN_WARPS][5];    // tokens, tiles, pages, max length, empty requests
  __shared__ Choice best;
  __shared__ double predicted[2 * MAX_ROWS];
  __shared__ i64 slot_values[END_SLOT];
  __shared__ int misaligned;
  __shared__ int bad_rows;                    // some query_rows entry was bad
  extern __shared__ int shared_scratch[];     // the scratch, when it fits (scratch_in_shared)
  PLAN_PHASE(0)
  DevicePlanState& st = *reinterpret_cast<DevicePlanState*>(p.state);
  const Scratch sc = scratch_at(p.scratch_in_shared ? shared_scratch : p.scratch, p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = p.batch_size;
  const int filled = st.filled;               // read by every thread before thread 0 rewrites it
  if (tid == 0) misaligned = bad_rows = 0;
  __syncthreads();

  PLAN_PHASE(1)
  // 1. the requests: lengths, errors, sums and maxima (every lane of a warp takes as many
  // turns, those past the batch idle)
  i64 tokens = 0, tiles = 0, pages = 0, longest = 0, empty = 0;
  for (int base = 0; base < n; base += PLAN_THREADS) {
    const int b = base + tid;
    if (b >= n) continue;
    const Request r = read_request(p, b);
    if (r.error && atomicCAS(&st.error, 0, r.error) == 0) st.error_request = b;
    const int len = read_len(p, r.len);   // the window's tokens, with a window
    sc.lens[b] = len;
    sc.kv_begin[b] = r.len - len;
    sc.table_begin[b] = (int)r.table_begin;
    sc.table_last[b] = r.error ? -1 : (int)r.table_last;
    tokens += len;
    tiles += ceil_div(len, TILE);
    pages += r.pages;
    longest = len > longest ? len : longest;
    empty += len == 0;
  }
  PLAN_PHASE(2)
  if (p.query_rows != nullptr) {   // multi-token decode: each request's rows (the same thread
    for (int b = tid; b < p.max_batch; b += PLAN_THREADS) {   // wrote its length above)
      const int error = write_query_rows(p, b, b < n ? sc.lens[b] + sc.kv_begin[b] : 0);
      if (error && atomicCAS(&st.error, 0, error) == 0) st.error_request = b;
      if (error) bad_rows = 1;
    }
  }
  // each warp's sums and maximum, then every thread adds the warps' (no atomics: their order
  // would not matter, but a 64-bit shared-memory maximum is a compare-and-swap loop)
  tokens = warp_sum(tokens); tiles = warp_sum(tiles); pages = warp_sum(pages);
  longest = warp_max(longest); empty = warp_sum(empty);
  if (lane == 0) {
    per_warp[warp][0] = tokens; per_warp[warp][1] = tiles; per_warp[warp][2] = pages;
    per_warp[warp][3] = longest; per_warp[warp][4] = empty;
  }
  __syncthreads();
  if (bad_rows)                     // past a bad entry the rows may overlap: none has rows
    for (int b = tid; b < p.max_batch; b += PLAN_THREADS) clear_query_rows(p, b);
  i64 total = 0, total_tiles = 0, total_pages = 0, longest_len = 0, empties = 0;
#pragma unroll
  for (int w = 0; w < PLAN_WARPS; ++w) {
    total += per_warp[w][0]; total_tiles += per_warp[w][1]; total_pages += per_warp[w][2];
    longest_len = per_warp[w][3] > longest_len ? per_warp[w][3] : longest_len;
    empties += per_warp[w][4];
  }
  const int max_len = (int)longest_len, num_empty = (int)empties;

  PLAN_PHASE(3)
  // 2. the candidate rows: the first warp, two slots a lane
  if (warp == 0) {
    const CandidateSpace cs = candidate_space(n, max_len, total, p.items_per_chunk, p.slots);
    for (int s = lane; s < END_SLOT; s += 32) slot_values[s] = slot_value(s, cs);
    __syncwarp();
    const bool low = slot_kept(lane, slot_values), high = slot_kept(lane + 32, slot_values);
    const unsigned long long kept = __ballot_sync(0xffffffffu, low)
                                  | (unsigned long long)__ballot_sync(0xffffffffu, high) << 32;
    if (low) cands.rows[slot_position(lane, kept, slot_values)] = slot_row(lane, slot_values[lane]);
    if (high)
      cands.rows[slot_position(lane + 32, kept, slot_values)] = slot_row(lane + 32, slot_values[lane + 32]);
    if (lane == 0) cands.num_rows = popcount64(kept);
  }
  __syncthreads();

  PLAN_PHASE(4)
  // 3. each row's sums over the requests: one warp per row
  for (int r = warp; r < cands.num_rows; r += PLAN_WARPS) {
    RowSums s = {};
    for (int b = lane; b < n; b += 32) add_request(s, cands.rows[r], sc.lens[b], num_empty > 0);
    s.chunks = warp_sum(s.chunks);       // may pass 2**32 (a candidate too fine to choose)
    s.odd = warp_sum(s.odd);             // at most the chunks
    // the rest fit 32 bits (lengths < 2**31): one instruction each
    s.min2 = __reduce_add_sync(0xffffffffu, (unsigned)s.min2);
    s.largest_tokens = __reduce_max_sync(0xffffffffu, (unsigned)s.largest_tokens);
    s.max_m = __reduce_max_sync(0xffffffffu, (unsigned)s.max_m);
    s.max_k = __reduce_max_sync(0xffffffffu, (unsigned)s.max_k);
    if (lane == 0) sums[r] = s;
  }
  __syncthreads();

  PLAN_PHASE(5)
  // 4. the cheapest candidate: one thread per (row, strategy) pair
  const int pairs = num_pairs(cands);
  if (tid < pairs) {
    const Scorer scorer = {&p, (double)total, (double)total_tiles, (double)max_len, n, num_empty};
    predicted[tid] = pair_prediction(scorer, cands, sums, tid, p.max_chunks);
  }
  __syncthreads();
  if (warp == 0) {                     // the first cheapest: a warp's argmin, ties to the lower
    // pair (pairs <= 2 x MAX_ROWS), as the serial `cheapest` scans: a NaN is never less than
    // anything, so it is passed over (read here as +inf), unless pair 0 is one, which then stays
    const double inf = infinity();
    int at = lane;
    double value = lane < pairs && !isnan(predicted[lane]) ? predicted[lane] : inf;
    for (int i = lane + 32; i < pairs; i += 32)
      if (predicted[i] < value) { value = predicted[i]; at = i; }
    if (lane >= pairs) at = pairs;
    for (int o = 16; o; o >>= 1) {
      const double v = __shfl_xor_sync(0xffffffffu, value, o);
      const int i = __shfl_xor_sync(0xffffffffu, at, o);
      if (v < value || (v == value && i < at)) { value = v; at = i; }
    }
    if (lane == 0) {
      if (isnan(predicted[0])) at = 0;
      best = pair_choice(at);
      best.predicted_us = predicted[at];
    }
  }
  __syncthreads();
  const Row row = cands.rows[best.row];

  PLAN_PHASE(6)
  // 5. its chunks: counts per request, their prefix sum, then every chunk by its own thread
  const int per_thread = (n + PLAN_THREADS - 1) / PLAN_THREADS;
  const int lo = min(n, tid * per_thread), hi = min(n, lo + per_thread);
  int count = 0;
  for (int b = lo; b < hi; ++b) {        // each request's count, kept in its offset until the scan
    sc.offsets[b] = (int)cut_request(row, sc.lens[b]).count;
    count += sc.offsets[b];
  }
  int num_chunks;
  int at = block_exclusive_scan(count, &num_chunks);
  for (int b = lo; b < hi; ++b) {
    const int chunks = sc.offsets[b];
    sc.offsets[b] = at;
    at += chunks;
  }
  if (tid == 0) sc.offsets[n] = num_chunks;
  __syncthreads();
  bool aligned = true;
  for (int c = tid; c < num_chunks; c += PLAN_THREADS) {
    int b = 0, top = n - 1;              // the request: the last b with offsets[b] <= c
    while (b < top) {
      const int mid = (b + top + 1) / 2;
      if (sc.offsets[mid] <= c) b = mid; else top = mid - 1;
    }
    const int begin = write_chunk(sc, row, cut_request(row, sc.lens[b]), b, c - sc.offsets[b], c);
    aligned &= begin % p.page_size == 0;
  }
  if (!aligned) misaligned = 1;
  const int merge = merge_mode(best.strategy, num_chunks, n);

  PLAN_PHASE(7)
  // 6. the grid order: a stable sort by decreasing key
  int* keys = sc.keys;
  for (int i = tid; i < num_chunks; i += PLAN_THREADS)
    keys[i] = p.launch_order == LONGEST_CHUNKS ? sc.chunk_end[i] - sc.chunk_begin[i]
            : p.launch_order == LONGEST_REQUESTS
            ? sc.lens[sc.chunk_request[i]] + sc.kv_begin[sc.chunk_request[i]] : 0;
  __syncthreads();
  if (num_chunks <= 64) {                // few: a thread per chunk
    for (int i = tid; i < num_chunks; i += PLAN_THREADS)
      sc.order[grid_rank(keys, num_chunks, i)] = i;
  } else {                               // a warp per chunk, each lane a 32nd of the keys
    for (int i = warp; i < num_chunks; i += PLAN_WARPS) {
      const int key = keys[i];
      unsigned rank = 0;
#pragma unroll 4
      for (int j = lane; j < num_chunks; j += 32) rank += keys[j] > key || (keys[j] == key && j < i);
      rank = __reduce_add_sync(0xffffffffu, rank);
      if (lane == 0) sc.order[rank] = i;
    }
  }
  __syncthreads();

  PLAN_PHASE(8)
  // 7. the records (one warp writes one, lane j its int j), idle records past them,
  // merge_indptr, the state
  const int record_pages = misaligned ? 0 : p.record_pages;
  const int flags = (merge == MERGE_TICKET ? 1 : 0) | (record_pages ? 2 : 0);
  static_assert(sizeof(Record) == 4 * (8 + RECORD_PAGES) && 8 + RECORD_PAGES <= 32,
                "a warp writes one record, one int per lane");
  constexpr int RECORDS_IN_FLIGHT = 8;   // per warp: their page-id loads overlap
  for (int g0 = warp; g0 < num_chunks; g0 += RECORDS_IN_FLIGHT * PLAN_WARPS) {
    int value[RECORDS_IN_FLIGHT];
#pragma unroll
    for (int u = 0; u < RECORDS_IN_FLIGHT; ++u) {
      const int g = g0 + u * PLAN_WARPS;
      value[u] = 0;
      if (g >= num_chunks) continue;
      const int i = sc.order[g], b = sc.chunk_request[i];
      const int last = sc.table_last[b], begin = sc.chunk_begin[i];
      switch (lane) {
        case 0: value[u] = b; break;
        case 1: value[u] = begin; break;
        case 2: value[u] = sc.chunk_end[i]; break;
        case 3: value[u] = sc.table_begin[b]; break;
        case 4: value[u] = sc.offsets[b]; break;
        case 5: value[u] = sc.offsets[b + 1]; break;
        case 6: value[u] = i; break;
        case 7: value[u] = flags; break;
        default: {
          const int j = lane - 8;
          if (j < record_pages && total_pages > 0 && last >= 0) {
            const i64 e = (i64)sc.table_begin[b] + begin / p.page_size + j;
            value[u] = p.kv_indices[e < last ? e : last];
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < RECORDS_IN_FLIGHT; ++u) {
      const int g = g0 + u * PLAN_WARPS;
      if (g < num_chunks && lane < 8 + RECORD_PAGES)
        reinterpret_cast<int*>(&p.records[g])[lane] = value[u];
    }
  }
  for (int g = num_chunks + warp; g < filled; g += PLAN_WARPS)
    if (lane < 8 + RECORD_PAGES)
      reinterpret_cast<int*>(&p.records[g])[lane] = lane == 0 ? IDLE_REQUEST : 0;
  for (int b = tid; b <= p.max_batch; b += PLAN_THREADS)
    p.merge_indptr[b] = merge != MERGE_KERNEL ? 0 : sc.offsets[b < n ? b : n];
  if (tid == 0) record_plan(p, st, best, row, num_chunks, merge);
#ifdef DEVICE_PLAN_PHASES
  __syncthreads();
  PLAN_PHASE(9)
#endif
}
