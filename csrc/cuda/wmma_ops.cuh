// Warp-level products on WMMA fragments (kernels 1-7): loads and stores of fragments in
// shared memory, the bf16, 1xTF32 and 3xTF32 steps (tf32_split), and a warp's 16 x 32 slab of
// a 64 x 64 product (warp_gemm).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "config.cuh"

namespace ks_cuda {
namespace {

// ------------------------------------------------------------------ warp-level MMA
// 3xTF32's split of an fp32 value x = big + small + r: big is x with the low 13 bits of its
// encoding cleared (a tf32 value, x rounded toward zero), small the same of x - big (exact in
// fp32), so |r| < 2^-20 |x|, and a b ~ big_a big_b + small_a big_b + big_a small_b lies
// within about 3 * 2^-20 of a b, far inside fp32 outputs' 1e-4. Two instructions a value where
// rounding to nearest (cvt.rna.tf32) takes several: with it, the fp32 kernels' chunk loops had
// 19-34% more instructions (static SASS, sm_90a) and more spills. Both parts are exact tf32
// values, so what a tensor core does with an operand's low bits never matters. Non-finite x keeps a
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
// Built with -DKS_WMMA_GENERIC_LOADS (KERNELSTUDY_CUDA_FLAGS), the kernels load through wmma's own
// calls again, as they did when they first passed on a GPU (2026-11-28): the fallback, and the A of
// an A/B of the two.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(KS_WMMA_GENERIC_LOADS)
#define KS_WMMA_SHARED_PTX 1
#else
#define KS_WMMA_SHARED_PTX 0
#endif
#if KS_WMMA_SHARED_PTX
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
#if KS_WMMA_SHARED_PTX
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
#if KS_WMMA_SHARED_PTX
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
#if KS_WMMA_SHARED_PTX
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
#undef KS_WMMA_SHARED_PTX
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
// fragments ("tiles" in linear_attention.cu).
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

// acc += part, element by element (fragments of one type hold their elements alike).
template <typename Acc>
__device__ __forceinline__ void add_fragments(Acc (&acc)[2], const Acc (&part)[2]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < part[j].num_elements; ++e) acc[j].x[e] += part[j].x[e];
  }
}

// acc += the warp's slab of A B, as warp_gemm, for a sum that runs over many chunks (a walk's
// state, a group's total). The tensor cores cut each product step's sum toward zero rather than
// round it, so a sum kept in the accumulators over a walk drifts toward zero by up to an ulp of
// itself a step: with 3xTF32's 24 steps a chunk, about 1e-4 of the state after 256 chunks, all
// of fp32's error budget (2.4e-4 between one and two segments of 512 chunks on the H200,
// 2026-11-30). For fp32 inputs the chunk's products therefore go to fresh accumulators, added
// to acc in fp32 (to nearest): the drift is then that of one chunk's sum. 16-bit inputs keep
// the plain sum (their tolerance is 1e-2; the drift stays near 1e-4).
template <typename Tin, typename LA, typename LB, typename Op = typename OperandOf<Tin>::type>
__device__ __forceinline__ void warp_gemm_sum(typename Mma<Op>::Acc (&acc)[2], const Op* A,
                                              int lda, const Op* B, int ldb) {
  if constexpr (kSplitOf<Tin>) {
    typename Mma<Op>::Acc part[2];
    wmma::fill_fragment(part[0], 0.f);
    wmma::fill_fragment(part[1], 0.f);
    warp_gemm<Tin, LA, LB>(part, A, lda, B, ldb);
    add_fragments(acc, part);
  } else {
    warp_gemm<Tin, LA, LB>(acc, A, lda, B, ldb);
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

}  // namespace
}  // namespace ks_cuda
