// A CPU emulator of the CUDA features that the kernels of csrc/cuda use, so that they can
// run (slowly) on a machine without a GPU and be compared with the float64 reference in CI.
//
// The shim headers beside this file (cuda_runtime.h, cuda_bf16.h, cuda_fp16.h, mma.h) take the
// place of CUDA's when the .cu is compiled as C++ with g++. A kernel launch runs the grid's blocks
// one after another, in a random order; each thread of a block is a fiber (Fiber below) that runs until it reaches a
// barrier: __syncthreads() waits for the block, and __syncwarp() and the shuffles wait for the
// 32 lanes of the warp (see mma.h for why the WMMA operations need no barrier). Between block barriers the warps
// run one after another, each as far as it can, in an order drawn from a seeded generator
// (set_schedule_seed), and a warp's lanes in a random order: a missing barrier shows up as
// results that change with the seed, or differ from the reference.
// Checks: a block's dynamic shared memory starts filled with 0xFF bytes (NaN in fp32, bf16 and
// fp16), so reading what no thread wrote shows up as NaN; guards before and after it must stay
// intact (a write outside it aborts); a barrier that not every live thread of the block (or
// warp) reaches aborts as a deadlock (a lane that has exited is not waited for, as in CUDA); so
// does a launch a GPU refuses (check_launch: block and grid sizes, shared memory above the
// device's limit, or above 48 KB without cudaFuncSetAttribute). An
// asynchronous copy (cp.async) lands at its issue or at the thread's next wait, drawn at random:
// reading a tile before waiting for it, or copying into a tile other threads still read, shows
// up; a thread that ends with copies it never waited for aborts.
//
// WMMA fragments hold their whole tile in every lane (the element order of a real fragment is
// unspecified, and the kernels only apply the same function to every element). Products
// accumulate in float, as the tensor cores do, and are computed once per warp (warp_product);
// bf16 and tf32 operands are rounded as on a GPU.
// ldmatrix and mma.sync (kernels 8 and 9), whose register layouts the kernels do depend on, are
// emulated lane by lane as the PTX ISA lays them out (mma.h, on Collective below): each lane
// posts its row (ldmatrix: the 16 bytes as they are when it arrives) or its registers, waits
// for the warp, and takes its own result from what the others posted.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

// ------------------------------------------------------------------ CUDA keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct alignas(8) float2 {
  float x, y;
};

struct alignas(16) float4 {
  float x, y, z, w;
};

struct alignas(8) uint2 {
  unsigned x, y;
};

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

namespace ks_emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "ks_emu: %s\n", what);
  std::abort();
}

enum class Wait { kNone, kBlock, kWarp, kDone };

// ------------------------------------------------------------------ fibers
// A thread of a block runs as a fiber on its own stack; switch_fiber(from, to) saves the running
// fiber's context in `from` and resumes `to`. On x86-64 a switch saves the callee-saved registers,
// MXCSR and the x87 control word on the fiber's stack and swaps stack pointers (the compiler
// treats the call like any other, so the caller-saved registers are its concern); ucontext's
// swapcontext, used elsewhere, also saves the signal mask with a system call, which took a third
// of the emulator's time.
#if defined(__x86_64__)
struct Fiber {
  void* sp = nullptr;
};

// switch_stacks(&from->sp, to->sp) (System V ABI: rdi, rsi).
__attribute__((naked, noinline)) static void switch_stacks(void**, void*) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

// Where a new fiber's first switch returns to: calls its entry (held in r12) on an aligned stack.
__attribute__((naked, noinline)) static void fiber_start() {
  asm volatile(
      "callq *%r12\n\t"
      "ud2\n\t");
}

inline void switch_fiber(Fiber& from, Fiber& to) { switch_stacks(&from.sp, to.sp); }

// Makes `f` a fiber that runs entry() on `stack` (entry must switch away at its end, never
// return).
inline void start_fiber(Fiber& f, std::vector<char>& stack, void (*entry)()) {
  // the first switch pops MXCSR and the x87 control word, r15 .. rbp, and returns into
  // fiber_start with the stack 16-byte aligned for its call
  const uintptr_t top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t{15};
  uint64_t* sp = reinterpret_cast<uint64_t*>(top) - 8;
  uint32_t mxcsr;
  uint16_t fpu_cw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpu_cw));
  sp[0] = mxcsr | (static_cast<uint64_t>(fpu_cw) << 32);
  sp[1] = sp[2] = sp[3] = 0;                        // r15, r14, r13
  sp[4] = reinterpret_cast<uint64_t>(entry);        // r12
  sp[5] = sp[6] = 0;                                // rbx, rbp
  sp[7] = reinterpret_cast<uint64_t>(&fiber_start);  // the return address
  f.sp = sp;
}
#else
struct Fiber {
  ucontext_t context;
};

inline void switch_fiber(Fiber& from, Fiber& to) {
  if (swapcontext(&from.context, &to.context) != 0) fail("swapcontext failed");
}

inline void start_fiber(Fiber& f, std::vector<char>& stack, void (*entry)()) {
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = stack.data();
  f.context.uc_stack.ss_size = stack.size();
  f.context.uc_link = nullptr;
  makecontext(&f.context, entry, 0);
}
#endif

// A 16-byte asynchronous copy that has not landed yet.
struct PendingCopy {
  void* dst;
  unsigned char bytes[16];
};

struct Thread {
  Fiber fiber;
  dim3 idx;
  Wait wait = Wait::kNone;
  uint64_t products = 0;            // WMMA products this thread has issued (see warp_product)
  uint64_t collectives = 0;         // ldmatrix and mma.sync this thread has issued
  std::vector<PendingCopy> copies;  // issued, landing at the thread's next wait
};

// A WMMA product of a warp that not all its lanes have taken yet (at most 16 x 16 floats).
struct Product {
  float value[256];
  int taken = 0;
};

// A warp's products not yet taken by all its lanes: products[i] is its product number base + i.
// The lanes issue products in the same order, so they are taken up in that order too.
struct PendingProducts {
  std::deque<Product> products;
  uint64_t base = 1;
};

// What a lane gives a warp-collective operation (ldmatrix: its row's 16 bytes in reg[0..3];
// mma.sync: its A and B registers).
struct Posted {
  uint32_t reg[6] = {};
};

// The state of the block that is running (one at a time).
struct Runtime {
  dim3 block_idx, block_dim, grid_dim;
  std::vector<Thread> threads;
  std::vector<std::vector<char>> stacks;
  std::vector<float> shuffle;  // one slot per thread
  std::vector<Posted> posted;  // two slots per thread (see collective)
  std::vector<PendingProducts> products;  // one per warp
  // The scheduler's view of each warp: its lanes that can run (wait == kNone), in no order, and
  // how many of its lanes are live (not kDone) and how many wait at its barrier (kWarp).
  std::vector<std::vector<int>> ready;
  std::vector<int> live, waiting;
  Fiber scheduler;
  int current = 0;
  std::vector<unsigned char> smem_storage;
  unsigned char* smem = nullptr;  // in smem_storage, 128-byte aligned as the kernels declare it
  std::mt19937_64 rng{0};
  size_t smem_optin = 232448;  // an H100's opt-in shared memory per block (227 KB)
  size_t last_smem = 0;        // the dynamic shared memory of the last launch
  const void* last_kernel = nullptr;  // the kernel of the last launch
  std::vector<const void*> asked;     // kernels asked about by the occupancy shim
  // cudaFuncSetAttribute's MaxDynamicSharedMemorySize, by kernel: above 48 KB a launch needs it
  std::unordered_map<const void*, size_t> smem_attribute;
  int64_t carry_blocks = 512;         // KS_CARRY_BLOCKS: the production value unless a test sets it
  int64_t chunk_blocks = 1024;        // KS_CHUNK_BLOCKS: likewise
};

inline Runtime runtime;  // not a function's static: no guard checked at every use
inline Runtime& rt() { return runtime; }

inline Thread& self() { return rt().threads[rt().current]; }
inline int lane() { return rt().current % 32; }

inline void yield(Wait wait) {
  Thread& t = self();
  t.wait = wait;
  switch_fiber(t.fiber, rt().scheduler);
}

inline void sync_block() { yield(Wait::kBlock); }
inline void sync_warp() { yield(Wait::kWarp); }

// Releases warp w's barrier: its lanes waiting there can run again.
inline void release_warp(int w) {
  Runtime& r = rt();
  const int end = std::min(static_cast<int>(r.threads.size()), w * 32 + 32);
  for (int i = w * 32; i < end; ++i) {
    if (r.threads[i].wait == Wait::kWarp) {
      r.threads[i].wait = Wait::kNone;
      r.ready[w].push_back(i);
    }
  }
  r.waiting[w] = 0;
}

// Releases the block barrier if all live threads have reached it; true if released.
inline bool release_block() {
  Runtime& r = rt();
  int live = 0, waiting = 0;
  for (const Thread& t : r.threads) {
    live += t.wait != Wait::kDone;
    waiting += t.wait == Wait::kBlock;
  }
  if (live == 0 || waiting < live) return false;
  for (int i = 0; i < static_cast<int>(r.threads.size()); ++i) {
    if (r.threads[i].wait == Wait::kBlock) {
      r.threads[i].wait = Wait::kNone;
      r.ready[i / 32].push_back(i);
    }
  }
  return true;
}

template <typename Fn>
struct Entry {
  static Fn* fn;
  static void run() {
    (*fn)();
    Thread& t = rt().threads[rt().current];
    if (!t.copies.empty()) fail("a thread ended with asynchronous copies it never waited for");
    t.wait = Wait::kDone;
    switch_fiber(t.fiber, rt().scheduler);  // never resumed
    fail("a finished thread resumed");
  }
};
template <typename Fn>
Fn* Entry<Fn>::fn = nullptr;

// Runs fn() as every thread of one block, to completion.
template <typename Fn>
void run_block(Fn& fn) {
  Runtime& r = rt();
  const int n = static_cast<int>(r.block_dim.x * r.block_dim.y * r.block_dim.z);
  constexpr size_t kStack = 256 * 1024;
  r.threads.assign(n, Thread{});
  r.shuffle.assign(n, 0.f);
  r.posted.assign(2 * n, Posted{});
  const int warps = (n + 31) / 32;
  r.products.assign(warps, {});
  r.ready.assign(warps, {});
  r.live.assign(warps, 0);
  r.waiting.assign(warps, 0);
  if (r.stacks.size() < static_cast<size_t>(n)) r.stacks.resize(n);
  Entry<Fn>::fn = &fn;
  for (int i = 0; i < n; ++i) {
    Thread& t = r.threads[i];
    t.idx = dim3(i % r.block_dim.x, (i / r.block_dim.x) % r.block_dim.y,
                 i / (r.block_dim.x * r.block_dim.y));
    r.stacks[i].resize(kStack);
    start_fiber(t.fiber, r.stacks[i], &Entry<Fn>::run);
    r.ready[i / 32].push_back(i);
    ++r.live[i / 32];
  }
  // Between block barriers the warps run in a random order of priority: the first warp runs
  // as far as it can (to the block barrier, or to a warp barrier that its lanes then pass at
  // once), then the next. So any warp may run a whole phase ahead of, or behind, any other,
  // which is what a missing __syncthreads() needs to show. A warp's lanes run in random order.
  // Warps ahead of priority[first] have no runnable lane until the block barrier opens: only
  // the running warp's lanes change their state in between.
  std::vector<int> priority(warps);
  int first = 0;
  auto reorder = [&] {
    for (int w = 0; w < warps; ++w) priority[w] = w;
    std::shuffle(priority.begin(), priority.end(), r.rng);
    first = 0;
  };
  reorder();
  for (;;) {
    int pick = -1;
    for (; first < warps; ++first) {
      std::vector<int>& ready = r.ready[priority[first]];
      if (!ready.empty()) {
        const size_t j = std::uniform_int_distribution<size_t>(0, ready.size() - 1)(r.rng);
        pick = ready[j];
        ready[j] = ready.back();
        ready.pop_back();
        break;
      }
    }
    if (pick >= 0) {
      r.current = pick;
      switch_fiber(r.scheduler, r.threads[pick].fiber);
      const int w = pick / 32;
      switch (r.threads[pick].wait) {
        case Wait::kWarp:  // the last live lane to reach the warp's barrier opens it
          if (++r.waiting[w] == r.live[w]) release_warp(w);
          break;
        case Wait::kDone:  // an exited lane is not waited for (CUDA: "all non-exited threads")
          if (--r.live[w] > 0 && r.waiting[w] == r.live[w]) release_warp(w);
          break;
        case Wait::kBlock:
          break;
        case Wait::kNone:
          fail("a thread came back to the scheduler without waiting");
      }
      continue;
    }
    bool done = true;
    for (const Thread& t : r.threads) done &= t.wait == Wait::kDone;
    if (done) return;
    if (!release_block()) fail("deadlock: a barrier that not every thread reaches");
    reorder();
  }
}

// The tensor cores' sum of a product step: the products (exact) and the accumulator added, the
// result cut toward zero to fp32, not rounded to nearest (NVIDIA's tensor cores truncate when
// they align and normalize the sum; Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of
// NVIDIA tensor cores", 2021). One step loses less than an ulp, always toward zero, so a state
// summed over a long walk in the accumulators drifts toward zero: on the H200 (2026-11-30) the
// fp32 walk's output over 512 chunks differed by 2.4e-4 from the same over two segments.
inline float tensor_core_sum(double exact) {
  float f = static_cast<float>(exact);
  if (std::fabs(static_cast<double>(f)) > std::fabs(exact)) f = std::nextafter(f, 0.f);
  return f;
}

// The block's dynamic shared memory, between two guards of kGuard bytes.
constexpr size_t kGuard = 4096;
constexpr unsigned char kPoison = 0xFF;
inline unsigned char* dynamic_smem() { return rt().smem; }

// A GPU faults ("misaligned address") or computes garbage where these are not met; a host
// compiler does neither, so the emulator checks them.
inline void check_aligned(const void* p, size_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) fail(what);
}

// A launch a GPU refuses (cudaErrorInvalidConfiguration, or too much shared memory) aborts here:
// more than 1,024 threads a block (x, y <= 1,024, z <= 64), grid.y or grid.z above 65,535, an
// empty grid or block, dynamic shared memory above the device's opt-in limit, or above 48 KB
// that cudaFuncSetAttribute did not allow for this kernel.
inline void check_launch(const void* kernel, dim3 grid, dim3 block, size_t smem) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) {
    fail("launch: an empty grid or block");
  }
  if (threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    fail("launch: a block above 1024 threads (x, y <= 1024, z <= 64)");
  }
  if (grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
    fail("launch: a grid above 2^31 - 1 x 65535 x 65535 blocks");
  }
  if (smem > rt().smem_optin) fail("dynamic shared memory above the device's limit");
  if (smem > 48 * 1024) {
    const auto it = rt().smem_attribute.find(kernel);
    if (it == rt().smem_attribute.end() || it->second < smem) {
      fail("launch: dynamic shared memory above 48 KB not allowed by cudaFuncSetAttribute");
    }
  }
}

template <typename Kernel>
struct Launch;

template <typename... Params>
struct Launch<void (*)(Params...)> {
  void (*kernel)(Params...);
  dim3 grid, block;
  size_t smem;
  template <typename... Args>
  void operator()(Args&&... args) const {
    std::tuple<Params...> values(std::forward<Args>(args)...);
    Runtime& r = rt();
    check_launch(reinterpret_cast<const void*>(kernel), grid, block, smem);
    r.last_smem = smem;
    r.last_kernel = reinterpret_cast<const void*>(kernel);
    r.grid_dim = grid;
    r.block_dim = block;
    r.smem_storage.assign(kGuard + 128 + smem + kGuard, kPoison);
    const uintptr_t base = reinterpret_cast<uintptr_t>(r.smem_storage.data()) + kGuard;
    r.smem = r.smem_storage.data() + kGuard + (128 - base % 128) % 128;
    auto body = [&] { std::apply(kernel, values); };
    // Blocks run one at a time, in an order drawn from the schedule: on a GPU they run in any
    // order and at once, so results that depend on the order show up as a change with the seed.
    std::vector<dim3> blocks;
    for (unsigned bz = 0; bz < grid.z; ++bz) {
      for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) blocks.emplace_back(bx, by, bz);
      }
    }
    std::shuffle(blocks.begin(), blocks.end(), r.rng);
    for (const dim3& b : blocks) {
      r.block_idx = b;
      std::fill(r.smem, r.smem + smem, kPoison);
      run_block(body);
      const auto intact = [](const unsigned char* p) {
        return std::all_of(p, p + kGuard, [](unsigned char c) { return c == kPoison; });
      };
      if (!intact(r.smem - kGuard) || !intact(r.smem + smem)) {
        fail("write outside the block's dynamic shared memory");
      }
    }
  }
};

template <typename... Params>
Launch<void (*)(Params...)> launch(void (*kernel)(Params...), dim3 grid, dim3 block,
                                   size_t smem) {
  return {kernel, grid, block, smem};
}

inline void set_schedule_seed(uint64_t seed) { rt().rng.seed(seed); }

// cp.async: the source is read now; the 16 bytes land now or at the thread's next wait, drawn
// from the schedule's generator, so a read before the wait or a copy into a tile that other
// threads still read shows up.
inline void async_copy16(void* dst, const void* src) {
  check_aligned(dst, 16, "cp.async: shared address not 16-byte aligned");
  check_aligned(src, 16, "cp.async: global address not 16-byte aligned");
  PendingCopy copy{dst, {}};
  std::memcpy(copy.bytes, src, 16);
  if (rt().rng() & 1) {
    std::memcpy(dst, copy.bytes, 16);
  } else {
    self().copies.push_back(copy);
  }
}

inline void async_wait() {
  for (const PendingCopy& copy : self().copies) std::memcpy(copy.dst, copy.bytes, 16);
  self().copies.clear();
}

// A warp's lanes hold identical WMMA operands, so the first lane to issue the warp's i-th product
// computes it (compute(out), `size` floats) and the other lanes copy it.
template <typename Compute>
void warp_product(float* out, int size, Compute compute) {
  Runtime& r = rt();
  if (size > 256) fail("warp_product: a product of more than 256 floats");
  const int lanes = std::min<int>(32, static_cast<int>(r.threads.size()) - r.current / 32 * 32);
  PendingProducts& pending = r.products[r.current / 32];
  const uint64_t index = ++r.threads[r.current].products;
  if (lanes == 1) return compute(out);
  if (index == pending.base + pending.products.size()) {  // the first lane to issue it
    compute(out);
    pending.products.emplace_back();
    std::memcpy(pending.products.back().value, out, sizeof(float) * size);
    pending.products.back().taken = 1;
    return;
  }
  Product& p = pending.products[index - pending.base];
  std::memcpy(out, p.value, sizeof(float) * size);
  if (++p.taken == lanes) {  // every lane has taken it, and so every earlier one
    if (index != pending.base) fail("warp_product: products taken out of order");
    pending.products.pop_front();
    ++pending.base;
  }
}

// Warp shuffle: every lane posts its value, waits for the warp, reads its partner's, and waits
// again before the slots can be reused.
inline float shfl_xor(float value, int lane_mask) {
  Runtime& r = rt();
  const int i = r.current;
  r.shuffle[i] = value;
  sync_warp();
  const float other = r.shuffle[(i & ~31) | ((i & 31) ^ lane_mask)];
  sync_warp();
  return other;
}

// A warp-collective operation: the lane posts what it gives and waits for the warp; then
// posted(l) is what lane l of the warp gave. Two slots per lane, taken in turn: a lane can post
// again into a slot only after the next collective's barrier, which every lane reaches after
// reading this one's.
class Collective {
 public:
  explicit Collective(const Posted& mine) {
    Runtime& r = rt();
    const int n = static_cast<int>(r.threads.size());
    base_ = static_cast<int>(self().collectives++ % 2) * n + r.current / 32 * 32;
    r.posted[base_ + r.current % 32] = mine;
    sync_warp();
  }
  const Posted& posted(int l) const { return rt().posted[base_ + l]; }

 private:
  int base_;
};

}  // namespace ks_emu

// ------------------------------------------------------------------ CUDA built-ins
#define threadIdx (::ks_emu::self().idx)
#define blockIdx (::ks_emu::rt().block_idx)
#define blockDim (::ks_emu::rt().block_dim)
#define gridDim (::ks_emu::rt().grid_dim)

inline void __syncthreads() { ks_emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ks_emu::sync_warp(); }
inline float __shfl_xor_sync(unsigned, float value, int lane_mask, int = 32) {
  return ks_emu::shfl_xor(value, lane_mask);
}

#define KS_LAUNCH(kernel, grid, block, smem, stream) ::ks_emu::launch(kernel, grid, block, smem)
#define KS_HOST_ASYNC_COPY16(dst, src) ::ks_emu::async_copy16(dst, src)
#define KS_HOST_ASYNC_WAIT() ::ks_emu::async_wait()
#define KS_DYNAMIC_SMEM(name) unsigned char* name = ::ks_emu::dynamic_smem()
#define KS_CARRY_BLOCKS (::ks_emu::rt().carry_blocks)
#define KS_CHUNK_BLOCKS (::ks_emu::rt().chunk_blocks)
