// The host side of the kernels for one input type: layouts of the workspaces, the choice of
// kernels and their launches, and Launchers<Tin> (launchers_by_dtype.h) at the end. Included
// by float32.cu, float16.cu and bfloat16.cu, each instantiating one type's Launchers (and so
// its kernels); linear_attention.cu describes the kernels and dispatches on the dtype. Everything
// but Launchers is internal to the translation unit that includes it.
#pragma once

#include "config.cuh"
#include "wmma_ops.cuh"
#include "tiles.cuh"
#include "mma_sync.cuh"
#include "chunk_kernels.cuh"
#include "walk_kernels.cuh"
#include "register_walk_kernels.cuh"
#include "backward_walks_kernels.cuh"
#include "cumsum_kernels.cuh"
#include "normalizer_kernels.cuh"
#include "launchers_by_dtype.h"

namespace ks_cuda {
namespace {

// ------------------------------------------------------------------ host helpers
int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Rows of a (BH, N, D) tensor of T are 16-byte aligned when the base is and D is whole vectors.
template <typename T>
bool rows_vectorizable(const void* p, int64_t d) {
  return aligned16(p) && d % vec_elems<T>() == 0;
}

constexpr int64_t kMaxBlocks = (int64_t{1} << 31) - 1;

// Dynamic shared memory of a kernel with `tiles` operand tiles (64 x LD) and one fp32 64 x kLdF
// tile, plus `floats` more floats.
template <typename Tin>
size_t tiles_smem(int tiles, int floats = 0) {
  using Op = typename OperandOf<Tin>::type;
  return tiles * kTile * ld_of<Op>() * sizeof(Op) + (kTile * kLdF + floats) * sizeof(float);
}

template <typename Tin>
size_t states_smem() {
  return tiles_smem<Tin>(4);  // two buffers of (K, V)
}

template <typename Tin>
size_t output_smem() {
  return tiles_smem<Tin>(4, 2 * kTile);  // Q, K, S, V; z and den
}

// Causal state layout. A sequence's nc chunks are split into nblk blocks of cpb consecutive
// chunks; nblk is chosen from the shape alone (so results do not depend on the GPU) to give
// about KS_CHUNK_BLOCKS (1024, config.cuh) thread blocks to the state pass: B·H = 1 at long N
// still fills the GPU.

struct CausalLayout {
  int64_t nc, cpb, nblk, ss;
  int64_t totals, prefix_z, prefix_s;  // float offsets of the workspace regions
  int64_t floats;                      // workspace size in floats
};

int64_t round_up(int64_t x, int64_t to) { return cdiv(x, to) * to; }

// Groups a sequence's nc chunks into nblk groups of cpb consecutive chunks (1 <= nblk <= nc) so
// that about `target` thread blocks run, `per_group` of them (over all sequences) per group.
struct ChunkGroups {
  int64_t cpb, nblk;
};
ChunkGroups group_chunks(int64_t nc, int64_t target, int64_t per_group) {
  int64_t want = cdiv(target, per_group);
  want = want < 1 ? 1 : (want > nc ? nc : want);
  const int64_t cpb = cdiv(nc, want);
  return {cpb, cdiv(nc, cpb)};
}

CausalLayout causal_layout(int64_t bh, int64_t n, int64_t f, int64_t m, size_t state_bytes) {
  CausalLayout l;
  l.nc = cdiv(n, kChunk);
  const ChunkGroups g = group_chunks(l.nc, KS_CHUNK_BLOCKS, bh * cdiv(f, kTile) * cdiv(m, kTile));
  l.cpb = g.cpb;
  l.nblk = g.nblk;
  l.ss = f * m + f;
  l.totals = 0;  // fp32 [bh][nblk][ss]: block totals, then (in place) the carries
  l.prefix_z = round_up(bh * l.nblk * l.ss, 64);                     // fp32 [bh][nc][F]
  l.prefix_s = l.prefix_z + round_up(bh * l.nc * f, 64);             // Tstate [bh][nc][F*M]
  l.floats = l.prefix_s + round_up(cdiv(bh * l.nc * f * m * static_cast<int64_t>(state_bytes),
                                        sizeof(float)), 64);
  return l;
}

// Chunk states are stored in the operand type: fp32 for fp32 and fp16 inputs, bf16 for bf16
// inputs (they are rounded to bf16 as MMA operands anyway).
template <typename Tin>
using StateOf = typename OperandOf<Tin>::type;

// Sets the kernel's dynamic shared memory limit and launches it on a (blocks, slices) grid.
template <typename... Params, typename... Args>
cudaError_t launch_tiles(void (*kernel)(Params...), int64_t blocks, int64_t slices, size_t smem,
                         cudaStream_t stream, Args... args) {
  if (blocks > kMaxBlocks || slices > 65535) return cudaErrorInvalidConfiguration;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  KS_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(slices)), kThreads,
            smem, stream)(args...);
  return cudaGetLastError();
}

// Kernel 1 over groups of cpb chunks, the `skip` groups that come last in the order left out;
// v in Tv (Tin unless given: fp32 for the non-causal backward's [dS | dz], on fp32 tiles).
template <typename Tin, typename Tstate, typename Tv = Tin>
cudaError_t launch_states(const Tin* k, const Tv* v, const bool* keep, int64_t heads,
                          float* totals, Tstate* prefix_s, float* prefix_z, int64_t bh, int64_t n,
                          int64_t f, int64_t m, int64_t cpb, bool reverse, bool with_z,
                          int64_t skip, cudaStream_t stream) {
  const int64_t nblk = cdiv(cdiv(n, kChunk), cpb);
  return launch_tiles(chunk_states_kernel<Tin, Tstate, Tv>, bh * (nblk - skip),
                      cdiv(f, kTile) * cdiv(m, kTile), states_smem<Tv>(), stream, k, v, keep,
                      heads, totals, prefix_s, prefix_z, n, f, m, nblk, cpb, reverse, with_z,
                      skip, rows_vectorizable<Tin>(k, f), rows_vectorizable<Tv>(v, m));
}

// Kernel 2 over `groups` totals a sequence: their sum, or the carries of segments of `per`
// groups (in place where per = 1 and out = states).
cudaError_t launch_scan(const float* states, float* out, int64_t bh, int64_t groups, int64_t per,
                        int64_t ss, int mode, cudaStream_t stream) {
  const int64_t blocks = bh * cdiv(ss, kThreads);
  if (blocks > kMaxBlocks) return cudaErrorInvalidConfiguration;
  KS_LAUNCH(state_scan_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream)(
      states, out, groups, per, ss, mode);
  return cudaGetLastError();
}

// Kernels 1 and 2 for the chunk kernels: the block totals of (k, v) over groups of cpb chunks
// with every chunk's block-local exclusive prefix (prefix_s, prefix_z), then in place the
// exclusive prefix (suffix with `reverse`) of the totals: the carry of each group.
template <typename Tin, typename Tstate>
cudaError_t launch_carries(const Tin* k, const Tin* v, float* totals, Tstate* prefix_s,
                           float* prefix_z, int64_t bh, int64_t n, int64_t f, int64_t m,
                           int64_t cpb, bool reverse, bool with_z, cudaStream_t stream) {
  cudaError_t err = launch_states<Tin, Tstate>(k, v, nullptr, 1, totals, prefix_s, prefix_z, bh,
                                               n, f, m, cpb, reverse, with_z, 0, stream);
  if (err != cudaSuccess) return err;
  return launch_scan(totals, totals, bh, cdiv(cdiv(n, kChunk), cpb), 1, f * m + f,
                     reverse ? kExclusiveReverse : kExclusiveForward, stream);
}

// Kernel 3; `bias`, `keep` and `heads` for the non-causal read-outs (null, null, 1: none).
template <typename Tin, typename Tstate, typename Tout>
cudaError_t launch_output(const Tin* q, const Tin* k, const Tin* v, const Tstate* s_base,
                          int64_t s_stride, const float* z_base, int64_t z_stride,
                          const float* carry, int64_t cpb, Tout* out, float* den,
                          const float* bias, const bool* keep, int64_t heads, int64_t bh,
                          int64_t n, int64_t f, int64_t m, int mode, bool normalize, float eps,
                          cudaStream_t stream) {
  const bool vec_qk =
      rows_vectorizable<Tin>(q, f) && (k == nullptr || rows_vectorizable<Tin>(k, f));
  const bool vec_v = v != nullptr && rows_vectorizable<Tin>(v, m);
  const bool vec_s = rows_vectorizable<Tstate>(s_base, m) && s_stride % vec_elems<Tstate>() == 0;
  return launch_tiles(chunk_output_kernel<Tin, Tstate, Tout>, bh * cdiv(n, kTile), cdiv(m, kTile),
                      output_smem<Tin>(), stream, q, k, v, s_base, s_stride, z_base, z_stride,
                      carry, cpb, out, den, bias, keep, heads, n, f, m, mode, normalize, eps,
                      vec_qk, vec_v, vec_s);
}

// The walk (kernel 6): whether it runs for these inputs, its segments and its workspace.
// Segments: a sequence's nc chunks are split into nblk segments of cpb consecutive chunks so
// that about `walk_blocks` thread blocks walk at once (nblk = 1 where B·H·ceil(M/64) reaches it;
// B·H = 1 at long N is split as far as one chunk per segment). The split depends on the shape
// and walk_blocks alone, so results do not depend on the GPU.
constexpr int kWalkMaxSlices = 2;  // F <= 128

template <typename Tin>
size_t walk_smem(int64_t f) {
  using Op = typename OperandOf<Tin>::type;
  return cdiv(f, kTile) == 1 ? WalkSmem<Op, 1>::bytes() : WalkSmem<Op, 2>::bytes();
}

// The current device's shared memory per block (opt-in), 0 if it cannot be read.
size_t smem_optin() {
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    cudaGetLastError();  // clear the error: the chunked kernels run instead
    return 0;
  }
  return static_cast<size_t>(optin);
}

// The walk that computes a causal product: with walk_blocks > 0, kernel 8 where mma_walk asks
// for it, it covers F and its shared memory fits the device, else kernel 6 where it covers F
// and fits; none (the chunk kernels) otherwise.
enum class Walk { kNone, kWmma, kMma };

template <typename Tin>
Walk causal_walk(int64_t f, int64_t walk_blocks, bool mma_walk) {
  using Op = typename OperandOf<Tin>::type;
  if (walk_blocks <= 0) return Walk::kNone;
  const size_t optin = smem_optin();
  const int ft = mma_walk ? mma_walk_slices<Op>(f) : 0;
  if (ft > 0 && mma_walk_smem<Op>(ft) <= optin) return Walk::kMma;
  if (cdiv(f, kTile) <= kWalkMaxSlices && walk_smem<Tin>(f) <= optin) return Walk::kWmma;
  return Walk::kNone;
}

// Kernel 7's shared-memory layout for F and M: two buffers where they fit, else one, and with
// them two staging tiles where they fit, else one; nbuf = 0 where F or M exceeds 128 or even one
// buffer and one tile do not fit (the backward then walks dk and dv separately).
template <typename Tin>
DkvSmem<typename OperandOf<Tin>::type> dkv_smem(int64_t f, int64_t m) {
  DkvSmem<typename OperandOf<Tin>::type> lay{0, 0, 0, 0};
  if (cdiv(f, kTile) > kWalkMaxSlices || cdiv(m, kTile) > kWalkMaxSlices) return lay;
  lay.ft = static_cast<int>(cdiv(f, kTile));
  lay.mt = static_cast<int>(cdiv(m, kTile));
  const size_t optin = smem_optin();
  for (lay.nbuf = 2; lay.nbuf >= 1; --lay.nbuf) {  // a second buffer before a second stage
    for (lay.stages = 2; lay.stages >= 1; --lay.stages) {
      if (lay.bytes() <= optin) return lay;
    }
  }
  return lay;  // nbuf = 0
}

// The walk's carry pass (kernel 1, or 12 for the register walks) sums each segment in groups of
// cpg chunks, so that each of its thread blocks adds cpg chunks one after another, not cpb. cpg
// is the smallest divisor of cpb that keeps
//   - the pass at or below about KS_CARRY_BLOCKS (512) blocks, about four for each of an H100's
//     SMs, which hold four of kernel 1's or 12's blocks at once with bf16 tiles
//     (kStatesBlocksPerSm, kMmaStatesBlocksPerSm) and two (kernel 12: three) with fp32 tiles
//     (cpg = cpb, one group a segment, where the segments alone reach it);
//   - a sequence at or below kCarryGroups groups (or nblk, where the segments alone are more):
//     kernel 2, which then adds the groups up into the carries, reads a sequence's groups one
//     batch of 8 after another, so more groups lengthen its chain as fewer chunks a group
//     shorten kernel 1's.
// The grouping, like the segments, depends on the shape alone, so results do not depend on the
// GPU.
constexpr int64_t kCarryGroups = 128;

struct WalkLayout {
  int64_t cpb, nblk;     // segments: nblk a sequence, of cpb chunks (the last one shorter)
  int64_t cpg, groups;   // the carry pass: groups of cpg chunks, `groups` a sequence
  int64_t per;           // groups a segment (cpb / cpg)
  int64_t carries;       // float offset of the carries ([bh][nblk][F*M+F]), after the totals
                         // ([bh][groups][F*M+F]); 0 where per = 1 (in place over the totals)
  int64_t floats;        // workspace: 0 where nblk = 1 (no carries)
};

// `slices`: thread blocks per segment (kernel 6: one per 64-wide M slice; kernel 7: one).
WalkLayout walk_layout(int64_t bh, int64_t n, int64_t f, int64_t m, int64_t walk_blocks,
                       int64_t slices) {
  const int64_t nc = cdiv(n, kChunk);
  const ChunkGroups g = group_chunks(nc, walk_blocks, bh * slices);
  WalkLayout l{g.cpb, g.nblk, g.cpb, g.nblk, 1, 0, 0};
  if (l.nblk == 1) return l;
  // kernel 1's blocks with one group a segment (the last segment in the walk's order is not
  // summed: no carry includes it), and how many groups a segment would keep them near the target
  const int64_t blocks = bh * (l.nblk - 1) * cdiv(f, kTile) * cdiv(m, kTile);
  const int64_t target = KS_CARRY_BLOCKS;
  const int64_t split = std::max<int64_t>(1, std::min(target / blocks, l.cpb));
  l.cpg = std::max(cdiv(l.cpb, split), cdiv(nc, std::max(kCarryGroups, l.nblk)));
  while (l.cpb % l.cpg != 0) ++l.cpg;  // cdiv(nc, nblk) <= cpb, which divides itself
  l.per = l.cpb / l.cpg;
  l.groups = cdiv(nc, l.cpg);
  const int64_t ss = f * m + f;
  if (l.per == 1) {
    l.floats = bh * l.nblk * ss;
  } else {
    l.carries = round_up(bh * l.groups * ss, 64);
    l.floats = l.carries + bh * l.nblk * ss;
  }
  return l;
}

// Kernel 12 over groups of cpb chunks, the `skip` groups that come last in the order left out.
template <typename Tin>
cudaError_t launch_states_mma(const Tin* k, const Tin* v, float* totals, int64_t bh, int64_t n,
                              int64_t f, int64_t m, int64_t cpb, bool reverse, bool with_z,
                              int64_t skip, cudaStream_t stream) {
  const int64_t nblk = cdiv(cdiv(n, kChunk), cpb);
  return launch_tiles(chunk_states_mma_kernel<Tin>, bh * (nblk - skip),
                      cdiv(f, kTile) * cdiv(m, kTile),
                      mma_states_smem<typename OperandOf<Tin>::type>(), stream, k, v, totals, n,
                      f, m, nblk, cpb, reverse, with_z, skip, rows_vectorizable<Tin>(k, f),
                      rows_vectorizable<Tin>(v, m));
}

// The carries of a walk's segments of (k, v) into ws, in `*carry`; null where each sequence is
// a single segment. The groups' totals by kernel 12 for the register walks (`mma`: kernels 8-10),
// else by kernel 1; then kernel 2.
template <typename Tin>
cudaError_t walk_carries(const Tin* k, const Tin* v, float* ws, const WalkLayout& l, int64_t bh,
                         int64_t n, int64_t f, int64_t m, bool reverse, bool with_z, bool mma,
                         const float** carry, cudaStream_t stream) {
  *carry = nullptr;
  if (l.nblk == 1) return cudaSuccess;
  // the groups of the segment that comes last in the walk's order are not summed
  const int64_t skip = reverse ? l.per : l.groups - (l.nblk - 1) * l.per;
  cudaError_t err =
      mma ? launch_states_mma<Tin>(k, v, ws, bh, n, f, m, l.cpg, reverse, with_z, skip, stream)
          : launch_states<Tin, StateOf<Tin>>(k, v, nullptr, 1, ws, nullptr, nullptr, bh, n, f, m,
                                             l.cpg, reverse, with_z, skip, stream);
  if (err != cudaSuccess) return err;
  *carry = ws + l.carries;
  return launch_scan(ws, ws + l.carries, bh, l.groups, l.per, f * m + f,
                     reverse ? kExclusiveReverse : kExclusiveForward, stream);
}

// Kernel 6 for F features (one or two slices).
template <typename Tin, typename Tout>
auto walk_kernel_for(int64_t f) {
  return cdiv(f, kTile) == 1 ? chunk_walk_kernel<Tin, Tout, 1> : chunk_walk_kernel<Tin, Tout, 2>;
}

// Kernel 8 for ft feature slices (mma_walk_slices).
template <typename Tin, typename Tout>
auto walk_mma_kernel_for(int ft) {
  auto kernel = chunk_walk_mma_kernel<Tin, Tout, 1>;
  if constexpr (mma_walk_slices<typename OperandOf<Tin>::type>(2 * kTile) == 2) {
    if (ft == 2) kernel = chunk_walk_mma_kernel<Tin, Tout, 2>;
  }
  return kernel;
}

template <typename Tin, typename Tout>
cudaError_t launch_walk(const Tin* q, const Tin* k, const Tin* v, const float* carry, Tout* out,
                        float* den, int64_t bh, int64_t n, int64_t f, int64_t m, int64_t nblk,
                        int64_t cpb, bool reverse, bool normalize, float eps,
                        cudaStream_t stream) {
  const bool vec_qk = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_v = rows_vectorizable<Tin>(v, m);
  return launch_tiles(walk_kernel_for<Tin, Tout>(f), bh * nblk, cdiv(m, kTile), walk_smem<Tin>(f),
                      stream, q, k, v, carry, out, den, n, f, m, nblk, cpb, reverse, normalize,
                      eps, vec_qk, vec_v);
}

template <typename Tin, typename Tout>
cudaError_t launch_walk_mma(const Tin* q, const Tin* k, const Tin* v, const float* carry,
                            Tout* out, float* den, int64_t bh, int64_t n, int64_t f, int64_t m,
                            int64_t nblk, int64_t cpb, bool reverse, bool normalize, float eps,
                            cudaStream_t stream) {
  using Op = typename OperandOf<Tin>::type;
  const bool vec_qk = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_v = rows_vectorizable<Tin>(v, m);
  const int ft = mma_walk_slices<Op>(f);
  return launch_tiles(walk_mma_kernel_for<Tin, Tout>(ft), bh * nblk, cdiv(m, kTile),
                      mma_walk_smem<Op>(ft), stream, q, k, v, carry, out, den, n, f, m, nblk, cpb,
                      reverse, normalize, eps, vec_qk, vec_v);
}

// The causal product by kernel 6 or 8 (`mma`): the carries of the segments (kernels 1 and 2,
// totals only) where the sequence is split, then one walk per segment.
template <typename Tin>
cudaError_t walk_typed(const Tin* q, const Tin* k, const Tin* v, void* out, bool out_fp32,
                       float* den, bool normalize, float eps, float* ws, int64_t bh, int64_t n,
                       int64_t f, int64_t m, bool reverse, int64_t walk_blocks, bool mma,
                       cudaStream_t stream) {
  const WalkLayout l = walk_layout(bh, n, f, m, walk_blocks, cdiv(m, kTile));
  const float* carry;
  const cudaError_t err = walk_carries(k, v, ws, l, bh, n, f, m, reverse,
                                       normalize || den != nullptr, mma, &carry, stream);
  if (err != cudaSuccess) return err;
  if (mma) {
    if (out_fp32) {
      return launch_walk_mma<Tin, float>(q, k, v, carry, static_cast<float*>(out), den, bh, n, f,
                                         m, l.nblk, l.cpb, reverse, normalize, eps, stream);
    }
    return launch_walk_mma<Tin, Tin>(q, k, v, carry, static_cast<Tin*>(out), den, bh, n, f, m,
                                     l.nblk, l.cpb, reverse, normalize, eps, stream);
  }
  if (out_fp32) {
    return launch_walk<Tin, float>(q, k, v, carry, static_cast<float*>(out), den, bh, n, f, m,
                                   l.nblk, l.cpb, reverse, normalize, eps, stream);
  }
  return launch_walk<Tin, Tin>(q, k, v, carry, static_cast<Tin*>(out), den, bh, n, f, m, l.nblk,
                               l.cpb, reverse, normalize, eps, stream);
}

template <typename Tin>
cudaError_t causal_typed(const void* q, const void* k, const void* v, void* out, bool out_fp32,
                         float* den, bool normalize, float eps, float* ws, int64_t bh, int64_t n,
                         int64_t f, int64_t m, bool reverse, int64_t walk_blocks,
                         bool mma_walk, cudaStream_t stream) {
  using Tstate = StateOf<Tin>;
  const Tin* qt = static_cast<const Tin*>(q);
  const Tin* kt = static_cast<const Tin*>(k);
  const Tin* vt = static_cast<const Tin*>(v);
  const Walk walk = causal_walk<Tin>(f, walk_blocks, mma_walk);
  if (walk != Walk::kNone) {
    return walk_typed<Tin>(qt, kt, vt, out, out_fp32, den, normalize, eps, ws, bh, n, f, m,
                           reverse, walk_blocks, walk == Walk::kMma, stream);
  }
  const CausalLayout l = causal_layout(bh, n, f, m, sizeof(Tstate));
  float* totals = ws + l.totals;
  float* prefix_z = ws + l.prefix_z;
  Tstate* prefix_s = reinterpret_cast<Tstate*>(ws + l.prefix_s);
  // 1. block-local exclusive prefixes per chunk and block totals (z, the key sums, only where
  //    the normalizer is wanted: the output kernel reads them only then; otherwise they stay 0);
  // 2. carries: exclusive prefix (suffix) of the block totals, in place
  const bool with_z = normalize || den != nullptr;
  const cudaError_t err = launch_carries<Tin, Tstate>(kt, vt, totals, prefix_s, prefix_z, bh, n,
                                                      f, m, l.cpb, reverse, with_z, stream);
  if (err != cudaSuccess) return err;
  // 3. outputs
  const int mode = reverse ? kAntiCausal : kCausal;
  if (out_fp32) {
    return launch_output<Tin, Tstate, float>(qt, kt, vt, prefix_s, f * m, prefix_z, f, totals,
                                             l.cpb, static_cast<float*>(out), den, nullptr,
                                             nullptr, 1, bh, n, f, m, mode, normalize, eps,
                                             stream);
  }
  return launch_output<Tin, Tstate, Tin>(qt, kt, vt, prefix_s, f * m, prefix_z, f, totals, l.cpb,
                                         static_cast<Tin*>(out), den, nullptr, nullptr, 1, bh, n,
                                         f, m, mode, normalize, eps, stream);
}

// The fused backward: states S of (k, v) forward and R of (q, g) in reverse (block-local
// prefixes, then the carries), then dq and dk (kernel 4, in Tout) and dv (kernel 5, in Tdv).
template <typename Tin, typename Tout, typename Tdv>
cudaError_t backward_typed(const Tin* q, const Tin* k, const Tin* v, const Tin* g, Tout* dq,
                           Tout* dk, Tdv* dv, float* ws, int64_t bh, int64_t n, int64_t f,
                           int64_t m, cudaStream_t stream) {
  using Tstate = StateOf<Tin>;
  const CausalLayout l = causal_layout(bh, n, f, m, sizeof(Tstate));
  ChunkStates st[2];
  for (int d = 0; d < 2; ++d) {  // d = 0: S of (k, v); d = 1: R of (q, g), in reverse
    float* w = ws + d * l.floats;
    Tstate* prefix = reinterpret_cast<Tstate*>(w + l.prefix_s);
    const bool reverse = d == 1;
    const cudaError_t err =
        launch_carries<Tin, Tstate>(reverse ? q : k, reverse ? g : v, w + l.totals, prefix,
                                    w + l.prefix_z, bh, n, f, m, l.cpb, reverse, false, stream);
    if (err != cudaSuccess) return err;
    st[d] = ChunkStates{prefix, w + l.totals};
  }
  const bool vec_f = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_m = rows_vectorizable<Tin>(v, m) && rows_vectorizable<Tin>(g, m);
  const bool vec_s = rows_vectorizable<Tstate>(st[0].prefix, m) &&
                     rows_vectorizable<Tstate>(st[1].prefix, m);
  const int64_t blocks = bh * l.nc;
  cudaError_t err = launch_tiles(chunk_dqk_kernel<Tin, Tstate, Tout>, blocks, cdiv(f, kTile),
                                 tiles_smem<Tin>(4), stream, q, k, v, g, st[0], st[1], l.cpb, dq,
                                 dk, n, f, m, vec_f, vec_m, vec_s);
  if (err != cudaSuccess) return err;
  return launch_tiles(chunk_dv_kernel<Tin, Tstate, Tdv>, blocks, cdiv(m, kTile),
                      tiles_smem<Tin>(3), stream, q, k, g, st[1], l.cpb, dv, n, f, m, vec_f,
                      vec_m, vec_s);
}

// Whether the walk's fused backward takes kernel 9 for dk and dv (else kernel 7 or two
// anti-causal products): with mma_walk, F and M <= 64 and its shared memory on this device.
template <typename Tin>
bool dkv_by_mma(int64_t f, int64_t m, bool mma_walk) {
  return mma_walk && f <= kTile && m <= kTile &&
         mma_dkv_smem<typename OperandOf<Tin>::type>() <= smem_optin();
}

// The kernel that runs the walk's fused backward's dq walk and dk, dv walk as one grid, 0 for
// none: where asked for (`together`), with bf16 operand tiles and F, M <= 64 (one slice each),
// and where an SM holds two of its blocks at once (its shared memory taken as the opt-in limit
// of a block plus the 1 KB reserved per block, as on current GPUs): kernel 10 with mma_walk,
// else kernel 11. Where two blocks fit, so do kernels 8 and 9 (or 6 and 7) alone: the two
// launches it replaces would have run them.
template <typename Tin>
int together_kernel(int64_t f, int64_t m, bool mma_walk, bool together) {
  using Op = typename OperandOf<Tin>::type;
  if (!together || sizeof(Op) != 2 || f > kTile || m > kTile) return 0;
  const size_t smem = mma_walk ? mma_backward_smem<Op>() : walk_backward_smem<Op>();
  if (2 * (smem + 1024) > smem_optin() + 1024) return 0;
  return mma_walk ? 10 : 11;
}

// The segments of kernel 10's or 11's two walks: dq's (features M, values F) and dk, dv's; the
// carries of dq's come first in the workspace, then those of dk, dv's.
struct TogetherLayout {
  WalkLayout dq, dkv;
};
TogetherLayout together_layout(int64_t bh, int64_t n, int64_t f, int64_t m, int64_t walk_blocks) {
  return {walk_layout(bh, n, m, f, walk_blocks, 1), walk_layout(bh, n, f, m, walk_blocks, 1)};
}

// Kernel 10 or 11 (together_kernel's number), dq and dk in Tout, dv in Tdv, and its shared
// memory per block.
template <typename Tin, typename Tout, typename Tdv>
auto together_kernel_for(int kernel) {
  return kernel == 10 ? chunk_walk_mma_backward_kernel<Tin, Tout, Tdv>
                      : chunk_walk_backward_kernel<Tin, Tout, Tdv>;
}
template <typename Op>
size_t together_smem(int kernel) {
  return kernel == 10 ? mma_backward_smem<Op>() : walk_backward_smem<Op>();
}

// Kernel 10 or 11 (together_kernel): the carries of both walks' segments, then one launch.
template <typename Tin, typename Tout, typename Tdv>
cudaError_t walk_backward_together(int kernel, const Tin* q, const Tin* k, const Tin* v,
                                   const Tin* g, Tout* dq, Tout* dk, Tdv* dv, float* ws,
                                   int64_t bh, int64_t n, int64_t f, int64_t m,
                                   int64_t walk_blocks, cudaStream_t stream) {
  using Op = typename OperandOf<Tin>::type;
  if constexpr (sizeof(Op) == 2) {
    const TogetherLayout l = together_layout(bh, n, f, m, walk_blocks);
    const float *dq_carry, *dkv_carry;
    const bool mma = kernel == 10;
    cudaError_t err =
        walk_carries(v, k, ws, l.dq, bh, n, m, f, false, false, mma, &dq_carry, stream);
    if (err != cudaSuccess) return err;
    err = walk_carries(q, g, ws + l.dq.floats, l.dkv, bh, n, f, m, true, false, mma, &dkv_carry,
                       stream);
    if (err != cudaSuccess) return err;
    BackwardWalks<Tin, Tout, Tdv> args{q, k, v, g, dkv_carry, dq_carry, dq, dk, dv, n, f, m};
    args.dkv_blocks = bh * l.dkv.nblk;
    args.dkv_nblk = l.dkv.nblk;
    args.dkv_cpb = l.dkv.cpb;
    args.dq_nblk = l.dq.nblk;
    args.dq_cpb = l.dq.cpb;
    args.vec_f = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
    args.vec_m = rows_vectorizable<Tin>(v, m) && rows_vectorizable<Tin>(g, m);
    args.vec_k = rows_vectorizable<Tin>(k, f);
    return launch_tiles(together_kernel_for<Tin, Tout, Tdv>(kernel),
                        args.dkv_blocks + bh * l.dq.nblk, 1, together_smem<Op>(kernel), stream,
                        args);
  }
  return cudaErrorInvalidValue;  // together_kernel is 0
}

// The walk's fused backward: dq, dk and dv by kernel 10 or 11 where together_kernel says; else
// dq = causal(g, v, k) by kernel 6 (or 8, as causal_walk selects), then dk and dv by one reverse
// walk with the carries of (q, g) where a sequence is cut into segments: kernel 9 with mma_walk
// where F, M <= 64 and it fits, else kernel 7; where neither fits, dk = anticausal(v, g, q) and
// dv = anticausal(k, q, g). The steps run in order on `stream` and share the workspace. dq and dk
// in Tout, dv in Tdv (each Tin or float).
template <typename Tin, typename Tout, typename Tdv>
cudaError_t walk_backward_typed(const Tin* q, const Tin* k, const Tin* v, const Tin* g, Tout* dq,
                                Tout* dk, Tdv* dv, float* ws, int64_t bh, int64_t n, int64_t f,
                                int64_t m, int64_t walk_blocks, bool mma_walk, bool together,
                                cudaStream_t stream) {
  constexpr bool kOutFp32 = std::is_same_v<Tout, float>, kDvFp32 = std::is_same_v<Tdv, float>;
  if (const int kernel = together_kernel<Tin>(f, m, mma_walk, together)) {
    return walk_backward_together<Tin, Tout, Tdv>(kernel, q, k, v, g, dq, dk, dv, ws, bh, n, f,
                                                  m, walk_blocks, stream);
  }
  cudaError_t err = causal_typed<Tin>(g, v, k, dq, kOutFp32, nullptr, false, 0.f, ws, bh, n, m,
                                      f, false, walk_blocks, mma_walk, stream);
  if (err != cudaSuccess) return err;
  constexpr size_t mma_dkv = mma_dkv_smem<typename OperandOf<Tin>::type>();
  const bool mma = dkv_by_mma<Tin>(f, m, mma_walk);
  const auto lay = dkv_smem<Tin>(f, m);
  if (!mma && lay.nbuf == 0) {
    err = causal_typed<Tin>(v, g, q, dk, kOutFp32, nullptr, false, 0.f, ws, bh, n, m, f, true,
                            walk_blocks, mma_walk, stream);
    if (err != cudaSuccess) return err;
    return causal_typed<Tin>(k, q, g, dv, kDvFp32, nullptr, false, 0.f, ws, bh, n, f, m, true,
                             walk_blocks, mma_walk, stream);
  }
  const WalkLayout l = walk_layout(bh, n, f, m, walk_blocks, 1);
  const float* carry;
  err = walk_carries(q, g, ws, l, bh, n, f, m, true, false, mma, &carry, stream);
  if (err != cudaSuccess) return err;
  const bool vec_f = rows_vectorizable<Tin>(q, f) && rows_vectorizable<Tin>(k, f);
  const bool vec_m = rows_vectorizable<Tin>(v, m) && rows_vectorizable<Tin>(g, m);
  if (mma) {
    return launch_tiles(chunk_walk_mma_dkv_kernel<Tin, Tout, Tdv>, bh * l.nblk, 1, mma_dkv,
                        stream, q, k, v, g, carry, dk, dv, n, f, m, l.nblk, l.cpb, vec_f, vec_m);
  }
  return launch_tiles(chunk_walk_dkv_kernel<Tin, Tout, Tdv>, bh * l.nblk, 1, lay.bytes(), stream,
                      q, k, v, g, carry, dk, dv, n, f, m, l.nblk, l.cpb, lay, vec_f, vec_m);
}

// fn(OutTypes<Tout, Tdv>{}) for the fused backward's outputs: dq and dk in float with
// `out_fp32`, else in Tin; dv likewise with `dv_fp32`. dq and dk in Tin beside dv in float has
// no caller (the binding refuses it): cudaErrorInvalidValue.
template <typename Tout_, typename Tdv_>
struct OutTypes {
  using Tout = Tout_;
  using Tdv = Tdv_;
};
template <typename Tin, typename Fn>
cudaError_t by_out_types(bool out_fp32, bool dv_fp32, Fn fn) {
  if (out_fp32 && dv_fp32) return fn(OutTypes<float, float>{});
  if (out_fp32) return fn(OutTypes<float, Tin>{});
  if (!dv_fp32) return fn(OutTypes<Tin, Tin>{});
  return cudaErrorInvalidValue;
}

// How many thread blocks of `kernel` with `smem` bytes of dynamic shared memory an SM of the
// current device holds at once, into *blocks (its shared-memory limit set first, as launch_tiles
// does).
template <typename... Params>
cudaError_t resident_blocks(void (*kernel)(Params...), size_t smem, int* blocks) {
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, kThreads, smem);
}

}  // namespace

// ------------------------------------------------------------------ Launchers<Tin>
// The entry points' typed part (launchers_by_dtype.h); linear_attention.cu has checked what
// every type shares (empty sizes, F or M of 0) first.
template <typename Tin>
int64_t Launchers<Tin>::causal_workspace_floats(int64_t bh, int64_t n, int64_t f, int64_t m,
                                                int64_t walk_blocks, bool mma_walk) {
  if (causal_walk<Tin>(f, walk_blocks, mma_walk) != Walk::kNone) {
    return walk_layout(bh, n, f, m, walk_blocks, cdiv(m, kTile)).floats;
  }
  return causal_layout(bh, n, f, m, sizeof(StateOf<Tin>)).floats;
}

template <typename Tin>
cudaError_t Launchers<Tin>::causal_product(const void* q, const void* k, const void* v,
                                           void* out, bool out_fp32, float* den, bool normalize,
                                           float eps, float* workspace, int64_t bh, int64_t n,
                                           int64_t f, int64_t m, bool reverse,
                                           int64_t walk_blocks, bool mma_walk,
                                           cudaStream_t stream) {
  return causal_typed<Tin>(q, k, v, out, out_fp32, den, normalize, eps, workspace, bh, n, f, m,
                           reverse, walk_blocks, mma_walk, stream);
}

template <typename Tin>
int64_t Launchers<Tin>::causal_backward_workspace_floats(int64_t bh, int64_t n, int64_t f,
                                                         int64_t m, int64_t walk_blocks,
                                                         bool mma_walk, bool walks_together) {
  if (walk_blocks <= 0) return 2 * causal_workspace_floats(bh, n, f, m, 0, false);
  if (together_kernel<Tin>(f, m, mma_walk, walks_together) != 0) {
    const TogetherLayout l = together_layout(bh, n, f, m, walk_blocks);
    return l.dq.floats + l.dkv.floats;  // kernel 10's or 11's two walks run at once
  }
  // else the steps of walk_backward_typed run one after another on one workspace
  const int64_t dq_dk = causal_workspace_floats(bh, n, m, f, walk_blocks, mma_walk);
  const int64_t dv = causal_workspace_floats(bh, n, f, m, walk_blocks, mma_walk);
  const int64_t dkv = walk_layout(bh, n, f, m, walk_blocks, 1).floats;
  return std::max({dq_dk, dv, dkv});
}

template <typename Tin>
cudaError_t Launchers<Tin>::causal_backward(const void* q, const void* k, const void* v,
                                            const void* g, void* dq, void* dk, void* dv,
                                            bool out_fp32, bool dv_fp32, float* ws, int64_t bh,
                                            int64_t n, int64_t f, int64_t m, int64_t walk_blocks,
                                            bool mma_walk, bool together, cudaStream_t stream) {
  const Tin* qt = static_cast<const Tin*>(q);
  const Tin* kt = static_cast<const Tin*>(k);
  const Tin* vt = static_cast<const Tin*>(v);
  const Tin* gt = static_cast<const Tin*>(g);
  return by_out_types<Tin>(out_fp32, dv_fp32, [&](auto types) {
    using Tout = typename decltype(types)::Tout;
    using Tdv = typename decltype(types)::Tdv;
    Tout* dqt = static_cast<Tout*>(dq);
    Tout* dkt = static_cast<Tout*>(dk);
    Tdv* dvt = static_cast<Tdv*>(dv);
    if (walk_blocks > 0) {
      return walk_backward_typed<Tin, Tout, Tdv>(qt, kt, vt, gt, dqt, dkt, dvt, ws, bh, n, f, m,
                                                 walk_blocks, mma_walk, together, stream);
    }
    return backward_typed<Tin, Tout, Tdv>(qt, kt, vt, gt, dqt, dkt, dvt, ws, bh, n, f, m,
                                          stream);
  });
}

// walk_kernels for Tin operands, outputs in Tin: the choices of causal_walk and
// walk_backward_typed.
template <typename Tin>
cudaError_t Launchers<Tin>::walk_kernels(int64_t f, int64_t m, bool mma_walk, bool together,
                                         WalkKernels* out) {
  using Op = typename OperandOf<Tin>::type;
  *out = WalkKernels{};
  const Walk walk = causal_walk<Tin>(f, 1, mma_walk);
  cudaError_t err = cudaSuccess;
  if (walk == Walk::kMma) {
    out->product = 8;
    const int ft = mma_walk_slices<Op>(f);
    err = resident_blocks(walk_mma_kernel_for<Tin, Tin>(ft), mma_walk_smem<Op>(ft),
                          &out->product_blocks_per_sm);
  } else if (walk == Walk::kWmma) {
    out->product = 6;
    err = resident_blocks(walk_kernel_for<Tin, Tin>(f), walk_smem<Tin>(f),
                          &out->product_blocks_per_sm);
  }
  if (err != cudaSuccess) return err;
  if (const int kernel = together_kernel<Tin>(f, m, mma_walk, together)) {
    out->dkv = kernel;
    if constexpr (sizeof(Op) == 2) {
      return resident_blocks(together_kernel_for<Tin, Tin, Tin>(kernel), together_smem<Op>(kernel),
                             &out->dkv_blocks_per_sm);
    }
  }
  if (dkv_by_mma<Tin>(f, m, mma_walk)) {
    out->dkv = 9;
    return resident_blocks(chunk_walk_mma_dkv_kernel<Tin, Tin, Tin>, mma_dkv_smem<Op>(),
                           &out->dkv_blocks_per_sm);
  }
  const auto lay = dkv_smem<Tin>(f, m);
  if (lay.nbuf == 0) return cudaSuccess;
  out->dkv = 7;
  return resident_blocks(chunk_walk_dkv_kernel<Tin, Tin, Tin>, lay.bytes(),
                         &out->dkv_blocks_per_sm);
}

template <typename Tin>
cudaError_t Launchers<Tin>::full_state(const void* k, const void* v, bool v_fp32, const bool* keep,
                                       int64_t heads, float* state, float* ws, int64_t bh,
                                       int64_t n, int64_t f, int64_t m, cudaStream_t stream) {
  const Tin* kt = static_cast<const Tin*>(k);
  const int64_t cpb = kReduceRows / kChunk;
  cudaError_t err =
      v_fp32 ? launch_states<Tin, float, float>(kt, static_cast<const float*>(v), keep, heads, ws,
                                                nullptr, nullptr, bh, n, f, m, cpb, false, true,
                                                0, stream)
             : launch_states<Tin, float>(kt, static_cast<const Tin*>(v), keep, heads, ws, nullptr,
                                         nullptr, bh, n, f, m, cpb, false, true, 0, stream);
  if (err != cudaSuccess) return err;
  return launch_scan(ws, state, bh, cdiv(n, kReduceRows), 1, f * m + f, kSum, stream);
}

// The read-out of q in Tin into out in Tin or fp32, or of an fp32 q (`q_fp32`) into out in Tin.
template <typename Tin>
cudaError_t Launchers<Tin>::full_apply(const void* q, bool q_fp32, const float* state,
                                       const float* bias, const bool* keep, int64_t heads,
                                       void* out, bool out_fp32, float* den, bool normalize,
                                       float eps, int64_t bh, int64_t n, int64_t f, int64_t m,
                                       cudaStream_t stream) {
  const int64_t ss = f * m + f;
  auto run = [&](auto* qt, auto* ot) {
    using Tq = std::remove_const_t<std::remove_pointer_t<decltype(qt)>>;
    using To = std::remove_pointer_t<decltype(ot)>;
    return launch_output<Tq, float, To>(qt, nullptr, nullptr, state, ss, state + f * m, ss,
                                        nullptr, 1, ot, den, bias, keep, heads, bh, n, f, m,
                                        kFull, normalize, eps, stream);
  };
  if constexpr (!std::is_same_v<Tin, float>) {
    if (q_fp32) {  // rounded once to Tin (an fp32 out is the float32 entry's)
      if (out_fp32) return cudaErrorInvalidValue;
      return run(static_cast<const float*>(q), static_cast<Tin*>(out));
    }
  }
  const Tin* qt = static_cast<const Tin*>(q);
  return out_fp32 ? run(qt, static_cast<float*>(out)) : run(qt, static_cast<Tin*>(out));
}

template <typename Tin>
cudaError_t Launchers<Tin>::scaled_cumsum(const void* x, const float* pre, const float* post,
                                          const float* base, void* out, bool out_fp32, float* ws,
                                          int64_t bh, int64_t n, int64_t f, bool reverse,
                                          cudaStream_t stream) {
  const Tin* xt = static_cast<const Tin*>(x);
  const int64_t nc = cdiv(n, kTile);
  const int64_t blocks = bh * nc;
  const int64_t cols = cdiv(f, kSumCols);
  if (blocks > kMaxBlocks || cols > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(cols));
  KS_LAUNCH(chunk_colsum_kernel<Tin>, grid, kSumThreads, kSumSmem, stream)(xt, pre, ws, n, f,
                                                                            reverse);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = launch_scan(ws, ws, bh, nc, 1, f, reverse ? kExclusiveReverse : kExclusiveForward,
                    stream);
  if (err != cudaSuccess) return err;
  if (out_fp32) {
    auto* kernel = chunk_cumsum_kernel<Tin, float>;
    KS_LAUNCH(kernel, grid, kSumThreads, kSumSmem, stream)(
        xt, pre, post, ws, base, static_cast<float*>(out), n, f, reverse);
  } else {
    auto* kernel = chunk_cumsum_kernel<Tin, Tin>;
    KS_LAUNCH(kernel, grid, kSumThreads, kSumSmem, stream)(
        xt, pre, post, ws, base, static_cast<Tin*>(out), n, f, reverse);
  }
  return cudaGetLastError();
}

// The normalized backward's row terms (normalizer_kernels.cuh): dnum in the operand type, or in
// fp32 with `dnum_fp32`.
template <typename Tin>
cudaError_t Launchers<Tin>::normalized_grad(const void* g, const void* out, const float* den,
                                            float eps, void* dnum, bool dnum_fp32, float* dden,
                                            int64_t rows, int64_t m, cudaStream_t stream) {
  using Op = typename OperandOf<Tin>::type;
  const int64_t blocks =
      std::min<int64_t>(cdiv(rows, int64_t{kGradWarps} * kGradRows), int64_t{1} << 20);
  const Tin* gt = static_cast<const Tin*>(g);
  const Tin* outt = static_cast<const Tin*>(out);
  if (dnum_fp32) {
    auto* kernel = normalized_grad_kernel<Tin, float>;
    KS_LAUNCH(kernel, static_cast<unsigned>(blocks), kThreads, 0, stream)(
        gt, outt, den, eps, static_cast<float*>(dnum), dden, rows, m);
  } else {
    auto* kernel = normalized_grad_kernel<Tin, Op>;
    KS_LAUNCH(kernel, static_cast<unsigned>(blocks), kThreads, 0, stream)(
        gt, outt, den, eps, static_cast<Op*>(dnum), dden, rows, m);
  }
  return cudaGetLastError();
}

}  // namespace ks_cuda
