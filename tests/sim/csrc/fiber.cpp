// Context switching for the simulator's fibers: hand-written for x86-64 (System V) and AArch64
// (AAPCS64), ucontext everywhere else.
#include "fiber.h"

#include <pthread.h>

#include <cstdint>
#include <cstring>

#if defined(__SANITIZE_ADDRESS__)
#define TREE_ATTN_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TREE_ATTN_SIM_ASAN 1
#endif
#endif
#if TREE_ATTN_SIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// Define TREE_ATTN_SIM_FIBER_UCONTEXT to use the portable fallback everywhere (for testing it).
#if defined(__x86_64__) && !defined(_WIN32) && !defined(TREE_ATTN_SIM_FIBER_UCONTEXT)
#define TREE_ATTN_SIM_FIBER_X86_64 1
#elif defined(__aarch64__) && !defined(_WIN32) && !defined(TREE_ATTN_SIM_FIBER_UCONTEXT)
#define TREE_ATTN_SIM_FIBER_AARCH64 1
#else
#include <ucontext.h>

#include <memory>
#endif

namespace tree_attn::sim::detail {

// Each architecture defines raw_prepare (the initial frame) and raw_switch (the switch).

#if TREE_ATTN_SIM_FIBER_X86_64

// A switch saves the callee-saved registers and the stack pointer. Saved frame, from the saved
// stack pointer up: r15, r14, r13, r12, rbx, rbp, return address.
//
// The floating-point control state (MXCSR, x87 control word) is not switched: kernels cannot
// change it (MSL has no floating-point environment), so every fiber keeps the state it starts
// with, which is the creating thread's. A new context "returns" into fiber_start with
// r12 = fn, r13 = arg, r14 = MXCSR and r15 = x87 control word to load. Loading them on every
// switch would cost more than the rest of the switch.
extern "C" void tree_attn_sim_fiber_switch(void** save, void* next);
extern "C" void tree_attn_sim_fiber_start();

asm(R"(
    .text
    .globl tree_attn_sim_fiber_switch
    .hidden tree_attn_sim_fiber_switch
    .type tree_attn_sim_fiber_switch, @function
    .p2align 4
tree_attn_sim_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tree_attn_sim_fiber_switch, .-tree_attn_sim_fiber_switch

    .globl tree_attn_sim_fiber_start
    .hidden tree_attn_sim_fiber_start
    .type tree_attn_sim_fiber_start, @function
    .p2align 4
tree_attn_sim_fiber_start:
    .cfi_startproc
    .cfi_undefined rip
    subq $16, %rsp
    movl %r14d, (%rsp)
    ldmxcsr (%rsp)
    movw %r15w, 4(%rsp)
    fldcw 4(%rsp)
    addq $16, %rsp
    movq %r13, %rdi
    callq *%r12
    ud2
    .cfi_endproc
    .size tree_attn_sim_fiber_start, .-tree_attn_sim_fiber_start
)");

void* raw_prepare(void* stack, size_t size, FiberFn fn, void* arg) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  // After the final `ret` the stack pointer is top - 16: 16-byte aligned before fiber_start's
  // call, as the ABI requires.
  auto* frame = reinterpret_cast<uint64_t*>(top - 16 - 7 * 8);
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  std::memset(frame, 0, 7 * 8);
  frame[0] = fpucw;                                // r15
  frame[1] = mxcsr;                                // r14
  frame[2] = reinterpret_cast<uint64_t>(arg);      // r13
  frame[3] = reinterpret_cast<uint64_t>(fn);       // r12
  frame[6] = reinterpret_cast<uint64_t>(&tree_attn_sim_fiber_start);
  return frame;
}

void raw_switch(void** save, void* next) { tree_attn_sim_fiber_switch(save, next); }

#elif TREE_ATTN_SIM_FIBER_AARCH64

// Saved frame (160 bytes, from the saved stack pointer up): x19..x28, x29, x30, d8..d15.
// As on x86-64, the floating-point control register (FPCR) is loaded once, when a fiber starts:
// a new context "returns" (x30) into fiber_start with x19 = fn, x20 = arg, x21 = FPCR.
extern "C" void tree_attn_sim_fiber_switch(void** save, void* next);
extern "C" void tree_attn_sim_fiber_start();

asm(R"(
    .text
    .globl tree_attn_sim_fiber_switch
    .hidden tree_attn_sim_fiber_switch
    .type tree_attn_sim_fiber_switch, %function
    .p2align 4
tree_attn_sim_fiber_switch:
    sub sp, sp, #160
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #160
    ret
    .size tree_attn_sim_fiber_switch, .-tree_attn_sim_fiber_switch

    .globl tree_attn_sim_fiber_start
    .hidden tree_attn_sim_fiber_start
    .type tree_attn_sim_fiber_start, %function
    .p2align 4
tree_attn_sim_fiber_start:
    .cfi_startproc
    .cfi_undefined x30
    msr fpcr, x21
    mov x0, x20
    blr x19
    brk #0
    .cfi_endproc
    .size tree_attn_sim_fiber_start, .-tree_attn_sim_fiber_start
)");

void* raw_prepare(void* stack, size_t size, FiberFn fn, void* arg) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  auto* frame = reinterpret_cast<uint64_t*>(top - 160);
  std::memset(frame, 0, 160);
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  frame[0] = reinterpret_cast<uint64_t>(fn);                           // x19
  frame[1] = reinterpret_cast<uint64_t>(arg);                          // x20
  frame[2] = fpcr;                                                     // x21
  frame[11] = reinterpret_cast<uint64_t>(&tree_attn_sim_fiber_start);  // x30
  return frame;
}

void raw_switch(void** save, void* next) { tree_attn_sim_fiber_switch(save, next); }

#else

// Portable fallback: the saved "stack pointer" is a ucontext_t living at the top of the stack.
namespace {
struct StartArgs {
  FiberFn fn;
  void* arg;
};
void ucontext_start(unsigned hi, unsigned lo) {
  auto* a = reinterpret_cast<StartArgs*>((uintptr_t(hi) << 32) | uintptr_t(lo));
  a->fn(a->arg);
}
thread_local ucontext_t* tls_scheduler_context = nullptr;
}  // namespace

void* raw_prepare(void* stack, size_t size, FiberFn fn, void* arg) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size - sizeof(ucontext_t) - sizeof(StartArgs)) & ~uintptr_t(63);
  auto* ctx = reinterpret_cast<ucontext_t*>(top);
  auto* start = reinterpret_cast<StartArgs*>(top + sizeof(ucontext_t));
  *start = StartArgs{fn, arg};
  getcontext(ctx);
  ctx->uc_stack.ss_sp = stack;
  ctx->uc_stack.ss_size = top - reinterpret_cast<uintptr_t>(stack);
  ctx->uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(start);
  makecontext(ctx, reinterpret_cast<void (*)()>(&ucontext_start), 2, unsigned(p >> 32), unsigned(p & 0xffffffffu));
  return ctx;
}

void raw_switch(void** save, void* next) {
  // The side that saves into a caller-provided slot needs somewhere to keep its ucontext: the
  // scheduler (whose slot is not inside a fiber stack) uses a thread-local one.
  if (*save == nullptr) {
    if (!tls_scheduler_context) tls_scheduler_context = new ucontext_t;
    *save = tls_scheduler_context;
  }
  swapcontext(static_cast<ucontext_t*>(*save), static_cast<ucontext_t*>(next));
}

#endif

// ---------------------------------------------------------------------------------------------
// What every build shares: the sanitizer bookkeeping around the architecture's raw switch.

StackBounds thread_stack() {
  thread_local const StackBounds bounds = [] {
    StackBounds b;
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* addr = nullptr;
      size_t size = 0;
      if (pthread_attr_getstack(&attr, &addr, &size) == 0) b = StackBounds{addr, size};
      pthread_attr_destroy(&attr);
    }
    return b;
  }();
  return bounds;
}

void* fiber_prepare(void* stack, size_t size, FiberFn fn, void* arg) {
#if TREE_ATTN_SIM_ASAN
  // A fiber ends by switching away for good, so its frames never return and leave their
  // redzones poisoned: a new fiber on the same stack must start from clean shadow memory.
  __asan_unpoison_memory_region(stack, size);
#endif
  return raw_prepare(stack, size, fn, arg);
}

void fiber_switch(void** save, void* next, StackBounds next_stack) {
#if TREE_ATTN_SIM_ASAN
  // This context's fake stack (use-after-return detection) stays in this frame while it is
  // switched out; the frame is resumed when the context is.
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, next_stack.bottom, next_stack.size);
  raw_switch(save, next);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)next_stack;
  raw_switch(save, next);
#endif
}

void fiber_started() {
#if TREE_ATTN_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
}

}  // namespace tree_attn::sim::detail
