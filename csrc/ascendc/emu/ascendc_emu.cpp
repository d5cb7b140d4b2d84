// Runtime of the AscendC host emulation (see include/kernel_operator.h): cores as fibers, local
// memories, TPipe/TQue/TBuf state, cross-core flags, and the happens-before race detector.
//
// Race detector. Every instruction runs on one pipe of one core ("agent"; PIPE_S .. PIPE_FIX) and
// gets a timestamp from its pipe's counter. Each agent keeps a vector clock over all agents: the
// latest timestamp of every agent it is ordered after. Orderings come from
//   * queue EnQue -> DeQue (producer pipe -> consumer pipe), FreeTensor -> AllocTensor (back),
//   * PipeBarrier<p> (p's later instructions after its earlier ones), PipeBarrier<PIPE_ALL>,
//   * CrossCoreSetFlag -> CrossCoreWaitFlag (the setting pipe -> every pipe of the waiting core;
//     on Atlas A2 the wait blocks all pipes),
//   * program order within the pipes that execute in order (S, MTE1, M, FIX). V, MTE2 and MTE3 do
//     not order dependent instructions by themselves (CANN: PipeBarrier for dependent vector
//     instructions, for overlapping DMA destinations).
// Local memory is shadowed per 32-byte block, writable GM per 2 bytes: the last write and the
// reads since. An access not ordered after a conflicting one from another agent (or, for V /
// MTE2 / MTE3, from its own pipe without a barrier) is a race.
#include "kernel_operator.h"

#include <ucontext.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

// ----- half / bfloat16_t -----------------------------------------------------------------------

namespace {
uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

half::half(float f) {
  const uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf, NaN
    bits = static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  } else if (a >= 0x477ff000u) {  // >= 65520 rounds to inf
    bits = static_cast<uint16_t>(sign | 0x7c00u);
  } else if (a < 0x38800000u) {  // below 2^-14: subnormal or zero, in units of 2^-24
    bits = static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(bits_f32(a) * 16777216.0f)));
  } else {
    const uint32_t e = ((a >> 23) - 127 + 15) << 10;
    const uint32_t m = a & 0x7fffffu;
    uint32_t h = e | (m >> 13);
    const uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    bits = static_cast<uint16_t>(sign | h);
  }
}

half::operator float() const {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t e = (bits >> 10) & 0x1fu;
  const uint32_t m = bits & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) / 16777216.0f;
    return sign ? -v : v;
  }
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
  return bits_f32(sign | ((e - 15 + 127) << 23) | (m << 13));
}

bfloat16_t::bfloat16_t(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    bits = static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  } else {
    bits = static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
}

bfloat16_t::operator float() const { return bits_f32(static_cast<uint32_t>(bits) << 16); }

namespace slmoe_emu {
namespace {

constexpr int kPipes = 7;  // PIPE_S .. PIPE_FIX
constexpr int kMems = static_cast<int>(Mem::kCount);
constexpr int kFlags = 16;
constexpr int kMaxFlagCount = 15;
constexpr uint32_t kBlock = 32;  // shadow granularity of local memory
constexpr size_t kStackBytes = 512 * 1024;

const char* kPipeName[kPipes + 1] = {"S", "V", "M", "MTE1", "MTE2", "MTE3", "FIX", "ALL"};
const char* kMemName[kMems] = {"L1", "L0A", "L0B", "L0C", "UB"};
constexpr uint32_t kMemBytes[kMems] = {512 * 1024, 64 * 1024, 64 * 1024, 128 * 1024, 192 * 1024};

bool in_order(int pipe) { return pipe == PIPE_S || pipe == PIPE_MTE1 || pipe == PIPE_M || pipe == PIPE_FIX; }

using Clock = std::vector<uint32_t>;

struct Shadow {  // one 32-byte block of local memory
  uint32_t wt = 0;
  uint8_t wpipe = 0;
  uint32_t rt[kPipes] = {};
};

struct Buffer {
  enum State { kFree, kAlloc, kQueued, kDequeued, kTBuf } state = kFree;
  Mem mem = Mem::UB;
  AscendC::TPosition pos = AscendC::TPosition::MAX;
  uint32_t addr = 0, bytes = 0, gen = 0;
  int queue = -1;
  Clock enq_snap, free_snap;
};

struct Queue {
  AscendC::TPosition pos;
  int depth = 1;
  int producer = PIPE_S, consumer = PIPE_S;
  std::vector<int> buffers;
  size_t next = 0;
  std::deque<int> fifo;
};

struct Core {
  bool aic = false;
  uint32_t block = 0, sub = 0;
  int index = 0;
  std::string name;
  int kernel_type = -1;
  std::vector<uint8_t> mem[kMems];
  std::vector<Shadow> shadow[kMems];
  uint32_t cursor[kMems] = {};
  int queue_buffers[static_cast<int>(AscendC::TPosition::MAX)] = {};
  uint32_t counter[kPipes] = {};
  Clock vc[kPipes];
  std::vector<Buffer> buffers;
  std::vector<Queue> queues;
  std::deque<Clock> inbox[2][kFlags];  // AIV: [0] from its AIC; AIC: [sub] from each AIV
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  bool done = false;
  std::function<bool()> wait_for;
  std::string waiting_on;
};

struct GmShadow {  // two bytes of writable global memory
  uint32_t wagent = 0;  // agent + 1, 0: never written in this launch
  uint32_t wt = 0;
  uint32_t ragent[2] = {};
  uint32_t rt[2] = {};
};

struct GmRegion {
  uintptr_t begin = 0, end = 0;
  bool writable = false;
  std::string name;
  std::vector<GmShadow> shadow;
};

struct Launch {
  uint32_t block_dim = 0;
  int kernel_type = KERNEL_TYPE_MIX_AIC_1_2;  // launch_mix: one AIC + two AIVs per block; launch_aiv: one AIV
  std::vector<std::unique_ptr<Core>> cores;
  int cur = -1;
  ucontext_t sched;
  const std::function<void()>* kernel = nullptr;
  // the instruction in flight
  int op_pipe = -1;
  uint32_t op_t = 0;
  const char* op_name = nullptr;
};

Launch* g_launch = nullptr;
std::map<uintptr_t, GmRegion> g_gm;
bool g_gm_unregistered_ok = false;

Core& cur() {
  if (g_launch == nullptr || g_launch->cur < 0) fail("AscendC device API called outside an emulated launch");
  return *g_launch->cores[g_launch->cur];
}

uint32_t agents() { return static_cast<uint32_t>(g_launch->cores.size()) * kPipes; }
uint32_t agent(const Core& c, int pipe) { return static_cast<uint32_t>(c.index * kPipes + pipe); }
std::string agent_name(uint32_t a) {
  const Core& c = *g_launch->cores[a / kPipes];
  return c.name + "/" + kPipeName[a % kPipes];
}

Clock snapshot(const Core& c, int pipe) {
  Clock s = c.vc[pipe];
  s[agent(c, pipe)] = c.counter[pipe];
  return s;
}

void join(Core& c, int pipe, const Clock& s) {
  Clock& v = c.vc[pipe];
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::max(v[i], s[i]);
}

void join_all(Core& c, const Clock& s) {
  for (int p = 0; p < kPipes; ++p) join(c, p, s);
}

// ----- fibers ----------------------------------------------------------------------------------

void yield() {
  Core& c = cur();
  swapcontext(&c.ctx, &g_launch->sched);
}

void block_until(std::function<bool()> ready, std::string what) {
  if (ready()) return;
  Core& c = cur();
  c.wait_for = std::move(ready);
  c.waiting_on = std::move(what);
  yield();
}

void check_core_end(Core& c) {
  if (c.kernel_type != g_launch->kernel_type) {
    fail("the kernel did not declare KERNEL_TASK_TYPE_DEFAULT(%s)",
         g_launch->kernel_type == KERNEL_TYPE_AIV_ONLY ? "KERNEL_TYPE_AIV_ONLY" : "KERNEL_TYPE_MIX_AIC_1_2");
  }
  for (size_t q = 0; q < c.queues.size(); ++q) {
    for (int b : c.queues[q].buffers) {
      if (c.buffers[b].state != Buffer::kFree) {
        fail("the kernel ended with a tensor of queue %zu (position %d) still allocated or queued", q,
             static_cast<int>(c.queues[q].pos));
      }
    }
  }
}

void fiber_main() {
  (*g_launch->kernel)();
  Core& c = cur();
  check_core_end(c);
  c.done = true;
  swapcontext(&c.ctx, &g_launch->sched);
}

// ----- shadows ---------------------------------------------------------------------------------

[[noreturn]] void race(const char* kind, const std::string& where, uint32_t other_agent, uint32_t other_t) {
  fail("race (%s) on %s: not ordered after %s instruction #%u; a queue EnQue/DeQue, SetFlag/WaitFlag, "
       "PipeBarrier or CrossCore flag must order them",
       kind, where.c_str(), agent_name(other_agent).c_str(), other_t);
}

std::string local_where(Mem m, uint32_t block) {
  return std::string(kMemName[static_cast<int>(m)]) + " bytes [" + std::to_string(block * kBlock) + ", " +
         std::to_string((block + 1) * kBlock) + ")";
}

void check_local(Core& c, Mem m, uint32_t first_block, uint32_t last_block, bool write) {
  const int p = g_launch->op_pipe;
  const uint32_t t = g_launch->op_t;
  const Clock& v = c.vc[p];
  for (uint32_t b = first_block; b <= last_block; ++b) {
    Shadow& s = c.shadow[static_cast<int>(m)][b];
    if (s.wt != 0) {
      const uint32_t wa = agent(c, s.wpipe);
      const bool same = s.wpipe == p;
      const bool ordered = same ? (in_order(p) || s.wt <= v[wa]) : s.wt <= v[wa];
      if (!ordered) race(write ? "write after write" : "read after write", local_where(m, b), wa, s.wt);
    }
    if (write) {
      for (int q = 0; q < kPipes; ++q) {
        if (q == p || s.rt[q] == 0) continue;  // same-pipe reads happen before later writes
        if (s.rt[q] > v[agent(c, q)]) race("write after read", local_where(m, b), agent(c, q), s.rt[q]);
      }
      s.wt = t;
      s.wpipe = static_cast<uint8_t>(p);
      std::fill(std::begin(s.rt), std::end(s.rt), 0u);
    } else {
      s.rt[p] = std::max(s.rt[p], t);
    }
  }
}

GmRegion* find_gm(const void* p, uint64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_gm.upper_bound(a);
  if (it == g_gm.begin()) return nullptr;
  --it;
  GmRegion& r = it->second;
  if (a < r.begin || a + bytes > r.end) return nullptr;
  return &r;
}

void check_gm(Core& c, GmRegion& r, uintptr_t a, uint64_t bytes, bool write) {
  const int p = g_launch->op_pipe;
  const uint32_t me = agent(c, p);
  const uint32_t t = g_launch->op_t;
  const Clock& v = c.vc[p];
  const uint64_t first = (a - r.begin) / 2, last = (a + bytes - 1 - r.begin) / 2;
  for (uint64_t u = first; u <= last; ++u) {
    GmShadow& s = r.shadow[u];
    const auto where = [&] { return "GM " + r.name + " bytes [" + std::to_string(u * 2) + ", " + std::to_string(u * 2 + 2) + ")"; };
    if (s.wagent != 0 && s.wagent - 1 != me && s.wt > v[s.wagent - 1]) {
      race(write ? "write after write" : "read after write", where(), s.wagent - 1, s.wt);
    }
    if (write) {
      for (int i = 0; i < 2; ++i) {
        if (s.ragent[i] != 0 && s.ragent[i] - 1 != me && s.rt[i] > v[s.ragent[i] - 1]) {
          race("write after read", where(), s.ragent[i] - 1, s.rt[i]);
        }
      }
      s = GmShadow{};
      s.wagent = me + 1;
      s.wt = t;
    } else {
      int slot = -1;
      for (int i = 0; i < 2; ++i)
        if (s.ragent[i] == me + 1) slot = i;
      if (slot < 0) slot = s.ragent[0] == 0 ? 0 : (s.ragent[1] == 0 ? 1 : (s.rt[0] <= s.rt[1] ? 0 : 1));
      s.ragent[slot] = me + 1;
      s.rt[slot] = t;
    }
  }
}

Buffer& buffer_of(Core& c, const TensorRef& t) {
  if (t.buffer < 0 || t.buffer >= static_cast<int>(c.buffers.size())) fail("tensor was not allocated by TPipe");
  return c.buffers[t.buffer];
}

Queue& queue_at(Core& c, int q) {
  if (q < 0 || q >= static_cast<int>(c.queues.size())) fail("queue of another core");
  return c.queues[q];
}

void validate(Core& c, const TensorRef& t, const char* what) {
  if (t.core != c.index) fail("%s: tensor belongs to another core", what);
  const Buffer& b = buffer_of(c, t);
  if (b.state == Buffer::kTBuf) return;
  if (t.gen != b.gen) fail("%s: stale tensor (its buffer was freed and allocated again)", what);
  switch (b.state) {
    case Buffer::kAlloc:
    case Buffer::kDequeued:
      return;
    case Buffer::kQueued:
      fail("%s: tensor used while it is in its queue (use before DeQue, or after EnQue)", what);
    default:
      fail("%s: tensor used after FreeTensor", what);
  }
}

std::pair<int, int> queue_pipes(AscendC::TPosition pos) {
  using AscendC::TPosition;
  switch (pos) {
    case TPosition::VECIN: return {PIPE_MTE2, PIPE_V};
    case TPosition::VECOUT: return {PIPE_V, PIPE_MTE3};
    case TPosition::A1:
    case TPosition::B1: return {PIPE_MTE2, PIPE_MTE1};
    case TPosition::A2:
    case TPosition::B2: return {PIPE_MTE1, PIPE_M};
    case TPosition::CO1: return {PIPE_M, PIPE_FIX};
    default: fail("TQue position %d is not emulated", static_cast<int>(pos));
  }
}

Mem mem_of(AscendC::TPosition pos) {
  using AscendC::TPosition;
  switch (pos) {
    case TPosition::A1:
    case TPosition::B1: return Mem::L1;
    case TPosition::A2: return Mem::L0A;
    case TPosition::B2: return Mem::L0B;
    case TPosition::CO1: return Mem::L0C;
    case TPosition::VECIN:
    case TPosition::VECOUT:
    case TPosition::VECCALC: return Mem::UB;
    default: fail("position %d is not emulated", static_cast<int>(pos));
  }
}

int make_buffer(Core& c, AscendC::TPosition pos, uint32_t len, Buffer::State state, int queue) {
  const Mem m = mem_of(pos);
  const bool cube_mem = m != Mem::UB;
  if (cube_mem != c.aic) {
    fail("TPipe::InitBuffer: %s has no %s", c.aic ? "a cube unit (AIC)" : "a vector unit (AIV)",
         kMemName[static_cast<int>(m)]);
  }
  if (len == 0) fail("TPipe::InitBuffer: zero-byte buffer");
  const uint32_t bytes = (len + 31) / 32 * 32;
  const int mi = static_cast<int>(m);
  if (static_cast<uint64_t>(c.cursor[mi]) + bytes > kMemBytes[mi]) {
    fail("TPipe::InitBuffer: %u more bytes of %s do not fit (%u of %u in use)", bytes, kMemName[mi], c.cursor[mi],
         kMemBytes[mi]);
  }
  Buffer b;
  b.state = state;
  b.mem = m;
  b.pos = pos;
  b.addr = c.cursor[mi];
  b.bytes = bytes;
  b.queue = queue;
  c.cursor[mi] += bytes;
  c.buffers.push_back(std::move(b));
  return static_cast<int>(c.buffers.size()) - 1;
}

TensorRef ref_of(const Core& c, int id) {
  const Buffer& b = c.buffers[id];
  TensorRef r;
  r.core = c.index;
  r.mem = b.mem;
  r.pos = b.pos;
  r.addr = b.addr;
  r.bytes = b.bytes;
  r.buffer = id;
  r.gen = b.gen;
  return r;
}

}  // namespace

// ----- public runtime --------------------------------------------------------------------------

void fail(const char* fmt, ...) {
  std::fflush(stdout);
  std::fprintf(stderr, "emu: ");
  if (g_launch != nullptr && g_launch->cur >= 0) {
    const Core& c = *g_launch->cores[g_launch->cur];
    std::fprintf(stderr, "[%s", c.name.c_str());
    if (g_launch->op_name != nullptr) std::fprintf(stderr, ", %s on PIPE_%s", g_launch->op_name, kPipeName[g_launch->op_pipe]);
    std::fprintf(stderr, "] ");
  }
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::_Exit(3);
}

namespace {
int g_mutation = [] {
  const char* s = std::getenv("SLMOE_EMU_MUTATION");
  return s ? std::atoi(s) : 0;
}();
}  // namespace

int mutation() { return g_mutation; }
void set_mutation(int n) { g_mutation = n; }

void gm_register(const void* p, size_t bytes, bool writable, const char* name) {
  if (bytes == 0) return;
  GmRegion r;
  r.begin = reinterpret_cast<uintptr_t>(p);
  r.end = r.begin + bytes;
  r.writable = writable;
  r.name = name;
  if (writable) r.shadow.resize((bytes + 1) / 2);
  g_gm[r.begin] = std::move(r);
}

void gm_clear() { g_gm.clear(); }

void gm_allow_unregistered(bool allow) { g_gm_unregistered_ok = allow; }

namespace {
void launch(uint32_t block_dim, int kernel_type, const std::function<void()>& kernel);
}

void launch_mix(uint32_t block_dim, const std::function<void()>& kernel) {
  launch(block_dim, KERNEL_TYPE_MIX_AIC_1_2, kernel);
}

void launch_aiv(uint32_t block_dim, const std::function<void()>& kernel) {
  launch(block_dim, KERNEL_TYPE_AIV_ONLY, kernel);
}

namespace {
void launch(uint32_t block_dim, int kernel_type, const std::function<void()>& kernel) {
  if (block_dim == 0) return;
  if (g_launch != nullptr) fail("nested launch");
  Launch L;
  L.block_dim = block_dim;
  L.kernel_type = kernel_type;
  const bool aiv_only = kernel_type == KERNEL_TYPE_AIV_ONLY;
  L.kernel = &kernel;
  g_launch = &L;
  for (auto& [addr, r] : g_gm) {  // a launch is ordered after everything before it on the stream
    (void)addr;
    std::fill(r.shadow.begin(), r.shadow.end(), GmShadow{});
  }
  for (uint32_t b = 0; b < block_dim; ++b) {
    for (int k = aiv_only ? 1 : 0; k < (aiv_only ? 2 : 3); ++k) {
      auto c = std::make_unique<Core>();
      c->aic = k == 0;
      c->block = b;
      c->sub = k == 0 ? 0 : k - 1;
      c->index = static_cast<int>(L.cores.size());
      c->name = c->aic ? "AIC" + std::to_string(b) : "AIV" + std::to_string(aiv_only ? b : 2 * b + c->sub);
      for (int m = 0; m < kMems; ++m) {
        const bool mine = (m == static_cast<int>(Mem::UB)) != c->aic;
        if (!mine) continue;
        c->mem[m].assign(kMemBytes[m], 0xff);  // NaN in every float type
        c->shadow[m].assign(kMemBytes[m] / kBlock, Shadow{});
      }
      L.cores.push_back(std::move(c));
    }
  }
  for (auto& c : L.cores) {
    for (int p = 0; p < kPipes; ++p) c->vc[p].assign(agents(), 0);
    c->stack.reset(new char[kStackBytes]);
    getcontext(&c->ctx);
    c->ctx.uc_stack.ss_sp = c->stack.get();
    c->ctx.uc_stack.ss_size = kStackBytes;
    c->ctx.uc_link = nullptr;
    makecontext(&c->ctx, fiber_main, 0);
  }
  for (;;) {
    bool all_done = true, progress = false;
    for (size_t i = 0; i < L.cores.size(); ++i) {
      Core& c = *L.cores[i];
      if (c.done) continue;
      all_done = false;
      if (c.wait_for && !c.wait_for()) continue;
      c.wait_for = nullptr;
      L.cur = static_cast<int>(i);
      swapcontext(&L.sched, &c.ctx);
      L.cur = -1;
      progress = true;
    }
    if (all_done) break;
    if (!progress) {
      std::string who;
      for (auto& c : L.cores)
        if (!c->done) who += " " + c->name + " (" + c->waiting_on + ")";
      fail("deadlock: every unfinished core waits:%s", who.c_str());
    }
  }
  for (auto& c : L.cores) {
    for (int s = 0; s < 2; ++s) {
      for (int f = 0; f < kFlags; ++f) {
        if (!c->inbox[s][f].empty()) {
          fail("%s ended with %zu CrossCoreSetFlag(%d) never waited for", c->name.c_str(), c->inbox[s][f].size(), f);
        }
      }
    }
  }
  g_launch = nullptr;
}
}  // namespace

void declare_kernel_type(int type) { cur().kernel_type = type; }
bool is_aic() { return cur().aic; }
bool is_aiv() { return !cur().aic; }
int64_t block_idx() {
  const Core& c = cur();
  return c.aic || g_launch->kernel_type == KERNEL_TYPE_AIV_ONLY ? c.block : 2 * c.block + c.sub;
}
int64_t block_num() { return cur(), g_launch->block_dim; }
int64_t sub_block_idx() { return cur().sub; }

void pipe_open() {
  Core& c = cur();
  std::fill(std::begin(c.cursor), std::end(c.cursor), 0u);
}

int queue_create(AscendC::TPosition pos, int depth, int num, uint32_t len, const char* kind) {
  Core& c = cur();
  if (num < 1) fail("TPipe::InitBuffer(%s): %d buffers", kind, num);
  if (depth < 1) fail("TQue depth %d is not emulated", depth);
  const int pi = static_cast<int>(pos);
  c.queue_buffers[pi] += num;
  if (c.queue_buffers[pi] > 8) fail("TPipe::InitBuffer: more than 8 queue buffers on one position (event ids)");
  Queue q;
  q.pos = pos;
  q.depth = depth;
  std::tie(q.producer, q.consumer) = queue_pipes(pos);
  const int id = static_cast<int>(c.queues.size());
  for (int i = 0; i < num; ++i) q.buffers.push_back(make_buffer(c, pos, len, Buffer::kFree, id));
  c.queues.push_back(std::move(q));
  return id;
}

int tbuf_create(AscendC::TPosition pos, uint32_t len) {
  Core& c = cur();
  return make_buffer(c, pos, len, Buffer::kTBuf, -1);
}

TensorRef queue_alloc(int qi) {
  Core& c = cur();
  Queue& q = queue_at(c, qi);
  const int id = q.buffers[q.next];
  Buffer& b = c.buffers[id];
  if (b.state != Buffer::kFree) {
    fail("AllocTensor: the queue's next buffer (of %zu) is still in use: FreeTensor missing, or fewer buffers than "
         "tensors held at once",
         q.buffers.size());
  }
  q.next = (q.next + 1) % q.buffers.size();
  b.state = Buffer::kAlloc;
  ++b.gen;
  if (!b.free_snap.empty()) join(c, q.producer, b.free_snap);  // wait for its previous consumer
  return ref_of(c, id);
}

void queue_enque(int qi, const TensorRef& t) {
  Core& c = cur();
  Queue& q = queue_at(c, qi);
  Buffer& b = buffer_of(c, t);
  if (b.queue != qi) fail("EnQue: tensor of another queue");
  if (b.state != Buffer::kAlloc || b.gen != t.gen) fail("EnQue: tensor is not freshly allocated (enqueued twice?)");
  if (static_cast<int>(q.fifo.size()) >= q.depth) {
    fail("EnQue: %zu tensors already queued, more than the TQue depth %d", q.fifo.size(), q.depth);
  }
  b.state = Buffer::kQueued;
  b.enq_snap = snapshot(c, q.producer);
  q.fifo.push_back(t.buffer);
}

TensorRef queue_deque(int qi) {
  Core& c = cur();
  Queue& q = queue_at(c, qi);
  if (q.fifo.empty()) fail("DeQue on an empty queue");
  const int id = q.fifo.front();
  q.fifo.pop_front();
  Buffer& b = c.buffers[id];
  join(c, q.consumer, b.enq_snap);
  b.state = Buffer::kDequeued;
  return ref_of(c, id);
}

void queue_free(int qi, const TensorRef& t) {
  Core& c = cur();
  Queue& q = queue_at(c, qi);
  Buffer& b = buffer_of(c, t);
  if (b.queue != qi) fail("FreeTensor: tensor of another queue");
  if (b.gen != t.gen || b.state != Buffer::kDequeued) {
    fail("FreeTensor: tensor is not dequeued (double free, or FreeTensor before DeQue)");
  }
  b.free_snap = snapshot(c, q.consumer);
  b.state = Buffer::kFree;
}

TensorRef tbuf_get(int id, uint32_t bytes) {
  Core& c = cur();
  TensorRef r = ref_of(c, id);
  if (bytes > r.bytes) fail("TBuf::Get: %u bytes of a %u-byte buffer", bytes, r.bytes);
  if (bytes > 0) r.bytes = bytes;
  return r;
}

uint8_t* tensor_data(const TensorRef& t, const char* what) {
  Core& c = cur();
  validate(c, t, what);
  return c.mem[static_cast<int>(t.mem)].data() + t.addr;
}

void op_begin(pipe_t pipe, const char* what) {
  Core& c = cur();
  if (g_launch->op_name != nullptr) fail("instruction %s started inside %s", what, g_launch->op_name);
  g_launch->op_pipe = pipe;
  g_launch->op_t = ++c.counter[pipe];
  g_launch->op_name = what;
}

void op_local(const TensorRef& t, uint32_t offset, uint32_t bytes, bool write) {
  Core& c = cur();
  validate(c, t, g_launch->op_name);
  if (bytes == 0) return;
  if (static_cast<uint64_t>(offset) + bytes > t.bytes) fail("access past the end of a local tensor");
  const uint32_t a = t.addr + offset;
  check_local(c, t.mem, a / kBlock, (a + bytes - 1) / kBlock, write);
}

void op_gm(const void* p, uint64_t bytes, bool write) {
  Core& c = cur();
  if (bytes == 0) return;
  if (reinterpret_cast<uintptr_t>(p) < 65536) {
    fail("global memory access at %p, near address 0: a tensor the launch was not given", p);
  }
  GmRegion* r = find_gm(p, bytes);
  if (r == nullptr && g_gm_unregistered_ok) return;
  if (r == nullptr) {
    fail("global memory [%p, +%llu bytes) is outside every buffer of the launch", p,
         static_cast<unsigned long long>(bytes));
  }
  if (write && !r->writable) fail("write to the read-only global buffer %s", r->name.c_str());
  if (r->writable) check_gm(c, *r, reinterpret_cast<uintptr_t>(p), bytes, write);
}

void op_mmad_accumulate_check(const TensorRef& t, uint32_t bytes, uint16_t m, uint16_t n) {
  // CANN: consecutive Mmads accumulating into one L0C block need PipeBarrier<PIPE_M> between them
  // unless (m / 16) * (n / 16) >= 10.
  if ((m / 16) * (n / 16) >= 10) return;
  Core& c = cur();
  const uint32_t a = t.addr;
  const Clock& v = c.vc[PIPE_M];
  for (uint32_t b = a / kBlock; b <= (a + bytes - 1) / kBlock; ++b) {
    const Shadow& s = c.shadow[static_cast<int>(Mem::L0C)][b];
    if (s.wt != 0 && s.wpipe == PIPE_M && s.wt > v[agent(c, PIPE_M)]) {
      fail("Mmad accumulates (m=%u, n=%u) into L0C written by the previous Mmad without PipeBarrier<PIPE_M>", m, n);
    }
  }
}

void op_end() { g_launch->op_name = nullptr; }

void pipe_barrier(pipe_t pipe) {
  Core& c = cur();
  if (pipe == PIPE_S) fail("PipeBarrier<PIPE_S> is not supported");
  if (pipe != PIPE_ALL) {
    c.vc[pipe][agent(c, pipe)] = c.counter[pipe];
    return;
  }
  Clock all(agents(), 0);
  for (int p = 0; p < kPipes; ++p) {
    const Clock s = snapshot(c, p);
    for (size_t i = 0; i < all.size(); ++i) all[i] = std::max(all[i], s[i]);
  }
  join_all(c, all);
}

void cross_core_set(uint8_t mode, pipe_t pipe, uint16_t flag) {
  Core& c = cur();
  if (mode != 2) fail("CrossCoreSetFlag mode %u is not emulated (mode 2 only)", mode);
  if (pipe == PIPE_S || pipe == PIPE_ALL) fail("CrossCoreSetFlag does not take PIPE_S or PIPE_ALL");
  if (flag >= kFlags) fail("CrossCoreSetFlag flag id %u > 15", flag);
  if (g_launch->kernel_type != KERNEL_TYPE_MIX_AIC_1_2) fail("CrossCoreSetFlag in a kernel without a cube unit");
  const Clock s = snapshot(c, pipe);
  auto post = [&](Core& to, int slot) {
    auto& box = to.inbox[slot][flag];
    box.push_back(s);
    if (static_cast<int>(box.size()) > kMaxFlagCount) fail("CrossCoreSetFlag(%u): flag counter of %s above 15", flag, to.name.c_str());
  };
  const uint32_t base = c.block * 3;
  if (c.aic) {
    post(*g_launch->cores[base + 1], 0);
    post(*g_launch->cores[base + 2], 0);
  } else {
    post(*g_launch->cores[base], static_cast<int>(c.sub));
  }
}

void cross_core_wait(uint8_t mode, uint16_t flag) {
  Core& c = cur();
  if (flag >= kFlags) fail("CrossCoreWaitFlag flag id %u > 15", flag);
  if (g_launch->kernel_type != KERNEL_TYPE_MIX_AIC_1_2) fail("CrossCoreWaitFlag in a kernel without a cube unit");
  (void)mode;  // Atlas A2: the wait blocks all pipes whatever the mode template says
  Core* me = &c;
  const std::string what = "CrossCoreWaitFlag(" + std::to_string(flag) + ")";
  if (c.aic) {
    block_until([me, flag] { return !me->inbox[0][flag].empty() && !me->inbox[1][flag].empty(); }, what);
    for (int s = 0; s < 2; ++s) {
      join_all(*me, me->inbox[s][flag].front());
      me->inbox[s][flag].pop_front();
    }
  } else {
    block_until([me, flag] { return !me->inbox[0][flag].empty(); }, what);
    join_all(*me, me->inbox[0][flag].front());
    me->inbox[0][flag].pop_front();
  }
}

}  // namespace slmoe_emu

namespace AscendC {
int64_t GetBlockIdx() { return slmoe_emu::block_idx(); }
int64_t GetBlockNum() { return slmoe_emu::block_num(); }
int64_t GetSubBlockIdx() { return slmoe_emu::sub_block_idx(); }
}  // namespace AscendC
