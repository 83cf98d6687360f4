// The deterministic weighted cumulative sum along the sequence (one thread per column), added to
// a float32 base where one is given (the normalized backward's dq and dk).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "config.cuh"

namespace ks_cuda {
namespace {

// ------------------------------------------------------------------ weighted cumulative sum
// grid.x = BH * nc, grid.y = ceil(F/128), 128 threads: one thread per column f of a chunk.
constexpr int kSumThreads = 128;

template <typename Tin>
__global__ void __launch_bounds__(kSumThreads)
    chunk_colsum_kernel(const Tin* __restrict__ x, const float* __restrict__ pre,
                        float* __restrict__ sums, int64_t n, int64_t f) {
  const int64_t nc = (n + kTile - 1) / kTile;
  const int64_t bh = blockIdx.x / nc;
  const int64_t c = blockIdx.x % nc;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kSumThreads + threadIdx.x;
  if (col >= f) return;
  const int64_t end = (c + 1) * kTile < n ? (c + 1) * kTile : n;
  float s = 0.f;
  for (int64_t t = c * kTile; t < end; ++t) {
    const float w = pre == nullptr ? 1.f : pre[bh * n + t];
    s += w * to_float(x[(bh * n + t) * f + col]);
  }
  sums[(bh * nc + c) * f + col] = s;
}

// out = base + post * (running sum), in Tout (base: fp32, nullptr for none), rounded once.
template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kSumThreads)
    chunk_cumsum_kernel(const Tin* __restrict__ x, const float* __restrict__ pre,
                        const float* __restrict__ post, const float* __restrict__ carry,
                        const float* __restrict__ base, Tout* __restrict__ out, int64_t n,
                        int64_t f, bool reverse) {
  const int64_t nc = (n + kTile - 1) / kTile;
  const int64_t bh = blockIdx.x / nc;
  const int64_t c = blockIdx.x % nc;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kSumThreads + threadIdx.x;
  if (col >= f) return;
  float run = carry[(bh * nc + c) * f + col];
  for (int u = 0; u < kTile; ++u) {
    const int64_t t = c * kTile + (reverse ? kTile - 1 - u : u);
    if (t >= n) continue;
    const float w = pre == nullptr ? 1.f : pre[bh * n + t];
    run += w * to_float(x[(bh * n + t) * f + col]);
    const int64_t at = (bh * n + t) * f + col;
    const float scaled = post == nullptr ? run : post[bh * n + t] * run;
    out[at] = from_float<Tout>(base == nullptr ? scaled : base[at] + scaled);
  }
}

}  // namespace
}  // namespace ks_cuda
