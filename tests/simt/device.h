// The SIMT emulator's device side: what CUDA device code sees, for kernels compiled as plain C++
// (tests/simt/README.md).
//
// A launch (simt::Launch, which kernels/cuda/portable.h's LaunchKernel calls) runs the grid's
// blocks one after another, inside the call; each thread of a block is a fiber (fiber.cc) that
// runs until it reaches a barrier or a warp collective, where it waits for the others:
//   __syncthreads            every thread of the block that has not exited; all of them at the
//                            same call site (else a synccheck report)
//   __syncwarp, __shfl_*_sync, __ballot_sync, __any_sync, __all_sync, simt::MmaSync
//                            every lane the mask names, with the same mask, at the same call
//                            site (__syncwarp: any __syncwarp) — else a synccheck report, as for a
//                            lane that exited, waits elsewhere, or is read outside the mask
// A block in which no thread can go on (a barrier some thread never reaches) is a deadlock: the
// block is abandoned with a synccheck report. Shared memory (declared through portable.h's
// ATTN_SHARED_ARRAY and ATTN_DYNAMIC_SHARED) is a heap allocation per block, so ASan sees its
// bounds; in a build whose kernels are compiled with -fsanitize=thread (racecheck.cc) every load
// and store of it is checked for a race within a barrier interval and for a read of a byte never
// written. Asynchronous copies (simt::CopyAsync) land at simt::WaitCopies, not before.
//
// Every report goes to stderr and to simt::TakeReports(), and fails the launch: the next runtime
// call returns cudaErrorLaunchFailure, sticky, as a faulting kernel's does, until
// simt::ResetDevice().
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tests/simt/types.h"

// --- Qualifiers ---------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict
// __shared__ is deliberately not defined: device code declares shared memory through
// ATTN_SHARED_ARRAY and ATTN_DYNAMIC_SHARED (kernels/cuda/portable.h), which the emulator
// allocates per block.

namespace simt {

// What a fiber shows its thread: its indices and its block's.
struct ThreadHeader {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

namespace detail {
// The running fiber's thread, null outside a kernel. A plain global, since kernels run one at a
// time under the device's lock: as an extern thread_local, the asan build (GCC 12, ASan + UBSan)
// reported every threadIdx in a fiber as a load through a null pointer (cause not pinned down).
extern const ThreadHeader* current_thread;
}  // namespace detail

// --- Barriers and warp collectives (device.cc) ------------------------------------------------
using Site = std::source_location;

void SyncThreads(Site site);
int SyncThreadsCount(int predicate, Site site);  // The number of threads with predicate ≠ 0.
void SyncWarp(unsigned mask, Site site);

enum class ShuffleKind { kIndex, kUp, kDown, kXor };
// One lane's part in a shuffle of 64-bit payloads; returns the source lane's payload.
uint64_t Shuffle(ShuffleKind kind, unsigned mask, uint64_t payload, int operand, int width,
                 Site site);
// The mask of lanes in `mask` whose predicate is not 0.
unsigned Ballot(unsigned mask, int predicate, Site site);

// The warp's m16n8k16 .row.col mma.sync with f32 accumulators: this lane's fragments in, its d
// out (c = d). Every lane of the warp takes part.
enum class MmaType { kF16, kBF16 };
void MmaSync(MmaType type, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
             Site site = Site::current());

// --- Asynchronous copies (cp.async) ----------------------------------------------------------
// Queues a copy of `bytes` (4, 8 or 16) from global memory to shared memory, of which the first
// `source_bytes` are read and the rest zero-filled; it lands only when a WaitCopies covers its
// group.
void CopyAsync(void* shared, const void* global, int bytes, int source_bytes);
// Closes the thread's open group of copies (cp.async.commit_group).
void CommitCopies();
// Completes every committed group but the `pending` most recent (cp.async.wait_group).
void WaitCopies(int pending);

// --- Shared memory ----------------------------------------------------------------------------
// The block's dynamic shared memory (the launch's size) and its static array for `tag` (one per
// declaration: the same for every thread of the block), both 16-byte aligned.
void* DynamicShared();
void* StaticShared(const void* tag, const char* name, size_t bytes, size_t alignment);

// --- Launch -----------------------------------------------------------------------------------
// A kernel's body for every thread: calls the kernel with the launch's arguments.
struct KernelBody {
  void (*run)(const void* body);
  const void* body;  // The launch's arguments, which its threads read: the kernel's own memory.
  size_t body_bytes;
  const void* kernel;  // Identifies the kernel (its attributes).
};

cudaError_t LaunchBody(const KernelBody& body, dim3 grid, dim3 block, size_t shared_bytes,
                       cudaStream_t stream);

template <class... Params, class... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "a kernel's arguments, one per parameter");
  // Converted to the parameters' types once, as a launch copies its arguments.
  struct Bound {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> arguments;
  };
  const Bound bound{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  const KernelBody body{[](const void* b) {
                          const Bound& self = *static_cast<const Bound*>(b);
                          std::apply(self.kernel, self.arguments);
                        },
                        &bound, sizeof bound, reinterpret_cast<const void*>(kernel)};
  return LaunchBody(body, grid, block, shared_bytes, stream);
}

// --- Reports ----------------------------------------------------------------------------------
// What the checks found since the last call (each also printed to stderr when found), oldest
// first: "racecheck: …", "synccheck: …", "initcheck: …", "launch: …".
std::vector<std::string> TakeReports();
// Whether this build sees every access of device code (kernels compiled with -fsanitize=thread:
// racecheck.cc): shared memory's races and unwritten reads, and global accesses that are not to
// device memory (a host pointer handed to a kernel, which ASan cannot tell from a device one).
// Not in the ASan build, which checks bounds instead.
bool SharedAccessesChecked();

// Called by racecheck.cc's hooks for each instrumented access.
void CheckAccessHook(const void* address, size_t bytes, bool write, const void* pc);

}  // namespace simt

// --- What CUDA device code names ---------------------------------------------------------------
cudaError_t cudaGetLastError();

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
namespace simt {
cudaError_t SetFunctionAttribute(const void* kernel, cudaFuncAttribute attribute, int value);
}
template <class... Params>
cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attribute,
                                 int value) {
  return simt::SetFunctionAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}

#define threadIdx (::simt::detail::current_thread->thread_idx)
#define blockIdx (::simt::detail::current_thread->block_idx)
#define blockDim (::simt::detail::current_thread->block_dim)
#define gridDim (::simt::detail::current_thread->grid_dim)
constexpr int warpSize = 32;

inline void __syncthreads(simt::Site site = simt::Site::current()) { simt::SyncThreads(site); }
inline int __syncthreads_count(int predicate, simt::Site site = simt::Site::current()) {
  return simt::SyncThreadsCount(predicate, site);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, simt::Site site = simt::Site::current()) {
  simt::SyncWarp(mask, site);
}

namespace simt::detail {
template <class T>
uint64_t ToPayload(T value) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8);
  uint64_t payload = 0;
  std::memcpy(&payload, &value, sizeof value);
  return payload;
}
template <class T>
T FromPayload(uint64_t payload) {
  T value;
  std::memcpy(&value, &payload, sizeof value);
  return value;
}
}  // namespace simt::detail

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32,
              simt::Site site = simt::Site::current()) {
  return simt::detail::FromPayload<T>(simt::Shuffle(
      simt::ShuffleKind::kIndex, mask, simt::detail::ToPayload(var), src_lane, width, site));
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                 simt::Site site = simt::Site::current()) {
  return simt::detail::FromPayload<T>(simt::Shuffle(simt::ShuffleKind::kUp, mask,
                                                    simt::detail::ToPayload(var),
                                                    static_cast<int>(delta), width, site));
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                   simt::Site site = simt::Site::current()) {
  return simt::detail::FromPayload<T>(simt::Shuffle(simt::ShuffleKind::kDown, mask,
                                                    simt::detail::ToPayload(var),
                                                    static_cast<int>(delta), width, site));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                  simt::Site site = simt::Site::current()) {
  return simt::detail::FromPayload<T>(simt::Shuffle(
      simt::ShuffleKind::kXor, mask, simt::detail::ToPayload(var), lane_mask, width, site));
}
inline unsigned __ballot_sync(unsigned mask, int predicate,
                              simt::Site site = simt::Site::current()) {
  return simt::Ballot(mask, predicate, site);
}
inline int __any_sync(unsigned mask, int predicate, simt::Site site = simt::Site::current()) {
  return simt::Ballot(mask, predicate, site) != 0;
}
inline int __all_sync(unsigned mask, int predicate, simt::Site site = simt::Site::current()) {
  return simt::Ballot(mask, predicate, site) == mask;
}

// Atomics: fibers run one at a time, so a plain read-modify-write is atomic.
template <class T>
T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
template <class T>
T atomicMax(T* address, T value) {
  const T old = *address;
  if (value > old) *address = value;
  return old;
}
template <class T>
T atomicMin(T* address, T value) {
  const T old = *address;
  if (value < old) *address = value;
  return old;
}
template <class T>
T atomicExch(T* address, T value) {
  const T old = *address;
  *address = value;
  return old;
}
template <class T>
T atomicCAS(T* address, T compare, T value) {
  const T old = *address;
  if (old == compare) *address = value;
  return old;
}

// Math and bit casts device code uses beside <cmath>'s.
template <class A, class B>
constexpr std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B>
constexpr std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
inline unsigned __float_as_uint(float x) {
  return simt::detail::FromPayload<unsigned>(simt::detail::ToPayload(x));
}
inline float __uint_as_float(unsigned x) { return simt::detail::FromPayload<float>(x); }
inline int __float_as_int(float x) {
  return simt::detail::FromPayload<int>(simt::detail::ToPayload(x));
}
inline float __int_as_float(int x) {
  return simt::detail::FromPayload<float>(static_cast<uint32_t>(x));
}
template <class T>
T __ldg(const T* p) {
  return *p;
}
