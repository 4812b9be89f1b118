// The SIMT emulator's CUDA runtime (host_api.h): device memory, copies, streams, events, the
// device's properties and the error state, all synchronous over host memory.
#include "tests/simt/host_api.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <type_traits>
#include <vector>

// The runtime's handles. They stay opaque to the rest of the emulator: every call finds a handle
// in the live set before touching it, so a destroyed or made-up handle is an error, not a crash.
struct CUstream_st {
  unsigned int flags;
};

struct CUevent_st {
  unsigned int flags;
  bool recorded = false;
  std::chrono::steady_clock::time_point time;
};

struct CUmemPoolHandle_st {
  int reuse_follow_event_dependencies = 1;
  int reuse_allow_opportunistic = 1;
  int reuse_allow_internal_dependencies = 1;
  uint64_t release_threshold = 0;
  uint64_t high_bytes = 0;  // High-water mark of the bytes cudaMallocAsync held.
};

namespace simt {
namespace {

constexpr size_t kDefaultDeviceMemory = size_t{4} << 30;
constexpr int kDefaultSharedMemoryOptin = 166912;  // The A100's 163 KiB.
constexpr std::align_val_t kDeviceAlignment{256};  // cudaMalloc's guarantee.
constexpr unsigned char kFreshDeviceByte = 0xFF;   // NaN as fp32, fp16 and bf16.

// Errors after which a real context is unusable, as CUDA documents them. The backend has its own
// list (IsStickyError, kernels/cuda/cuda_status.h) of what it expects; the emulator models the
// runtime, so it keeps the runtime's list rather than taking the backend's word for it.
bool IsSticky(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

struct DeviceAllocation {
  size_t bytes;
  bool from_pool;  // cudaMallocAsync: counted in the default pool's statistics.
};

struct State {
  std::mutex mutex;
  size_t budget = kDefaultDeviceMemory;
  int shared_optin = kDefaultSharedMemoryOptin;
  // Keyed by address, so the allocation holding a pointer is the last one starting at or below it.
  std::map<uintptr_t, DeviceAllocation> device;
  size_t allocated = 0;
  size_t pool_allocated = 0;
  std::map<uintptr_t, size_t> pinned;      // cudaHostAlloc / cudaMallocHost.
  std::map<uintptr_t, size_t> registered;  // cudaHostRegister.
  std::set<cudaStream_t> streams;
  std::set<cudaEvent_t> events;
  CUmemPoolHandle_st pool;
  cudaError_t sticky = cudaSuccess;
  std::vector<void (*)()> reset_hooks;
};

// Never destroyed: backend objects with static lifetime free their memory during exit, after
// any State with a destructor would be gone.
State& GetState() {
  static State& state = *new State;
  return state;
}

// A thread's last error is stale once ResetDevice has run since it was set: that is how a reset
// reaches other threads' thread_local values.
std::atomic<uint64_t> reset_epoch{0};

struct LastError {
  cudaError_t error = cudaSuccess;
  uint64_t epoch = 0;
};
thread_local LastError last_error;

cudaError_t CurrentLastError() {
  return last_error.epoch == reset_epoch.load() ? last_error.error : cudaSuccess;
}

// Every call's result passes through here, so that a failure becomes the thread's last error.
cudaError_t Result(cudaError_t error) {
  if (error != cudaSuccess) last_error = {error, reset_epoch.load()};
  return error;
}

uintptr_t Address(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer); }

// The allocation of `ranges` (a map from start to size) holding [pointer, pointer + bytes), or
// end(). bytes 0 accepts one past the end, which C++ pointer arithmetic produces legitimately.
template <class Map>
typename Map::const_iterator Containing(const Map& ranges, const void* pointer, size_t bytes) {
  const uintptr_t start = Address(pointer);
  auto it = ranges.upper_bound(start);
  if (it == ranges.begin()) return ranges.end();
  --it;
  size_t size;
  if constexpr (std::is_same_v<typename Map::mapped_type, DeviceAllocation>) {
    size = it->second.bytes;
  } else {
    size = it->second;
  }
  const uintptr_t offset = start - it->first;
  if (offset > size || bytes > size - offset) return ranges.end();
  if (bytes == 0 || offset < size) return it;
  return ranges.end();
}

// True when [pointer, pointer + bytes) shares a byte with any of `ranges`.
template <class Map>
bool Overlaps(const Map& ranges, const void* pointer, size_t bytes) {
  const uintptr_t start = Address(pointer);
  const uintptr_t end = start + std::max<size_t>(bytes, 1);
  auto it = ranges.lower_bound(end);  // The first range starting at or past the end.
  if (it == ranges.begin()) return false;
  --it;
  size_t size;
  if constexpr (std::is_same_v<typename Map::mapped_type, DeviceAllocation>) {
    size = it->second.bytes;
  } else {
    size = it->second;
  }
  return it->first + std::max<size_t>(size, 1) > start;
}

bool ValidStream(const State& state, cudaStream_t stream) {
  return stream == nullptr || state.streams.count(stream) > 0;
}

// One side of a copy: a device side must lie inside one allocation; a host side must not touch
// any, since on a GPU a device pointer read as host memory (or the reverse) is garbage or a
// fault. `extent` is the span of bytes the copy touches.
cudaError_t CheckSide(const State& state, const void* pointer, size_t extent, bool device) {
  if (pointer == nullptr) return cudaErrorInvalidValue;
  if (device) {
    return Containing(state.device, pointer, extent) != state.device.end() ? cudaSuccess
                                                                           : cudaErrorInvalidValue;
  }
  return Overlaps(state.device, pointer, extent) ? cudaErrorInvalidValue : cudaSuccess;
}

// Which sides of a copy of `kind` are device memory; false for a kind CUDA does not have.
bool DeviceSides(const State& state, cudaMemcpyKind kind, const void* dst, const void* src,
                 bool* dst_device, bool* src_device) {
  switch (kind) {
    case cudaMemcpyHostToHost:
      *dst_device = false, *src_device = false;
      return true;
    case cudaMemcpyHostToDevice:
      *dst_device = true, *src_device = false;
      return true;
    case cudaMemcpyDeviceToHost:
      *dst_device = false, *src_device = true;
      return true;
    case cudaMemcpyDeviceToDevice:
      *dst_device = true, *src_device = true;
      return true;
    case cudaMemcpyDefault:
      // Unified addressing: a pointer into an allocation is device memory.
      *dst_device = Containing(state.device, dst, 1) != state.device.end();
      *src_device = Containing(state.device, src, 1) != state.device.end();
      return true;
  }
  return false;
}

// A 2-D copy: `height` rows of `width` bytes, rows `pitch` bytes apart on each side. A 1-D copy
// is one row. Runs under the lock so a concurrent cudaFree cannot pull memory out from under it.
cudaError_t Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                   size_t height, cudaMemcpyKind kind, cudaStream_t stream) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (!ValidStream(state, stream)) return Result(cudaErrorInvalidResourceHandle);
  bool dst_device, src_device;
  if (!DeviceSides(state, kind, dst, src, &dst_device, &src_device)) {
    return Result(cudaErrorInvalidMemcpyDirection);
  }
  if (width > dst_pitch || width > src_pitch) return Result(cudaErrorInvalidPitchValue);
  if (width == 0 || height == 0) return cudaSuccess;
  const size_t dst_extent = (height - 1) * dst_pitch + width;
  const size_t src_extent = (height - 1) * src_pitch + width;
  if (cudaError_t error = CheckSide(state, dst, dst_extent, dst_device); error != cudaSuccess) {
    return Result(error);
  }
  if (cudaError_t error = CheckSide(state, src, src_extent, src_device); error != cudaSuccess) {
    return Result(error);
  }
  // memcpy, not memmove: overlapping ranges are undefined on the device too, and
  // AddressSanitizer reports them.
  for (size_t row = 0; row < height; ++row) {
    std::memcpy(static_cast<char*>(dst) + row * dst_pitch,
                static_cast<const char*>(src) + row * src_pitch, width);
  }
  return cudaSuccess;
}

cudaError_t Fill(void* pointer, int value, size_t bytes, cudaStream_t stream) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (!ValidStream(state, stream)) return Result(cudaErrorInvalidResourceHandle);
  if (bytes == 0) return cudaSuccess;
  if (cudaError_t error = CheckSide(state, pointer, bytes, /*device=*/true); error != cudaSuccess) {
    return Result(error);
  }
  std::memset(pointer, value, bytes);  // memset, like cudaMemset, uses the low byte.
  return cudaSuccess;
}

cudaError_t AllocateDevice(void** pointer, size_t bytes, cudaStream_t stream, bool from_pool) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (pointer == nullptr) return Result(cudaErrorInvalidValue);
  if (!ValidStream(state, stream)) return Result(cudaErrorInvalidResourceHandle);
  *pointer = nullptr;
  if (bytes == 0) return cudaSuccess;
  if (bytes > state.budget || state.allocated > state.budget - bytes) {
    return Result(cudaErrorMemoryAllocation);
  }
  void* memory = ::operator new(bytes, kDeviceAlignment, std::nothrow);
  if (memory == nullptr) return Result(cudaErrorMemoryAllocation);
  std::memset(memory, kFreshDeviceByte, bytes);
  state.device.emplace(Address(memory), DeviceAllocation{bytes, from_pool});
  state.allocated += bytes;
  if (from_pool) {
    state.pool_allocated += bytes;
    state.pool.high_bytes = std::max<uint64_t>(state.pool.high_bytes, state.pool_allocated);
  }
  *pointer = memory;
  return cudaSuccess;
}

// Releases even while a sticky error is pending (see host_api.h), but then answers with it.
cudaError_t FreeDevice(void* pointer, cudaStream_t stream) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky == cudaSuccess && !ValidStream(state, stream)) {
    return Result(cudaErrorInvalidResourceHandle);
  }
  if (pointer != nullptr) {
    auto it = state.device.find(Address(pointer));
    if (it == state.device.end()) {
      return state.sticky != cudaSuccess ? state.sticky : Result(cudaErrorInvalidValue);
    }
    state.allocated -= it->second.bytes;
    if (it->second.from_pool) state.pool_allocated -= it->second.bytes;
    state.device.erase(it);
    ::operator delete(pointer, kDeviceAlignment);
  }
  return state.sticky;
}

// What cudaGetDeviceProperties reports, from the emulator's settings. Caller holds the lock.
cudaDeviceProp Properties(const State& state) {
  cudaDeviceProp properties{};
  std::snprintf(properties.name, sizeof(properties.name), "%s", "SIMT emulator (CPU)");
  const size_t optin = static_cast<size_t>(state.shared_optin);
  properties.totalGlobalMem = state.budget;
  properties.sharedMemPerBlock = std::min<size_t>(48 << 10, optin);
  properties.regsPerBlock = 65536;
  properties.warpSize = 32;
  properties.memPitch = 2147483647;
  properties.maxThreadsPerBlock = 1024;
  properties.maxThreadsDim[0] = 1024;
  properties.maxThreadsDim[1] = 1024;
  properties.maxThreadsDim[2] = 64;
  properties.maxGridSize[0] = 2147483647;
  properties.maxGridSize[1] = 65535;
  properties.maxGridSize[2] = 65535;
  properties.clockRate = 1410000;
  properties.totalConstMem = 65536;
  properties.major = 8;
  properties.minor = 0;
  properties.multiProcessorCount = 108;
  properties.canMapHostMemory = 1;
  properties.concurrentKernels = 1;
  properties.asyncEngineCount = 2;
  properties.unifiedAddressing = 1;
  properties.memoryClockRate = 1215000;
  properties.memoryBusWidth = 5120;
  properties.l2CacheSize = 40 << 20;
  properties.maxThreadsPerMultiProcessor = 2048;
  // The A100 reserves 1 KiB of each SM's shared memory per block beyond what a block may use.
  properties.reservedSharedMemPerBlock = 1024;
  properties.sharedMemPerMultiprocessor = optin + properties.reservedSharedMemPerBlock;
  properties.regsPerMultiprocessor = 65536;
  properties.managedMemory = 1;
  properties.sharedMemPerBlockOptin = optin;
  properties.maxBlocksPerMultiProcessor = 32;
  properties.memoryPoolsSupported = 1;
  return properties;
}

cudaEvent_t FindEvent(const State& state, cudaEvent_t event) {
  return state.events.count(event) > 0 ? event : nullptr;
}

}  // namespace

void RecordError(cudaError_t error) {
  if (error == cudaSuccess) return;
  if (IsSticky(error)) {
    State& state = GetState();
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.sticky == cudaSuccess) state.sticky = error;  // The first fault is the one to see.
  }
  Result(error);
}

cudaError_t StickyError() {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.sticky;
}

void ResetDevice() {
  State& state = GetState();
  std::vector<void (*)()> hooks;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.sticky = cudaSuccess;
    reset_epoch.fetch_add(1);
    hooks = state.reset_hooks;
  }
  for (void (*hook)() : hooks) hook();
}

void AddResetHook(void (*hook)()) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.reset_hooks.push_back(hook);
}

void SetDeviceMemory(size_t bytes) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.budget = bytes;
}

void SetSharedMemoryOptin(int bytes) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.shared_optin = bytes;
}

int SharedMemoryOptin() {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.shared_optin;
}

size_t AllocatedBytes() {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.allocated;
}

bool IsDeviceRange(const void* pointer, size_t bytes) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  return pointer != nullptr && Containing(state.device, pointer, bytes) != state.device.end();
}

std::vector<std::pair<uintptr_t, uintptr_t>> DeviceAccessibleRanges() {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const auto& [begin, allocation] : state.device)
    ranges.push_back({begin, begin + allocation.bytes});
  for (const auto& [begin, bytes] : state.pinned) ranges.push_back({begin, begin + bytes});
  for (const auto& [begin, bytes] : state.registered) ranges.push_back({begin, begin + bytes});
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

bool IsValidStream(cudaStream_t stream) {
  State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  return ValidStream(state, stream);
}

}  // namespace simt

using simt::GetState;
using simt::Result;

// ---- Memory ----------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  return simt::AllocateDevice(pointer, bytes, nullptr, /*from_pool=*/false);
}

cudaError_t cudaFree(void* pointer) { return simt::FreeDevice(pointer, nullptr); }

cudaError_t cudaMallocAsync(void** pointer, size_t bytes, cudaStream_t stream) {
  return simt::AllocateDevice(pointer, bytes, stream, /*from_pool=*/true);
}

cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream) {
  return simt::FreeDevice(pointer, stream);
}

cudaError_t cudaHostAlloc(void** pointer, size_t bytes, unsigned int flags) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  constexpr unsigned int kKnown =
      cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined;
  if (pointer == nullptr || (flags & ~kKnown) != 0) return Result(cudaErrorInvalidValue);
  *pointer = nullptr;
  if (bytes == 0) return cudaSuccess;
  void* memory = ::operator new(bytes, std::nothrow);
  if (memory == nullptr) return Result(cudaErrorMemoryAllocation);
  state.pinned.emplace(simt::Address(memory), bytes);
  *pointer = memory;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** pointer, size_t bytes) {
  return cudaHostAlloc(pointer, bytes, cudaHostAllocDefault);
}

cudaError_t cudaFreeHost(void* pointer) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (pointer != nullptr) {
    auto it = state.pinned.find(simt::Address(pointer));
    if (it == state.pinned.end()) {
      return state.sticky != cudaSuccess ? state.sticky : Result(cudaErrorInvalidValue);
    }
    state.pinned.erase(it);
    ::operator delete(pointer);
  }
  return state.sticky;
}

cudaError_t cudaHostRegister(void* pointer, size_t bytes, unsigned int flags) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  constexpr unsigned int kKnown = cudaHostRegisterPortable | cudaHostRegisterMapped |
                                  cudaHostRegisterIoMemory | cudaHostRegisterReadOnly;
  if (pointer == nullptr || bytes == 0 || (flags & ~kKnown) != 0 ||
      simt::Overlaps(state.device, pointer, bytes)) {
    return Result(cudaErrorInvalidValue);
  }
  if (simt::Overlaps(state.registered, pointer, bytes) ||
      simt::Overlaps(state.pinned, pointer, bytes)) {
    return Result(cudaErrorHostMemoryAlreadyRegistered);
  }
  state.registered.emplace(simt::Address(pointer), bytes);
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* pointer) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto it = state.registered.find(simt::Address(pointer));
  if (it == state.registered.end()) {
    return state.sticky != cudaSuccess ? state.sticky : Result(cudaErrorHostMemoryNotRegistered);
  }
  state.registered.erase(it);
  return state.sticky;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return simt::Copy2D(dst, bytes, src, bytes, bytes, 1, kind, nullptr);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return simt::Copy2D(dst, bytes, src, bytes, bytes, 1, kind, stream);
}

cudaError_t cudaMemcpy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                         size_t width, size_t height, cudaMemcpyKind kind) {
  return simt::Copy2D(dst, dst_pitch, src, src_pitch, width, height, kind, nullptr);
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
  return simt::Copy2D(dst, dst_pitch, src, src_pitch, width, height, kind, stream);
}

cudaError_t cudaMemset(void* pointer, int value, size_t bytes) {
  return simt::Fill(pointer, value, bytes, nullptr);
}

cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t stream) {
  return simt::Fill(pointer, value, bytes, stream);
}

// ---- Streams and events ----------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (stream == nullptr || (flags & ~cudaStreamNonBlocking) != 0) {
    return Result(cudaErrorInvalidValue);
  }
  *stream = new CUstream_st{flags};
  state.streams.insert(*stream);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto it = state.streams.find(stream);
  if (it == state.streams.end()) {  // The null stream among them: it cannot be destroyed.
    return state.sticky != cudaSuccess ? state.sticky : Result(cudaErrorInvalidResourceHandle);
  }
  state.streams.erase(it);
  delete stream;
  return state.sticky;
}

// Nothing is ever pending on a stream, so synchronizing and querying only check the handle.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  return simt::ValidStream(state, stream) ? cudaSuccess : Result(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  constexpr unsigned int kKnown =
      cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  // CUDA requires interprocess events to have timing disabled.
  if (event == nullptr || (flags & ~kKnown) != 0 ||
      ((flags & cudaEventInterprocess) != 0 && (flags & cudaEventDisableTiming) == 0)) {
    return Result(cudaErrorInvalidValue);
  }
  *event = new CUevent_st{flags, false, {}};
  state.events.insert(*event);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  cudaEvent_t found = simt::FindEvent(state, event);
  if (found == nullptr || !simt::ValidStream(state, stream)) {
    return Result(cudaErrorInvalidResourceHandle);
  }
  found->recorded = true;
  found->time = std::chrono::steady_clock::now();
  return cudaSuccess;
}

// A recorded event is complete at once, and CUDA calls one never recorded complete too.
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  return simt::FindEvent(state, event) != nullptr ? cudaSuccess
                                                  : Result(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaEventSynchronize(event); }

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (ms == nullptr) return Result(cudaErrorInvalidValue);
  const cudaEvent_t first = simt::FindEvent(state, start);
  const cudaEvent_t last = simt::FindEvent(state, end);
  // As in CUDA: an event never recorded, or one without timing, is an invalid handle here.
  if (first == nullptr || last == nullptr || !first->recorded || !last->recorded ||
      ((first->flags | last->flags) & cudaEventDisableTiming) != 0) {
    return Result(cudaErrorInvalidResourceHandle);
  }
  *ms = std::chrono::duration<float, std::milli>(last->time - first->time).count();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto it = state.events.find(event);
  if (it == state.events.end()) {
    return state.sticky != cudaSuccess ? state.sticky : Result(cudaErrorInvalidResourceHandle);
  }
  state.events.erase(it);
  delete event;
  return state.sticky;
}

// ---- The device ------------------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Result(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  return device == 0 ? cudaSuccess : Result(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDevice(int* device) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (device == nullptr) return Result(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() { return simt::StickyError(); }

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* properties, int device) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (properties == nullptr) return Result(cudaErrorInvalidValue);
  if (device != 0) return Result(cudaErrorInvalidDevice);
  *properties = simt::Properties(state);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (value == nullptr) return Result(cudaErrorInvalidValue);
  if (device != 0) return Result(cudaErrorInvalidDevice);
  const cudaDeviceProp p = simt::Properties(state);
  switch (attribute) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = p.maxThreadsPerBlock;
      break;
    case cudaDevAttrMaxBlockDimX:
    case cudaDevAttrMaxBlockDimY:
    case cudaDevAttrMaxBlockDimZ:
      *value = p.maxThreadsDim[attribute - cudaDevAttrMaxBlockDimX];
      break;
    case cudaDevAttrMaxGridDimX:
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ:
      *value = p.maxGridSize[attribute - cudaDevAttrMaxGridDimX];
      break;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(p.sharedMemPerBlock);
      break;
    case cudaDevAttrTotalConstantMemory:
      *value = static_cast<int>(p.totalConstMem);
      break;
    case cudaDevAttrWarpSize:
      *value = p.warpSize;
      break;
    case cudaDevAttrMaxRegistersPerBlock:
      *value = p.regsPerBlock;
      break;
    case cudaDevAttrClockRate:
      *value = p.clockRate;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = p.multiProcessorCount;
      break;
    case cudaDevAttrMemoryClockRate:
      *value = p.memoryClockRate;
      break;
    case cudaDevAttrGlobalMemoryBusWidth:
      *value = p.memoryBusWidth;
      break;
    case cudaDevAttrL2CacheSize:
      *value = p.l2CacheSize;
      break;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
      *value = p.maxThreadsPerMultiProcessor;
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = p.major;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = p.minor;
      break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = static_cast<int>(p.sharedMemPerMultiprocessor);
      break;
    case cudaDevAttrMaxRegistersPerMultiprocessor:
      *value = p.regsPerMultiprocessor;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(p.sharedMemPerBlockOptin);
      break;
    case cudaDevAttrMaxBlocksPerMultiprocessor:
      *value = p.maxBlocksPerMultiProcessor;
      break;
    case cudaDevAttrReservedSharedMemoryPerBlock:
      *value = static_cast<int>(p.reservedSharedMemPerBlock);
      break;
    case cudaDevAttrMemoryPoolsSupported:
      *value = p.memoryPoolsSupported;
      break;
    default:
      return Result(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (free_bytes == nullptr || total_bytes == nullptr) return Result(cudaErrorInvalidValue);
  *total_bytes = state.budget;
  *free_bytes = state.budget > state.allocated ? state.budget - state.allocated : 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (pool == nullptr) return Result(cudaErrorInvalidValue);
  if (device != 0) return Result(cudaErrorInvalidDevice);
  *pool = &state.pool;
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attribute, void* value) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (pool != &state.pool || value == nullptr) return Result(cudaErrorInvalidValue);
  switch (attribute) {
    case cudaMemPoolReuseFollowEventDependencies:
      std::memcpy(&pool->reuse_follow_event_dependencies, value, sizeof(int));
      return cudaSuccess;
    case cudaMemPoolReuseAllowOpportunistic:
      std::memcpy(&pool->reuse_allow_opportunistic, value, sizeof(int));
      return cudaSuccess;
    case cudaMemPoolReuseAllowInternalDependencies:
      std::memcpy(&pool->reuse_allow_internal_dependencies, value, sizeof(int));
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      std::memcpy(&pool->release_threshold, value, sizeof(uint64_t));
      return cudaSuccess;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh: {
      uint64_t reset;  // CUDA accepts only 0, which restarts the high-water mark from now.
      std::memcpy(&reset, value, sizeof(reset));
      if (reset != 0) return Result(cudaErrorInvalidValue);
      pool->high_bytes = state.pool_allocated;
      return cudaSuccess;
    }
    default:  // The current sizes are read-only.
      return Result(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attribute, void* value) {
  simt::State& state = GetState();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.sticky != cudaSuccess) return state.sticky;
  if (pool != &state.pool || value == nullptr) return Result(cudaErrorInvalidValue);
  uint64_t bytes;
  switch (attribute) {
    case cudaMemPoolReuseFollowEventDependencies:
      std::memcpy(value, &pool->reuse_follow_event_dependencies, sizeof(int));
      return cudaSuccess;
    case cudaMemPoolReuseAllowOpportunistic:
      std::memcpy(value, &pool->reuse_allow_opportunistic, sizeof(int));
      return cudaSuccess;
    case cudaMemPoolReuseAllowInternalDependencies:
      std::memcpy(value, &pool->reuse_allow_internal_dependencies, sizeof(int));
      return cudaSuccess;
    case cudaMemPoolAttrReleaseThreshold:
      bytes = pool->release_threshold;
      break;
    case cudaMemPoolAttrReservedMemCurrent:
    case cudaMemPoolAttrUsedMemCurrent:
      bytes = state.pool_allocated;
      break;
    case cudaMemPoolAttrReservedMemHigh:
    case cudaMemPoolAttrUsedMemHigh:
      bytes = pool->high_bytes;
      break;
    default:
      return Result(cudaErrorInvalidValue);
  }
  std::memcpy(value, &bytes, sizeof(bytes));
  return cudaSuccess;
}

// ---- Errors ----------------------------------------------------------------------------------

cudaError_t cudaGetLastError() {
  if (cudaError_t sticky = simt::StickyError(); sticky != cudaSuccess) return sticky;
  const cudaError_t error = simt::CurrentLastError();
  simt::last_error = {};
  return error;
}

cudaError_t cudaPeekAtLastError() {
  if (cudaError_t sticky = simt::StickyError(); sticky != cudaSuccess) return sticky;
  return simt::CurrentLastError();
}

namespace {

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};

constexpr ErrorText kErrorTexts[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidPitchValue, "cudaErrorInvalidPitchValue", "invalid pitch argument"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorECCUncorrectable, "cudaErrorECCUncorrectable", "uncorrectable ECC error encountered"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout", "the launch timed out and was terminated"},
    {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
    {cudaErrorHostMemoryAlreadyRegistered, "cudaErrorHostMemoryAlreadyRegistered",
     "part or all of the requested memory range is already mapped"},
    {cudaErrorHostMemoryNotRegistered, "cudaErrorHostMemoryNotRegistered",
     "pointer does not correspond to a registered memory region"},
    {cudaErrorHardwareStackError, "cudaErrorHardwareStackError", "hardware stack error"},
    {cudaErrorIllegalInstruction, "cudaErrorIllegalInstruction",
     "an illegal instruction was encountered"},
    {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
    {cudaErrorInvalidAddressSpace, "cudaErrorInvalidAddressSpace",
     "operation not supported on global/shared address space"},
    {cudaErrorInvalidPc, "cudaErrorInvalidPc", "invalid program counter"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorText* FindErrorText(cudaError_t error) {
  for (const ErrorText& entry : kErrorTexts) {
    if (entry.error == error) return &entry;
  }
  return nullptr;
}

}  // namespace

const char* cudaGetErrorName(cudaError_t error) {
  const ErrorText* entry = FindErrorText(error);
  return entry != nullptr ? entry->name : "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  const ErrorText* entry = FindErrorText(error);
  return entry != nullptr ? entry->text : "unrecognized error code";
}
