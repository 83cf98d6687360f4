// Shim of CUDA's WMMA header for tests/cuda_emulator (see ks_emulator.h): every lane holds a
// fragment's whole tile (row-major) and products accumulate in float (once per warp:
// ks_emu::warp_product: the first lane to reach a product computes it from its copies). A store
// is no barrier: each lane writes its share of the tile, the elements e with e % 32 == lane, as
// a real fragment's elements are spread over the lanes. A lane that runs ahead so overwrites its
// share while the others may still read the old tile, and the tile is whole only once every lane
// has stored: a __syncwarp() missing on either side of a store shows up. (A lane that loads a
// tile after another lane stored its share gets a mixed copy, but only where it reaches no
// product first: in the kernels a tile is stored only after the products that read it.)
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

// A tf32 operand must hold tf32 values (__float_to_tf32): the GPU ignores the low 13 bits of an
// fp32 operand, so an unrounded one would be truncated there and kept whole here.
inline void check_tf32(const float* x, int count) {
  for (int i = 0; i < count; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    if ((u & 0x7f800000u) != 0x7f800000u && (u & 0x1fffu) != 0) {
      ks_emu::fail("wmma: a tf32 operand not rounded with __float_to_tf32");
    }
  }
}

template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d,
              const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  if constexpr (std::is_same_v<T, precision::tf32>) {
    check_tf32(a.x, M * K);
    check_tf32(b.x, K * N);
  }
  float out[M * N];
  ks_emu::warp_product(out, M * N, [&](float* o) {
    float fa[M * K], fb[N * K];  // b transposed: both walked along k
    for (int i = 0; i < M * K; ++i) fa[i] = as_float(a.x[i]);
    for (int t = 0; t < K; ++t) {
      for (int j = 0; j < N; ++j) fb[j * K + t] = as_float(b.x[t * N + j]);
    }
    for (int i = 0; i < M; ++i) {
      for (int j = 0; j < N; ++j) {
        float s = 0.f;
        for (int t = 0; t < K; ++t) s += fa[i * K + t] * fb[j * K + t];
        o[i * N + j] = c.x[i * N + j] + s;
      }
    }
  });
  std::memcpy(d.x, out, sizeof(out));
}

}  // namespace wmma
}  // namespace nvcuda
