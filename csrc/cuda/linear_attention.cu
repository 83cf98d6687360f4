// CUDA kernels of the linear-attention core: chunked causal product on tensor cores, the
// non-causal state reduction and read-out, and a deterministic weighted cumulative sum.
// Host entry points are declared in launchers.h; this file includes CUDA headers only.
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
// chunk_output_kernel reading the single state without the intra-chunk term.
// The walk (causal and anti-causal products with walk_blocks > 0, F <= 128) replaces kernels 1-3:
//   6. chunk_walk_kernel     a thread block walks a segment of consecutive chunks in order with
//                            the state S (F x 64-wide M slice) and z in shared memory, writing
//                            each chunk's output as it goes; kernels 1 and 2 (totals only) give
//                            the segments' carries where a sequence is cut into several.
//   7. chunk_walk_dkv_kernel the walk's fused backward: dq = causal(g, v, k) by kernel 6, then dk
//                            and dv together by one reverse walk with R = sum Q^T G on chip.
//   Kernels 1 and 3 write and read one F x M state per chunk (at N = 8192, B·H = 128, F = M = 64
//   in bf16: 134 MB each way); the walk keeps it on chip and launches once.
//   8. chunk_walk_mma_kernel kernel 6 for F <= 64 (bf16: F <= 128) with mma_walk: mma.sync
//                            with each warp's operands in registers (scores to P V without
//                            shared memory, S in fp32 accumulators), one barrier per chunk.
//   9. chunk_walk_mma_dkv_kernel  kernel 7 in the same form (F, M <= 64, mma_walk).
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
// inputs are converted to fp32 in registers on the way.
// Intermediates that are rounded to the operand type: masked intra-chunk scores and the chunk
// states (block-local prefixes stored in the operand type, carries and z in fp32).
//
// Indexing is 64-bit, except offsets inside a tile's 64 rows (load_tile: F, M < 2^24, checked
// by the binding); grid.x enumerates (BH, chunk) pairs (< 2^31 blocks).
// Determinism: no atomics; every sum has a fixed order independent of the launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "launchers.h"

// Hooks for tests/cuda_emulator, which compiles this file as plain C++ and runs every kernel on
// the CPU (one fiber per thread): the kernel launch, the dynamic shared memory of a block, and
// in host compilation the asynchronous copy and its wait (the emulator lands each copy at the
// issue or at the wait). nvcc gets the usual forms.
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
// ... and for kernels 8 and 9, the warp-collective ldmatrix and mma.sync (the emulator gathers the
// lanes' registers as the PTX ISA lays them out); nvcc's host pass never runs them.
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

// Leading dimension of a 64-wide shared tile of operands: a multiple of 16 bytes (WMMA) that
// shifts consecutive rows across banks.
template <typename Op>
__host__ __device__ constexpr int ld_of() {
  return kTile + (sizeof(Op) == 2 ? 8 : 4);
}

// ------------------------------------------------------------------ warp-level MMA
// 3xTF32's split of an fp32 value x = big + small + r: big is x with the low 13 bits of its
// encoding cleared (a tf32 value, x rounded toward zero), small the same of x - big (exact in
// fp32), so |r| < 2^-20 |x|, and a b ~ big_a big_b + small_a big_b + big_a small_b lies
// within about 3 * 2^-20 of a b, far inside fp32 outputs' 1e-4. Two instructions a value where
// rounding to nearest (cvt.rna.tf32) takes several: with it, the fp32 kernels' chunk loops had
// 19-34% more instructions (static SASS, sm_90a) and more spills. Both parts are exact tf32 values, so
// what a tensor core does with an operand's low bits never matters. Non-finite x keeps a
// non-finite big or small (inf: big inf, small NaN), as with rounding.
__device__ __forceinline__ void tf32_split(float x, float& big, float& small) {
  constexpr uint32_t kKept = 0xffffe000u;  // sign, exponent and the 10 bits tf32 keeps
  uint32_t u;
  memcpy(&u, &x, 4);
  u &= kKept;
  memcpy(&big, &u, 4);
  const float rest = x - big;
  memcpy(&u, &rest, 4);
  u &= kKept;
  memcpy(&small, &u, 4);
}

// WMMA fragments loaded from and stored to shared memory. nvcc compiles wmma::load_matrix_sync
// on bf16 and tf32 fragments to generic loads even where the pointer is plainly shared: four
// 32-bit LD a fragment, each with 64-bit address arithmetic (nvcc 13.0, sm_80 and sm_90a; fp16
// fragments get .shared). The same PTX instruction (wmma.load/.store with the fragment's use,
// layout, shape and type, so the same fragment) in the .shared state space is one ldmatrix
// (LDSM) a bf16 fragment; every tile the kernels pass to WMMA is in shared memory. Host
// compilation (tests/cuda_emulator) goes through wmma's own calls; tests/test_nvcc_compile.py
// checks in the PTX that every mma reads its fragments in the use and layout they were loaded.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KS_SHARED(p) "r"(static_cast<unsigned>(__cvta_generic_to_shared(p)))
// wmma.load.<use>.sync.aligned.<layout>.<shape>.shared.<type> of an A or B fragment (4 registers)
#define KS_WMMA_LOAD4(qualifiers, f, p, ldm)                                                  \
  do {                                                                                        \
    uint32_t* r_ = reinterpret_cast<uint32_t*>(f.x);                                          \
    asm volatile("wmma.load." qualifiers " {%0, %1, %2, %3}, [%4], %5;\n"                     \
                 : "=r"(r_[0]), "=r"(r_[1]), "=r"(r_[2]), "=r"(r_[3])                         \
                 : KS_SHARED(p), "r"(ldm)                                                     \
                 : "memory");                                                                 \
  } while (0)
// ... picked by load_shared's kA (matrix_a, else matrix_b) and kRow (row_major, else col_major)
#define KS_WMMA_LOAD_AB(shape, type, f, p, ldm)                                               \
  if constexpr (kA && kRow) KS_WMMA_LOAD4("a.sync.aligned.row." shape ".shared." type, f, p, ldm); \
  else if constexpr (kA) KS_WMMA_LOAD4("a.sync.aligned.col." shape ".shared." type, f, p, ldm);   \
  else if constexpr (kRow) KS_WMMA_LOAD4("b.sync.aligned.row." shape ".shared." type, f, p, ldm); \
  else KS_WMMA_LOAD4("b.sync.aligned.col." shape ".shared." type, f, p, ldm)
// the 8 registers of an fp32 accumulator fragment f as asm operands of constraint `how`
#define KS_ACC8(how, f) how(f.x[0]), how(f.x[1]), how(f.x[2]), how(f.x[3]), how(f.x[4]), \
                        how(f.x[5]), how(f.x[6]), how(f.x[7])
#define KS_WMMA_LOAD_C(shape, f, p, ldm)                                                      \
  asm volatile("wmma.load.c.sync.aligned.row." shape ".shared.f32 "                           \
               "{%0, %1, %2, %3, %4, %5, %6, %7}, [%8], %9;\n"                                \
               : KS_ACC8("=f", f) : KS_SHARED(p), "r"(ldm) : "memory")
#define KS_WMMA_STORE_D(shape, p, f, ldm)                                                     \
  asm volatile("wmma.store.d.sync.aligned.row." shape ".shared.f32 "                          \
               "[%0], {%1, %2, %3, %4, %5, %6, %7, %8}, %9;\n"                                \
               :: KS_SHARED(p), KS_ACC8("f", f), "r"(ldm) : "memory")
#endif

// An A or B fragment (16 x 16 x 16 bf16 or 16 x 16 x 8 tf32, row- or column-major) from p.
template <typename Use, int K, typename T, typename L, typename E>
__device__ __forceinline__ void load_shared(wmma::fragment<Use, 16, 16, K, T, L>& f, const E* p,
                                            unsigned ldm) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kA = std::is_same_v<Use, wmma::matrix_a>;
  constexpr bool kRow = std::is_same_v<L, wmma::row_major>;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    KS_WMMA_LOAD_AB("m16n16k16", "bf16", f, p, ldm);
  } else {
    static_assert(std::is_same_v<T, wmma::precision::tf32> && K == 8, "bf16 or tf32 fragments");
    KS_WMMA_LOAD_AB("m16n16k8", "tf32", f, p, ldm);
  }
#else
  wmma::load_matrix_sync(f, p, ldm);
#endif
}

// A row-major fp32 accumulator fragment (16 x 16, of a k16 or k8 product) from p.
template <int K>
__device__ __forceinline__ void load_shared(wmma::fragment<wmma::accumulator, 16, 16, K, float>& f,
                                            const float* p, unsigned ldm) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(K == 16 || K == 8, "k16 or k8 accumulators");
  if constexpr (K == 16) {
    KS_WMMA_LOAD_C("m16n16k16", f, p, ldm);
  } else {
    KS_WMMA_LOAD_C("m16n16k8", f, p, ldm);
  }
#else
  wmma::load_matrix_sync(f, p, ldm, wmma::mem_row_major);
#endif
}

// A row-major fp32 accumulator fragment to p.
template <int K>
__device__ __forceinline__ void store_shared(
    float* p, const wmma::fragment<wmma::accumulator, 16, 16, K, float>& f, unsigned ldm) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(K == 16 || K == 8, "k16 or k8 accumulators");
  if constexpr (K == 16) {
    KS_WMMA_STORE_D("m16n16k16", p, f, ldm);
  } else {
    KS_WMMA_STORE_D("m16n16k8", p, f, ldm);
  }
#else
  wmma::store_matrix_sync(p, f, ldm, wmma::mem_row_major);
#endif
}
#undef KS_SHARED
#undef KS_WMMA_LOAD4
#undef KS_WMMA_LOAD_AB
#undef KS_ACC8
#undef KS_WMMA_LOAD_C
#undef KS_WMMA_STORE_D

template <typename Op>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static constexpr int kK = 16;
  template <typename L>
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, L>;
  template <typename L>
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, L>;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

  template <typename LA, typename LB, bool kSplit>
  static __device__ __forceinline__ void step(Acc (&acc)[2], const __nv_bfloat16* a, int lda,
                                              const __nv_bfloat16* b0, const __nv_bfloat16* b1,
                                              int ldb) {
    FragA<LA> fa;
    FragB<LB> fb;
    load_shared(fa, a, lda);
    load_shared(fb, b0, ldb);
    wmma::mma_sync(acc[0], fa, fb, acc[0]);
    load_shared(fb, b1, ldb);
    wmma::mma_sync(acc[1], fa, fb, acc[1]);
  }
};

template <>
struct Mma<float> {  // 3xTF32 (kSplit) or 1xTF32
  static constexpr int kK = 8;
  template <typename L>
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, L>;
  template <typename L>
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, L>;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

  template <typename Frag>
  static __device__ __forceinline__ void split(Frag& big, Frag& small) {
#pragma unroll
    for (int i = 0; i < big.num_elements; ++i) {
      float hi, lo;
      tf32_split(big.x[i], hi, lo);
      big.x[i] = hi;
      small.x[i] = lo;
    }
  }

  template <typename Frag>
  static __device__ __forceinline__ void round(Frag& frag) {
#pragma unroll
    for (int i = 0; i < frag.num_elements; ++i) frag.x[i] = wmma::__float_to_tf32(frag.x[i]);
  }

  template <typename LA, typename LB, bool kSplit>
  static __device__ __forceinline__ void step(Acc (&acc)[2], const float* a, int lda,
                                              const float* b0, const float* b1, int ldb) {
    if constexpr (kSplit) {
      FragA<LA> a_big, a_small;
      FragB<LB> b_big, b_small;
      load_shared(a_big, a, lda);
      split(a_big, a_small);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        load_shared(b_big, j == 0 ? b0 : b1, ldb);
        split(b_big, b_small);
        wmma::mma_sync(acc[j], a_small, b_big, acc[j]);
        wmma::mma_sync(acc[j], a_big, b_small, acc[j]);
        wmma::mma_sync(acc[j], a_big, b_big, acc[j]);
      }
    } else {
      FragA<LA> fa;
      FragB<LB> fb;
      load_shared(fa, a, lda);
      round(fa);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        load_shared(fb, j == 0 ? b0 : b1, ldb);
        round(fb);
        wmma::mma_sync(acc[j], fa, fb, acc[j]);
      }
    }
  }
};

// Address of element (row, col) of a shared matrix stored with layout L.
template <typename L, typename T>
__device__ __forceinline__ const T* at(const T* base, int ld, int row, int col) {
  if constexpr (std::is_same_v<L, wmma::row_major>) {
    return base + row * ld + col;
  } else {
    return base + col * ld + row;
  }
}

// The warp's slab of a 64 x 64 tile: rows [r0, r0+16) and columns [c0, c0+32), two 16 x 16
// fragments (see "tiles" above).
struct Slab {
  int r0, c0;
};
__device__ __forceinline__ Slab warp_slab() {
  const int warp = threadIdx.x / 32;
  return {(warp / 2) * 16, (warp % 2) * 32};
}

// The warp's 16 x 32 slab of a 64 x 64 product:  acc[j] += A[r0:r0+16, 0:64] B[0:64, c0+16j:+16].
// A (64 x 64) and B (64 x 64) live in shared memory with layouts LA and LB, in the operand type
// of input type Tin.
template <typename Tin, typename LA, typename LB, typename Op = typename OperandOf<Tin>::type>
__device__ __forceinline__ void warp_gemm(typename Mma<Op>::Acc (&acc)[2], const Op* A, int lda,
                                          const Op* B, int ldb) {
  const Slab w = warp_slab();
#pragma unroll
  for (int kk = 0; kk < kTile; kk += Mma<Op>::kK) {
    Mma<Op>::template step<LA, LB, kSplitOf<Tin>>(acc, at<LA>(A, lda, w.r0, kk), lda,
                                                  at<LB>(B, ldb, kk, w.c0),
                                                  at<LB>(B, ldb, kk, w.c0 + 16), ldb);
  }
}

// Stores the warp's two accumulator fragments into a 64 x 64 fp32 shared tile (ld kLdF).
template <typename Acc>
__device__ __forceinline__ void warp_store(float* tile, const Acc (&acc)[2]) {
  const Slab w = warp_slab();
  float* slab = tile + w.r0 * kLdF + w.c0;
  store_shared(slab, acc[0], kLdF);
  store_shared(slab + 16, acc[1], kLdF);
}

// Zeroes the warps' accumulator pairs.
template <typename Acc, typename... More>
__device__ __forceinline__ void zero(Acc (&acc)[2], More&... more) {
  wmma::fill_fragment(acc[0], 0.f);
  wmma::fill_fragment(acc[1], 0.f);
  if constexpr (sizeof...(More) > 0) zero(more...);
}

// ------------------------------------------------------------------ asynchronous copies
// cp.async (sm_80+): 16 bytes global -> shared without a trip through registers, so every tile
// of a step is in flight at once. A thread waits for its own copies with cp_async_wait_all();
// a __syncthreads() after that makes all threads' copies visible to the block.
__device__ __forceinline__ void cp_async16(void* dst_shared, const void* src_global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src_global)
               : "memory");
#elif !defined(__CUDA_ARCH__)  // host compilation (tests/cuda_emulator)
  KS_HOST_ASYNC_COPY16(dst_shared, src_global);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#elif !defined(__CUDA_ARCH__)
  KS_HOST_ASYNC_WAIT();
#endif
}

// ------------------------------------------------------------------ mma.sync fragments
// Kernels 8 and 9 multiply with mma.sync on operands in registers, laid out as the PTX ISA
// specifies; g = lane / 4, t = lane % 4. bf16 inputs: m16n8k16 (bf16 x bf16 -> fp32), pairs of
// bf16 packed low element first into a 32-bit register:
//   A (16 x 16, row):  a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
//                      a[3] = A[g+8][2t+8, 2t+9];
//   B (16 x 8, col):   b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g];
//   C (16 x 8, fp32):  c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1].
// ldmatrix.x4 loads four 8 x 8 bf16 matrices from shared memory, lane 8i + r giving the address
// of row r of matrix i (16-byte aligned); register i of a lane receives matrix i's row g, columns
// 2t and 2t+1, or with `trans` its column g, rows 2t and 2t+1.
// fp32 and fp16 inputs: m16n8k8 (tf32 x tf32 -> fp32), one fp32 bit pattern per register,
// a tf32 value (tf32_split's parts, or rounded with cvt.rna) when it enters a product:
//   A (16 x 8, row):   a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4];
//   B (8 x 8, col):    b[0] = B[t][g], b[1] = B[t+4][g];
//   C (16 x 8, fp32):  as for bf16.
// A sum over k does not depend on the order of its terms, so the kernels place index 2t of each
// k-step in slot t and 2t + 1 in slot t + 4, in A and B alike: A's a[0], a[2] are then C's c[0],
// c[1] (scores pass from accumulators to A fragments in place), and a row's pair loads as one
// float2.

// Two floats rounded to a 16-bit type T and packed (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(sizeof(T) == 2, "two 16-bit elements");
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  uint16_t ua, ub;
  memcpy(&ua, &a, 2);
  memcpy(&ub, &b, 2);
  return static_cast<uint32_t>(ua) | (static_cast<uint32_t>(ub) << 16);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return pack2<__nv_bfloat16>(lo, hi);
}

__device__ __forceinline__ uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

__device__ __forceinline__ float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
  }
#elif !defined(__CUDA_ARCH__)
  KS_HOST_LDMATRIX_X4(r, p, kTrans);
#endif
}

// acc += A B for one m16n8k16 step (a: A's four registers, b0, b1: B's two).
__device__ __forceinline__ void mma_bf16(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif !defined(__CUDA_ARCH__)
  const uint32_t b[2] = {b0, b1};
  KS_HOST_MMA_BF16(acc, a, b);
#endif
}

// acc += A B for one m16n8k8 step on tf32 operands (registers holding tf32 values).
__device__ __forceinline__ void mma_tf32_rounded(float (&acc)[4], const uint32_t (&a)[4],
                                                 uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif !defined(__CUDA_ARCH__)
  const uint32_t b[2] = {b0, b1};
  KS_HOST_MMA_TF32(acc, a, b);
#endif
}

// The fp32 value of register x rounded to tf32 (cvt.rna: to nearest, ties away from zero).
__device__ __forceinline__ uint32_t tf32_bits(uint32_t x) {
  return float_bits(wmma::__float_to_tf32(bits_float(x)));
}

// tf32_split of fp32 register x.
__device__ __forceinline__ void tf32_split_bits(uint32_t x, uint32_t& big, uint32_t& small) {
  float hi, lo;
  tf32_split(bits_float(x), hi, lo);
  big = float_bits(hi);
  small = float_bits(lo);
}

// An A fragment of fp32 registers made ready for m16n8k8 products: with kSplit (3xTF32) split
// into big and small (tf32_split), else rounded to tf32 (big; 1xTF32, as for fp16 inputs).
// Made once per k-step and used by every n-tile of it: rounding to nearest costs several
// instructions a register.
template <bool kSplit>
struct TF32A {
  uint32_t big[4], small[kSplit ? 4 : 1];
  TF32A() = default;
  __device__ __forceinline__ explicit TF32A(const uint32_t (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kSplit) {
        tf32_split_bits(a[i], big[i], small[i]);
      } else {
        big[i] = tf32_bits(a[i]);
      }
    }
  }
};

// acc += A B for one m16n8k8 step on fp32 B registers b0, b1: with kSplit as 3xTF32
// (A B ~ small big + big small + big big, as Mma<float>), else on the operands rounded to tf32.
template <bool kSplit>
__device__ __forceinline__ void mma_tf32(float (&acc)[4], const TF32A<kSplit>& a, uint32_t b0,
                                         uint32_t b1) {
  if constexpr (kSplit) {
    uint32_t b0_big, b0_small, b1_big, b1_small;
    tf32_split_bits(b0, b0_big, b0_small);
    tf32_split_bits(b1, b1_big, b1_small);
    mma_tf32_rounded(acc, a.small, b0_big, b1_big);
    mma_tf32_rounded(acc, a.big, b0_small, b1_small);
    mma_tf32_rounded(acc, a.big, b0_big, b1_big);
  } else {
    mma_tf32_rounded(acc, a.big, tf32_bits(b0), tf32_bits(b1));
  }
}

// ------------------------------------------------------------------ global -> shared tiles
// How many of a tile's 64 rows (columns) lie inside a matrix that has `left` of them from the
// tile's first on (0 where left <= 0).
__device__ __forceinline__ int extent_in(int64_t left) {
  return static_cast<int>(left < 0 ? 0 : (left < kTile ? left : kTile));
}

// Copies rows [row0, row0+64) x columns [col0, col0+64) of a row-major global matrix
// (rows x cols, leading dimension ld) into a 64 x 64 shared tile (leading dimension ldd),
// converted to Op. Elements outside the matrix, and rows whose `keep` flag is false, are zero.
// `add` (optional): an fp32 matrix of the same shape and leading dimension added on the way
// (the carry of earlier segments onto a block-local state prefix).
// Each thread moves 16-byte vectors; `vec` says the global rows are 16-byte aligned. Where no
// conversion or addition is needed (Tin == Op: bf16 and fp32 inputs), whole in-range vectors
// are copied with cp.async: the caller calls cp_async_wait_all() before the __syncthreads()
// that publishes the tile. Zero fill and converted elements are stored directly.
template <typename Tin, typename Op>
__device__ __forceinline__ void load_tile(Op* __restrict__ dst, int ldd,
                                          const Tin* __restrict__ src, int64_t ld, int64_t rows,
                                          int64_t cols, int64_t row0, int64_t col0,
                                          const bool* __restrict__ keep, bool vec,
                                          const float* __restrict__ add = nullptr) {
  constexpr int V = 16 / sizeof(Tin);  // elements per vector: 4 (fp32) or 8 (16-bit)
  constexpr int kVecPerRow = kTile / V;
  // 8 (fp32 -> bf16), 16, or 32 (fp16 -> fp32) bytes, aligned to at most 16: rows of fp32
  // tiles are 16-byte aligned only (32 bytes are stored as two 16-byte vectors)
  struct alignas(sizeof(Op) * V < 16 ? sizeof(Op) * V : 16) Pack {
    Op e[V];
  };
  // Thread t moves columns c .. c + V - 1 of rows t / kVecPerRow + kRowsPerPass * pass. From
  // the tile's corner on, offsets and bounds are 32-bit: ld < 2^24 (checked by the binding).
  constexpr int kRowsPerPass = kThreads / kVecPerRow;
  static_assert(kThreads % kVecPerRow == 0 && kTile % kRowsPerPass == 0, "whole rows per pass");
  const int64_t corner = row0 * ld + col0;
  src += corner;
  if (add != nullptr) add += corner;
  if (keep != nullptr) keep += row0;
  const int in_rows = extent_in(rows - row0), in_cols = extent_in(cols - col0);
  const int r_first = threadIdx.x / kVecPerRow, c = (threadIdx.x % kVecPerRow) * V;
  const bool vec_ok = vec && c + V <= in_cols;
  // unrolled where whole vectors go by cp.async; one pass at a time where they convert in
  // registers (fp16 -> fp32: 8 floats a vector; unrolled, the chunk kernels spilled)
  constexpr int kPasses = kTile / kRowsPerPass, kUnroll = std::is_same_v<Tin, Op> ? kPasses : 1;
#pragma unroll kUnroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = r_first + pass * kRowsPerPass;
    const int at = r * static_cast<int>(ld) + c;  // element (r, c) from the corner
    const bool row_ok = r < in_rows && (keep == nullptr || keep[r]);
    if constexpr (std::is_same_v<Tin, Op>) {
      if (row_ok && vec_ok && add == nullptr) {
        cp_async16(dst + r * ldd + c, src + at);
        continue;
      }
    }
    float x[V];
    if (row_ok && vec_ok) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + at);
      const Tin* e = reinterpret_cast<const Tin*>(&raw);
#pragma unroll
      for (int u = 0; u < V; ++u) x[u] = to_float(e[u]);
    } else {
#pragma unroll
      for (int u = 0; u < V; ++u) x[u] = (row_ok && c + u < in_cols) ? to_float(src[at + u]) : 0.f;
    }
    if (add != nullptr && row_ok) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        if (c + u < in_cols) x[u] += add[at + u];
      }
    }
    Pack p;
#pragma unroll
    for (int u = 0; u < V; ++u) p.e[u] = from_float<Op>(x[u]);
    *reinterpret_cast<Pack*>(dst + r * ldd + c) = p;
  }
}

template <typename T>
__host__ __device__ constexpr int vec_elems() {
  return 16 / sizeof(T);
}

// Writes a 64 x 64 fp32 shared tile (ld kLdF) to rows [row0, row0+64) x columns [col0, col0+64)
// of a row-major global matrix (rows x cols, leading dimension ld) in T, skipping what lies
// outside it; with `div`, row r is multiplied by 1 / (div[r] + eps) (the normalizer). Each
// thread writes whole 16-byte vectors where the destination allows (the same choice in every
// thread), single elements at a ragged edge.
template <typename T>
__device__ __forceinline__ void store_tile(T* __restrict__ dst, int64_t ld, int64_t rows,
                                           int64_t cols, int64_t row0, int64_t col0,
                                           const float* __restrict__ tile,
                                           const float* __restrict__ div = nullptr,
                                           float eps = 0.f) {
  constexpr int V = vec_elems<T>();
  struct alignas(16) Pack {
    T e[V];
  };
  const bool vec = reinterpret_cast<uintptr_t>(dst) % 16 == 0 && ld % V == 0 && col0 % V == 0;
  // from the tile's corner on, 32-bit offsets and bounds (ld < 2^24, checked by the binding)
  dst += row0 * ld + col0;
  const int in_rows = extent_in(rows - row0), in_cols = extent_in(cols - col0);
  for (int i = threadIdx.x; i < kTile * (kTile / V); i += kThreads) {
    const int r = i / (kTile / V), c = (i % (kTile / V)) * V;
    if (r >= in_rows) continue;
    const float inv = div == nullptr ? 1.f : 1.f / (div[r] + eps);  // one division a vector
    const float* x = tile + r * kLdF + c;
    T* out = dst + r * static_cast<int>(ld) + c;
    if (vec && c + V <= in_cols) {
      Pack p;
#pragma unroll
      for (int u = 0; u < V; ++u) p.e[u] = from_float<T>(div == nullptr ? x[u] : x[u] * inv);
      *reinterpret_cast<Pack*>(out) = p;
    } else {
      for (int u = 0; u < V && c + u < in_cols; ++u) {
        out[u] = from_float<T>(div == nullptr ? x[u] : x[u] * inv);
      }
    }
  }
}

// A chunk's output: rows [row0, row0+64) x the M slice [m0, m0+64) of sequence bh of out
// (BH, N, M) from the fp32 staging tile, divided by den + eps with `normalize`; and, from the
// blocks of M slice 0, den (BH, N) where it is wanted (dens: the chunk's 64 normalizers).
template <typename Tout>
__device__ __forceinline__ void store_output(Tout* out, float* den, const float* tile,
                                             const float* dens, int64_t bh, int64_t n, int64_t m,
                                             int64_t row0, int64_t m0, bool normalize,
                                             float eps) {
  store_tile(out + bh * n * m, m, n, m, row0, m0, tile, normalize ? dens : nullptr, eps);
  if (den != nullptr && blockIdx.y == 0 && threadIdx.x < kTile && row0 + threadIdx.x < n) {
    den[bh * n + row0 + threadIdx.x] = dens[threadIdx.x];
  }
}

// Masks the 64 x 64 fp32 scores of a chunk in Af (ld kLdF) to j <= i (`causal`) or j >= i and
// rounds them into the operand tile As (ld LD); with `in_place` the masked scores also go back
// into Af (for their row sums, the normalizer). Call between barriers.
template <typename Op>
__device__ __forceinline__ void mask_scores(float* __restrict__ Af, Op* __restrict__ As,
                                            bool causal, bool in_place) {
  constexpr int LD = ld_of<Op>();
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    const int r = i / kTile, j = i % kTile;
    const bool on = causal ? j <= r : j >= r;
    const float a = on ? Af[r * kLdF + j] : 0.f;
    if (in_place) Af[r * kLdF + j] = a;
    As[r * LD + j] = from_float<Op>(a);
  }
}

// ------------------------------------------------------------------ segments
// The segment a thread block walks in kernels 1, 6, 7, 8 and 9 (grid.x = BH * nblk): sequence
// bh, segment blk, the chunks [first, first + count) of the sequence's nc (cpb per segment, the
// last segment shorter), visited first to last or, with `reverse`, last to first. With
// `skip_last` (kernel 1's carries, grid.x = BH * (nblk - 1)) no block takes the segment that
// comes last in the walk's order (the last one, or with `reverse` the first).
struct WalkSegment {
  int64_t nc, bh, blk, first, count;
  bool reverse;
  __device__ WalkSegment(int64_t n, int64_t nblk, int64_t cpb, bool reverse_,
                         bool skip_last = false)
      : nc((n + kTile - 1) / kTile),
        bh(blockIdx.x / (nblk - skip_last)),
        blk(blockIdx.x % (nblk - skip_last) + (reverse_ && skip_last)),
        first(blk * cpb),
        count((first + cpb < nc ? first + cpb : nc) - first),  // >= 1
        reverse(reverse_) {}
  // the i-th chunk visited
  __device__ int64_t chunk(int64_t i) const { return reverse ? first + count - 1 - i : first + i; }
};

// ------------------------------------------------------------------ kernel 1: chunk states
// grid.x = BH * nblk: block b walks the chunks [b*cpb, min(nc, (b+1)*cpb)) of sequence bh in
// order (last to first with `reverse`), cpb = chunks per block; grid.y = ceil(F/64) *
// ceil(M/64) (F slice, M slice). The running sum of k_t v_t^T over the block's rows stays in
// the warps' fp32 accumulator fragments.
//   totals[bh][b] (ss = F*M + F floats): the block's sum S (row-major F x M), then z = sum k_t
//                 (z written by the blocks of M slice 0; summed only with `with_z`, else 0).
//   with `prefix_s` (causal): before adding chunk c, the running sum over the block's earlier
//                 chunks (later ones with reverse), i.e. the block-local exclusive prefix, goes
//                 to prefix_s[bh][c] (F x M, in Tstate) and prefix_z[bh][c] (F, fp32).
// Rows with keep == false (key padding) are skipped. With `skip_last` (totals for the carries of
// an exclusive scan, which never reads the total that comes last in its order) grid.x = BH *
// (nblk - 1) and that segment is not walked (WalkSegment).
// Shared: two buffers of (K tile 64 x 64 (rows x F slice), V tile 64 x 64 (rows x M slice)), so
// the next chunk's tiles load (cp.async) while this chunk's product runs; fp32 staging 64 x 64.
template <typename Tin, typename Tstate>
__global__ void __launch_bounds__(kThreads)
    chunk_states_kernel(const Tin* __restrict__ k, const Tin* __restrict__ v,
                        const bool* __restrict__ key_keep, int64_t heads,
                        float* __restrict__ totals, Tstate* __restrict__ prefix_s,
                        float* __restrict__ prefix_z, int64_t n, int64_t f, int64_t m,
                        int64_t nblk, int64_t cpb, bool reverse, bool with_z, bool skip_last,
                        bool vec_k, bool vec_v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  constexpr int LD = ld_of<Op>();
  KS_DYNAMIC_SMEM(smem);
  Op* tiles = reinterpret_cast<Op*>(smem);  // buffer b: K at 2b, V at 2b + 1 (64 x LD each)
  float* St = reinterpret_cast<float*>(tiles + 4 * kTile * LD);  // 64 x kLdF: fp32 state tile

  const WalkSegment seg(n, nblk, cpb, reverse, skip_last);
  const int64_t nc = seg.nc, bh = seg.bh, blk = seg.blk;
  const int64_t m_tiles = (m + kTile - 1) / kTile;
  const int64_t f0 = (blockIdx.y / m_tiles) * kTile;
  const int64_t m0 = (blockIdx.y % m_tiles) * kTile;
  const bool z_block = m0 == 0;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  const bool* keep = key_keep == nullptr ? nullptr : key_keep + (bh / heads) * n;

  typename Mma<Op>::Acc acc[2];
  zero(acc);
  float z = 0.f;  // thread t < 64: running z of feature f0 + t

  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    load_tile<Tin, Op>(tiles + (2 * buf) * kTile * LD, LD, kb, f, n, f, row0, f0, keep, vec_k);
    load_tile<Tin, Op>(tiles + (2 * buf + 1) * kTile * LD, LD, vb, m, n, m, row0, m0, keep,
                       vec_v);
    cp_async_commit();
  };

  load_chunk(0, 0);
  for (int64_t i = 0; i < seg.count; ++i) {
    const int buf = static_cast<int>(i & 1);
    const int64_t c = seg.chunk(i);
    const Op* Ks = tiles + (2 * buf) * kTile * LD;
    const Op* Vs = Ks + kTile * LD;
    cp_async_wait_all();  // chunk i's tiles (the only copies in flight)
    __syncthreads();      // ... visible to all; chunk i-1's buffer and the staging tile are free
    if (i + 1 < seg.count) load_chunk(i + 1, buf ^ 1);
    if (prefix_s != nullptr) {
      warp_store(St, acc);  // the block-local exclusive prefix of chunk c
      if (z_block && threadIdx.x < kTile && f0 + threadIdx.x < f) {
        prefix_z[(bh * nc + c) * f + f0 + threadIdx.x] = z;
      }
    }
    // K^T (F slice x rows) is K's tile read column-major.
    warp_gemm<Tin, wmma::col_major, wmma::row_major>(acc, Ks, LD, Vs, LD);
    if (with_z && z_block && threadIdx.x < kTile) {
      for (int t = 0; t < kTile; ++t) z += to_float(Ks[t * LD + threadIdx.x]);
    }
    if (prefix_s != nullptr) {
      __syncthreads();  // the staging tile is complete
      store_tile(prefix_s + (bh * nc + c) * f * m, m, f, m, f0, m0, St);
    }
  }
  __syncthreads();  // the staging tile is consumed
  warp_store(St, acc);
  __syncthreads();

  const int64_t ss = f * m + f;
  float* out = totals + (bh * nblk + blk) * ss;
  store_tile(out, m, f, m, f0, m0, St);
  if (z_block && threadIdx.x < kTile && f0 + threadIdx.x < f) out[f * m + f0 + threadIdx.x] = z;
#endif
}

// ------------------------------------------------------------------ kernel 2: scan over blocks
// One thread per state element e (of ss) and sequence bh; walks the nblk block totals of bh in
// order: exclusive prefix (in place), exclusive suffix (in place), or the sum into `total`.
// The exclusive scans never read the total that comes last in their order (kernel 1 may not
// have written it: skip_last). Loads are batched by 8 to keep several in flight.
__global__ void __launch_bounds__(kThreads)
    state_scan_kernel(float* __restrict__ states, float* __restrict__ total, int64_t nblk,
                      int64_t ss, int mode) {
  const int64_t per_bh = (ss + kThreads - 1) / kThreads;
  const int64_t bh = blockIdx.x / per_bh;
  const int64_t e = (blockIdx.x % per_bh) * kThreads + threadIdx.x;
  if (e >= ss) return;
  float* base = states + bh * nblk * ss + e;
  constexpr int U = 8;
  float run = 0.f;
  for (int64_t c0 = 0; c0 < nblk; c0 += U) {
    float x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u;
      const int64_t cc = mode == kExclusiveReverse ? nblk - 1 - c : c;
      x[u] = c < nblk && (mode == kSum || c + 1 < nblk) ? base[cc * ss] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u;
      if (c < nblk) {
        const int64_t cc = mode == kExclusiveReverse ? nblk - 1 - c : c;
        if (mode != kSum) base[cc * ss] = run;
        run += x[u];
      }
    }
  }
  if (mode == kSum) total[bh * ss + e] = run;
}

// ------------------------------------------------------------------ kernel 3: chunk output
// grid.x = BH * nc (chunk c of sequence bh), grid.y = ceil(M/64) (M slice).
// out[c rows, M slice] = mask(Q_c K_c^T) V_c + Q_c S_c, looping over 64-wide F slices:
//   scores  A (64 x 64, fp32 fragments) += Q[:, F slice] K[:, F slice]^T
//   output  O (64 x 64, fp32 fragments) += Q[:, F slice] S[F slice, M slice]
// then A is masked (tril / triu), rounded to the operand type and O += A V[:, M slice].
// The state of chunk c is s_base[idx] (F x M, Tstate) and z_base[idx] (F, fp32) with
// idx = bh*nc + c, plus, with `carry`, the fp32 carry [S | z] of chunk c's block of cpb chunks,
// carry[bh*nblk + c/cpb] (ss = F*M + F floats).
// mode kFull: no intra-chunk term, idx = bh for every chunk (non-causal read-out).
// den_i = q_i . z_c (+ row sums of the masked fp32 scores); with `normalize` the output is
// divided by den_i + eps. Every block computes den (cheap); the M-slice-0 block writes it.
// Shared (Op tiles 64 x LD): Q, K, S, V; A in fp32 (64 x kLdF, then the output staging);
// the rounded scores reuse Q's tile.
// Blocks per SM the register budget must allow: the shared memory of an H100 SM (228 KB) holds 3
// output blocks with 16-bit operands and 2 with fp32 ones (an A100's 164 KB holds 1 of fp32).
// For fp32 the cap of 128 registers costs a small spill; the GPU session should time 1 vs 2.
template <typename Tin>
constexpr int kOutputBlocksPerSm = std::is_same_v<typename OperandOf<Tin>::type, float> ? 2 : 3;

template <typename Tin, typename Tstate, typename Tout>
__global__ void __launch_bounds__(kThreads, kOutputBlocksPerSm<Tin>)
    chunk_output_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                        const Tin* __restrict__ v, const Tstate* __restrict__ s_base,
                        int64_t s_stride, const float* __restrict__ z_base, int64_t z_stride,
                        const float* __restrict__ carry, int64_t cpb, Tout* __restrict__ out,
                        float* __restrict__ den, int64_t n, int64_t f, int64_t m, int mode,
                        bool normalize, float eps, bool vec_qk, bool vec_v, bool vec_s) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  constexpr int LD = ld_of<Op>();
  KS_DYNAMIC_SMEM(smem);
  Op* Qs = reinterpret_cast<Op*>(smem);  // 64 x LD: Q rows x F slice
  Op* Ks = Qs + kTile * LD;               // 64 x LD: K rows x F slice
  Op* Ss = Ks + kTile * LD;               // 64 x LD: state F slice x M slice
  Op* Vs = Ss + kTile * LD;               // 64 x LD: V rows x M slice
  float* Af = reinterpret_cast<float*>(Vs + kTile * LD);  // 64 x kLdF fp32
  float* zs = Af + kTile * kLdF;                          // 64: z of the F slice
  float* dens = zs + kTile;                               // 64: den per row
  Op* As = Qs;  // rounded masked scores, once Q is no longer needed

  const int64_t nc = (n + kTile - 1) / kTile;
  const int64_t bh = blockIdx.x / nc;
  const int64_t c = blockIdx.x % nc;
  const int64_t row0 = c * kTile;
  const int64_t m0 = blockIdx.y * kTile;
  const bool intra = mode != kFull;
  const bool need_den = normalize || den != nullptr;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  const int64_t idx = intra ? bh * nc + c : bh;
  const Tstate* st = s_base + idx * s_stride;
  const float* zt = z_base + idx * z_stride;
  const float* cs = nullptr;  // carry of earlier blocks: S (F x M) then z (F)
  if (carry != nullptr) cs = carry + (bh * ((nc + cpb - 1) / cpb) + c / cpb) * (f * m + f);

  typename Mma<Op>::Acc acc_o[2], acc_a[2];
  zero(acc_o, acc_a);
  if (threadIdx.x < kTile) dens[threadIdx.x] = 0.f;
  if (intra) load_tile<Tin, Op>(Vs, LD, vb, m, n, m, row0, m0, nullptr, vec_v);

  for (int64_t f0 = 0; f0 < f; f0 += kTile) {
    __syncthreads();  // the previous slice's tiles are consumed
    load_tile<Tin, Op>(Qs, LD, qb, f, n, f, row0, f0, nullptr, vec_qk);
    if (intra) load_tile<Tin, Op>(Ks, LD, kb, f, n, f, row0, f0, nullptr, vec_qk);
    load_tile<Tstate, Op>(Ss, LD, st, m, f, m, f0, m0, nullptr, vec_s, cs);
    if (need_den && threadIdx.x < kTile) {
      const int64_t fi = f0 + threadIdx.x;
      zs[threadIdx.x] = fi < f ? zt[fi] + (cs != nullptr ? cs[f * m + fi] : 0.f) : 0.f;
    }
    cp_async_wait_all();  // this thread's copies of V, Q, K (and S) have landed
    __syncthreads();
    if (intra) warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_a, Qs, LD, Ks, LD);
    warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_o, Qs, LD, Ss, LD);
    if (need_den && threadIdx.x < kTile) {
      float s = 0.f;
      for (int j = 0; j < kTile; ++j) s += to_float(Qs[threadIdx.x * LD + j]) * zs[j];
      dens[threadIdx.x] += s;
    }
  }

  if (intra) {
    warp_store(Af, acc_a);  // Af is nobody's operand; As (over Q) is written after the barrier
    __syncthreads();
    mask_scores(Af, As, mode == kCausal, need_den);
    __syncthreads();
    warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_o, As, LD, Vs, LD);
    if (need_den && threadIdx.x < kTile) {
      float s = 0.f;
      for (int j = 0; j < kTile; ++j) s += Af[threadIdx.x * kLdF + j];
      dens[threadIdx.x] += s;
    }
  }
  // Af's last readers: the row sums (normalizer) after the last barrier; mask_scores before it
  if (intra && need_den) __syncthreads();
  warp_store(Af, acc_o);
  __syncthreads();

  store_output(out, den, Af, dens, bh, n, m, row0, m0, normalize, eps);
#endif
}

// ------------------------------------------------------------------ kernels 4, 5: fused backward
// Gradients of the causal product out_i = sum_{j<=i} (q_i . k_j) v_j for g = dL/dout. Chunk c:
//   A = tril(G_c V_c^T)  (A_ij = g_i . v_j),   B = tril(Q_c K_c^T)  (B_ij = q_i . k_j),
//   dq_c = A K_c + G_c S_c^T,   dk_c = A^T Q_c + V_c R_c^T,   dv_c = B^T G_c + K_c R_c,
// with S_c = sum_{c' < c} K_c'^T V_c' (the forward's chunk states) and R_c = sum_{c' > c}
// Q_c'^T G_c' (the states of (q, g) summed in reverse), both F x M: each is a block-local prefix
// s_base[bh*nc + c] (Tstate) plus the fp32 carry of its block of cpb chunks, as in kernel 3.
// Two state passes and these two kernels replace three separate causal products: q, k, v and g
// are read fewer times and no product's chunk states are written twice.
//   chunk_dqk_kernel: grid.x = BH * nc, grid.y = ceil(F/64): dq and dk of one 64-wide F slice;
//     A, G S^T and V R^T accumulate over the 64-wide M slices, then A K and A^T Q are added.
//   chunk_dv_kernel:  grid.x = BH * nc, grid.y = ceil(M/64): dv of one 64-wide M slice;
//     B and K R accumulate over the F slices, then B^T G is added.
// Shared: four (dqk) or three (dv) Op tiles 64 x LD and an fp32 64 x kLdF tile for the scores,
// then for the output staging.
// The chunk of a block of a per-chunk kernel (grid.x = BH * nc): sequence bh, chunk c, its
// first row, and the block's 64 x LD operand tiles followed by one fp32 64 x kLdF tile.
template <typename Op>
struct ChunkBlock {
  int64_t nc, bh, c, row0;
  Op* tiles;
  __device__ ChunkBlock(int64_t n, unsigned char* smem)
      : nc((n + kTile - 1) / kTile),
        bh(blockIdx.x / nc),
        c(blockIdx.x % nc),
        row0(c * kTile),
        tiles(reinterpret_cast<Op*>(smem)) {}
  __device__ Op* tile(int i) const { return tiles + i * kTile * ld_of<Op>(); }
  __device__ float* fp32_tile(int count) const { return reinterpret_cast<float*>(tile(count)); }
};

struct ChunkStates {  // the per-chunk states S or R of one direction
  const void* prefix;  // Tstate [bh][nc][F x M]: block-local exclusive prefixes
  const float* carry;  // fp32 [bh][nblk][F*M + F]: the sum over earlier blocks (S then z)
};

template <typename Tstate>
__device__ __forceinline__ const Tstate* chunk_prefix(const ChunkStates& st, int64_t bh,
                                                      int64_t nc, int64_t c, int64_t f,
                                                      int64_t m) {
  return static_cast<const Tstate*>(st.prefix) + (bh * nc + c) * f * m;
}

__device__ __forceinline__ const float* chunk_carry(const ChunkStates& st, int64_t bh,
                                                    int64_t nc, int64_t c, int64_t cpb,
                                                    int64_t f, int64_t m) {
  return st.carry + (bh * ((nc + cpb - 1) / cpb) + c / cpb) * (f * m + f);
}

template <typename Tin, typename Tstate, typename Tout>
__global__ void __launch_bounds__(kThreads, 2)  // three accumulator pairs: up to 128 registers
    chunk_dqk_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                     const Tin* __restrict__ v, const Tin* __restrict__ g, ChunkStates s_states,
                     ChunkStates r_states, int64_t cpb, Tout* __restrict__ dq,
                     Tout* __restrict__ dk, int64_t n, int64_t f, int64_t m, bool vec_f,
                     bool vec_m, bool vec_s) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  constexpr int LD = ld_of<Op>();
  KS_DYNAMIC_SMEM(smem);
  const ChunkBlock<Op> blk(n, smem);
  const int64_t nc = blk.nc, bh = blk.bh, c = blk.c, row0 = blk.row0;
  Op *T0 = blk.tile(0), *T1 = blk.tile(1), *T2 = blk.tile(2), *T3 = blk.tile(3);
  float* Af = blk.fp32_tile(4);
  const int64_t f0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  const Tin* gb = g + bh * n * m;
  const Tstate* sp = chunk_prefix<Tstate>(s_states, bh, nc, c, f, m);
  const Tstate* rp = chunk_prefix<Tstate>(r_states, bh, nc, c, f, m);
  const float* sc = chunk_carry(s_states, bh, nc, c, cpb, f, m);
  const float* rc = chunk_carry(r_states, bh, nc, c, cpb, f, m);

  typename Mma<Op>::Acc acc_a[2], acc_dq[2], acc_dk[2];
  zero(acc_a, acc_dq, acc_dk);

  for (int64_t m0 = 0; m0 < m; m0 += kTile) {
    __syncthreads();  // the previous slice's tiles are consumed
    Op* Gs = T0;  // G rows x M slice
    Op* Vs = T1;  // V rows x M slice
    Op* Ss = T2;  // S: F slice x M slice
    Op* Rs = T3;  // R: F slice x M slice
    load_tile<Tin, Op>(Gs, LD, gb, m, n, m, row0, m0, nullptr, vec_m);
    load_tile<Tin, Op>(Vs, LD, vb, m, n, m, row0, m0, nullptr, vec_m);
    load_tile<Tstate, Op>(Ss, LD, sp, m, f, m, f0, m0, nullptr, vec_s, sc);
    load_tile<Tstate, Op>(Rs, LD, rp, m, f, m, f0, m0, nullptr, vec_s, rc);
    cp_async_wait_all();
    __syncthreads();
    warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_a, Gs, LD, Vs, LD);   // G V^T
    warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_dq, Gs, LD, Ss, LD);  // G S^T
    warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_dk, Vs, LD, Rs, LD);  // V R^T
  }
  __syncthreads();  // G, V, S, R consumed
  Op* Qs = T0;  // Q rows x F slice
  Op* Ks = T1;  // K rows x F slice
  Op* As = T2;  // the masked scores A
  load_tile<Tin, Op>(Qs, LD, qb, f, n, f, row0, f0, nullptr, vec_f);
  load_tile<Tin, Op>(Ks, LD, kb, f, n, f, row0, f0, nullptr, vec_f);
  warp_store(Af, acc_a);
  __syncthreads();
  mask_scores(Af, As, true, false);
  cp_async_wait_all();
  __syncthreads();
  warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_dq, As, LD, Ks, LD);  // A K
  warp_gemm<Tin, wmma::col_major, wmma::row_major>(acc_dk, As, LD, Qs, LD);  // A^T Q

  warp_store(Af, acc_dq);
  __syncthreads();
  store_tile(dq + bh * n * f, f, n, f, row0, f0, Af);
  __syncthreads();
  warp_store(Af, acc_dk);
  __syncthreads();
  store_tile(dk + bh * n * f, f, n, f, row0, f0, Af);
#endif
}

template <typename Tin, typename Tstate, typename Tout>
__global__ void __launch_bounds__(kThreads, kOutputBlocksPerSm<Tin>)
    chunk_dv_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                    const Tin* __restrict__ g, ChunkStates r_states, int64_t cpb,
                    Tout* __restrict__ dv, int64_t n, int64_t f, int64_t m, bool vec_f,
                    bool vec_m, bool vec_s) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  constexpr int LD = ld_of<Op>();
  KS_DYNAMIC_SMEM(smem);
  const ChunkBlock<Op> blk(n, smem);
  const int64_t nc = blk.nc, bh = blk.bh, c = blk.c, row0 = blk.row0;
  Op *T0 = blk.tile(0), *T1 = blk.tile(1), *T2 = blk.tile(2);
  float* Af = blk.fp32_tile(3);
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* gb = g + bh * n * m;
  const Tstate* rp = chunk_prefix<Tstate>(r_states, bh, nc, c, f, m);
  const float* rc = chunk_carry(r_states, bh, nc, c, cpb, f, m);

  typename Mma<Op>::Acc acc_b[2], acc_dv[2];
  zero(acc_b, acc_dv);

  for (int64_t f0 = 0; f0 < f; f0 += kTile) {
    __syncthreads();  // the previous slice's tiles are consumed
    Op* Qs = T0;  // Q rows x F slice
    Op* Ks = T1;  // K rows x F slice
    Op* Rs = T2;  // R: F slice x M slice
    load_tile<Tin, Op>(Qs, LD, qb, f, n, f, row0, f0, nullptr, vec_f);
    load_tile<Tin, Op>(Ks, LD, kb, f, n, f, row0, f0, nullptr, vec_f);
    load_tile<Tstate, Op>(Rs, LD, rp, m, f, m, f0, m0, nullptr, vec_s, rc);
    cp_async_wait_all();
    __syncthreads();
    warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_b, Qs, LD, Ks, LD);   // Q K^T
    warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_dv, Ks, LD, Rs, LD);  // K R
  }
  __syncthreads();  // Q, K, R consumed
  Op* Gs = T0;  // G rows x M slice
  Op* Bs = T1;  // the masked scores B
  load_tile<Tin, Op>(Gs, LD, gb, m, n, m, row0, m0, nullptr, vec_m);
  warp_store(Af, acc_b);
  __syncthreads();
  mask_scores(Af, Bs, true, false);
  cp_async_wait_all();
  __syncthreads();
  warp_gemm<Tin, wmma::col_major, wmma::row_major>(acc_dv, Bs, LD, Gs, LD);  // B^T G

  warp_store(Af, acc_dv);
  __syncthreads();
  store_tile(dv + bh * n * m, m, n, m, row0, m0, Af);
#endif
}

// ------------------------------------------------------------------ walk states
// Kernels 6 and 7 keep a running state (S or R, F x M) on chip: fp32 tiles (64 x kLdF) and, for
// 16-bit operands, a rounded copy of each (64 x LD, stride kTile * LD) that the products read;
// fp32 operands read the fp32 tiles themselves. State tile t covers rows [(t / m_tiles) * 64,
// +64) of F and columns [m0 + (t % m_tiles) * 64, +64) of M.
template <typename Op>
constexpr bool kStateCopy = !std::is_same_v<Op, float>;

// The operand a product reads for an fp32 tile (a state, or the masked scores): its rounded
// copy, or (fp32 operands, LD = kLdF) the tile itself.
template <typename Op>
__device__ __forceinline__ const Op* tile_operand(const float* tile32, const Op* copy) {
  if constexpr (kStateCopy<Op>) {
    return copy;
  } else {
    return tile32;
  }
}

// Rounds the warp's 16 x 32 slab (see warp_gemm) of an fp32 64 x kLdF tile into an operand tile
// (64 x LD). Call after a __syncwarp() that follows the warp's store; only this warp touches
// the slab.
template <typename Op>
__device__ __forceinline__ void round_slab(const float* tile32, Op* copy) {
  constexpr int LD = ld_of<Op>();
  const Slab w = warp_slab();
  for (int e = threadIdx.x % 32; e < 16 * 32; e += 32) {
    const int r = w.r0 + e / 32, c = w.c0 + e % 32;
    copy[r * LD + c] = from_float<Op>(tile32[r * kLdF + c]);
  }
}

// Sets `tiles` state tiles to the segment's carry (fp32 row-major F x M; null: zero).
template <typename Op>
__device__ __forceinline__ void init_state(float* s32, Op* copy, int tiles, int m_tiles,
                                           const float* carry, int64_t f, int64_t m,
                                           int64_t m0) {
  constexpr int LD = ld_of<Op>();
  for (int i = threadIdx.x; i < tiles * kTile * kTile; i += kThreads) {
    const int t = i / (kTile * kTile), r = (i / kTile) % kTile, j = i % kTile;
    const int64_t fi = (t / m_tiles) * kTile + r, mj = m0 + (t % m_tiles) * kTile + j;
    const float s = (carry != nullptr && fi < f && mj < m) ? carry[fi * m + mj] : 0.f;
    s32[t * kTile * kLdF + r * kLdF + j] = s;
    if constexpr (kStateCopy<Op>) copy[t * kTile * LD + r * LD + j] = from_float<Op>(s);
  }
}

// Adds A^T B (A: 64 rows x F slice, B: 64 rows x M slice, operand tiles) to the warp's slab of
// one state tile, then rounds the slab into the tile's copy. No other warp touches the slab,
// so no barrier is needed until others read the state.
template <typename Tin, typename Op = typename OperandOf<Tin>::type>
__device__ __forceinline__ void accumulate_state(float* tile32, Op* copy, const Op* A,
                                                 const Op* B) {
  constexpr int LD = ld_of<Op>();
  const Slab w = warp_slab();
  float* st = tile32 + w.r0 * kLdF + w.c0;
  typename Mma<Op>::Acc acc[2];
  load_shared(acc[0], st, kLdF);
  load_shared(acc[1], st + 16, kLdF);
  warp_gemm<Tin, wmma::col_major, wmma::row_major>(acc, A, LD, B, LD);
  store_shared(st, acc[0], kLdF);
  store_shared(st + 16, acc[1], kLdF);
  if constexpr (kStateCopy<Op>) {
    __syncwarp();
    round_slab(tile32, copy);
  }
}

// ------------------------------------------------------------------ masks in registers
// Kernels 6 and 7 mask a chunk's scores in the accumulator fragments, so each warp can round
// its own slab without a block barrier. The order of a fragment's elements is unspecified but
// the same for every fragment of one type: a 16 x 16 fp32 tile of positions (r * 16 + c) in
// shared memory, loaded into a fragment, gives each element its row and column.
constexpr int kPositions = 16 * 16;

// Fills the position tile (kPositions floats); a __syncthreads() must follow before its use.
__device__ __forceinline__ void init_positions(float* pos) {
  for (int i = threadIdx.x; i < kPositions; i += kThreads) pos[i] = static_cast<float>(i);
}

// Zeroes the warp's two score fragments (its 16 x 32 slab of the 64 x 64 scores, see warp_gemm)
// outside j <= i (`causal`) or j >= i. A fragment lies wholly on one side of the diagonal or
// on it (its rows and columns start at multiples of 16); only the diagonal needs positions.
template <typename Acc>
__device__ __forceinline__ void mask_slab(Acc (&acc)[2], const float* pos, bool causal) {
  const Slab w = warp_slab();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col0 = w.c0 + 16 * j;
    if (col0 == w.r0) {
      Acc p;
      load_shared(p, pos, 16);
#pragma unroll
      for (int e = 0; e < p.num_elements; ++e) {
        const int rc = static_cast<int>(p.x[e]);
        const int r = rc / 16, c = rc % 16;
        if (causal ? c > r : c < r) acc[j].x[e] = 0.f;
      }
    } else if (causal ? col0 > w.r0 : col0 < w.r0) {
      wmma::fill_fragment(acc[j], 0.f);
    }
  }
}

// ------------------------------------------------------------------ kernel 6: chunk walk
// The causal product in one pass per segment, with the state on chip (selected by walk_blocks >
// 0, for F <= 128; kernels 1-3 cover the rest). grid.x = BH * nblk: block b walks the chunks
// [b*cpb, min(nc, (b+1)*cpb)) of sequence bh in order (last to first with `reverse`);
// grid.y = ceil(M/64) (M slice). The running state S (F x M slice) and z (F) stay in shared
// memory in fp32, starting from the segment's carry (kernels 1 and 2 with no per-chunk
// prefixes; none when nblk = 1). Chunk c:
//     out_c = mask(Q_c K_c^T) V_c + Q_c S,  den_c = Q_c z + row sums of mask(Q_c K_c^T),
//     then S += K_c^T V_c and z += the column sums of K_c,
// so no per-chunk state goes through global memory (kernels 1 and 3 write and read one F x M
// state per chunk). FT = ceil(F/64) F slices are held at once.
// Shared: two buffers of (Q: FT tiles, K: FT tiles, V: 1 tile), so the next chunk loads
// (cp.async) while this one is multiplied; for 16-bit operands, S's bf16 copy (FT tiles 64 x LD)
// and the rounded masked scores (one tile); then in fp32: S (FT tiles 64 x kLdF), one 64 x kLdF
// tile for the masked scores and then the output staging, z (FT*64), den (64) and the positions
// (masks in registers). fp32 operands read S and the scores from their fp32 tiles.
// Barriers per chunk: 3 (16-bit operands, no normalizer), else 4.
template <typename Op, int FT>
struct WalkSmem {
  static constexpr int kOpTile = kTile * ld_of<Op>();  // elements of one operand tile
  static constexpr int kBufTiles = 2 * FT + 1;         // Q slices, K slices, V
  static constexpr bool kCopy = kStateCopy<Op>;  // S and the scores have operand copies
  static constexpr size_t bytes() {
    return static_cast<size_t>(2 * kBufTiles + (kCopy ? FT + 1 : 0)) * kOpTile * sizeof(Op) +
           static_cast<size_t>((FT + 1) * kTile * kLdF + FT * kTile + kTile + kPositions) *
               sizeof(float);
  }
};

// Two blocks per SM where the shared memory allows it (16-bit operands, F <= 64: ~110 KB each).
template <typename Op, int FT>
constexpr int kWalkBlocksPerSm = (FT == 1 && sizeof(Op) == 2) ? 2 : 1;

template <typename Tin, typename Tout, int FT>
__global__ void __launch_bounds__(kThreads, kWalkBlocksPerSm<typename OperandOf<Tin>::type, FT>)
    chunk_walk_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                      const Tin* __restrict__ v, const float* __restrict__ carry,
                      Tout* __restrict__ out, float* __restrict__ den, int64_t n, int64_t f,
                      int64_t m, int64_t nblk, int64_t cpb, bool reverse, bool normalize,
                      float eps, bool vec_qk, bool vec_v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  using Smem = WalkSmem<Op, FT>;
  constexpr int LD = ld_of<Op>();
  KS_DYNAMIC_SMEM(smem);
  Op* bufs = reinterpret_cast<Op*>(smem);
  Op* s_copy = bufs + 2 * Smem::kBufTiles * Smem::kOpTile;  // FT tiles (16-bit operands only)
  Op* As = s_copy + FT * Smem::kOpTile;                      // scores (16-bit operands only)
  float* s32 = reinterpret_cast<float*>(s_copy + (Smem::kCopy ? (FT + 1) * Smem::kOpTile : 0));
  float* Af = s32 + FT * kTile * kLdF;
  float* zs = Af + kTile * kLdF;
  float* dens = zs + FT * kTile;
  float* pos = dens + kTile;
  auto q_tile = [&](int buf, int ft) { return bufs + (buf * Smem::kBufTiles + ft) * Smem::kOpTile; };
  auto k_tile = [&](int buf, int ft) {
    return bufs + (buf * Smem::kBufTiles + FT + ft) * Smem::kOpTile;
  };
  auto v_tile = [&](int buf) { return bufs + (buf * Smem::kBufTiles + 2 * FT) * Smem::kOpTile; };
  auto s_tile = [&](int ft) { return s32 + ft * kTile * kLdF; };
  auto s_copy_tile = [&](int ft) { return s_copy + ft * Smem::kOpTile; };

  const WalkSegment seg(n, nblk, cpb, reverse);
  const int64_t bh = seg.bh, blk = seg.blk;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const bool need_den = normalize || den != nullptr;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
      load_tile<Tin, Op>(q_tile(buf, ft), LD, qb, f, n, f, row0, ft * kTile, nullptr, vec_qk);
      load_tile<Tin, Op>(k_tile(buf, ft), LD, kb, f, n, f, row0, ft * kTile, nullptr, vec_qk);
    }
    load_tile<Tin, Op>(v_tile(buf), LD, vb, m, n, m, row0, m0, nullptr, vec_v);
    cp_async_commit();
  };
  load_chunk(0, 0);

  // The state at the segment's start: its carry (S row-major F x M, then z) or zero.
  const float* cs = carry == nullptr ? nullptr : carry + (bh * nblk + blk) * (f * m + f);
  init_state<Op>(s32, s_copy, FT, 1, cs, f, m, m0);
  for (int i = threadIdx.x; i < FT * kTile; i += kThreads) {
    zs[i] = (cs != nullptr && need_den && i < f) ? cs[f * m + i] : 0.f;
  }
  init_positions(pos);

  const int row = threadIdx.x / 4, part = threadIdx.x % 4;  // den: 4 threads per row
  typename Mma<Op>::Acc acc_a[2], acc_o[2];
  for (int64_t i = 0; i < seg.count; ++i) {
    const int buf = static_cast<int>(i & 1);
    const int64_t row0 = seg.chunk(i) * kTile;
    cp_async_wait_all();  // chunk i's tiles (the only copies in flight)
    __syncthreads();      // ... visible to all; step i-1 is complete (its buffer is free)
    if (i + 1 < seg.count) load_chunk(i + 1, buf ^ 1);

    // scores Q K^T and Q S over the F slices; this thread's share of q . z
    zero(acc_a, acc_o);
    float dpart = 0.f;
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
      const Op* Qs = q_tile(buf, ft);
      warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_a, Qs, LD, k_tile(buf, ft), LD);
      warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_o, Qs, LD,
                                                      tile_operand(s_tile(ft), s_copy_tile(ft)),
                                                      LD);
      if (need_den) {
        for (int j = part; j < kTile; j += 4) {
          dpart += to_float(Qs[row * LD + j]) * zs[ft * kTile + j];
        }
      }
    }
    // the masked scores: in fp32 (Af, for the row sums) and rounded (As), each warp its slab
    mask_slab(acc_a, pos, !reverse);
    warp_store(Af, acc_a);
    if constexpr (Smem::kCopy) {
      __syncwarp();
      round_slab(Af, As);
    }
    __syncthreads();  // masked scores complete; Q and S read by every warp
    warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_o, tile_operand(Af, As), LD, v_tile(buf),
                                                    LD);
    if (need_den) {
      for (int j = part; j < kTile; j += 4) dpart += Af[row * kLdF + j];
      dpart += __shfl_xor_sync(0xffffffffu, dpart, 1);
      dpart += __shfl_xor_sync(0xffffffffu, dpart, 2);
      if (part == 0) dens[row] = dpart;
    }

    // S += K^T V (no other warp reads S until the next step)
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
      accumulate_state<Tin>(s_tile(ft), s_copy_tile(ft), k_tile(buf, ft), v_tile(buf));
    }
    if (need_den) {  // z += column sums of K: kParts neighbouring lanes per column
      constexpr int kParts = kThreads / (FT * kTile);  // 4 (FT = 1) or 2
      static_assert(kParts * FT * kTile == kThreads && (kParts & (kParts - 1)) == 0);
      const int col = threadIdx.x / kParts, start = threadIdx.x % kParts;
      const Op* Ks = k_tile(buf, col / kTile);
      float s = 0.f;
      for (int t = start; t < kTile; t += kParts) s += to_float(Ks[t * LD + col % kTile]);
#pragma unroll
      for (int lane = 1; lane < kParts; lane *= 2) s += __shfl_xor_sync(0xffffffffu, s, lane);
      if (start == 0) zs[col] += s;
    }

    // the output rows, divided by den + eps with `normalize`, staged in Af. Its readers since
    // the last barrier: every warp's row sums (normalizer) and, for fp32 operands, products;
    // otherwise none (round_slab read it before the barrier).
    if (need_den || !Smem::kCopy) __syncthreads();
    warp_store(Af, acc_o);
    __syncthreads();
    store_output(out, den, Af, dens, bh, n, m, row0, m0, normalize, eps);
  }
#endif
}

// ------------------------------------------------------------------ kernel 7: walk of dk and dv
// The walk's fused backward (walk_blocks > 0 with causal_backward): dq is the causal product
// walk(g, v, k) (kernel 6); dk and dv come from one walk over the chunks from last to first with
// the state R = sum_{c' > c} Q_c'^T G_c' (F x M) in shared memory:
//     dk_c = U(V_c G_c^T) Q_c + V_c R^T,   dv_c = U(K_c Q_c^T) G_c + K_c R,   then R += Q_c^T G_c,
// U keeping the scores (j, i) with i >= j. Two anti-causal walks would read q and g twice and
// walk the sequence twice. grid.x = BH * nblk (segments as in kernel 6, carries from kernels 1
// and 2 over (q, g) in reverse); one block covers all F and M slices (ft, mt = ceil(F/64),
// ceil(M/64) <= 2), so each chunk's scores are computed once.
// Shared (DkvSmem): nbuf (2, or 1 where two do not fit) buffers of (Q, K: ft tiles; V, G: mt
// tiles), R's operand copy (16-bit operands; fp32 operands read R itself), the masked scores
// U(V G^T) and U(K Q^T), then in fp32: R (ft x mt tiles 64 x kLdF), `stages` (2, or 1 where two
// do not fit) staging tiles and the positions (masks in registers). The scores are masked and
// rounded by each warp on its own slab; the dk and dv slices take turns in the staging tiles,
// so with two, one barrier per slice suffices (at F = M = 64, 4 per chunk; 5 with one tile).
template <typename Op>
struct DkvSmem {
  int ft, mt, nbuf, stages;
  static constexpr bool kCopy = kStateCopy<Op>;
  __host__ __device__ static constexpr int op_tile() { return kTile * ld_of<Op>(); }
  __host__ __device__ int buf_tiles() const { return 2 * (ft + mt); }
  __host__ __device__ size_t op_bytes() const {
    const int tiles = nbuf * buf_tiles() + (kCopy ? ft * mt : 0) + 2;
    return static_cast<size_t>(tiles) * op_tile() * sizeof(Op);
  }
  __host__ __device__ size_t bytes() const {
    return op_bytes() +
           (static_cast<size_t>(ft * mt + stages) * kTile * kLdF + kPositions) * sizeof(float);
  }
};

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kThreads, 1)
    chunk_walk_dkv_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                          const Tin* __restrict__ v, const Tin* __restrict__ g,
                          const float* __restrict__ carry, Tout* __restrict__ dk,
                          Tout* __restrict__ dv, int64_t n, int64_t f, int64_t m, int64_t nblk,
                          int64_t cpb, DkvSmem<typename OperandOf<Tin>::type> lay, bool vec_f,
                          bool vec_m) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  constexpr int LD = ld_of<Op>();
  constexpr int kOpTile = DkvSmem<Op>::op_tile();
  KS_DYNAMIC_SMEM(smem);
  const int ft_n = lay.ft, mt_n = lay.mt, bt = lay.buf_tiles();
  Op* bufs = reinterpret_cast<Op*>(smem);
  Op* r_copy = bufs + lay.nbuf * bt * kOpTile;
  Op* As = r_copy + (DkvSmem<Op>::kCopy ? ft_n * mt_n : 0) * kOpTile;  // U(V G^T)
  Op* Bs = As + kOpTile;                                                // U(K Q^T)
  float* r32 = reinterpret_cast<float*>(smem + lay.op_bytes());
  float* staging = r32 + ft_n * mt_n * kTile * kLdF;  // lay.stages tiles 64 x kLdF
  float* pos = staging + lay.stages * kTile * kLdF;
  auto tile = [&](int buf, int i) { return bufs + (buf * bt + i) * kOpTile; };
  auto q_tile = [&](int buf, int ft) { return tile(buf, ft); };
  auto k_tile = [&](int buf, int ft) { return tile(buf, ft_n + ft); };
  auto v_tile = [&](int buf, int mt) { return tile(buf, 2 * ft_n + mt); };
  auto g_tile = [&](int buf, int mt) { return tile(buf, 2 * ft_n + mt_n + mt); };
  auto r_state = [&](int ft, int mt) { return r32 + (ft * mt_n + mt) * kTile * kLdF; };
  auto r_copy_tile = [&](int ft, int mt) { return r_copy + (ft * mt_n + mt) * kOpTile; };
  auto r_operand = [&](int ft, int mt) {
    return tile_operand(r_state(ft, mt), r_copy_tile(ft, mt));
  };

  const WalkSegment seg(n, nblk, cpb, true);
  const int64_t bh = seg.bh, blk = seg.blk;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  const Tin* gb = g + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    for (int ft = 0; ft < ft_n; ++ft) {
      load_tile<Tin, Op>(q_tile(buf, ft), LD, qb, f, n, f, row0, ft * kTile, nullptr, vec_f);
      load_tile<Tin, Op>(k_tile(buf, ft), LD, kb, f, n, f, row0, ft * kTile, nullptr, vec_f);
    }
    for (int mt = 0; mt < mt_n; ++mt) {
      load_tile<Tin, Op>(v_tile(buf, mt), LD, vb, m, n, m, row0, mt * kTile, nullptr, vec_m);
      load_tile<Tin, Op>(g_tile(buf, mt), LD, gb, m, n, m, row0, mt * kTile, nullptr, vec_m);
    }
    cp_async_commit();
  };
  load_chunk(0, 0);

  // R at the segment's start: the carry of the later segments (row-major F x M) or zero.
  const float* cs = carry == nullptr ? nullptr : carry + (bh * nblk + blk) * (f * m + f);
  init_state<Op>(r32, r_copy, ft_n * mt_n, mt_n, cs, f, m, 0);
  init_positions(pos);

  typename Mma<Op>::Acc acc_a[2], acc_b[2], acc_o[2];
  for (int64_t i = 0; i < seg.count; ++i) {
    const int buf = lay.nbuf == 2 ? static_cast<int>(i & 1) : 0;
    const int64_t row0 = seg.chunk(i) * kTile;
    cp_async_wait_all();  // chunk i's tiles (the only copies in flight)
    __syncthreads();      // ... visible to all; step i-1 is complete
    if (lay.nbuf == 2 && i + 1 < seg.count) load_chunk(i + 1, buf ^ 1);

    // the masked scores U(V G^T) (over the M slices) and U(K Q^T) (over the F slices)
    zero(acc_a, acc_b);
    for (int mt = 0; mt < mt_n; ++mt) {
      warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_a, v_tile(buf, mt), LD,
                                                      g_tile(buf, mt), LD);
    }
    for (int ft = 0; ft < ft_n; ++ft) {
      warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_b, k_tile(buf, ft), LD,
                                                      q_tile(buf, ft), LD);
    }
    // masked in registers and rounded by each warp on its own slab (of staging tile 0)
    mask_slab(acc_a, pos, false);
    mask_slab(acc_b, pos, false);
    warp_store(staging, acc_a);
    __syncwarp();
    round_slab(staging, As);
    __syncwarp();
    warp_store(staging, acc_b);
    __syncwarp();
    round_slab(staging, Bs);
    __syncthreads();  // As and Bs complete

    // One slice of dk or dv into a staging tile, for store_tile after the barrier. Tile `item %
    // stages`: with two, its last reader (the store two slices back) finished before the last
    // barrier; with one, a barrier first waits for the previous slice's store. The first
    // slice's tile was last read by round_slab, before the barrier above.
    int item = 0;
    auto stage = [&](const typename Mma<Op>::Acc(&acc)[2]) -> const float* {
      float* st = staging + (item % lay.stages) * kTile * kLdF;
      if (lay.stages == 1 && item > 0) __syncthreads();
      warp_store(st, acc);
      __syncthreads();
      ++item;
      return st;
    };
    // dk = U(V G^T) Q + V R^T, one F slice at a time
    for (int ft = 0; ft < ft_n; ++ft) {
      zero(acc_o);
      warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_o, As, LD, q_tile(buf, ft), LD);
      for (int mt = 0; mt < mt_n; ++mt) {  // R^T (M slice x F slice) is R's tile read col-major
        warp_gemm<Tin, wmma::row_major, wmma::col_major>(acc_o, v_tile(buf, mt), LD,
                                                        r_operand(ft, mt), LD);
      }
      store_tile(dk + bh * n * f, f, n, f, row0, ft * kTile, stage(acc_o));
    }
    // dv = U(K Q^T) G + K R, one M slice at a time
    for (int mt = 0; mt < mt_n; ++mt) {
      zero(acc_o);
      warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_o, Bs, LD, g_tile(buf, mt), LD);
      for (int ft = 0; ft < ft_n; ++ft) {
        warp_gemm<Tin, wmma::row_major, wmma::row_major>(acc_o, k_tile(buf, ft), LD,
                                                        r_operand(ft, mt), LD);
      }
      store_tile(dv + bh * n * m, m, n, m, row0, mt * kTile, stage(acc_o));
    }

    // R += Q^T G (every warp's dk, dv products have read R: the barrier of the last slice)
    for (int t = 0; t < ft_n * mt_n; ++t) {
      const int ft = t / mt_n, mt = t % mt_n;
      accumulate_state<Tin>(r_state(ft, mt), r_copy_tile(ft, mt), q_tile(buf, ft),
                           g_tile(buf, mt));
    }
    if (lay.nbuf == 1 && i + 1 < seg.count) {
      __syncthreads();  // every warp has read this chunk's tiles
      load_chunk(i + 1, 0);
    }
  }
#endif
}

// ------------------------------------------------------------------ register walks
// Kernels 8 and 9 work on 64 x LD tiles of the operand type (chunk rows x a 64-wide slice,
// zero-padded), a warp on a band of 16 rows r0 .. r0 + 15: the band over 64 columns is kSteps A
// fragments (one per k-step), and B fragments come in pairs of n-tiles (16 columns) per k-step.
// Band<Op, kSplit> holds what differs between the two kinds of operands (B fragments come from
// its A fragment loads, b_pair):
//   bf16 (m16n8k16): k-steps of 16, fragments by ldmatrix (see "mma.sync fragments"; lr, lm0,
//     lm1: the lane's row of an ldmatrix matrix and the matrix's two index bits);
//   fp32 tiles (m16n8k8 on tf32; fp32 inputs as 3xTF32, fp16 inputs as 1xTF32): k-steps of 8,
//     fragments by 32-bit shared loads, each k-step's 8 indices taken in the order
//     0, 2, 4, 6, 1, 3, 5, 7 in both operands (see "mma.sync fragments").
// The band of warp w (8 warps): rows 16 b .. 16 b + 15 with b = w for warps 0-3 and b = 7 - w
// for warps 4-7. Warps w and w + 4 share an SM sub-partition and its tensor cores (current GPUs
// place warp w on sub-partition w % 4), which so gets bands b and 3 - b: under a causal mask
// band b multiplies b + 1 of the 4 score steps, so each sub-partition gets 5 (with b = w % 4,
// sub-partition 3 got 8 and sub-partition 0 got 2), as under an anti-causal one (4 - b).
__device__ __forceinline__ int band_row0(int warp) { return 16 * (warp < 4 ? warp : 7 - warp); }

struct Lane {
  int g, t, lr, lm0, lm1;
  __device__ Lane()
      : g(threadIdx.x % 32 / 4),
        t(threadIdx.x % 4),
        lr(threadIdx.x % 8),
        lm0(threadIdx.x % 32 / 8 % 2),
        lm1(threadIdx.x % 32 / 16) {}
};

// Whether n-tile j (columns 8j .. 8j + 7 of the 64 x 64 scores) has an element kept by the mask
// for some row of the band: key <= row, or key >= row with `reverse`.
__device__ __forceinline__ bool tile_kept(int j, int r0, bool reverse) {
  return reverse ? 8 * j + 7 >= r0 : 8 * j <= r0 + 15;
}

template <typename Op, bool kSplit>
struct Band;

template <bool kSplit>
struct Band<__nv_bfloat16, kSplit> {
  using Op = __nv_bfloat16;
  static constexpr int kSteps = 4, LD = ld_of<Op>(), kTileElems = kTile * LD;
  static constexpr uint32_t kOnes = 0x3f803f80u;  // a B register of two bf16 1.0
  using Frags = uint32_t[kSteps][4];

  // k-step kk of A = rows r0 .. r0 + 15 of T
  static __device__ __forceinline__ void rows(uint32_t (&a)[4], const Op* T, int r0, int kk,
                                              const Lane& l) {
    ldmatrix_x4<false>(a, T + (r0 + l.lr + 8 * l.lm0) * LD + 16 * kk + 8 * l.lm1);
  }
  // k-step kk of A = columns r0 .. r0 + 15 of T as rows (the k index runs over T's rows)
  static __device__ __forceinline__ void columns(uint32_t (&a)[4], const Op* T, int r0, int kk,
                                                 const Lane& l) {
    ldmatrix_x4<true>(a, T + (16 * kk + l.lr + 8 * l.lm1) * LD + r0 + 8 * l.lm0);
  }
  // b_pair's fragments straight from ldmatrix: register i holds the 8 x 8 matrix whose row
  // addresses lanes 8i .. 8i + 7 give, so the lanes address (k-half, n-tile) = (i % 2, i / 2)
  // where columns() and rows() address (i / 2, i % 2); no register moves before the products
  static constexpr bool kBPairLoad = true;
  template <bool kAsStored>
  static __device__ __forceinline__ void b_pair(uint32_t (&b)[4], const Op* T, int c0, int kk,
                                                const Lane& l) {
    if constexpr (kAsStored) {  // k: T's rows 16 kk .., n: T's columns c0 ..
      ldmatrix_x4<true>(b, T + (16 * kk + l.lr + 8 * l.lm0) * LD + c0 + 8 * l.lm1);
    } else {  // n: T's rows c0 .., k: T's columns 16 kk ..
      ldmatrix_x4<false>(b, T + (c0 + l.lr + 8 * l.lm1) * LD + 16 * kk + 8 * l.lm0);
    }
  }
  struct Ready {  // an A fragment as the product takes it: as loaded
    uint32_t r[4];
  };
  static constexpr bool kReadyCosts = false;
  static __device__ __forceinline__ Ready ready(const uint32_t (&a)[4]) {
    return {{a[0], a[1], a[2], a[3]}};
  }
  static __device__ __forceinline__ void mma(float (&acc)[4], const Ready& a, uint32_t b0,
                                             uint32_t b1) {
    mma_bf16(acc, a.r, b0, b1);
  }
  // whether k-step kk (keys 16 kk ..) holds a key the band's mask keeps
  static __device__ __forceinline__ bool step_kept(int kk, int r0, bool reverse) {
    return tile_kept(2 * kk, r0, reverse) || tile_kept(2 * kk + 1, r0, reverse);
  }
  // the scores (n-tile j: keys 8j ..) as A fragments, rounded to bf16
  static __device__ __forceinline__ void scores(Frags& pa, const float (&p)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      pa[kk][0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
      pa[kk][1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
      pa[kk][2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
    }
  }
  // z's copy (a slot of 64 floats): z = hi + lo (within 2^-16 |z|), the bf16 parts of z[c] at
  // bf16 element c (hi) and 64 + c (lo) of the slot
  static __device__ __forceinline__ void publish_z(float* slot, int c, float z) {
    const __nv_bfloat16 hi = __float2bfloat16_rn(z);
    Op* parts = reinterpret_cast<Op*>(slot);
    parts[c] = hi;
    parts[kTile + c] = __float2bfloat16_rn(z - __bfloat162float(hi));
  }
  // d[h] += row g + 8h of the band . z, on the lanes t = 0 (0 on the others): one mma a k-step
  // with B's columns 0 and 1 = z's hi and lo parts, the others zero
  static __device__ __forceinline__ void dot(float (&d)[2], const Frags& a, const float* slot,
                                             const Lane& l) {
    const uint32_t* parts = reinterpret_cast<const uint32_t*>(slot) + (l.g & 1) * kTile / 2;
    float acc[4] = {};
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {  // b0: rows 2t, 2t + 1 of column g; b1: + 8
      const int c = 8 * kk + l.t;          // in bf16 pairs
      mma_bf16(acc, a[kk], l.g < 2 ? parts[c] : 0u, l.g < 2 ? parts[c + 4] : 0u);
    }
    d[0] += acc[0] + acc[1];
    d[1] += acc[2] + acc[3];
  }
  // the warp's 16 x 32 slab (n-tile j: columns c0 + 8j) of a state in accumulators to a copy
  static __device__ __forceinline__ void publish(Op* copy, const float (&s)[4][4], int r0, int c0,
                                                 const Lane& l) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<uint32_t*>(copy + (r0 + l.g + 8 * h) * LD + c0 + 8 * j + 2 * l.t) =
            pack_bf16(s[j][2 * h], s[j][2 * h + 1]);
      }
    }
  }
};

template <bool kSplit>
struct Band<float, kSplit> {
  using Op = float;
  static constexpr int kSteps = 8, LD = ld_of<Op>(), kTileElems = kTile * LD;
  static constexpr uint32_t kOnes = 0x3f800000u;  // a B register of 1.0 (exact in tf32)
  static constexpr bool kBPairLoad = false;       // b_pair: rows() or columns(), reordered
  using Frags = uint32_t[kSteps][4];

  static __device__ __forceinline__ void rows(uint32_t (&a)[4], const Op* T, int r0, int kk,
                                              const Lane& l) {
    const float* p = T + (r0 + l.g) * LD + 8 * kk + 2 * l.t;
    const float2 x = *reinterpret_cast<const float2*>(p);
    const float2 y = *reinterpret_cast<const float2*>(p + 8 * LD);
    a[0] = float_bits(x.x);
    a[1] = float_bits(y.x);
    a[2] = float_bits(x.y);
    a[3] = float_bits(y.y);
  }
  static __device__ __forceinline__ void columns(uint32_t (&a)[4], const Op* T, int r0, int kk,
                                                 const Lane& l) {
    const float* p = T + (8 * kk + 2 * l.t) * LD + r0 + l.g;
    a[0] = float_bits(p[0]);
    a[1] = float_bits(p[8]);
    a[2] = float_bits(p[LD]);
    a[3] = float_bits(p[LD + 8]);
  }
  using Ready = TF32A<kSplit>;  // rounded (and split) once per k-step
  static constexpr bool kReadyCosts = true;
  static __device__ __forceinline__ Ready ready(const uint32_t (&a)[4]) { return Ready(a); }
  static __device__ __forceinline__ void mma(float (&acc)[4], const Ready& a, uint32_t b0,
                                             uint32_t b1) {
    mma_tf32<kSplit>(acc, a, b0, b1);
  }
  static __device__ __forceinline__ bool step_kept(int kk, int r0, bool reverse) {
    return tile_kept(kk, r0, reverse);
  }
  // C's c[0], c[1] (keys 2t, 2t + 1) are A's slots t and t + 4: the scores stay in place
  static __device__ __forceinline__ void scores(Frags& pa, const float (&p)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      pa[kk][0] = float_bits(p[kk][0]);
      pa[kk][1] = float_bits(p[kk][2]);
      pa[kk][2] = float_bits(p[kk][1]);
      pa[kk][3] = float_bits(p[kk][3]);
    }
  }
  // z's copy (a slot of 64 floats): z[c] at c
  static __device__ __forceinline__ void publish_z(float* slot, int c, float z) { slot[c] = z; }
  // d[h] += row g + 8h of the band . z over this lane's columns
  static __device__ __forceinline__ void dot(float (&d)[2], const Frags& a, const float* z,
                                             const Lane& l) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // a[h]: column 2t (row g + 8h); a[h + 2]: 2t + 1
        const int c = 8 * kk + 2 * l.t;
        d[h] += bits_float(a[kk][h]) * z[c] + bits_float(a[kk][h + 2]) * z[c + 1];
      }
    }
  }
  static __device__ __forceinline__ void publish(Op* copy, const float (&s)[4][4], int r0, int c0,
                                                 const Lane& l) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<float2*>(copy + (r0 + l.g + 8 * h) * LD + c0 + 8 * j + 2 * l.t) =
            float2{s[j][2 * h], s[j][2 * h + 1]};
      }
    }
  }
};

template <typename Tin>
using BandOf = Band<typename OperandOf<Tin>::type, kSplitOf<Tin>>;

// Rows r0 .. r0 + 15 of tile T as A fragments.
template <typename B>
__device__ __forceinline__ void band_fragments(typename B::Frags& a, const typename B::Op* T,
                                               int r0, const Lane& l) {
#pragma unroll
  for (int kk = 0; kk < B::kSteps; ++kk) B::rows(a[kk], T, r0, kk, l);
}

// The band's K^T-like A fragments: columns r0 .. r0 + 15 of tile T as rows.
template <typename B>
__device__ __forceinline__ void transposed_band_fragments(typename B::Frags& a,
                                                          const typename B::Op* T, int r0,
                                                          const Lane& l) {
#pragma unroll
  for (int kk = 0; kk < B::kSteps; ++kk) B::columns(a[kk], T, r0, kk, l);
}

// k-step kk of columns c0 .. c0 + 15 of B (b[0], b[1]: n-tile c0; b[2], b[3]: c0 + 8), with
// B = T as stored, or T^T (B's columns are T's rows). Both operands hold a 16 x k-step block
// the same way, rows g, g + 8 and k slots of the lane: the A fragment of T's columns (rows)
// c0 .., with the two middle registers (row g + 8 at the low slots, row g at the high ones)
// trading places. bf16 loads them in this order (Band::b_pair); fp32 as A, then reordered.
template <typename B, bool kAsStored>
__device__ __forceinline__ void b_pair(uint32_t (&b)[4], const typename B::Op* T, int c0, int kk,
                                       const Lane& l) {
  if constexpr (B::kBPairLoad) {
    B::template b_pair<kAsStored>(b, T, c0, kk, l);
  } else {
    uint32_t a[4];
    if constexpr (kAsStored) {
      B::columns(a, T, c0, kk, l);
    } else {
      B::rows(a, T, c0, kk, l);
    }
    b[0] = a[0];
    b[1] = a[2];
    b[2] = a[1];
    b[3] = a[3];
  }
}

// The band's masked scores p = A Y^T (n-tile j: rows 8j .. of Y) over FT feature slices (a[ft]:
// the band's fragments of slice ft; Y: FT 64 x LD tiles one after another), tiles wholly
// outside the mask skipped.
template <typename B, int FT>
__device__ __forceinline__ void band_scores(float (&p)[8][4], const typename B::Frags (&a)[FT],
                                            const typename B::Op* Y, int r0, bool reverse,
                                            const Lane& l) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) p[j][e] = 0.f;
  }
  auto kept = [&](int jp) {
    return tile_kept(2 * jp, r0, reverse) || tile_kept(2 * jp + 1, r0, reverse);
  };
  auto product = [&](int ft, int kk, int jp, const typename B::Ready& ak) {
    uint32_t b[4];
    b_pair<B, false>(b, Y + ft * B::kTileElems, 16 * jp, kk, l);
    B::mma(p[2 * jp], ak, b[0], b[1]);
    B::mma(p[2 * jp + 1], ak, b[2], b[3]);
  };
  // each accumulator sums its k-steps in the same order either way
  if constexpr (B::kReadyCosts) {  // k-steps outermost: A rounded once for every n-tile pair
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
#pragma unroll
      for (int kk = 0; kk < B::kSteps; ++kk) {
        const typename B::Ready ak = B::ready(a[ft][kk]);
#pragma unroll
        for (int jp = 0; jp < 4; ++jp) {
          if (kept(jp)) product(ft, kk, jp, ak);
        }
      }
    }
  } else {  // n-tile pairs outermost (fewer registers live: kernel 9 fits 128 without spills)
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      if (!kept(jp)) continue;
#pragma unroll
      for (int ft = 0; ft < FT; ++ft) {
#pragma unroll
        for (int kk = 0; kk < B::kSteps; ++kk) product(ft, kk, jp, B::ready(a[ft][kk]));
      }
    }
  }
  // Only the tile pair on the band's diagonal (keys r0 .. r0 + 15) holds scores the mask
  // zeroes: the pairs before it (after it, reverse) are kept whole, the others not computed.
  // (The tf32 kernels mask every tile: masking the diagonal alone cost them register moves.)
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (B::kReadyCosts || j / 2 == r0 / 16) {  // the same in the whole warp
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // row and key from the pair's first
        const int row = l.g + 8 * (e / 2) + (B::kReadyCosts ? r0 : 0);
        const int key = 8 * (B::kReadyCosts ? j : j % 2) + 2 * l.t + e % 2;
        if (reverse ? key < row : key > row) p[j][e] = 0.f;
      }
    }
  }
}

// The row sums of the band's scores p (rows g, g + 8; this lane's columns only), pairwise (a
// dependency chain of 4 additions, not 16).
__device__ __forceinline__ void band_row_sums(float (&rs)[2], const float (&p)[8][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float a[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = p[j][2 * h] + p[j][2 * h + 1];
    rs[h] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
}

// acc (n-tile j: columns c0 + 8j) += A B over 64 rows of B: B = tile T as stored (kAsStored)
// or T^T (B's columns c0 .. are T's rows); a: A's fragments. With `skip`, the k-steps whose
// scores the band's mask zeroes are left out.
template <typename B, int NT, bool kAsStored>
__device__ __forceinline__ void band_product(float (&acc)[NT][4], const typename B::Frags& a,
                                             const typename B::Op* T, int c0, const Lane& l,
                                             bool skip = false, int r0 = 0, bool reverse = false) {
#pragma unroll
  for (int kk = 0; kk < B::kSteps; ++kk) {
    if (skip && !B::step_kept(kk, r0, reverse)) continue;
    const typename B::Ready ak = B::ready(a[kk]);
#pragma unroll
    for (int jp = 0; jp < NT / 2; ++jp) {
      uint32_t b[4];
      b_pair<B, kAsStored>(b, T, c0 + 16 * jp, kk, l);
      B::mma(acc[2 * jp], ak, b[0], b[1]);
      B::mma(acc[2 * jp + 1], ak, b[2], b[3]);
    }
  }
}

// acc += a B and acc2[ft] += a2[ft] B (ft < FT) with one load of each fragment of B = tile T as
// stored (columns c0 ..); the k-steps whose scores the band's mask zeroes are left out of acc
// only. With `with_z`, also z[ft] += a2[ft] 1 (the row sums of a2[ft]: every column of z[ft]
// holds them).
template <typename B, int NT, int FT>
__device__ __forceinline__ void band_products_sharing_b(float (&acc)[NT][4],
                                                        const typename B::Frags& a,
                                                        float (&acc2)[FT][NT][4],
                                                        const typename B::Frags (&a2)[FT],
                                                        float (&z)[FT][4], bool with_z,
                                                        const typename B::Op* T, int c0,
                                                        const Lane& l, int r0, bool reverse) {
#pragma unroll
  for (int kk = 0; kk < B::kSteps; ++kk) {
    const bool kept = B::step_kept(kk, r0, reverse);
    const typename B::Ready ak = B::ready(a[kk]);
    typename B::Ready a2k[FT];
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
      a2k[ft] = B::ready(a2[ft][kk]);
      if (with_z) B::mma(z[ft], a2k[ft], B::kOnes, B::kOnes);
    }
#pragma unroll
    for (int jp = 0; jp < NT / 2; ++jp) {
      uint32_t b[4];
      b_pair<B, true>(b, T, c0 + 16 * jp, kk, l);
      // acc2 first: B's tf32 rounding, in the unconditional products, serves the kept ones
#pragma unroll
      for (int ft = 0; ft < FT; ++ft) {
        B::mma(acc2[ft][2 * jp], a2k[ft], b[0], b[1]);
        B::mma(acc2[ft][2 * jp + 1], a2k[ft], b[2], b[3]);
      }
      if (kept) {
        B::mma(acc[2 * jp], ak, b[0], b[1]);
        B::mma(acc[2 * jp + 1], ak, b[2], b[3]);
      }
    }
  }
}

// Sets the warp's slab of a state from a segment's carry (fp32 row-major rows x cols, null: 0).
__device__ __forceinline__ void carry_slab(float (&s)[4][4], const float* carry, int64_t rows,
                                           int64_t cols, int r0, int64_t c0, const Lane& l) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t r = r0 + l.g + 8 * (e / 2), c = c0 + 8 * j + 2 * l.t + e % 2;
      s[j][e] = (carry != nullptr && r < rows && c < cols) ? carry[r * cols + c] : 0.f;
    }
  }
}

template <typename Tout>
__device__ __forceinline__ void store_pair(Tout* dst, float a, float b, bool both, bool pair) {
  if (pair) {  // both in range, and dst aligned to the pair
    if constexpr (std::is_same_v<Tout, float>) {
      *reinterpret_cast<float2*>(dst) = float2{a, b};
    } else {
      *reinterpret_cast<uint32_t*>(dst) = pack2<Tout>(a, b);
    }
    return;
  }
  dst[0] = from_float<Tout>(a);
  if (both) dst[1] = from_float<Tout>(b);
}

// Writes the band's rows of acc (n-tile j: columns col0 + 8j) to rows row0 + g, row0 + g + 8 of a
// row-major (rows x cols) matrix, with `divide` each times 1 / its d (d.x, d.y); `pairs`: the
// matrix is aligned for two-element stores.
template <int NT, typename Tout>
__device__ __forceinline__ void store_band(Tout* out, const float (&acc)[NT][4], int64_t rows,
                                           int64_t cols, int64_t row0, int64_t col0, bool divide,
                                           float2 d, bool pairs, const Lane& l) {
  static_assert(8 * NT <= kTile, "a band is at most a tile wide");
  // from the band's corner on, 32-bit offsets and bounds (cols < 2^24, checked by the binding)
  out += row0 * cols + col0;
  const int in_rows = extent_in(rows - row0), in_cols = extent_in(cols - col0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = l.g + 8 * h;
    if (row >= in_rows) continue;
    const float inv = divide ? 1.f / (h == 0 ? d.x : d.y) : 1.f;  // one division a row
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = 8 * j + 2 * l.t;
      if (col >= in_cols) continue;
      float a = acc[j][2 * h], b = acc[j][2 * h + 1];
      if (divide) {
        a *= inv;
        b *= inv;
      }
      store_pair(out + row * static_cast<int>(cols) + col, a, b, col + 1 < in_cols,
                 pairs && col + 1 < in_cols);
    }
  }
}

// Shared memory of kernels 8 and 9: `tiles` 64 x LD operand tiles and `floats` floats.
template <typename Op>
constexpr size_t mma_smem(int tiles, int floats) {
  return static_cast<size_t>(tiles) * kTile * ld_of<Op>() * sizeof(Op) + floats * sizeof(float);
}

// Two blocks per SM for bf16 tiles with F <= 64 (74 and 90 KB), one for fp32 tiles (137 and
// 170 KB), whose 3xTF32 products also hold more registers, and for two feature slices (127 KB).
template <typename Op, int FT = 1>
constexpr int kMmaBlocksPerSm = sizeof(Op) == 2 && FT == 1 ? 2 : 1;

// ------------------------------------------------------------------ kernel 8: register walk
// Kernel 6 on mma.sync with each warp's operands in registers (selected by mma_walk; FT feature
// slices: F <= 64 in every dtype, F <= 128 for bf16): the masked scores go from the accumulators
// of Q K^T straight into the A operand of P V, and the state S stays in fp32 accumulators for
// the whole walk, so per chunk only the Q, K, V tiles and one copy of S pass through shared
// memory, with one barrier. bf16 inputs multiply in bf16 (S's copy rounded to bf16), fp32
// inputs in 3xTF32 and fp16 inputs in 1xTF32 (as kernel 6; S's copy and the tiles in fp32).
// grid and segments as in kernel 6 (grid.x = BH * nblk, grid.y = ceil(M/64); carries from
// kernels 1 and 2). Warp w owns rows r0 = band_row0(w) .. +16 of the chunk (outputs) and of each
// feature slice of S (features 64 ft + r0 ..), and columns c0 = 32*(w/4) .. +32 of the M slice;
// the two warps of each row band both compute its 16 x 64 scores. Chunk c (rows of chunk i are
// j, i within the chunk):
//     P = mask(Q_c K_c^T)            (fp32 accumulators; A fragments)
//     out_c = P V_c + Q_c S,  den_c = row sums of P + Q_c z
//     S += K_c^T V_c,  z += column sums of K_c,
// then S's copy and z go to the other of two shared copies, which the next chunk reads after
// the barrier that also publishes its tiles. Score and value steps that the mask zeroes for a
// whole warp are skipped. z's sums are products too (K_c^T 1 beside K_c^T V_c, in fp32
// accumulators), and in bf16 so is Q_c z (z's copy as bf16 hi and lo parts: B's two columns).
// Shared: two buffers of (Q: FT tiles, K: FT tiles, V: one tile; 64 x LD operand tiles), two
// copies of S (FT tiles) and of z (FT slots of 64 floats: z in fp32, or in bf16 its hi and lo
// parts). Outputs and den go from registers to global
// memory.
template <typename Op>
constexpr size_t mma_walk_smem(int ft) {
  return mma_smem<Op>(2 * (2 * ft + 1) + 2 * ft, 2 * ft * kTile);
}

// Kernel 8's feature slices for F, 0 where it does not apply: the fp32 tiles of two slices
// (238 KB) exceed every GPU's shared memory.
template <typename Op>
constexpr int mma_walk_slices(int64_t f) {
  return f <= kTile ? 1 : (sizeof(Op) == 2 && f <= 2 * kTile ? 2 : 0);
}

template <typename Tin, typename Tout, int FT>
__global__ void __launch_bounds__(kThreads, kMmaBlocksPerSm<typename OperandOf<Tin>::type, FT>)
    chunk_walk_mma_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                          const Tin* __restrict__ v, const float* __restrict__ carry,
                          Tout* __restrict__ out, float* __restrict__ den, int64_t n, int64_t f,
                          int64_t m, int64_t nblk, int64_t cpb, bool reverse, bool normalize,
                          float eps, bool vec_qk, bool vec_v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  using B = BandOf<Tin>;
  constexpr int LD = ld_of<Op>();
  constexpr int kOpTile = kTile * LD;
  constexpr int kBufTiles = 2 * FT + 1;
  KS_DYNAMIC_SMEM(smem);
  Op* bufs = reinterpret_cast<Op*>(smem);  // buffer b: Q slices, K slices, V
  Op* s_copies = bufs + 2 * kBufTiles * kOpTile;  // S in the operand type, two copies of FT tiles
  float* z_copies = reinterpret_cast<float*>(s_copies + 2 * FT * kOpTile);  // two copies of z
  auto tile = [&](int buf, int i) { return bufs + (buf * kBufTiles + i) * kOpTile; };

  const Lane l;
  const int warp = threadIdx.x / 32;
  const int r0 = band_row0(warp), c0 = (warp / 4) * 32;
  const WalkSegment seg(n, nblk, cpb, reverse);
  const int64_t bh = seg.bh, blk = seg.blk;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const bool need_den = normalize || den != nullptr;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
      load_tile<Tin, Op>(tile(buf, ft), LD, qb, f, n, f, row0, ft * kTile, nullptr, vec_qk);
      load_tile<Tin, Op>(tile(buf, FT + ft), LD, kb, f, n, f, row0, ft * kTile, nullptr, vec_qk);
    }
    load_tile<Tin, Op>(tile(buf, 2 * FT), LD, vb, m, n, m, row0, m0, nullptr, vec_v);
    cp_async_commit();
  };
  load_chunk(0, 0);

  // S: the warp's 16 x 32 slab of each feature slice (features 64 ft + r0 .., columns
  // m0 + c0 ..) in fp32 accumulators, from the segment's carry (S row-major F x M, then z) or
  // zero; z: the sums of K's columns 64 ft + r0 + g and + 8 (the band's features) in the
  // accumulators of K^T 1 (z[ft][2h], z[ft][2h + 1]: feature r0 + g + 8h), which the lanes
  // t = 0 of warps 0-3 publish.
  const float* cs = carry == nullptr ? nullptr : carry + (bh * nblk + blk) * (f * m + f);
  const bool z_writer = c0 == 0 && l.t == 0;
  float s[FT][4][4], z[FT][4];
#pragma unroll
  for (int ft = 0; ft < FT; ++ft) {
    carry_slab(s[ft], cs, f, m, ft * kTile + r0, m0 + c0, l);
    B::publish(s_copies + ft * kOpTile, s[ft], r0, c0, l);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t col = ft * kTile + r0 + l.g + 8 * h;
      z[ft][2 * h] = z[ft][2 * h + 1] =
          (cs != nullptr && need_den && col < f) ? cs[f * m + col] : 0.f;
      if (z_writer) B::publish_z(z_copies + ft * kTile, r0 + l.g + 8 * h, z[ft][2 * h]);
    }
  }

  const bool pairs = reinterpret_cast<uintptr_t>(out) % (2 * sizeof(Tout)) == 0 && m % 2 == 0;
  for (int64_t i = 0; i < seg.count; ++i) {
    const int buf = static_cast<int>(i & 1);
    cp_async_wait_all();  // chunk i's tiles (the only copies in flight)
    __syncthreads();      // ... visible to all, with S and z; step i-1 is complete
    if (i + 1 < seg.count) load_chunk(i + 1, buf ^ 1);
    const Op* Qs = tile(buf, 0);
    const Op* Ks = tile(buf, FT);
    const Op* Vs = tile(buf, 2 * FT);
    const Op* Ss = s_copies + buf * FT * kOpTile;
    const float* zs = z_copies + buf * FT * kTile;

    typename B::Frags qa[FT], pa;
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) band_fragments<B>(qa[ft], Qs + ft * kOpTile, r0, l);
    float rs[2] = {0.f, 0.f};
    {
      float p[8][4];
      band_scores<B, FT>(p, qa, Ks, r0, reverse, l);
      if (need_den) band_row_sums(rs, p);
      B::scores(pa, p);
    }
    // out = Q S + P V (the warp's 16 x 32), then S += K^T V
    float o[4][4] = {};
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) band_product<B, 4, true>(o, qa[ft], Ss + ft * kOpTile, c0, l);
    typename B::Frags ka[FT];
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) transposed_band_fragments<B>(ka[ft], Ks + ft * kOpTile, r0, l);
    band_products_sharing_b<B>(o, pa, s, ka, z, need_den, Vs, c0, l, r0, reverse);

    // den = row sums + q . z (z before this chunk), summed over the four lanes of a row
    float dn[2] = {rs[0], rs[1]};
    if (need_den) {
#pragma unroll
      for (int ft = 0; ft < FT; ++ft) B::dot(dn, qa[ft], zs + ft * kTile, l);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        dn[h] += __shfl_xor_sync(0xffffffffu, dn[h], 1);
        dn[h] += __shfl_xor_sync(0xffffffffu, dn[h], 2);
      }
    }
    if (i + 1 < seg.count) {  // the other copies: read in step i - 1
#pragma unroll
      for (int ft = 0; ft < FT; ++ft) {
        B::publish(s_copies + ((buf ^ 1) * FT + ft) * kOpTile, s[ft], r0, c0, l);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* slot = z_copies + ((buf ^ 1) * FT + ft) * kTile;
          if (z_writer) B::publish_z(slot, r0 + l.g + 8 * h, z[ft][2 * h]);
        }
      }
    }

    // outputs (divided by den + eps with `normalize`) and den, from registers
    const int64_t row0 = seg.chunk(i) * kTile + r0;
    store_band(out + bh * n * m, o, n, m, row0, m0 + c0, normalize, float2{dn[0] + eps, dn[1] + eps},
               pairs, l);
    if (den != nullptr && blockIdx.y == 0 && c0 == 0 && l.t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row0 + l.g + 8 * h < n) den[bh * n + row0 + l.g + 8 * h] = dn[h];
      }
    }
  }
#endif
}

// ------------------------------------------------------------------ kernel 9: register dk, dv
// Kernel 7 for F, M <= 64 (selected by mma_walk), as kernel 8 is kernel 6: one walk from the
// last chunk to the first with R = sum_{c' > c} Q_c'^T G_c' (F x M) in fp32 accumulators,
// starting from the segment's carry (kernels 1 and 2 over (q, g) in reverse).
// Warps 0-3 give dk, warps 4-7 dv, each for its band of 16 rows r0 = band_row0(w) of the chunk:
//     dk_c = U(V_c G_c^T) Q_c + V_c R^T      dv_c = U(K_c Q_c^T) G_c + K_c R
// (U keeps the scores (j, i) with i >= j), then every warp adds its 16 x 32 slab of
// Q_c^T G_c to R (features r0 .., columns 32*(w/4) ..), and R's copy for the next chunk goes to
// the other of two shared copies. One barrier per chunk.
// Shared: two buffers of (Q, K, V, G: 64 x LD operand tiles each) and two copies of R.
template <typename Op>
constexpr size_t mma_dkv_smem() {
  return mma_smem<Op>(2 * 4 + 2, 0);
}

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kThreads, kMmaBlocksPerSm<typename OperandOf<Tin>::type>)
    chunk_walk_mma_dkv_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                              const Tin* __restrict__ v, const Tin* __restrict__ g,
                              const float* __restrict__ carry, Tout* __restrict__ dk,
                              Tout* __restrict__ dv, int64_t n, int64_t f, int64_t m,
                              int64_t nblk, int64_t cpb, bool vec_f, bool vec_m) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  using B = BandOf<Tin>;
  constexpr int LD = ld_of<Op>();
  constexpr int kOpTile = kTile * LD;
  KS_DYNAMIC_SMEM(smem);
  Op* bufs = reinterpret_cast<Op*>(smem);  // buffer b: Q, K, V, G at tiles 4b .. 4b + 3
  Op* r_copies = bufs + 8 * kOpTile;       // R in the operand type, two copies
  auto tile = [&](int buf, int i) { return bufs + (buf * 4 + i) * kOpTile; };

  const Lane l;
  const int warp = threadIdx.x / 32;
  const int r0 = band_row0(warp), c0 = (warp / 4) * 32;
  const bool dk_warp = warp < 4;
  const WalkSegment seg(n, nblk, cpb, true);
  const int64_t bh = seg.bh, blk = seg.blk;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  const Tin* gb = g + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    load_tile<Tin, Op>(tile(buf, 0), LD, qb, f, n, f, row0, 0, nullptr, vec_f);
    load_tile<Tin, Op>(tile(buf, 1), LD, kb, f, n, f, row0, 0, nullptr, vec_f);
    load_tile<Tin, Op>(tile(buf, 2), LD, vb, m, n, m, row0, 0, nullptr, vec_m);
    load_tile<Tin, Op>(tile(buf, 3), LD, gb, m, n, m, row0, 0, nullptr, vec_m);
    cp_async_commit();
  };
  load_chunk(0, 0);

  float r[4][4];
  carry_slab(r, carry == nullptr ? nullptr : carry + (bh * nblk + blk) * (f * m + f), f, m, r0,
             c0, l);
  B::publish(r_copies, r, r0, c0, l);

  Tout* grad = dk_warp ? dk + bh * n * f : dv + bh * n * m;
  const int64_t width = dk_warp ? f : m;
  const bool pairs =
      reinterpret_cast<uintptr_t>(grad) % (2 * sizeof(Tout)) == 0 && width % 2 == 0;
  for (int64_t i = 0; i < seg.count; ++i) {
    const int buf = static_cast<int>(i & 1);
    cp_async_wait_all();  // chunk i's tiles (the only copies in flight)
    __syncthreads();      // ... visible to all, with R; step i-1 is complete
    if (i + 1 < seg.count) load_chunk(i + 1, buf ^ 1);
    const Op* Qs = tile(buf, 0);
    const Op* Ks = tile(buf, 1);
    const Op* Vs = tile(buf, 2);
    const Op* Gs = tile(buf, 3);
    const Op* Rs = r_copies + buf * kOpTile;

    // the band's gradient: X = V (dk) or K (dv), scored against Y = G or Q, whose partner
    // Z = Q or G the scores multiply
    const Op* X = dk_warp ? Vs : Ks;
    typename B::Frags xa[1], pa;
    band_fragments<B>(xa[0], X, r0, l);
    {
      float p[8][4];
      band_scores<B, 1>(p, xa, dk_warp ? Gs : Qs, r0, true, l);
      B::scores(pa, p);
    }
    float o[8][4] = {};
    band_product<B, 8, true>(o, pa, dk_warp ? Qs : Gs, 0, l, true, r0, true);
    if (dk_warp) {
      band_product<B, 8, false>(o, xa[0], Rs, 0, l);  // V R^T
    } else {
      band_product<B, 8, true>(o, xa[0], Rs, 0, l);  // K R
    }
    // R += Q^T G (the warp's slab)
    typename B::Frags qta;
    transposed_band_fragments<B>(qta, Qs, r0, l);
    band_product<B, 4, true>(r, qta, Gs, c0, l);
    if (i + 1 < seg.count) B::publish(r_copies + (buf ^ 1) * kOpTile, r, r0, c0, l);

    store_band(grad, o, n, width, seg.chunk(i) * kTile + r0, 0, false, float2{1.f, 1.f}, pairs, l);
  }
#endif
}

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

template <typename Tin>
__global__ void __launch_bounds__(kSumThreads)
    chunk_cumsum_kernel(const Tin* __restrict__ x, const float* __restrict__ pre,
                        const float* __restrict__ post, const float* __restrict__ carry,
                        float* __restrict__ out, int64_t n, int64_t f, bool reverse) {
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
    out[(bh * n + t) * f + col] = post == nullptr ? run : post[bh * n + t] * run;
  }
}

// ------------------------------------------------------------------ host helpers
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Rows of a (BH, N, D) tensor of T are 16-byte aligned when the base is and D is whole vectors.
template <typename T>
bool rows_vectorizable(const void* p, int64_t d) {
  return aligned16(p) && d % vec_elems<T>() == 0;
}

constexpr int64_t kMaxBlocks = (int64_t{1} << 31) - 1;

// Dynamic shared memory of a kernel with `tiles` operand tiles (64 x LD) and one fp32 64 x kLdF
// tile, plus `floats` more floats.
template <typename Tin>
size_t tiles_smem(int tiles, int floats = 0) {
  using Op = typename OperandOf<Tin>::type;
  return tiles * kTile * ld_of<Op>() * sizeof(Op) + (kTile * kLdF + floats) * sizeof(float);
}

template <typename Tin>
size_t states_smem() {
  return tiles_smem<Tin>(4);  // two buffers of (K, V)
}

template <typename Tin>
size_t output_smem() {
  return tiles_smem<Tin>(4, 2 * kTile);  // Q, K, S, V; z and den
}

// Causal state layout. A sequence's nc chunks are split into nblk blocks of cpb consecutive
// chunks; nblk is chosen from the shape alone (so results do not depend on the GPU) to give
// about kTargetBlocks thread blocks to the state pass: B·H = 1 at long N still fills the GPU.
constexpr int64_t kTargetBlocks = 1024;

struct CausalLayout {
  int64_t nc, cpb, nblk, ss;
  int64_t totals, prefix_z, prefix_s;  // float offsets of the workspace regions
  int64_t floats;                      // workspace size in floats
};

int64_t round_up(int64_t x, int64_t to) { return cdiv(x, to) * to; }

// Groups a sequence's nc chunks into nblk groups of cpb consecutive chunks (1 <= nblk <= nc) so
// that about `target` thread blocks run, `per_group` of them (over all sequences) per group.
struct ChunkGroups {
  int64_t cpb, nblk;
};
ChunkGroups group_chunks(int64_t nc, int64_t target, int64_t per_group) {
  int64_t want = cdiv(target, per_group);
  want = want < 1 ? 1 : (want > nc ? nc : want);
  const int64_t cpb = cdiv(nc, want);
  return {cpb, cdiv(nc, cpb)};
}

CausalLayout causal_layout(int64_t bh, int64_t n, int64_t f, int64_t m, size_t state_bytes) {
  CausalLayout l;
  l.nc = cdiv(n, kChunk);
  const ChunkGroups g = group_chunks(l.nc, kTargetBlocks, bh * cdiv(f, kTile) * cdiv(m, kTile));
  l.cpb = g.cpb;
  l.nblk = g.nblk;
  l.ss = f * m + f;
  l.totals = 0;  // fp32 [bh][nblk][ss]: block totals, then (in place) the carries
  l.prefix_z = round_up(bh * l.nblk * l.ss, 64);                     // fp32 [bh][nc][F]
  l.prefix_s = l.prefix_z + round_up(bh * l.nc * f, 64);             // Tstate [bh][nc][F*M]
  l.floats = l.prefix_s + round_up(cdiv(bh * l.nc * f * m * static_cast<int64_t>(state_bytes),
                                        sizeof(float)), 64);
  return l;
}

// Chunk states are stored in the operand type: fp32 for fp32 and fp16 inputs, bf16 for bf16
// inputs (they are rounded to bf16 as MMA operands anyway).
template <typename Tin>
using StateOf = typename OperandOf<Tin>::type;

// Sets the kernel's dynamic shared memory limit and launches it on a (blocks, slices) grid.
template <typename... Params, typename... Args>
cudaError_t launch_tiles(void (*kernel)(Params...), int64_t blocks, int64_t slices, size_t smem,
                         cudaStream_t stream, Args... args) {
  if (blocks > kMaxBlocks || slices > 65535) return cudaErrorInvalidConfiguration;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  KS_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(slices)), kThreads,
            smem, stream)(args...);
  return cudaGetLastError();
}

template <typename Tin, typename Tstate>
cudaError_t launch_states(const Tin* k, const Tin* v, const bool* keep, int64_t heads,
                          float* totals, Tstate* prefix_s, float* prefix_z, int64_t bh, int64_t n,
                          int64_t f, int64_t m, int64_t cpb, bool reverse, bool with_z,
                          bool skip_last, cudaStream_t stream) {
  const int64_t nblk = cdiv(cdiv(n, kChunk), cpb);
  skip_last = skip_last && nblk > 1;
  return launch_tiles(chunk_states_kernel<Tin, Tstate>, bh * (nblk - skip_last),
                      cdiv(f, kTile) * cdiv(m, kTile), states_smem<Tin>(), stream, k, v, keep,
                      heads, totals, prefix_s, prefix_z, n, f, m, nblk, cpb, reverse, with_z,
                      skip_last, rows_vectorizable<Tin>(k, f), rows_vectorizable<Tin>(v, m));
}

cudaError_t launch_scan(float* states, float* total, int64_t bh, int64_t nblk, int64_t ss,
                        int mode, cudaStream_t stream) {
  const int64_t blocks = bh * cdiv(ss, kThreads);
  if (blocks > kMaxBlocks) return cudaErrorInvalidConfiguration;
  KS_LAUNCH(state_scan_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream)(
      states, total, nblk, ss, mode);
  return cudaGetLastError();
}

// Kernels 1 and 2: the block totals of (k, v) over groups of cpb chunks, then in place their
// exclusive prefix (suffix with `reverse`): the carry of each group. With prefix_s, also every
// chunk's block-local exclusive prefix (prefix_s, prefix_z); without, the group that comes last
// is not summed at all (no carry includes it: a walk's carries with two segments a sequence
// take half the work).
template <typename Tin, typename Tstate>
cudaError_t launch_carries(const Tin* k, const Tin* v, float* totals, Tstate* prefix_s,
                           float* prefix_z, int64_t bh, int64_t n, int64_t f, int64_t m,
                           int64_t cpb, bool reverse, bool with_z, cudaStream_t stream) {
  cudaError_t err =
      launch_states<Tin, Tstate>(k, v, nullptr, 1, totals, prefix_s, prefix_z, bh, n, f, m, cpb,
                                 reverse, with_z, prefix_s == nullptr, stream);
  if (err != cudaSuccess) return err;
  return launch_scan(totals, nullptr, bh, cdiv(cdiv(n, kChunk), cpb), f * m + f,
                     reverse ? kExclusiveReverse : kExclusiveForward, stream);
}

template <typename Tin, typename Tstate, typename Tout>
cudaError_t launch_output(const Tin* q, const Tin* k, const Tin* v, const Tstate* s_base,
                          int64_t s_stride, const float* z_base, int64_t z_stride,
                          const float* carry, int64_t cpb, Tout* out, float* den, int64_t bh,
                          int64_t n, int64_t f, int64_t m, int mode, bool normalize, float eps,
                          cudaStream_t stream) {
  const bool vec_qk =
      rows_vectorizable<Tin>(q, f) && (k == nullptr || rows_vectorizable<Tin>(k, f));
  const bool vec_v = v != nullptr && rows_vectorizable<Tin>(v, m);
  const bool vec_s = rows_vectorizable<Tstate>(s_base, m) && s_stride % vec_elems<Tstate>() == 0;
  return launch_tiles(chunk_output_kernel<Tin, Tstate, Tout>, bh * cdiv(n, kTile), cdiv(m, kTile),
                      output_smem<Tin>(), stream, q, k, v, s_base, s_stride, z_base, z_stride,
                      carry, cpb, out, den, n, f, m, mode, normalize, eps, vec_qk, vec_v, vec_s);
}

// The walk (kernel 6): whether it runs for these inputs, its segments and its workspace.
// Segments: a sequence's nc chunks are split into nblk segments of cpb consecutive chunks so
// that about `walk_blocks` thread blocks walk at once (nblk = 1 where B·H·ceil(M/64) reaches it;
// B·H = 1 at long N is split as far as one chunk per segment). The split depends on the shape
// and walk_blocks alone, so results do not depend on the GPU.
constexpr int kWalkMaxSlices = 2;  // F <= 128

template <typename Tin>
size_t walk_smem(int64_t f) {
  using Op = typename OperandOf<Tin>::type;
  return cdiv(f, kTile) == 1 ? WalkSmem<Op, 1>::bytes() : WalkSmem<Op, 2>::bytes();
}

// The current device's shared memory per block (opt-in), 0 if it cannot be read.
size_t smem_optin() {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    cudaGetLastError();  // clear the error: the chunked kernels run instead
    return 0;
  }
  return static_cast<size_t>(optin);
}

// The walk that computes a causal product: with walk_blocks > 0, kernel 8 where mma_walk asks
// for it, it covers F and its shared memory fits the device, else kernel 6 where it covers F
// and fits; none (the chunk kernels) otherwise.
enum class Walk { kNone, kWmma, kMma };

template <typename Tin>
Walk causal_walk(int64_t f, int64_t walk_blocks, bool mma_walk) {
  using Op = typename OperandOf<Tin>::type;
  if (walk_blocks <= 0) return Walk::kNone;
  const size_t optin = smem_optin();
  const int ft = mma_walk ? mma_walk_slices<Op>(f) : 0;
  if (ft > 0 && mma_walk_smem<Op>(ft) <= optin) return Walk::kMma;
  if (cdiv(f, kTile) <= kWalkMaxSlices && walk_smem<Tin>(f) <= optin) return Walk::kWmma;
  return Walk::kNone;
}

// Kernel 7's shared-memory layout for F and M: two buffers where they fit, else one, and with
// them two staging tiles where they fit, else one; nbuf = 0 where F or M exceeds 128 or even one
// buffer and one tile do not fit (the backward then walks dk and dv separately).
template <typename Tin>
DkvSmem<typename OperandOf<Tin>::type> dkv_smem(int64_t f, int64_t m) {
  DkvSmem<typename OperandOf<Tin>::type> lay{0, 0, 0, 0};
  if (cdiv(f, kTile) > kWalkMaxSlices || cdiv(m, kTile) > kWalkMaxSlices) return lay;
  lay.ft = static_cast<int>(cdiv(f, kTile));
  lay.mt = static_cast<int>(cdiv(m, kTile));
  const size_t optin = smem_optin();
  for (lay.nbuf = 2; lay.nbuf >= 1; --lay.nbuf) {  // a second buffer before a second stage
    for (lay.stages = 2; lay.stages >= 1; --lay.stages) {
      if (lay.bytes() <= optin) return lay;
    }
  }
  return lay;  // nbuf = 0
}

struct WalkLayout {
  int64_t cpb, nblk;
  int64_t floats;  // workspace: the segments' totals, then carries ([bh][nblk][F*M+F]) if nblk > 1
};

// `slices`: thread blocks per segment (kernel 6: one per 64-wide M slice; kernel 7: one).
WalkLayout walk_layout(int64_t bh, int64_t n, int64_t f, int64_t m, int64_t walk_blocks,
                       int64_t slices) {
  const ChunkGroups g = group_chunks(cdiv(n, kChunk), walk_blocks, bh * slices);
  return {g.cpb, g.nblk, g.nblk > 1 ? bh * g.nblk * (f * m + f) : 0};
}

// The carries of a walk's segments of (k, v) (kernels 1 and 2, totals only) into ws, in
// `*carry`; null where each sequence is a single segment.
template <typename Tin>
cudaError_t walk_carries(const Tin* k, const Tin* v, float* ws, const WalkLayout& l, int64_t bh,
                         int64_t n, int64_t f, int64_t m, bool reverse, bool with_z,
                         const float** carry, cudaStream_t stream) {
  *carry = nullptr;
  if (l.nblk == 1) return cudaSuccess;
  *carry = ws;
  return launch_carries<Tin, StateOf<Tin>>(k, v, ws, nullptr, nullptr, bh, n, f, m, l.cpb,
                                           reverse, with_z, stream);
}

// Kernel 6 for F features (one or two slices).
template <typename Tin, typename Tout>
auto walk_kernel_for(int64_t f) {
  return cdiv(f, kTile) == 1 ? chunk_walk_kernel<Tin, Tout, 1> : chunk_walk_kernel<Tin, Tout, 2>;
}

// Kernel 8 for ft feature slices (mma_walk_slices).
template <typename Tin, typename Tout>
auto walk_mma_kernel_for(int ft) {
  auto kernel = chunk_walk_mma_kernel<Tin, Tout, 1>;
  if constexpr (mma_walk_slices<typename OperandOf<Tin>::type>(2 * kTile) == 2) {
    if (ft == 2) kernel = chunk_walk_mma_kernel<Tin, Tout, 2>;
  }
  return kernel;
}

template <typename Tin, typename Tout>
cudaError_t launch_walk(const Tin* q, const Tin* k, const Tin* v, const float* carry, Tout* out,
                        float* den, int64_t bh, int64_t n, int64_t f, int64_t m, int64_t nblk,
                        int64_t cpb, bool reverse, bool normalize, float eps,
                        cudaStream_t stream) {
  const bool vec_qk = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_v = rows_vectorizable<Tin>(v, m);
  return launch_tiles(walk_kernel_for<Tin, Tout>(f), bh * nblk, cdiv(m, kTile), walk_smem<Tin>(f),
                      stream, q, k, v, carry, out, den, n, f, m, nblk, cpb, reverse, normalize,
                      eps, vec_qk, vec_v);
}

template <typename Tin, typename Tout>
cudaError_t launch_walk_mma(const Tin* q, const Tin* k, const Tin* v, const float* carry,
                            Tout* out, float* den, int64_t bh, int64_t n, int64_t f, int64_t m,
                            int64_t nblk, int64_t cpb, bool reverse, bool normalize, float eps,
                            cudaStream_t stream) {
  using Op = typename OperandOf<Tin>::type;
  const bool vec_qk = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_v = rows_vectorizable<Tin>(v, m);
  const int ft = mma_walk_slices<Op>(f);
  return launch_tiles(walk_mma_kernel_for<Tin, Tout>(ft), bh * nblk, cdiv(m, kTile),
                      mma_walk_smem<Op>(ft), stream, q, k, v, carry, out, den, n, f, m, nblk, cpb,
                      reverse, normalize, eps, vec_qk, vec_v);
}

// The causal product by kernel 6 or 8 (`mma`): the carries of the segments (kernels 1 and 2,
// totals only) where the sequence is split, then one walk per segment.
template <typename Tin>
cudaError_t walk_typed(const Tin* q, const Tin* k, const Tin* v, void* out, bool out_fp32,
                       float* den, bool normalize, float eps, float* ws, int64_t bh, int64_t n,
                       int64_t f, int64_t m, bool reverse, int64_t walk_blocks, bool mma,
                       cudaStream_t stream) {
  const WalkLayout l = walk_layout(bh, n, f, m, walk_blocks, cdiv(m, kTile));
  const float* carry;
  const cudaError_t err = walk_carries(k, v, ws, l, bh, n, f, m, reverse,
                                       normalize || den != nullptr, &carry, stream);
  if (err != cudaSuccess) return err;
  if (mma) {
    if (out_fp32) {
      return launch_walk_mma<Tin, float>(q, k, v, carry, static_cast<float*>(out), den, bh, n, f,
                                         m, l.nblk, l.cpb, reverse, normalize, eps, stream);
    }
    return launch_walk_mma<Tin, Tin>(q, k, v, carry, static_cast<Tin*>(out), den, bh, n, f, m,
                                     l.nblk, l.cpb, reverse, normalize, eps, stream);
  }
  if (out_fp32) {
    return launch_walk<Tin, float>(q, k, v, carry, static_cast<float*>(out), den, bh, n, f, m,
                                   l.nblk, l.cpb, reverse, normalize, eps, stream);
  }
  return launch_walk<Tin, Tin>(q, k, v, carry, static_cast<Tin*>(out), den, bh, n, f, m, l.nblk,
                               l.cpb, reverse, normalize, eps, stream);
}

template <typename Tin>
cudaError_t causal_typed(const void* q, const void* k, const void* v, void* out, bool out_fp32,
                         float* den, bool normalize, float eps, float* ws, int64_t bh, int64_t n,
                         int64_t f, int64_t m, bool reverse, int64_t walk_blocks,
                         bool mma_walk, cudaStream_t stream) {
  using Tstate = StateOf<Tin>;
  const Tin* qt = static_cast<const Tin*>(q);
  const Tin* kt = static_cast<const Tin*>(k);
  const Tin* vt = static_cast<const Tin*>(v);
  const Walk walk = causal_walk<Tin>(f, walk_blocks, mma_walk);
  if (walk != Walk::kNone) {
    return walk_typed<Tin>(qt, kt, vt, out, out_fp32, den, normalize, eps, ws, bh, n, f, m,
                           reverse, walk_blocks, walk == Walk::kMma, stream);
  }
  const CausalLayout l = causal_layout(bh, n, f, m, sizeof(Tstate));
  float* totals = ws + l.totals;
  float* prefix_z = ws + l.prefix_z;
  Tstate* prefix_s = reinterpret_cast<Tstate*>(ws + l.prefix_s);
  // 1. block-local exclusive prefixes per chunk and block totals (z, the key sums, only where
  //    the normalizer is wanted: the output kernel reads them only then; otherwise they stay 0);
  // 2. carries: exclusive prefix (suffix) of the block totals, in place
  const bool with_z = normalize || den != nullptr;
  const cudaError_t err = launch_carries<Tin, Tstate>(kt, vt, totals, prefix_s, prefix_z, bh, n,
                                                      f, m, l.cpb, reverse, with_z, stream);
  if (err != cudaSuccess) return err;
  // 3. outputs
  const int mode = reverse ? kAntiCausal : kCausal;
  if (out_fp32) {
    return launch_output<Tin, Tstate, float>(qt, kt, vt, prefix_s, f * m, prefix_z, f, totals,
                                             l.cpb, static_cast<float*>(out), den, bh, n, f, m,
                                             mode, normalize, eps, stream);
  }
  return launch_output<Tin, Tstate, Tin>(qt, kt, vt, prefix_s, f * m, prefix_z, f, totals, l.cpb,
                                         static_cast<Tin*>(out), den, bh, n, f, m, mode,
                                         normalize, eps, stream);
}

// The fused backward: states S of (k, v) forward and R of (q, g) in reverse (block-local
// prefixes, then the carries), then dq and dk (kernel 4) and dv (kernel 5).
template <typename Tin, typename Tout>
cudaError_t backward_typed(const Tin* q, const Tin* k, const Tin* v, const Tin* g, Tout* dq,
                           Tout* dk, Tout* dv, float* ws, int64_t bh, int64_t n, int64_t f,
                           int64_t m, cudaStream_t stream) {
  using Tstate = StateOf<Tin>;
  const CausalLayout l = causal_layout(bh, n, f, m, sizeof(Tstate));
  ChunkStates st[2];
  for (int d = 0; d < 2; ++d) {  // d = 0: S of (k, v); d = 1: R of (q, g), in reverse
    float* w = ws + d * l.floats;
    Tstate* prefix = reinterpret_cast<Tstate*>(w + l.prefix_s);
    const bool reverse = d == 1;
    const cudaError_t err =
        launch_carries<Tin, Tstate>(reverse ? q : k, reverse ? g : v, w + l.totals, prefix,
                                    w + l.prefix_z, bh, n, f, m, l.cpb, reverse, false, stream);
    if (err != cudaSuccess) return err;
    st[d] = ChunkStates{prefix, w + l.totals};
  }
  const bool vec_f = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_m = rows_vectorizable<Tin>(v, m) && rows_vectorizable<Tin>(g, m);
  const bool vec_s = rows_vectorizable<Tstate>(st[0].prefix, m) &&
                     rows_vectorizable<Tstate>(st[1].prefix, m);
  const int64_t blocks = bh * l.nc;
  cudaError_t err = launch_tiles(chunk_dqk_kernel<Tin, Tstate, Tout>, blocks, cdiv(f, kTile),
                                 tiles_smem<Tin>(4), stream, q, k, v, g, st[0], st[1], l.cpb, dq,
                                 dk, n, f, m, vec_f, vec_m, vec_s);
  if (err != cudaSuccess) return err;
  return launch_tiles(chunk_dv_kernel<Tin, Tstate, Tout>, blocks, cdiv(m, kTile),
                      tiles_smem<Tin>(3), stream, q, k, g, st[1], l.cpb, dv, n, f, m, vec_f,
                      vec_m, vec_s);
}

// Whether the walk's fused backward takes kernel 9 for dk and dv (else kernel 7 or two
// anti-causal products): with mma_walk, F and M <= 64 and its shared memory on this device.
template <typename Tin>
bool dkv_by_mma(int64_t f, int64_t m, bool mma_walk) {
  return mma_walk && f <= kTile && m <= kTile &&
         mma_dkv_smem<typename OperandOf<Tin>::type>() <= smem_optin();
}

// The walk's fused backward: dq = causal(g, v, k) by kernel 6 (or 8, as causal_walk selects),
// then dk and dv by one reverse walk with the carries of (q, g) where a sequence is cut into
// segments: kernel 9 with mma_walk where F, M <= 64 and it fits, else kernel 7; where neither
// fits, dk = anticausal(v, g, q) and dv = anticausal(k, q, g). The steps run in order on
// `stream` and share the workspace.
template <typename Tin>
cudaError_t walk_backward_typed(const Tin* q, const Tin* k, const Tin* v, const Tin* g, void* dq,
                                void* dk, void* dv, bool out_fp32, float* ws, int64_t bh,
                                int64_t n, int64_t f, int64_t m, int64_t walk_blocks,
                                bool mma_walk, cudaStream_t stream) {
  cudaError_t err = causal_typed<Tin>(g, v, k, dq, out_fp32, nullptr, false, 0.f, ws, bh, n, m,
                                      f, false, walk_blocks, mma_walk, stream);
  if (err != cudaSuccess) return err;
  constexpr size_t mma_dkv = mma_dkv_smem<typename OperandOf<Tin>::type>();
  const bool mma = dkv_by_mma<Tin>(f, m, mma_walk);
  const auto lay = dkv_smem<Tin>(f, m);
  if (!mma && lay.nbuf == 0) {
    err = causal_typed<Tin>(v, g, q, dk, out_fp32, nullptr, false, 0.f, ws, bh, n, m, f, true,
                            walk_blocks, mma_walk, stream);
    if (err != cudaSuccess) return err;
    return causal_typed<Tin>(k, q, g, dv, out_fp32, nullptr, false, 0.f, ws, bh, n, f, m, true,
                             walk_blocks, mma_walk, stream);
  }
  const WalkLayout l = walk_layout(bh, n, f, m, walk_blocks, 1);
  const float* carry;
  err = walk_carries(q, g, ws, l, bh, n, f, m, true, false, &carry, stream);
  if (err != cudaSuccess) return err;
  const bool vec_f = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_m = rows_vectorizable<Tin>(v, m) && rows_vectorizable<Tin>(g, m);
  if (mma) {
    if (out_fp32) {
      return launch_tiles(chunk_walk_mma_dkv_kernel<Tin, float>, bh * l.nblk, 1, mma_dkv, stream,
                          q, k, v, g, carry, static_cast<float*>(dk), static_cast<float*>(dv), n,
                          f, m, l.nblk, l.cpb, vec_f, vec_m);
    }
    return launch_tiles(chunk_walk_mma_dkv_kernel<Tin, Tin>, bh * l.nblk, 1, mma_dkv, stream, q,
                        k, v, g, carry, static_cast<Tin*>(dk), static_cast<Tin*>(dv), n, f, m,
                        l.nblk, l.cpb, vec_f, vec_m);
  }
  if (out_fp32) {
    return launch_tiles(chunk_walk_dkv_kernel<Tin, float>, bh * l.nblk, 1, lay.bytes(), stream,
                        q, k, v, g, carry, static_cast<float*>(dk), static_cast<float*>(dv), n,
                        f, m, l.nblk, l.cpb, lay, vec_f, vec_m);
  }
  return launch_tiles(chunk_walk_dkv_kernel<Tin, Tin>, bh * l.nblk, 1, lay.bytes(), stream, q, k,
                      v, g, carry, static_cast<Tin*>(dk), static_cast<Tin*>(dv), n, f, m, l.nblk,
                      l.cpb, lay, vec_f, vec_m);
}

// How many thread blocks of `kernel` with `smem` bytes of dynamic shared memory an SM of the
// current device holds at once, into *blocks (its shared-memory limit set first, as launch_tiles
// does).
template <typename... Params>
cudaError_t resident_blocks(void (*kernel)(Params...), size_t smem, int* blocks) {
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kThreads, smem);
}

// walk_kernels for Tin operands, outputs in Tin: the choices of causal_walk and
// walk_backward_typed.
template <typename Tin>
cudaError_t walk_kernels_typed(int64_t f, int64_t m, bool mma_walk, WalkKernels* out) {
  using Op = typename OperandOf<Tin>::type;
  *out = WalkKernels{};
  const Walk walk = causal_walk<Tin>(f, 1, mma_walk);
  cudaError_t err = cudaSuccess;
  if (walk == Walk::kMma) {
    out->product = 8;
    const int ft = mma_walk_slices<Op>(f);
    err = resident_blocks(walk_mma_kernel_for<Tin, Tin>(ft), mma_walk_smem<Op>(ft),
                          &out->product_blocks_per_sm);
  } else if (walk == Walk::kWmma) {
    out->product = 6;
    err = resident_blocks(walk_kernel_for<Tin, Tin>(f), walk_smem<Tin>(f),
                          &out->product_blocks_per_sm);
  }
  if (err != cudaSuccess) return err;
  if (dkv_by_mma<Tin>(f, m, mma_walk)) {
    out->dkv = 9;
    return resident_blocks(chunk_walk_mma_dkv_kernel<Tin, Tin>, mma_dkv_smem<Op>(),
                           &out->dkv_blocks_per_sm);
  }
  const auto lay = dkv_smem<Tin>(f, m);
  if (lay.nbuf == 0) return cudaSuccess;
  out->dkv = 7;
  return resident_blocks(chunk_walk_dkv_kernel<Tin, Tin>, lay.bytes(), &out->dkv_blocks_per_sm);
}

template <typename Tin>
cudaError_t causal_backward_typed(const void* q, const void* k, const void* v, const void* g,
                                  void* dq, void* dk, void* dv, bool out_fp32, float* ws,
                                  int64_t bh, int64_t n, int64_t f, int64_t m,
                                  int64_t walk_blocks, bool mma_walk, cudaStream_t stream) {
  const Tin* qt = static_cast<const Tin*>(q);
  const Tin* kt = static_cast<const Tin*>(k);
  const Tin* vt = static_cast<const Tin*>(v);
  const Tin* gt = static_cast<const Tin*>(g);
  if (walk_blocks > 0) {
    return walk_backward_typed<Tin>(qt, kt, vt, gt, dq, dk, dv, out_fp32, ws, bh, n, f, m,
                                    walk_blocks, mma_walk, stream);
  }
  if (out_fp32) {
    return backward_typed<Tin, float>(qt, kt, vt, gt, static_cast<float*>(dq),
                                      static_cast<float*>(dk), static_cast<float*>(dv), ws, bh,
                                      n, f, m, stream);
  }
  return backward_typed<Tin, Tin>(qt, kt, vt, gt, static_cast<Tin*>(dq), static_cast<Tin*>(dk),
                                  static_cast<Tin*>(dv), ws, bh, n, f, m, stream);
}

template <typename Tin>
cudaError_t full_state_typed(const void* k, const void* v, const bool* keep, int64_t heads,
                             float* state, float* ws, int64_t bh, int64_t n, int64_t f,
                             int64_t m, cudaStream_t stream) {
  cudaError_t err = launch_states<Tin, float>(
      static_cast<const Tin*>(k), static_cast<const Tin*>(v), keep, heads, ws, nullptr, nullptr,
      bh, n, f, m, kReduceRows / kChunk, false, true, false, stream);
  if (err != cudaSuccess) return err;
  return launch_scan(ws, state, bh, cdiv(n, kReduceRows), f * m + f, kSum, stream);
}

template <typename Tin>
cudaError_t full_apply_typed(const void* q, const float* state, void* out, bool out_fp32,
                             float* den, bool normalize, float eps, int64_t bh, int64_t n,
                             int64_t f, int64_t m, cudaStream_t stream) {
  const Tin* qt = static_cast<const Tin*>(q);
  const int64_t ss = f * m + f;
  if (out_fp32) {
    return launch_output<Tin, float, float>(qt, nullptr, nullptr, state, ss, state + f * m, ss,
                                            nullptr, 1, static_cast<float*>(out), den, bh, n, f,
                                            m, kFull, normalize, eps, stream);
  }
  return launch_output<Tin, float, Tin>(qt, nullptr, nullptr, state, ss, state + f * m, ss,
                                        nullptr, 1, static_cast<Tin*>(out), den, bh, n, f, m,
                                        kFull, normalize, eps, stream);
}

template <typename Tin>
cudaError_t cumsum_typed(const void* x, const float* pre, const float* post, float* out,
                         float* ws, int64_t bh, int64_t n, int64_t f, bool reverse,
                         cudaStream_t stream) {
  const Tin* xt = static_cast<const Tin*>(x);
  const int64_t nc = cdiv(n, kTile);
  const int64_t blocks = bh * nc;
  const int64_t cols = cdiv(f, kSumThreads);
  if (blocks > kMaxBlocks || cols > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(cols));
  KS_LAUNCH(chunk_colsum_kernel<Tin>, grid, kSumThreads, 0, stream)(xt, pre, ws, n, f);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = launch_scan(ws, nullptr, bh, nc, f, reverse ? kExclusiveReverse : kExclusiveForward,
                    stream);
  if (err != cudaSuccess) return err;
  KS_LAUNCH(chunk_cumsum_kernel<Tin>, grid, kSumThreads, 0, stream)(xt, pre, post, ws, out, n,
                                                                    f, reverse);
  return cudaGetLastError();
}

}  // namespace

// ------------------------------------------------------------------ entry points
int64_t causal_workspace_floats(DType dtype, int64_t bh, int64_t n, int64_t f, int64_t m,
                                int64_t walk_blocks, bool mma_walk) {
  const bool bf16 = dtype == DType::kBFloat16;  // fp32 and fp16 inputs have fp32 operands
  const Walk walk = bf16 ? causal_walk<__nv_bfloat16>(f, walk_blocks, mma_walk)
                         : causal_walk<float>(f, walk_blocks, mma_walk);
  if (walk != Walk::kNone) return walk_layout(bh, n, f, m, walk_blocks, cdiv(m, kTile)).floats;
  return causal_layout(bh, n, f, m, bf16 ? sizeof(__nv_bfloat16) : sizeof(float)).floats;
}

cudaError_t causal_product(DType dtype, const void* q, const void* k, const void* v, void* out,
                           bool out_fp32, float* den, bool normalize, float eps, float* workspace,
                           int64_t bh, int64_t n, int64_t f, int64_t m, bool reverse,
                           int64_t walk_blocks, bool mma_walk, cudaStream_t stream) {
  if (bh <= 0 || n <= 0 || m <= 0) return cudaSuccess;
  if (f <= 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return causal_typed<float>(q, k, v, out, out_fp32, den, normalize, eps, workspace, bh, n, f,
                                 m, reverse, walk_blocks, mma_walk, stream);
    case DType::kFloat16:
      return causal_typed<__half>(q, k, v, out, out_fp32, den, normalize, eps, workspace, bh, n,
                                  f, m, reverse, walk_blocks, mma_walk, stream);
    case DType::kBFloat16:
      return causal_typed<__nv_bfloat16>(q, k, v, out, out_fp32, den, normalize, eps, workspace,
                                         bh, n, f, m, reverse, walk_blocks, mma_walk, stream);
  }
  return cudaErrorInvalidValue;
}

int64_t causal_backward_workspace_floats(DType dtype, int64_t bh, int64_t n, int64_t f,
                                         int64_t m, int64_t walk_blocks, bool mma_walk) {
  if (walk_blocks <= 0) return 2 * causal_workspace_floats(dtype, bh, n, f, m, 0, false);
  // the steps of walk_backward_typed run one after another on one workspace
  const int64_t dq_dk = causal_workspace_floats(dtype, bh, n, m, f, walk_blocks, mma_walk);
  const int64_t dv = causal_workspace_floats(dtype, bh, n, f, m, walk_blocks, mma_walk);
  const int64_t dkv = walk_layout(bh, n, f, m, walk_blocks, 1).floats;
  return std::max({dq_dk, dv, dkv});
}

cudaError_t causal_backward(DType dtype, const void* q, const void* k, const void* v,
                            const void* g, void* dq, void* dk, void* dv, bool out_fp32,
                            float* workspace, int64_t bh, int64_t n, int64_t f, int64_t m,
                            int64_t walk_blocks, bool mma_walk, cudaStream_t stream) {
  if (bh <= 0 || n <= 0) return cudaSuccess;
  if (f <= 0 || m <= 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return causal_backward_typed<float>(q, k, v, g, dq, dk, dv, out_fp32, workspace, bh, n, f,
                                          m, walk_blocks, mma_walk, stream);
    case DType::kFloat16:
      return causal_backward_typed<__half>(q, k, v, g, dq, dk, dv, out_fp32, workspace, bh, n, f,
                                           m, walk_blocks, mma_walk, stream);
    case DType::kBFloat16:
      return causal_backward_typed<__nv_bfloat16>(q, k, v, g, dq, dk, dv, out_fp32, workspace, bh,
                                                  n, f, m, walk_blocks, mma_walk, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t walk_kernels(DType dtype, int64_t f, int64_t m, bool mma_walk, WalkKernels* out) {
  *out = WalkKernels{};
  if (f <= 0 || m <= 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return walk_kernels_typed<float>(f, m, mma_walk, out);
    case DType::kFloat16:
      return walk_kernels_typed<__half>(f, m, mma_walk, out);
    case DType::kBFloat16:
      return walk_kernels_typed<__nv_bfloat16>(f, m, mma_walk, out);
  }
  return cudaErrorInvalidValue;
}

int64_t full_state_workspace_floats(int64_t bh, int64_t n, int64_t f, int64_t m) {
  return bh * cdiv(n, kReduceRows) * (f * m + f);
}

cudaError_t full_state(DType dtype, const void* k, const void* v, const bool* key_keep,
                       int64_t heads, float* state, float* workspace, int64_t bh, int64_t n,
                       int64_t f, int64_t m, cudaStream_t stream) {
  if (bh <= 0) return cudaSuccess;
  if (f <= 0 || m <= 0 || heads <= 0) return cudaErrorInvalidValue;
  if (n <= 0) {
    return cudaMemsetAsync(state, 0, sizeof(float) * bh * (f * m + f), stream);
  }
  switch (dtype) {
    case DType::kFloat32:
      return full_state_typed<float>(k, v, key_keep, heads, state, workspace, bh, n, f, m,
                                     stream);
    case DType::kFloat16:
      return full_state_typed<__half>(k, v, key_keep, heads, state, workspace, bh, n, f, m,
                                      stream);
    case DType::kBFloat16:
      return full_state_typed<__nv_bfloat16>(k, v, key_keep, heads, state, workspace, bh, n, f,
                                             m, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t full_apply(DType dtype, const void* q, const float* state, void* out, bool out_fp32,
                       float* den, bool normalize, float eps, int64_t bh, int64_t n, int64_t f,
                       int64_t m, cudaStream_t stream) {
  if (bh <= 0 || n <= 0 || m <= 0) return cudaSuccess;
  if (f <= 0) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kFloat32:
      return full_apply_typed<float>(q, state, out, out_fp32, den, normalize, eps, bh, n, f, m,
                                     stream);
    case DType::kFloat16:
      return full_apply_typed<__half>(q, state, out, out_fp32, den, normalize, eps, bh, n, f, m,
                                      stream);
    case DType::kBFloat16:
      return full_apply_typed<__nv_bfloat16>(q, state, out, out_fp32, den, normalize, eps, bh, n,
                                             f, m, stream);
  }
  return cudaErrorInvalidValue;
}

int64_t cumsum_workspace_floats(int64_t bh, int64_t n, int64_t f) {
  return bh * cdiv(n, kTile) * f;
}

cudaError_t scaled_cumsum(DType dtype, const void* x, const float* pre, const float* post,
                          float* out, float* workspace, int64_t bh, int64_t n, int64_t f,
                          bool reverse, cudaStream_t stream) {
  if (bh <= 0 || n <= 0 || f <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return cumsum_typed<float>(x, pre, post, out, workspace, bh, n, f, reverse, stream);
    case DType::kFloat16:
      return cumsum_typed<__half>(x, pre, post, out, workspace, bh, n, f, reverse, stream);
    case DType::kBFloat16:
      return cumsum_typed<__nv_bfloat16>(x, pre, post, out, workspace, bh, n, f, reverse,
                                         stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ks_cuda
