// The decode kernels' arguments, in one place: a DecodeParams (both kernels take it, in parameter
// space) and the ChunkRecord each CTA of the partial kernel reads. The host fills one DecodeParams
// per plan and writes the tensors' pointers into it per run. runtime/kernel_abi.py mirrors both
// structs field by field, and every compile of decode.cu checks the mirror's offsets and sizes
// (the runtime appends its static_asserts), so the two cannot drift apart.
#pragma once
#include "common.cuh"

#ifndef RECORD_PAGES
#error "RECORD_PAGES must be defined"
#endif
static_assert(RECORD_PAGES % 4 == 0, "the record's page ids are copied 16 bytes at a time");

// What a CTA must know of its chunk before it can fetch anything: read with two 16-byte loads
// (load_header).
struct __align__(16) ChunkHeader {
  int request;           // index in the batch
  int token_begin;       // the chunk is tokens token_begin..token_end-1 of its request
  int token_end;
  int page_table_begin;  // the request's first entry of kv_indices (kv_indptr[request])
  int chunk_begin;       // the request's chunks in the plan, chunk_begin..chunk_end-1: where its
  int chunk_end;         //   partials are; a single chunk writes the output itself
  int plan_index;        // this chunk's index in the plan: the partial rows it writes
  int flags;             // RECORD_* below
};

// ChunkHeader::flags. They travel with the records, not in DecodeParams, so that a graph-stable
// wrapper's one captured launch runs whichever plan its records hold.
#define RECORD_TICKET_MERGE 1   // the last CTA of a split output to finish merges it
#define RECORD_HAS_PAGES 2      // first_pages holds the chunk's first pages
// A record of request -1 is an idle slot of a graph-stable grid: its CTAs exit at once.

// One chunk of the plan. Records are in grid order (the plan's launch order), so a CTA's record
// is found from its block index and its partial rows from plan_index.
struct __align__(16) ChunkRecord {
  ChunkHeader header;
  int first_pages[RECORD_PAGES];  // page ids of the chunk's first pages, from the page holding
                                  // token_begin (with RECORD_HAS_PAGES)
};

__device__ __forceinline__ ChunkHeader load_header(const ChunkRecord* __restrict__ record) {
  const int4* src = reinterpret_cast<const int4*>(&record->header);
  const int4 a = src[0], b = src[1];
  return {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
}

// Shapes (one query row a request; with MULTI_TOKEN q, out and lse have a row per query row,
// and num_qo_heads, the workspace and the merges count virtual heads, see query_rows below):
// q, out [batch_size, num_qo_heads, HEAD_DIM]; k_cache, v_cache pages of page_size
// tokens of num_kv_heads rows of HEAD_DIM (rows 16-byte aligned; the strides below, in
// elements);
// lse [batch_size, num_qo_heads]; the workspace's partial_o [num_chunks, num_qo_heads, HEAD_DIM]
// and partial_lse [num_chunks, num_qo_heads]; counters [batch_size, num_kv_heads,
// ctas_per_kv_head].
struct DecodeParams {
  const u16* q;
  const u16* k_cache;
  const u16* v_cache;
  i64 page_stride;                 // from one page of k_cache / v_cache to the next
  i64 token_stride;                // from one token of a page to the next
  const int* kv_indices;           // the page table: request b's pages from page_table_begin
  const ChunkRecord* records;      // [num_chunks], in grid order
  const int* merge_indptr;         // [batch_size + 1]: request b's chunks (the merge kernel)
  u16* out;
  float* lse;                      // natural log; null: not written
  float* partial_o;                // normalised partial outputs (split requests only)
  float* partial_lse;              // their log-sum-exp, base 2
  unsigned* counters;              // the ticket merge's arrival counts: 0 between launches
  int batch_size;
  int num_qo_heads;
  int num_kv_heads;
  int ctas_per_kv_head;            // CTAs sharing one (chunk, kv head), ROWS query heads each
  int page_size;
  float sm_scale_log2;             // sm_scale * log2(e): scores are kept in base 2
  int pages_in_record;             // 1: copy each record's first_pages to shared memory with
                                   //    its header; a record with RECORD_HAS_PAGES uses them
  int pdl_early_trigger;           // 1: let the next kernel launch at the start, not at the end
                                   //    of streaming (with programmatic dependent launch)
  // fp8 caches (KV_FP8): K = code value x k_scale. A device array (read after the wait, so a
  // graph sees new values) of one value (stride 0) or one per kv head (stride 1); null: the
  // value below.
  const float* k_scale;
  const float* v_scale;
  float k_scale_value;
  float v_scale_value;
  int k_scale_stride;
  int v_scale_stride;
  // Attention variants (core/variants.py). logits_soft_cap_log2: the cap times log2(e) (scores
  // are base 2: s becomes cap * tanh(s / cap) in either base); 0: no cap. sinks: one logit per
  // query head, natural log, that joins each head's softmax denominator (and its LSE) with no
  // value; null: none.
  float logits_soft_cap_log2;
  const float* sinks;
  i64 head_stride;                 // from one kv head of a token to the next (HND: page_size
                                   //   x head_dim; NHD: head_dim, or more with padded heads)
  // Multi-token decode (the MULTI_TOKEN build; unused otherwise): query_rows holds four ints a
  // request, {first query row in q, its query rows q_len, its KV length, window_left}; q_group
  // is the model's query heads per kv head. num_qo_heads above then counts "virtual heads":
  // each kv head has max_q_len x q_group of them, row j's heads after row j - 1's, so the
  // kernels' rows, workspace and merges work as for a group that large (query_row maps them
  // back). window_left (-1: none): each row sees its own window, which the plan's chunks
  // (covering every row's window) do not say alone; per request, so a graph-stable wrapper's
  // plans may change it.
  const int* query_rows;
  int q_group;
  // The unified max (the UNIFIED_MAX build; unused otherwise): phi x log2(e), the fixed offset
  // of the scores (base 2), and a count of the CTAs that fell back to the running max (null:
  // not counted).
  float unified_max_log2;
  unsigned* unified_fallbacks;
  // The merge kernel's rows (an experiment, DecodeExperiments.compact_merge): the requests
  // that split, in order, num_split_requests of them, and a thread per (one of them, head, 4
  // dims); null: a thread per (request, head, 4 dims) of the whole batch.
  const int* split_requests;
  int num_split_requests;
  // From one row of q (a request's, or with MULTI_TOKEN a query row's) to the next, in
  // elements: num_qo_heads x HEAD_DIM when q is contiguous, more when it is a slice of a fused
  // QKV projection (its heads stay HEAD_DIM apart).
  i64 q_stride;
  // ALiBi (the ALIBI build; unused otherwise): one slope per query head times log2(e); a query
  // row at position p adds slope x (j - p) to its score of token j. Each request's p comes from
  // query_rows (its KV length less its rows after), which the ALIBI build always has.
  const float* alibi_slopes_log2;
};
