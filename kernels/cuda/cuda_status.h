// CUDA and cuBLAS results as absl::Status: every CUDA call in the backend goes through these,
// so a failure becomes an error the server returns, never an exit or abort.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attn::cuda {

// True for errors after which the CUDA context is unusable until the process restarts.
inline bool IsStickyError(cudaError_t error) {
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

// OK for cudaSuccess; RESOURCE_EXHAUSTED for out-of-memory, UNAVAILABLE for sticky (device
// lost) errors, INTERNAL otherwise. `what` names the call.
inline absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (IsStickyError(error)) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

inline absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cublasGetStatusName(status), " (",
                                           cublasGetStatusString(status), ")");
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace attn::cuda

// Evaluates a CUDA runtime call; returns its failure as a Status from the enclosing function.
#define ATTN_CUDA_RETURN_IF_ERROR(call)                                                        \
  do {                                                                                         \
    if (absl::Status cuda_status = ::attn::cuda::CudaStatus((call), #call); !cuda_status.ok()) \
      return cuda_status;                                                                      \
  } while (0)

#define ATTN_CUBLAS_RETURN_IF_ERROR(call)                                       \
  do {                                                                          \
    if (absl::Status cublas_status = ::attn::cuda::CublasStatus((call), #call); \
        !cublas_status.ok())                                                    \
      return cublas_status;                                                     \
  } while (0)

// Evaluates an expression yielding absl::Status; returns it if not OK.
#define ATTN_RETURN_IF_ERROR(expr)                                    \
  do {                                                                \
    if (absl::Status status_ = (expr); !status_.ok()) return status_; \
  } while (0)

// Assigns the value of a StatusOr expression to `lhs`, or returns its error.
#define ATTN_ASSIGN_OR_RETURN(lhs, expr)                                                        \
  auto ATTN_CONCAT(statusor_, __LINE__) = (expr);                                               \
  if (!ATTN_CONCAT(statusor_, __LINE__).ok()) return ATTN_CONCAT(statusor_, __LINE__).status(); \
  lhs = *std::move(ATTN_CONCAT(statusor_, __LINE__))
#define ATTN_CONCAT_INNER(a, b) a##b
#define ATTN_CONCAT(a, b) ATTN_CONCAT_INNER(a, b)
