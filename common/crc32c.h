// CRC32C (Castagnoli, reflected polynomial 0x82F63B78, as iSCSI, ext4 and gRPC's
// grpc-encoding use it): the checksum of attnd's cache files (server/cache_file.h) and of a
// cache's exported tokens (CacheChunk.crc32c), so the server and the clients compute it alike.
//
// Crc32c(data, n) is the checksum of n bytes; Crc32c(data, n, crc) extends `crc` (the checksum
// of what came before) by n more bytes, so Crc32c(b, m, Crc32c(a, n)) == Crc32c(a‖b, n + m).
// On x86-64 with SSE4.2 it uses the crc32 instruction (about 8 bytes a cycle per stream);
// elsewhere a table, a byte at a time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace attn {
namespace crc32c_internal {

constexpr uint32_t kPolynomial = 0x82F63B78u;

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? kPolynomial : 0);
    table[i] = crc;
  }
  return table;
}

inline constexpr std::array<uint32_t, 256> kTable = MakeTable();

// The raw (un-inverted) register over n bytes, a byte at a time.
inline uint32_t Portable(const unsigned char* p, size_t n, uint32_t crc) {
  for (size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint32_t Hardware(const unsigned char* p, size_t n,
                                                           uint32_t crc) {
  uint64_t wide = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    wide = __builtin_ia32_crc32di(wide, word);
  }
  crc = static_cast<uint32_t>(wide);
  for (; n > 0; --n, ++p) crc = __builtin_ia32_crc32qi(crc, *p);
  return crc;
}

inline bool HaveHardware() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace crc32c_internal

inline uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t state = ~crc;
#if defined(__x86_64__)
  if (crc32c_internal::HaveHardware()) return ~crc32c_internal::Hardware(p, n, state);
#endif
  return ~crc32c_internal::Portable(p, n, state);
}

}  // namespace attn
