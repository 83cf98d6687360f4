// The row terms of the normalized attention's backward, out = num / d with d = den + eps:
// dnum = g / d (the products' upstream gradient) and dden = -(g . out) / d (the normalizer's),
// in one pass over g and out.
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "config.cuh"

namespace ks_cuda {
namespace {

constexpr int kRowsPerBlock = kThreads / 32;  // one warp a row

// rows = B·H·N rows of M: g and out (B·H·N, M) in Tin, den (B·H·N) fp32; writes dnum
// (B·H·N, M) in Tnum and dden (B·H·N) fp32, or with dden null, dnum (B·H·N, M + 1) in Tnum with
// dden in its last column (the non-causal backward's [g/d | -(g·out)/d]). Each lane takes the
// columns lane, lane + 32, ...; the lanes' partial dot products are summed in a fixed butterfly
// order (deterministic). Blocks stride over the rows (any count).
template <typename Tin, typename Tnum>
__global__ void __launch_bounds__(kThreads)
    normalized_grad_kernel(const Tin* __restrict__ g, const Tin* __restrict__ out,
                           const float* __restrict__ den, float eps, Tnum* __restrict__ dnum,
                           float* __restrict__ dden, int64_t rows, int64_t m) {
  const int lane = threadIdx.x % 32;
  const int64_t ld = dden == nullptr ? m + 1 : m;  // dnum's row stride
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
       row < rows; row += stride) {
    const float d = den[row] + eps;
    float dot = 0.f;
    for (int64_t c = lane; c < m; c += 32) {
      const float gc = to_float(g[row * m + c]);
      dot += gc * to_float(out[row * m + c]);
      dnum[row * ld + c] = from_float<Tnum>(gc / d);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    }
    if (lane == 0) {
      if (dden == nullptr) {
        dnum[row * ld + m] = from_float<Tnum>(-dot / d);
      } else {
        dden[row] = -dot / d;
      }
    }
  }
}

}  // namespace
}  // namespace ks_cuda
