#include "tests/simt/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/detail/fcontext.hpp>
#include <cstdio>
#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace simt {
namespace {

namespace fcontext = boost::context::detail;

// The scheduler's side of the running fiber, per OS thread.
struct SchedulerSide {
  fcontext::fcontext_t context = nullptr;  // Where Suspend returns to.
  Fiber* running = nullptr;
  const void* stack_bottom = nullptr;  // The scheduler's stack, for ASan.
  size_t stack_bytes = 0;
};
thread_local SchedulerSide scheduler;

// ASan's view of a switch: `fake_stack_save` keeps the leaving stack's fake frames (null: the
// leaving fiber is done for good).
void StartSwitch(void** fake_stack_save, const void* bottom, size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(fake_stack_save, bottom, bytes);
#else
  (void)fake_stack_save, (void)bottom, (void)bytes;
#endif
}
void FinishSwitch(void* fake_stack, const void** old_bottom, size_t* old_bytes) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake_stack, old_bottom, old_bytes);
#else
  (void)fake_stack, (void)old_bottom, (void)old_bytes;
#endif
}

}  // namespace

Fiber::Fiber(size_t stack_bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes_ = (stack_bytes + page - 1) / page * page;
  mapping_bytes_ = stack_bytes_ + page;
  void* mapping = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapping == MAP_FAILED) {
    std::fprintf(stderr, "simt: cannot map a fiber stack of %zu bytes\n", stack_bytes_);
    std::abort();
  }
  mapping_ = static_cast<char*>(mapping);
  mprotect(mapping_, page, PROT_NONE);  // A stack overflow faults instead of corrupting.
  stack_ = mapping_ + page;
}

Fiber::~Fiber() { munmap(mapping_, mapping_bytes_); }

void Fiber::Reset(void (*function)(void*), void* argument) {
#if defined(__SANITIZE_ADDRESS__)
  // An abandoned fiber leaves its frames' poison behind.
  __asan_unpoison_memory_region(stack_, stack_bytes_);
#endif
  function_ = function;
  argument_ = argument;
  finished_ = false;
  fake_stack_ = nullptr;
  context_ = fcontext::make_fcontext(stack_ + stack_bytes_, stack_bytes_,
                                     [](fcontext::transfer_t t) { Entry(&t); });
}

void Fiber::Resume() {
  if (finished_) return;
  scheduler.running = this;
  void* scheduler_fake_stack = nullptr;
  StartSwitch(&scheduler_fake_stack, stack_, stack_bytes_);
  const fcontext::transfer_t back = fcontext::jump_fcontext(context_, this);
  FinishSwitch(scheduler_fake_stack, nullptr, nullptr);
  context_ = back.fctx;
  scheduler.running = nullptr;
}

void Fiber::Entry(void* transfer) {
  const auto& t = *static_cast<fcontext::transfer_t*>(transfer);
  scheduler.context = t.fctx;
  Fiber* self = static_cast<Fiber*>(t.data);
  FinishSwitch(nullptr, &scheduler.stack_bottom, &scheduler.stack_bytes);
  self->function_(self->argument_);
  self->finished_ = true;
  self->SwitchToScheduler();  // Never resumed again.
  std::abort();
}

void Fiber::SwitchToScheduler() {
  StartSwitch(finished_ ? nullptr : &fake_stack_, scheduler.stack_bottom, scheduler.stack_bytes);
  const fcontext::transfer_t t = fcontext::jump_fcontext(scheduler.context, nullptr);
  scheduler.context = t.fctx;
  FinishSwitch(fake_stack_, &scheduler.stack_bottom, &scheduler.stack_bytes);
}

void Fiber::Suspend() {
  Fiber* self = scheduler.running;
  if (self == nullptr) {
    std::fprintf(stderr, "simt: a device-side wait outside a kernel's thread\n");
    std::abort();
  }
  self->SwitchToScheduler();
}

}  // namespace simt
