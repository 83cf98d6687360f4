// The register walk on mma.sync: tiles, bands and stores of kernels 8 (the walk) and 9
// (the fused dk, dv walk), with each warp's operands in registers, and kernel 12 (their
// carries: kernel 1 on mma.sync).
// Included, with every .cuh here in order, by launch.cuh (in each input type's .cu).
#pragma once

#include "mma_sync.cuh"
#include "walk_kernels.cuh"

namespace ks_cuda {
namespace {

// ------------------------------------------------------------------ register walks
// Kernels 8 and 9 work on 64 x LD tiles of the operand type (chunk rows x a 64-wide slice,
// zero-padded), a warp on a band of 16 rows r0 .. r0 + 15: the band over 64 columns is kSteps A
// fragments (one per k-step), and B fragments come in pairs of n-tiles (16 columns) per k-step.
// A band type (BandOf<Tin>) holds what differs between the kinds of operands (B fragments come
// from its A fragment loads, b_pair):
//   bf16 (Band<__nv_bfloat16>, m16n8k16): k-steps of 16, fragments by ldmatrix (mma_sync.cuh;
//     lr, lm0, lm1: the lane's row of an ldmatrix matrix and the matrix's two index bits);
//   fp32 tiles (Band<float>, m16n8k8 on tf32; fp32 inputs as 3xTF32, fp16 inputs as 1xTF32):
//     k-steps of 8, fragments by 32-bit shared loads, each k-step's 8 indices taken in the order
//     0, 2, 4, 6, 1, 3, 5, 7 in both operands (mma_sync.cuh);
//   fp32 inputs built with -DKS_FP32_BF16X3 (Bf16x3Band): fp32 tiles split into two bf16 parts
//     where they land, then as bf16 for each part, three products for one.
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
  static constexpr bool kPromote = false;  // sums over a walk stay in the accumulators (chunk_sum)
  using Frag = uint32_t[4];   // a k-step of A
  using Frags = Frag[kSteps];
  using BPair = uint32_t[4];  // a k-step of two n-tiles of B (b_pair): n-tile j in 2j, 2j + 1

  // k-step kk of A = rows r0 .. r0 + 15 of T (kLd: T's leading dimension; Bf16x3Band's parts
  // have another)
  template <int kLd = LD>
  static __device__ __forceinline__ void rows(Frag& a, const Op* T, int r0, int kk,
                                              const Lane& l) {
    ldmatrix_x4<false>(a, T + (r0 + l.lr + 8 * l.lm0) * kLd + 16 * kk + 8 * l.lm1);
  }
  // k-step kk of A = columns r0 .. r0 + 15 of T as rows (the k index runs over T's rows)
  template <int kLd = LD>
  static __device__ __forceinline__ void columns(Frag& a, const Op* T, int r0, int kk,
                                                 const Lane& l) {
    ldmatrix_x4<true>(a, T + (16 * kk + l.lr + 8 * l.lm1) * kLd + r0 + 8 * l.lm0);
  }
  // b_pair's fragments straight from ldmatrix: register i holds the 8 x 8 matrix whose row
  // addresses lanes 8i .. 8i + 7 give, so the lanes address (k-half, n-tile) = (i % 2, i / 2)
  // where columns() and rows() address (i / 2, i % 2); no register moves before the products
  static constexpr bool kBPairLoad = true;
  template <bool kAsStored, int kLd = LD>
  static __device__ __forceinline__ void b_pair(BPair& b, const Op* T, int c0, int kk,
                                                const Lane& l) {
    if constexpr (kAsStored) {  // k: T's rows 16 kk .., n: T's columns c0 ..
      ldmatrix_x4<true>(b, T + (16 * kk + l.lr + 8 * l.lm0) * kLd + c0 + 8 * l.lm1);
    } else {  // n: T's rows c0 .., k: T's columns 16 kk ..
      ldmatrix_x4<false>(b, T + (c0 + l.lr + 8 * l.lm1) * kLd + 16 * kk + 8 * l.lm0);
    }
  }
  struct Ready {  // an A fragment as the product takes it: as loaded
    uint32_t r[4];
  };
  static constexpr bool kReadyCosts = false;
  static __device__ __forceinline__ Ready ready(const Frag& a) {
    return {{a[0], a[1], a[2], a[3]}};
  }
  // acc += A B for n-tile j of the pair b
  static __device__ __forceinline__ void mma(float (&acc)[4], const Ready& a, const BPair& b,
                                             int j) {
    mma_bf16(acc, a.r, b[2 * j], b[2 * j + 1]);
  }
  // acc += A 1 (every column of acc: A's row sums)
  static __device__ __forceinline__ void mma_ones(float (&acc)[4], const Ready& a) {
    mma_bf16(acc, a.r, kOnes, kOnes);
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
  static constexpr bool kPromote = kSplit;  // fp32 inputs: each chunk's sum apart (chunk_sum)
  static constexpr bool kBPairLoad = false;       // b_pair: rows() or columns(), reordered
  using Frag = uint32_t[4];
  using Frags = Frag[kSteps];
  using BPair = uint32_t[4];

  static __device__ __forceinline__ void rows(Frag& a, const Op* T, int r0, int kk,
                                              const Lane& l) {
    const float* p = T + (r0 + l.g) * LD + 8 * kk + 2 * l.t;
    const float2 x = *reinterpret_cast<const float2*>(p);
    const float2 y = *reinterpret_cast<const float2*>(p + 8 * LD);
    a[0] = float_bits(x.x);
    a[1] = float_bits(y.x);
    a[2] = float_bits(x.y);
    a[3] = float_bits(y.y);
  }
  static __device__ __forceinline__ void columns(Frag& a, const Op* T, int r0, int kk,
                                                 const Lane& l) {
    const float* p = T + (8 * kk + 2 * l.t) * LD + r0 + l.g;
    a[0] = float_bits(p[0]);
    a[1] = float_bits(p[8]);
    a[2] = float_bits(p[LD]);
    a[3] = float_bits(p[LD + 8]);
  }
  using Ready = TF32A<kSplit>;  // rounded (and split) once per k-step
  static constexpr bool kReadyCosts = true;
  static __device__ __forceinline__ Ready ready(const Frag& a) { return Ready(a); }
  static __device__ __forceinline__ void mma(float (&acc)[4], const Ready& a, const BPair& b,
                                             int j) {
    mma_tf32<kSplit>(acc, a, b[2 * j], b[2 * j + 1]);
  }
  static __device__ __forceinline__ void mma_ones(float (&acc)[4], const Ready& a) {
    mma_tf32<kSplit>(acc, a, kOnes, kOnes);
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

// fp32 inputs multiplied as bf16x3 (-DKS_FP32_BF16X3, config.cuh): A B ~ small big + big small +
// big big over bf16 parts (bf16_split2) in m16n8k16 products, k-steps of 16, fragments by
// ldmatrix as for bf16 inputs. The tiles land in shared memory as fp32 (cp.async, as for
// 3xTF32), and land() splits them where they lie, once for every warp that multiplies them:
// row r of a tile (LD floats) then holds the bf16 big parts of its 64 elements in bf16 elements
// 0 .. 63 and their small parts in 64 .. 127, so each part is a bf16 tile of leading dimension
// kLdParts (Bf16 below loads it). S's copy is written so, z's as bf16 parts (as for bf16 inputs).
struct Bf16x3Band {
  using Op = float;  // tiles of fp32 rows, split in place by land()
  using Bf16 = Band<__nv_bfloat16, true>;
  static constexpr int kSteps = 4, LD = ld_of<Op>(), kTileElems = kTile * LD;
  static constexpr int kLdParts = 2 * LD;  // a part's leading dimension in bf16 elements
  static constexpr uint32_t kOnes = Bf16::kOnes;
  static constexpr bool kPromote = true;  // each chunk's sum apart (chunk_sum), as 3xTF32
  static constexpr bool kBPairLoad = true;
  static constexpr bool kReadyCosts = false;
  // a k-step of A (16 x 16) in m16n8k16 fragments, one of each part; a k-step of B's two
  // n-tiles the same (n-tile j: registers 2j, 2j + 1 of each part)
  struct Frag {
    uint32_t big[4], small[4];
  };
  using Frags = Frag[kSteps];
  using BPair = Frag;
  using Ready = Frag;

  static __device__ __forceinline__ const __nv_bfloat16* big(const Op* T) {
    return reinterpret_cast<const __nv_bfloat16*>(T);
  }
  static __device__ __forceinline__ const __nv_bfloat16* small(const Op* T) {
    return big(T) + kTile;
  }
  // Splits N fp32 tiles (one after another) in place: every thread reads the vectors it
  // copied (load_tile's), a barrier, then each writes their parts (which lie where other
  // threads' vectors were). Call after cp_async_wait_all(), before the barrier that publishes
  // the tiles, in every thread.
  template <int N>
  static __device__ __forceinline__ void land(float* T) {
    using L = TileVectors<float>;
    float4 x[N][L::kPasses];
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int pass = 0; pass < L::kPasses; ++pass) {
        x[i][pass] =
            *reinterpret_cast<const float4*>(T + i * kTileElems + L::row(pass) * LD + L::col());
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
      for (int pass = 0; pass < L::kPasses; ++pass) {
        const float4 v = x[i][pass];
        uint2 b, s;  // the parts of elements c .. c + 3, two packed pairs each
        bf16_split2(float_bits(v.x), float_bits(v.y), b.x, s.x);
        bf16_split2(float_bits(v.z), float_bits(v.w), b.y, s.y);
        auto* row = reinterpret_cast<__nv_bfloat16*>(T + i * kTileElems + L::row(pass) * LD);
        *reinterpret_cast<uint2*>(row + L::col()) = b;
        *reinterpret_cast<uint2*>(row + kTile + L::col()) = s;
      }
    }
  }
  static __device__ __forceinline__ void rows(Frag& a, const Op* T, int r0, int kk,
                                              const Lane& l) {
    Bf16::rows<kLdParts>(a.big, big(T), r0, kk, l);
    Bf16::rows<kLdParts>(a.small, small(T), r0, kk, l);
  }
  static __device__ __forceinline__ void columns(Frag& a, const Op* T, int r0, int kk,
                                                 const Lane& l) {
    Bf16::columns<kLdParts>(a.big, big(T), r0, kk, l);
    Bf16::columns<kLdParts>(a.small, small(T), r0, kk, l);
  }
  template <bool kAsStored>
  static __device__ __forceinline__ void b_pair(BPair& b, const Op* T, int c0, int kk,
                                                const Lane& l) {
    Bf16::b_pair<kAsStored, kLdParts>(b.big, big(T), c0, kk, l);
    Bf16::b_pair<kAsStored, kLdParts>(b.small, small(T), c0, kk, l);
  }
  static __device__ __forceinline__ Ready ready(const Frag& a) { return a; }
  // the small terms first, as mma_tf32
  static __device__ __forceinline__ void mma(float (&acc)[4], const Ready& a, const BPair& b,
                                             int j) {
    mma_bf16(acc, a.small, b.big[2 * j], b.big[2 * j + 1]);
    mma_bf16(acc, a.big, b.small[2 * j], b.small[2 * j + 1]);
    mma_bf16(acc, a.big, b.big[2 * j], b.big[2 * j + 1]);
  }
  static __device__ __forceinline__ void mma_ones(float (&acc)[4], const Ready& a) {
    mma_bf16(acc, a.small, kOnes, kOnes);
    mma_bf16(acc, a.big, kOnes, kOnes);
  }
  static __device__ __forceinline__ bool step_kept(int kk, int r0, bool reverse) {
    return Bf16::step_kept(kk, r0, reverse);  // k-steps of 16, as bf16's
  }
  // the scores (n-tile j: keys 8j ..) split into A fragments, in bf16's order
  static __device__ __forceinline__ void scores(Frags& pa, const float (&p)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // register i: n-tile 2 kk + i / 2, row g + 8 (i % 2)
        const float(&c)[4] = p[2 * kk + i / 2];
        bf16_split2(float_bits(c[2 * (i % 2)]), float_bits(c[2 * (i % 2) + 1]), pa[kk].big[i],
                    pa[kk].small[i]);
      }
    }
  }
  static __device__ __forceinline__ void publish_z(float* slot, int c, float z) {
    Bf16::publish_z(slot, c, z);
  }
  // d[h] += row g + 8h of the band . z, on the lanes t = 0: as bf16's dot, for each part
  static __device__ __forceinline__ void dot(float (&d)[2], const Frags& a, const float* slot,
                                             const Lane& l) {
    const uint32_t* parts = reinterpret_cast<const uint32_t*>(slot) + (l.g & 1) * kTile / 2;
    float acc[4] = {};
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      const int c = 8 * kk + l.t;
      const uint32_t b0 = l.g < 2 ? parts[c] : 0u, b1 = l.g < 2 ? parts[c + 4] : 0u;
      mma_bf16(acc, a[kk].small, b0, b1);
      mma_bf16(acc, a[kk].big, b0, b1);
    }
    d[0] += acc[0] + acc[1];
    d[1] += acc[2] + acc[3];
  }
  // the warp's 16 x 32 slab of a state to a copy, split (columns c0 + 8j + 2t, + 1: a pair)
  static __device__ __forceinline__ void publish(Op* copy, const float (&s)[4][4], int r0, int c0,
                                                 const Lane& l) {
    auto* parts = reinterpret_cast<__nv_bfloat16*>(copy);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t b, sm;
        bf16_split2(float_bits(s[j][2 * h]), float_bits(s[j][2 * h + 1]), b, sm);
        __nv_bfloat16* at = parts + (r0 + l.g + 8 * h) * kLdParts + c0 + 8 * j + 2 * l.t;
        *reinterpret_cast<uint32_t*>(at) = b;
        *reinterpret_cast<uint32_t*>(at + kTile) = sm;
      }
    }
  }
};

// Readies N tiles of a chunk that landed (one after another; after cp_async_wait_all, before
// the barrier that publishes them; in every thread): bf16x3 splits them (Bf16x3Band::land), the
// other bands take them as they landed.
template <typename B, int N>
__device__ __forceinline__ void land_tiles(typename B::Op* first) {
  if constexpr (std::is_same_v<B, Bf16x3Band>) B::template land<N>(first);
}

template <typename Tin>
using BandOf = std::conditional_t<kSplitOf<Tin> && kFp32Bf16x3, Bf16x3Band,
                                  Band<typename OperandOf<Tin>::type, kSplitOf<Tin>>>;

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
__device__ __forceinline__ void b_pair(typename B::BPair& b, const typename B::Op* T, int c0,
                                       int kk, const Lane& l) {
  if constexpr (B::kBPairLoad) {
    B::template b_pair<kAsStored>(b, T, c0, kk, l);
  } else {
    typename B::Frag a;
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

// A sum over a walk's chunks (a state S or R, z, a group's total) kept in mma accumulators:
// the tensor cores cut each step's sum toward zero rather than round it, a drift toward zero of
// up to an ulp of the state a step (warp_gemm_sum, wmma_ops.cuh). Where B::kPromote (fp32 inputs,
// 3xTF32: 24 steps a chunk) a chunk's products go to `part`, which chunk_sum zeroes and returns,
// and add_chunk adds them to the state in fp32; elsewhere chunk_sum returns the state itself and
// add_chunk does nothing. T: an array of floats (accumulators).
template <typename B, typename T>
__device__ __forceinline__ T& chunk_sum(T& state, T& part) {
  if constexpr (B::kPromote) {
    float* x = reinterpret_cast<float*>(&part);
#pragma unroll
    for (int e = 0; e < static_cast<int>(sizeof(T) / sizeof(float)); ++e) x[e] = 0.f;
    return part;
  } else {
    return state;
  }
}

template <typename B, typename T>
__device__ __forceinline__ void add_chunk(T& state, const T& part) {
  if constexpr (B::kPromote) {
    float* x = reinterpret_cast<float*>(&state);
    const float* y = reinterpret_cast<const float*>(&part);
#pragma unroll
    for (int e = 0; e < static_cast<int>(sizeof(T) / sizeof(float)); ++e) x[e] += y[e];
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
    typename B::BPair b;
    b_pair<B, false>(b, Y + ft * B::kTileElems, 16 * jp, kk, l);
    B::mma(p[2 * jp], ak, b, 0);
    B::mma(p[2 * jp + 1], ak, b, 1);
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
      typename B::BPair b;
      b_pair<B, kAsStored>(b, T, c0 + 16 * jp, kk, l);
      B::mma(acc[2 * jp], ak, b, 0);
      B::mma(acc[2 * jp + 1], ak, b, 1);
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
      if (with_z) B::mma_ones(z[ft], a2k[ft]);
    }
#pragma unroll
    for (int jp = 0; jp < NT / 2; ++jp) {
      typename B::BPair b;
      b_pair<B, true>(b, T, c0 + 16 * jp, kk, l);
      // acc2 first: B's tf32 rounding, in the unconditional products, serves the kept ones
#pragma unroll
      for (int ft = 0; ft < FT; ++ft) {
        B::mma(acc2[ft][2 * jp], a2k[ft], b, 0);
        B::mma(acc2[ft][2 * jp + 1], a2k[ft], b, 1);
      }
      if (kept) {
        B::mma(acc[2 * jp], ak, b, 0);
        B::mma(acc[2 * jp + 1], ak, b, 1);
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

// Kernel 8's walk by thread block `block` (blockIdx.x of kernel 8) of M slice `slice`
// (blockIdx.y).
template <typename Tin, typename Tout, int FT>
__device__ __forceinline__ void walk_mma(int64_t block, int64_t slice, const Tin* __restrict__ q,
                                         const Tin* __restrict__ k, const Tin* __restrict__ v,
                                         const float* __restrict__ carry, Tout* __restrict__ out,
                                         float* __restrict__ den, int64_t n, int64_t f, int64_t m,
                                         int64_t nblk, int64_t cpb, bool reverse, bool normalize,
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
  const WalkSegment seg(block, n, nblk, cpb, reverse);
  const int64_t bh = seg.bh, blk = seg.blk;
  const int64_t m0 = slice * kTile;
  const bool need_den = normalize || den != nullptr;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    TileBatch<Tin, Op, 2 * FT + 1> tiles;  // Q, K slices and V, their loads at once
#pragma unroll
    for (int ft = 0; ft < FT; ++ft) {
      tiles.load(2 * ft, tile(buf, ft), LD, qb, f, n, f, row0, ft * kTile, nullptr, vec_qk);
      tiles.load(2 * ft + 1, tile(buf, FT + ft), LD, kb, f, n, f, row0, ft * kTile, nullptr,
                 vec_qk);
    }
    tiles.load(2 * FT, tile(buf, 2 * FT), LD, vb, m, n, m, row0, m0, nullptr, vec_v);
    tiles.land();
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
    land_tiles<B, kBufTiles>(tile(buf, 0));  // bf16x3: split
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
    {  // S += K^T V and z += K's column sums, each chunk's apart for fp32 inputs (chunk_sum)
      float s_part[FT][4][4], z_part[FT][4];
      band_products_sharing_b<B>(o, pa, chunk_sum<B>(s, s_part), ka, chunk_sum<B>(z, z_part),
                                 need_den, Vs, c0, l, r0, reverse);
      add_chunk<B>(s, s_part);
      add_chunk<B>(z, z_part);
    }

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
    const float2 div = {dn[0] + eps, dn[1] + eps};
    store_band(out + bh * n * m, o, n, m, row0, m0 + c0, normalize, div, pairs, l);
    if (den != nullptr && slice == 0 && c0 == 0 && l.t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row0 + l.g + 8 * h < n) den[bh * n + row0 + l.g + 8 * h] = dn[h];
      }
    }
  }
#endif
}

template <typename Tin, typename Tout, int FT>
__global__ void __launch_bounds__(kThreads, kMmaBlocksPerSm<typename OperandOf<Tin>::type, FT>)
    chunk_walk_mma_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                          const Tin* __restrict__ v, const float* __restrict__ carry,
                          Tout* __restrict__ out, float* __restrict__ den, int64_t n, int64_t f,
                          int64_t m, int64_t nblk, int64_t cpb, bool reverse, bool normalize,
                          float eps, bool vec_qk, bool vec_v) {
  walk_mma<Tin, Tout, FT>(blockIdx.x, blockIdx.y, q, k, v, carry, out, den, n, f, m, nblk, cpb,
                          reverse, normalize, eps, vec_qk, vec_v);
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

// Kernel 9's walk by thread block `block` (blockIdx.x of kernel 9); dk in Tout, dv in Tdv.
template <typename Tin, typename Tout, typename Tdv>
__device__ __forceinline__ void walk_mma_dkv(int64_t block, const Tin* __restrict__ q,
                                             const Tin* __restrict__ k, const Tin* __restrict__ v,
                                             const Tin* __restrict__ g,
                                             const float* __restrict__ carry,
                                             Tout* __restrict__ dk, Tdv* __restrict__ dv,
                                             int64_t n, int64_t f, int64_t m, int64_t nblk,
                                             int64_t cpb, bool vec_f, bool vec_m) {
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
  const WalkSegment seg(block, n, nblk, cpb, true);
  const int64_t bh = seg.bh, blk = seg.blk;
  const Tin* qb = q + bh * n * f;
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  const Tin* gb = g + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    TileBatch<Tin, Op, 4> tiles;  // Q, K, V, G, their loads at once
    tiles.load(0, tile(buf, 0), LD, qb, f, n, f, row0, 0, nullptr, vec_f);
    tiles.load(1, tile(buf, 1), LD, kb, f, n, f, row0, 0, nullptr, vec_f);
    tiles.load(2, tile(buf, 2), LD, vb, m, n, m, row0, 0, nullptr, vec_m);
    tiles.load(3, tile(buf, 3), LD, gb, m, n, m, row0, 0, nullptr, vec_m);
    tiles.land();
    cp_async_commit();
  };
  load_chunk(0, 0);

  float r[4][4];
  carry_slab(r, carry == nullptr ? nullptr : carry + (bh * nblk + blk) * (f * m + f), f, m, r0,
             c0, l);
  B::publish(r_copies, r, r0, c0, l);

  // the warp's gradient rows, dk's (warps 0-3) or dv's, as Tout* (dv's are Tdv's: cast back to
  // store)
  Tout* grad = dk_warp ? dk + bh * n * f : reinterpret_cast<Tout*>(dv + bh * n * m);
  const int64_t width = dk_warp ? f : m;
  const size_t elem = dk_warp ? sizeof(Tout) : sizeof(Tdv);
  const bool pairs = reinterpret_cast<uintptr_t>(grad) % (2 * elem) == 0 && width % 2 == 0;
  for (int64_t i = 0; i < seg.count; ++i) {
    const int buf = static_cast<int>(i & 1);
    cp_async_wait_all();  // chunk i's tiles (the only copies in flight)
    land_tiles<B, 4>(tile(buf, 0));  // bf16x3: split
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
    float r_part[4][4];  // for fp32 inputs, the chunk's apart (chunk_sum)
    band_product<B, 4, true>(chunk_sum<B>(r, r_part), qta, Gs, c0, l);
    add_chunk<B>(r, r_part);
    if (i + 1 < seg.count) B::publish(r_copies + (buf ^ 1) * kOpTile, r, r0, c0, l);

    const int64_t row0 = seg.chunk(i) * kTile + r0;
    if (std::is_same_v<Tout, Tdv> || dk_warp) {
      store_band(grad, o, n, width, row0, 0, false, float2{1.f, 1.f}, pairs, l);
    } else {
      store_band(reinterpret_cast<Tdv*>(grad), o, n, width, row0, 0, false, float2{1.f, 1.f},
                 pairs, l);
    }
  }
#endif
}

template <typename Tin, typename Tout, typename Tdv>
__global__ void __launch_bounds__(kThreads, kMmaBlocksPerSm<typename OperandOf<Tin>::type>)
    chunk_walk_mma_dkv_kernel(const Tin* __restrict__ q, const Tin* __restrict__ k,
                              const Tin* __restrict__ v, const Tin* __restrict__ g,
                              const float* __restrict__ carry, Tout* __restrict__ dk,
                              Tdv* __restrict__ dv, int64_t n, int64_t f, int64_t m,
                              int64_t nblk, int64_t cpb, bool vec_f, bool vec_m) {
  walk_mma_dkv<Tin, Tout, Tdv>(blockIdx.x, q, k, v, g, carry, dk, dv, n, f, m, nblk, cpb, vec_f,
                               vec_m);
}

// ------------------------------------------------------------------ kernel 12: register carries
// Kernel 1 for the carries of the register walks (walk_carries for kernels 8, 9 and 10): the
// totals of groups of cpb chunks of (k, v), S = sum of K_c^T V_c (row-major F x M) and, with
// `with_z`, z = the sum of K_c's rows (else 0), with no prefixes and no key padding. Warp w sums
// the 16 x 32 slab of S at features f0 + 16 (w % 4) .., columns m0 + 32 (w / 4) .. in fp32
// accumulators for the whole group, its A fragments (K^T's rows) loaded a k-step at a time, and
// warps 0-3 of M slice 0 the z of their features (K^T 1 beside K^T V, as kernel 8). Per chunk:
// one barrier, 16 products a warp in bf16 (4 k-steps of m16n8k16 over 4 n-tiles), no staging
// through shared memory. Grid, `skip` and totals as kernel 1: grid.x = BH * (nblk - skip),
// grid.y = ceil(F/64) * ceil(M/64). Shared: two buffers of (K tile, V tile), 64 x LD operand
// tiles (37 KB in bf16, 70 KB with fp32 tiles).
template <typename Op>
constexpr size_t mma_states_smem() {
  return mma_smem<Op>(4, 0);
}
// Four blocks an SM with bf16 tiles, as kernel 1 (the walk's carry pass of about 512 blocks in
// one wave on 132 SMs); fp32 tiles (3xTF32) no minimum.
template <typename Op>
constexpr int kMmaStatesBlocksPerSm = sizeof(Op) == 2 ? 4 : 0;

template <typename Tin>
__global__ void __launch_bounds__(kThreads, kMmaStatesBlocksPerSm<typename OperandOf<Tin>::type>)
    chunk_states_mma_kernel(const Tin* __restrict__ k, const Tin* __restrict__ v,
                            float* __restrict__ totals, int64_t n, int64_t f, int64_t m,
                            int64_t nblk, int64_t cpb, bool reverse, bool with_z, int64_t skip,
                            bool vec_k, bool vec_v) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using Op = typename OperandOf<Tin>::type;
  using B = BandOf<Tin>;
  constexpr int LD = ld_of<Op>();
  constexpr int kOpTile = kTile * LD;
  KS_DYNAMIC_SMEM(smem);
  Op* tiles = reinterpret_cast<Op*>(smem);  // buffer b: K at 2b, V at 2b + 1

  const Lane l;
  const int warp = threadIdx.x / 32;
  const int r0 = 16 * (warp % 4), c0 = 32 * (warp / 4);
  const WalkSegment seg(blockIdx.x, n, nblk, cpb, reverse, skip);
  const int64_t bh = seg.bh;
  const int64_t m_tiles = (m + kTile - 1) / kTile;
  const int64_t f0 = (blockIdx.y / m_tiles) * kTile;
  const int64_t m0 = (blockIdx.y % m_tiles) * kTile;
  const bool z_warp = m0 == 0 && c0 == 0;  // the same in the whole warp
  const Tin* kb = k + bh * n * f;
  const Tin* vb = v + bh * n * m;
  auto load_chunk = [&](int64_t i, int buf) {
    const int64_t row0 = seg.chunk(i) * kTile;
    TileBatch<Tin, Op, 2> kv;  // K, V, their loads at once
    kv.load(0, tiles + 2 * buf * kOpTile, LD, kb, f, n, f, row0, f0, nullptr, vec_k);
    kv.load(1, tiles + (2 * buf + 1) * kOpTile, LD, vb, m, n, m, row0, m0, nullptr, vec_v);
    kv.land();
    cp_async_commit();
  };
  load_chunk(0, 0);

  float s[4][4] = {}, z[1][4] = {};  // z[0]: as z's accumulators of kernel 8
  for (int64_t i = 0; i < seg.count; ++i) {
    const int buf = static_cast<int>(i & 1);
    cp_async_wait_all();  // chunk i's tiles (the only copies in flight)
    land_tiles<B, 2>(tiles + 2 * buf * kOpTile);  // bf16x3: split
    __syncthreads();      // ... visible to all; chunk i-1's buffer is free
    if (i + 1 < seg.count) load_chunk(i + 1, buf ^ 1);
    const Op* Ks = tiles + 2 * buf * kOpTile;
    const Op* Vs = Ks + kOpTile;
    float s_part[4][4], z_part[1][4];  // for fp32 inputs, the chunk's apart (chunk_sum)
    float(&sc)[4][4] = chunk_sum<B>(s, s_part);
    float(&zc)[4] = chunk_sum<B>(z, z_part)[0];
#pragma unroll
    for (int kk = 0; kk < B::kSteps; ++kk) {  // k: the chunk's rows
      typename B::Frag a;
      B::columns(a, Ks, r0, kk, l);  // K^T's rows r0 .. (features f0 + r0 ..)
      const typename B::Ready ak = B::ready(a);
      if (with_z && z_warp) B::mma_ones(zc, ak);
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        typename B::BPair b;
        b_pair<B, true>(b, Vs, c0 + 16 * jp, kk, l);
        B::mma(sc[2 * jp], ak, b, 0);
        B::mma(sc[2 * jp + 1], ak, b, 1);
      }
    }
    add_chunk<B>(s, s_part);
    add_chunk<B>(z, z_part);
  }

  // the slab (rows f0 + r0 + g + 8h, columns m0 + c0 + 8j + 2t + e) and z (every column of z's
  // accumulators holds the row's sum) to the group's totals
  float* out = totals + (bh * nblk + seg.blk) * (f * m + f);
  const int in_cols = extent_in(m - m0 - c0);  // of the slab's 32 columns
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = f0 + r0 + l.g + 8 * h;
    if (row >= f) continue;
    float* dst = out + row * m + m0 + c0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * l.t + e;
        if (col < in_cols) dst[col] = s[j][2 * h + e];
      }
    }
    if (z_warp && l.t == 0) out[f * m + row] = with_z ? z[0][2 * h] : 0.f;
  }
#endif
}

}  // namespace
}  // namespace ks_cuda
