// Geometry: which keys a query row sees and which key/value head it reads — the one host-and-
// device definition every kernel (CPU and CUDA), every trace and the request checks use.
//
// Positions. Every key and query row has a position in the sequence: key j is at
// key_position + j, query row i at query_position + i. The request's defaults
// (server/request.cc) put the keys at 0 … key_len − 1 and the queries bottom-right, so the last
// query row sits at the last key (query_position = key_position + key_len − query_len, which may
// be negative when there are more query rows than keys: those first rows see no key). A client
// that splits a problem's keys (or queries) across servers sends each slice its own positions,
// and each slice then computes exactly its part of the whole (README, "Splitting the keys").
//
// Causal: a query at position p sees a key at position t iff t ≤ p. Since that is a bound from
// above, the keys row i sees are always a prefix [0, VisibleKeys(i)) of the request's keys, and
// VisibleKeys never decreases with i: a block of consecutive rows sees at most what its last row
// sees, and a key tile past that row's last visible key can be skipped by the whole block.
//
// Positions are checked to lie in [0, 2^62] (kMaxPosition) and key_len, query_len < 2^62, so
// query_position − key_position + row + 1 cannot overflow int64.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace attn {

// The largest position a request may give (both positions, and the lengths, are at most this).
inline constexpr int64_t kMaxPosition = int64_t{1} << 62;

struct Geometry {
  int64_t query_len = 1;
  int64_t key_len = 1;
  int64_t query_position = 0;  // Position of query row 0 (resolved; may be negative, see above).
  int64_t key_position = 0;    // Position of key 0.
  bool causal = false;

  // The request defaults: keys at key_position …, queries bottom-right against them.
  static ATTN_HOST_DEVICE Geometry BottomRight(int64_t query_len, int64_t key_len, bool causal,
                                               int64_t key_position = 0) {
    return Geometry{query_len, key_len, key_position + key_len - query_len, key_position, causal};
  }

  // Keys query row `row` sees: keys [0, VisibleKeys(row)), all key_len of them unless causal.
  ATTN_HOST_DEVICE int64_t VisibleKeys(int64_t row) const {
    if (!causal) return key_len;
    const int64_t visible = query_position + row - key_position + 1;  // Keys at t ≤ p.
    return visible < 0 ? 0 : (visible > key_len ? key_len : visible);
  }

  // Of those, the ones in keys [begin, begin + n).
  ATTN_HOST_DEVICE int64_t VisibleKeysIn(int64_t row, int64_t begin, int64_t n) const {
    const int64_t end = VisibleKeys(row);
    const int64_t last = begin + n < end ? begin + n : end;
    return last > begin ? last - begin : 0;
  }

  // Key tiles of block_k keys holding at least one key row `row` sees (the tiles Tiled visits).
  ATTN_HOST_DEVICE int64_t VisitedTiles(int64_t row, int64_t block_k) const {
    return (VisibleKeys(row) + block_k - 1) / block_k;
  }
};

// Grouped-query attention: kv_heads divides heads, and each consecutive group of
// heads / kv_heads query heads shares one key/value head.
ATTN_HOST_DEVICE int64_t QueryHeadsPerKvHead(int64_t heads, int64_t kv_heads) {
  return heads / kv_heads;
}

// The key/value head that query head `head` reads.
ATTN_HOST_DEVICE int64_t KvHeadOf(int64_t head, int64_t heads, int64_t kv_heads) {
  return head / QueryHeadsPerKvHead(heads, kv_heads);
}

}  // namespace attn
