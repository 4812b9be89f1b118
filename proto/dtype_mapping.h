// The one mapping between the contract's DType and the kernels' DType, shared by the server's
// request parsing and the client library.
#pragma once

#include <optional>

#include "attention/v1/attention.pb.h"
#include "kernels/dtype.h"

namespace attn {

// The kernel dtype for a tensor's wire dtype (float32, float16, bfloat16); nullopt for
// DTYPE_UNSPECIFIED, DTYPE_FLOAT8_E4M3 (a cache's dtype only) or an unknown number.
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

// The kernel dtype for a KV cache's wire dtype: a tensor's, or DTYPE_FLOAT8_E4M3.
inline std::optional<DType> FromProtoCacheDType(int dtype) {
  if (dtype == attention::v1::DTYPE_FLOAT8_E4M3) return DType::kFloat8E4M3;
  return FromProtoDType(dtype);
}

// The tensor dtype a client sends a cache of wire dtype `cache` its tokens (and queries) in: the
// cache's own, or bf16 for an fp8 cache (which quantizes what it is sent; no tensor is fp8).
inline attention::v1::DType TokenDTypeFor(attention::v1::DType cache) {
  return cache == attention::v1::DTYPE_FLOAT8_E4M3 ? attention::v1::DTYPE_BFLOAT16 : cache;
}

inline attention::v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return attention::v1::DTYPE_FLOAT32;
    case DType::kFloat16:
      return attention::v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return attention::v1::DTYPE_BFLOAT16;
    case DType::kFloat8E4M3:
      return attention::v1::DTYPE_FLOAT8_E4M3;
  }
  return attention::v1::DTYPE_UNSPECIFIED;
}

}  // namespace attn
