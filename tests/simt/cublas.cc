// The SIMT emulator's cuBLAS (include/cublas_v2.h): handles, and GEMM as a plain fp32 loop over
// the emulator's device memory.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <set>
#include <vector>

struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace simt {
namespace {

// Live handles: a call finds its handle here before using it, so a destroyed one is an error.
struct Handles {
  std::mutex mutex;
  std::set<cublasHandle_t> live;
};

Handles& GetHandles() {
  static Handles& handles = *new Handles;  // Never destroyed: see host_api.cc's State.
  return handles;
}

// The handle's stream, or false for a handle that is not live.
bool StreamOf(cublasHandle_t handle, cudaStream_t* stream) {
  Handles& handles = GetHandles();
  std::lock_guard<std::mutex> lock(handles.mutex);
  if (handles.live.count(handle) == 0) return false;
  *stream = handle->stream;
  return true;
}

int64_t ElementSize(cudaDataType type) { return type == CUDA_R_32F ? 4 : 2; }

bool SupportedInput(cudaDataType type) {
  return type == CUDA_R_32F || type == CUDA_R_16F || type == CUDA_R_16BF;
}

// The 16-bit formats' conversions are the emulated headers' (cuda_fp16.h, cuda_bf16.h: the
// project's one rounding rule, kernels/dtype.h).
float HalfToFloat(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
uint16_t FloatToHalf(float value) { return __half_as_ushort(__float2half_rn(value)); }
float BfloatToFloat(uint16_t bits) { return __bfloat162float(__ushort_as_bfloat16(bits)); }
uint16_t FloatToBfloat(float value) { return __bfloat16_as_ushort(__float2bfloat16_rn(value)); }

// out[i] = element first + i·step of `base`, as float, for i < count.
void Gather(const void* base, cudaDataType type, int64_t first, int64_t step, int64_t count,
            float* out) {
  if (type == CUDA_R_32F) {
    const float* data = static_cast<const float*>(base) + first;
    for (int64_t i = 0; i < count; ++i) out[i] = data[i * step];
    return;
  }
  const uint16_t* data = static_cast<const uint16_t*>(base) + first;
  if (type == CUDA_R_16F) {
    for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(data[i * step]);
  } else {
    for (int64_t i = 0; i < count; ++i) out[i] = BfloatToFloat(data[i * step]);
  }
}

// Elements first .. first + count of `base` = values, rounded to `type`.
void Scatter(void* base, cudaDataType type, int64_t first, int64_t count, const float* values) {
  if (type == CUDA_R_32F) {
    std::memcpy(static_cast<float*>(base) + first, values, count * sizeof(float));
    return;
  }
  uint16_t* data = static_cast<uint16_t*>(base) + first;
  if (type == CUDA_R_16F) {
    for (int64_t i = 0; i < count; ++i) data[i] = FloatToHalf(values[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) data[i] = FloatToBfloat(values[i]);
  }
}

// One operand of one batch: `rows` × `cols` stored column-major, `ld` elements apart.
struct Matrix {
  const char* name;
  const void* base;
  cudaDataType type;
  int64_t offset;  // Elements from base.
  int64_t rows, cols, ld;
};

// A GPU kernel reading outside device memory faults; the emulator says where first.
bool InDeviceMemory(const char* function, const Matrix& matrix, int batch) {
  const int64_t element = ElementSize(matrix.type);
  const char* start = static_cast<const char*>(matrix.base) + matrix.offset * element;
  const int64_t bytes = ((matrix.cols - 1) * matrix.ld + matrix.rows) * element;
  if (matrix.base != nullptr && IsDeviceRange(start, static_cast<size_t>(bytes))) return true;
  std::fprintf(stderr,
               "simt: %s: %s of batch %d ([%p, +%lld bytes)) is not inside one device "
               "allocation; recording cudaErrorIllegalAddress\n",
               function, matrix.name, batch, static_cast<const void*>(start),
               static_cast<long long>(bytes));
  return false;
}

bool ValidOperation(cublasOperation_t op) {
  return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;
}

bool ValidAlgorithm(cublasGemmAlgo_t algo) {
  return (algo >= CUBLAS_GEMM_DEFAULT && algo <= CUBLAS_GEMM_ALGO23) ||
         (algo >= CUBLAS_GEMM_DEFAULT_TENSOR_OP && algo <= CUBLAS_GEMM_ALGO15_TENSOR_OP);
}

cublasStatus_t Gemm(const char* function, cublasHandle_t handle, cublasOperation_t transa,
                    cublasOperation_t transb, int m, int n, int k, const void* alpha_pointer,
                    const void* A, cudaDataType a_type, int lda, int64_t stride_a, const void* B,
                    cudaDataType b_type, int ldb, int64_t stride_b, const void* beta_pointer,
                    void* C, cudaDataType c_type, int ldc, int64_t stride_c, int batches,
                    cublasComputeType_t compute, cublasGemmAlgo_t algo) {
  cudaStream_t stream;
  if (!StreamOf(handle, &stream)) return CUBLAS_STATUS_NOT_INITIALIZED;
  const bool a_plain = transa == CUBLAS_OP_N;
  const bool b_plain = transb == CUBLAS_OP_N;
  // op(A) is m × k and op(B) k × n, so A stores m (or k) rows and B k (or n).
  const int a_rows = a_plain ? m : k;
  const int b_rows = b_plain ? k : n;
  if (!ValidOperation(transa) || !ValidOperation(transb) || m < 0 || n < 0 || k < 0 ||
      batches < 0 || lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) ||
      ldc < std::max(1, m) || alpha_pointer == nullptr || beta_pointer == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool types_supported =
      a_type == b_type && SupportedInput(a_type) && (c_type == CUDA_R_32F || c_type == a_type);
  if ((compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC) ||
      !types_supported || !ValidAlgorithm(algo)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (StickyError() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (m == 0 || n == 0 || batches == 0) return CUBLAS_STATUS_SUCCESS;  // No kernel to launch.
  if (!IsValidStream(stream)) {
    RecordError(cudaErrorInvalidResourceHandle);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }

  float alpha, beta;
  std::memcpy(&alpha, alpha_pointer, sizeof(alpha));
  std::memcpy(&beta, beta_pointer, sizeof(beta));
  // BLAS: with alpha or k zero, A and B are not referenced; with beta zero, C is not read.
  const bool read_ab = alpha != 0.f && k > 0;
  const bool read_c = beta != 0.f;

  // Every batch's operands are checked before any is written, so a fault leaves C as it was.
  for (int batch = 0; batch < batches; ++batch) {
    const Matrix a{"A", A, a_type, batch * stride_a, a_rows, a_plain ? k : m, lda};
    const Matrix b{"B", B, b_type, batch * stride_b, b_rows, b_plain ? n : k, ldb};
    const Matrix c{"C", C, c_type, batch * stride_c, m, n, ldc};
    if ((read_ab && (!InDeviceMemory(function, a, batch) || !InDeviceMemory(function, b, batch))) ||
        !InDeviceMemory(function, c, batch)) {
      RecordError(cudaErrorIllegalAddress);
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
  }

  std::vector<float> op_a;  // op(A), m × k column-major, in fp32.
  std::vector<float> b_column(read_ab ? k : 0), sum(m), c_column(m);
  if (read_ab) op_a.resize(static_cast<size_t>(m) * k);
  for (int batch = 0; batch < batches; ++batch) {
    const int64_t a_offset = batch * stride_a;
    const int64_t b_offset = batch * stride_b;
    const int64_t c_offset = batch * stride_c;
    if (read_ab) {
      // Column p of op(A) is column p of A, or row p of A when transposed.
      for (int p = 0; p < k; ++p) {
        Gather(A, a_type, a_offset + (a_plain ? int64_t{p} * lda : p), a_plain ? 1 : lda, m,
               &op_a[static_cast<size_t>(p) * m]);
      }
    }
    for (int j = 0; j < n; ++j) {
      std::fill(sum.begin(), sum.end(), 0.f);
      if (read_ab) {
        Gather(B, b_type, b_offset + (b_plain ? int64_t{j} * ldb : j), b_plain ? 1 : ldb, k,
               b_column.data());
        // Column j of op(A)·op(B) as a sum of op(A)'s columns: a unit-stride inner loop, each
        // output summed in k order in fp32.
        for (int p = 0; p < k; ++p) {
          const float scale = b_column[p];
          const float* column = &op_a[static_cast<size_t>(p) * m];
          for (int i = 0; i < m; ++i) sum[i] += column[i] * scale;
        }
      }
      const int64_t c_first = c_offset + int64_t{j} * ldc;
      if (read_c) {
        Gather(C, c_type, c_first, 1, m, c_column.data());
        for (int i = 0; i < m; ++i) c_column[i] = alpha * sum[i] + beta * c_column[i];
      } else {
        for (int i = 0; i < m; ++i) c_column[i] = alpha * sum[i];
      }
      Scatter(C, c_type, c_first, m, c_column.data());
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

struct StatusText {
  cublasStatus_t status;
  const char* name;
  const char* text;
};

constexpr StatusText kStatusTexts[] = {
    {CUBLAS_STATUS_SUCCESS, "CUBLAS_STATUS_SUCCESS", "success"},
    {CUBLAS_STATUS_NOT_INITIALIZED, "CUBLAS_STATUS_NOT_INITIALIZED",
     "the library was not initialized"},
    {CUBLAS_STATUS_ALLOC_FAILED, "CUBLAS_STATUS_ALLOC_FAILED", "the resource allocation failed"},
    {CUBLAS_STATUS_INVALID_VALUE, "CUBLAS_STATUS_INVALID_VALUE",
     "an invalid numeric value was used as an argument"},
    {CUBLAS_STATUS_ARCH_MISMATCH, "CUBLAS_STATUS_ARCH_MISMATCH",
     "an absent device architectural feature is required"},
    {CUBLAS_STATUS_MAPPING_ERROR, "CUBLAS_STATUS_MAPPING_ERROR",
     "an access to GPU memory space failed"},
    {CUBLAS_STATUS_EXECUTION_FAILED, "CUBLAS_STATUS_EXECUTION_FAILED",
     "the GPU program failed to execute"},
    {CUBLAS_STATUS_INTERNAL_ERROR, "CUBLAS_STATUS_INTERNAL_ERROR", "an internal operation failed"},
    {CUBLAS_STATUS_NOT_SUPPORTED, "CUBLAS_STATUS_NOT_SUPPORTED",
     "the functionality requested is not supported"},
    {CUBLAS_STATUS_LICENSE_ERROR, "CUBLAS_STATUS_LICENSE_ERROR",
     "an error was detected when checking the current licensing"},
};

const StatusText* FindStatusText(cublasStatus_t status) {
  for (const StatusText& entry : kStatusTexts) {
    if (entry.status == status) return &entry;
  }
  return nullptr;
}

}  // namespace
}  // namespace simt

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  // cuBLAS cannot initialize on a context that has failed.
  if (simt::StickyError() != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  cublasHandle_t created = new (std::nothrow) cublasContext;
  if (created == nullptr) return CUBLAS_STATUS_ALLOC_FAILED;
  simt::Handles& handles = simt::GetHandles();
  std::lock_guard<std::mutex> lock(handles.mutex);
  handles.live.insert(created);
  *handle = created;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  simt::Handles& handles = simt::GetHandles();
  std::lock_guard<std::mutex> lock(handles.mutex);
  if (handles.live.erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

// Like cuBLAS, takes the stream as given; a stream destroyed by the time of a call fails that
// call.
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  simt::Handles& handles = simt::GetHandles();
  std::lock_guard<std::mutex> lock(handles.mutex);
  if (handles.live.count(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  return simt::StreamOf(handle, stream) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  const simt::StatusText* entry = simt::FindStatusText(status);
  return entry != nullptr ? entry->name : "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  const simt::StatusText* entry = simt::FindStatusText(status);
  return entry != nullptr ? entry->text : "unknown error";
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
  return simt::Gemm("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B,
                    Btype, ldb, 0, beta, C, Ctype, ldc, 0, 1, computeType, algo);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType Atype,
                                          int lda, long long int strideA, const void* B,
                                          cudaDataType Btype, int ldb, long long int strideB,
                                          const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  return simt::Gemm("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype,
                    lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount,
                    computeType, algo);
}
