// Racecheck's eyes: the emulated kernels (and only they) are compiled with GCC's
// -fsanitize=thread instrumentation but linked without its runtime; these definitions take the
// runtime's place. Every load and store the kernels make calls one of them and goes on to
// simt::CheckAccessHook (device.cc): a shared-memory address to the race and initialization
// checks, any other to the check that device code touches only device memory and its own.
// Atomics the instrumented code makes are done here, plainly (fibers never run at once).
//
// Built only into the release stage's emulator: GCC refuses -fsanitize=thread beside
// -fsanitize=address, so the ASan stage checks shared-memory bounds instead (device.h).
#include <cstddef>
#include <cstdint>

#include "tests/simt/device.h"

namespace {

__attribute__((always_inline)) inline void Access(const void* address, size_t bytes, bool write) {
  simt::CheckAccessHook(address, bytes, write, __builtin_return_address(0));
}

}  // namespace

extern "C" {

void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}

#define SIMT_ACCESS_HOOKS(n)                                        \
  void __tsan_read##n(void* p) { Access(p, n, false); }             \
  void __tsan_write##n(void* p) { Access(p, n, true); }             \
  void __tsan_unaligned_read##n(void* p) { Access(p, n, false); }   \
  void __tsan_unaligned_write##n(void* p) { Access(p, n, true); }   \
  void __tsan_volatile_read##n(void* p) { Access(p, n, false); }    \
  void __tsan_volatile_write##n(void* p) { Access(p, n, true); }    \
  void __tsan_read##n##_pc(void* p, void*) { Access(p, n, false); } \
  void __tsan_write##n##_pc(void* p, void*) { Access(p, n, true); }
SIMT_ACCESS_HOOKS(1)
SIMT_ACCESS_HOOKS(2)
SIMT_ACCESS_HOOKS(4)
SIMT_ACCESS_HOOKS(8)
SIMT_ACCESS_HOOKS(16)
#undef SIMT_ACCESS_HOOKS

void __tsan_read_range(void* p, size_t n) { Access(p, n, false); }
void __tsan_write_range(void* p, size_t n) { Access(p, n, true); }

#define SIMT_ATOMIC_HOOKS(bits)                                                                    \
  using a##bits = uint##bits##_t;                                                                  \
  a##bits __tsan_atomic##bits##_load(const volatile a##bits* p, int) {                             \
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);                                                   \
  }                                                                                                \
  void __tsan_atomic##bits##_store(volatile a##bits* p, a##bits v, int) {                          \
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);                                                      \
  }                                                                                                \
  a##bits __tsan_atomic##bits##_exchange(volatile a##bits* p, a##bits v, int) {                    \
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                                \
  a##bits __tsan_atomic##bits##_fetch_add(volatile a##bits* p, a##bits v, int) {                   \
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  a##bits __tsan_atomic##bits##_fetch_sub(volatile a##bits* p, a##bits v, int) {                   \
    return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  a##bits __tsan_atomic##bits##_fetch_and(volatile a##bits* p, a##bits v, int) {                   \
    return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  a##bits __tsan_atomic##bits##_fetch_or(volatile a##bits* p, a##bits v, int) {                    \
    return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);                                              \
  }                                                                                                \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile a##bits* p, a##bits* expected,        \
                                                    a##bits v, int, int) {                         \
    return __atomic_compare_exchange_n(p, expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                                \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile a##bits* p, a##bits* expected,          \
                                                  a##bits v, int, int) {                           \
    return __atomic_compare_exchange_n(p, expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                                \
  a##bits __tsan_atomic##bits##_compare_exchange_val(volatile a##bits* p, a##bits expected,        \
                                                     a##bits v, int, int) {                        \
    __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
    return expected;                                                                               \
  }
SIMT_ATOMIC_HOOKS(8)
SIMT_ATOMIC_HOOKS(16)
SIMT_ATOMIC_HOOKS(32)
SIMT_ATOMIC_HOOKS(64)
#undef SIMT_ATOMIC_HOOKS

void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) {}

}  // extern "C"
