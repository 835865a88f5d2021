// Just enough of the CUDA runtime to run pagedllm's cuda-native kernels on the CPU: each CUDA
// thread of a block is a fiber, blocks run one after another, __syncthreads and warp shuffles
// are barriers over the block's and the warp's threads. For tests only: it checks numerics and
// synchronisation (barriers that cannot all open abort with a message), not speed or the
// memory model.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

using std::max;
using std::min;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "no error"; }

inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

namespace emu {

// The threads of one block are fibers (ucontext) on the calling thread: a fiber runs until it
// reaches a barrier, and a barrier opens once every thread it waits for has reached it.
enum class State { Running, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
  ucontext_t context;
  std::vector<char> stack = std::vector<char>(256 * 1024);
  State state = State::Running;
};

inline dim3 block_dim, block_idx, thread_idx;
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline unsigned current = 0;
inline std::function<void()> body;
inline float shuffle_slots[2][32][32];  // double-buffered: one barrier per shuffle
inline unsigned char shuffle_parity[1024];
constexpr size_t kSharedFloats = 1 << 15;  // 128 KiB of dynamic shared memory

inline void wait(State barrier) {
  fibers[current].state = barrier;
  swapcontext(&fibers[current].context, &scheduler);
}

inline void fiber_main() {
  body();
  fibers[current].state = State::Done;
}

// Runs every fiber of the block to its end; false if they stop at barriers that cannot open.
inline bool run_block() {
  const unsigned n = block_dim.x;
  for (unsigned t = 0; t < n; ++t) {
    Fiber& f = fibers[t];
    f.state = State::Running;
    shuffle_parity[t] = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = &scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  for (;;) {
    for (unsigned t = 0; t < n; ++t) {
      if (fibers[t].state != State::Running) continue;
      current = t;
      thread_idx = dim3(t);
      swapcontext(&scheduler, &fibers[t].context);
    }
    bool progress = false, all_done = true, block_ready = true;
    for (unsigned t = 0; t < n; ++t) {
      all_done &= fibers[t].state == State::Done;
      block_ready &= fibers[t].state == State::AtBlockBarrier || fibers[t].state == State::Done;
    }
    if (all_done) return true;
    if (block_ready) {
      for (auto& f : fibers)
        if (f.state == State::AtBlockBarrier) f.state = State::Running;
      continue;
    }
    for (unsigned w = 0; w < n / 32; ++w) {
      bool warp_ready = true;
      for (unsigned l = 0; l < 32; ++l) warp_ready &= fibers[32 * w + l].state == State::AtWarpBarrier;
      if (!warp_ready) continue;
      for (unsigned l = 0; l < 32; ++l) fibers[32 * w + l].state = State::Running;
      progress = true;
    }
    if (!progress) return false;
  }
}

}  // namespace emu

#define threadIdx (::emu::thread_idx)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)

inline void __syncthreads() { emu::wait(emu::State::AtBlockBarrier); }

inline float __shfl_xor_sync(unsigned, float value, int lane_mask) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // a lane writes the other buffer next time, and no lane can get two shuffles ahead of another
  auto& slots = emu::shuffle_slots[emu::shuffle_parity[threadIdx.x] ^= 1];
  slots[warp][lane] = value;
  emu::wait(emu::State::AtWarpBarrier);
  return slots[warp][lane ^ lane_mask];
}

// The kernels' `extern __shared__ float smem[]` (declared in this namespace) lands here.
namespace pagedllm {
namespace kernels {
inline float smem[emu::kSharedFloats];
}
}  // namespace pagedllm

namespace emu {

// kernel<<<grid, block, shared_bytes, stream>>>(args...), rewritten by the test into this call.
template <typename... Params, typename... Args>
void launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t, void (*kernel)(Params...), Args... args) {
  if (shared_bytes > sizeof(pagedllm::kernels::smem) || block.x % 32 != 0 || block.y != 1 || block.z != 1) {
    std::fprintf(stderr, "cuda emulation: unsupported launch (%zu bytes shared, %u threads)\n", shared_bytes, block.x);
    std::abort();
  }
  block_dim = block;
  fibers.resize(block.x);
  body = [=] { kernel(args...); };
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        block_idx = dim3(x, y, z);
        // shared memory starts as NaN, so a read before a write shows in the output
        std::fill(std::begin(pagedllm::kernels::smem), std::end(pagedllm::kernels::smem),
                  std::numeric_limits<float>::quiet_NaN());
        if (!run_block()) {
          std::fprintf(stderr, "cuda emulation: block (%u, %u, %u) stopped at barriers not every thread reaches\n",
                       x, y, z);
          std::abort();
        }
      }
}

}  // namespace emu
