// The walk on WMMA: states kept on chip, masks in registers, kernel 6 (chunk walk) and
// kernel 7 (the fused dk, dv walk).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "chunk_kernels.cuh"

namespace ks_cuda {
namespace {

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
  warp_gemm_sum<Tin, wmma::col_major, wmma::row_major>(acc, A, LD, B, LD);
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

// Kernel 6's walk by thread block `block` (blockIdx.x of kernel 6) of M slice `slice`
// (blockIdx.y).
template <typename Tin, typename Tout, int FT>
__device__ __forceinline__ void walk_wmma(int64_t block, int64_t slice, const Tin* __restrict__ q,
                                          const Tin* __restrict__ k, const Tin* __restrict__ v,
                                          const float* __restrict__ carry, Tout* __restrict__ out,
                                          float* __restrict__ den, int64_t n, int64_t f,
                                          int64_t m, int64_t nblk, int64_t cpb, bool reverse,
                                          bool normalize, float eps, bool vec_qk, bool vec_v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  static_assert(FT == 1 || FT == 2, "one or two 64-wide feature slices (F <= 128)");
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
  auto q_tile = [&](int buf, int ft) {
    return bufs + (buf * Smem::kBufTiles + ft) * Smem::kOpTile;
  };
  auto k_tile = [&](int buf, int ft) {
    return bufs + (buf * Smem::kBufTiles + FT + ft) * Smem::kOpTile;
  };
  auto v_tile = [&](int buf) { return bufs + (buf * Smem::kBufTiles + 2 * FT) * Smem::kOpTile; };
  auto s_tile = [&](int ft) { return s32 + ft * kTile * kLdF; };
  auto s_copy_tile = [&](int ft) { return s_copy + ft * Smem::kOpTile; };

  const WalkSegment seg(block, n, nblk, cpb, reverse);
  const int64_t bh = seg.bh, blk = seg.blk;
  const int64_t m0 = slice * kTile;
  const bool need_den = normalize || den != nullptr;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    if constexpr (kFetchFirst<Tin, Op> && FT == 2) {
      // slice 0's Q, K, then slice 1's with V, each group's loads at once (all five tiles'
      // loads at once spilled in fp16)
      TileBatch<Tin, Op, 2> first;
      first.load(0, q_tile(buf, 0), LD, qb, f, n, f, row0, 0, nullptr, vec_qk);
      first.load(1, k_tile(buf, 0), LD, kb, f, n, f, row0, 0, nullptr, vec_qk);
      first.land();
      TileBatch<Tin, Op, 3> second;
      second.load(0, q_tile(buf, 1), LD, qb, f, n, f, row0, kTile, nullptr, vec_qk);
      second.load(1, k_tile(buf, 1), LD, kb, f, n, f, row0, kTile, nullptr, vec_qk);
      second.load(2, v_tile(buf), LD, vb, m, n, m, row0, m0, nullptr, vec_v);
      second.land();
    } else {
      TileBatch<Tin, Op, 2 * FT + 1> tiles;  // Q, K slices and V, their loads at once
#pragma unroll
      for (int ft = 0; ft < FT; ++ft) {
        tiles.load(2 * ft, q_tile(buf, ft), LD, qb, f, n, f, row0, ft * kTile, nullptr, vec_qk);
        tiles.load(2 * ft + 1, k_tile(buf, ft), LD, kb, f, n, f, row0, ft * kTile, nullptr,
                   vec_qk);
      }
      tiles.load(2 * FT, v_tile(buf), LD, vb, m, n, m, row0, m0, nullptr, vec_v);
      tiles.land();
    }
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

template <typename Tin, typename Tout, int FT>
__global__ void __launch_bounds__(kThreads, kWalkBlocksPerSm<typename OperandOf<Tin>::type, FT>)
    chunk_walk_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                      const Tin* __restrict__ v, const float* __restrict__ carry,
                      Tout* __restrict__ out, float* __restrict__ den, int64_t n, int64_t f,
                      int64_t m, int64_t nblk, int64_t cpb, bool reverse, bool normalize,
                      float eps, bool vec_qk, bool vec_v) {
  walk_wmma<Tin, Tout, FT>(blockIdx.x, blockIdx.y, q, k, v, carry, out, den, n, f, m, nblk, cpb,
                           reverse, normalize, eps, vec_qk, vec_v);
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
  __host__ __device__ constexpr int buf_tiles() const { return 2 * (ft + mt); }
  __host__ __device__ constexpr size_t op_bytes() const {
    const int tiles = nbuf * buf_tiles() + (kCopy ? ft * mt : 0) + 2;
    return static_cast<size_t>(tiles) * op_tile() * sizeof(Op);
  }
  __host__ __device__ constexpr size_t bytes() const {
    return op_bytes() +
           (static_cast<size_t>(ft * mt + stages) * kTile * kLdF + kPositions) * sizeof(float);
  }
};

// Kernel 7's walk by thread block `block` (blockIdx.x of kernel 7); dk in Tout, dv in Tdv.
template <typename Tin, typename Tout, typename Tdv>
__device__ __forceinline__ void walk_wmma_dkv(int64_t block, const Tin* __restrict__ q,
                                              const Tin* __restrict__ k, const Tin* __restrict__ v,
                                              const Tin* __restrict__ g,
                                              const float* __restrict__ carry,
                                              Tout* __restrict__ dk, Tdv* __restrict__ dv,
                                              int64_t n, int64_t f, int64_t m, int64_t nblk,
                                              int64_t cpb,
                                              DkvSmem<typename OperandOf<Tin>::type> lay,
                                              bool vec_f, bool vec_m) {
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

  const WalkSegment seg(block, n, nblk, cpb, true);
  const int64_t bh = seg.bh, blk = seg.blk;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  const Tin* gb = g + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    for (int ft = 0; ft < ft_n; ++ft) {
      TileBatch<Tin, Op, 2> qk;  // a slice's Q and K, their loads at once
      qk.load(0, q_tile(buf, ft), LD, qb, f, n, f, row0, ft * kTile, nullptr, vec_f);
      qk.load(1, k_tile(buf, ft), LD, kb, f, n, f, row0, ft * kTile, nullptr, vec_f);
      qk.land();
    }
    for (int mt = 0; mt < mt_n; ++mt) {
      TileBatch<Tin, Op, 2> vg;  // V and G
      vg.load(0, v_tile(buf, mt), LD, vb, m, n, m, row0, mt * kTile, nullptr, vec_m);
      vg.load(1, g_tile(buf, mt), LD, gb, m, n, m, row0, mt * kTile, nullptr, vec_m);
      vg.land();
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

template <typename Tin, typename Tout, typename Tdv>
__global__ void __launch_bounds__(kThreads, 1)
    chunk_walk_dkv_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                          const Tin* __restrict__ v, const Tin* __restrict__ g,
                          const float* __restrict__ carry, Tout* __restrict__ dk,
                          Tdv* __restrict__ dv, int64_t n, int64_t f, int64_t m, int64_t nblk,
                          int64_t cpb, DkvSmem<typename OperandOf<Tin>::type> lay, bool vec_f,
                          bool vec_m) {
  walk_wmma_dkv<Tin, Tout, Tdv>(blockIdx.x, q, k, v, g, carry, dk, dv, n, f, m, nblk, cpb, lay,
                                vec_f, vec_m);
}

}  // namespace
}  // namespace ks_cuda
