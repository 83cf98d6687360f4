// CUDA kernels of the linear-attention core: chunked causal product on tensor cores, the
// non-causal state reduction and read-out, and a deterministic weighted cumulative sum.
// Host entry points are declared in launchers.h and defined here, at the end: they check what
// every input type shares and call Launchers<Tin> (launchers_by_dtype.h) for the dtype. Each
// type's kernels compile in a translation unit of their own (float32.cu, float16.cu,
// bfloat16.cu: nvcc runs the three at once), which includes launch.cuh (layouts, choices and
// launches) and with it the kernels' .cuh files, CUDA headers only:
//   config.cuh                 block and tile shape, modes, element types, emulator hooks
//   wmma_ops.cuh               WMMA fragment loads and products (kernels 1-7), 3xTF32's split
//   tiles.cuh                  cp.async, global <-> shared tiles, the masked scores of a chunk
//   mma_sync.cuh               mma.sync fragment layouts, ldmatrix and products (kernels 8, 9)
//   chunk_kernels.cuh          segments, kernels 1-5
//   walk_kernels.cuh           kernels 6 and 7 (the walk on WMMA)
//   register_walk_kernels.cuh  kernels 8 and 9 (the walk on mma.sync)
//   backward_walks_kernels.cuh kernels 10 and 11 (a fused backward's two walks in one grid)
//   cumsum_kernels.cuh         the weighted cumulative sum
//   normalizer_kernels.cuh     the normalized backward's row terms (g / d, -(g . out) / d)
//
// ------------------------------------------------------------------ algorithm
// Causal product out_i = sum_{j<=i} (q_i . k_j) v_j, q, k: (BH, N, F), v: (BH, N, M).
// The sequence is cut into chunks of C = 64 rows; chunk c computes
//     out_c = tril(Q_c K_c^T) V_c + Q_c S_c,     S_c = sum_{c' < c} K_c'^T V_c'   (F x M)
// in three kernels:
//   1. chunk_states_kernel   the nc chunks of a sequence are grouped into nblk blocks of cpb
//                            consecutive chunks (nblk chosen from the shape so that about 1024
//                            thread blocks run: B·H = 1 at long N still fills the GPU); a thread
//                            block walks its chunks in order with the running state in fp32
//                            accumulator fragments, writes each chunk's block-local exclusive
//                            prefix (S in the operand type: fp32 for fp32 and fp16 inputs, bf16
//                            for bf16 inputs; z = sum k_t
//                            in fp32) and the block total (fp32);
//   2. state_scan_kernel     exclusive prefix over the nblk block totals (the carries), fp32, in
//                            block order;
//   3. chunk_output_kernel   per chunk: intra-chunk masked product + Q_c (prefix_c + carry), and
//                            the normalizer den_i = q_i . z_i (+ row sums of the masked scores).
// The anti-causal product (sum over j >= i) uses the same kernels with an upper-triangular mask
// and walks/scans in reverse. The backward pass keeps no per-step state: with g = dL/dout,
//     dq = causal(g, v, k),  dk = anticausal(v, g, q),  dv = anticausal(k, q, g),
// either as three such products or fused (causal_backward): the states of (k, v) forward and of
// (q, g) in reverse (kernels 1 and 2 twice), then
//   4. chunk_dqk_kernel      per chunk and F slice: dq and dk from the two states and the chunk,
//   5. chunk_dv_kernel       per chunk and M slice: dv.
// Non-causal attention: chunk_states_kernel over blocks of 1024 rows (16 chunks accumulated in
// registers, key padding skipped), a fixed-order sum over blocks (state_scan_kernel, kSum), then
// chunk_output_kernel reading the single state without the intra-chunk term. Its backward runs on
// the same kernels: the reduction of a 16-bit q beside fp32 row terms [g/d | -(g . out)/d] (on
// fp32 tiles, q converted as it loads), and read-outs of fp32 row terms into the inputs' dtype
// (dq), with a bias row (dk's dz) and padded keys' rows written as zeros (dk, dv).
// The walk (causal and anti-causal products with walk_blocks > 0, F <= 128) replaces kernels 1-3:
//   6. chunk_walk_kernel     a thread block walks a segment of consecutive chunks in order with
//                            the state S (F x 64-wide M slice) and z in shared memory, writing
//                            each chunk's output as it goes; kernels 1 and 2 (totals only) give
//                            the segments' carries where a sequence is cut into several: kernel
//                            1 sums each segment in groups of chunks (walk_layout: about 512
//                            blocks, so that no block adds a whole segment's chunks one after
//                            another), kernel 2 adds the groups of the segments before each.
//   7. chunk_walk_dkv_kernel the walk's fused backward: dq = causal(g, v, k) by kernel 6, then dk
//                            and dv together by one reverse walk with R = sum Q^T G on chip.
//   Kernels 1 and 3 write and read one F x M state per chunk (at N = 8192, B·H = 128, F = M = 64
//   in bf16: 134 MB each way); the walk keeps it on chip and launches once.
//   8. chunk_walk_mma_kernel kernel 6 for F <= 64 (bf16: F <= 128) with mma_walk: mma.sync
//                            with each warp's operands in registers (scores to P V without
//                            shared memory, S in fp32 accumulators), one barrier per chunk.
//   9. chunk_walk_mma_dkv_kernel  kernel 7 in the same form (F, M <= 64, mma_walk).
//  10. chunk_walk_mma_backward_kernel  kernels 9 and 8 (dq) as one grid for bf16, so that an SM
//                            walks one sequence's dk, dv and another's dq at once;
//  11. chunk_walk_backward_kernel  kernels 7 (one buffer) and 6 (dq) likewise.
//  12. chunk_states_mma_kernel  kernel 1 for the carries of kernels 8-10 (totals only, on
//                            mma.sync: S in fp32 accumulators, A fragments a k-step at a time).
//
// ------------------------------------------------------------------ tiles
// Thread block: 256 threads = 8 warps. Every matrix product is on 64 x 64 tiles staged in
// shared memory: chunk rows (C = 64) x a 64-wide slice of F or M. F and M of any size are
// covered by looping over F slices (the contraction) and by one block per 64-wide M slice
// (grid.y); ragged edges (N, F, M not multiples of 64) are zero-filled in shared memory.
// Warp w owns output rows 16*(w/2) .. +16 and columns 32*(w%2) .. +32 of a 64 x 64 tile (two
// 16 x 16 accumulator fragments).
//
// Tensor cores via WMMA (sm_80+), accumulation always in fp32:
//   * bf16 inputs:  bf16 x bf16 -> fp32 (m16n16k16).
//   * fp16 inputs:  converted to fp32 on the way into shared memory, one TF32 product each
//     (m16n16k8). Every fp16 value is exact in tf32 (10 mantissa bits, fp32's range), so
//     products of two inputs (Q K^T, K^T V, G V^T) are exact, and the intermediates that
//     enter a product (masked scores, chunk states), which can exceed fp16's range (65504),
//     are rounded to tf32 (relative 2^-11, as fine as fp16 itself). With bf16 operands, a
//     product whose terms cancel (g.v at N = 1) lost the inputs' last three bits in full.
//   * fp32 inputs:  3xTF32 (m16n16k8): x = big + small with big = x and small = x - big each
//     cut to tf32 (tf32_split), a*b ~ big*big + big*small + small*big, which keeps fp32's
//     accuracy (max relative error 8e-7 against float64 in the emulator's tests of every
//     kernel, 4e-7 with both parts rounded to nearest) at tensor-core speed.
// Tiles of bf16 and fp32 inputs load with cp.async (all tiles of a step in flight at once; the
// state pass prefetches the next chunk into a second buffer while it multiplies this one); fp16
// inputs are converted to fp32 in registers on the way, every load of a chunk's tiles issued
// before the first is converted (TileBatch: one trip to memory a chunk rather than one a
// 16-byte vector; the H200 of 2026-11-30 ran the fp16 walks 4x slower than bf16's, 8.6 against
// 2.2 us a chunk, each thread waiting on its six loads one after another).
// Intermediates that are rounded to the operand type: masked intra-chunk scores and the chunk
// states (block-local prefixes stored in the operand type, carries and z in fp32).
//
// Indexing is 64-bit, except offsets inside a tile's 64 rows (load_tile: F, M < 2^24, checked
// by the binding); grid.x enumerates (BH, chunk) pairs (< 2^31 blocks).
// Determinism: no atomics; every sum has a fixed order independent of the launch.

#include "launchers_by_dtype.h"

namespace ks_cuda {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool known(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

template <typename T>
struct TypeOf {
  using type = T;
};

// fn(TypeOf<Tin>{}) for the input type of `dtype` (float for a dtype not known: the callers
// that can fail check known() first).
template <typename Fn>
auto by_dtype(DType dtype, Fn fn) {
  switch (dtype) {
    case DType::kFloat16:
      return fn(TypeOf<__half>{});
    case DType::kBFloat16:
      return fn(TypeOf<__nv_bfloat16>{});
    default:
      return fn(TypeOf<float>{});
  }
}

}  // namespace

// ------------------------------------------------------------------ entry points
int64_t causal_workspace_floats(DType dtype, int64_t bh, int64_t n, int64_t f, int64_t m,
                                int64_t walk_blocks, bool mma_walk) {
  if (bh <= 0 || n <= 0 || f <= 0 || m <= 0) return 0;  // nothing runs (causal_product)
  return by_dtype(dtype, [&](auto t) {
    using L = Launchers<typename decltype(t)::type>;
    return L::causal_workspace_floats(bh, n, f, m, walk_blocks, mma_walk);
  });
}

cudaError_t causal_product(DType dtype, const void* q, const void* k, const void* v, void* out,
                           bool out_fp32, float* den, bool normalize, float eps, float* workspace,
                           int64_t bh, int64_t n, int64_t f, int64_t m, bool reverse,
                           int64_t walk_blocks, bool mma_walk, cudaStream_t stream) {
  if (bh <= 0 || n <= 0 || m <= 0) return cudaSuccess;
  if (f <= 0 || !known(dtype)) return cudaErrorInvalidValue;
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::causal_product(
        q, k, v, out, out_fp32, den, normalize, eps, workspace, bh, n, f, m, reverse, walk_blocks,
        mma_walk, stream);
  });
}

int64_t causal_backward_workspace_floats(DType dtype, int64_t bh, int64_t n, int64_t f,
                                         int64_t m, int64_t walk_blocks, bool mma_walk,
                                         bool walks_together) {
  if (bh <= 0 || n <= 0 || f <= 0 || m <= 0) return 0;  // nothing runs (causal_backward)
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::causal_backward_workspace_floats(
        bh, n, f, m, walk_blocks, mma_walk, walks_together);
  });
}

cudaError_t causal_backward(DType dtype, const void* q, const void* k, const void* v,
                            const void* g, void* dq, void* dk, void* dv, bool out_fp32,
                            bool dv_fp32, float* workspace, int64_t bh, int64_t n, int64_t f,
                            int64_t m, int64_t walk_blocks, bool mma_walk, bool walks_together,
                            cudaStream_t stream) {
  if (bh <= 0 || n <= 0) return cudaSuccess;
  if (f <= 0 || m <= 0 || !known(dtype)) return cudaErrorInvalidValue;
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::causal_backward(
        q, k, v, g, dq, dk, dv, out_fp32, dv_fp32, workspace, bh, n, f, m, walk_blocks, mma_walk,
        walks_together, stream);
  });
}

cudaError_t walk_kernels(DType dtype, int64_t f, int64_t m, bool mma_walk, bool walks_together,
                         WalkKernels* out) {
  *out = WalkKernels{};
  if (f <= 0 || m <= 0 || !known(dtype)) return cudaErrorInvalidValue;
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::walk_kernels(f, m, mma_walk, walks_together,
                                                               out);
  });
}

int64_t full_state_workspace_floats(int64_t bh, int64_t n, int64_t f, int64_t m) {
  return bh * cdiv(n, kReduceRows) * (f * m + f);
}

cudaError_t full_state(DType dtype, const void* k, const void* v, bool v_fp32,
                       const bool* key_keep, int64_t heads, float* state, float* workspace,
                       int64_t bh, int64_t n, int64_t f, int64_t m, cudaStream_t stream) {
  if (bh <= 0) return cudaSuccess;
  if (f <= 0 || m <= 0 || heads <= 0 || !known(dtype)) return cudaErrorInvalidValue;
  if (n <= 0) {
    return cudaMemsetAsync(state, 0, sizeof(float) * bh * (f * m + f), stream);
  }
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::full_state(k, v, v_fp32, key_keep, heads, state,
                                                             workspace, bh, n, f, m, stream);
  });
}

cudaError_t full_apply(DType dtype, const void* q, bool q_fp32, const float* state,
                       const float* bias, const bool* key_keep, int64_t heads, void* out,
                       bool out_fp32, float* den, bool normalize, float eps, int64_t bh, int64_t n,
                       int64_t f, int64_t m, cudaStream_t stream) {
  if (bh <= 0 || n <= 0 || m <= 0) return cudaSuccess;
  if (f <= 0 || heads <= 0 || !known(dtype) || (q_fp32 && out_fp32)) {
    return cudaErrorInvalidValue;
  }
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::full_apply(q, q_fp32, state, bias, key_keep,
                                                             heads, out, out_fp32, den, normalize,
                                                             eps, bh, n, f, m, stream);
  });
}

int64_t cumsum_workspace_floats(int64_t bh, int64_t n, int64_t f) {
  return bh * cdiv(n, kChunk) * f;  // one partial sum per chunk (64 rows) and column
}

cudaError_t scaled_cumsum(DType dtype, const void* x, const float* pre, const float* post,
                          const float* base, void* out, bool out_fp32, float* workspace,
                          int64_t bh, int64_t n, int64_t f, bool reverse, cudaStream_t stream) {
  if (bh <= 0 || n <= 0 || f <= 0) return cudaSuccess;
  if (!known(dtype)) return cudaErrorInvalidValue;
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::scaled_cumsum(
        x, pre, post, base, out, out_fp32, workspace, bh, n, f, reverse, stream);
  });
}

cudaError_t normalized_grad(DType dtype, const void* g, const void* out, const float* den,
                            float eps, void* dnum, bool dnum_fp32, float* dden, int64_t rows,
                            int64_t m, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (m < 0 || !known(dtype)) return cudaErrorInvalidValue;
  return by_dtype(dtype, [&](auto t) {
    return Launchers<typename decltype(t)::type>::normalized_grad(
        g, out, den, eps, dnum, dnum_fp32, dden, rows, m, stream);
  });
}

}  // namespace ks_cuda
