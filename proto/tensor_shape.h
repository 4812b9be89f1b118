// The one reading of a Tensor's shape as [batch, heads, len, dim], shared by the server's request
// parsing, its request log and the client's head sharding. The contract (attention.proto,
// Tensor.shape) takes rank 2 [seq, dim], 3 [heads, seq, dim] or 4 [batch, heads, seq, dim]; the
// leading dimensions rank 2 and 3 drop are 1.
#pragma once

#include <cstdint>
#include <optional>

#include "attention/v1/attention.pb.h"

namespace attn {

struct TensorDims {
  int64_t batch = 1;
  int64_t heads = 1;
  int64_t len = 1;  // Sequence length: query_len or key_len.
  int64_t dim = 1;  // Head dimension: head_dim, or value_dim for a value tensor.
};

// `tensor`'s shape as [batch, heads, len, dim]; nullopt when its rank is not 2, 3 or 4. The
// dimensions are copied as given: checking that each is ≥ 1 and that their product fits the data
// is the caller's (the server's messages name the axis at fault).
std::optional<TensorDims> NormalizedShape(const attention::v1::Tensor& tensor);

}  // namespace attn
