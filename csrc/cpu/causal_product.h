// Causal linear-attention product on the CPU, in plain C++ with OpenMP (no torch).
//
//   out_i = sum_{j<=i} (q_i . k_j) v_j        q, k: (BH, N, F), v: (BH, N, M), row-major
//
// and, with `reverse`, the anti-causal product over j >= i; the backward pass needs one
// causal product (dq) and two anti-causal ones (dk, dv), which share a state and run fused.
//
// Chunked algorithm: the sequence is cut into chunks of C rows (32 or 64, from F and M).
// For chunk c,
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
// Memory: O(C * (F + M) + F * M) per thread, plus O(N / 512 * F * M) per sequence for the
// segment prefixes when a sequence is split.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

// AVX2+FMA intrinsics where the compiler targets them (define KS_PORTABLE to test without)
#if defined(__AVX2__) && defined(__FMA__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(KS_PORTABLE)
#define KS_AVX2 1
#include <immintrin.h>
#endif

namespace ks_cpu {

using idx = std::ptrdiff_t;

static inline idx round_up(idx x, idx to) { return (x + to - 1) / to * to; }

// Rows per segment: fixed (a multiple of every chunk size), which keeps results independent
// of the thread count.
constexpr idx kSegment = 512;

// ---------------------------------------------------------------- vectors of 32 bytes
// Vec<T>: load, store, splat (broadcast) and fma (acc + a * b) on 32 bytes of T.
#ifdef KS_AVX2
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

// Register block: kMR rows x kNV vectors of accumulators (6 x 2 and 4 x 3 fill the 16 AVX2
// registers; 6 x 2 measured best over F = M = 32 .. 128 on AMD EPYC).
constexpr int kMR = 6;
constexpr int kNV = 2;

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
  for (; i + kMR <= m; i += kMR)
    gemm_rows<T, kMR>(n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  gemm_tail<T, kMR - 1>(m - i, n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
}

// ---------------------------------------------------------------- one chunk
// One causal product on one sequence: out (N, m) = sum_{j<=i} (q_i . k_j) v_j with q, k (N, f),
// v (N, m). Rows are "virtual": with `reverse`, virtual row r is row N-1-r of the inputs, which
// turns the anti-causal product into a causal one.
template <typename T>
struct Operands {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  idx f, m;
};

// A chunk of one product packed into zero-padded buffers, and its output.
template <typename T>
struct Chunk {
  idx size;               // C, rows per chunk
  idx fp, mp;             // f, m padded to the vector width
  // The state first: where it cannot be allocated, the call fails before touching the
  // others (C rows of f + m can be gigabytes when f x m is beyond the address space).
  std::vector<T> total;   // (fp, mp) state of all earlier chunks
  std::vector<T> qc;      // (C, fp)  queries
  std::vector<T> kt;      // (fp, C)  keys, transposed
  std::vector<T> vc;      // (C, mp)  values
  std::vector<T> scores;  // (C, C)   tril(Q_c K_c^T)
  std::vector<T> oc;      // (C, mp)  output

  Chunk(idx f, idx m, idx size)
      : size(size),
        fp(round_up(f, Vec<T>::lanes)),
        mp(round_up(m, Vec<T>::lanes)),
        total(fp * mp),
        qc(size * fp),
        kt(fp * size),
        vc(size * mp),
        scores(size * size),
        oc(size * mp) {}
};

// Rows per chunk: 32 while the state (f x m) fits in 16 KB, else 64 (a larger state costs more
// to update; the update is shared by the rows of a chunk).
template <typename T>
static idx chunk_rows(idx f, idx m) {
  constexpr idx L = Vec<T>::lanes;
  return round_up(f, L) * round_up(m, L) * idx(sizeof(T)) <= 16384 ? 32 : 64;
}

// Where virtual row r of a (N, width) matrix lives.
template <typename T>
static inline T* row_of(T* base, idx n, bool reverse, idx r, idx width) {
  return base + (reverse ? n - 1 - r : r) * width;
}

// Pack the keys and values of virtual rows c0 .. c0+C (zeros past N, f and m).
template <typename T>
static void pack_keys_values(const Operands<T>& o, Chunk<T>& c, idx n, bool reverse, idx c0) {
  const idx rows = std::min(c.size, n - c0);
  std::fill(c.kt.begin(), c.kt.end(), T(0));
  std::fill(c.vc.begin(), c.vc.end(), T(0));
  for (idx r = 0; r < rows; ++r) {
    const T* kr = row_of(o.k, n, reverse, c0 + r, o.f);
    for (idx x = 0; x < o.f; ++x) c.kt[x * c.size + r] = kr[x];
    std::memcpy(&c.vc[r * c.mp], row_of(o.v, n, reverse, c0 + r, o.m), o.m * sizeof(T));
  }
}

template <typename T>
static void pack_queries(const Operands<T>& o, Chunk<T>& c, idx n, bool reverse, idx c0) {
  const idx rows = std::min(c.size, n - c0);
  std::fill(c.qc.begin(), c.qc.end(), T(0));
  for (idx r = 0; r < rows; ++r)
    std::memcpy(&c.qc[r * c.fp], row_of(o.q, n, reverse, c0 + r, o.f), o.f * sizeof(T));
}

// state (fp, mp) += K_c^T V_c
template <typename T>
static void update_state(const Chunk<T>& c, T* state) {
  gemm<T>(c.fp, c.mp, c.size, c.kt.data(), c.size, c.vc.data(), c.mp, state, c.mp);
}

// Output rows of the packed chunk at c0: O_c = Q_c total + tril(Q_c K_c^T) V_c.
template <typename T>
static void chunk_output(const Operands<T>& o, Chunk<T>& c, idx n, bool reverse, idx c0) {
  constexpr idx L = Vec<T>::lanes;
  const idx fp = c.fp, mp = c.mp;
  std::fill(c.oc.begin(), c.oc.end(), T(0));
  gemm<T>(c.size, mp, fp, c.qc.data(), fp, c.total.data(), mp, c.oc.data(), mp);
  // a block of kMR rows at a time, skipping the blocks above the diagonal
  for (idx i0 = 0; i0 < c.size; i0 += kMR) {
    const idx i1 = std::min(i0 + kMR, c.size);  // rows i0 .. i1 see keys 0 .. i1-1
    const idx cols = round_up(i1, L);
    T* sc = &c.scores[i0 * c.size];
    std::fill(sc, sc + (i1 - i0) * c.size, T(0));
    gemm<T>(i1 - i0, cols, fp, &c.qc[i0 * fp], fp, c.kt.data(), c.size, sc, c.size);
    for (idx i = i0; i < i1; ++i)
      for (idx j = i + 1; j < cols; ++j) c.scores[i * c.size + j] = T(0);
    gemm<T>(i1 - i0, mp, i1, sc, c.size, c.vc.data(), mp, &c.oc[i0 * mp], mp);
  }
  const idx rows = std::min(c.size, n - c0);
  for (idx r = 0; r < rows; ++r)
    std::memcpy(row_of(o.out, n, reverse, c0 + r, o.m), &c.oc[r * mp], o.m * sizeof(T));
}

// ---------------------------------------------------------------- one sequence
// The work on one sequence: product `a`, and optionally a second product `b` whose state is
// the transpose of a's (the backward pass computes dk and dv together this way).
template <typename T>
struct Task {
  idx n;
  bool reverse;
  idx chunk;  // rows per chunk
  Operands<T> a;
  bool fused;
  Operands<T> b;
};

// The buffers of one thread.
template <typename T>
struct Worker {
  Chunk<T> a, b;
  std::vector<T> state;   // (a.fp, a.mp) T: earlier chunks of this segment
  std::vector<T> prefix;  // (a.fp, a.mp) states of the earlier segments (run_sequence)

  explicit Worker(const Task<T>& t)
      : a(t.a.f, t.a.m, t.chunk),
        b(t.fused ? t.b.f : 0, t.fused ? t.b.m : 0, t.chunk),
        state(a.fp * a.mp),
        prefix(a.fp * a.mp) {}
};

// One worker per thread, made before the parallel region: an allocation that fails throws
// std::bad_alloc to the caller here (a MemoryError in Python), where inside the region it
// would end the process (an exception may not leave an OpenMP region: std::terminate).
template <typename T, typename MakeTask>
static std::vector<Worker<T>> make_workers(int threads, MakeTask task) {
  std::vector<Worker<T>> workers;
  workers.reserve(threads);
  for (int i = 0; i < threads; ++i) workers.emplace_back(task(0));
  return workers;
}

static int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Outputs of virtual rows r0 .. r1 (one segment), starting from `prefix`, the sum of the
// states of earlier segments ((a.fp, a.mp), or null for zero). Leaves the segment's state in
// w.state if `whole_state` (otherwise the last chunk, which no later row needs, is left out).
template <typename T>
static void run_segment(const Task<T>& t, Worker<T>& w, idx r0, idx r1, const T* prefix,
                        bool whole_state) {
  const idx fp = w.a.fp, mp = w.a.mp;
  std::fill(w.state.begin(), w.state.end(), T(0));
  for (idx c0 = r0; c0 < r1; c0 += t.chunk) {
    pack_queries(t.a, w.a, t.n, t.reverse, c0);
    pack_keys_values(t.a, w.a, t.n, t.reverse, c0);
    for (idx x = 0; x < fp * mp; ++x) w.a.total[x] = prefix ? prefix[x] + w.state[x] : w.state[x];
    chunk_output(t.a, w.a, t.n, t.reverse, c0);
    if (t.fused) {
      pack_queries(t.b, w.b, t.n, t.reverse, c0);
      pack_keys_values(t.b, w.b, t.n, t.reverse, c0);
      for (idx x = 0; x < fp; ++x)
        for (idx y = 0; y < mp; ++y) w.b.total[y * fp + x] = w.a.total[x * mp + y];
      chunk_output(t.b, w.b, t.n, t.reverse, c0);
    }
    if (whole_state || c0 + t.chunk < r1) update_state(w.a, w.state.data());
  }
}

// The state of virtual rows r0 .. r1 (one segment) into w.state.
template <typename T>
static void segment_state(const Task<T>& t, Worker<T>& w, idx r0, idx r1) {
  std::fill(w.state.begin(), w.state.end(), T(0));
  for (idx c0 = r0; c0 < r1; c0 += t.chunk) {
    pack_keys_values(t.a, w.a, t.n, t.reverse, c0);
    update_state(w.a, w.state.data());
  }
}

// A whole sequence on one thread: the same operations as the three-phase schedule.
template <typename T>
static void run_sequence(const Task<T>& t, Worker<T>& w) {
  constexpr idx seg = kSegment;
  std::vector<T>& prefix = w.prefix;  // read only after the first segment has written it
  for (idx r0 = 0; r0 < t.n; r0 += seg) {
    const idx r1 = std::min(r0 + seg, t.n);
    run_segment(t, w, r0, r1, r0 == 0 ? nullptr : prefix.data(), r1 < t.n);
    if (r1 < t.n)  // P += T (the first segment copies: 0 + T is T)
      for (size_t x = 0; x < prefix.size(); ++x)
        prefix[x] = r0 == 0 ? w.state[x] : prefix[x] + w.state[x];
  }
}

// Run task(b) for b < bh, in parallel over sequences, or, when there are fewer sequences than
// threads, over segments within them (results are the same either way).
template <typename T, typename MakeTask>
static void run_tasks(idx bh, idx n, idx flops_per_row, int threads, MakeTask task) {
  if (bh == 0 || n == 0) return;
  constexpr idx seg = kSegment;
  const idx segments = (n + seg - 1) / seg;
  // at most one thread per task, and per ~1M multiply-adds (waking threads costs more)
  const idx useful = std::min(bh * segments, std::max<idx>(bh * n * flops_per_row >> 20, 1));
  threads = static_cast<int>(std::clamp<idx>(threads, 1, useful));

  std::vector<Worker<T>> workers = make_workers<T>(threads, task);
  if (bh >= threads || segments == 1) {
#pragma omp parallel num_threads(threads)
    {
      Worker<T>& w = workers[thread_index()];
#pragma omp for schedule(dynamic, 1)
      for (idx b = 0; b < bh; ++b) run_sequence(task(b), w);
    }
    return;
  }

  // prefixes[b][s] = sum of the states of segments < s of sequence b
  const idx size = workers[0].state.size();
  std::vector<T> prefixes(bh * segments * size, T(0));
  auto prefix = [&](idx b, idx s) { return prefixes.data() + (b * segments + s) * size; };
#pragma omp parallel num_threads(threads)
  {
    Worker<T>& w = workers[thread_index()];
    // 1. the state of every segment but the last, into the slot of the next one
#pragma omp for schedule(dynamic, 1)
    for (idx i = 0; i < bh * (segments - 1); ++i) {
      const idx b = i / (segments - 1), s = i % (segments - 1);
      segment_state(task(b), w, s * seg, std::min((s + 1) * seg, n));
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
    // 3. the outputs of every segment
#pragma omp for schedule(dynamic, 1)
    for (idx i = 0; i < bh * segments; ++i) {
      const idx b = i / segments, s = i % segments;
      run_segment(task(b), w, s * seg, std::min((s + 1) * seg, n),
                  s == 0 ? nullptr : prefix(b, s), false);
    }
  }
}

// ---------------------------------------------------------------- entry points
// out (BH, N, M) = causal (or, with reverse, anti-causal) product of q, k (BH, N, F), v (BH, N, M).
template <typename T>
void causal_product(const T* q, const T* k, const T* v, T* out, idx bh, idx n, idx f, idx m,
                    bool reverse, int threads) {
  if (m == 0) return;
  const idx chunk = chunk_rows<T>(f, m);
  auto task = [=](idx b) {
    const Operands<T> a{q + b * n * f, k + b * n * f, v + b * n * m, out + b * n * m, f, m};
    return Task<T>{n, reverse, chunk, a, false, {}};
  };
  run_tasks<T>(bh, n, f * m + chunk * (f + m), threads, task);
}

// Gradients of out = causal_product(q, k, v) with respect to k and v, given g = dL/dout:
//   dk_j = sum_{i>=j} (v_j . g_i) q_i,   dv_j = sum_{i>=j} (k_j . q_i) g_i,
// two anti-causal products sharing one state, sum_i q_i g_i^T (F x M), and its transpose.
template <typename T>
void causal_product_backward_kv(const T* q, const T* k, const T* v, const T* g, T* dk, T* dv,
                                idx bh, idx n, idx f, idx m, int threads) {
  if (f == 0 || m == 0) {
    std::fill(dk, dk + bh * n * f, T(0));
    std::fill(dv, dv + bh * n * m, T(0));
    return;
  }
  const idx chunk = chunk_rows<T>(f, m);
  auto task = [=](idx b) {
    const idx qk = b * n * f, vg = b * n * m;
    const Operands<T> for_dv{k + qk, q + qk, g + vg, dv + vg, f, m};
    const Operands<T> for_dk{v + vg, g + vg, q + qk, dk + qk, m, f};
    return Task<T>{n, true, chunk, for_dv, true, for_dk};
  };
  run_tasks<T>(bh, n, 2 * (f * m + chunk * (f + m)), threads, task);
}

}  // namespace ks_cpu
