// The SIMT emulator's basic CUDA types, shared by its host runtime (host_api.h), its device side
// (device.h) and its cuBLAS (include/cublas_v2.h): the vector types, the error codes, the opaque
// stream and event handles.
//
// The emulator (tests/simt/README.md) compiles the CUDA backend's own sources — kernels/cuda/*.cu
// and the host code around them — with g++, its include/ directory standing in for the CUDA
// Toolkit's headers, so the backend runs on the CPU with every block's threads as fibers.
#pragma once

#include <cstddef>
#include <cstdint>

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// The runtime's error codes the backend names (kernels/cuda/cuda_status.h and the host code),
// with the CUDA runtime's numeric values.
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidPitchValue = 12,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchTimeout = 702,
  cudaErrorHardwareStackError = 714,
  cudaErrorIllegalInstruction = 715,
  cudaErrorMisalignedAddress = 716,
  cudaErrorInvalidAddressSpace = 717,
  cudaErrorInvalidPc = 718,
  cudaErrorLaunchFailure = 719,
  cudaErrorECCUncorrectable = 214,
  cudaErrorAssert = 710,
  cudaErrorHostMemoryAlreadyRegistered = 712,
  cudaErrorHostMemoryNotRegistered = 713,
  cudaErrorNoDevice = 100,
  cudaErrorUnknown = 999,
};

struct CUstream_st;  // Opaque, as in the CUDA runtime.
struct CUevent_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;

namespace simt {

// Records an error of an operation (a launch, a copy): what cudaGetLastError and
// cudaPeekAtLastError report next; a sticky one (IsStickyError's list: an illegal address, a
// launch failure) is returned by every later runtime call until ResetDevice. Implemented in
// host_api.cc.
void RecordError(cudaError_t error);

// The device's sticky error, or cudaSuccess.
cudaError_t StickyError();

// Clears every error, sticky ones too, and the emulator's reports (device.h): for tests that
// break a kernel on purpose and go on. Implemented in host_api.cc.
void ResetDevice();

}  // namespace simt
