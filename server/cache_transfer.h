// A cache as a stream of attention.v1.CacheChunk messages and back: ExportCache's and
// ImportCache's handlers (service_caches.cc) and the drain's hand-over (server/handover.h) use
// these, so the chunking, the checks and the checksum live in one place.
//
// CacheExporter: the first chunk carries the cache's info (its length when the export began);
// then consecutive tokens, each chunk's key and value data together at most kChunkBytes (one
// token at least), in the stored dtype; the last chunk carries the CRC32C of every chunk's key
// data then value data. Each chunk takes the cache's lease only to copy its tokens, so a slow
// reader never holds up the cache's appends; tokens below the length never change (appends
// only add).
//
// CacheImporter: checks each chunk against the first one's layout and the tokens so far, adds
// the tokens to an invisible cache (CacheRegistry::Import), and on Finish checks the count and
// the CRC32C before the cache appears. Every refusal names the chunk and field.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "server/caches.h"

namespace attn {

class CacheExporter {
 public:
  // Key and value data of one chunk together, at most: 4 MiB less room for the message's
  // framing, so a chunk fits gRPC's default 4 MiB receive limit.
  static constexpr int64_t kChunkBytes = (int64_t{4} << 20) - (int64_t{16} << 10);

  // NOT_FOUND as CacheRegistry::Acquire, naming `field`.
  static absl::StatusOr<CacheExporter> Start(CacheRegistry& caches, const std::string& owner,
                                             const std::string& id, const std::string& field);

  // The next chunk into *chunk (cleared first); false once the last has been given. NOT_FOUND
  // when the cache went away during the export, ABORTED when it was cut (its tokens may differ
  // from the ones already sent).
  absl::StatusOr<bool> Next(attention::v1::CacheChunk* chunk);

  int64_t length() const { return info_.length; }
  const std::string& id() const { return info_.id; }
  // CRC32C of the tokens given so far (all of them once Next has returned false).
  uint32_t crc32c() const { return crc_; }

 private:
  CacheExporter(CacheRegistry& caches, std::string owner, std::string field, CacheDescription info,
                int64_t cuts)
      : caches_(&caches),
        owner_(std::move(owner)),
        field_(std::move(field)),
        info_(info),
        cuts_(cuts) {}

  CacheRegistry* caches_;
  std::string owner_, field_;
  CacheDescription info_;
  int64_t cuts_ = 0;  // The cache's cuts at the start (Lease::cuts): one more aborts the export.
  int64_t sent_ = 0;  // Tokens sent.
  bool info_sent_ = false, done_ = false;
  uint32_t crc_ = 0;
};

class CacheImporter {
 public:
  CacheImporter(CacheRegistry& caches, std::string owner)
      : caches_(&caches), owner_(std::move(owner)) {}

  // Chunk `index` (0 first) of the stream. INVALID_ARGUMENT naming the field for a chunk that
  // does not fit; the first chunk's errors as CacheRegistry::BeginImport's.
  absl::Status Add(const attention::v1::CacheChunk& chunk, int64_t index);
  // The stream has ended: DATA_LOSS when tokens are missing or the CRC32C does not match;
  // otherwise the cache appears (Import::Finish) and its description, with crc32c, returns.
  absl::StatusOr<CacheDescription> Finish();

 private:
  CacheRegistry* caches_;
  std::string owner_;
  std::optional<CacheRegistry::Import> import_;
  int64_t expected_length_ = 0;
  std::optional<uint32_t> sent_crc_;
  uint32_t crc_ = 0;
};

}  // namespace attn
