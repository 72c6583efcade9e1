// The planner of kernels_cu/device_plan.cuh run serially on the host: what the CPU tests
// compare with the host planner (tests/helpers/device_plan_reference.py builds it with g++ and
// -ffp-contract=off, so the float64 formulas round as NumPy's).
#include <cmath>
#include <cstring>

#include "device_plan_defines.h"   // runtime/device_planner.py's header_defines()
#define DEVICE_PLAN_HD
#include "device_plan.cuh"

namespace device_plan {

// The record of chunk c (plan index) of `request`, as records.chunk_records writes it.
inline void write_record(const DevicePlanParams& p, Record& rec, int c, int request, int begin,
                         int end, i64 table_begin, i64 table_last, int chunk_begin,
                         int chunk_end, int flags, int record_pages, bool read_pages) {
  rec.request = request;
  rec.token_begin = begin;
  rec.token_end = end;
  rec.page_table_begin = (int)table_begin;
  rec.chunk_begin = chunk_begin;
  rec.chunk_end = chunk_end;
  rec.plan_index = c;
  rec.flags = flags;
  const i64 first = table_begin + begin / p.page_size;
  for (int j = 0; j < RECORD_PAGES; ++j) {
    const i64 e = first + j < table_last ? first + j : table_last;
    rec.first_pages[j] = j < record_pages && read_pages ? p.kv_indices[e] : 0;
  }
}

inline void write_idle(Record& rec) {
  rec.request = IDLE_REQUEST;
  rec.token_begin = rec.token_end = rec.page_table_begin = 0;
  rec.chunk_begin = rec.chunk_end = rec.plan_index = rec.flags = 0;
  for (int j = 0; j < RECORD_PAGES; ++j) rec.first_pages[j] = 0;
}

// The whole planner with one thread (the kernel in device_plan.cu is the same steps spread
// over a CTA).
inline void plan_on_host(const DevicePlanParams& p) {
  DevicePlanState& st = *reinterpret_cast<DevicePlanState*>(p.state);
  Scratch sc = scratch_at(p.scratch, p);
  const int n = p.batch_size;
  i64 total = 0, total_units = 0, total_pages = 0;
  int max_len = 0, num_empty = 0;
  for (int b = 0; b < n; ++b) {
    const Request r = read_request(p, b);
    if (r.error && !st.error) { st.error = r.error; st.error_request = b; }
    const int len = read_len(p, r.len);
    sc.lens[b] = len;
    sc.kv_begin[b] = r.len - len;
    total_pages += r.pages;
    total += len;
    total_units += ceil_div(len, TILE);
    if (len > max_len) max_len = len;
    num_empty += len == 0;
  }
  if (p.query_rows != nullptr) {
    bool bad = false;
    for (int b = 0; b < p.max_batch; ++b) {
      const int error = write_query_rows(p, b, b < n ? sc.lens[b] + sc.kv_begin[b] : 0);
      if (error && !st.error) { st.error = error; st.error_request = b; }
      bad |= error != 0;
    }
    if (bad)
      for (int b = 0; b < p.max_batch; ++b) clear_query_rows(p, b);
  }
  Candidates c;
  enumerate_rows(c, n, max_len, total, p.items_per_chunk, p.slots);
  RowSums sums[MAX_ROWS];
  for (int r = 0; r < c.num_rows; ++r) {
    sums[r] = RowSums{};
    for (int b = 0; b < n; ++b) add_request(sums[r], c.rows[r], sc.lens[b], num_empty > 0);
  }
  Scorer scorer = {&p, (double)total, (double)total_units, (double)max_len, n, num_empty};
  double predicted[2 * MAX_ROWS];
  for (int i = 0; i < num_pairs(c); ++i)
    predicted[i] = pair_prediction(scorer, c, sums, i, p.max_chunks);
  const Choice best = cheapest(predicted, num_pairs(c));
  const Row& row = c.rows[best.row];
  int num_chunks = 0;
  bool aligned = true;
  for (int b = 0; b < n; ++b) {
    const Cut cut = cut_request(row, sc.lens[b]);
    sc.offsets[b] = num_chunks;
    for (int i = 0; i < cut.count; ++i, ++num_chunks)
      aligned &= write_chunk(sc, row, cut, b, i, num_chunks) % p.page_size == 0;
  }
  sc.offsets[n] = num_chunks;
  const int merge = merge_mode(best.strategy, num_chunks, n);
  for (int i = 0; i < num_chunks; ++i)
    sc.keys[i] = p.launch_order == LONGEST_CHUNKS ? sc.chunk_end[i] - sc.chunk_begin[i]
               : p.launch_order == LONGEST_REQUESTS
               ? sc.lens[sc.chunk_request[i]] + sc.kv_begin[sc.chunk_request[i]] : 0;
  for (int i = 0; i < num_chunks; ++i) sc.order[grid_rank(sc.keys, num_chunks, i)] = i;
  const int record_pages = aligned ? p.record_pages : 0;
  const int flags = (merge == MERGE_TICKET ? 1 : 0) | (record_pages ? 2 : 0);
  for (int g = 0; g < num_chunks; ++g) {
    const int i = sc.order[g], b = sc.chunk_request[i];
    const Request r = read_request(p, b);
    write_record(p, p.records[g], i, b, sc.chunk_begin[i], sc.chunk_end[i], r.table_begin,
                 r.table_last, sc.offsets[b], sc.offsets[b + 1], flags, record_pages,
                 total_pages > 0 && !r.error);
  }
  for (int g = num_chunks; g < st.filled; ++g) write_idle(p.records[g]);
  for (int b = 0; b <= p.max_batch; ++b)
    p.merge_indptr[b] = merge != MERGE_KERNEL ? 0 : sc.offsets[b < n ? b : n];
  record_plan(p, st, best, row, num_chunks, merge);
}
}  // namespace device_plan

extern "C" void splitkv_plan_on_host(const device_plan::DevicePlanParams* p) {
  device_plan::plan_on_host(*p);
}
// The candidate rows (value, kind, tiny each, in order) for a batch: what the tests compare
// with planner._candidates. Returns the number of rows.
extern "C" int splitkv_candidate_rows(int batch, int max_len, long long total, int ipc, int slots,
                                      int* out) {
  device_plan::Candidates c;
  device_plan::enumerate_rows(c, batch, max_len, total, ipc, slots);
  for (int r = 0; r < c.num_rows; ++r) {
    out[3 * r] = c.rows[r].value;
    out[3 * r + 1] = c.rows[r].kind;
    out[3 * r + 2] = c.rows[r].tiny;
  }
  return c.num_rows;
}
extern "C" int splitkv_plan_params_size() { return (int)sizeof(device_plan::DevicePlanParams); }

// The cost model's rows of one candidate (FeatureRows' members in order) from its inputs
// (RowInputs' in order), float64 each: what the tests compare with the host's NumPy rows.
extern "C" void splitkv_feature_rows(const double* in, double* out) {
  device_plan::RowInputs inputs;
  std::memcpy(&inputs, in, sizeof inputs);
  const device_plan::FeatureRows rows = device_plan::feature_rows(inputs);
  std::memcpy(out, &rows, sizeof rows);
}
extern "C" int splitkv_row_inputs() { return (int)(sizeof(device_plan::RowInputs) / 8); }
extern "C" int splitkv_row_members() { return (int)(sizeof(device_plan::FeatureRows) / 8); }
