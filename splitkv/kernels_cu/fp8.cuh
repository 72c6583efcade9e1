// fp8 K/V codes to float16, exactly: every e4m3fn and e5m2 value is a float16 (NaN stays NaN,
// e5m2's infinities stay infinite). KV_FP8 = 1 (e4m3fn) or 2 (e5m2) picks the format.
#pragma once
#include "common.cuh"

// The bytes of a and b, numbered 0-3 and 4-7, picked into the result by the selector's nibbles
// (the low nibble chooses the low byte).
__device__ __forceinline__ u32 byte_perm(u32 a, u32 b, u32 selector) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890)
// Before sm_89 (no fp8 cvt): an e4m3fn code's exponent and mantissa bits, placed as a float16's
// low bits, are its value times 2**-8 (normal and subnormal alike: the biases differ by 8), so
// one float16 multiply by 256 finishes the pair; S.1111.111 is NaN.
__device__ __forceinline__ u32 e4m3fn_pair_to_half2(u32 codes) {
  u32 bits = 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const u32 c = (codes >> (8 * k)) & 0xFFu, em = c & 0x7Fu;
    const u32 h = (em == 0x7Fu ? 0x7E00u : em << 7) | ((c & 0x80u) << 8);
    bits |= h << (16 * k);
  }
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(bits) : "r"(0x5C005C00u));   // 256 in each half
  return bits;
}
#endif

// Four codes (one word, the low byte first) to two float16 pairs: `lo` holds codes 0 and 1,
// `hi` codes 2 and 3 (each pair's first code in the low half).
__device__ __forceinline__ void fp8x4_to_half2x2(u32 word, u32& lo, u32& hi) {
#if KV_FP8 == 2
  // e5m2 is a float16's top byte
  lo = byte_perm(word, 0u, 0x1404u);
  hi = byte_perm(word, 0u, 0x3424u);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi) : "r"(word));
#else
  lo = e4m3fn_pair_to_half2(word & 0xFFFFu);
  hi = e4m3fn_pair_to_half2(word >> 16);
#endif
}
