// The online-softmax algebra, in one place.
//
// A partial attention state over some keys is (o, m, d): m the largest score, d = sum exp2(s - m),
// o = sum exp2(s - m) * v / d. Scores are kept in base 2 (pre-multiplied by sm_scale * log2 e),
// so exp2 replaces exp. Its log-sum-exp is lse2 = m + log2(d) (natural-log LSE = lse2 * ln 2).
// An empty state has m = -inf, d = 0, o = 0.
//
// Partials in the workspace are stored normalised: partial_o[c, h, :] = o, partial_lse[c, h] =
// lse2. Merging states c = lo..hi-1 in that fixed order gives the same bits whichever CTA merges.
#pragma once
#include "common.cuh"

// Scores are offset by the max before exp2; an empty state (max -inf) uses 0 to avoid inf - inf.
__device__ __forceinline__ float safe_max(float m) { return m == SPLITKV_NEG_INF ? 0.f : m; }

// The (m, d) part of a state; o is kept by its owner (in MMA fragments, or in memory).
struct SoftmaxState {
  float m;  // largest score seen, base 2; -inf while empty
  float d;  // sum of exp2(score - m)

  __device__ __forceinline__ static SoftmaxState empty() { return {SPLITKV_NEG_INF, 0.f}; }

  // Admit scores up to `new_max`: rescales d and returns the factor o must be rescaled by
  // (exactly 1 when the max did not move, 0 from an empty state).
  __device__ __forceinline__ float raise_max(float new_max) {
    const float m_new = fmaxf(m, new_max);
    const float factor = fast_exp2(m - safe_max(m_new));
    m = m_new;
    d *= factor;
    return factor;
  }

  // What scores are offset by before exp2.
  __device__ __forceinline__ float offset() const { return safe_max(m); }

  // log2 of the sum of exp2(scores): m + log2(d), -inf for an empty state.
  __device__ __forceinline__ float lse2() const {
    return d > 0.f ? safe_max(m) + fast_log2(d) : SPLITKV_NEG_INF;
  }
};

// Weight of a state whose max is m_i in a combination whose largest max is m_all: the exact
// rescaling of the online-softmax merge (0 for an empty state).
__device__ __forceinline__ float state_weight(float m_i, float m_all) {
  return fast_exp2(m_i - safe_max(m_all));
}

// Merges normalised partial states, a batch at a time, for four dims of one output row. A
// normalised partial with log-sum-exp lse2 is the state (m = lse2, d = 1). Batches are merged
// online in the order given, so the bits do not depend on which thread or CTA merges.
struct MergeAccumulator {
  float m = SPLITKV_NEG_INF, d = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);

  // Admits N partials; an absent one has lse2 = -inf (weight 0).
  template <int N>
  __device__ __forceinline__ void add(const float (&lse2)[N], const float4 (&o)[N]) {
    float m_new = m;
#pragma unroll
    for (int j = 0; j < N; ++j) m_new = fmaxf(m_new, lse2[j]);
    const float rescale = state_weight(m, m_new);
    d *= rescale;
    acc.x *= rescale; acc.y *= rescale; acc.z *= rescale; acc.w *= rescale;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float w = state_weight(lse2[j], m_new);
      d += w;
      acc.x += w * o[j].x; acc.y += w * o[j].y; acc.z += w * o[j].z; acc.w += w * o[j].w;
    }
    m = m_new;
  }

  // Writes the merged four dims in the storage dtype; returns the row's lse2.
  __device__ __forceinline__ float finish(u16* __restrict__ dst) const {
    const float inv = d > 0.f ? 1.f / d : 0.f;
    store4(dst, acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    return SoftmaxState{m, d}.lse2();
  }
};

// Partials merged per pass of merge_slot: each pass issues all its loads before using any, so
// merging up to this many partials costs one round trip to L2, not one per partial.
#define MERGE_BATCH 16

// Merges the partial states lo..hi-1 (in the workspace) of one (request, qo head) row for the
// four dims at `dim`, writes them to out_row[dim..dim+3]; returns the row's lse2.
template <int DIM>
__device__ __forceinline__ float merge_slot(const float* __restrict__ partial_o,
                                            const float* __restrict__ partial_lse, int lo, int hi,
                                            int head, int num_qo_heads, int dim,
                                            u16* __restrict__ out_row) {
  MergeAccumulator merged;
  for (int c0 = lo; c0 < hi; c0 += MERGE_BATCH) {
    float lse2[MERGE_BATCH];
    float4 o[MERGE_BATCH];
#pragma unroll
    for (int j = 0; j < MERGE_BATCH; ++j) {
      const i64 row = (i64)(c0 + j) * num_qo_heads + head;
      const bool valid = c0 + j < hi;
      lse2[j] = valid ? ld_cg(partial_lse + row) : SPLITKV_NEG_INF;
      o[j] = valid ? ld_cg4(partial_o + row * DIM + dim) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    merged.add(lse2, o);
  }
  return merged.finish(out_row + dim);
}
