// Streaming-read probe: the floor that `splitkv bench` judges "% of read bandwidth" against.
//
// stream_read: a grid-stride read of src (n 16-byte words). Each thread issues LOADS
// independent 16-byte loads per iteration before it uses any of them, then reads the words
// left over one at a time. It folds every word into one register and stores it only if it
// equals a constant, so the loads stay alive and practically nothing is written.
//
// Compile-time parameter: LOADS (16-byte loads in flight per thread).
#ifndef LOADS
#error "LOADS must be defined"
#endif

extern "C" __global__ void stream_read(const uint4* __restrict__ src, long long n, unsigned* sink) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  unsigned acc = 0;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  for (; i + (LOADS - 1) * stride < n; i += LOADS * stride) {
    uint4 v[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) v[j] = src[i + j * stride];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n; i += stride) {
    uint4 v = src[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;   // keeps the loads alive; practically never stores
}
