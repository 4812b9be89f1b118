#include "proto/tensor_shape.h"

namespace attn {

std::optional<TensorDims> NormalizedShape(const attention::v1::Tensor& tensor) {
  const int rank = tensor.shape_size();
  if (rank < 2 || rank > 4) return std::nullopt;
  TensorDims dims;
  dims.dim = tensor.shape(rank - 1);
  dims.len = tensor.shape(rank - 2);
  if (rank >= 3) dims.heads = tensor.shape(rank - 3);
  if (rank == 4) dims.batch = tensor.shape(0);
  return dims;
}

}  // namespace attn
