// CacheRegistry: the server-resident KV caches — their ids, owners, lengths, the memory budget
// they share, idle expiry, and the ordering of the calls on one cache. The backend owns each
// cache's memory (a KvStore); this registry owns what it means.
//
// - Ids are 128 random bits from the kernel's CSPRNG (getrandom), as 32 hex digits.
// - A cache belongs to the identity that created it; any other identity gets NOT_FOUND, the
//   same answer as for an id that never existed, and never the cache's data.
// - The pages of every cache together stay within `budget_bytes`: an append past it is
//   RESOURCE_EXHAUSTED naming --cache-bytes, and the cache keeps what it had.
// - At most `max_caches` caches live at once: one more is RESOURCE_EXHAUSTED naming --max-caches.
// - A cache unused for `idle_seconds` (0: never) is dropped; later calls naming it get NOT_FOUND
//   saying it expired.
// - Calls on one cache are ordered: a Lease holds the cache exclusively, so a reader never sees
//   half an append; different caches proceed in parallel. A deleted or expired cache's memory
//   is freed once the last lease on it ends.
// - A lease's appends are all or nothing: what Describe, List and the metrics report changes only
//   at Lease::Commit; a lease that ends without committing (an error, an exception unwinding it)
//   takes back everything it appended, so no client ever sees a length a failing call takes back.
// - A cache can be cut to a prefix of itself (TruncateCache, Decode's truncate_to): the tokens
//   past the cut are gone as if never appended. With a directory the cut is on disk (a cut
//   record, fsynced) before it is acknowledged, so a restart never brings cut tokens back.
// - One call may hold several caches (AcquireAll, a Decode batch): they are taken in id order,
//   so two calls naming the same caches cannot deadlock, and their appends are all or nothing
//   together (LeaseGroup).
// - With a directory (attnd --cache-dir) every cache is also a file there (server/cache_file.h),
//   written behind the memory by one thread at most `sync_seconds` late and fsynced; Restore
//   reads them back at start (ids, owners, layouts, the verified prefix of the tokens), Flush
//   writes everything at a clean shutdown. A deleted or expired cache's file is removed. An
//   append reserves its disk blocks before it changes anything, so a full disk refuses it
//   (RESOURCE_EXHAUSTED naming the directory) and memory stays a prefix-extension of the disk.
//   caches_disk.cc holds this part.
// - A cache can be forked (ForkCache): a new cache of the same owner whose tokens are a prefix
//   of the source's, sharing its pages (KvStore::Fork). Every page counts once in the budget,
//   however many caches hold it; a fork's page table (kForkTableBytesPerPage a page) counts too,
//   so that forks of a long cache cannot take the host's memory outside the budget. A fork's
//   file holds all its tokens and is fsynced before Fork returns; Restore shares the pages again
//   with its source (or a sibling forked from the same source) as far as their bytes agree.
// - Import builds a cache out of sight and shows it only once whole (ImportCache); a cache
//   handed to another server (MarkMoved) answers NOT_FOUND ending "moved_to=HOST:PORT".
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/kv_store.h"
#include "server/cache_file.h"

namespace attn {

struct CacheLimits {
  static constexpr int64_t kDefaultMaxCaches = 65536;  // attnd's --max-caches.

  int64_t budget_bytes = 0;                // Pages of all caches together (> 0).
  int64_t idle_seconds = 0;                // An unused cache lives this long; 0 = forever.
  int64_t max_caches = kDefaultMaxCaches;  // Caches alive at once (> 0).
  std::string dir = "";                    // --cache-dir; empty: caches live in memory only.
  int64_t sync_seconds = 1;                // --cache-sync-seconds: the disk's lag, at most.
};

// What a client sees of a cache (attention.v1.CacheInfo).
struct CacheDescription {
  std::string id;
  KvLayout layout;
  int64_t length = 0;
  int64_t bytes = 0;
  int64_t shared_bytes = 0;  // Of bytes, in pages another cache holds too (a fork's).
  int64_t page_tokens = 0;
  std::optional<int64_t> durable_length;  // Tokens on disk; only with a directory.
  std::optional<uint32_t> crc32c;         // Of the tokens (an import's answer only).
};

class CacheRegistry {
 public:
  struct Entry;  // One cache (server/caches_internal.h): opaque outside the registry's files.

  // The backend makes the stores and must outlive the registry.
  CacheRegistry(Backend& backend, CacheLimits limits);
  ~CacheRegistry();
  CacheRegistry(const CacheRegistry&) = delete;
  CacheRegistry& operator=(const CacheRegistry&) = delete;

  const CacheLimits& limits() const { return limits_; }

  // A new, empty cache owned by `owner`. RESOURCE_EXHAUSTED when the budget cannot hold its
  // first page or max_caches are alive; whatever the backend's CreateKvStore answers otherwise.
  absl::StatusOr<CacheDescription> Create(const std::string& owner, const KvLayout& layout);
  absl::StatusOr<CacheDescription> Describe(const std::string& owner, const std::string& id);
  absl::Status Delete(const std::string& owner, const std::string& id);
  std::vector<CacheDescription> List(const std::string& owner);

  // One call's exclusive hold on a cache, from Acquire until it is destroyed.
  class Lease {
   public:
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = delete;  // Would drop a held cache without releasing it.
    ~Lease();

    const KvLayout& layout() const;
    int64_t length() const;
    // The cache's pages (valid while the lease lives and no Append or Rollback follows).
    const PagedKv& pages() const;
    // Largest |key| and |value| element stored, for the score bounds of request validation.
    double max_abs_key() const;
    double max_abs_value() const;
    CacheDescription Describe() const;
    // Copies tokens [begin, end) out to dense host tensors (KvStore::CopyOut).
    absl::Status CopyOut(int64_t begin, int64_t end, void* key, void* value) const;

    // Appends n tokens (dense host tensors, any dtype) whose largest magnitudes are given,
    // within the registry's budget (RESOURCE_EXHAUSTED naming --cache-bytes). All or nothing.
    // Visible to this lease at once, to everyone else only after Commit.
    absl::Status Append(const TensorView& key, const TensorView& value, int64_t n,
                        double max_abs_key, double max_abs_value);
    // Cuts the cache to its first `length` tokens (0 ≤ length ≤ length(), the caller's check),
    // freeing the pages past it. Durable first: with a file the cut is written and fsynced
    // before the memory changes, so on an error nothing changed. Not undone by Rollback (the
    // cut is applied when this returns): TruncateCache's, and a restore's.
    absl::Status Truncate(int64_t length);
    // The same cut, undone by Rollback (Decode's truncate_to): only first in a lease (before
    // any Append; FAILED_PRECONDITION otherwise). It keeps a host copy of the tokens it drops,
    // (length() − length) · TokenBytes bytes, which the caller bounds, and their pages' budget
    // until Commit. PersistCut writes it to disk before Commit.
    absl::Status TruncateTentatively(int64_t length);
    // Makes a TruncateTentatively durable (a cut record written and fsynced when the file holds
    // tokens past it); no-op without one. On an error the call must Rollback.
    absl::Status PersistCut();
    // Cuts committed on this cache so far: an export checks it did not change under it.
    int64_t cuts() const;

    // Publishes this lease's appends and cut: the call that made them has succeeded.
    void Commit();
    // Takes back every token this lease appended since it began or last committed, and puts
    // back what TruncateTentatively dropped (a failed Decode): the cache is as it was. The
    // destructor does the same for uncommitted changes.
    void Rollback();

   private:
    friend class CacheRegistry;
    Lease(CacheRegistry* registry, std::shared_ptr<Entry> entry);

    CacheRegistry* registry_;
    std::shared_ptr<Entry> entry_;
    std::unique_lock<std::mutex> hold_;
    int64_t length_at_start_;
    double max_abs_key_at_start_, max_abs_value_at_start_;
    bool appended_ = false;  // Since the start or the last Commit.
    // TruncateTentatively's cut: the length cut to, the tokens it dropped (key then value,
    // dense, in the store's dtype) and whether PersistCut has written it.
    std::optional<int64_t> cut_to_;
    std::vector<char> cut_tokens_;
    bool cut_persisted_ = false;
    // After a cut with nothing appended: no token waits for the disk when none lies past it.
    static void CaughtUpAfterCut(Entry& entry);
  };

  // What a fork's page table costs the budget, per page it names.
  static constexpr int64_t kForkTableBytesPerPage = 64;

  // A fork of the cache `source` holds: a new cache of the same owner and layout whose tokens
  // are the source's first `length` (0 ≤ length ≤ source.length(), the caller's check), sharing
  // its pages. RESOURCE_EXHAUSTED at --max-caches, when its page table does not fit the budget,
  // or (with a directory) when the disk cannot hold its file, which is written and fsynced
  // before this returns.
  absl::StatusOr<CacheDescription> Fork(Lease& source, int64_t length);

  // Waits for the calls ahead on the cache, then holds it. NOT_FOUND (naming `field` and saying
  // whether the cache expired) for an unknown, deleted, expired or someone else's cache.
  absl::StatusOr<Lease> Acquire(const std::string& owner, const std::string& id,
                                const std::string& field);

  // Exclusive holds on several caches at once, from AcquireAll until it is destroyed: one lease
  // per id, in the order the ids were given.
  class LeaseGroup {
   public:
    LeaseGroup(LeaseGroup&&) = default;
    LeaseGroup& operator=(LeaseGroup&&) = delete;

    size_t size() const { return leases_.size(); }
    Lease& operator[](size_t i) { return leases_[i]; }
    const Lease& operator[](size_t i) const { return leases_[i]; }
    // Lease::Commit on every lease: the call that appended has succeeded.
    void Commit();
    // Lease::Rollback on every lease: every cache is as it was when acquired (or last
    // committed). Ending without Commit does the same, lease by lease.
    void Rollback();

   private:
    friend class CacheRegistry;
    explicit LeaseGroup(std::vector<Lease> leases) : leases_(std::move(leases)) {}
    std::vector<Lease> leases_;
  };

  // Acquire for every id (ids[i]'s errors name fields[i]; the two of one length), taking them in
  // id order so that two calls naming the same caches never wait for each other in a cycle. On
  // the first failure the leases already taken are released and its error returned. The ids
  // must be distinct (one call would wait for itself): INVALID_ARGUMENT naming the later one's
  // field otherwise.
  absl::StatusOr<LeaseGroup> AcquireAll(const std::string& owner,
                                        const std::vector<std::string>& ids,
                                        const std::vector<std::string>& fields);
  // The layout of a cache, without holding it (layouts never change): for the request checks
  // that run before a call is queued. NOT_FOUND as Acquire.
  absl::StatusOr<KvLayout> LayoutOf(const std::string& owner, const std::string& id,
                                    const std::string& field);

  // A cache built from another server's export (ImportCache): invisible until Finish.
  class Import {
   public:
    Import(Import&&) = default;
    Import& operator=(Import&&) = delete;
    ~Import();  // Without Finish: the tokens and their budget are given back.
    const KvLayout& layout() const;
    int64_t length() const;
    // Appends n tokens, dense in the cache's dtype ([kv_heads, n, head_dim] and
    // [kv_heads, n, value_dim]), within the budget (as Lease::Append). INVALID_ARGUMENT naming
    // `field` when one is not finite.
    absl::Status Append(const void* key, const void* value, int64_t n, const std::string& field);
    // Shows the cache: under the id asked for when it is free, else ALREADY_EXISTS or (with
    // new_id_if_taken) a new one; RESOURCE_EXHAUSTED at --max-caches or a full disk.
    absl::StatusOr<CacheDescription> Finish();

   private:
    friend class CacheRegistry;
    Import(CacheRegistry* registry, std::shared_ptr<Entry> entry, bool new_id_if_taken);
    CacheRegistry* registry_;
    std::shared_ptr<Entry> entry_;
    std::optional<Lease> lease_;
    bool new_id_if_taken_;
  };
  // An Import of a cache named `id` (32 lowercase hex digits, as this server draws them;
  // INVALID_ARGUMENT naming `field` otherwise) with `layout`, owned by `owner`.
  absl::StatusOr<Import> BeginImport(const std::string& owner, const std::string& id,
                                     const std::string& field, const KvLayout& layout,
                                     bool new_id_if_taken);

  // The cache now lives at `target` (attnd --drain-to): it is dropped here, and calls naming it
  // get NOT_FOUND ending "moved_to=<target>".
  void MarkMoved(const std::string& owner, const std::string& id, const std::string& target);
  // Every cache's (owner, id), oldest first: what a drain hands over.
  std::vector<std::pair<std::string, std::string>> AllCaches() const;

  // Persistence (caches_disk.cc). Restore takes the directory's lock (FAILED_PRECONDITION when
  // another attnd holds it) and reads its caches in; call it once, before the server serves. It
  // returns a line per cache restored or damaged (for the log), or the error that keeps the server
  // from starting (an unreadable directory, caches over the budget).
  bool persistent() const { return !limits_.dir.empty(); }
  absl::StatusOr<std::vector<std::string>> Restore();
  // Writes and fsyncs everything not yet on disk (the writer thread's pass, with every cache
  // waited for). At a clean shutdown, also gives back preallocated blocks.
  absl::Status Flush(bool shutdown = false);

  // For metrics: caches, tokens and bytes in use now; bytes on disk, the disk's lag behind the
  // memory (seconds since the oldest append not yet durable; 0 when none) and the wall-clock
  // time of the last flush (seconds since the epoch, 0 before the first).
  int64_t caches() const;
  int64_t tokens() const;
  int64_t bytes() const;
  int64_t disk_bytes() const;
  double disk_lag_seconds() const;
  double last_flush_seconds() const;

 private:
  // The owner's entry, or null with *status NOT_FOUND. With `lease`, counts a lease on it
  // under the registry's mutex, so the idle sweep can never drop it in between.
  std::shared_ptr<Entry> Find(const std::string& owner, const std::string& id,
                              const std::string& field, absl::Status* status, bool lease = false);
  void Sweep();  // The idle-expiry thread's loop.
  void Touch(Entry& entry);
  // The budget counts every live page once (reserved before an append allocates it, given back
  // by the store's OnPageFreed when the last holder frees it) and tentative cuts' holds.
  // Reserve: RESOURCE_EXHAUSTED naming --cache-bytes when `bytes` do not fit. Hold: bytes just
  // in use (a cut's pages), kept without the check.
  absl::Status Reserve(int64_t bytes);
  void Hold(int64_t bytes);
  void Release(int64_t bytes);
  // Adds a built entry under its id: RESOURCE_EXHAUSTED at --max-caches, ALREADY_EXISTS when
  // the id is taken.
  absl::Status Insert(std::shared_ptr<Entry> entry);
  // caches_disk.cc: the file of a new cache; the writer's loop and one pass of it.
  absl::Status CreateFile(Entry& entry);
  // Writes a cut of the entry's file to `length` tokens and fsyncs it (when the file holds more),
  // and counts the cut (Entry::cuts) so that the writer drops what it copied before it.
  absl::Status CutFile(Entry& entry, int64_t length);
  // Reserves the disk blocks for `tokens` tokens of the entry's file (a no-op without one);
  // RESOURCE_EXHAUSTED naming the directory when the disk is full or the writer is failing.
  absl::Status ReserveDisk(Entry& entry, int64_t tokens);
  // A new fork's file (not yet in the registry), all its tokens written and fsynced.
  absl::Status WriteFork(Entry& entry);
  void RemoveFile(Entry& entry);  // Under mutex_ (the id may be taken again once it is free).
  void SyncDir();                 // After RemoveFile, outside mutex_; no-op without a directory.
  // Appends tokens as they come from a file or an export (dense, the store's dtype), with their
  // maxima: INVALID_ARGUMENT naming `field` when one is not finite.
  static absl::Status AppendStored(Lease& lease, const void* key, const void* value, int64_t n,
                                   const std::string& field);
  void WriteBehind();
  absl::Status WritePass(bool wait_for_every_cache);

  Backend& backend_;
  const CacheLimits limits_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<Entry>> entries_;  // By id.
  std::deque<std::string> expired_order_;                  // Bounded memory of expired ids.
  std::map<std::string, std::string> expired_;             // Expired id → owner.
  std::map<std::string, std::pair<std::string, std::string>> moved_;  // id → (owner, target).
  std::set<std::string> importing_;  // Ids imports are finishing under (their files being made).
  int64_t reserved_bytes_ = 0;       // Live pages (each once) and holds.
  bool restoring_ = false;           // Restore is running: Reserve allows twice the budget.
  int64_t created_ = 0;              // For List's oldest-first order.
  bool stopping_ = false;
  std::condition_variable wake_;
  std::thread sweeper_;
  // Persistence: the writer thread and what the metrics read.
  std::unique_ptr<CacheDirLock> dir_lock_;  // Held from Restore on.
  std::mutex write_mutex_;                  // One pass at a time (the thread's, a Flush).
  std::thread writer_;
  std::atomic<int64_t> last_flush_ns_{0};
  std::atomic<bool> disk_failed_{false};
};

}  // namespace attn
