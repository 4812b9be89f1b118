// Naive attention's own kernels on the GPU. The two matrix products are cuBLAS strided-batched
// GEMMs (cuda_backend.cc), as in a framework's eager path:
//   S = scale · Q Kᵀ      cuBLAS, fp32 [B·H·Nq, Nk] in device memory
//   W = softmax(S)        SoftmaxKernel below (SoftmaxRow, online_softmax.h), fp32 [B·H·Nq, Nk]
//                         beside S; the transform (softcap, ALiBi) and the mask (positions,
//                         causal, windows, ragged sequences) are applied here
//   O = W V               cuBLAS, fp32
// plus the conversions around them (ToFloatKernel for V, StoreKernel for the output dtype).
// Measured: not yet on a GPU (see docs/perf.md).
#include <cmath>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/portable.h"
#include "kernels/cuda/reduce.h"
#include "kernels/dtype.h"
#include "kernels/online_softmax.h"

namespace attn::cuda {
namespace {

constexpr int kSoftmaxThreads = 256;

// One block per score row: the transform (kernels/score_transform.h) and the mask
// (kernels/geometry.h), then the full-row stable softmax
// (SoftmaxRow, online_softmax.h, with the head's sink) shared by the block's threads. A row that
// sees no key gets zero weights and lse −inf (the sink with one).
__global__ void __launch_bounds__(kSoftmaxThreads)
    SoftmaxKernel(float* scores, float* weights, float* lse, int64_t heads, const Geometry geometry,
                  const ScoreTransforms transforms) {
  const int64_t row = blockIdx.x;
  const int64_t key_len = geometry.key_len;
  const int64_t query_row = row % geometry.query_len;
  const KeyRange visible = geometry.Visible(query_row);
  const int64_t head = row / geometry.query_len % heads;
  const ScoreTransform transform = transforms.ForHead(head);
  if (!transform.Identity()) {
    const int64_t distance = geometry.Distance(query_row, 0);  // p − t of key 0.
    for (int64_t j = visible.begin + threadIdx.x; j < visible.end; j += kSoftmaxThreads) {
      scores[row * key_len + j] = transform(scores[row * key_len + j], distance - j);
    }
    __syncthreads();
  }
  const OnlineSoftmax<BlockReduce<kSoftmaxThreads>> softmax =
      SoftmaxRow<BlockReduce<kSoftmaxThreads>>(scores + row * key_len, weights + row * key_len,
                                               key_len, visible, transforms.Sink(head), threadIdx.x,
                                               kSoftmaxThreads);
  if (lse != nullptr && threadIdx.x == 0) lse[row] = softmax.LogSumExp();
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

cudaError_t LaunchSoftmax(float* scores, float* weights, float* lse, int64_t rows, int64_t heads,
                          const Geometry& geometry, const ScoreTransforms& transforms,
                          cudaStream_t stream) {
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  return LaunchKernel(SoftmaxKernel, static_cast<unsigned>(rows), kSoftmaxThreads, 0, stream,
                      scores, weights, lse, heads, geometry, transforms);
}

cudaError_t LaunchToFloat(const void* input, DType dtype, int64_t pitch, int64_t rows, int64_t cols,
                          float* output, cudaStream_t stream) {
  return LaunchKernel(ToFloatKernel, GridFor(rows * cols), 256, 0, stream, input, dtype, pitch,
                      rows, cols, output);
}

cudaError_t LaunchStore(const float* input, int64_t count, DType dtype, void* output,
                        cudaStream_t stream) {
  return LaunchKernel(StoreKernel, GridFor(count), 256, 0, stream, input, count, dtype, output);
}

}  // namespace attn::cuda
