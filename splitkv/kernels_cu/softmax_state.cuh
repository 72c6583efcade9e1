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

// Combine several (m, d) pairs: returns the common max (0 if all are empty) for rescaling.
__device__ __forceinline__ float safe_max(float m) { return m == SPLITKV_NEG_INF ? 0.f : m; }

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
  const float m_use = safe_max(m);

  constexpr int PASSES = (DIM + 127) / 128;
  float4 acc[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) acc[p] = make_float4(0.f, 0.f, 0.f, 0.f);
  float d = 0.f;
#pragma unroll 4
  for (int c = lo; c < hi; ++c) {
    const i64 row = (i64)c * num_qo_heads + head;
    const float w = fast_exp2(ld_cg(partial_lse + row) - m_use);
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
  if (lse_out != nullptr && lane == 0)
    *lse_out = d > 0.f ? (m_use + fast_log2(d)) * SPLITKV_LN2 : SPLITKV_NEG_INF;
}
