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

// The stack a context runs on. AddressSanitizer must be told of every switch between
// stacks, or it mistakes fiber frames for the thread's and reports (or aborts on) phantom
// errors when an exception unwinds; other builds ignore it.
struct StackBounds {
  const void* bottom = nullptr;
  size_t size = 0;
};

// The calling OS thread's own stack (the scheduler's), computed once per thread.
StackBounds thread_stack();

// Saves the current context into *save and resumes the context `next`, which runs on
// `next_stack`.
void fiber_switch(void** save, void* next, StackBounds next_stack);

// A new context's first call, before anything else: completes the switch that started it.
void fiber_started();

}  // namespace tree_attn::sim::detail
