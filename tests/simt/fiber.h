// A fiber of the SIMT emulator: a stack of its own and a suspended context (Boost.Context's
// fcontext), so that each CUDA thread of a block runs until it has to wait for the others.
//
// The scheduler (device.cc) calls Resume, which returns when the fiber calls Suspend or its
// function returns. Under AddressSanitizer every switch is announced to it
// (__sanitizer_start_switch_fiber), so it tracks which stack is live. One scheduler per OS
// thread; a fiber is resumed only by the thread that started it.
#pragma once

#include <cstddef>

namespace simt {

class Fiber {
 public:
  explicit Fiber(size_t stack_bytes);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // Makes the fiber start `function(argument)` at its next Resume, on a clean stack; whatever
  // it was doing before (finished, or abandoned while suspended) is forgotten.
  void Reset(void (*function)(void*), void* argument);
  // Runs the fiber until it suspends or finishes.
  void Resume();
  bool finished() const { return finished_; }
  // Whether `address` is on this fiber's stack (its thread's local memory).
  bool OnStack(const void* address) const {
    return address >= stack_ && address < stack_ + stack_bytes_;
  }

  // From inside the running fiber: back to the scheduler until the next Resume.
  static void Suspend();

 private:
  static void Entry(void* transfer);
  void SwitchToScheduler();

  char* mapping_ = nullptr;  // Guard page, then the stack.
  size_t mapping_bytes_ = 0;
  char* stack_ = nullptr;
  size_t stack_bytes_ = 0;
  void* context_ = nullptr;     // The fiber's suspended context.
  void* fake_stack_ = nullptr;  // ASan's fake stack of the suspended fiber.
  void (*function_)(void*) = nullptr;
  void* argument_ = nullptr;
  bool finished_ = true;
};

}  // namespace simt
