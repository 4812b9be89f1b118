// Naive attention's own kernels on the GPU. The two matrix products are cuBLAS strided-batched
// GEMMs (cuda_backend.cc), as in a framework's eager path:
//   S = scale · Q Kᵀ      cuBLAS, fp32 [B·H·Nq, Nk] in device memory
//   W = softmax(S)        SoftmaxKernel below, fp32 [B·H·Nq, Nk] beside S (causal mask here)
//   O = W V               cuBLAS, fp32
// plus the conversions around them (ToFloatKernel for V, StoreKernel for the output dtype).
// Measured: not yet on a GPU (see docs/perf.md).
#include <cmath>

#include "kernels/cuda/launch.h"
#include "kernels/dtype.h"

namespace attn::cuda {
namespace {

constexpr int kSoftmaxThreads = 256;

// Block-wide reduction of one float per thread; every thread gets the result.
template <class Op>
__device__ float BlockReduce(float value, Op op, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read from a previous reduction.
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = shared[0];
  for (int w = 1; w < kSoftmaxThreads / 32; ++w) value = op(value, shared[w]);
  return value;
}

// One block per score row: mask, max, exp-sum, normalize. A row that sees no key gets zero
// weights and lse −inf.
__global__ void __launch_bounds__(kSoftmaxThreads)
    SoftmaxKernel(const float* scores, float* weights, float* lse, int64_t query_len,
                  int64_t key_len, bool causal) {
  __shared__ float partial[kSoftmaxThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t query = row % query_len;
  const int64_t visible =
      causal ? min(max(query + key_len - query_len + 1, int64_t{0}), key_len) : key_len;
  const float* s = scores + row * key_len;
  float* w = weights + row * key_len;

  float max_score = -INFINITY;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) max_score = fmaxf(max_score, s[j]);
  max_score = BlockReduce(
      max_score, [](float a, float b) { return fmaxf(a, b); }, partial);

  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < visible; j += blockDim.x) sum += expf(s[j] - max_score);
  sum = BlockReduce(
      sum, [](float a, float b) { return a + b; }, partial);

  const float inverse = visible > 0 ? 1.f / sum : 0.f;
  for (int64_t j = threadIdx.x; j < key_len; j += blockDim.x) {
    w[j] = j < visible ? expf(s[j] - max_score) * inverse : 0.f;
  }
  if (lse != nullptr && threadIdx.x == 0) {
    lse[row] = visible > 0 ? max_score + logf(sum) : -INFINITY;
  }
}

__global__ void ToFloatKernel(const void* input, DType dtype, int64_t pitch, int64_t rows,
                              int64_t cols, float* output) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    output[i] = LoadElement(input, dtype, i / cols * pitch + i % cols);
  }
}

__global__ void StoreKernel(const float* input, int64_t count, DType dtype, void* output) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    StoreElement(output, dtype, i, input[i]);
  }
}

// A grid-stride launch shape for `count` elements.
unsigned GridFor(int64_t count) {
  const int64_t blocks = (count + 255) / 256;
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

cudaError_t LaunchSoftmax(const float* scores, float* weights, float* lse, int64_t rows,
                          int64_t query_len, int64_t key_len, bool causal, cudaStream_t stream) {
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  SoftmaxKernel<<<static_cast<unsigned>(rows), kSoftmaxThreads, 0, stream>>>(
      scores, weights, lse, query_len, key_len, causal);
  return cudaGetLastError();
}

cudaError_t LaunchToFloat(const void* input, DType dtype, int64_t pitch, int64_t rows, int64_t cols,
                          float* output, cudaStream_t stream) {
  ToFloatKernel<<<GridFor(rows * cols), 256, 0, stream>>>(input, dtype, pitch, rows, cols, output);
  return cudaGetLastError();
}

cudaError_t LaunchStore(const float* input, int64_t count, DType dtype, void* output,
                        cudaStream_t stream) {
  StoreKernel<<<GridFor(count), 256, 0, stream>>>(input, count, dtype, output);
  return cudaGetLastError();
}

}  // namespace attn::cuda
