// mma.sync fragments of kernels 8 and 9: the PTX ISA's register layouts, ldmatrix, the
// m16n8k16 bf16 and m16n8k8 tf32 products, tf32 operands made once per k-step (TF32A), and
// bf16x3's split of fp32 pairs (bf16_split2).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "config.cuh"
#include "wmma_ops.cuh"

namespace ks_cuda {
namespace {

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

// Two floats rounded to bf16 (to nearest even) and packed, lo in the low half: one cvt.rn.bf16x2
// (pack_bf16 converts each apart).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// bf16x3's split of the fp32 pair (x0, x1), packed as pack_bf16x2 packs: x = big + small + r
// with big = x rounded to bf16 and small = x - big (exact in fp32) rounded to bf16, so
// |r| <= 2^-17 |x| (16 of fp32's 24 significant bits; tf32_split keeps 21).
__device__ __forceinline__ void bf16_split2(uint32_t x0, uint32_t x1, uint32_t& big,
                                            uint32_t& small) {
  const float a = bits_float(x0), b = bits_float(x1);
  big = pack_bf16x2(a, b);
  small = pack_bf16x2(a - bits_float(big << 16), b - bits_float(big & 0xffff0000u));
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

}  // namespace
}  // namespace ks_cuda
