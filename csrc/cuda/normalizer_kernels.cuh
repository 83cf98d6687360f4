// The row terms of the normalized attention's backward, out = num / d with d = den + eps:
// dnum = g / d (the products' upstream gradient) and dden = -(g . out) / d (the normalizer's),
// in one pass over g and out.
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "config.cuh"

namespace ks_cuda {
namespace {

constexpr int kGradWarps = kThreads / 32;      // warps a block
constexpr int kGradRows = 2;                   // rows a warp takes at once
constexpr int kGradCols = 4;                   // a lane's columns a pass: 128 of a row

// rows = B·H·N rows of M: g and out (B·H·N, M) in Tin, den (B·H·N) fp32; writes dnum
// (B·H·N, M) in Tnum and dden (B·H·N) fp32, or with dden null, dnum (B·H·N, M + 1) in Tnum with
// dden in its last column (the non-causal backward's [g/d | -(g·out)/d]). A warp takes
// kGradRows rows at once, 128 columns a pass, each lane the columns lane, lane + 32, ...: all of
// a pass's loads are issued before its stores (one at a time, a warp kept too few loads in
// flight to cover the memory's latency). The lanes' partial dot products (each in column order)
// are summed in a fixed butterfly order (deterministic). Blocks stride over the rows.
template <typename Tin, typename Tnum>
__global__ void __launch_bounds__(kThreads)
    normalized_grad_kernel(const Tin* __restrict__ g, const Tin* __restrict__ out,
                           const float* __restrict__ den, float eps, Tnum* __restrict__ dnum,
                           float* __restrict__ dden, int64_t rows, int64_t m) {
  const int lane = threadIdx.x % 32;
  const int64_t ld = dden == nullptr ? m + 1 : m;  // dnum's row stride
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGradWarps * kGradRows;
  for (int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kGradWarps + threadIdx.x / 32) *
                      kGradRows;
       row0 < rows; row0 += stride) {
    float d[kGradRows], dot[kGradRows];
#pragma unroll
    for (int r = 0; r < kGradRows; ++r) {
      d[r] = row0 + r < rows ? den[row0 + r] + eps : 1.f;
      dot[r] = 0.f;
    }
    for (int64_t c0 = 0; c0 < m; c0 += 32 * kGradCols) {
      float gv[kGradRows][kGradCols], ov[kGradRows][kGradCols];
#pragma unroll
      for (int r = 0; r < kGradRows; ++r) {
#pragma unroll
        for (int i = 0; i < kGradCols; ++i) {
          const int64_t row = row0 + r, c = c0 + lane + 32 * i;
          const bool in = row < rows && c < m;
          gv[r][i] = in ? to_float(g[row * m + c]) : 0.f;
          ov[r][i] = in ? to_float(out[row * m + c]) : 0.f;
        }
      }
#pragma unroll
      for (int r = 0; r < kGradRows; ++r) {
#pragma unroll
        for (int i = 0; i < kGradCols; ++i) {
          const int64_t row = row0 + r, c = c0 + lane + 32 * i;
          dot[r] += gv[r][i] * ov[r][i];
          if (row < rows && c < m) dnum[row * ld + c] = from_float<Tnum>(gv[r][i] / d[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kGradRows; ++r) {
      for (int offset = 16; offset > 0; offset /= 2) {
        dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], offset);
      }
      const int64_t row = row0 + r;
      if (lane == 0 && row < rows) {
        if (dden == nullptr) {
          dnum[row * ld + m] = from_float<Tnum>(-dot[r] / d[r]);
        } else {
          dden[row] = -dot[r] / d[r];
        }
      }
    }
  }
}

}  // namespace
}  // namespace ks_cuda
