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

// One warp merges the partial states lo..hi-1 of one (request, qo head) row and writes the
// output row in the storage dtype, plus the natural-log LSE if lse_out is not null.
// Lane l covers dims 4l..4l+3 (+128 per extra pass for head_dim 256).
template <int DIM>
__device__ __forceinline__ void merge_row_warp(const float* __restrict__ partial_o,
                                               const float* __restrict__ partial_lse, int lo, int hi,
                                               int head, int num_qo_heads, u16* __restrict__ out_row,
                                               float* __restrict__ lse_out, int lane) {
  float m = SPLITKV_NEG_INF;
  for (int c = lo + lane; c < hi; c += 32) m = fmaxf(m, ld_cg(partial_lse + (i64)c * num_qo_heads + head));
  m = warp_max(m);

  constexpr int PASSES = (DIM + 127) / 128;
  float4 acc[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) acc[p] = make_float4(0.f, 0.f, 0.f, 0.f);
  float d = 0.f;
#pragma unroll 4
  for (int c = lo; c < hi; ++c) {
    const i64 row = (i64)c * num_qo_heads + head;
    // A normalised partial with log-sum-exp lse2 is the state (m = lse2, d = 1).
    const float w = state_weight(ld_cg(partial_lse + row), m);
    d += w;
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
      const int dim = p * 128 + lane * 4;
      if (dim < DIM) {
        const float4 v = ld_cg4(partial_o + row * DIM + dim);
        acc[p].x += w * v.x; acc[p].y += w * v.y; acc[p].z += w * v.z; acc[p].w += w * v.w;
      }
    }
  }
  const float inv = d > 0.f ? 1.f / d : 0.f;
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int dim = p * 128 + lane * 4;
    if (dim < DIM)
      store4(out_row + dim, acc[p].x * inv, acc[p].y * inv, acc[p].z * inv, acc[p].w * inv);
  }
  if (lse_out != nullptr && lane == 0) *lse_out = SoftmaxState{m, d}.lse2() * SPLITKV_LN2;
}
