// The simulator's executor: kernel registry, launch validation, the per-threadgroup fiber
// scheduler with lock-step simd-group and barrier semantics, fault reporting, race detection on
// threadgroup and device memory, and the parallel loop over threadgroups.
#include "runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "exec.h"
#include "fiber.h"
#include "kernel_registry.h"

namespace tree_attn::sim {
namespace detail {
namespace {

constexpr int kMaxBufferIndex = 31;       // Metal's argument table holds [[buffer(0..30)]]
constexpr int kMaxThreadgroupIndex = 31;

// ---------------------------------------------------------------------------------------------
// Registry
// ---------------------------------------------------------------------------------------------
struct Registry {
  std::mutex mutex;
  std::map<std::string, KernelEntry> kernels;
  std::map<std::string, std::string> duplicates;  // name -> message
};
Registry& registry() {
  static Registry r;
  return r;
}

const KernelEntry& find_kernel(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (auto d = r.duplicates.find(name); d != r.duplicates.end()) throw std::runtime_error(d->second);
  auto it = r.kernels.find(name);
  if (it == r.kernels.end()) {
    std::ostringstream msg;
    msg << "metal simulator: no kernel named '" << name << "'; the translated shaders define: ";
    bool first = true;
    for (const auto& [k, _] : r.kernels) {
      msg << (first ? "" : ", ") << k;
      first = false;
    }
    throw std::runtime_error(msg.str());
  }
  return it->second;
}

std::string site_str(const Site& s) {
  std::ostringstream o;
  o << s.file_name() << ":" << s.line() << ":" << s.column();
  return o.str();
}
bool same_site(const Site& a, const Site& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

std::string lanes_str(uint32_t mask) {
  std::ostringstream o;
  o << "{";
  bool first = true;
  for (int l = 0; l < 32;) {
    if (!(mask >> l & 1u)) {
      ++l;
      continue;
    }
    int e = l;
    while (e + 1 < 32 && (mask >> (e + 1) & 1u)) ++e;
    o << (first ? "" : ",") << l;
    if (e > l) o << "-" << e;
    first = false;
    l = e + 1;
  }
  o << "}";
  return o.str();
}

size_t env_size(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(v, &end, 10);
  return (end && *end == 0 && x > 0) ? size_t(x) : fallback;
}

// ---------------------------------------------------------------------------------------------
// Fiber stacks: mmap'd with a guard page below each, reused across threadgroups and launches.
// ---------------------------------------------------------------------------------------------
class Stack {
 public:
  explicit Stack(size_t size) : page_(size_t(sysconf(_SC_PAGESIZE))), size_(size) {
    total_ = size_ + page_;
    mem_ = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem_ == MAP_FAILED) throw std::runtime_error("metal simulator: cannot map a fiber stack");
    if (mprotect(mem_, page_, PROT_NONE) != 0) {
      munmap(mem_, total_);
      throw std::runtime_error("metal simulator: cannot protect a fiber stack's guard page");
    }
  }
  ~Stack() { munmap(mem_, total_); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  void* base() const { return static_cast<char*>(mem_) + page_; }
  size_t size() const { return size_; }

 private:
  size_t page_, size_, total_;
  void* mem_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Worker: runs threadgroups of one launch on one OS thread.
// ---------------------------------------------------------------------------------------------
struct LaunchShared {
  const KernelEntry* kernel = nullptr;
  uint32_t grid[3], threads[3];
  uint32_t num_threads = 0, num_simd = 0;
  BufferState buffers[kMaxBufferIndex + 1];
  size_t tg_offsets[kMaxThreadgroupIndex + 1];
  size_t tg_sizes[kMaxThreadgroupIndex + 1];
  bool tg_bound[kMaxThreadgroupIndex + 1];
  size_t dynamic_tg_bytes = 0;
  std::vector<ConstantSlot> constants;  // by the kernel's function-constant slot
  std::vector<std::unique_ptr<std::max_align_t[]>> inline_data;
  std::atomic<bool> stop{false};
};

struct Worker {
  const LaunchShared* launch = nullptr;
  uint32_t tg_pos[3] = {0, 0, 0};
  BufferState buffers[kMaxBufferIndex + 1];

  // Threadgroup memory: dynamic [[threadgroup(i)]] regions first, body arrays after them.
  alignas(64) unsigned char arena[kMaxThreadgroupMemory + 64];
  size_t arena_used = 0;
  std::vector<std::pair<const TgSite*, TgRegion>> declared;
  std::vector<TgRegion> regions;  // every region of the current threadgroup, for lookups

  OpCounters counters;
  ThreadCtx threads[kMaxThreadsPerThreadgroup];
  SimdGroup simd[kMaxThreadsPerThreadgroup / kSimdWidth];
  std::vector<std::unique_ptr<Stack>> stacks;
  StackBounds fiber_stacks[kMaxThreadsPerThreadgroup];  // the part of stacks[i] thread i runs on
  size_t stack_size = 0;
  void* scheduler_sp = nullptr;

  // Race detection on threadgroup memory: one shadow entry per 2-byte granule of the arena.
  // `epoch` advances at every threadgroup start and every completed threadgroup_barrier, so
  // entries from an earlier epoch need no clearing.
  std::vector<TgShadow> shadow = std::vector<TgShadow>(kMaxThreadgroupMemory / 2 + 32);
  uint32_t epoch = 0;

  uint32_t done_count = 0;
  uint32_t barrier_count = 0;
  Site barrier_site;
  std::exception_ptr fault;
  uint64_t fault_tg = UINT64_MAX;
  uint64_t tg_linear = 0;

  // Every device store of the launch, checked for write-write races after it (see
  // check_device_store_races).
  struct Store {
    uintptr_t begin, end;
    uint64_t group;   // threadgroup, linear
    uint32_t thread;  // index in the threadgroup
    uint32_t epoch;   // threadgroup barrier epoch
  };
  std::vector<Store> stores;
  std::vector<Store> loads;  // from allocations that are also stored to (track_loads)

  ThreadCtx* next_ready(uint32_t from) {
    const uint32_t n = launch->num_threads;
    for (uint32_t k = 0; k < n; ++k) {
      uint32_t i = from + k;
      if (i >= n) i -= n;
      if (threads[i].state == ThreadState::ready) return &threads[i];
    }
    return nullptr;
  }
  void prepare(const LaunchShared& shared);
  void run_threadgroup(uint64_t linear);
  void finish_thread(ThreadCtx* t);
  void complete_simd_op(SimdGroup& sg, uint32_t simd_index, const ThreadCtx* self);
  [[noreturn]] void deadlock();
};

namespace {
thread_local ThreadCtx* tls_thread = nullptr;

std::string thread_where(const ThreadCtx* t) {
  std::ostringstream o;
  const Worker* w = t->worker;
  o << "threadgroup (" << w->tg_pos[0] << "," << w->tg_pos[1] << "," << w->tg_pos[2] << "), thread ("
    << t->pos[0] << "," << t->pos[1] << "," << t->pos[2] << ") [index " << t->index << ", simdgroup " << t->simd
    << ", lane " << t->lane << "]";
  return o.str();
}

std::string kernel_prefix(const Worker* w) {
  return std::string("metal simulator: kernel '") + w->launch->kernel->name + "'";
}

[[noreturn]] void fault_here(const std::string& what) {
  ThreadCtx* t = tls_thread;
  if (!t) throw std::runtime_error("metal simulator: " + what);
  throw std::runtime_error(kernel_prefix(t->worker) + ": " + what + "; at " + thread_where(t));
}

// Suspends the calling fiber and resumes the next ready thread after it (round-robin), or the
// scheduler when none is ready (all done, a deadlock, or a fault to report). Switching directly
// between fibers halves the number of switches per synchronisation point.
void yield(ThreadCtx* t) {
  Worker* w = t->worker;
  if (!w->fault) {
    if (ThreadCtx* next = w->next_ready(t->index + 1)) {
      tls_thread = next;
      fiber_switch(&t->fiber_sp, next->fiber_sp, w->fiber_stacks[next->index]);
      return;  // whoever resumed this fiber set tls_thread to it
    }
  }
  fiber_switch(&t->fiber_sp, w->scheduler_sp, thread_stack());
}
void fiber_entry(void* arg) {
  fiber_started();
  auto* t = static_cast<ThreadCtx*>(arg);
  Worker* w = t->worker;
  try {
    w->launch->kernel->launch(*t);
    w->finish_thread(t);
  } catch (...) {
    w->fault = std::current_exception();
    t->state = ThreadState::done;
  }
  yield(t);
  std::abort();  // a finished fiber is never resumed
}

}  // namespace

void Worker::prepare(const LaunchShared& shared) {
  launch = &shared;
  stores.clear();
  loads.clear();
  std::memcpy(buffers, shared.buffers, sizeof(buffers));
  counters = OpCounters{};
  fault = nullptr;
  fault_tg = UINT64_MAX;
  const size_t want = env_size("TREE_ATTN_SIM_STACK_KIB", 256) * 1024;
  if (want != stack_size) {
    stacks.clear();
    stack_size = want;
  }
  while (stacks.size() < shared.num_threads) stacks.push_back(std::make_unique<Stack>(stack_size));
  for (uint32_t i = 0; i < shared.num_threads; ++i) {
    ThreadCtx& t = threads[i];
    t.worker = this;
    t.counters = &counters;
    t.constants = shared.constants.data();
    t.tg_shadow = shadow.data();
    t.tg_arena = reinterpret_cast<uintptr_t>(arena);
    t.tg_epoch = &epoch;
    t.index = i;
    t.lane = i % kSimdWidth;
    t.simd = i / kSimdWidth;
    t.pos[0] = i % shared.threads[0];
    t.pos[1] = (i / shared.threads[0]) % shared.threads[1];
    t.pos[2] = i / (shared.threads[0] * shared.threads[1]);
  }
}

void Worker::run_threadgroup(uint64_t linear) {
  const LaunchShared& L = *launch;
  tg_linear = linear;
  tg_pos[0] = uint32_t(linear % L.grid[0]);
  tg_pos[1] = uint32_t((linear / L.grid[0]) % L.grid[1]);
  tg_pos[2] = uint32_t(linear / (uint64_t(L.grid[0]) * L.grid[1]));

  // Poison threadgroup memory: a read before any write yields NaN (0xFF bytes).
  std::memset(arena, 0xFF, L.dynamic_tg_bytes);
  arena_used = L.dynamic_tg_bytes;
  declared.clear();
  regions.clear();
  for (int i = 0; i <= kMaxThreadgroupIndex; ++i) {
    if (!L.tg_bound[i]) continue;
    const uintptr_t b = reinterpret_cast<uintptr_t>(arena + L.tg_offsets[i]);
    regions.push_back(TgRegion{b, b + L.tg_sizes[i], "[[threadgroup]] argument"});
  }

  done_count = 0;
  barrier_count = 0;
  if (++epoch == 0) {  // wrapped: forget everything
    std::fill(shadow.begin(), shadow.end(), TgShadow{});
    epoch = 1;
  }
  for (uint32_t s = 0; s < L.num_simd; ++s) {
    SimdGroup& sg = simd[s];
    sg.live_mask = 0xffffffffu;
    sg.arrived_mask = sg.barrier_mask = sg.op_mask = 0;
    sg.completed = sg.computed = 0;
  }
  for (uint32_t i = 0; i < L.num_threads; ++i) {
    ThreadCtx& t = threads[i];
    t.state = ThreadState::ready;
    t.wait_name = nullptr;
    t.lvalue_next = 0;
    // Stack tops are page-aligned; staggering them keeps the fibers' hot frames out of the
    // same cache sets.
    const size_t stagger = (i * 37 % 64) * 64;
    fiber_stacks[i] = StackBounds{stacks[i]->base(), stacks[i]->size() - stagger};
    t.fiber_sp = fiber_prepare(stacks[i]->base(), stacks[i]->size() - stagger, &fiber_entry, &t);
  }

  // Fibers pass control among themselves; control comes back here only when no thread is ready.
  while (done_count < L.num_threads) {
    ThreadCtx* next = next_ready(0);
    if (next) {
      tls_thread = next;
      fiber_switch(&scheduler_sp, next->fiber_sp, fiber_stacks[next->index]);
      tls_thread = nullptr;
    }
    if (fault) {
      fault_tg = linear;
      return;
    }
    if (!next) {
      try {
        deadlock();
      } catch (...) {
        fault = std::current_exception();
        fault_tg = linear;
        return;
      }
    }
  }
}

void Worker::complete_simd_op(SimdGroup& sg, uint32_t simd_index, const ThreadCtx* self) {
  sg.op_mask = sg.arrived_mask;
  sg.arrived_mask = 0;
  ++sg.completed;
  for (uint32_t l = 0; l < kSimdWidth; ++l) {
    if (!(sg.op_mask >> l & 1u)) continue;
    ThreadCtx& t = threads[simd_index * kSimdWidth + l];
    if (&t != self) t.state = ThreadState::ready;
  }
}

void Worker::finish_thread(ThreadCtx* t) {
  t->state = ThreadState::done;
  ++done_count;
  SimdGroup& sg = simd[t->simd];
  sg.live_mask &= ~(1u << t->lane);
  // The lanes still waiting at a simd op were only waiting for the lanes that are live.
  if (sg.arrived_mask != 0 && sg.arrived_mask == sg.live_mask) complete_simd_op(sg, t->simd, t);
  if (barrier_count > 0)
    fault_here("returned while " + std::to_string(barrier_count) + " thread(s) wait at threadgroup_barrier (" +
               site_str(barrier_site) + "); on the GPU they would never be released");
}

void Worker::deadlock() {
  std::ostringstream o;
  o << kernel_prefix(this) << ": deadlock in threadgroup (" << tg_pos[0] << "," << tg_pos[1] << "," << tg_pos[2]
    << "): no thread can proceed (divergent simd-group op or barrier). Threads: ";
  const uint32_t n = launch->num_threads;
  uint32_t i = 0;
  bool first = true;
  auto describe = [&](const ThreadCtx& t) {
    switch (t.state) {
      case ThreadState::done: return std::string("returned");
      case ThreadState::waiting_barrier: return "wait at threadgroup_barrier " + site_str(t.wait_site);
      case ThreadState::waiting_simd: return "wait at " + std::string(t.wait_name) + " " + site_str(t.wait_site);
      default: return std::string("ready");
    }
  };
  while (i < n) {
    const std::string d = describe(threads[i]);
    uint32_t e = i;
    while (e + 1 < n && describe(threads[e + 1]) == d) ++e;
    o << (first ? "" : "; ") << i;
    if (e > i) o << "-" << e;
    o << " " << d;
    first = false;
    i = e + 1;
  }
  throw std::runtime_error(o.str());
}

// ---------------------------------------------------------------------------------------------
// Hooks called from translated kernels (declared in exec.h / kernel_registry.h)
// ---------------------------------------------------------------------------------------------
ThreadCtx* current_thread() { return tls_thread; }

LaneScope::LaneScope(uint32_t lane) : saved_(tls_thread) {
  tls_thread = &saved_->worker->threads[saved_->simd * kSimdWidth + lane];
}
LaneScope::~LaneScope() { tls_thread = saved_; }

SimdGroup& simd_arrive(const char* op_name, const Site& site, const void* value, uint32_t size, uint32_t arg) {
  ThreadCtx* t = tls_thread;
  Worker* w = t->worker;
  SimdGroup& sg = w->simd[t->simd];
  const uint32_t bit = 1u << t->lane;
  if (sg.barrier_mask != 0)
    fault_here(std::string("divergent simdgroup: this lane reached ") + op_name + " (" + site_str(site) +
               ") while lanes " + lanes_str(sg.barrier_mask) + " wait at threadgroup_barrier (" +
               site_str(w->barrier_site) + ")");
  if (sg.arrived_mask == 0) {
    sg.op_name = op_name;
    sg.site = site;
    sg.value_size = size;
  } else if ((sg.op_name != op_name && std::strcmp(sg.op_name, op_name) != 0) || !same_site(sg.site, site) ||
             sg.value_size != size) {
    fault_here(std::string("divergent simd-group ops: this lane reached ") + op_name + " (" + site_str(site) +
               ") while lanes " + lanes_str(sg.arrived_mask) + " wait at " + sg.op_name + " (" + site_str(sg.site) +
               ")");
  }
  if (size) std::memcpy(sg.values[t->lane], value, size);
  sg.args[t->lane] = arg;
  sg.arrived_mask |= bit;
  if (sg.arrived_mask == sg.live_mask) {
    w->complete_simd_op(sg, t->simd, t);
  } else {
    t->state = ThreadState::waiting_simd;
    t->wait_name = op_name;
    t->wait_site = site;
    yield(t);
  }
  return sg;
}

void threadgroup_barrier_wait(const Site& site) {
  ThreadCtx* t = tls_thread;
  Worker* w = t->worker;
  SimdGroup& sg = w->simd[t->simd];
  if (w->done_count > 0)
    fault_here("threadgroup_barrier (" + site_str(site) + ") reached after " + std::to_string(w->done_count) +
               " thread(s) of the threadgroup returned; on the GPU this barrier would never complete");
  if (sg.arrived_mask != 0)
    fault_here("divergent simdgroup: this lane reached threadgroup_barrier (" + site_str(site) + ") while lanes " +
               lanes_str(sg.arrived_mask) + " wait at " + sg.op_name + " (" + site_str(sg.site) + ")");
  if (w->barrier_count == 0) {
    w->barrier_site = site;
  } else if (!same_site(w->barrier_site, site)) {
    fault_here("divergent barriers: this thread reached threadgroup_barrier at " + site_str(site) + " while " +
               std::to_string(w->barrier_count) + " thread(s) wait at the one at " + site_str(w->barrier_site));
  }
  ++w->barrier_count;
  if (w->barrier_count == w->launch->num_threads) {
    w->barrier_count = 0;
    if (++w->epoch == 0) {
      std::fill(w->shadow.begin(), w->shadow.end(), TgShadow{});
      w->epoch = 1;
    }
    for (uint32_t s = 0; s < w->launch->num_simd; ++s) w->simd[s].barrier_mask = 0;
    for (uint32_t i = 0; i < w->launch->num_threads; ++i)
      if (w->threads[i].state == ThreadState::waiting_barrier) w->threads[i].state = ThreadState::ready;
    return;
  }
  sg.barrier_mask |= 1u << t->lane;
  t->state = ThreadState::waiting_barrier;
  t->wait_name = "threadgroup_barrier";
  t->wait_site = site;
  yield(t);
}

namespace {
std::string region_name_of(const Worker* w, uintptr_t addr) {
  for (const TgRegion& r : w->regions)
    if (addr >= r.begin && addr < r.end) return std::string("'") + r.name + "' byte " + std::to_string(addr - r.begin);
  return "threadgroup memory";
}
std::string thread_str(uint32_t index) {
  return "thread " + std::to_string(index) + " (simdgroup " + std::to_string(index / kSimdWidth) + ")";
}
}  // namespace

// Two accesses by different threads to the same bytes, at least one a store, are ordered only
// by a threadgroup_barrier between them, or, within one simdgroup, by a simd-group function or
// simdgroup_barrier between them. Anything else is a data race on the GPU.
void threadgroup_track(uintptr_t addr, size_t size, bool write) {
  ThreadCtx* t = tls_thread;
  Worker* w = t->worker;
  const uint32_t ops = uint32_t(w->simd[t->simd].completed);
  const size_t first = (addr - reinterpret_cast<uintptr_t>(w->arena)) / 2;
  const size_t last = (addr + size - 1 - reinterpret_cast<uintptr_t>(w->arena)) / 2;
  for (size_t g = first; g <= last; ++g) {
    TgShadow& s = w->shadow[g];
    if (s.write_epoch == w->epoch && s.write_thread != t->index &&
        !(s.write_thread / kSimdWidth == t->simd && s.write_ops != ops)) {
      fault_here(std::string("threadgroup memory race on ") + region_name_of(w, addr) + ": this thread " +
                 (write ? "stores to" : "loads from") + " bytes that " + thread_str(s.write_thread) +
                 " stored to since the last threadgroup_barrier, with nothing ordering the two");
    }
    if (write) {
      if (s.read_epoch == w->epoch) {
        const bool only_self = s.read_thread == t->index;
        const bool same_simd_ordered = s.read_simd == t->simd && s.read_ops != ops;
        if (!only_self && !same_simd_ordered) {
          const std::string readers = s.read_simd == TgShadow::kSeveralSimd
                                          ? std::string("threads of several simdgroups")
                                      : s.read_thread == TgShadow::kSeveral
                                          ? "threads of simdgroup " + std::to_string(s.read_simd)
                                          : thread_str(s.read_thread);
          fault_here("threadgroup memory race on " + region_name_of(w, addr) +
                     ": this thread stores to bytes that " + readers +
                     " loaded since the last threadgroup_barrier, with nothing ordering the two");
        }
      }
      s.write_epoch = w->epoch;
      s.write_ops = ops;
      s.write_thread = uint16_t(t->index);
    } else if (s.read_epoch != w->epoch) {
      s.read_epoch = w->epoch;
      s.read_ops = ops;
      s.read_thread = uint16_t(t->index);
      s.read_simd = uint8_t(t->simd);
    } else {
      if (s.read_thread != t->index) s.read_thread = TgShadow::kSeveral;
      if (s.read_simd != t->simd) s.read_simd = TgShadow::kSeveralSimd;
      s.read_ops = ops;
    }
  }
}

unsigned char* threadgroup_declare(const TgSite* site, size_t bytes, size_t align) {
  Worker* w = tls_thread->worker;
  for (const auto& [s, r] : w->declared)
    if (s == site) return reinterpret_cast<unsigned char*>(r.begin);
  align = std::max<size_t>(align, 16);
  const size_t offset = (w->arena_used + align - 1) / align * align;
  if (offset + bytes > kMaxThreadgroupMemory) {
    fault_here("threadgroup memory exceeds " + std::to_string(kMaxThreadgroupMemory) + " bytes: declaring '" +
               site->name + "' (" + std::to_string(bytes) + " bytes) on top of " + std::to_string(w->arena_used) +
               " bytes already in use (" + std::to_string(w->launch->dynamic_tg_bytes) +
               " of them [[threadgroup(i)]] arguments)");
  }
  unsigned char* p = w->arena + offset;
  std::memset(p, 0xFF, bytes);
  w->arena_used = offset + bytes;
  const TgRegion region{reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + bytes, site->name};
  w->declared.emplace_back(site, region);
  w->regions.push_back(region);
  return p;
}

TgRegion threadgroup_region_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const TgRegion& r : tls_thread->worker->regions)
    if (a >= r.begin && a < r.end) return r;
  std::ostringstream o;
  o << "a pointer converted to the threadgroup address space does not point into threadgroup memory (" << p << ")";
  fault_here(o.str());
}

void device_fault(const BufferState* buf, uintptr_t addr, size_t size, const char* access) {
  std::ostringstream o;
  const auto element = (intptr_t(addr) - intptr_t(buf->kernel_base)) / intptr_t(size);
  // Called for an access outside the allocation, or inside it but misaligned.
  const bool misaligned = addr >= buf->alloc_begin && addr <= buf->alloc_end && buf->alloc_end - addr >= size;
  const std::string what = std::strcmp(access, "write to read-only binding") == 0 ? "write to a read-only binding"
                            : misaligned ? std::string("misaligned device ") + access
                                         : std::string("out-of-bounds device ") + access;
  o << what << " of buffer(" << buf->index << ") '" << buf->name << "'";
  if (std::strcmp(buf->name, buf->param) != 0) o << " (kernel parameter '" << buf->param << "')";
  o << ": element " << element << " of " << size
    << " bytes (byte " << (intptr_t(addr) - intptr_t(buf->alloc_begin)) << " of a "
    << (buf->alloc_end - buf->alloc_begin) << "-byte allocation; the binding starts at byte "
    << (buf->kernel_base - buf->alloc_begin) << ")";
  fault_here(o.str());
}

void threadgroup_fault(const TgRegion& region, uintptr_t addr, size_t size, const char* what) {
  std::ostringstream o;
  o << "out-of-bounds threadgroup memory " << what << " in '" << region.name << "': byte "
    << (intptr_t(addr) - intptr_t(region.begin)) << " (" << size << "-byte element, index "
    << (intptr_t(addr) - intptr_t(region.begin)) / intptr_t(size) << ") of a " << (region.end - region.begin)
    << "-byte region";
  fault_here(o.str());
}

void simd_fault(const char* message) { fault_here(message); }

void function_constant_undefined(const char* name, uint32_t index) {
  fault_here(std::string("function constant '") + name + "' [[function_constant(" + std::to_string(index) +
             ")]] is used but the launch gives it no value (set it, or test is_function_constant_defined(" + name +
             ") before using it)");
}

void device_store_track(uintptr_t addr, size_t size) {
  ThreadCtx* t = tls_thread;
  Worker* w = t->worker;
  w->stores.push_back(Worker::Store{addr, addr + size, w->tg_linear, t->index, w->epoch});
}

void device_load_track(uintptr_t addr, size_t size) {
  ThreadCtx* t = tls_thread;
  Worker* w = t->worker;
  w->loads.push_back(Worker::Store{addr, addr + size, w->tg_linear, t->index, w->epoch});
}

BufferState* bound_buffer(ThreadCtx& t, int index) { return &t.worker->buffers[index]; }

TgRegion bound_threadgroup_memory(ThreadCtx& t, int index) {
  const LaunchShared& L = *t.worker->launch;
  const uintptr_t b = reinterpret_cast<uintptr_t>(t.worker->arena + L.tg_offsets[index]);
  return TgRegion{b, b + L.tg_sizes[index], "[[threadgroup]] argument"};
}

void attribute_value(const ThreadCtx& t, Attr attr, uint32_t out[3]) {
  const Worker& w = *t.worker;
  const LaunchShared& L = *w.launch;
  auto set = [&](uint32_t a, uint32_t b, uint32_t c) {
    out[0] = a;
    out[1] = b;
    out[2] = c;
  };
  switch (attr) {
    case Attr::threadgroup_position_in_grid: set(w.tg_pos[0], w.tg_pos[1], w.tg_pos[2]); break;
    case Attr::thread_position_in_threadgroup: set(t.pos[0], t.pos[1], t.pos[2]); break;
    case Attr::thread_index_in_threadgroup: set(t.index, 0, 0); break;
    case Attr::threads_per_threadgroup: set(L.threads[0], L.threads[1], L.threads[2]); break;
    case Attr::threadgroups_per_grid: set(L.grid[0], L.grid[1], L.grid[2]); break;
    case Attr::thread_position_in_grid:
      set(w.tg_pos[0] * L.threads[0] + t.pos[0], w.tg_pos[1] * L.threads[1] + t.pos[1],
          w.tg_pos[2] * L.threads[2] + t.pos[2]);
      break;
    case Attr::threads_per_grid:
      set(L.grid[0] * L.threads[0], L.grid[1] * L.threads[1], L.grid[2] * L.threads[2]);
      break;
    case Attr::simdgroup_index_in_threadgroup: set(t.simd, 0, 0); break;
    case Attr::thread_index_in_simdgroup: set(t.lane, 0, 0); break;
    case Attr::threads_per_simdgroup: set(kSimdWidth, 0, 0); break;
    case Attr::simdgroups_per_threadgroup: set(L.num_simd, 0, 0); break;
  }
}

KernelRegistrar::KernelRegistrar(const KernelEntry& entry) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto [it, inserted] = r.kernels.emplace(entry.name, entry);
  if (!inserted) {
    r.duplicates[entry.name] = std::string("metal simulator: kernel name '") + entry.name + "' is defined twice (" +
                               it->second.source + " and " + entry.source + ")";
  }
}

// ---------------------------------------------------------------------------------------------
// Worker pool: workers (with their fiber stacks) outlive launches.
// ---------------------------------------------------------------------------------------------
namespace {
std::mutex g_pool_mutex;
std::vector<std::unique_ptr<Worker>> g_pool;

std::unique_ptr<Worker> acquire_worker() {
  {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (!g_pool.empty()) {
      auto w = std::move(g_pool.back());
      g_pool.pop_back();
      return w;
    }
  }
  return std::make_unique<Worker>();
}
void release_worker(std::unique_ptr<Worker> w) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool.push_back(std::move(w));
}

std::string group_str(const LaunchShared& L, uint64_t linear) {
  return "threadgroup (" + std::to_string(linear % L.grid[0]) + "," + std::to_string((linear / L.grid[0]) % L.grid[1]) +
         "," + std::to_string(linear / (uint64_t(L.grid[0]) * L.grid[1])) + ")";
}

// Two stores to overlapping bytes by different threads are a race unless both threads are in
// the same threadgroup with a threadgroup_barrier between the stores (the result would depend
// on scheduling on the GPU, and the kernels must be deterministic). A thread may overwrite its
// own stores.
[[noreturn]] void device_race(const LaunchShared& L, const Worker::Store& first, const char* first_access,
                              const Worker::Store& second, const char* second_access) {
  std::ostringstream o;
  o << "metal simulator: kernel '" << L.kernel->name << "': device memory race: ";
  for (const BufferState& b : L.buffers)
    if (b.bound && b.counted && second.begin >= b.alloc_begin && second.begin < b.alloc_end) {
      o << "buffer(" << b.index << ") '" << b.name << "' byte " << (second.begin - b.alloc_begin) << " ";
      break;
    }
  o << "is " << first_access << " by " << group_str(L, first.group) << " thread index " << first.thread << " and "
    << second_access << " by " << group_str(L, second.group) << " thread index " << second.thread
    << ", with nothing ordering the two";
  throw std::runtime_error(o.str());
}

bool unordered(const Worker::Store& a, const Worker::Store& b) {
  const bool same_thread = a.group == b.group && a.thread == b.thread;
  const bool ordered = a.group == b.group && a.epoch != b.epoch;
  return !same_thread && !ordered;
}

void check_device_store_races(const LaunchShared& L, std::vector<std::unique_ptr<Worker>>& workers) {
  std::vector<Worker::Store> all;
  for (auto& w : workers) all.insert(all.end(), w->stores.begin(), w->stores.end());
  std::sort(all.begin(), all.end(), [](const Worker::Store& a, const Worker::Store& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.group != b.group ? a.group < b.group : a.thread < b.thread;
  });
  // Sweep keeping the store that reaches furthest so far: any later store starting before its
  // end overlaps it.
  size_t reach = 0;
  for (size_t i = 1; i < all.size(); ++i) {
    const Worker::Store& prev = all[reach];
    const Worker::Store& cur = all[i];
    if (cur.begin < prev.end && unordered(prev, cur)) device_race(L, prev, "stored to", cur, "stored to");
    if (cur.end > all[reach].end || cur.begin >= all[reach].end) reach = i;
  }
  // Loads of bytes that another thread stored to, unordered (in either order in time).
  constexpr uintptr_t kMaxAccess = kSimdSlotBytes;  // no single access is wider
  for (auto& w : workers) {
    for (const Worker::Store& load : w->loads) {
      auto it = std::lower_bound(all.begin(), all.end(), load.end,
                                 [](const Worker::Store& s, uintptr_t end) { return s.begin < end; });
      while (it != all.begin()) {
        --it;
        if (it->begin + kMaxAccess <= load.begin) break;
        if (it->end > load.begin && unordered(*it, load)) device_race(L, *it, "stored to", load, "loaded");
      }
    }
  }
}

std::string param_desc(const ParamInfo& p) { return std::string("'") + p.name + "' (" + p.type + ")"; }

[[noreturn]] void launch_error(const KernelEntry& k, const std::string& what) {
  throw std::runtime_error(std::string("metal simulator: kernel '") + k.name + "': " + what);
}

std::string declared_constants(const KernelEntry& k) {
  if (k.num_constants == 0) return "none";
  std::string s;
  for (size_t i = 0; i < k.num_constants; ++i)
    s += (i ? ", " : "") + std::string(k.constants[i].name) + " (" + std::to_string(k.constants[i].index) + ", " +
         function_constant_type_name(k.constants[i].type) + ")";
  return s;
}

// Every given value must be for a [[function_constant]] of the kernel's file, of its type.
void bind_function_constants(const LaunchDesc& desc, const KernelEntry& k, LaunchShared& L) {
  L.constants.assign(std::max<size_t>(k.num_constants, 1), ConstantSlot{});
  for (size_t a = 0; a < desc.constants.size(); ++a) {
    const FunctionConstant& c = desc.constants[a];
    const std::string what = "function constant index " + std::to_string(c.index);
    for (size_t b = 0; b < a; ++b)
      if (desc.constants[b].index == c.index) launch_error(k, what + " is given twice");
    size_t slot = k.num_constants;
    for (size_t j = 0; j < k.num_constants; ++j)
      if (k.constants[j].index == c.index) slot = j;
    if (slot == k.num_constants)
      launch_error(k, what + " (" + function_constant_type_name(c.type) + ") is given, but " + k.source +
                          " declares no [[function_constant(" + std::to_string(c.index) + ")]]; it declares: " +
                          declared_constants(k));
    const FunctionConstantInfo& info = k.constants[slot];
    if (info.type != c.type)
      launch_error(k, what + " is given as " + function_constant_type_name(c.type) + ", but '" + info.name +
                          "' is declared " + function_constant_type_name(info.type));
    if (c.type == FunctionConstantType::Bool && c.bytes[0] > 1)
      launch_error(k, what + " ('" + info.name + "'): a bool's byte must be 0 or 1, got " + std::to_string(c.bytes[0]));
    L.constants[slot].defined = true;
    std::memcpy(L.constants[slot].bytes, c.bytes, sizeof(c.bytes));
  }
}

void validate_and_bind(const LaunchDesc& desc, const KernelEntry& k, LaunchShared& L) {
  uint64_t n = 1;
  for (int d = 0; d < 3; ++d) {
    L.grid[d] = desc.grid[d];
    L.threads[d] = desc.threads[d];
    n *= desc.threads[d];
  }
  if (n == 0 || n > kMaxThreadsPerThreadgroup || n % kSimdWidth != 0) {
    std::ostringstream o;
    o << "threads per threadgroup (" << desc.threads[0] << "," << desc.threads[1] << "," << desc.threads[2]
      << ") = " << n << ": must be a positive multiple of " << kSimdWidth << " and at most "
      << kMaxThreadsPerThreadgroup;
    launch_error(k, o.str());
  }
  if (k.max_total_threads && n > k.max_total_threads)
    launch_error(k, std::to_string(n) + " threads per threadgroup exceed the kernel's "
                    "[[max_total_threads_per_threadgroup(" + std::to_string(k.max_total_threads) + ")]]");
  L.num_threads = uint32_t(n);
  L.num_simd = uint32_t(n / kSimdWidth);

  // Threadgroup memory.
  size_t total = 0;
  for (int i = 0; i <= kMaxThreadgroupIndex; ++i) L.tg_bound[i] = false;
  for (const auto& [index, bytes] : desc.threadgroup_memory) {
    if (index < 0 || index > kMaxThreadgroupIndex)
      launch_error(k, "threadgroup memory index " + std::to_string(index) + " is out of range");
    if (bytes % 16 != 0)
      launch_error(k, "threadgroup memory length " + std::to_string(bytes) + " at [[threadgroup(" +
                          std::to_string(index) + ")]] is not a multiple of 16");
    L.tg_bound[index] = true;
    L.tg_offsets[index] = total;
    L.tg_sizes[index] = bytes;
    total += bytes;
  }
  if (total > kMaxThreadgroupMemory)
    launch_error(k, "threadgroup memory " + std::to_string(total) + " bytes exceeds the " +
                        std::to_string(kMaxThreadgroupMemory) + "-byte limit");
  L.dynamic_tg_bytes = total;

  bind_function_constants(desc, k, L);

  // Buffers.
  for (int i = 0; i <= kMaxBufferIndex; ++i) L.buffers[i] = BufferState{};
  for (const auto& [index, b] : desc.buffers) {
    if (index < 0 || index > kMaxBufferIndex)
      launch_error(k, "buffer index " + std::to_string(index) + " is out of range");
    BufferState& s = L.buffers[index];
    s.bound = true;
    s.index = index;
    s.name = b.name.c_str();
    if (!b.bytes.empty()) {
      // setBytes data: copied to aligned storage, read-only, not device memory.
      auto storage = std::make_unique<std::max_align_t[]>((b.bytes.size() + sizeof(std::max_align_t) - 1) /
                                                          sizeof(std::max_align_t));
      std::memcpy(storage.get(), b.bytes.data(), b.bytes.size());
      s.alloc_begin = s.kernel_base = reinterpret_cast<uintptr_t>(storage.get());
      s.alloc_end = s.alloc_begin + b.bytes.size();
      s.writable = false;
      s.counted = false;
      L.inline_data.push_back(std::move(storage));
    } else {
      if (b.base == nullptr && b.length != 0)
        launch_error(k, "buffer(" + std::to_string(index) + ") '" + b.name + "' has a null base and length " +
                            std::to_string(b.length));
      if (b.offset > b.length)
        launch_error(k, "buffer(" + std::to_string(index) + ") '" + b.name + "': offset " +
                            std::to_string(b.offset) + " is past the allocation's " + std::to_string(b.length) +
                            " bytes");
      s.alloc_begin = reinterpret_cast<uintptr_t>(b.base);
      s.alloc_end = s.alloc_begin + b.length;
      s.kernel_base = s.alloc_begin + b.offset;
      s.writable = b.writable;
      s.counted = true;
    }
  }
  // Loads from an allocation that a writable pointer of this launch also points into are
  // recorded, to check them against the stores (other allocations cannot race).
  for (size_t p = 0; p < k.num_params; ++p) {
    const ParamInfo& store_target = k.params[p];
    if (store_target.kind != ParamKind::device_pointer || store_target.read_only) continue;
    const BufferState& target = L.buffers[store_target.index];
    if (!target.bound || !target.counted) continue;
    for (BufferState& b : L.buffers)
      if (b.bound && b.counted && b.alloc_begin < target.alloc_end && target.alloc_begin < b.alloc_end)
        b.track_loads = true;
  }
  for (size_t p = 0; p < k.num_params; ++p) {
    const ParamInfo& info = k.params[p];
    if (info.kind == ParamKind::attribute) continue;
    if (info.kind == ParamKind::threadgroup_pointer) {
      if (!L.tg_bound[info.index])
        launch_error(k, "parameter " + param_desc(info) + " is [[threadgroup(" + std::to_string(info.index) +
                            ")]] but the launch sets no threadgroup memory length there");
      continue;
    }
    BufferState& s = L.buffers[info.index];
    if (!s.bound)
      launch_error(k, "missing binding: parameter " + param_desc(info) + " is [[buffer(" +
                          std::to_string(info.index) + ")]] but the launch binds nothing there");
    s.param = info.name;
    if (*s.name == 0) s.name = info.name;
    if (info.kind == ParamKind::buffer_reference && s.alloc_end - s.kernel_base < info.value_size)
      launch_error(k, "buffer(" + std::to_string(info.index) + ") for " + param_desc(info) + " holds " +
                          std::to_string(s.alloc_end - s.kernel_base) + " bytes past its offset, the parameter needs " +
                          std::to_string(info.value_size));
  }
}
}  // namespace
}  // namespace detail

bool has_kernel(const std::string& name) {
  auto& r = detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.kernels.count(name) > 0;
}

std::vector<std::string> kernel_names() {
  auto& r = detail::registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& [k, _] : r.kernels) names.push_back(k);
  return names;
}

LaunchStats launch(const LaunchDesc& desc) {
  using namespace detail;
  const KernelEntry& kernel = find_kernel(desc.kernel);
  auto shared = std::make_unique<LaunchShared>();
  shared->kernel = &kernel;
  validate_and_bind(desc, kernel, *shared);
  // Buffer names must outlive the launch's BufferStates: they point into desc.

  const uint64_t groups = uint64_t(desc.grid[0]) * desc.grid[1] * desc.grid[2];
  LaunchStats stats;
  if (groups == 0) return stats;

  // Each worker maps a guarded stack per thread (two memory mappings each), so the default stays
  // well below the kernel's per-process mapping limit even on many-core machines.
  const size_t hw = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
  const size_t num_workers = size_t(std::min<uint64_t>(groups, env_size("TREE_ATTN_SIM_THREADS", hw)));
  std::vector<std::unique_ptr<Worker>> workers;
  for (size_t i = 0; i < num_workers; ++i) workers.push_back(acquire_worker());

  auto run = [&](size_t w) {
    Worker& worker = *workers[w];
    try {
      worker.prepare(*shared);
    } catch (...) {
      worker.fault = std::current_exception();
      worker.fault_tg = 0;
      shared->stop = true;
      return;
    }
    // Threadgroups are dealt round-robin: the split, and so every result, is deterministic.
    for (uint64_t g = w; g < groups && !shared->stop.load(std::memory_order_relaxed); g += num_workers) {
      worker.run_threadgroup(g);
      if (worker.fault) {
        shared->stop = true;
        return;
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t w = 1; w < num_workers; ++w) threads.emplace_back(run, w);
  run(0);
  for (auto& t : threads) t.join();

  std::exception_ptr fault;
  uint64_t fault_tg = UINT64_MAX;
  for (auto& w : workers) {
    if (w->fault && w->fault_tg < fault_tg) {
      fault = w->fault;
      fault_tg = w->fault_tg;
    }
    for (int i = 0; i <= kMaxBufferIndex; ++i) {
      const BufferState& b = w->buffers[i];
      if (!b.counted) continue;
      stats.device_bytes_read += b.bytes_read;
      stats.device_bytes_written += b.bytes_written;
    }
    stats.threadgroup_bytes_read += w->counters.threadgroup_bytes_read;
    stats.threadgroup_bytes_written += w->counters.threadgroup_bytes_written;
    stats.simdgroup_mmas += w->counters.simdgroup_mmas;
    stats.scalar_fmas += w->counters.scalar_fmas;
    stats.shuffles += w->counters.shuffles;
    w->fault = nullptr;
    w->launch = nullptr;
  }
  if (!fault) {
    try {
      check_device_store_races(*shared, workers);
    } catch (...) {
      fault = std::current_exception();
    }
  }
  for (auto& w : workers) {
    w->stores.clear();
    w->loads.clear();
    release_worker(std::move(w));
  }
  if (fault) std::rethrow_exception(fault);
  return stats;
}

}  // namespace tree_attn::sim
