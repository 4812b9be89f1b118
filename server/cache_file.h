// CacheFile: one KV cache on disk (attnd --cache-dir), an append-only log the registry writes
// behind its memory (server/caches.h) and reads back at start.
//
// DIR/<cache id>.kv, little-endian:
//   header   "ATTNKV01", u32 body bytes, body, u32 CRC32C of everything before it. The body:
//            u32 format version (1), i64 kv_heads, head_dim, value_dim, u32 dtype (the wire's
//            attention.v1.DType number), i64 created (ns since the epoch: List's order),
//            u32 + bytes owner, u32 + bytes id. Version 2, for latent caches and forks only
//            (other caches keep version 1, which an older attnd reads): then u32 flags, bit 0
//            values_from_keys, bit 1 a fork, then u32 + bytes twice: the id it was forked from
//            and its family's root (the cache no fork made that it descends from). A fork's
//            file holds all its tokens (files share nothing); the ids let a restart share its
//            pages again.
//   records  one per write: u32 "KVRC", u32 kind (1: tokens), i64 start, i64 n, u64 payload
//            bytes, u32 CRC32C of the payload, u32 CRC32C of the 36 bytes before it; then the
//            payload: key [kv_heads, n, head_dim] then value [kv_heads, n, value_dim] (none in
//            a latent cache) in the stored dtype, bit for bit as the cache holds them. A record's
//            start is the tokens of the records before it. kind 2 (a cut, TruncateCache): start =
//            the tokens kept (≤ the tokens before it), n = 0, no payload (its CRC32C 0); the next
//            record's start follows the cut.
// A file appears whole: its header is written to <id>.kv.tmp, synced, and renamed.
//
// Reading (Open) keeps the longest prefix of records that verify: the first record whose
// header or payload checksum fails, whose start does not follow, or that the file ends inside
// ends the cache there; the file is cut back to that point (so later records follow on) and
// the report says what was dropped. A header that does not verify refuses the whole file.
//
// Full disks: Reserve allocates the blocks for what the registry will write (fallocate, the
// file's size unchanged) when it accepts an append, so a full disk (ENOSPC, EDQUOT, or EFBIG
// under a file-size limit) is an append refused with RESOURCE_EXHAUSTED naming the directory,
// not a write that fails later. A write that fails all the same is cut back off the file.
//
// Not thread-safe, except that Reserve may run beside Write (the registry calls Reserve under
// the cache's lease, Write from its writer thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kv_store.h"

namespace attn {

// What a cache file says about its cache, besides its tokens.
struct CacheFileHeader {
  std::string id, owner;
  KvLayout layout;
  int64_t created_ns = 0;
  // A fork's source (ForkCache) and the root of its family (the first cache, which no fork
  // made); both empty for a cache that is not a fork.
  std::string parent, root;
};

class CacheFile {
 public:
  // The records a file may hold: their payload is at most this (a record of more tokens is
  // written as several).
  static constexpr int64_t kMaxRecordPayload = int64_t{4} << 20;
  static constexpr int64_t kRecordHeaderBytes = 40;

  // DIR/<id>.kv for a new cache, holding its header. An existing file of that name is replaced.
  static absl::StatusOr<std::unique_ptr<CacheFile>> Create(const std::string& dir,
                                                           const CacheFileHeader& header);

  // What Open found.
  struct Report {
    int64_t tokens = 0;         // Tokens kept.
    int64_t dropped_bytes = 0;  // Bytes cut off the end of the file (0: it was whole).
    std::string why_dropped;    // Why the first dropped record was refused.
  };
  // Reads the file at `path`: the header into *header, then each verified record's tokens to
  // `tokens` (start, n, key, value; the pointers valid during the call). A `tokens` error stops
  // the read and is returned. The file is then cut back to its verified prefix and open for
  // writing after it. FAILED_PRECONDITION (DATA_LOSS for damage) naming the file when the header
  // does not verify.
  // A cut record calls `cut` with the tokens kept.
  using TokenSink =
      std::function<absl::Status(int64_t start, int64_t n, const void* key, const void* value)>;
  using CutSink = std::function<absl::Status(int64_t length)>;
  static absl::StatusOr<std::unique_ptr<CacheFile>> Open(const std::string& path,
                                                         CacheFileHeader* header,
                                                         const TokenSink& tokens,
                                                         const CutSink& cut, Report* report);
  // The header alone (as Open reads it, with its errors), the file left as it is.
  static absl::Status ReadHeader(const std::string& path, CacheFileHeader* header);

  ~CacheFile();
  CacheFile(const CacheFile&) = delete;
  CacheFile& operator=(const CacheFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }  // Bytes written (records verified or written).
  int64_t tokens() const { return tokens_; }
  int64_t reserved() const { return reserved_; }  // Bytes Reserve has allocated so far.

  // An upper bound on the file's size holding `tokens` tokens however they were written: what
  // the file holds up to its last cut (the header when it has none), then per token after it
  // its payload and a record header.
  int64_t BoundFor(int64_t tokens) const;
  // Allocates the disk blocks for a file of `bytes` (no-op where already allocated, or where
  // the file system cannot preallocate). RESOURCE_EXHAUSTED naming the directory when the disk
  // is full.
  absl::Status Reserve(int64_t bytes);
  // Tokens one record holds at most: as many as fit kMaxRecordPayload, at least one.
  int64_t TokensPerRecord() const;
  // Appends tokens [tokens(), tokens() + n) as one record (n ≤ TokensPerRecord(); key and value
  // dense, as KvStore::CopyOut gives them). On an error nothing of it stays in the file.
  absl::Status Write(int64_t n, const void* key, const void* value);
  // Appends a cut record: the file then holds its first `length` tokens (length ≤ tokens()).
  // On an error nothing of it stays in the file.
  absl::Status Cut(int64_t length);
  // Makes everything written durable (fdatasync).
  absl::Status Sync();
  // Gives back blocks Reserve allocated past the end (a clean shutdown).
  void Trim();
  // Removes the file (a deleted or expired cache); SyncCacheDir makes that durable. The object
  // stays usable and writes nowhere.
  void Remove();

 private:
  CacheFile(std::string path, int fd, const KvLayout& layout, int64_t header_bytes);
  absl::Status Failed(const std::string& what, int error) const;

  std::string path_, dir_;
  int fd_;
  KvLayout layout_;
  int64_t header_bytes_;
  int64_t size_ = 0;
  int64_t tokens_ = 0;
  // Where the last cut left the file (its size and tokens; the header and 0 before any):
  // BoundFor counts from there.
  int64_t cut_bytes_ = 0;
  int64_t cut_tokens_ = 0;
  int64_t reserved_ = 0;
  bool removed_ = false;
};

// fsyncs the directory, so that a file removed from it stays removed after a power loss.
void SyncCacheDir(const std::string& dir);

// Holds DIR/attnd.lock (flock) while it lives, so that two servers never write one directory.
class CacheDirLock {
 public:
  // FAILED_PRECONDITION naming the directory and the holder's pid when another process holds
  // it; INTERNAL when the lock file cannot be made.
  static absl::StatusOr<std::unique_ptr<CacheDirLock>> Take(const std::string& dir);
  ~CacheDirLock();
  CacheDirLock(const CacheDirLock&) = delete;
  CacheDirLock& operator=(const CacheDirLock&) = delete;

 private:
  explicit CacheDirLock(int fd) : fd_(fd) {}
  int fd_;
};

// The cache files in `dir` (DIR/*.kv), sorted; removes leftover DIR/*.kv.tmp (a crash during
// a Create). INTERNAL naming the directory when it cannot be read.
absl::StatusOr<std::vector<std::string>> ListCacheFiles(const std::string& dir);

}  // namespace attn
