// The drain's hand-over (attnd --drain-to): every cache this server holds, moved to a peer
// attnd one at a time over its ImportCache, with the chunks CacheExporter makes
// (cache_transfer.h). A cache the peer took whole (its length and CRC32C as sent) is dropped
// here and remembered as moved (CacheRegistry::MarkMoved: NOT_FOUND ending moved_to=PEER); one
// the peer refuses (its id taken there, its budget full, the peer unreachable) stays here, and
// with --cache-dir on disk, so nothing is lost.
#pragma once

#include <string>
#include <vector>

#include "server/caches.h"

namespace attn {

struct HandOverResult {
  int64_t moved = 0, kept = 0;
  std::vector<std::string> lines;  // One per cache kept (why), and a summary, for the log.
};

// Moves the caches to `target` (host:port, plaintext gRPC), sending `auth_token` as the bearer
// token when it is not empty. Each cache's import gets `seconds_per_cache` to finish.
HandOverResult HandOverCaches(CacheRegistry& caches, const std::string& target,
                              const std::string& auth_token, int seconds_per_cache = 600);

}  // namespace attn
