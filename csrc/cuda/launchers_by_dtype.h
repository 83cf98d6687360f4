// The entry points of launchers.h for one input type: Launchers<Tin> for Tin = float, __half
// and __nv_bfloat16. linear_attention.cu checks the arguments every type shares and dispatches
// on the dtype; launch.cuh defines the members, and float32.cu, float16.cu and bfloat16.cu
// each instantiate one type's (with its kernels), so that the three compile in parallel.
// Arguments and results are those of the entry point of the same name in launchers.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"

namespace ks_cuda {

template <typename Tin>
struct Launchers {
  static int64_t causal_workspace_floats(int64_t bh, int64_t n, int64_t f, int64_t m,
                                         int64_t walk_blocks, bool mma_walk);
  static cudaError_t causal_product(const void* q, const void* k, const void* v, void* out,
                                    bool out_fp32, float* den, bool normalize, float eps,
                                    float* workspace, int64_t bh, int64_t n, int64_t f,
                                    int64_t m, bool reverse, int64_t walk_blocks, bool mma_walk,
                                    cudaStream_t stream);
  static int64_t causal_backward_workspace_floats(int64_t bh, int64_t n, int64_t f, int64_t m,
                                                  int64_t walk_blocks, bool mma_walk,
                                                  bool walks_together);
  static cudaError_t causal_backward(const void* q, const void* k, const void* v, const void* g,
                                     void* dq, void* dk, void* dv, bool out_fp32, bool dv_fp32,
                                     float* workspace, int64_t bh, int64_t n, int64_t f,
                                     int64_t m, int64_t walk_blocks, bool mma_walk,
                                     bool walks_together, cudaStream_t stream);
  static cudaError_t walk_kernels(int64_t f, int64_t m, bool mma_walk, bool walks_together,
                                  WalkKernels* out);
  static cudaError_t full_state(const void* k, const void* v, bool v_fp32, const bool* key_keep,
                                int64_t heads, float* state, float* workspace, int64_t bh,
                                int64_t n, int64_t f, int64_t m, cudaStream_t stream);
  static cudaError_t full_apply(const void* q, bool q_fp32, const float* state, const float* bias,
                                const bool* key_keep, int64_t heads, void* out, bool out_fp32,
                                float* den, bool normalize, float eps, int64_t bh, int64_t n,
                                int64_t f, int64_t m, cudaStream_t stream);
  static cudaError_t scaled_cumsum(const void* x, const float* pre, const float* post,
                                   const float* base, void* out, bool out_fp32, float* workspace,
                                   int64_t bh, int64_t n, int64_t f, bool reverse,
                                   cudaStream_t stream);
  static cudaError_t normalized_grad(const void* g, const void* out, const float* den, float eps,
                                     void* dnum, bool dnum_fp32, float* dden, int64_t rows,
                                     int64_t m, cudaStream_t stream);
};

// Instantiated in float32.cu, float16.cu and bfloat16.cu, nowhere else.
extern template struct Launchers<float>;
extern template struct Launchers<__half>;
extern template struct Launchers<__nv_bfloat16>;

}  // namespace ks_cuda
