"""The two small GPU kernels around context parallelism's all-gather, compiled through NVRTC.

``pack_state`` turns this rank's 16-bit output and float32 LSE into the float32 wire buffer
[rows, head_dim + 1]. ``merge_states`` reads the gathered buffer [ranks, rows, head_dim + 1]
once and writes the merged output, already cast to the query dtype, and the merged LSE: the
merge and the cast are one kernel, so nothing else reads the gathered states. Their arithmetic
is ``splitkv.merge_states_n`` in float32 (the same non-finite rules) followed by the rounding of
``core.bfloat16.float32_to_bits`` or float16's round-to-nearest-even; ``states.py`` is the
NumPy twin the tests compare them with.

The source is kept here (not in ``kernels_cu``) because only context parallelism launches it.
Nothing here imports CuPy: the module of the buffers given (``array_namespace``) compiles and
launches, so CuPy is only ever loaded by ``splitkv.runtime``.
"""

from __future__ import annotations

import numpy as np

from ..core.bfloat16 import array_namespace

KERNEL_SOURCE = r"""
// OUT_BF16: the 16-bit output holds bfloat16 (1) or float16 (0). All arithmetic is fp32.
#ifndef OUT_BF16
#error "OUT_BF16 must be defined (1 = bfloat16, 0 = float16)"
#endif

#define SKV_NEG_INF __int_as_float(0xff800000)
#define SKV_POS_INF __int_as_float(0x7f800000)
#define SKV_NAN __int_as_float(0x7fffffff)

__device__ __forceinline__ float bits16_to_float(unsigned short h) {
#if OUT_BF16
  return __uint_as_float(((unsigned)h) << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ unsigned short float_to_bits16(float x) {
#if OUT_BF16
  // nearest even, a NaN the canonical 0x7FFF: the decode kernels' conversion, and
  // core/bfloat16.py's float32_to_bits (adding the rounding bias to a NaN's bits would carry
  // the GPU's NaN, 0x7FFFFFFF, into -0)
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#else
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#endif
}

// send[row, c] = float(o[row, c]) for c < head_dim, lse[row] for c == head_dim.
extern "C" __global__ void pack_state(const unsigned short* __restrict__ o,
                                      const float* __restrict__ lse, float* __restrict__ send,
                                      long long rows, int head_dim) {
  const int width = head_dim + 1;
  const long long n = rows * width;
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
    const long long row = i / width;
    const int c = (int)(i - row * width);
    send[i] = c < head_dim ? bits16_to_float(o[row * head_dim + c]) : lse[row];
  }
}

// One thread per output element (row, d) of gathered [ranks, rows, head_dim + 1]:
//   m = max_r lse_r (0 where every lse is -inf), w_r = exp(lse_r - m), total = sum_r w_r,
//   out = sum_r o_r * (w_r / total), lse = m + log(total);
// only empty states (total 0): zeros and -inf; a NaN or +inf lse in a row: NaN output and LSE.
// lse_out may be null.
extern "C" __global__ void merge_states(const float* __restrict__ gathered, int ranks,
                                        long long rows, int head_dim,
                                        unsigned short* __restrict__ out,
                                        float* __restrict__ lse_out) {
  const int width = head_dim + 1;
  const long long per_rank = rows * width;
  const long long n = rows * head_dim;
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += step) {
    const long long row = i / head_dim;
    const int d = (int)(i - row * head_dim);
    const float* state = gathered + row * width;
    float m = SKV_NEG_INF;
    bool bad = false;
    for (int r = 0; r < ranks; ++r) {
      const float l = state[r * per_rank + head_dim];
      bad |= (l != l) || (l == SKV_POS_INF);
      m = fmaxf(m, l);
    }
    const float m_safe = m == SKV_NEG_INF ? 0.f : m;
    float total = 0.f;
    for (int r = 0; r < ranks; ++r) total += expf(state[r * per_rank + head_dim] - m_safe);
    const float safe_total = total > 0.f ? total : 1.f;
    float acc = 0.f;
    for (int r = 0; r < ranks; ++r) {
      const float* s = state + r * per_rank;
      acc += s[d] * (expf(s[head_dim] - m_safe) / safe_total);
    }
    float merged_lse = total == 0.f ? SKV_NEG_INF : m_safe + logf(total);
    if (bad) {
      acc = SKV_NAN;
      merged_lse = SKV_NAN;
    }
    out[i] = float_to_bits16(acc);
    if (lse_out != nullptr && d == 0) lse_out[row] = merged_lse;
  }
}
"""

THREADS = 256
MAX_BLOCKS = 4096          # grid-stride loops: enough blocks to fill a GPU, never one per element


def kernel_source(dtype: str) -> str:
    """The CUDA source for outputs of ``dtype`` ("bfloat16" or "float16")."""
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype: expected 'bfloat16' or 'float16', got {dtype!r}")
    return f"#define OUT_BF16 {int(dtype == 'bfloat16')}\n" + KERNEL_SOURCE


_KERNELS: dict[tuple[int, str], dict] = {}


def _kernel(dtype: str, name: str, like):
    """Kernel ``name`` for ``dtype`` on the device of ``like`` (a CuPy array); both kernels of a
    dtype compile once per process and device."""
    from ..runtime.kernel_source import NVRTC_OPTIONS

    key = (like.device.id, dtype)
    kernels = _KERNELS.get(key)
    if kernels is None:
        cupy = array_namespace(like)
        with like.device:
            module = cupy.RawModule(code=kernel_source(dtype), options=NVRTC_OPTIONS)
            kernels = {n: module.get_function(n) for n in ("pack_state", "merge_states")}
        _KERNELS[key] = kernels
    return kernels[name]


def _grid(n: int) -> tuple[int]:
    return (max(1, min(MAX_BLOCKS, -(-n // THREADS))),)


def launch_pack(o, lse, send, dtype: str, stream) -> None:
    """``send`` [rows, head_dim + 1] float32 from ``o`` [rows, head_dim] (16-bit) and ``lse``
    [rows] float32; CuPy arrays, contiguous, enqueued on ``stream`` (a CuPy stream)."""
    head_dim = send.shape[-1] - 1
    rows = send.size // (head_dim + 1)
    with stream:
        _kernel(dtype, "pack_state", send)(
            _grid(rows * (head_dim + 1)), (THREADS,),
            (o, lse, send, np.int64(rows), np.int32(head_dim)))


def launch_merge(gathered, out_ptr: int, lse_ptr: int, dtype: str, stream) -> None:
    """Merge ``gathered`` [ranks, ..., head_dim + 1] float32 (CuPy, contiguous) into the 16-bit
    output at ``out_ptr`` [..., head_dim] and, unless ``lse_ptr`` is 0, the float32 LSE [...]."""
    ranks, head_dim = gathered.shape[0], gathered.shape[-1] - 1
    rows = gathered.size // (ranks * (head_dim + 1))
    with stream:
        _kernel(dtype, "merge_states", gathered)(
            _grid(rows * head_dim), (THREADS,),
            (gathered, np.int32(ranks), np.int64(rows), np.int32(head_dim),
             np.uint64(out_ptr), np.uint64(lse_ptr)))
