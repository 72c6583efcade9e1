// The online-softmax algebra, in one place.
//
// The attention state of one query row over some keys is (o, m, d): m the largest score, d =
// sum exp2(s - m), o = sum exp2(s - m) * v (not yet divided by d). Scores are kept in base 2
// (pre-multiplied by sm_scale * log2 e), so exp2 replaces exp. Its log-sum-exp is lse2 = m +
// log2(d) (natural-log LSE = lse2 * ln 2), its output o / d. An empty state has m = -inf, d = 0,
// o = 0. Partials in the workspace (and in a cluster's shared memory) are stored normalised: the
// output o / d and lse2, which is the state (o / d, lse2, 1).
//
// States are merged in a fixed order (a CTA's warps in order, a request's chunks lo..hi-1), so the
// bits do not depend on which thread or CTA merges. Loads and stores stay with the callers.
#pragma once
#include "common.cuh"

// Scores are offset by the max before exp2; an empty state (max -inf) uses 0 to avoid inf - inf.
__device__ __forceinline__ float safe_max(float m) { return m == SPLITKV_NEG_INF ? 0.f : m; }

// Weight of a state whose max is m_i in a combination whose largest max is m_all: the exact
// rescaling of the online-softmax merge (0 for an empty state).
__device__ __forceinline__ float state_weight(float m_i, float m_all) {
  return fast_exp2(m_i - safe_max(m_all));
}

// A state over DIMS dims of o: 4 consecutive dims of a row (the merges), or the dims of a row a
// thread holds in its MMA accumulator fragments (the partial kernel's main loop).
template <int DIMS>
struct SoftmaxState {
  float o[DIMS];
  float m;  // largest score seen, base 2; -inf while empty
  float d;  // sum of exp2(score - m)

  __device__ __forceinline__ static SoftmaxState empty() {
    SoftmaxState s;
#pragma unroll
    for (int i = 0; i < DIMS; ++i) s.o[i] = 0.f;
    s.m = SPLITKV_NEG_INF;
    s.d = 0.f;
    return s;
  }

  // A normalised partial: output `o` and log-sum-exp `lse2` (an absent one has lse2 = -inf).
  __device__ __forceinline__ static SoftmaxState normalised(const float4& o, float lse2) {
    static_assert(DIMS == 4, "normalised partials are read four dims at a time");
    return {{o.x, o.y, o.z, o.w}, lse2, 1.f};
  }

  // Admit scores up to `new_max`: raises m, rescales d and returns the factor o must be rescaled
  // by (exactly 1 when the max did not move, 0 from an empty state). o is left to the caller,
  // which rescales it (scale_o) only when some row's max moved: after the first tiles, rarely.
  __device__ __forceinline__ float raise_max(float new_max) {
    const float m_new = fmaxf(m, new_max);
    const float factor = fast_exp2(m - safe_max(m_new));
    m = m_new;
    d *= factor;
    return factor;
  }

  __device__ __forceinline__ void scale_o(float factor) {
#pragma unroll
    for (int i = 0; i < DIMS; ++i) o[i] *= factor;
  }

  // Admits one more score, base 2, that carries no value (an attention sink): it joins d, and
  // so the LSE, and only rescales o. A score of -inf changes nothing.
  __device__ __forceinline__ void add_logit(float s2) {
    const float m_new = fmaxf(m, s2);
    const float w = state_weight(m, m_new);
    d = d * w + state_weight(s2, m_new);
    scale_o(w);
    m = m_new;
  }

  // What scores are offset by before exp2.
  __device__ __forceinline__ float offset() const { return safe_max(m); }

  // log2 of the sum of exp2(scores): m + log2(d), -inf for an empty state, NaN when a score
  // was NaN (d is then NaN: a NaN partial must not look empty, or a merge would drop it).
  __device__ __forceinline__ float lse2() const {
    return d > 0.f || d != d ? safe_max(m) + fast_log2(d) : SPLITKV_NEG_INF;
  }

  // The attention output o / d (0 for an empty state; NaN where d is NaN, which a NaN or +inf
  // sink makes of a row whose o is finite), four dims.
  __device__ __forceinline__ float4 output() const {
    static_assert(DIMS == 4, "outputs are written four dims at a time");
    const float inv = d > 0.f ? 1.f / d : d == 0.f ? 0.f : d;
    return make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
  }

  // Merges `others` into this state in order: one new max for all of them, this state rescaled
  // once, then each added with its weight. A batch of loads in flight, one merge.
  template <int N>
  __device__ __forceinline__ void merge(const SoftmaxState (&others)[N]) {
    float m_new = m;
#pragma unroll
    for (int j = 0; j < N; ++j) m_new = fmaxf(m_new, others[j].m);
    const float rescale = state_weight(m, m_new);
    d *= rescale;
    scale_o(rescale);
#pragma unroll
    for (int j = 0; j < N; ++j) add_weighted(others[j], m_new);
    m = m_new;
  }

  // The merge of `parts` into an empty state, without rescaling the empty start (a factor of 0
  // on zeros): the partial kernel's combine of its warps.
  template <int N>
  __device__ __forceinline__ static SoftmaxState merged(const SoftmaxState (&parts)[N]) {
    SoftmaxState s = empty();
#pragma unroll
    for (int j = 0; j < N; ++j) s.m = fmaxf(s.m, parts[j].m);
#pragma unroll
    for (int j = 0; j < N; ++j) s.add_weighted(parts[j], s.m);
    return s;
  }

 private:
  // Adds `other` rescaled to the max m_all (at least other.m).
  __device__ __forceinline__ void add_weighted(const SoftmaxState& other, float m_all) {
    const float w = state_weight(other.m, m_all);
    d += other.d * w;
#pragma unroll
    for (int i = 0; i < DIMS; ++i) o[i] += other.o[i] * w;
  }
};
