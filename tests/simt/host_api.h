// The SIMT emulator's CUDA runtime API: the part of cuda_runtime.h the backend's host code calls
// (memory, copies, streams, events, device queries, errors), with the CUDA runtime's names,
// signatures and numeric values, over host memory.
//
// Model. One device, index 0, that is the CPU. Every call does its work before it returns, so
// streams and events never have anything pending: a stream or event query answers cudaSuccess,
// a synchronize waits for nothing, an "async" call is its synchronous twin plus a stream check.
// Device memory is ordinary heap memory (aligned to 256 bytes, so AddressSanitizer watches every
// allocation at its exact size) that new allocations fill with 0xFF bytes — NaN in every float
// format — so a kernel that reads memory nobody wrote shows NaN instead of a lucky zero. Each
// allocation is tracked, which lets the runtime catch what a GPU reports late or never: a free of
// a pointer it never returned, a copy whose device side leaves its allocation, a host pointer
// passed where a device one belongs (or the reverse), all cudaErrorInvalidValue.
//
// Errors. As in CUDA, a failing call's error becomes the calling thread's "last error"
// (cudaGetLastError returns and clears it, cudaPeekAtLastError only returns it). A sticky error
// (an illegal address, a launch failure: what a real context cannot recover from), recorded by
// simt::RecordError, is returned by every later call, and by cudaGetLastError without clearing,
// until simt::ResetDevice. Calls that release something (cudaFree, the destroys) still release it
// while a sticky error is pending, so a test that breaks the device on purpose does not leak.
//
// Thread-safe: one mutex guards the runtime's state; last errors are per thread, as in CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "tests/simt/types.h"

// ---- Types and constants -------------------------------------------------------------------

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,  // Direction from the pointers, as with unified addressing.
};

// library_types.h's element types; cuBLAS (include/cublas_v2.h) reads them.
enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_8I = 3,
  CUDA_R_32I = 10,
  CUDA_R_16BF = 14,
};
using cudaDataType = cudaDataType_t;

constexpr unsigned int cudaHostAllocDefault = 0x0;
constexpr unsigned int cudaHostAllocPortable = 0x1;
constexpr unsigned int cudaHostAllocMapped = 0x2;
constexpr unsigned int cudaHostAllocWriteCombined = 0x4;

constexpr unsigned int cudaHostRegisterDefault = 0x0;
constexpr unsigned int cudaHostRegisterPortable = 0x1;
constexpr unsigned int cudaHostRegisterMapped = 0x2;
constexpr unsigned int cudaHostRegisterIoMemory = 0x4;
constexpr unsigned int cudaHostRegisterReadOnly = 0x8;

constexpr unsigned int cudaStreamDefault = 0x0;
constexpr unsigned int cudaStreamNonBlocking = 0x1;

constexpr unsigned int cudaEventDefault = 0x0;
constexpr unsigned int cudaEventBlockingSync = 0x1;
constexpr unsigned int cudaEventDisableTiming = 0x2;
constexpr unsigned int cudaEventInterprocess = 0x4;

// An A100-like sm_80 device (see cudaGetDeviceProperties); the fields of CUDA's struct that code
// commonly reads, in CUDA's types.
struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int regsPerBlock;
  int warpSize;
  size_t memPitch;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int clockRate;  // kHz.
  size_t totalConstMem;
  int major;
  int minor;
  int multiProcessorCount;
  int integrated;
  int canMapHostMemory;
  int computeMode;
  int concurrentKernels;
  int ECCEnabled;
  int pciBusID;
  int pciDeviceID;
  int pciDomainID;
  int asyncEngineCount;
  int unifiedAddressing;
  int memoryClockRate;  // kHz.
  int memoryBusWidth;   // Bits.
  int l2CacheSize;
  int maxThreadsPerMultiProcessor;
  size_t sharedMemPerMultiprocessor;
  int regsPerMultiprocessor;
  int managedMemory;
  size_t sharedMemPerBlockOptin;
  int maxBlocksPerMultiProcessor;
  size_t reservedSharedMemPerBlock;
  int memoryPoolsSupported;
};

// cudaDeviceGetAttribute's attributes that mirror a cudaDeviceProp field, with CUDA's values.
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxBlockDimX = 2,
  cudaDevAttrMaxBlockDimY = 3,
  cudaDevAttrMaxBlockDimZ = 4,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrTotalConstantMemory = 9,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMaxRegistersPerBlock = 12,
  cudaDevAttrClockRate = 13,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMemoryClockRate = 36,
  cudaDevAttrGlobalMemoryBusWidth = 37,
  cudaDevAttrL2CacheSize = 38,
  cudaDevAttrMaxThreadsPerMultiProcessor = 39,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxRegistersPerMultiprocessor = 82,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrMaxBlocksPerMultiprocessor = 106,
  cudaDevAttrReservedSharedMemoryPerBlock = 111,
  cudaDevAttrMemoryPoolsSupported = 115,
};

struct CUmemPoolHandle_st;  // Opaque, as in the CUDA runtime.
using cudaMemPool_t = CUmemPoolHandle_st*;

// Attributes of the stream-ordered allocator's pool. The emulator keeps no freed memory (each
// cudaMallocAsync is a fresh allocation, so AddressSanitizer sees use after cudaFreeAsync), but
// the values are stored and reported as CUDA does: the reuse flags are ints, the rest uint64_t.
enum cudaMemPoolAttr {
  cudaMemPoolReuseFollowEventDependencies = 0x1,
  cudaMemPoolReuseAllowOpportunistic = 0x2,
  cudaMemPoolReuseAllowInternalDependencies = 0x3,
  cudaMemPoolAttrReleaseThreshold = 0x4,
  cudaMemPoolAttrReservedMemCurrent = 0x5,  // Read-only: bytes cudaMallocAsync holds.
  cudaMemPoolAttrReservedMemHigh = 0x6,     // Its high-water mark; may only be reset to 0.
  cudaMemPoolAttrUsedMemCurrent = 0x7,      // Same as reserved: nothing is cached.
  cudaMemPoolAttrUsedMemHigh = 0x8,
};

// ---- Memory ----------------------------------------------------------------------------------

// Device memory, counted against simt::SetDeviceMemory's budget (cudaErrorMemoryAllocation past
// it). A size of 0 yields a null pointer and cudaSuccess.
cudaError_t cudaMalloc(void** pointer, size_t bytes);
cudaError_t cudaFree(void* pointer);  // Null is a no-op; anything not from cudaMalloc*: invalid.
cudaError_t cudaMallocAsync(void** pointer, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream);

// Pinned host memory: plain host memory here, tracked only so cudaFreeHost can check it.
cudaError_t cudaMallocHost(void** pointer, size_t bytes);
cudaError_t cudaHostAlloc(void** pointer, size_t bytes, unsigned int flags);
cudaError_t cudaFreeHost(void* pointer);
cudaError_t cudaHostRegister(void* pointer, size_t bytes, unsigned int flags);
cudaError_t cudaHostUnregister(void* pointer);

// Copies and fills. The device side of each must lie inside one allocation and the host side
// outside every allocation; a count of 0 does nothing.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                         size_t width, size_t height, cudaMemcpyKind kind);
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* pointer, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t stream = nullptr);

// ---- Streams and events ----------------------------------------------------------------------

// The null stream and every created, not yet destroyed stream are valid; using any other
// handle is cudaErrorInvalidResourceHandle.
cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);

// Events record std::chrono::steady_clock at cudaEventRecord, when all earlier work is done.
cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t event);

// ---- The device ------------------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count);  // 1; never the sticky error (needs no context).
cudaError_t cudaSetDevice(int device);       // cudaErrorInvalidDevice for any but 0.
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* properties, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device);
// Total: the budget; free: the budget less what cudaMalloc* holds.
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attribute, void* value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attribute, void* value);

// ---- Errors ----------------------------------------------------------------------------------

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t error);    // "cudaErrorInvalidValue"; never null.
const char* cudaGetErrorString(cudaError_t error);  // A sentence; never null.

// ---- The C++ overloads cuda_runtime.h adds -------------------------------------------------

// Typed pointers, so `char* p; cudaHostAlloc(&p, ...)` compiles as it does with nvcc.
template <class T>
cudaError_t cudaMalloc(T** pointer, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(pointer), bytes);
}
template <class T>
cudaError_t cudaMallocAsync(T** pointer, size_t bytes, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(pointer), bytes, stream);
}
template <class T>
cudaError_t cudaMallocHost(T** pointer, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void**>(pointer), bytes);
}
template <class T>
cudaError_t cudaHostAlloc(T** pointer, size_t bytes, unsigned int flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(pointer), bytes, flags);
}
inline cudaError_t cudaEventCreate(cudaEvent_t* event, unsigned int flags) {
  return cudaEventCreateWithFlags(event, flags);
}

// ---- The emulator's own hooks, for its device side, its cuBLAS and tests -------------------

namespace simt {

// The device memory budget (default 4 GiB): totalGlobalMem, cudaMemGetInfo's total, and the
// most cudaMalloc* may hold at once. Lowering it below what is held only fails later requests.
void SetDeviceMemory(size_t bytes);

// What one block may opt in to with cudaFuncSetAttribute (default 166912, the A100's 163 KiB):
// sharedMemPerBlockOptin and cudaDevAttrMaxSharedMemoryPerBlockOptin, so tests can shrink it to
// a smaller part's (99 KiB on sm_86/89) and watch the backend follow.
void SetSharedMemoryOptin(int bytes);
int SharedMemoryOptin();

// Bytes cudaMalloc* hold now.
size_t AllocatedBytes();

// True when [pointer, pointer + bytes) lies inside one live device allocation. With bytes 0:
// whether pointer is inside one or one past its end.
bool IsDeviceRange(const void* pointer, size_t bytes);

// Every range device code may read or write through a pointer, sorted: the device allocations,
// and the pinned and registered host memory (mapped into the device's address space, as with
// unified addressing).
std::vector<std::pair<uintptr_t, uintptr_t>> DeviceAccessibleRanges();

// True for the null stream and for streams created and not yet destroyed.
bool IsValidStream(cudaStream_t stream);

// Registers a function ResetDevice calls after clearing the errors: how the device side clears
// its own reports. Hooks run in registration order, outside the runtime's lock.
void AddResetHook(void (*hook)());

}  // namespace simt
