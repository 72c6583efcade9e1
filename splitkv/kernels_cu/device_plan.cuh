// The planner on the device: choose a plan from the batch's lengths in device memory and write
// its chunk records, so that one captured graph serves any lengths within a graph-stable
// wrapper's capacity with no host work per step.
//
// It is the host planner (planner/planner.py, stats.py, features.py) written again for one
// CTA: the same candidates in the same order, the same statistics, the same float64 operations
// in the same order, the same tie-break (the first cheapest candidate) and the same records as
// records.chunk_records. The host planner stays the reference: the CPU tests compile this file
// with the host compiler beside a serial driver of their own (tests/helpers/device_plan_host.cpp)
// and check both choose the same plans and write the same records; the GPU tests check the
// kernel writes the same bytes.
//
// Defined before this file: by runtime/device_planner.py's header_defines, RECORD_PAGES, the
// cost model's columns from planner/features.py's table (DEVICE_PLAN_NUM_FEATURES and
// DEVICE_PLAN_FEATURES, see Scorer) and its rows from the same file's expressions
// (DEVICE_PLAN_ROW_INPUTS, DEVICE_PLAN_ROW_MEMBERS, DEVICE_PLAN_ROWS, see FeatureRows); by the
// includer, DEVICE_PLAN_HD (__device__ in device_plan.cu, nothing in the host tests).
//
// Integer statistics are sums and maxima of integers far below 2**53: exact in any order. The
// float64 formulas must not be contracted into FMAs (NVRTC --fmad=false; the host compiler
// -ffp-contract=off), so that both builds round as NumPy does.
#pragma once

namespace device_plan {

typedef long long i64;

// Must equal core/geometry.py, planner/planner.py, features.py (the runtime passes the
// shape's constants in DevicePlanParams; these are the planner's own).
constexpr int TILE = 64;                 // TILE_TOKENS
constexpr int TINY_CONTEXT = 2048;       // planner.TINY_CONTEXT
constexpr int MAX_WAVES = 32;            // planner.MAX_WAVES
constexpr int WAVE_FILL_MAX = 4;         // wave_filling_* max_waves
constexpr int NUM_FEATURES = DEVICE_PLAN_NUM_FEATURES;   // features.FEATURES
constexpr int MAX_ROWS = 64;             // candidate rows (no split, chunk sizes, split counts)
constexpr double NO_SPLIT_CHUNK = 1152921504606846976.0;   // 2**60
constexpr int IDLE_REQUEST = -1;

// Strategy codes (validation.STRATEGIES) and merge modes (execution.MERGE_MODES order).
constexpr int SINGLE = 0, SPLIT_MERGE = 1, FUSED = 2;
constexpr int MERGE_NONE = 0, MERGE_KERNEL = 1, MERGE_TICKET = 2;
// Launch orders (execution.LAUNCH_ORDERS order).
constexpr int LONGEST_CHUNKS = 0, LONGEST_REQUESTS = 1;   // 2: plan order

// Error codes in DevicePlanState::error (the first error a plan met; 0: none). A request with
// an error is planned as empty, and nothing past its own page-table entries is read.
// Bad query rows (ERR_BAD_QO_INDPTR) leave the plan as it is but give no request a query row:
// no output of the batch is written.
enum { ERR_NONE = 0, ERR_NEGATIVE_LENGTH = 1, ERR_PAGES_PAST_TABLE = 2, ERR_BAD_INDPTR = 3,
       ERR_BAD_LAST_PAGE_LEN = 4, ERR_BAD_QO_INDPTR = 5 };

struct Record {            // kernels_cu/decode_params.cuh ChunkRecord, field by field
  int request, token_begin, token_end, page_table_begin, chunk_begin, chunk_end, plan_index,
      flags;
  int first_pages[RECORD_PAGES];
};

// What the planning kernel reads and writes; runtime/device_planner.py mirrors it.
struct DevicePlanParams {
  // The batch, in one of two layouts: vLLM's seq_lens [batch] with a block table
  // [batch, block_table_stride] (block_table_stride > 0), or FlashInfer's kv_indptr [batch + 1]
  // and kv_last_page_len [batch] with kv_indices (block_table_stride == 0).
  const int* seq_lens;
  const int* kv_indptr;
  const int* kv_last_page_len;
  const int* kv_indices;            // the block table, or kv_indices
  i64 block_table_stride;
  i64 page_table_entries;           // entries of kv_indices (or of the block table)
  Record* records;                  // [max_chunks], in grid order; past the plan: idle
  int* merge_indptr;                // [max_batch + 1]
  int* scratch;                     // [DEVICE_PLAN_SCRATCH_INTS(max_chunks, batch)]
  int* state;                       // DevicePlanState, persistent across plans
  double* predicted_us;             // the chosen candidate's prediction
  double coef[NUM_FEATURES];        // the cost model's coefficients
  double unit[NUM_FEATURES];        // features.feature_constants' units
  double stream_ratio;              // features.stream_ratio_of(the model's bandwidth)
  int batch_size;
  int max_batch;
  int max_chunks;                   // the capacity: no plan of more chunks is chosen
  int items_per_chunk;              // kv heads x CTAs per kv head
  int slots;                        // SMs x CTAs per SM
  int num_sms;
  int page_size;
  int record_pages;                 // pages a chunk's first tiles span when they fit a record
                                    // (records.record_pages_needed), else 0
  int launch_order;
  int scratch_in_shared;            // 1: the kernel keeps its scratch in dynamic shared memory
  // Multi-token decode (a graph-stable wrapper made with max_q_len > 1): query_rows
  // [max_batch x 4] is written for the decode kernels (records.query_rows_array, no window),
  // from qo_indptr [batch + 1] (null: one row a request); null query_rows: one row a request.
  const int* qo_indptr;
  int* query_rows;
  int max_q_len;
  // A sliding window (DecodeProblem's window_left): each request's plan covers its last
  // window_left + 1 tokens (-1: all); with query rows, the window that covers every row's
  // (variants.covering_window_left), and rows_window_left the rows' own, for query_rows.
  int window_left;
  int rows_window_left;
  // Chunked local attention (DecodeProblem's attention_chunk_size): each request's plan
  // covers the tokens of its last position's chunk (0: none; one query row a request).
  int attention_chunk_size;
  // The tiles the model counts (features.build_tile_units): 64-token tiles in one tile of the
  // plan's build, for grids that give some SM two CTAs (short chunks, then chunks of a mean
  // of long_chunk_tokens or more) and for lone grids (the same two); all 1: 64-token tiles.
  int tile_units[4];
  double long_chunk_tokens;         // core.builds.LONG_CHUNK_TOKENS
};

// Persistent state, int32 each.
struct DevicePlanState {
  int filled;          // records the last plan wrote (the rest are idle)
  int error;           // ERR_*: the error of the first plan since the host cleared it that met
  int error_request;   //   one; error_request: one such request (on the GPU: whichever won)
  int num_chunks;      // of the last plan
  int pair;            // the chosen candidate's index in the planner's enumeration
  int value;           // its row's value: 1 (no split), chunk tokens or split count
  int kind;            // 0 no split, 1 chunk tokens, 2 split count
  int strategy;        // SINGLE, SPLIT_MERGE, FUSED
  int merge;           // MERGE_*
  int plans;           // plans made
};

#define DEVICE_PLAN_SCRATCH_INTS(max_chunks, batch) (5 * (max_chunks) + 5 * (batch) + 8)

DEVICE_PLAN_HD inline double dmin(double a, double b) { return b < a ? b : a; }  // np.minimum
DEVICE_PLAN_HD inline double dmax(double a, double b) { return b > a ? b : a; }  // np.maximum
DEVICE_PLAN_HD inline double infinity() {
  union { i64 bits; double value; } u;
  u.bits = 0x7ff0000000000000LL;
  return u.value;
}
DEVICE_PLAN_HD inline i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }
DEVICE_PLAN_HD inline int bit_length(i64 x) { int n = 0; while (x) { ++n; x >>= 1; } return n; }

// One candidate row: a chunk size (divisor), capped at a split count for split rows.
struct Row {
  double divisor;      // chunk tokens; TILE for a split row; 2**60 for no split
  double cap;          // the split count of a split row, else 0
  int value;           // 1, chunk tokens or split count
  int kind;            // 0 no split, 1 chunk tokens, 2 split count
  int tiny;            // a chunk size under one tile
  int align;           // chunk boundaries' alignment when built
};

// The sums and maxima over the requests that a row's statistics need, as integers; odd: the
// chunks of an odd number of tiles (stats.S_ODD_CHUNKS).
struct RowSums {
  i64 chunks, min2, largest_tokens, max_m, max_k, odd;
};

struct Candidates {
  Row rows[MAX_ROWS];
  int num_rows;
};

// planner._candidates, unforced: no split, the chunk sizes of at least a tile (powers of two,
// then the wave-filling sizes not already there), the split counts, the tiny chunk sizes.
// Each candidate has a slot whose value is found apart from the others, so that a warp's lanes
// take a slot each (the planning kernel) or one thread takes them all (enumerate_rows):
//   slot 0              no split
//   1 .. 25             the powers of two of at least a tile, largest first (slot s: the
//                       largest power below the longest request, halved s - 1 times)
//   26 .. 29            the wave-filling chunk sizes, j = 1..4 waves
//   30 .. 36            the wave-filling split counts (j = 1..4 waves, then 2, 3, 4), ascending
//   37, 38              the tiny chunk sizes, 32 and 16 tokens
// A slot's value is 0 where it holds no candidate; a chunk size or split count already held by
// an earlier slot of its kind is dropped (slot_kept); the kept slots are rows in slot order,
// except that the split counts run ascending (slot_position).
constexpr int POW_SLOT = 1, WAVE_SLOT = 26, SPLIT_SLOT = 30, TINY_SLOT = 37, END_SLOT = 39;
static_assert(END_SLOT <= MAX_ROWS && END_SLOT <= 64, "a slot is a bit of a 64-bit mask");

DEVICE_PLAN_HD inline int popcount64(unsigned long long x) {
#ifdef __CUDACC__
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// What every slot reads.
struct CandidateSpace {
  int batch, max_len, ipc, slots;
  i64 total;
  i64 top;          // the largest power of two below the longest request (1 when it has <= 2)
  double limit;     // max_useful_items: MAX_WAVES x slots work items
  bool halving;     // powers past the first are tried: the batch unsplit is within the limit
};

DEVICE_PLAN_HD inline CandidateSpace candidate_space(int batch, int max_len, i64 total, int ipc,
                                                     int slots) {
  CandidateSpace cs;
  cs.batch = batch; cs.max_len = max_len; cs.ipc = ipc; cs.slots = slots; cs.total = total;
  cs.top = (i64)1 << (bit_length(max_len - 1 > 1 ? max_len - 1 : 1) - 1);
  cs.limit = (double)MAX_WAVES * slots;
  cs.halving = (double)batch * ipc <= cs.limit;      // Python ints: exact either way
  return cs;
}

// Slot s's chunk tokens or split count (1 for no split), 0 where it holds no candidate.
DEVICE_PLAN_HD inline i64 slot_value(int s, const CandidateSpace& cs) {
  if (s == 0) return 1;
  if (s < WAVE_SLOT || s >= TINY_SLOT) {    // chunk_token_candidates: a power of two
    if (s >= END_SLOT) return 0;
    i64 size;
    if (s < WAVE_SLOT) {
      size = cs.top >> (s - POW_SLOT);
      if (size < TILE) return 0;
    } else {
      if (cs.max_len > TINY_CONTEXT) return 0;
      size = s == TINY_SLOT ? 32 : 16;
      if (size > cs.top) return 0;
    }
    if (size == cs.top) return size;      // the largest is always kept
    // after it, a size is kept while total / size x items is within the limit: true for a
    // prefix of the halvings, as the quotient only grows
    return cs.halving && (double)cs.total / (double)size * (double)cs.ipc <= cs.limit ? size : 0;
  }
  if (s < SPLIT_SLOT) {                     // wave_filling_chunk_tokens: about j whole waves,
    const int j = s - WAVE_SLOT + 1;        // half a chunk of waste a request
    const double chunks = (double)((i64)j * cs.slots / cs.ipc) - (double)cs.batch / 2.0;
    if (!(chunks > 0)) return 0;
    const i64 q = (i64)((double)cs.total / chunks);   // int(total / chunks): truncation
    const i64 size = ceil_div(q, TILE) * TILE;
    return size >= TILE && size < cs.max_len ? size : 0;
  }
  // wave_filling_splits: the largest s with items * s <= j slots, j = 1..4, then 2, 3, 4;
  // within MAX_WAVES waves, and none past the longest request's tiles
  const i64 items = (i64)cs.batch * cs.ipc;
  if (items <= 0) return 0;
  const int f = s - SPLIT_SLOT;
  const i64 count = f < WAVE_FILL_MAX ? (i64)(f + 1) * cs.slots / items : f - WAVE_FILL_MAX + 2;
  if (count <= 1 || (double)(count * items) > cs.limit || count > ceil_div(cs.max_len, TILE))
    return 0;
  return count;
}

// Whether slot s holds a row: it has a value, and no earlier slot of its kind has the same one
// (a wave-filling size among the powers or the earlier wave sizes, a split count among the
// earlier counts). values: every slot's slot_value.
DEVICE_PLAN_HD inline bool slot_kept(int s, const i64* values) {
  if (s >= END_SLOT || values[s] == 0) return false;
  int first = s;                            // the slots that could repeat s's value
  if (s >= WAVE_SLOT && s < SPLIT_SLOT) first = POW_SLOT;
  else if (s >= SPLIT_SLOT && s < TINY_SLOT) first = SPLIT_SLOT;
  for (int t = first; t < s; ++t)
    if (values[t] == values[s]) return false;
  return true;
}

// The row of kept slot s, of the kept slots `kept` (bit t: slot t): its place in slot order,
// the split counts among themselves ascending.
DEVICE_PLAN_HD inline int slot_position(int s, unsigned long long kept, const i64* values) {
  if (s < SPLIT_SLOT || s >= TINY_SLOT) return popcount64(kept & ((1ull << s) - 1));
  int at = popcount64(kept & ((1ull << SPLIT_SLOT) - 1));
  for (int t = SPLIT_SLOT; t < TINY_SLOT; ++t) at += (int)((kept >> t) & 1) && values[t] < values[s];
  return at;
}

DEVICE_PLAN_HD inline Row slot_row(int s, i64 value) {
  if (s == 0) return {NO_SPLIT_CHUNK, 0.0, 1, 0, 0, TILE};
  if (s >= SPLIT_SLOT && s < TINY_SLOT) return {(double)TILE, (double)value, (int)value, 2, 0, TILE};
  const int tiny = s >= TINY_SLOT;
  return {(double)value, 0.0, (int)value, 1, tiny, tiny ? (int)value : TILE};
}

// Every slot by one thread (the CPU tests' driver; the planning kernel spreads the slots over
// a warp).
DEVICE_PLAN_HD inline void enumerate_rows(Candidates& c, int batch, int max_len, i64 total,
                                          int ipc, int slots) {
  const CandidateSpace cs = candidate_space(batch, max_len, total, ipc, slots);
  i64 values[END_SLOT];
  for (int s = 0; s < END_SLOT; ++s) values[s] = slot_value(s, cs);
  unsigned long long kept = 0;
  for (int s = 0; s < END_SLOT; ++s) kept |= (unsigned long long)slot_kept(s, values) << s;
  for (int s = 0; s < END_SLOT; ++s)
    if ((kept >> s) & 1) c.rows[slot_position(s, kept, values)] = slot_row(s, values[s]);
  c.num_rows = popcount64(kept);
}

// A request's chunk count under a row (stats.ragged_candidate_stats' k), from its length.
DEVICE_PLAN_HD inline double row_chunks(const Row& row, int len) {
  const double len1 = len > 1 ? (double)len : 1.0;
  double k = ceil(len1 / row.divisor);
  if (row.cap > 0 && row.cap < k) k = row.cap;
  return k;
}

// One request's part of a row's sums. units: the request's tiles, ceil(len / 64) (0 when
// empty); tiles: len / 64 as a float (or max(len, 1) / 64 when no request is empty).
DEVICE_PLAN_HD inline void add_request(RowSums& s, const Row& row, int len, bool some_empty) {
  const double k = row_chunks(row, len);
  const double tiles = some_empty ? (double)len * (1.0 / TILE)
                                  : (len > 1 ? (double)len : 1.0) / (double)TILE;
  const double units = ceil(tiles);
  const double m = ceil(units / k);
  double largest = (k - 1.0) * (m - 1.0);
  largest = tiles - largest;
  largest = dmin(largest, m);
  s.chunks += (i64)k;
  s.min2 += k < 2.0 ? (i64)k : 2;
  const i64 largest_tokens = (i64)(largest * (double)TILE);
  if (largest_tokens > s.largest_tokens) s.largest_tokens = largest_tokens;
  if ((i64)m > s.max_m) s.max_m = (i64)m;
  if ((i64)k > s.max_k) s.max_k = (i64)k;
  // of the k chunks, r = u - k q hold q + 1 tiles and the rest q (q = floor(u / k)): r are
  // odd when q is even, k - r when q is odd (stats.ragged_candidate_stats)
  const i64 u = (i64)units, kk = (i64)k, q = u / kk, r = u - kk * q;
  s.odd += r + (q & 1) * (kk - 2 * r);
}

// The cost model's rows (features.ROW_EXPRESSIONS), written by runtime/device_planner.py from
// the host's expressions: RowInputs holds what they read (a candidate row's statistics,
// stats.STAT_NAMES, its 'clustered' row and the shape's constants), FeatureRows the rows the
// columns read (DEVICE_PLAN_FEATURES names its members, so a column whose row the device does
// not compute does not compile), and DEVICE_PLAN_ROWS computes them in NumPy's operations and
// order.
struct RowInputs { DEVICE_PLAN_ROW_INPUTS };
struct FeatureRows { DEVICE_PLAN_ROW_MEMBERS };

DEVICE_PLAN_HD inline FeatureRows feature_rows(const RowInputs& in) {
  FeatureRows r;
  DEVICE_PLAN_ROWS(in, r)
  return r;
}

// Statistics of a row (stats.STAT_NAMES) and its predictions, as planner._score computes them:
// features.row_features per row, then gather_features per (row, strategy) and a sequential
// sum over the features. Returns the prediction of `strategy`.
struct Scorer {
  const DevicePlanParams* p;
  double total;            // total tokens
  double total_units;      // sum of the requests' tiles
  double max_len;
  int batch;
  int num_empty;

  DEVICE_PLAN_HD double predict(const Row& row, const RowSums& s, int strategy,
                                double* num_chunks_out) const {
    const double ipc = (double)p->items_per_chunk;
    RowInputs in;
    in.num_chunks = (double)s.chunks;
    in.total_tokens = total;
    in.total_tiles = total_units;
    in.max_chunk_tokens = (double)s.largest_tokens;   // max(largest) * 64
    in.max_chunk_tiles = (double)s.max_m;
    in.max_splits = (double)s.max_k;
    in.split_chunks = (in.num_chunks + (double)s.min2) - 2.0 * (double)batch;
    in.odd_chunks = (double)s.odd;
    if (row.tiny) {        // every tiny chunk is one (partial) tile; an empty request has none
      in.total_tiles = in.num_chunks - (double)num_empty;
      in.max_chunk_tokens = dmin(row.divisor, max_len);
      in.max_chunk_tiles = max_len > 0 ? 1.0 : 0.0;
      in.odd_chunks = in.total_tiles;
    }
    *num_chunks_out = in.num_chunks;
    // features.count_build_tiles: where the row's build streams 128-token tiles, each chunk of
    // an odd number of tiles runs one more half, and the largest chunk's count rounds up to even
    const int lone_grid = in.num_chunks * ipc <= (double)p->num_sms ? 1 : 0;
    const int long_chunks = total >= p->long_chunk_tokens * in.num_chunks ? 1 : 0;
    const double extra = (double)(p->tile_units[2 * lone_grid + long_chunks] - 1);
    if (extra != 0.0) {
      in.total_tiles += in.odd_chunks * extra;
      in.max_chunk_tiles += fmod(in.max_chunk_tiles, 2.0) * extra;
    }
    in.clustered = 0.0;    // clusters are off on a graph-stable grid
    in.items_per_chunk = ipc;
    in.slots = (double)p->slots;
    in.num_sms = (double)p->num_sms;
    in.stream_ratio = p->stream_ratio;
    in.batch_size = (double)batch;
    const FeatureRows r = feature_rows(in);
    // gather_features: each column is its row times its unit, 0 where the strategy does not
    // pay it, summed in column order. DEVICE_PLAN_FEATURES(X) holds X(column, row,
    // split_merge's row, the strategy that alone pays it or -1) for each column, in order.
    double pred = 0.0;
#define DEVICE_PLAN_TERM(f, row_, split_merge_row, paid_by)                                \
    {                                                                                      \
      double scale = p->unit[f];                                                           \
      if (paid_by >= 0) scale *= strategy == paid_by ? 1.0 : 0.0;                          \
      const double x = strategy == SPLIT_MERGE ? r.split_merge_row : r.row_;               \
      const double term = (x * scale) * p->coef[f];                                        \
      pred = f == 0 ? term : pred + term;                                                  \
    }
    DEVICE_PLAN_FEATURES(DEVICE_PLAN_TERM)
#undef DEVICE_PLAN_TERM
    return pred;
  }
};

// The chunk boundaries of request b under the chosen row: chunk i of k starts at tile
// floor(i * u / k) (u: the request's length in align units), the last ends at the length.
DEVICE_PLAN_HD inline int chunk_start(int i, i64 units, i64 k, int align) {
  return (int)(((i64)i * units / k) * align);
}

// A request as the planner sees it: its length, where its page-table entries are, and any
// error (the request is then planned as empty and none of its entries is read).
struct Request {
  int len;
  i64 table_begin;   // its first page-table entry
  i64 table_last;    // its last entry, max(.., 0) (first_pages repeats it past the end)
  i64 pages;         // its page-table entries
  int error;
};

DEVICE_PLAN_HD inline Request read_request(const DevicePlanParams& p, int b) {
  Request r = {0, 0, 0, 0, ERR_NONE};
  const i64 page = p.page_size;
  i64 len = 0, begin, pages;
  if (p.block_table_stride > 0) {
    len = p.seq_lens[b];
    begin = (i64)b * p.block_table_stride;
    pages = len > 0 ? ceil_div(len, page) : 0;
    if (len < 0) r.error = ERR_NEGATIVE_LENGTH;
    else if (pages > p.block_table_stride || begin + pages > p.page_table_entries)
      r.error = ERR_PAGES_PAST_TABLE;
  } else {
    begin = p.kv_indptr[b];
    const i64 end = p.kv_indptr[b + 1];
    pages = end - begin;
    const i64 last = p.kv_last_page_len[b];
    if (begin < 0 || pages < 0 || end > p.page_table_entries) r.error = ERR_BAD_INDPTR;
    else if (pages > 0 ? (last < 1 || last > page) : last != 0) r.error = ERR_BAD_LAST_PAGE_LEN;
    else len = pages > 0 ? (pages - 1) * page + last : 0;
    if (!r.error && len > 2147483647LL) r.error = ERR_BAD_INDPTR;
  }
  if (r.error) {
    r.table_begin = begin > 0 ? begin : 0;
    r.table_last = r.table_begin;
    return r;
  }
  r.len = (int)len;
  r.pages = pages;
  r.table_begin = begin;
  r.table_last = begin + pages - 1 > 0 ? begin + pages - 1 : 0;
  return r;
}

// Request b's entry of query_rows (b < max_batch): {first row in q, q_len, its length, the rows'
// window}; past the batch, no rows (and no window). Rows not 1..max_q_len, more than its tokens
// (at least 1), past q's max_batch x max_q_len rows, or a qo_indptr[0] other than 0:
// ERR_BAD_QO_INDPTR. Returns the error; the caller then takes every request's rows away
// (clear_query_rows): past a bad entry, the others' rows may overlap.
DEVICE_PLAN_HD inline int write_query_rows(const DevicePlanParams& p, int b, int len) {
  int first = 0, count = 0, error = ERR_NONE;
  if (b < p.batch_size) {
    first = b;
    count = 1;
    if (p.qo_indptr != nullptr) {
      first = p.qo_indptr[b];
      const i64 rows = (i64)p.qo_indptr[b + 1] - first, end = (i64)first + rows;
      if (p.qo_indptr[0] != 0 || rows < 1 || rows > p.max_q_len || rows > (len > 1 ? len : 1)
          || first < 0 || end > (i64)p.max_batch * p.max_q_len) {
        error = ERR_BAD_QO_INDPTR;
        count = 0;
      } else {
        count = (int)rows;
      }
    }
  }
  int* e = p.query_rows + 4 * (i64)b;
  e[0] = first;
  e[1] = count;
  e[2] = b < p.batch_size ? len : 0;
  e[3] = b < p.batch_size ? p.rows_window_left : -1;
  return error;
}

// After a bad query-rows entry: no request has rows (no output of the batch is written).
DEVICE_PLAN_HD inline void clear_query_rows(const DevicePlanParams& p, int b) {
  p.query_rows[4 * (i64)b + 1] = 0;
}

// The tokens a call reads of a request of `len` (DecodeProblem.read_lens): its window's, or
// its last position's chunk's (the fewer), or all.
DEVICE_PLAN_HD inline int read_len(const DevicePlanParams& p, int len) {
  int read = p.window_left >= 0 && len > p.window_left + 1 ? p.window_left + 1 : len;
  if (p.attention_chunk_size > 0 && len > 0) {
    const int in_chunk = (len - 1) % p.attention_chunk_size + 1;
    read = in_chunk < read ? in_chunk : read;
  }
  return read;
}

// The chunks of one request under the chosen row: count and units (its length in align units).
struct Cut {
  i64 count;
  i64 units;
};

DEVICE_PLAN_HD inline Cut cut_request(const Row& row, int len) {
  if (row.kind == 0) return {1, 1};
  const i64 k = (i64)row_chunks(row, len);
  return {k, ceil_div(len, row.align)};
}

// The candidates are (row, strategy) pairs in planner._pairs' order: (0, single), then every
// other row as split_merge and as fused.
DEVICE_PLAN_HD inline int num_pairs(const Candidates& c) { return 1 + 2 * (c.num_rows - 1); }

struct Choice {
  int pair, row, strategy;
  double predicted_us;
};

DEVICE_PLAN_HD inline Choice pair_choice(int pair) {
  if (pair == 0) return {0, 0, SINGLE, 0.0};
  return {pair, 1 + (pair - 1) / 2, SPLIT_MERGE + (pair - 1) % 2, 0.0};
}

// One pair's prediction; +inf for a plan of more than max_chunks chunks (never chosen).
DEVICE_PLAN_HD inline double pair_prediction(const Scorer& scorer, const Candidates& c,
                                             const RowSums* sums, int pair, int max_chunks) {
  const Choice ch = pair_choice(pair);
  double num_chunks;
  const double us = scorer.predict(c.rows[ch.row], sums[ch.row], ch.strategy, &num_chunks);
  return num_chunks > (double)max_chunks ? infinity() : us;
}

// The first cheapest pair (np.argmin) of predictions [num_pairs].
DEVICE_PLAN_HD inline Choice cheapest(const double* predicted, int pairs) {
  int best = 0;
  for (int i = 1; i < pairs; ++i)
    if (predicted[i] < predicted[best]) best = i;
  Choice ch = pair_choice(best);
  ch.predicted_us = predicted[best];
  return ch;
}

// The merge mode of the chosen plan (execution.decide without clusters).
DEVICE_PLAN_HD inline int merge_mode(int strategy, i64 num_chunks, int batch) {
  if (num_chunks <= batch) return MERGE_NONE;
  return strategy == SPLIT_MERGE ? MERGE_KERNEL : MERGE_TICKET;
}

// Grid position of chunk c (records.chunk_records' order, execution.launch_order): its rank
// under a stable sort by decreasing key (chunk tokens, or its request's length).
DEVICE_PLAN_HD inline int grid_rank(const int* keys, int n, int c) {
  const int key = keys[c];
  int rank = 0;
#pragma unroll 8
  for (int j = 0; j < n; ++j) rank += keys[j] > key || (keys[j] == key && j < c);
  return rank;
}

// What the plan was, in the state (and its prediction), for the host to read back.
DEVICE_PLAN_HD inline void record_plan(const DevicePlanParams& p, DevicePlanState& st,
                                       const Choice& best, const Row& row, int num_chunks,
                                       int merge) {
  *p.predicted_us = best.predicted_us;
  st.filled = num_chunks;
  st.num_chunks = num_chunks;
  st.pair = best.pair;
  st.value = row.value;
  st.kind = row.kind;
  st.strategy = best.strategy;
  st.merge = merge;
  st.plans += 1;
}

// Scratch (int32 each): per request the tokens a call reads (read_len), first page-table entry,
// last entry (-1: an error, read nothing), chunk offset [batch + 1] and first token read (its
// window's; 0 without one); per chunk its request, start, end (tokens of the request, a
// window's moved to it), sort key and grid order [max_chunks each]. (Entries fit an int: the
// host checks < 2**31.)
struct Scratch {
  int* kv_begin;
  int* lens;
  int* table_begin;
  int* table_last;
  int* offsets;
  int* chunk_request;
  int* chunk_begin;
  int* chunk_end;
  int* keys;
  int* order;
};

DEVICE_PLAN_HD inline Scratch scratch_at(int* s, const DevicePlanParams& p) {
  Scratch out;
  out.lens = s;
  out.table_begin = s + p.batch_size;
  out.table_last = s + 2 * p.batch_size;
  out.offsets = s + 3 * p.batch_size;
  out.kv_begin = s + 4 * p.batch_size + 4;      // [batch], before the chunks at 5 batch + 8
  int* chunks = s + 5 * p.batch_size + 8;
  out.chunk_request = chunks;
  out.chunk_begin = chunks + p.max_chunks;
  out.chunk_end = chunks + 2 * p.max_chunks;
  out.keys = chunks + 3 * p.max_chunks;
  out.order = chunks + 4 * p.max_chunks;
  return out;
}

// Chunk c of the plan, chunk i of request b (cut under the chosen row): its request and its
// tokens [begin, end), a window's moved to it. Returns begin.
DEVICE_PLAN_HD inline int write_chunk(const Scratch& sc, const Row& row, const Cut& cut, int b,
                                      int i, int c) {
  const int begin = sc.kv_begin[b] + chunk_start(i, cut.units, cut.count, row.align);
  sc.chunk_request[c] = b;
  sc.chunk_begin[c] = begin;
  sc.chunk_end[c] = sc.kv_begin[b] + (i + 1 < cut.count
                        ? chunk_start(i + 1, cut.units, cut.count, row.align) : sc.lens[b]);
  return begin;
}


}  // namespace device_plan
