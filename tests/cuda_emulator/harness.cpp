// C entry points of the emulated CUDA core for tests/test_cuda_emulated.py (ctypes): the
// launchers of csrc/cuda/launchers.h, one for one, on host buffers, each allocating its
// workspace, returning the cudaError_t of the launches (0 = success) or kOutsideWorkspace.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_runtime.h"
#include "launchers.h"

using ks_cuda::DType;

namespace {

constexpr int kOutsideWorkspace = 1000;  // a kernel wrote to a guard of the workspace

// A workspace of `floats` floats (torch's empty tensor on a GPU: whatever memory held) between
// two guards. It starts as NaN, so a float read before it is written reaches the results as
// NaN; the guards hold kMark, checked after the launches.
class Workspace {
 public:
  explicit Workspace(size_t floats) : buf_(floats + 2 * kGuard, NAN), floats_(floats) {
    std::fill(buf_.begin(), buf_.begin() + kGuard, kMark);
    std::fill(buf_.end() - kGuard, buf_.end(), kMark);
  }
  float* data() { return buf_.data() + kGuard; }
  // err, or kOutsideWorkspace where the launches succeeded but a guard changed.
  int checked(int err) const {
    const auto mark = [](float x) { return x == kMark; };
    const bool intact = std::all_of(buf_.begin(), buf_.begin() + kGuard, mark) &&
                        std::all_of(buf_.begin() + kGuard + floats_, buf_.end(), mark);
    return err != 0 || intact ? err : kOutsideWorkspace;
  }

 private:
  static constexpr size_t kGuard = 64;  // 256 bytes: the workspace stays 16-byte aligned
  static constexpr float kMark = -7168.f;
  std::vector<float> buf_;
  size_t floats_;
};

}  // namespace

extern "C" {

void ks_emu_configure(uint64_t schedule_seed, int64_t smem_optin) {
  ks_emu::set_schedule_seed(schedule_seed);
  ks_emu::rt().smem_optin = static_cast<size_t>(smem_optin);
}

// The thread blocks a walk's carry pass aims at (KS_CARRY_BLOCKS; 512 as built for a GPU): a test
// lowers it so that small shapes sum several chunks a group.
void ks_emu_set_carry_blocks(int64_t blocks) { ks_emu::rt().carry_blocks = blocks; }

// The thread blocks the chunk kernels' state pass aims at (KS_CHUNK_BLOCKS; 1024 as built for a
// GPU): a test lowers it so that small shapes give a thread block several chunks.
void ks_emu_set_chunk_blocks(int64_t blocks) { ks_emu::rt().chunk_blocks = blocks; }

int64_t ks_emu_causal_workspace_floats(int dtype, int64_t bh, int64_t n, int64_t f, int64_t m,
                                       int64_t walk_blocks, int mma_walk) {
  return ks_cuda::causal_workspace_floats(static_cast<DType>(dtype), bh, n, f, m, walk_blocks,
                                          mma_walk != 0);
}

// The dynamic shared memory of the last kernel launched (bytes): which layout it chose.
int64_t ks_emu_last_launch_smem() { return static_cast<int64_t>(ks_emu::rt().last_smem); }

int ks_emu_causal_product(int dtype, const void* q, const void* k, const void* v, void* out,
                          int out_fp32, float* den, int normalize, float eps, int64_t bh,
                          int64_t n, int64_t f, int64_t m, int reverse, int64_t walk_blocks,
                          int mma_walk) {
  const DType dt = static_cast<DType>(dtype);
  Workspace ws(ks_cuda::causal_workspace_floats(dt, bh, n, f, m, walk_blocks, mma_walk != 0));
  return ws.checked(ks_cuda::causal_product(dt, q, k, v, out, out_fp32 != 0, den, normalize != 0,
                                            eps, ws.data(), bh, n, f, m, reverse != 0,
                                            walk_blocks, mma_walk != 0, nullptr));
}

int ks_emu_causal_backward(int dtype, const void* q, const void* k, const void* v, const void* g,
                           void* dq, void* dk, void* dv, int out_fp32, int dv_fp32, int64_t bh,
                           int64_t n, int64_t f, int64_t m, int64_t walk_blocks, int mma_walk,
                           int walks_together) {
  const DType dt = static_cast<DType>(dtype);
  Workspace ws(ks_cuda::causal_backward_workspace_floats(dt, bh, n, f, m, walk_blocks,
                                                         mma_walk != 0, walks_together != 0));
  return ws.checked(ks_cuda::causal_backward(dt, q, k, v, g, dq, dk, dv, out_fp32 != 0,
                                             dv_fp32 != 0, ws.data(), bh, n, f, m, walk_blocks,
                                             mma_walk != 0, walks_together != 0, nullptr));
}

// walk_kernels into kernels[4] (product kernel, its blocks per SM, dk/dv kernel, its blocks)
// and the kernels it asked the occupancy of, in order, into asked[2] (0 where fewer).
int ks_emu_walk_kernels(int dtype, int64_t f, int64_t m, int mma_walk, int walks_together,
                        int* kernels, uint64_t* asked) {
  ks_emu::rt().asked.clear();
  ks_cuda::WalkKernels w;
  const int err = ks_cuda::walk_kernels(static_cast<DType>(dtype), f, m, mma_walk != 0,
                                        walks_together != 0, &w);
  kernels[0] = w.product;
  kernels[1] = w.product_blocks_per_sm;
  kernels[2] = w.dkv;
  kernels[3] = w.dkv_blocks_per_sm;
  const auto& seen = ks_emu::rt().asked;
  for (size_t i = 0; i < 2; ++i) {
    asked[i] = i < seen.size() ? reinterpret_cast<uint64_t>(seen[i]) : 0;
  }
  return err;
}

// The kernel of the last launch (an address, to compare with ks_emu_walk_kernels' `asked`).
uint64_t ks_emu_last_kernel() {
  return reinterpret_cast<uint64_t>(ks_emu::rt().last_kernel);
}

int ks_emu_full_state(int dtype, const void* k, const void* v, int v_fp32, const bool* keep,
                      int64_t heads, float* state, int64_t bh, int64_t n, int64_t f, int64_t m) {
  Workspace ws(ks_cuda::full_state_workspace_floats(bh, n, f, m));
  return ws.checked(ks_cuda::full_state(static_cast<DType>(dtype), k, v, v_fp32 != 0, keep, heads,
                                        state, ws.data(), bh, n, f, m, nullptr));
}

int ks_emu_full_apply(int dtype, const void* q, int q_fp32, const float* state, const float* bias,
                      const bool* keep, int64_t heads, void* out, int out_fp32, float* den,
                      int normalize, float eps, int64_t bh, int64_t n, int64_t f, int64_t m) {
  return ks_cuda::full_apply(static_cast<DType>(dtype), q, q_fp32 != 0, state, bias, keep, heads,
                             out, out_fp32 != 0, den, normalize != 0, eps, bh, n, f, m, nullptr);
}

int ks_emu_scaled_cumsum(int dtype, const void* x, const float* pre, const float* post,
                         const float* base, void* out, int out_fp32, int64_t bh, int64_t n,
                         int64_t f, int reverse) {
  Workspace ws(ks_cuda::cumsum_workspace_floats(bh, n, f));
  return ws.checked(ks_cuda::scaled_cumsum(static_cast<DType>(dtype), x, pre, post, base, out,
                                           out_fp32 != 0, ws.data(), bh, n, f, reverse != 0,
                                           nullptr));
}

int ks_emu_normalized_grad(int dtype, const void* g, const void* out, const float* den,
                           float eps, void* dnum, int dnum_fp32, float* dden, int64_t rows,
                           int64_t m) {
  return ks_cuda::normalized_grad(static_cast<DType>(dtype), g, out, den, eps, dnum,
                                  dnum_fp32 != 0, dden, rows, m, nullptr);
}

}  // extern "C"
