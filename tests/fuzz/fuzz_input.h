// The fuzz input's format, read by attention_fuzz.cc and written by structure_mutator.cc and
// make_corpus.py:
//   byte 0, the selector: odd → a TraceRequest; 0 mod 4 → an AttentionRequest; 2 mod 4 → a cache
//           step (so the seeds' 0 and 1 keep their meaning);
//   then    the TraceRequest or AttentionRequest in protobuf's binary format, or for a cache step
//           the CreateCacheRequest's byte count as a protobuf varint, that CreateCacheRequest,
//           and a DecodeRequest in the rest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "attention/v1/attention.pb.h"

namespace attn {

enum class InputKind { kAttention, kTrace, kCacheStep };

inline InputKind KindOf(uint8_t selector) {
  if (selector % 2 == 1) return InputKind::kTrace;
  return selector % 4 == 2 ? InputKind::kCacheStep : InputKind::kAttention;
}

// A cache step's messages from the bytes after the selector; false when they do not parse.
inline bool ParseCacheStep(const uint8_t* data, size_t size,
                           attention::v1::CreateCacheRequest* create,
                           attention::v1::DecodeRequest* decode) {
  uint64_t length = 0;
  size_t at = 0;
  for (int shift = 0;; shift += 7) {
    if (at == size || shift > 28) return false;  // Over 2^35 bytes: more than any input.
    const uint8_t byte = data[at++];
    length |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) break;
  }
  if (length > size - at) return false;
  return create->ParseFromArray(data + at, static_cast<int>(length)) &&
         decode->ParseFromArray(data + at + length, static_cast<int>(size - at - length));
}

// The bytes after the selector for a cache step.
inline std::string SerializeCacheStep(const attention::v1::CreateCacheRequest& create,
                                      const attention::v1::DecodeRequest& decode) {
  const std::string create_bytes = create.SerializeAsString();
  std::string bytes;
  for (uint64_t length = create_bytes.size();; length >>= 7) {
    bytes.push_back(static_cast<char>((length & 0x7f) | (length >= 0x80 ? 0x80 : 0)));
    if (length < 0x80) break;
  }
  return bytes + create_bytes + decode.SerializeAsString();
}

}  // namespace attn
