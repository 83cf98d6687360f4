// Shim of CUDA's runtime header for tests/cuda_emulator (see ks_emulator.h): the types and calls
// the launchers of csrc/cuda use, on host memory.
#pragma once

#include <algorithm>
#include <cstring>

#include "ks_emulator.h"

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
using cudaStream_t = void*;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };

// Records the kernel's allowance (ks_emu::check_launch reads it).
template <typename Kernel>
inline cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute, int value) {
  if (value < 0 || static_cast<size_t>(value) > ks_emu::rt().smem_optin) {
    return cudaErrorInvalidValue;
  }
  ks_emu::rt().smem_attribute[reinterpret_cast<const void*>(kernel)] = static_cast<size_t>(value);
  return cudaSuccess;
}
// Blocks an SM holds at once. The emulator knows no registers: it counts shared memory alone
// (an SM with the opt-in limit plus 1 KB, reserved per block as on a GPU) and threads (2048).
// The kernel asked about is recorded (rt().asked), so a test can match it to the one launched.
template <typename Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel kernel,
                                                                 int threads, size_t smem) {
  ks_emu::rt().asked.push_back(reinterpret_cast<const void*>(kernel));
  const size_t per_sm = ks_emu::rt().smem_optin + 1024;
  *blocks = static_cast<int>(std::min<size_t>(2048 / threads, per_sm / (smem + 1024)));
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = static_cast<int>(ks_emu::rt().smem_optin);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : "emulated CUDA error";
}
