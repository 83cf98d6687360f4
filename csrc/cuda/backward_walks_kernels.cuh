// Kernels 10 and 11: the walks' fused backward (bf16, F, M <= 64) with its dq walk and its dk, dv
// walk as one grid, on mma.sync (10: kernels 8 and 9) or WMMA (11: kernels 6 and 7).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "register_walk_kernels.cuh"
#include "walk_kernels.cuh"

namespace ks_cuda {
namespace {

// ------------------------------------------------------------------ kernels 10, 11: both walks
// Blocks [0, dkv_blocks) walk dk and dv (kernel 9, or 7), the others dq = causal(g, v, k)
// (kernel 8, or 6; features M, values F: one slice each), each from its carries. The two walks
// are independent, so an SM holds a block of each at once, where the two launches one after
// the other leave an SM with one block at a time whenever B·H is near the SM count (one segment
// a sequence): a walk waiting on its barrier or its products then has the other's work beside
// it. The longer dk, dv walks come first. Every block gets the larger of the two walks' shared
// memory: kernel 10 mma_backward_smem (kernel 9's 90 KB), kernel 11 walk_backward_smem (kernel
// 6's 108 KB), with kernel 7 at one buffer and one staging tile (kDkvOne, 98 KB: two buffers,
// 134 KB and more, would leave no room for a second block); two an SM where the SM has 228 KB
// (H100, H200).
template <typename Op>
constexpr DkvSmem<Op> kDkvOne = {1, 1, 1, 1};  // ft, mt, nbuf, stages

template <typename Op>
constexpr size_t mma_backward_smem() {
  return std::max(mma_dkv_smem<Op>(), mma_walk_smem<Op>(1));
}

template <typename Op>
constexpr size_t walk_backward_smem() {
  return std::max(WalkSmem<Op, 1>::bytes(), kDkvOne<Op>.bytes());
}

// The arguments of kernels 10 and 11: q, k, v (BH, N, F / M) and g = dL/dout (BH, N, M); the
// carries of each walk's segments (or null) and its segments (nblk per sequence, cpb chunks
// each); vec_f, vec_m: rows of q and k, of v and g are 16-byte vectors; vec_k: rows of k. dq and
// dk in Tout, dv in Tdv.
template <typename Tin, typename Tout, typename Tdv>
struct BackwardWalks {
  const Tin *q, *k, *v, *g;
  const float *dkv_carry, *dq_carry;
  Tout *dq, *dk;
  Tdv* dv;
  int64_t n, f, m, dkv_blocks, dkv_nblk, dkv_cpb, dq_nblk, dq_cpb;
  bool vec_f, vec_m, vec_k;
};

// Kernel 9's walk as a function kernel 10 calls, once a block. Inlined beside kernel 8's walk
// under kernel 10's 128 registers, ptxas set aside a few loop-invariant values (sm_90a: 28 bytes
// of spill stores, 5 local loads a chunk in this walk, 2 in the other); called, it allocates
// its registers alone: no spill in either walk.
template <typename Tin, typename Tout, typename Tdv>
__device__ __noinline__ void walk_mma_dkv_called(int64_t block, const Tin* __restrict__ q,
                                              const Tin* __restrict__ k, const Tin* __restrict__ v,
                                              const Tin* __restrict__ g,
                                              const float* __restrict__ carry,
                                              Tout* __restrict__ dk, Tdv* __restrict__ dv,
                                              int64_t n, int64_t f, int64_t m, int64_t nblk,
                                              int64_t cpb, bool vec_f, bool vec_m) {
  walk_mma_dkv<Tin, Tout, Tdv>(block, q, k, v, g, carry, dk, dv, n, f, m, nblk, cpb, vec_f,
                               vec_m);
}

// Block blockIdx.x's walk of kernel 10 (kMma) or 11.
template <typename Tin, typename Tout, typename Tdv, bool kMma>
__device__ __forceinline__ void backward_walks(const BackwardWalks<Tin, Tout, Tdv>& a) {
  using Op = typename OperandOf<Tin>::type;
  const int64_t block = blockIdx.x;
  if (block < a.dkv_blocks) {
    if constexpr (kMma) {
      walk_mma_dkv_called<Tin, Tout, Tdv>(block, a.q, a.k, a.v, a.g, a.dkv_carry, a.dk, a.dv,
                                          a.n, a.f, a.m, a.dkv_nblk, a.dkv_cpb, a.vec_f,
                                          a.vec_m);
    } else {
      walk_wmma_dkv<Tin, Tout, Tdv>(block, a.q, a.k, a.v, a.g, a.dkv_carry, a.dk, a.dv, a.n, a.f,
                                    a.m, a.dkv_nblk, a.dkv_cpb, kDkvOne<Op>, a.vec_f, a.vec_m);
    }
    return;
  }
  // dq = causal(g, v, k): g and v take q's and k's places (rows of M), k takes v's (rows of F)
  const int64_t dq_block = block - a.dkv_blocks;
  if constexpr (kMma) {
    walk_mma<Tin, Tout, 1>(dq_block, 0, a.g, a.v, a.k, a.dq_carry, a.dq, nullptr, a.n, a.m, a.f,
                           a.dq_nblk, a.dq_cpb, false, false, 0.f, a.vec_m, a.vec_k);
  } else {
    walk_wmma<Tin, Tout, 1>(dq_block, 0, a.g, a.v, a.k, a.dq_carry, a.dq, nullptr, a.n, a.m, a.f,
                            a.dq_nblk, a.dq_cpb, false, false, 0.f, a.vec_m, a.vec_k);
  }
}

template <typename Tin, typename Tout, typename Tdv>
__global__ void __launch_bounds__(kThreads, kMmaBlocksPerSm<typename OperandOf<Tin>::type>)
    chunk_walk_mma_backward_kernel(BackwardWalks<Tin, Tout, Tdv> args) {
  backward_walks<Tin, Tout, Tdv, true>(args);
}

template <typename Tin, typename Tout, typename Tdv>
__global__ void __launch_bounds__(kThreads, kWalkBlocksPerSm<typename OperandOf<Tin>::type, 1>)
    chunk_walk_backward_kernel(BackwardWalks<Tin, Tout, Tdv> args) {
  backward_walks<Tin, Tout, Tdv, false>(args);
}

}  // namespace
}  // namespace ks_cuda
