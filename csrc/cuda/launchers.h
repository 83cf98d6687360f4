// Host-side entry points of the CUDA linear-attention core (defined in linear_attention.cu).
//
// Plain C++ on raw device pointers, so the kernels compile with nvcc alone (no torch headers);
// the torch binding (binding.cpp) checks tensors and calls these on the current stream.
//
// Layout: every sequence tensor is row-major and contiguous, (BH, N, D) with BH = batch*heads
// flattened. Inputs q, k, v share one dtype (fp32, fp16 or bf16); sums accumulate in fp32.
// Every function only enqueues work on `stream` and returns the launch error (cudaSuccess if
// all launches were accepted). All reductions run in a fixed order: results are bit-identical
// from run to run on one GPU (no floating-point atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ks_cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int64_t kChunk = 64;        // rows per chunk of the chunked algorithm
constexpr int64_t kReduceRows = 1024;  // rows per partial state of the non-causal reduction

// ------------------------------------------------------------------ causal product
// out_i = sum_{j<=i} (q_i . k_j) v_j   (with `reverse`: sum over j >= i)
// q, k: (BH, N, F), v: (BH, N, M) in `dtype`; out: (BH, N, M) in fp32 if `out_fp32`, else in
// `dtype`. den (optional, fp32 (BH, N)): den_i = sum_{j<=i} q_i . k_j (j >= i with reverse).
// With `normalize`, out_i is divided by (den_i + eps).
// walk_blocks = 0: per-chunk kernels (chunk states through global memory, then the outputs of
// all chunks in parallel); walk_blocks > 0 and F <= 128: each thread block walks a segment of
// chunks with the state on chip, the sequences cut into segments so that about walk_blocks
// blocks run (the per-chunk kernels where the walk does not apply). `workspace` holds
// causal_workspace_floats(...) floats (same arguments, on the device that runs the product):
// per-chunk states (S: F x M in fp32 for fp32 inputs, bf16 for half inputs; z: F in fp32) and
// per-block carries (fp32), or for the walk the segments' carries only. `mma_walk` (with
// walk_blocks > 0): inputs with F <= 64 (bf16: F <= 128) walk on mma.sync with the operands in
// registers (kernel 8) instead of WMMA tiles in shared memory (bf16 products for bf16 inputs,
// 3xTF32 for fp32, tf32 for fp16, as the WMMA walk), where its shared memory fits the device;
// same results up to the order of sums and where the operands are rounded; larger F ignores it.
int64_t causal_workspace_floats(DType dtype, int64_t bh, int64_t n, int64_t f, int64_t m,
                                int64_t walk_blocks, bool mma_walk);
cudaError_t causal_product(DType dtype, const void* q, const void* k, const void* v, void* out,
                           bool out_fp32, float* den, bool normalize, float eps, float* workspace,
                           int64_t bh, int64_t n, int64_t f, int64_t m, bool reverse,
                           int64_t walk_blocks, bool mma_walk, cudaStream_t stream);

// Gradients of the causal product for g = dL/dout (BH, N, M), fused:
// dq_i = sum_{j<=i} (g_i . v_j) k_j,  dk_j = sum_{i>=j} (g_i . v_j) q_i,
// dv_j = sum_{i>=j} (q_i . k_j) g_i.  q, k, g, v as in causal_product (g like v); dq, dk:
// (BH, N, F), in fp32 if `out_fp32` else in `dtype`; dv: (BH, N, M), in fp32 if `dv_fp32` else
// in `dtype` (dv_fp32 without out_fp32: cudaErrorInvalidValue).
// walk_blocks = 0: the chunk states of (k, v) and of (q, g), then one pass over all chunks for
// dq, dk and dv. walk_blocks > 0: dq by the walk, then dk and dv together by one reverse walk
// (F, M <= 128; separate walks otherwise); `mma_walk` as in causal_product: dq by kernel 8
// where it applies, and with F, M <= 64 dk and dv by its reverse-walk counterpart (kernel 9);
// with `walks_together`, F, M <= 64 and bf16, where an SM holds two blocks, the two walks run as
// one grid (kernel 10, or 11 without mma_walk) instead of one launch after the other.
// `workspace` holds causal_backward_workspace_floats(...) floats (same arguments, on the device
// that runs it).
int64_t causal_backward_workspace_floats(DType dtype, int64_t bh, int64_t n, int64_t f,
                                         int64_t m, int64_t walk_blocks, bool mma_walk,
                                         bool walks_together);
cudaError_t causal_backward(DType dtype, const void* q, const void* k, const void* v,
                            const void* g, void* dq, void* dk, void* dv, bool out_fp32,
                            bool dv_fp32, float* workspace, int64_t bh, int64_t n, int64_t f,
                            int64_t m, int64_t walk_blocks, bool mma_walk, bool walks_together,
                            cudaStream_t stream);

// The walk kernels that causal_product (walk_blocks > 0) and causal_backward run on the current
// device for `dtype` operands with F = f, M = m, `mma_walk` and `walks_together`, outputs in
// `dtype`: the
// product's walk (6: WMMA, 8: mma.sync; 0: the chunk kernels run instead) and the backward's
// reverse walk of dk and dv (7 or 9; 11 or 10: one grid with the dq walk as well; 0: two
// anti-causal products instead), each with how many of its thread blocks an SM holds at once
// (cudaOccupancyMaxActiveBlocksPerMultiprocessor with the kernel's shared memory). Except in
// kernels 10 and 11, the backward's dq walk is the product's with F and M swapped.
struct WalkKernels {
  int product = 0, product_blocks_per_sm = 0;
  int dkv = 0, dkv_blocks_per_sm = 0;
};
cudaError_t walk_kernels(DType dtype, int64_t f, int64_t m, bool mma_walk, bool walks_together,
                         WalkKernels* out);

// ------------------------------------------------------------------ non-causal attention
// state (fp32, (BH, F*M + F)): S = sum_j keep_j k_j v_j^T (row-major F x M) followed by
// z = sum_j keep_j k_j. k: (BH, N, F) in `dtype`, v: (BH, N, M) in `dtype`, or in fp32 with
// `v_fp32` (the backward's [dS | dz] = sum_i q_i [dnum_i | dden_i]^T beside fp32 row terms: the
// products then run on fp32 tiles, 3xTF32); key_keep: (BH / heads, N) bool, True for real
// tokens, or null. `workspace` holds full_state_workspace_floats(...) floats.
int64_t full_state_workspace_floats(int64_t bh, int64_t n, int64_t f, int64_t m);
cudaError_t full_state(DType dtype, const void* k, const void* v, bool v_fp32,
                       const bool* key_keep, int64_t heads, float* state, float* workspace,
                       int64_t bh, int64_t n, int64_t f, int64_t m, cudaStream_t stream);

// out_i = q_i . S (divided by q_i . z + eps with `normalize`; plus bias, (BH, M) fp32, where
// given); den_i = q_i . z (optional); rows i whose key_keep flag ((BH / heads, N) bool, or null)
// is false come out as zeros (out and den). q: (BH, N, F) in `dtype`, or in fp32 with `q_fp32`
// (then out in `dtype`, rounded once: dq of the backward from fp32 row terms; not with out_fp32);
// state as written by full_state; out (BH, N, M) fp32 or `dtype`.
cudaError_t full_apply(DType dtype, const void* q, bool q_fp32, const float* state,
                       const float* bias, const bool* key_keep, int64_t heads, void* out,
                       bool out_fp32, float* den, bool normalize, float eps, int64_t bh, int64_t n,
                       int64_t f, int64_t m, cudaStream_t stream);

// ------------------------------------------------------------------ the normalized backward
// out_i = base_i + post_i * sum_{j<=i} pre_j x_j  (j >= i with `reverse`); x: (BH, N, F) in
// `dtype`, pre, post: (BH, N) fp32 or null (= 1), base: (BH, N, F) fp32 or null (= 0), out:
// (BH, N, F) in fp32 with `out_fp32`, else in `dtype`, rounded once. A deterministic replacement
// for torch.cumsum (which is not deterministic on CUDA) in the normalizer's backward, where base
// is the products' part of dq or dk.
int64_t cumsum_workspace_floats(int64_t bh, int64_t n, int64_t f);
cudaError_t scaled_cumsum(DType dtype, const void* x, const float* pre, const float* post,
                          const float* base, void* out, bool out_fp32, float* workspace,
                          int64_t bh, int64_t n, int64_t f, bool reverse, cudaStream_t stream);

// The backward's row terms for out = num / d, d = den + eps, in one pass: dnum = g / d (rows, m)
// in the products' operand type (bf16 for bf16 inputs; fp32 for fp32, and for fp16, whose
// normalized backward runs in fp32), or in fp32 with `dnum_fp32`, and dden = -(g . out) / d
// (rows) fp32; with dden null, dnum is (rows, m + 1) with dden in its last column, in dnum's
// type. g, out: (rows, m) in `dtype`, den: (rows) fp32.
cudaError_t normalized_grad(DType dtype, const void* g, const void* out, const float* den,
                            float eps, void* dnum, bool dnum_fp32, float* dden, int64_t rows,
                            int64_t m, cudaStream_t stream);

}  // namespace ks_cuda
