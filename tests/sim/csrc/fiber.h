// Minimal cooperative fibers for the simulator: a context switch saves only what the calling
// convention says a callee must preserve (plus the floating-point control state), which is a
// few nanoseconds, against a system call per switch for swapcontext.
#pragma once

#include <cstddef>

namespace tree_attn::sim::detail {

using FiberFn = void (*)(void*);

// Prepares a suspended context on [stack, stack + size) that will run fn(arg) when first
// switched to. fn must never return (it switches away for the last time instead).
// Returns the context's saved stack pointer.
void* fiber_prepare(void* stack, size_t size, FiberFn fn, void* arg);

// Saves the current context into *save and resumes the context `next`.
void fiber_switch(void** save, void* next);

}  // namespace tree_attn::sim::detail
