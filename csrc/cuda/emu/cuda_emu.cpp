// Runtime of the host CUDA emulation (see cuda_emu.h): fibers, barriers, warp exchange, deferred
// cp.async, and the few CUDA runtime API functions the launchers call.
//
// Fibers start through makecontext/swapcontext and then switch with _setjmp/_longjmp, which does
// not save the signal mask (swapcontext makes a system call on every switch, 10x slower here).
#include "cuda_emu.h"

#include <setjmp.h>
#include <ucontext.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace slmoe_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kSlotBytes = 64;

struct PendingCopy {
  void* dst;
  const void* src;
  int src_bytes;
};

struct Fiber {
  ucontext_t ctx;  // only to start the fiber
  jmp_buf jb;      // where it resumes
  bool started = false;
  std::unique_ptr<char[]> stack;
  unsigned tid = 0;
  bool done = false;
  const uint64_t* wait_gen = nullptr;  // blocked while *wait_gen == wait_val
  uint64_t wait_val = 0;
  std::vector<PendingCopy> copies;     // issued cp.async, oldest first
  std::vector<size_t> group_ends;      // copies.size() at each commit
  size_t completed = 0;                // copies[0, completed) have been performed
};

struct Block {
  dim3 grid, block;
  uint3 bidx;
  unsigned nthreads = 0;
  std::vector<unsigned char> smem;
  std::vector<Fiber> fibers;
  unsigned cur = 0;
  ucontext_t sched_ctx;  // unused after a fiber starts: fibers return with _longjmp(sched_jb)
  jmp_buf sched_jb;
  const std::function<void()>* body = nullptr;
  uint64_t bar_gen = 0;
  unsigned bar_arrived = 0;
  std::vector<uint64_t> warp_gen;
  std::vector<unsigned> warp_arrived;
  std::vector<unsigned char> slots;  // kSlotBytes per thread
};

Block* g_block = nullptr;

Block& blk() {
  if (g_block == nullptr) fail("CUDA device function called outside an emulated launch");
  return *g_block;
}
Fiber& me() { return blk().fibers[blk().cur]; }

void yield() {
  Block& b = blk();
  if (_setjmp(b.fibers[b.cur].jb) == 0) _longjmp(b.sched_jb, 1);
}

void fiber_entry() {
  Block& b = blk();
  (*b.body)();
  Fiber& f = b.fibers[b.cur];
  if (f.completed != f.copies.size()) {
    fail("thread %u of block %u exited with %zu cp.async copies never waited for", f.tid, b.bidx.x,
         f.copies.size() - f.completed);
  }
  f.done = true;
  _longjmp(b.sched_jb, 1);  // never return: the fiber's start context is stale by now
}

unsigned warp_size_of(const Block& b, unsigned warp) {
  const unsigned first = warp * 32;
  return b.nthreads - first < 32 ? b.nthreads - first : 32;
}

void warp_barrier() {
  Block& b = blk();
  const unsigned warp = b.fibers[b.cur].tid / 32;
  const uint64_t gen = b.warp_gen[warp];
  if (++b.warp_arrived[warp] == warp_size_of(b, warp)) {
    b.warp_arrived[warp] = 0;
    ++b.warp_gen[warp];
    return;
  }
  Fiber& f = b.fibers[b.cur];
  f.wait_gen = &b.warp_gen[warp];
  f.wait_val = gen;
  yield();
}

void perform(const PendingCopy& c) {
  if (c.src_bytes > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
  std::memset(static_cast<unsigned char*>(c.dst) + c.src_bytes, 0, static_cast<size_t>(16 - c.src_bytes));
}

// Runs fiber t until it blocks or exits. Its own function, so no local of the scheduler loop
// lives in the frame _setjmp saves.
__attribute__((noinline)) void resume(Block& b, unsigned t) {
  Fiber& f = b.fibers[t];
  b.cur = t;
  if (_setjmp(b.sched_jb) == 0) {
    if (!f.started) {
      f.started = true;
      swapcontext(&b.sched_ctx, &f.ctx);
    } else {
      _longjmp(f.jb, 1);
    }
  }
}

void run_block(Block& b) {
  b.fibers.clear();
  b.fibers.resize(b.nthreads);
  for (unsigned t = 0; t < b.nthreads; ++t) {
    Fiber& f = b.fibers[t];
    f.tid = t;
    f.stack.reset(new char[kStackBytes]);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  for (;;) {
    bool alive = false, ran = false;
    for (unsigned t = 0; t < b.nthreads; ++t) {
      Fiber& f = b.fibers[t];
      if (f.done) continue;
      alive = true;
      if (f.wait_gen != nullptr && *f.wait_gen == f.wait_val) continue;
      f.wait_gen = nullptr;
      ran = true;
      resume(b, t);
    }
    if (!alive) break;
    if (!ran) {
      unsigned done = 0;
      for (auto& f : b.fibers) done += f.done;
      fail("deadlock in block %u: %u of %u threads exited, the rest wait at barriers (%u at __syncthreads)",
           b.bidx.x, done, b.nthreads, b.bar_arrived);
    }
  }
}

}  // namespace

void fail(const char* fmt, ...) {
  std::fprintf(stderr, "cuda_emu: ");
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::abort();
}

uint3 thread_idx() { return make_uint3(me().tid, 0, 0); }
uint3 block_idx() { return blk().bidx; }
dim3 block_dim() { return blk().block; }
dim3 grid_dim() { return blk().grid; }
unsigned char* dynamic_smem() { return blk().smem.data(); }

void syncthreads() {
  Block& b = blk();
  const uint64_t gen = b.bar_gen;
  if (++b.bar_arrived == b.nthreads) {
    b.bar_arrived = 0;
    ++b.bar_gen;
    return;
  }
  Fiber& f = me();
  f.wait_gen = &b.bar_gen;
  f.wait_val = gen;
  yield();
}

void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  if (g_block != nullptr) fail("nested launch");
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) fail("only 1-D grids and blocks are emulated");
  if (block.x == 0 || block.x > 1024 || grid.x == 0) fail("bad launch configuration %u x %u", grid.x, block.x);
  Block b;
  b.grid = grid;
  b.block = block;
  b.nthreads = block.x;
  b.body = &body;
  b.warp_gen.assign((block.x + 31) / 32, 0);
  b.warp_arrived.assign((block.x + 31) / 32, 0);
  b.slots.assign(static_cast<size_t>(block.x) * kSlotBytes, 0);
  g_block = &b;
  for (unsigned x = 0; x < grid.x; ++x) {
    b.bidx = make_uint3(x, 0, 0);
    b.smem.assign(smem_bytes, 0xff);  // NaN in every float type: reading unwritten smem shows
    b.bar_gen = 0;
    b.bar_arrived = 0;
    run_block(b);
  }
  g_block = nullptr;
}

void warp_put(const void* data, size_t bytes) {
  if (bytes > kSlotBytes) fail("warp_put: %zu bytes exceed the slot", bytes);
  Block& b = blk();
  std::memcpy(b.slots.data() + static_cast<size_t>(me().tid) * kSlotBytes, data, bytes);
  warp_barrier();
}

const void* warp_peer(int lane) {
  Block& b = blk();
  const unsigned warp = me().tid / 32;
  if (lane < 0 || static_cast<unsigned>(lane) >= warp_size_of(b, warp)) fail("warp_peer: bad lane %d", lane);
  return b.slots.data() + static_cast<size_t>(warp * 32 + static_cast<unsigned>(lane)) * kSlotBytes;
}

void warp_done() { warp_barrier(); }

void check_smem(const void* p, size_t bytes, size_t align, const char* what) {
  Block& b = blk();
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < b.smem.data() || c + bytes > b.smem.data() + b.smem.size()) {
    fail("%s: %p (+%zu) is outside the block's %zu bytes of shared memory (thread %u, block %u)", what, p, bytes,
         b.smem.size(), me().tid, b.bidx.x);
  }
  if (static_cast<size_t>(c - b.smem.data()) % align != 0) {
    fail("%s: shared offset %td is not %zu-byte aligned (thread %u)", what, c - b.smem.data(), align, me().tid);
  }
}

void cp_async(void* dst, const void* src, int src_bytes) {
  check_smem(dst, 16, 16, "cp.async destination");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0) fail("cp.async source %p is not 16-byte aligned", src);
  if (src_bytes < 0 || src_bytes > 16) fail("cp.async src_bytes %d", src_bytes);
  me().copies.push_back({dst, src, src_bytes});
}

void cp_async_commit() {
  Fiber& f = me();
  f.group_ends.push_back(f.copies.size());
}

void cp_async_wait(int pending) {
  Fiber& f = me();
  const int groups = static_cast<int>(f.group_ends.size());
  if (groups <= pending) return;
  const size_t upto = f.group_ends[static_cast<size_t>(groups - pending - 1)];
  for (; f.completed < upto; ++f.completed) perform(f.copies[f.completed]);
}

namespace {
int g_mutation = -1;  // -1: not set, read $SLMOE_EMU_MUTATION
}

int mutation() {
  if (g_mutation < 0) {
    const char* env = std::getenv("SLMOE_EMU_MUTATION");
    g_mutation = env != nullptr ? std::atoi(env) : 0;
  }
  return g_mutation;
}

void set_mutation(int n) { g_mutation = n; }

int emu_sm_count() {
  const char* env = std::getenv("SLMOE_EMU_SMS");
  const int n = env != nullptr ? std::atoi(env) : 4;
  return n > 0 ? n : 4;
}

}  // namespace slmoe_emu

// The CUDA runtime functions the launchers call, for one emulated device.
extern "C" {

cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t err) { return err == cudaSuccess ? "no error" : "emulated error"; }

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = slmoe_emu::emu_sm_count();
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void*, enum cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return value <= 227 * 1024 ? cudaSuccess : cudaErrorInvalidValue;  // Hopper's opt-in limit
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, const void*, int block_size,
                                                          size_t dynamic_smem) {
  *num_blocks = (block_size <= 1024 && dynamic_smem <= 227 * 1024) ? 1 : 0;
  return cudaSuccess;
}

}  // extern "C"
