// The thread block and tile shape, the modes, element types and conversions, and the hooks of
// tests/cuda_emulator. Included, with every .cuh here in order, by launch.cuh (in each input
// type's .cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "launchers.h"

// Hooks for tests/cuda_emulator, which compiles the .cu files as plain C++ and runs every
// kernel on the CPU (one fiber per thread): the kernel launch, the dynamic shared memory of a
// block, and in host compilation the asynchronous copy and its wait (the emulator lands each copy
// at the issue or at the wait). nvcc gets the usual forms.
#ifndef KS_LAUNCH
#define KS_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif
#ifndef KS_DYNAMIC_SMEM
#define KS_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif
#ifndef KS_HOST_ASYNC_COPY16
#define KS_HOST_ASYNC_COPY16(dst, src) \
  (*static_cast<uint4*>(dst) = *static_cast<const uint4*>(src))
#define KS_HOST_ASYNC_WAIT()
#endif
// ... the thread blocks a walk's carry pass aims at (walk_layout in launch.cuh), which
// a test of the emulator lowers so that small shapes sum several chunks a group ...
#ifndef KS_CARRY_BLOCKS
#define KS_CARRY_BLOCKS 512
#endif
// ... the thread blocks the chunk kernels' state pass aims at (causal_layout in launch.cuh),
// which a test of the emulator lowers so that small shapes give a block several chunks ...
#ifndef KS_CHUNK_BLOCKS
#define KS_CHUNK_BLOCKS 1024
#endif
// ... and for kernels 8 and 9, the warp-collective ldmatrix and mma.sync (the emulator gathers
// the lanes' registers as the PTX ISA lays them out); nvcc's host pass never runs them.
#ifndef KS_HOST_LDMATRIX_X4
#define KS_HOST_LDMATRIX_X4(regs, ptr, trans)
#define KS_HOST_MMA_BF16(acc, a, b)
#define KS_HOST_MMA_TF32(acc, a, b)
#endif

namespace ks_cuda {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 256;  // 8 warps per block
constexpr int kTile = 64;      // tile edge: chunk rows and F / M slices
constexpr int kLdF = kTile + 4;  // leading dimension of fp32 shared tiles (pad: fewer conflicts)
static_assert(kChunk == kTile, "the chunk is one tile tall");
static_assert(kReduceRows % kTile == 0, "reduction blocks are whole chunks");

enum Mode : int { kCausal = 0, kAntiCausal = 1, kFull = 2 };
enum ScanMode : int { kExclusiveForward = 0, kExclusiveReverse = 1, kSum = 2 };

// ------------------------------------------------------------------ element conversions
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Shared-memory operand type of the tensor-core products for an input type, and whether the
// products split their operands (3xTF32).
template <typename Tin>
struct OperandOf {
  using type = __nv_bfloat16;  // bf16 inputs
};
template <>
struct OperandOf<float> {
  using type = float;  // 3xTF32
};
template <>
struct OperandOf<__half> {
  using type = float;  // 1xTF32: every fp16 value is exact in tf32
};
template <typename Tin>
constexpr bool kSplitOf = std::is_same_v<Tin, float>;

// Built with -DKS_FP32_BF16X3 ($KERNELSTUDY_CUDA_FLAGS), fp32 inputs' register walks (kernels
// 8, 9 and 12; Bf16x3Band in register_walk_kernels.cuh) multiply two bf16 parts of each
// operand (bf16x3, m16n8k16: half the tensor-pipe time of 3xTF32's m16n8k8 products) instead of
// two tf32 parts; the WMMA kernels (1-7) keep 3xTF32. Not the default until a GPU has timed it
// against 3xTF32.
#ifdef KS_FP32_BF16X3
constexpr bool kFp32Bf16x3 = true;
#else
constexpr bool kFp32Bf16x3 = false;
#endif

// Leading dimension of a 64-wide shared tile of operands: a multiple of 16 bytes (WMMA) that
// shifts consecutive rows across banks.
template <typename Op>
__host__ __device__ constexpr int ld_of() {
  return kTile + (sizeof(Op) == 2 ? 8 : 4);
}

}  // namespace
}  // namespace ks_cuda
