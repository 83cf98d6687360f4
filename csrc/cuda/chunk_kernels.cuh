// The chunk kernels: the segment a block walks (WalkSegment), kernel 1 (chunk states),
// kernel 2 (scan over blocks), kernel 3 (chunk output) and kernels 4 and 5 (fused backward).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "tiles.cuh"
#include "wmma_ops.cuh"

namespace ks_cuda {
namespace {

// ------------------------------------------------------------------ segments
// The segment thread block `block` walks in kernels 1, 6-11 (blockIdx.x, grid.x = BH * nblk;
// kernels 10 and 11 number the blocks of each of their two walks from 0): sequence bh, segment blk,
// the chunks [first, first + count) of the sequence's nc (cpb per segment, the last segment
// shorter), visited first to last or, with `reverse`, last to first. With `skip` (kernel 1's
// carries, grid.x = BH * (nblk - skip)) no block takes the `skip` segments that come last in the
// walk's order (the last ones, or with `reverse` the first ones).
struct WalkSegment {
  int64_t nc, bh, blk, first, count;
  bool reverse;
  __device__ WalkSegment(int64_t block, int64_t n, int64_t nblk, int64_t cpb, bool reverse_,
                         int64_t skip = 0)
      : nc((n + kTile - 1) / kTile),
        bh(block / (nblk - skip)),
        blk(block % (nblk - skip) + (reverse_ ? skip : 0)),
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
// Rows with keep == false (key padding) are skipped. With `skip` (totals for the carries of a
// walk's segments, which never include the segment that comes last in the walk's order)
// grid.x = BH * (nblk - skip) and the `skip` blocks that come last are not walked (WalkSegment).
// Shared: two buffers of (K tile 64 x 64 (rows x F slice), V tile 64 x 64 (rows x M slice)), so
// the next chunk's tiles load (cp.async) while this chunk's product runs; fp32 staging 64 x 64.
// Blocks per SM: with bf16 tiles (53 KB) an H100's shared memory holds four, which 64 registers
// a thread allow (ptxas: no spill; the chunk loop 1083 -> 1273 instructions); unbounded, ptxas
// took 77-80 and an SM held three, so the walk's carry pass of about 512 blocks (walk_layout)
// ran in two waves on 132 SMs. fp32 tiles (85 KB) fit two by shared memory alone: 0 there, no
// minimum (nvcc then emits no .minnctapersm, as for __launch_bounds__(kThreads); a minimum of
// 2 took fp16's 63 registers to 128 with a spill).
// v's type Tv (Tin unless given) sets the operand type and precision: the non-causal backward's
// [dS | dz] = sum_i q_i [dnum_i | dden_i]^T takes q in Tin beside fp32 row terms, on fp32 tiles
// with 3xTF32 (q converted on load; 16-bit values are exact in tf32).
template <typename Op>
constexpr int kStatesBlocksPerSm = sizeof(Op) == 2 ? 4 : 0;

template <typename Tin, typename Tstate, typename Tv = Tin>
__global__ void __launch_bounds__(kThreads, kStatesBlocksPerSm<typename OperandOf<Tv>::type>)
    chunk_states_kernel(const Tin* __restrict__ k, const Tv* __restrict__ v,
                        const bool* __restrict__ key_keep, int64_t heads,
                        float* __restrict__ totals, Tstate* __restrict__ prefix_s,
                        float* __restrict__ prefix_z, int64_t n, int64_t f, int64_t m,
                        int64_t nblk, int64_t cpb, bool reverse, bool with_z, int64_t skip,
                        bool vec_k, bool vec_v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tv>::type;
  constexpr int LD = ld_of<Op>();
  KS_DYNAMIC_SMEM(smem);
  Op* tiles = reinterpret_cast<Op*>(smem);  // buffer b: K at 2b, V at 2b + 1 (64 x LD each)
  float* St = reinterpret_cast<float*>(tiles + 4 * kTile * LD);  // 64 x kLdF: fp32 state tile

  const WalkSegment seg(blockIdx.x, n, nblk, cpb, reverse, skip);
  const int64_t nc = seg.nc, bh = seg.bh, blk = seg.blk;
  const int64_t m_tiles = (m + kTile - 1) / kTile;
  const int64_t f0 = (blockIdx.y / m_tiles) * kTile;
  const int64_t m0 = (blockIdx.y % m_tiles) * kTile;
  const bool z_block = m0 == 0;
  const Tin* kb = k + bh * n * f;
  const Tv* vb = v + bh * n * m;
  const bool* keep = key_keep == nullptr ? nullptr : key_keep + (bh / heads) * n;

  typename Mma<Op>::Acc acc[2];
  zero(acc);
  float z = 0.f;  // thread t < 64: running z of feature f0 + t

  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    if constexpr (std::is_same_v<Tin, Tv>) {
      TileBatch<Tin, Op, 2> kv;  // K, V, their loads at once
      kv.load(0, tiles + (2 * buf) * kTile * LD, LD, kb, f, n, f, row0, f0, keep, vec_k);
      kv.load(1, tiles + (2 * buf + 1) * kTile * LD, LD, vb, m, n, m, row0, m0, keep, vec_v);
      kv.land();
    } else {
      load_tile<Tin, Op>(tiles + (2 * buf) * kTile * LD, LD, kb, f, n, f, row0, f0, keep, vec_k);
      load_tile<Tv, Op>(tiles + (2 * buf + 1) * kTile * LD, LD, vb, m, n, m, row0, m0, keep,
                        vec_v);
    }
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
    warp_gemm_sum<Tv, wmma::col_major, wmma::row_major>(acc, Ks, LD, Vs, LD);
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
// One thread per state element e (of ss) and sequence bh; walks the `groups` block totals of bh
// ([bh][groups][ss] in `states`) in order:
//   kSum: their sum into out[bh] ([bh][ss]);
//   kExclusiveForward / kExclusiveReverse: the carries of segments of `per` consecutive groups
//     (the last segment may hold fewer): segment j's carry, the sum of every group of the
//     segments before it (after it, reverse), into out[bh][j] ([bh][cdiv(groups, per)][ss]).
//     With per = 1, out may be `states` itself (in place: each total is read before its slot
//     is written). The groups of the segment that comes last in the order are never read
//     (kernel 1 may not have written them: `skip`).
// Loads are batched by 8 to keep several in flight.
__global__ void __launch_bounds__(kThreads)
    state_scan_kernel(const float* states, float* out, int64_t groups, int64_t per, int64_t ss,
                      int mode) {
  const int64_t per_bh = (ss + kThreads - 1) / kThreads;
  const int64_t bh = blockIdx.x / per_bh;
  const int64_t e = (blockIdx.x % per_bh) * kThreads + threadIdx.x;
  if (e >= ss) return;
  const int64_t nseg = (groups + per - 1) / per;
  const int64_t last_len = groups - (nseg - 1) * per;  // groups of the last segment (1 .. per)
  const bool reverse = mode == kExclusiveReverse;
  const float* base = states + bh * groups * ss + e;
  float* dst = out + bh * (mode == kSum ? 1 : nseg) * ss + e;
  // Visit c takes group c (groups - 1 - c in reverse). Visits below `limit` are read: all for
  // the sum; for the carries, all but the segment visited last (segment 0 in reverse). Before
  // visit `next` is added, segment j's carry is written (j counts down in reverse, whose first
  // segment visited is the last, of last_len groups). Counters, not divisions, per group.
  const int64_t limit = mode == kSum ? groups : groups - (reverse ? per : last_len);
  int64_t next = mode == kSum ? groups : 0;
  int64_t j = reverse ? nseg - 1 : 0;
  constexpr int U = 8;
  float run = 0.f;
  for (int64_t c0 = 0; c0 < groups; c0 += U) {
    float x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u;
      x[u] = c < limit ? base[(reverse ? groups - 1 - c : c) * ss] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u;
      if (c < groups) {
        if (c == next) {
          dst[j * ss] = run;
          next += reverse && j == nseg - 1 ? last_len : per;
          j += reverse ? -1 : 1;
        }
        run += x[u];
      }
    }
  }
  if (mode == kSum) *dst = run;
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
// Read-outs of the non-causal backward: `bias` (BH, M) fp32 or null is added to every row (dk's
// dz), and rows whose key_keep[bh / heads] flag is false (padded keys) come out as zeros (out
// and den); Tout may be narrower than Tin (dq from fp32 row terms, rounded once).
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
                        float* __restrict__ den, const float* __restrict__ bias,
                        const bool* __restrict__ key_keep, int64_t heads, int64_t n, int64_t f,
                        int64_t m, int mode, bool normalize, float eps, bool vec_qk, bool vec_v,
                        bool vec_s) {
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
    if (kFetchFirst<Tin, Op> && intra) {
      TileBatch<Tin, Op, 2> qk;  // Q, K, their loads at once
      qk.load(0, Qs, LD, qb, f, n, f, row0, f0, nullptr, vec_qk);
      qk.load(1, Ks, LD, kb, f, n, f, row0, f0, nullptr, vec_qk);
      qk.land();
    } else {
      load_tile<Tin, Op>(Qs, LD, qb, f, n, f, row0, f0, nullptr, vec_qk);
      if (intra) load_tile<Tin, Op>(Ks, LD, kb, f, n, f, row0, f0, nullptr, vec_qk);
    }
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

  const bool* keep = key_keep == nullptr ? nullptr : key_keep + (bh / heads) * n + row0;
  store_output(out, den, Af, dens, bh, n, m, row0, m0, normalize, eps,
               bias == nullptr ? nullptr : bias + bh * m, keep);
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
    TileBatch<Tin, Op, 2> gv;  // G, V, their loads at once
    gv.load(0, Gs, LD, gb, m, n, m, row0, m0, nullptr, vec_m);
    gv.load(1, Vs, LD, vb, m, n, m, row0, m0, nullptr, vec_m);
    gv.land();
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
  TileBatch<Tin, Op, 2> qk;  // Q, K, their loads at once
  qk.load(0, Qs, LD, qb, f, n, f, row0, f0, nullptr, vec_f);
  qk.load(1, Ks, LD, kb, f, n, f, row0, f0, nullptr, vec_f);
  qk.land();
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
    TileBatch<Tin, Op, 2> qk;  // Q, K, their loads at once
    qk.load(0, Qs, LD, qb, f, n, f, row0, f0, nullptr, vec_f);
    qk.load(1, Ks, LD, kb, f, n, f, row0, f0, nullptr, vec_f);
    qk.land();
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

}  // namespace
}  // namespace ks_cuda
