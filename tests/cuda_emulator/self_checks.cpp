// Small kernels that check the emulator itself (tests/test_cuda_emulated.py,
// test_the_emulator_checks_what_a_gpu_refuses and its neighbours): each case is a program run
// with the case's name and a schedule seed. It prints what the kernel computed, or the emulator
// aborts with its message (ks_emu: ...) where a GPU would refuse or a race shows.
#include <cstdio>
#include <cstring>
#include <string>

#include "cuda_runtime.h"
#include "mma.h"

namespace {

int out[64];

// Lanes 16..31 return; lanes 0..15 meet at a __syncwarp() (valid CUDA: exited lanes are not
// waited for), then each writes its lane number.
__global__ void exited_lanes_kernel() {
  const int lane = threadIdx.x;
  if (lane >= 16) return;
  __syncwarp();
  out[lane] = lane;
}

// Each lane stores elements lane, lane + 32, ... of a 4 x 8 x 8 bf16 tile (so each 8-element
// row holds elements of eight lanes), then loads row `lane` by ldmatrix: with `sync`, after a
// __syncwarp(). out[lane] counts the 16-bit elements it received that no lane stored (poison).
__global__ void ldmatrix_kernel(bool sync) {
  KS_DYNAMIC_SMEM(smem);
  uint16_t* tile = reinterpret_cast<uint16_t*>(smem);
  const int lane = threadIdx.x;
  for (int e = lane; e < 256; e += 32) tile[e] = static_cast<uint16_t>(e);
  if (sync) __syncwarp();
  uint32_t regs[4];
  ks_emu::ldmatrix_x4(regs, tile + 8 * lane, false);
  int poisoned = 0;
  for (uint32_t r : regs) poisoned += ((r & 0xffffu) == 0xffffu) + ((r >> 16) == 0xffffu);
  out[lane] = poisoned;
}

// Each block writes its blockIdx.z into out[blockIdx.z].
__global__ void block_z_kernel() {
  if (threadIdx.x == 0) out[blockIdx.z] = static_cast<int>(blockIdx.z) + 100;
}

__global__ void nothing_kernel() {}

// Thread 0 writes the byte before the dynamic shared memory.
__global__ void write_before_smem_kernel() {
  KS_DYNAMIC_SMEM(smem);
  if (threadIdx.x == 0) smem[-1] = 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: self_checks CASE SEED\n");
    return 2;
  }
  const std::string name = argv[1];
  ks_emu::set_schedule_seed(std::stoull(argv[2]));
  std::memset(out, 0, sizeof(out));
  int count = 0;
  if (name == "exited_lanes") {
    KS_LAUNCH(exited_lanes_kernel, 1, 32, 0, nullptr)();
    count = 16;
  } else if (name == "ldmatrix" || name == "ldmatrix_synced") {
    KS_LAUNCH(ldmatrix_kernel, 1, 32, 512, nullptr)(name == "ldmatrix_synced");
    count = 32;
  } else if (name == "block_z") {
    KS_LAUNCH(block_z_kernel, dim3(1, 1, 3), 32, 0, nullptr)();
    count = 3;
  } else if (name == "block_of_2048") {
    KS_LAUNCH(nothing_kernel, 1, 2048, 0, nullptr)();
  } else if (name == "grid_y_65536") {
    KS_LAUNCH(nothing_kernel, dim3(1, 65536), 32, 0, nullptr)();
  } else if (name == "smem_64k") {
    KS_LAUNCH(nothing_kernel, 1, 32, 64 * 1024, nullptr)();
  } else if (name == "smem_64k_allowed") {
    if (cudaFuncSetAttribute(nothing_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             64 * 1024) != cudaSuccess) {
      return 3;
    }
    KS_LAUNCH(nothing_kernel, 1, 32, 64 * 1024, nullptr)();
  } else if (name == "write_before_smem") {
    KS_LAUNCH(write_before_smem_kernel, 1, 32, 256, nullptr)();
  } else {
    std::fprintf(stderr, "unknown case %s\n", name.c_str());
    return 2;
  }
  for (int i = 0; i < count; ++i) std::printf("%d ", out[i]);
  std::printf("\n");
  return 0;
}
