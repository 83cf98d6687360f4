// Moving 64 x 64 tiles between global and shared memory: cp.async, load_tile (with zero
// fill and conversion to the operand type), store_tile and store_output (with the normalizer),
// and the causal mask of a chunk's scores in shared memory.
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "config.cuh"

namespace ks_cuda {
namespace {

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

// ------------------------------------------------------------------ global -> shared tiles
// How many of a tile's 64 rows (columns) lie inside a matrix that has `left` of them from the
// tile's first on (0 where left <= 0).
__device__ __forceinline__ int extent_in(int64_t left) {
  return static_cast<int>(left < 0 ? 0 : (left < kTile ? left : kTile));
}

// How a block's threads cover a 64 x 64 tile of Tin in 16-byte vectors: thread t moves columns
// col() .. col() + V - 1 of rows row(pass), pass = 0 .. kPasses - 1.
template <typename Tin>
struct TileVectors {
  static constexpr int V = 16 / sizeof(Tin);  // elements per vector: 4 (fp32) or 8 (16-bit)
  static constexpr int kVecPerRow = kTile / V;
  static constexpr int kRowsPerPass = kThreads / kVecPerRow;
  static constexpr int kPasses = kTile / kRowsPerPass;
  static_assert(kThreads % kVecPerRow == 0 && kTile % kRowsPerPass == 0, "whole rows per pass");
  static __device__ __forceinline__ int col() { return (threadIdx.x % kVecPerRow) * V; }
  static __device__ __forceinline__ int row(int pass) {
    return threadIdx.x / kVecPerRow + pass * kRowsPerPass;
  }
};

// Whether Tin's tiles load in two halves (fetch_vectors, land_vectors): those that convert in
// registers and so cannot go by cp.async (fp16 inputs on fp32 tiles, 16-bit k beside fp32 v,
// fp32 states into bf16 tiles). Each thread issues all its loads of a tile, or of several
// (TileBatch), before it converts the first: one trip to memory rather than one a vector (the
// fp16 walks ran 4x slower than bf16's on an H200, 8.6 against 2.2 us a chunk, their threads
// waiting on each of a chunk's six loads in turn).
template <typename Tin, typename Op>
constexpr bool kFetchFirst = !std::is_same_v<Tin, Op>;

// load_tile's arguments as one value, for the two halves of a copy that converts in registers.
template <typename Tin, typename Op>
struct TileCopy {
  Op* dst;
  int ldd;
  const Tin* src;
  int64_t ld, rows, cols, row0, col0;
  const bool* keep;
  bool vec;
  const float* add;
};

// A thread's loaded vectors of a tile that converts in registers, and which of its rows are kept
// (bit `pass`).
template <typename Tin>
struct FetchedVectors {
  uint4 raw[TileVectors<Tin>::kPasses];
  unsigned kept;
};

// The first half of a converted tile's copy: this thread's 16-byte loads, issued without waiting
// for them (rows outside the matrix and vectors past a ragged edge or off 16 bytes are left to
// land_vectors), with the keep flags of its rows. From the tile's corner on, offsets and bounds
// are 32-bit: ld < 2^24 (checked by the binding).
template <typename Tin, typename Op>
__device__ __forceinline__ void fetch_vectors(const TileCopy<Tin, Op>& t, FetchedVectors<Tin>& x) {
  using L = TileVectors<Tin>;
  const Tin* src = t.src + t.row0 * t.ld + t.col0;
  const int in_rows = extent_in(t.rows - t.row0), in_cols = extent_in(t.cols - t.col0);
  const int c = L::col();
  const bool vec_ok = t.vec && c + L::V <= in_cols;
  x.kept = ~0u;
#pragma unroll
  for (int pass = 0; pass < L::kPasses; ++pass) {
    const int r = L::row(pass);
    x.raw[pass] = uint4{};
    if (r >= in_rows) continue;
    if (t.keep != nullptr && !t.keep[t.row0 + r]) x.kept &= ~(1u << pass);
    if (vec_ok) x.raw[pass] = *reinterpret_cast<const uint4*>(src + r * static_cast<int>(t.ld) + c);
  }
}

// The second half: converts this thread's vectors (loading element by element where
// fetch_vectors did not), adds `add`, and stores them into the shared tile.
template <typename Tin, typename Op>
__device__ __forceinline__ void land_vectors(const TileCopy<Tin, Op>& t,
                                             const FetchedVectors<Tin>& x) {
  static_assert(kFetchFirst<Tin, Op>, "a tile that converts");
  using L = TileVectors<Tin>;
  constexpr int V = L::V;
  // 8 (fp32 -> bf16) or 32 (16-bit -> fp32) bytes, aligned to at most 16: rows of fp32 tiles
  // are 16-byte aligned only (32 bytes are stored as two 16-byte vectors)
  struct alignas(sizeof(Op) * V < 16 ? sizeof(Op) * V : 16) Pack {
    Op e[V];
  };
  const int64_t corner = t.row0 * t.ld + t.col0;
  const Tin* src = t.src + corner;
  const float* add = t.add == nullptr ? nullptr : t.add + corner;
  const int in_rows = extent_in(t.rows - t.row0), in_cols = extent_in(t.cols - t.col0);
  const int c = L::col();
  const bool vec_ok = t.vec && c + V <= in_cols;
#pragma unroll
  for (int pass = 0; pass < L::kPasses; ++pass) {
    const int r = L::row(pass);
    const int at = r * static_cast<int>(t.ld) + c;  // element (r, c) from the corner
    const bool row_ok = r < in_rows && ((x.kept >> pass) & 1u);
    float y[V];
    if (row_ok && vec_ok) {
      const Tin* e = reinterpret_cast<const Tin*>(&x.raw[pass]);
#pragma unroll
      for (int u = 0; u < V; ++u) y[u] = to_float(e[u]);
    } else {
#pragma unroll
      for (int u = 0; u < V; ++u) y[u] = (row_ok && c + u < in_cols) ? to_float(src[at + u]) : 0.f;
    }
    if (add != nullptr && row_ok) {
#pragma unroll
      for (int u = 0; u < V; ++u) {
        if (c + u < in_cols) y[u] += add[at + u];
      }
    }
    Pack p;
#pragma unroll
    for (int u = 0; u < V; ++u) p.e[u] = from_float<Op>(y[u]);
    *reinterpret_cast<Pack*>(t.dst + r * t.ldd + c) = p;
  }
}

// Copies rows [row0, row0+64) x columns [col0, col0+64) of a row-major global matrix
// (rows x cols, leading dimension ld) into a 64 x 64 shared tile (leading dimension ldd),
// converted to Op. Elements outside the matrix, and rows whose `keep` flag is false (keep indexed
// by the matrix's rows), are zero. `add` (optional): an fp32 matrix of the same shape and leading
// dimension added on the way (the carry of earlier segments onto a block-local state prefix).
// Each thread moves 16-byte vectors; `vec` says the global rows are 16-byte aligned. Where no
// conversion or addition is needed (Tin == Op: bf16 and fp32 inputs), whole in-range vectors
// are copied with cp.async: the caller calls cp_async_wait_all() before the __syncthreads()
// that publishes the tile; zero fill is stored directly. Tiles that convert (Tin != Op) load in
// two halves (kFetchFirst).
template <typename Tin, typename Op>
__device__ __forceinline__ void load_tile(Op* __restrict__ dst, int ldd,
                                          const Tin* __restrict__ src, int64_t ld, int64_t rows,
                                          int64_t cols, int64_t row0, int64_t col0,
                                          const bool* __restrict__ keep, bool vec,
                                          const float* __restrict__ add = nullptr) {
  if constexpr (kFetchFirst<Tin, Op>) {
    const TileCopy<Tin, Op> t{dst, ldd, src, ld, rows, cols, row0, col0, keep, vec, add};
    FetchedVectors<Tin> x;
    fetch_vectors(t, x);
    land_vectors(t, x);
  } else {  // Tin == Op
    using L = TileVectors<Tin>;
    constexpr int V = L::V;
    struct alignas(16) Pack {
      Op e[V];
    };
    // From the tile's corner on, offsets and bounds are 32-bit: ld < 2^24 (checked by the
    // binding).
    const int64_t corner = row0 * ld + col0;
    src += corner;
    if (add != nullptr) add += corner;
    if (keep != nullptr) keep += row0;
    const int in_rows = extent_in(rows - row0), in_cols = extent_in(cols - col0);
    const int c = L::col();
    const bool vec_ok = vec && c + V <= in_cols;
#pragma unroll
    for (int pass = 0; pass < L::kPasses; ++pass) {
      const int r = L::row(pass);
      const int at = r * static_cast<int>(ld) + c;  // element (r, c) from the corner
      const bool row_ok = r < in_rows && (keep == nullptr || keep[r]);
      if (row_ok && vec_ok && add == nullptr) {
        cp_async16(dst + r * ldd + c, src + at);
        continue;
      }
      float x[V];  // zero fill, a ragged edge, rows off 16 bytes, or the carry added
      if (row_ok && vec_ok) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src + at);
        const Tin* e = reinterpret_cast<const Tin*>(&raw);
#pragma unroll
        for (int u = 0; u < V; ++u) x[u] = to_float(e[u]);
      } else {
#pragma unroll
        for (int u = 0; u < V; ++u) {
          x[u] = (row_ok && c + u < in_cols) ? to_float(src[at + u]) : 0.f;
        }
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
}

// N tiles of one type loaded together: load(i, ...) for each i in 0 .. N - 1 (load_tile's
// arguments), then land(). Where the tiles load in two halves (kFetchFirst), load() issues the
// tile's loads and land() converts and stores every tile, so that all N tiles' loads are in
// flight at once (a walk's chunk of fp16 Q, K, V: six 16-byte loads a thread rather than one);
// elsewhere load() is load_tile and land() does nothing.
template <typename Tin, typename Op, int N>
class TileBatch {
 public:
  __device__ __forceinline__ void load(int i, Op* dst, int ldd, const Tin* src, int64_t ld,
                                       int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                                       const bool* keep, bool vec) {
    if constexpr (kFetchFirst<Tin, Op>) {
      held_.copy[i] = {dst, ldd, src, ld, rows, cols, row0, col0, keep, vec, nullptr};
      fetch_vectors(held_.copy[i], held_.x[i]);
    } else {
      load_tile(dst, ldd, src, ld, rows, cols, row0, col0, keep, vec);
    }
  }
  __device__ __forceinline__ void land() {
    if constexpr (kFetchFirst<Tin, Op>) {
#pragma unroll
      for (int i = 0; i < N; ++i) land_vectors(held_.copy[i], held_.x[i]);
    }
  }

 private:
  struct Held {
    TileCopy<Tin, Op> copy[N];
    FetchedVectors<Tin> x[N];
  };
  struct Nothing {};
  std::conditional_t<kFetchFirst<Tin, Op>, Held, Nothing> held_;
};

template <typename T>
__host__ __device__ constexpr int vec_elems() {
  return 16 / sizeof(T);
}

// Writes a 64 x 64 fp32 shared tile (ld kLdF) to rows [row0, row0+64) x columns [col0, col0+64)
// of a row-major global matrix (rows x cols, leading dimension ld) in T, skipping what lies
// outside it; with `div`, row r is multiplied by 1 / (div[r] + eps) (the normalizer); with
// `bias` (cols floats), bias[col] is added to every row; rows r whose keep[r] is false (keep
// from the tile's first row on) are written as zeros. Each thread writes whole 16-byte vectors
// where the destination allows (the same choice in every thread), single elements at a ragged
// edge.
template <typename T>
__device__ __forceinline__ void store_tile(T* __restrict__ dst, int64_t ld, int64_t rows,
                                           int64_t cols, int64_t row0, int64_t col0,
                                           const float* __restrict__ tile,
                                           const float* __restrict__ div = nullptr,
                                           float eps = 0.f,
                                           const float* __restrict__ bias = nullptr,
                                           const bool* __restrict__ keep = nullptr) {
  constexpr int V = vec_elems<T>();
  struct alignas(16) Pack {
    T e[V];
  };
  const bool vec = reinterpret_cast<uintptr_t>(dst) % 16 == 0 && ld % V == 0 && col0 % V == 0;
  // from the tile's corner on, 32-bit offsets and bounds (ld < 2^24, checked by the binding)
  dst += row0 * ld + col0;
  const int in_rows = extent_in(rows - row0), in_cols = extent_in(cols - col0);
  // a thread's columns are the same in every row it writes: its bias is loaded once
  static_assert(kThreads % (kTile / V) == 0, "a thread keeps its columns");
  float add[V] = {};
  if (bias != nullptr) {
    const int c = (threadIdx.x % (kTile / V)) * V;
#pragma unroll
    for (int u = 0; u < V; ++u) add[u] = c + u < in_cols ? bias[col0 + c + u] : 0.f;
  }
  for (int i = threadIdx.x; i < kTile * (kTile / V); i += kThreads) {
    const int r = i / (kTile / V), c = (i % (kTile / V)) * V;
    if (r >= in_rows) continue;
    const float inv = div == nullptr ? 1.f : 1.f / (div[r] + eps);  // one division a vector
    const bool zero = keep != nullptr && !keep[r];
    const float* x = tile + r * kLdF + c;
    T* out = dst + r * static_cast<int>(ld) + c;
    // element u of the vector, as it is stored
    auto value = [&](int u) {
      float y = div == nullptr ? x[u] : x[u] * inv;
      if (bias != nullptr) y += add[u];
      return from_float<T>(zero ? 0.f : y);
    };
    if (vec && c + V <= in_cols) {
      Pack p;
#pragma unroll
      for (int u = 0; u < V; ++u) p.e[u] = value(u);
      *reinterpret_cast<Pack*>(out) = p;
    } else {
      for (int u = 0; u < V && c + u < in_cols; ++u) out[u] = value(u);
    }
  }
}

// A chunk's output: rows [row0, row0+64) x the M slice [m0, m0+64) of sequence bh of out
// (BH, N, M) from the fp32 staging tile, divided by den + eps with `normalize`, plus `bias`
// (M floats) where given; and, from the blocks of M slice 0, den (BH, N) where it is wanted
// (dens: the chunk's 64 normalizers). Rows whose `keep` flag (from row0 on) is false are zeros.
template <typename Tout>
__device__ __forceinline__ void store_output(Tout* out, float* den, const float* tile,
                                             const float* dens, int64_t bh, int64_t n, int64_t m,
                                             int64_t row0, int64_t m0, bool normalize, float eps,
                                             const float* bias = nullptr,
                                             const bool* keep = nullptr) {
  store_tile(out + bh * n * m, m, n, m, row0, m0, tile, normalize ? dens : nullptr, eps, bias,
             keep);
  if (den != nullptr && m0 == 0 && threadIdx.x < kTile && row0 + threadIdx.x < n) {
    const bool zero = keep != nullptr && !keep[threadIdx.x];
    den[bh * n + row0 + threadIdx.x] = zero ? 0.f : dens[threadIdx.x];
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

}  // namespace
}  // namespace ks_cuda
