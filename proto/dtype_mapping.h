// The one mapping between the contract's DType and the kernels' DType, shared by the server's
// request parsing and the client library.
#pragma once

#include <optional>

#include "attention/v1/attention.pb.h"
#include "kernels/dtype.h"

namespace attn {

// The kernel dtype for a wire dtype; nullopt for DTYPE_UNSPECIFIED or an unknown number.
inline std::optional<DType> FromProtoDType(int dtype) {
  switch (dtype) {
    case attention::v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case attention::v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case attention::v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    default:
      return std::nullopt;
  }
}

inline attention::v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return attention::v1::DTYPE_FLOAT32;
    case DType::kFloat16:
      return attention::v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return attention::v1::DTYPE_BFLOAT16;
  }
  return attention::v1::DTYPE_UNSPECIFIED;
}

}  // namespace attn
