// The SIMT emulator's cuBLAS: handles and the two mixed-precision GEMMs the backend calls
// (cublasGemmEx, cublasGemmStridedBatchedEx), with cuBLAS's names, signatures and values.
//
// Semantics are cuBLAS's: column-major matrices, C = alpha op(A) op(B) + beta C for each batch,
// alpha and beta read from host memory as floats (the host pointer mode, the default), C not read
// when beta is 0 and A, B not read when alpha or k is 0 (so NaN there does not spread, as BLAS
// specifies). Supported: compute type CUBLAS_COMPUTE_32F (or its _PEDANTIC twin); A and B both
// CUDA_R_32F, CUDA_R_16F or CUDA_R_16BF; C CUDA_R_32F, or the inputs' 16-bit type. Products
// accumulate in fp32 in k order, so results match a GPU's to fp32 rounding, not bit for bit.
//
// Errors as cuBLAS reports them: an unknown or destroyed handle CUBLAS_STATUS_NOT_INITIALIZED;
// negative sizes or leading dimensions below the rows stored CUBLAS_STATUS_INVALID_VALUE; other
// types, compute types or algorithms CUBLAS_STATUS_NOT_SUPPORTED. Where a GPU would fault instead
// — an operand that is not device memory (simt::IsDeviceRange), a destroyed stream — the call
// fails with CUBLAS_STATUS_EXECUTION_FAILED and records the CUDA error the fault would raise
// (cudaErrorIllegalAddress, sticky; cudaErrorInvalidResourceHandle), naming the operand on
// stderr. A sticky error already pending also fails the call with EXECUTION_FAILED.
//
// Thread-safe; calls on one handle from several threads are as unordered as on a GPU.
#pragma once

#include <cuda_runtime.h>

struct cublasContext;  // Opaque, as in cuBLAS.
using cublasHandle_t = cublasContext*;

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16,
};

// For real matrices the conjugate transposes are plain transposes.
enum cublasOperation_t {
  CUBLAS_OP_N = 0,
  CUBLAS_OP_T = 1,
  CUBLAS_OP_C = 2,
  CUBLAS_OP_HERMITAN = 2,
  CUBLAS_OP_CONJG = 3,
};

enum cublasComputeType_t {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
  CUBLAS_COMPUTE_32I = 72,
  CUBLAS_COMPUTE_32I_PEDANTIC = 73,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
};

// Every algorithm cuBLAS names (DEFAULT, ALGO0..23 and their tensor-op forms) runs the same loop
// here; the enumerators bound the accepted ranges.
enum cublasGemmAlgo_t {
  CUBLAS_GEMM_DFALT = -1,
  CUBLAS_GEMM_DEFAULT = -1,
  CUBLAS_GEMM_ALGO0 = 0,
  CUBLAS_GEMM_ALGO23 = 23,
  CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
  CUBLAS_GEMM_DFALT_TENSOR_OP = 99,
  CUBLAS_GEMM_ALGO0_TENSOR_OP = 100,
  CUBLAS_GEMM_ALGO15_TENSOR_OP = 115,
};

cublasStatus_t cublasCreate(cublasHandle_t* handle);  // Its stream is the null stream.
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream);
const char* cublasGetStatusName(cublasStatus_t status);    // "CUBLAS_STATUS_SUCCESS"; not null.
const char* cublasGetStatusString(cublasStatus_t status);  // A sentence; never null.

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo);

// Batch i reads A + i·strideA, B + i·strideB and writes C + i·strideC (strides in elements; 0
// reuses one matrix for every batch).
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B,
                                          cudaDataType Btype, int ldb, long long int strideB,
                                          const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo);
