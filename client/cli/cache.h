// attn cache create|append|truncate|fork|info|list|delete|export|import|move and attn decode:
// server-resident KV caches from the command line.
//
//   attn cache create --kv-heads K --head-dim D [--value-dim V] [--dtype f32|f16|bf16]
//                     [--values-from-keys]   a latent cache (MLA): keys only, V ≤ D
//   attn cache append ID --tokens N [--expected-length L]   N random tokens (uniform in [-1, 1))
//   attn cache truncate ID --keep N [--expected-length L]   drops the tokens from N on
//   attn cache fork ID [--length N] [--expected-length L]   a new cache holding ID's first N
//                                           tokens (all without --length), sharing its pages
//   attn cache info ID | attn cache list | attn cache delete ID
//   attn cache export ID --to FILE          the cache's tokens, bit-exact, into an export file
//   attn cache import FILE [--new-id]       a cache from an export file, on the one --target
//   attn cache move ID --from A --to B [--new-id]   streamed from server A to B, checked, then
//                                           deleted on A (client/client.h MoveCache)
//   attn decode [--heads H --kv-heads K --head-dim D --value-dim V --dtype T] [--tokens N]
//               [--steps M] [--values-from-keys]
//
// `attn decode` is the demo of why caches exist: it creates a cache, fills it with N random
// tokens (appends of at most kFillChunkBytes each, well under any message limit), then decodes
// M steps, each sending one new token's q, k and v, and prints per step the wall time, the
// server's compute time and the bytes sent beside what a stateless Tiled call of the same step
// (query plus the whole K and V) would have sent; then it deletes the cache. It keeps every token
// it sent, as the server stores it, and checks each step's output against a float64 reference
// over them (max |out − ref| / max |ref|, printed per step and at the end).
//
// With values_from_keys (`--values-from-keys`, cache create and decode) the cache is latent
// (CreateCacheRequest.values_from_keys: MLA, as DeepSeek-V3 decodes): it stores keys only and a
// token's value is the first value_dim columns of its key, so appends and decode steps send keys
// alone, and the demo's float64 reference takes each value from its key the same way.
//
// With shard_keys (`attn decode --shard-keys`), the demo's cache is one ShardedCache
// (client/sharded_cache.h) with a part on every endpoint of the target: the fill is water-filled
// over the parts, each step's token goes to the shortest part, every part answers each step
// concurrently and the client merges their (output, lse); per step it prints the same columns
// (compute: the slowest part's; sent: all parts' requests), and at the end each part's length.
//
// The commands go through a MultiServerClient, so with a --target list each cache stays on the
// server that created it (found by asking each endpoint when a later command names it); import
// needs one server to import into, and move names its two servers itself.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"
#include "client/multi_server_client.h"

namespace attn::cli {

// Appends are split to stay under this many bytes of key and value data each.
inline constexpr int64_t kFillChunkBytes = int64_t{8} << 20;

struct CacheFlags {
  int64_t heads = 8;      // Query heads (decode).
  int64_t kv_heads = 0;   // 0 = heads.
  int64_t head_dim = 64;  // Key width.
  int64_t value_dim = 0;  // 0 = head_dim.
  attention::v1::DType dtype = attention::v1::DTYPE_FLOAT32;
  bool values_from_keys = false;  // create, decode: a latent cache (keys only).
  int64_t tokens = 4096;          // append: tokens to add; decode: tokens to fill the cache with.
  int64_t steps = 16;             // decode: steps.
  int64_t expected_length = -1;   // append, truncate, fork: the length to send; −1 = the cache's.
  int64_t keep = -1;              // truncate: the tokens to keep.
  std::optional<int64_t> length;  // fork: the source's tokens the fork starts with; none = all.
  uint64_t seed = 1;
  bool json = false;        // create/append/info/list: protobuf JSON instead of text.
  bool shard_keys = false;  // decode: one cache split over every endpoint (ShardedCache).
  attention::v1::AttentionOptions options;  // decode: block_k, …
  std::string to;       // export: the file to write; move: the server to move the cache to.
  std::string from;     // move: the server holding the cache.
  bool new_id = false;  // import, move: a new id when the cache's is taken on the target.
  client::ClientOptions client_options;  // import, move: how to dial their servers.
};

// attn cache SUBCOMMAND [ID]: `args` are the words after "cache".
absl::Status RunCacheCommand(client::MultiServerClient& client,
                             const std::vector<std::string>& args, const CacheFlags& flags,
                             std::FILE* out);

// attn decode.
absl::Status RunDecodeDemo(client::MultiServerClient& client, const CacheFlags& flags,
                           std::FILE* out);

}  // namespace attn::cli
