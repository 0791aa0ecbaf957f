// Execution state shared by the MSL prelude (msl.h, included by translated kernels) and the
// simulator runtime (runtime.cpp). Nothing here is part of the public runtime API (runtime.h).
//
// One Worker runs threadgroups one after another on one OS thread. Each thread of the current
// threadgroup is a ThreadCtx with its own fiber; the worker's scheduler resumes fibers until
// every thread has returned. A fiber gives control back only at a synchronisation point (a
// simd_* op, simdgroup_barrier, threadgroup_barrier) or when its thread returns, so everything
// between two synchronisation points runs without interleaving, exactly like the hardware's
// lock-step execution as far as a data-race-free kernel can tell.
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>

namespace tree_attn::sim::detail {

struct Worker;
struct KernelEntry;

using Site = std::source_location;

// One [[buffer(i)]] as one worker sees it: its own byte counters, so workers never share a
// cache line on the hot path.
struct BufferState {
  uintptr_t alloc_begin = 0;  // the whole allocation: accesses outside it are faults
  uintptr_t alloc_end = 0;
  uintptr_t kernel_base = 0;  // alloc_begin + binding offset: where the kernel's pointer starts
  bool bound = false;
  bool writable = false;
  bool counted = false;  // false for setBytes-style inline data (not device memory)
  bool track_loads = false;  // its allocation is also bound to a writable pointer: check loads
  int index = -1;
  const char* name = "";        // the binding's name (Binding::name)
  const char* param = "";       // the kernel parameter bound there
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

enum class SyncKind : uint8_t {
  none,
  simd_reduce,       // simd_sum, simd_max, ...: every lane gets the same result
  simd_scan,         // simd_prefix_*
  simd_shuffle,      // simd_shuffle*, simd_broadcast*: a lane reads another lane's value
  simd_vote,         // simd_any, simd_all, simd_ballot
  simdgroup_barrier,
  threadgroup_barrier,
};

enum class ThreadState : uint8_t { ready, waiting_simd, waiting_barrier, done };

// A value slot large enough for any scalar or vector argument of a simd_* op.
inline constexpr size_t kSimdSlotBytes = 32;

struct SimdGroup {
  uint32_t live_mask = 0;      // lanes that have not returned
  uint32_t arrived_mask = 0;   // lanes waiting at the op now being gathered
  uint32_t barrier_mask = 0;   // lanes waiting at a threadgroup_barrier
  uint32_t op_mask = 0;        // lanes that took part in the last completed op
  uint64_t completed = 0;      // number of completed ops
  uint64_t computed = 0;       // number of completed ops whose results are computed
  // What the op being gathered is; every arriving lane must match it.
  const char* op_name = nullptr;
  Site site;
  uint32_t value_size = 0;
  alignas(16) unsigned char values[32][kSimdSlotBytes];
  alignas(16) unsigned char results[32][kSimdSlotBytes];
  uint32_t args[32];
};

// Hands out device lvalue proxies for `p[i]` on writable device pointers (see msl.h). A small
// per-thread ring, because an expression can hold several at once (a[i] = b[j] + c[k]) and a
// simd op inside an expression can switch fibers while a proxy is alive.
inline constexpr int kLvalueRing = 16;
struct LvalueSlot {
  BufferState* buf;
  uintptr_t addr;
};

// Race-detection state of one 2-byte granule of threadgroup memory (see threadgroup_track).
struct TgShadow {
  static constexpr uint16_t kSeveral = 0xffff;  // read_thread: several readers
  static constexpr uint8_t kSeveralSimd = 0xff;  // read_simd: readers in several simdgroups
  uint32_t write_epoch = 0, write_ops = 0;  // last store: epoch, its simdgroup's op count
  uint32_t read_epoch = 0, read_ops = 0;    // loads in read_epoch: latest op count
  uint16_t write_thread = 0, read_thread = 0;
  uint8_t read_simd = 0;
};

// Per-launch operation counters beside the device bytes (BufferState), one set per worker,
// summed by launch(). What each counts is documented with runtime.h's LaunchStats.
struct OpCounters {
  uint64_t threadgroup_bytes_read = 0, threadgroup_bytes_written = 0;
  uint64_t simdgroup_mmas = 0, scalar_fmas = 0, shuffles = 0;
};

// The value of one of the kernel's function constants in the current launch (slot = its
// position in the translated file's table).
struct ConstantSlot {
  bool defined = false;
  alignas(8) unsigned char bytes[8] = {};
};

struct ThreadCtx {
  Worker* worker = nullptr;
  OpCounters* counters = nullptr;  // the worker's
  const ConstantSlot* constants = nullptr;  // the launch's, by slot
  // Threadgroup-memory race detection, for the inline fast path of loads (msl.h).
  TgShadow* tg_shadow = nullptr;
  uintptr_t tg_arena = 0;
  const uint32_t* tg_epoch = nullptr;
  void* fiber_sp = nullptr;  // saved stack pointer while suspended
  uint32_t index = 0;        // thread_index_in_threadgroup
  uint32_t lane = 0;
  uint32_t simd = 0;
  uint32_t pos[3] = {0, 0, 0};  // thread_position_in_threadgroup
  ThreadState state = ThreadState::ready;
  const char* wait_name = nullptr;
  Site wait_site;
  unsigned lvalue_next = 0;
  alignas(16) unsigned char lvalue_ring[kLvalueRing][32];
};

// The calling fiber's thread (set by the scheduler before every switch into a fiber).
ThreadCtx* current_thread();

// --- Hooks implemented by runtime.cpp, called from translated kernels (msl.h) ---
// Arrive at a simd-group op; returns when every live lane of the simdgroup has arrived at the
// same op (the caller then computes or reads the results). Faults on divergence.
SimdGroup& simd_arrive(const char* op_name, const Site& site, const void* value, uint32_t size,
                       uint32_t arg);
void threadgroup_barrier_wait(const Site& site);

// Collective simd-group operations that move data on behalf of every lane (simdgroup_load,
// simdgroup_store) make each lane's memory accesses *as that lane*, so bounds faults, race
// records and byte counts name the lane that owns the element. While a LaneScope is alive,
// current_thread() is lane `lane` of the calling thread's simdgroup. Only valid inside the
// compute step of a completed simd-group op (every other lane of the simdgroup is suspended
// at the op), which never switches fibers.
class LaneScope {
 public:
  explicit LaneScope(uint32_t lane);
  ~LaneScope();
  LaneScope(const LaneScope&) = delete;
  LaneScope& operator=(const LaneScope&) = delete;

 private:
  ThreadCtx* saved_;
};

// Threadgroup memory declared in a kernel body: one allocation per threadgroup per site.
struct TgSite {
  const char* name;
};
unsigned char* threadgroup_declare(const TgSite* site, size_t bytes, size_t align);
// Where a raw threadgroup address lives, for pointers formed with `&tile[i]`.
struct TgRegion {
  uintptr_t begin = 0, end = 0;
  const char* name = "";
};
TgRegion threadgroup_region_of(const void* p);

// Records a load (write = false) or store of threadgroup memory by the calling thread; faults
// on a data race with another thread since the last barrier.
void threadgroup_track(uintptr_t addr, size_t size, bool write);

// Records a store to device memory; after the launch, bytes stored by two threads that nothing
// orders (different threadgroups, or the same one without a barrier between) are a fault.
void device_store_track(uintptr_t addr, size_t size);
// Records a load from an allocation the launch may also store to (BufferState::track_loads);
// after the launch, a load of bytes another thread stored without ordering is a fault.
void device_load_track(uintptr_t addr, size_t size);

[[noreturn]] void device_fault(const BufferState* buf, uintptr_t addr, size_t size, const char* access);
[[noreturn]] void threadgroup_fault(const TgRegion& region, uintptr_t addr, size_t size, const char* what);
[[noreturn]] void simd_fault(const char* message);
// A function constant used without a value (the launch gave none for its index).
[[noreturn]] void function_constant_undefined(const char* name, uint32_t index);

}  // namespace tree_attn::sim::detail
