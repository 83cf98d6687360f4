// Shim of CUDA's WMMA header for tests/cuda_emulator (see ks_emulator.h): every lane holds a
// fragment's whole tile (row-major) and products accumulate in float (once per warp:
// ks_emu::warp_product: the first lane to reach a product computes it from its copies). A store
// is no barrier: each lane writes its share of the tile, the elements e with e % 32 == lane, as
// a real fragment's elements are spread over the lanes. A lane that runs ahead so overwrites its
// share while the others may still read the old tile, and the tile is whole only once every lane
// has stored: a __syncwarp() missing on either side of a store shows up. (A lane that loads a
// tile after another lane stored its share gets a mixed copy, but only where it reaches no
// product first: in the kernels a tile is stored only after the products that read it.)
// Below WMMA: ldmatrix and mma.sync, lane by lane in the PTX ISA's register layouts (the
// .cu's hooks KS_HOST_LDMATRIX_X4, KS_HOST_MMA_BF16 and KS_HOST_MMA_TF32).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_bf16.h"
#include "ks_emulator.h"

namespace nvcuda {
namespace wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision {
struct tf32 {};
}  // namespace precision
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K>
struct Shape;
template <int M, int N, int K>
struct Shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct Shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct Shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

template <typename T>
struct Storage {
  using type = T;
};
template <>
struct Storage<precision::tf32> {
  using type = float;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  using storage_element_type = typename Storage<T>::type;
  static constexpr int rows = Shape<Use, M, N, K>::rows;
  static constexpr int cols = Shape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  storage_element_type x[num_elements];
};

inline float as_float(float v) { return v; }
inline float as_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Rounds to tf32 (10 mantissa bits), to nearest.
inline float __float_to_tf32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// WMMA's pointer must be 256-bit aligned and its leading dimension a multiple of 16 bytes.
template <typename E>
void check_tile(const E* p, unsigned ldm) {
  ks_emu::check_aligned(p, 32, "wmma: tile pointer not 32-byte aligned");
  if (ldm * sizeof(E) % 16 != 0) ks_emu::fail("wmma: leading dimension not a multiple of 16 bytes");
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename P>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& a, const P* p, unsigned ldm) {
  static_assert(!std::is_same_v<Layout, void>, "operand fragments carry their layout");
  using F = fragment<Use, M, N, K, T, Layout>;
  check_tile(p, ldm);
  for (int r = 0; r < F::rows; ++r) {
    for (int c = 0; c < F::cols; ++c) {
      a.x[r * F::cols + c] = std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r];
    }
  }
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& a, const float* p, unsigned ldm,
                      layout_t layout) {
  check_tile(p, ldm);
  for (int r = 0; r < M; ++r) {
    for (int c = 0; c < N; ++c) {
      a.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
    }
  }
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& a, unsigned ldm,
                       layout_t layout) {
  check_tile(p, ldm);
  for (int e = ks_emu::lane(); e < M * N; e += 32) {
    const int r = e / N, c = e % N;
    (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = a.x[e];
  }
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& a, float value) {
  for (auto& e : a.x) e = value;
}

// A tf32 operand must hold tf32 values (rounded with __float_to_tf32, or cut by tf32_split): the
// GPU ignores the low 13 bits of an fp32 operand, so an unrounded one would be truncated there
// and kept whole here.
inline void check_tf32(const float* x, int count,
                       const char* what = "wmma: a tf32 operand not rounded with __float_to_tf32") {
  for (int i = 0; i < count; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    if ((u & 0x7f800000u) != 0x7f800000u && (u & 0x1fffu) != 0) {
      ks_emu::fail(what);
    }
  }
}

template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d,
              const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  float out[M * N];
  ks_emu::warp_product(out, M * N, [&](float* o) {  // on the copies of the lane that computes
    if constexpr (std::is_same_v<T, precision::tf32>) {
      check_tf32(a.x, M * K);
      check_tf32(b.x, K * N);
    }
    float fa[M * K], fb[N * K];  // b transposed: both walked along k
    for (int i = 0; i < M * K; ++i) fa[i] = as_float(a.x[i]);
    for (int t = 0; t < K; ++t) {
      for (int j = 0; j < N; ++j) fb[j * K + t] = as_float(b.x[t * N + j]);
    }
    for (int i = 0; i < M; ++i) {
      for (int j = 0; j < N; ++j) {
        double s = c.x[i * N + j];
        for (int t = 0; t < K; ++t) s += double(fa[i * K + t]) * fb[j * K + t];
        o[i * N + j] = ks_emu::tensor_core_sum(s);
      }
    }
  });
  std::memcpy(d.x, out, sizeof(out));
}

}  // namespace wmma
}  // namespace nvcuda

// ------------------------------------------------------------------ mma.sync (kernels 8, 9)
namespace ks_emu {

inline uint16_t bits16(const uint32_t (&row)[6], int element) {
  uint16_t u;
  std::memcpy(&u, reinterpret_cast<const unsigned char*>(row) + 2 * element, 2);
  return u;
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane 8i + r gives row r of matrix i (eight
// 16-bit elements at a 16-byte aligned address); register i of lane l = 4g + t receives row g,
// elements 2t and 2t+1 (trans: elements g of rows 2t and 2t+1), the lower in the low half.
// A lane posts its row's 16 bytes as they are when it reaches the instruction: a row that other
// lanes store without a __syncwarp() before it is read stale, as a WMMA tile is (see above).
inline void ldmatrix_x4(uint32_t (&regs)[4], const void* row, bool trans) {
  check_aligned(row, 16, "ldmatrix: row address not 16-byte aligned");
  Posted mine;
  std::memcpy(mine.reg, row, 16);
  const Collective c(mine);
  const int l = lane(), g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;
    if (trans) {
      lo = bits16(c.posted(8 * i + 2 * t).reg, g);
      hi = bits16(c.posted(8 * i + 2 * t + 1).reg, g);
    } else {
      lo = bits16(c.posted(8 * i + g).reg, 2 * t);
      hi = bits16(c.posted(8 * i + g).reg, 2 * t + 1);
    }
    regs[i] = lo | (hi << 16);
  }
}

// What a lane posts for mma.sync: A's four registers, then B's two.
inline Posted operands(const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  Posted mine;
  for (int i = 0; i < 4; ++i) mine.reg[i] = a[i];
  mine.reg[4] = b[0];
  mine.reg[5] = b[1];
  return mine;
}

// acc += this lane's elements of C = A B (c[0], c[1]: row g, columns 2t, 2t + 1; c[2], c[3]:
// row g + 8), A(row, k) and B(k, col) over k < K, summed as the tensor cores do
// (tensor_core_sum). The lane's two rows of A and two columns of B are read out of the posted
// registers once.
template <int K, typename FA, typename FB>
void accumulate(float (&acc)[4], const FA& A, const FB& B) {
  const int l = lane(), g = l / 4, t = l % 4;
  float a[2][K], b[2][K];
  for (int k = 0; k < K; ++k) {
    a[0][k] = A(g, k);
    a[1][k] = A(g + 8, k);
    b[0][k] = B(k, 2 * t);
    b[1][k] = B(k, 2 * t + 1);
  }
  for (int e = 0; e < 4; ++e) {
    const float* row = a[e / 2];
    const float* col = b[e % 2];
    double s = acc[e];
    for (int k = 0; k < K; ++k) s += double(row[k]) * col[k];
    acc[e] = tensor_core_sum(s);
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, acc += A B with the PTX ISA's fragments
// (csrc/cuda/mma_sync.cuh); the products of bf16 are exact, summed as the tensor cores do.
inline void mma_bf16(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const Collective c(operands(a, b));
  const auto half = [](uint32_t u, int h) {
    return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(h ? u >> 16 : u & 0xffffu)});
  };
  const auto A = [&](int row, int col) {  // 16 x 16
    const int reg = (row < 8 ? 0 : 1) + (col < 8 ? 0 : 2);
    return half(c.posted((row % 8) * 4 + (col % 8) / 2).reg[reg], col % 2);
  };
  const auto B = [&](int k, int col) {  // 16 x 8
    return half(c.posted(col * 4 + (k % 8) / 2).reg[4 + (k < 8 ? 0 : 1)], k % 2);
  };
  accumulate<16>(acc, A, B);
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, acc += A B with the PTX ISA's fragments
// (csrc/cuda/mma_sync.cuh): A (16 x 8) a[0] = A[g][t], a[1] = A[g+8][t],
// a[2] = A[g][t+4], a[3] = A[g+8][t+4]; B (8 x 8) b[0] = B[t][g], b[1] = B[t+4][g]. Every
// operand register must hold a tf32 value (the GPU ignores the low 13 bits); the products are
// exact, summed as the tensor cores do.
inline void mma_tf32(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const Posted mine = operands(a, b);
  float x[6];
  std::memcpy(x, mine.reg, sizeof(x));
  nvcuda::wmma::check_tf32(x, 6, "mma.sync: a tf32 operand not rounded (cvt.rna.tf32.f32)");
  const Collective c(mine);
  const auto value = [](uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  };
  const auto A = [&](int row, int col) {  // 16 x 8
    return value(c.posted((row % 8) * 4 + col % 4).reg[(row < 8 ? 0 : 1) + (col < 4 ? 0 : 2)]);
  };
  const auto B = [&](int k, int col) {  // 8 x 8
    return value(c.posted(col * 4 + k % 4).reg[4 + (k < 4 ? 0 : 1)]);
  };
  accumulate<8>(acc, A, B);
}

}  // namespace ks_emu

#define KS_HOST_LDMATRIX_X4(regs, ptr, trans) ::ks_emu::ldmatrix_x4(regs, ptr, trans)
#define KS_HOST_MMA_BF16(acc, a, b) ::ks_emu::mma_bf16(acc, a, b)
#define KS_HOST_MMA_TF32(acc, a, b) ::ks_emu::mma_tf32(acc, a, b)
