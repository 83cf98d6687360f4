// The deterministic weighted cumulative sum along the sequence, added to a float32 base where one
// is given (the normalized backward's dq and dk).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "config.cuh"

namespace ks_cuda {
namespace {

// ------------------------------------------------------------------ weighted cumulative sum
// grid.x = BH * nc (chunks of kTile rows), grid.y = ceil(F / kSumCols); kSumThreads threads: a
// group of kGroupRows consecutive rows of the chunk x kSumCols columns, one thread per (group,
// column). A thread loads its group's rows at once (kGroupRows loads of each input in flight:
// a thread walking the chunk's 64 rows one after another kept about one row's loads in flight,
// too few to cover the memory's latency), sums them in the walk's order, and the groups' sums
// meet in shared memory, added in the walk's order: every sum has a fixed order.
constexpr int kSumThreads = 256;
constexpr int kSumCols = 64;
constexpr int kSumGroups = kSumThreads / kSumCols;  // 4
constexpr int kGroupRows = kTile / kSumGroups;      // 16
constexpr size_t kSumSmem = kSumGroups * kSumCols * sizeof(float);

// A thread's place: its sequence, chunk (of nc), group of rows and column.
struct SumPlace {
  int64_t nc, bh, c, col, row0;
  int group, lane_col;
  __device__ SumPlace(int64_t n) {
    nc = (n + kTile - 1) / kTile;
    bh = blockIdx.x / nc;
    c = blockIdx.x % nc;
    lane_col = threadIdx.x % kSumCols;
    group = threadIdx.x / kSumCols;
    col = static_cast<int64_t>(blockIdx.y) * kSumCols + lane_col;
    row0 = c * kTile + group * kGroupRows;
  }
  // Whether row r of the group and the column lie inside (N, F).
  __device__ bool holds(int r, int64_t n, int64_t f) const { return row0 + r < n && col < f; }
};

// w_t x_t for the kGroupRows rows of a thread's group (0 past N or past F), all loaded first.
template <typename Tin>
__device__ __forceinline__ void load_group(float (&wx)[kGroupRows], const Tin* __restrict__ x,
                                           const float* __restrict__ pre, const SumPlace& p,
                                           int64_t n, int64_t f) {
  float xs[kGroupRows], ws[kGroupRows];
#pragma unroll
  for (int r = 0; r < kGroupRows; ++r) {
    const int64_t t = p.row0 + r;
    const bool in = p.holds(r, n, f);
    xs[r] = in ? to_float(x[(p.bh * n + t) * f + p.col]) : 0.f;
    ws[r] = in && pre != nullptr ? pre[p.bh * n + t] : 1.f;
  }
#pragma unroll
  for (int r = 0; r < kGroupRows; ++r) wx[r] = ws[r] * xs[r];
}

// The sum of w_t x_t over a group's rows in the walk's order (last row first in reverse).
__device__ __forceinline__ float group_sum(const float (&wx)[kGroupRows], bool reverse) {
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < kGroupRows; ++u) s += wx[reverse ? kGroupRows - 1 - u : u];
  return s;
}

// Each chunk's sum of w_t x_t per column: sums (BH, nc, F) fp32, in the walk's order.
template <typename Tin>
__global__ void __launch_bounds__(kSumThreads)
    chunk_colsum_kernel(const Tin* __restrict__ x, const float* __restrict__ pre,
                        float* __restrict__ sums, int64_t n, int64_t f, bool reverse) {
  KS_DYNAMIC_SMEM(smem);
  float* part = reinterpret_cast<float*>(smem);  // [group][column]
  const SumPlace p(n);
  float wx[kGroupRows];
  load_group(wx, x, pre, p, n, f);
  part[p.group * kSumCols + p.lane_col] = group_sum(wx, reverse);
  __syncthreads();
  if (p.group != 0 || p.col >= f) return;
  float total = 0.f;
  for (int u = 0; u < kSumGroups; ++u) {
    total += part[(reverse ? kSumGroups - 1 - u : u) * kSumCols + p.lane_col];
  }
  sums[(p.bh * p.nc + p.c) * f + p.col] = total;
}

// out = base + post * (running sum), in Tout (base: fp32, nullptr for none), rounded once. The
// running sum at a row: the chunk's carry, the sums of the groups before it in the walk, then
// its group's rows up to it.
template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kSumThreads)
    chunk_cumsum_kernel(const Tin* __restrict__ x, const float* __restrict__ pre,
                        const float* __restrict__ post, const float* __restrict__ carry,
                        const float* __restrict__ base, Tout* __restrict__ out, int64_t n,
                        int64_t f, bool reverse) {
  KS_DYNAMIC_SMEM(smem);
  float* part = reinterpret_cast<float*>(smem);  // [group][column]
  const SumPlace p(n);
  float wx[kGroupRows];
  load_group(wx, x, pre, p, n, f);
  // the outputs' other inputs, loaded before any is used
  float scale[kGroupRows], add[kGroupRows];
#pragma unroll
  for (int r = 0; r < kGroupRows; ++r) {
    const int64_t t = p.row0 + r;
    const bool in = p.holds(r, n, f);
    scale[r] = in && post != nullptr ? post[p.bh * n + t] : 1.f;
    add[r] = in && base != nullptr ? base[(p.bh * n + t) * f + p.col] : 0.f;
  }
  part[p.group * kSumCols + p.lane_col] = group_sum(wx, reverse);
  __syncthreads();
  if (p.col >= f) return;
  float run = carry[(p.bh * p.nc + p.c) * f + p.col];
  for (int u = 0; u < kSumGroups; ++u) {  // the groups before this one, in the walk's order
    const int g = reverse ? kSumGroups - 1 - u : u;
    if (g == p.group) break;
    run += part[g * kSumCols + p.lane_col];
  }
#pragma unroll
  for (int u = 0; u < kGroupRows; ++u) {
    const int r = reverse ? kGroupRows - 1 - u : u;
    const int64_t t = p.row0 + r;
    run += wx[r];
    if (t < n) out[(p.bh * n + t) * f + p.col] = from_float<Tout>(add[r] + scale[r] * run);
  }
}

}  // namespace
}  // namespace ks_cuda
