// Causal linear-attention product on the CPU, in plain C++ with OpenMP (no torch).
//
//   out_i = sum_{j<=i} (q_i . k_j) v_j        q, k: (BH, N, F), v: (BH, N, M), row-major
//
// and, with `reverse`, the anti-causal product over j >= i (the backward pass needs both).
//
// Chunked algorithm: the sequence is cut into chunks of C rows. For chunk c,
//   out_c = tril(Q_c K_c^T) V_c + Q_c S,     S = sum over earlier chunks of K^T V  (F x M)
// Chunks are grouped into segments of a fixed number of rows; the state is kept as
// S = P + T, where P sums the states of earlier segments (in order) and T the earlier
// chunks of this segment. A sequence runs either serially or, when there are fewer
// sequences than threads, in three phases: every segment state in parallel, a prefix over
// segments, then every segment in parallel. Both schedules do the same floating-point
// operations in the same order, so results do not depend on the number of threads.
//
// Each chunk is packed into zero-padded buffers (rows to C, F and M to a multiple of the
// vector width), so every matrix product is on whole vectors and whole chunks. The products
// run on register-blocked micro-kernels: AVX2+FMA intrinsics where the compiler targets them
// (-march=native on x86-64), plain loops for the compiler to vectorize elsewhere.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace ks_cpu {

using idx = std::ptrdiff_t;

#ifndef KS_CHUNK
#define KS_CHUNK 64
#endif
constexpr idx kChunk = KS_CHUNK;   // rows per chunk
constexpr idx kSegmentChunks = 8;  // chunks per segment (fixed: keeps results thread-independent)

// ---------------------------------------------------------------- vectors of 32 bytes
// Vec<T>: load, store, splat (broadcast) and fma (acc + a * b) on 32 bytes of T.
#if defined(__AVX2__) && defined(__FMA__)
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int lanes = 8;
  using type = __m256;
  static type load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, type x) { _mm256_storeu_ps(p, x); }
  static type splat(const float* p) { return _mm256_broadcast_ss(p); }
  static type fma(type acc, type a, type b) { return _mm256_fmadd_ps(a, b, acc); }
  static void pin(type& x) { asm("" : "+x"(x)); }  // keep in a register (no load folding)
};
template <>
struct Vec<double> {
  static constexpr int lanes = 4;
  using type = __m256d;
  static type load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, type x) { _mm256_storeu_pd(p, x); }
  static type splat(const double* p) { return _mm256_broadcast_sd(p); }
  static type fma(type acc, type a, type b) { return _mm256_fmadd_pd(a, b, acc); }
  static void pin(type& x) { asm("" : "+x"(x)); }
};
#else  // portable fallback: small arrays the compiler may vectorize on its own
template <typename T>
struct Vec {
  static constexpr int lanes = 32 / sizeof(T);
  struct type {
    T x[lanes];
  };
  static type load(const T* p) {
    type r;
    std::memcpy(r.x, p, sizeof(r.x));
    return r;
  }
  static void store(T* p, type v) { std::memcpy(p, v.x, sizeof(v.x)); }
  static type splat(const T* p) {
    type r;
    for (int l = 0; l < lanes; ++l) r.x[l] = *p;
    return r;
  }
  static type fma(type acc, type a, type b) {
    for (int l = 0; l < lanes; ++l) acc.x[l] += a.x[l] * b.x[l];
    return acc;
  }
  static void pin(type&) {}
};
#endif

// ---------------------------------------------------------------- matrix products
// Fully unroll a loop of compile-time length (keeps accumulator arrays in registers).
#if defined(__clang__)
#define KS_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define KS_UNROLL _Pragma("GCC unroll 16")
#else
#define KS_UNROLL
#endif

// C[MR x NV*L] += A[MR x k] B[k x NV*L]; rows at strides lda, ldb, ldc.
template <typename T, int MR, int NV>
static inline void micro_kernel(idx k, const T* A, idx lda, const T* B, idx ldb, T* C, idx ldc) {
  using V = Vec<T>;
  using vec = typename V::type;
  constexpr int L = V::lanes;
  vec acc[MR][NV];
  KS_UNROLL for (int i = 0; i < MR; ++i) {
    KS_UNROLL for (int j = 0; j < NV; ++j) acc[i][j] = V::load(C + i * ldc + j * L);
  }
  for (idx p = 0; p < k; ++p) {
    vec b[NV];
    KS_UNROLL for (int j = 0; j < NV; ++j) {
      b[j] = V::load(B + p * ldb + j * L);
      V::pin(b[j]);
    }
    KS_UNROLL for (int i = 0; i < MR; ++i) {
      const vec a = V::splat(A + i * lda + p);
      KS_UNROLL for (int j = 0; j < NV; ++j) acc[i][j] = V::fma(acc[i][j], a, b[j]);
    }
  }
  KS_UNROLL for (int i = 0; i < MR; ++i) {
    KS_UNROLL for (int j = 0; j < NV; ++j) V::store(C + i * ldc + j * L, acc[i][j]);
  }
}

#ifndef KS_MR
#define KS_MR 4
#define KS_NV 3
#endif
constexpr int kMR = KS_MR;  // register block: kMR rows x kNV vectors of accumulators
constexpr int kNV = KS_NV;

// MR rows (MR <= kMR) of C[MR x n] (+)= A[MR x k] B[k x n]; n a multiple of the vector width.
template <typename T, int MR>
static void gemm_rows(idx n, idx k, const T* A, idx lda, const T* B, idx ldb, T* C, idx ldc) {
  constexpr int L = Vec<T>::lanes;
  idx j = 0;
  for (; j + kNV * L <= n; j += kNV * L)
    micro_kernel<T, MR, kNV>(k, A, lda, B + j, ldb, C + j, ldc);
  for (; j + 2 * L <= n; j += 2 * L)
    micro_kernel<T, MR, 2>(k, A, lda, B + j, ldb, C + j, ldc);
  for (; j < n; j += L) micro_kernel<T, MR, 1>(k, A, lda, B + j, ldb, C + j, ldc);
}

// The last m < kMR rows of a product: dispatch to the kernel of R = m rows.
template <typename T, int R>
static void gemm_tail(idx m, idx n, idx k, const T* A, idx lda, const T* B, idx ldb, T* C,
                      idx ldc) {
  if constexpr (R > 0) {
    if (m == R) return gemm_rows<T, R>(n, k, A, lda, B, ldb, C, ldc);
    gemm_tail<T, R - 1>(m, n, k, A, lda, B, ldb, C, ldc);
  }
}

// C[m x n] += A[m x k] B[k x n] (n a multiple of the vector width).
template <typename T>
static void gemm(idx m, idx n, idx k, const T* A, idx lda, const T* B, idx ldb, T* C, idx ldc) {
  idx i = 0;
  for (; i + kMR <= m; i += kMR) gemm_rows<T, kMR>(n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  gemm_tail<T, kMR - 1>(m - i, n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
}

static inline idx round_up(idx x, idx to) { return (x + to - 1) / to * to; }

// ---------------------------------------------------------------- one sequence
// Problem sizes and the buffers of one worker. Rows are "virtual": with `reverse`, virtual
// row r is row N-1-r of the inputs, which turns the anti-causal product into a causal one.
template <typename T>
struct Sequence {
  const T* q;  // (N, F)
  const T* k;  // (N, F)
  const T* v;  // (N, M)
  T* out;      // (N, M)
  idx n, f, m;
  bool reverse;

  const T* row(const T* base, idx r, idx width) const {
    return base + (reverse ? n - 1 - r : r) * width;
  }
  T* out_row(idx r) const { return out + (reverse ? n - 1 - r : r) * m; }
};

template <typename T>
struct Workspace {
  idx fp, mp;                // F, M padded to the vector width
  std::vector<T> qc;         // (C, fp)  queries of the chunk
  std::vector<T> kt;         // (fp, C)  keys of the chunk, transposed
  std::vector<T> vc;         // (C, mp)  values of the chunk
  std::vector<T> scores;     // (C, C)   tril(Q_c K_c^T)
  std::vector<T> oc;         // (C, mp)  output of the chunk
  std::vector<T> state;      // (fp, mp) T: earlier chunks of this segment
  std::vector<T> total;      // (fp, mp) P + T

  Workspace(idx f, idx m)
      : fp(round_up(f, Vec<T>::lanes)),
        mp(round_up(m, Vec<T>::lanes)),
        qc(kChunk * fp),
        kt(fp * kChunk),
        vc(kChunk * mp),
        scores(kChunk * kChunk),
        oc(kChunk * mp),
        state(fp * mp),
        total(fp * mp) {}
};

// Copy rows c0 .. c0+C of k and v (zero past the end, past F and past M) into kt and vc.
template <typename T>
static void pack_keys_values(const Sequence<T>& s, Workspace<T>& w, idx c0) {
  const idx rows = std::min(kChunk, s.n - c0);
  std::fill(w.kt.begin(), w.kt.end(), T(0));
  std::fill(w.vc.begin(), w.vc.end(), T(0));
  for (idx r = 0; r < rows; ++r) {
    const T* kr = s.row(s.k, c0 + r, s.f);
    for (idx x = 0; x < s.f; ++x) w.kt[x * kChunk + r] = kr[x];
    std::memcpy(&w.vc[r * w.mp], s.row(s.v, c0 + r, s.m), s.m * sizeof(T));
  }
}

template <typename T>
static void pack_queries(const Sequence<T>& s, Workspace<T>& w, idx c0) {
  const idx rows = std::min(kChunk, s.n - c0);
  std::fill(w.qc.begin(), w.qc.end(), T(0));
  for (idx r = 0; r < rows; ++r)
    std::memcpy(&w.qc[r * w.fp], s.row(s.q, c0 + r, s.f), s.f * sizeof(T));
}

// T += K_c^T V_c (uses the packed kt, vc).
template <typename T>
static void update_state(Workspace<T>& w) {
  gemm<T>(w.fp, w.mp, kChunk, w.kt.data(), kChunk, w.vc.data(), w.mp, w.state.data(), w.mp);
}

// Output of the chunk at c0 given the packed chunk and `total` = P + T.
template <typename T>
static void chunk_output(const Sequence<T>& s, Workspace<T>& w, idx c0) {
  constexpr idx L = Vec<T>::lanes;
  const idx fp = w.fp, mp = w.mp;
  // O_c = Q_c (P + T)
  std::fill(w.oc.begin(), w.oc.end(), T(0));
  gemm<T>(kChunk, mp, fp, w.qc.data(), fp, w.total.data(), mp, w.oc.data(), mp);
  // O_c += tril(Q_c K_c^T) V_c, a block of kMR rows at a time, skipping blocks above the diagonal
  for (idx i0 = 0; i0 < kChunk; i0 += kMR) {
    const idx i1 = std::min(i0 + kMR, kChunk);  // rows i0 .. i1 see keys 0 .. i1-1
    const idx cols = round_up(i1, L);
    T* sc = &w.scores[i0 * kChunk];
    std::fill(sc, sc + (i1 - i0) * kChunk, T(0));
    gemm<T>(i1 - i0, cols, fp, &w.qc[i0 * fp], fp, w.kt.data(), kChunk, sc, kChunk);
    for (idx i = i0; i < i1; ++i)
      for (idx j = i + 1; j < cols; ++j) w.scores[i * kChunk + j] = T(0);
    gemm<T>(i1 - i0, mp, i1, sc, kChunk, w.vc.data(), mp, &w.oc[i0 * mp], mp);
  }
  const idx rows = std::min(kChunk, s.n - c0);
  for (idx r = 0; r < rows; ++r) std::memcpy(s.out_row(c0 + r), &w.oc[r * mp], s.m * sizeof(T));
}

// total = prefix + T (prefix: sum of earlier segment states, or null for none).
template <typename T>
static void form_total(Workspace<T>& w, const T* prefix) {
  const idx size = w.fp * w.mp;
  if (prefix == nullptr) {
    std::copy(w.state.begin(), w.state.end(), w.total.begin());
  } else {
    for (idx x = 0; x < size; ++x) w.total[x] = prefix[x] + w.state[x];
  }
}

// Outputs of virtual rows r0 .. r1 (one segment), starting from the segment prefix `prefix`
// (fp x mp, or null for zero). Leaves the segment's state T in w.state if `whole_state`
// (otherwise the last chunk, which no later row of the segment needs, is left out).
template <typename T>
static void run_segment(const Sequence<T>& s, Workspace<T>& w, idx r0, idx r1, const T* prefix,
                        bool whole_state) {
  std::fill(w.state.begin(), w.state.end(), T(0));
  for (idx c0 = r0; c0 < r1; c0 += kChunk) {
    pack_queries(s, w, c0);
    pack_keys_values(s, w, c0);
    form_total(w, prefix);
    chunk_output(s, w, c0);
    if (whole_state || c0 + kChunk < r1) update_state(w);
  }
}

// T of virtual rows r0 .. r1 (one segment) into w.state.
template <typename T>
static void segment_state(const Sequence<T>& s, Workspace<T>& w, idx r0, idx r1) {
  std::fill(w.state.begin(), w.state.end(), T(0));
  for (idx c0 = r0; c0 < r1; c0 += kChunk) {
    pack_keys_values(s, w, c0);
    update_state(w);
  }
}

// A whole sequence on one thread: the same operations as the three-phase schedule.
template <typename T>
static void run_sequence(const Sequence<T>& s, Workspace<T>& w) {
  constexpr idx seg = kChunk * kSegmentChunks;
  const idx size = w.fp * w.mp;
  std::vector<T> prefix(size, T(0));
  for (idx r0 = 0; r0 < s.n; r0 += seg) {
    const idx r1 = std::min(r0 + seg, s.n);
    run_segment(s, w, r0, r1, r0 == 0 ? nullptr : prefix.data(), r1 < s.n);
    if (r1 < s.n) {  // P += T
      if (r0 == 0) {
        std::copy(w.state.begin(), w.state.end(), prefix.begin());
      } else {
        for (idx x = 0; x < size; ++x) prefix[x] += w.state[x];
      }
    }
  }
}

// ---------------------------------------------------------------- entry point
// out (BH, N, M) = causal (or, with reverse, anti-causal) product of q, k (BH, N, F), v (BH, N, M).
template <typename T>
void causal_product(const T* q, const T* k, const T* v, T* out, idx bh, idx n, idx f, idx m,
                    bool reverse, int threads) {
  if (bh == 0 || n == 0 || m == 0) return;
  threads = std::max(threads, 1);
  constexpr idx seg = kChunk * kSegmentChunks;
  const idx segments = (n + seg - 1) / seg;
  auto sequence = [&](idx b) {
    return Sequence<T>{q + b * n * f, k + b * n * f, v + b * n * m, out + b * n * m, n, f, m,
                       reverse};
  };

  if (bh >= threads || segments == 1) {
    // one sequence per task
#pragma omp parallel num_threads(threads)
    {
      Workspace<T> w(f, m);
#pragma omp for schedule(dynamic, 1)
      for (idx b = 0; b < bh; ++b) run_sequence(sequence(b), w);
    }
    return;
  }

  // Few sequences: split each into segments. prefixes[b][s] = sum of states of segments < s.
  Workspace<T> shape(f, m);
  const idx size = shape.fp * shape.mp;
  std::vector<T> prefixes(bh * segments * size, T(0));
  auto prefix = [&](idx b, idx s) { return prefixes.data() + (b * segments + s) * size; };
#pragma omp parallel num_threads(threads)
  {
    Workspace<T> w(f, m);
    // 1. state of every segment but the last, stored in the slot of the next segment
#pragma omp for schedule(dynamic, 1)
    for (idx t = 0; t < bh * (segments - 1); ++t) {
      const idx b = t / (segments - 1), s = t % (segments - 1);
      segment_state(sequence(b), w, s * seg, std::min((s + 1) * seg, n));
      std::copy(w.state.begin(), w.state.end(), prefix(b, s + 1));
    }
    // 2. prefix sums over segments, in order
#pragma omp for schedule(static)
    for (idx b = 0; b < bh; ++b)
      for (idx s = 2; s < segments; ++s) {
        T* p = prefix(b, s);
        const T* before = prefix(b, s - 1);
        for (idx x = 0; x < size; ++x) p[x] = before[x] + p[x];
      }
    // 3. outputs of every segment
#pragma omp for schedule(dynamic, 1)
    for (idx t = 0; t < bh * segments; ++t) {
      const idx b = t / segments, s = t % segments;
      run_segment(sequence(b), w, s * seg, std::min((s + 1) * seg, n),
                  s == 0 ? nullptr : prefix(b, s), false);
    }
  }
}

}  // namespace ks_cpu
