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
// - One call may hold several caches (AcquireAll, a Decode batch): they are taken in id order,
//   so two calls naming the same caches cannot deadlock, and their appends are all or nothing
//   together (LeaseGroup).
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/kv_store.h"

namespace attn {

struct CacheLimits {
  static constexpr int64_t kDefaultMaxCaches = 65536;  // attnd's --max-caches.

  int64_t budget_bytes = 0;                // Pages of all caches together (> 0).
  int64_t idle_seconds = 0;                // An unused cache lives this long; 0 = forever.
  int64_t max_caches = kDefaultMaxCaches;  // Caches alive at once (> 0).
};

// What a client sees of a cache (attention.v1.CacheInfo).
struct CacheDescription {
  std::string id;
  KvLayout layout;
  int64_t length = 0;
  int64_t bytes = 0;
  int64_t page_tokens = 0;
};

class CacheRegistry {
  struct Entry;

 public:
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
    // Copies the tokens out to dense host tensors (KvStore::CopyOut).
    absl::Status CopyOut(void* key, void* value) const;

    // Appends n tokens (dense host tensors, any dtype) whose largest magnitudes are given,
    // within the registry's budget (RESOURCE_EXHAUSTED naming --cache-bytes). All or nothing.
    // Visible to this lease at once, to everyone else only after Commit.
    absl::Status Append(const TensorView& key, const TensorView& value, int64_t n,
                        double max_abs_key, double max_abs_value);
    // Publishes this lease's appends: the call that made them has succeeded.
    void Commit();
    // Takes back every token this lease appended since it began or last committed (a failed
    // Decode): the cache is as it was. The destructor does the same for uncommitted appends.
    void Rollback();

   private:
    friend class CacheRegistry;
    Lease(CacheRegistry* registry, std::shared_ptr<Entry> entry);

    CacheRegistry* registry_;
    std::shared_ptr<Entry> entry_;
    std::unique_lock<std::mutex> hold_;
    int64_t length_at_start_;
    double max_abs_key_at_start_, max_abs_value_at_start_;
  };

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

  // For metrics: caches, tokens and bytes in use now.
  int64_t caches() const;
  int64_t tokens() const;
  int64_t bytes() const;

 private:
  // The owner's entry, or null with *status NOT_FOUND. With `lease`, counts a lease on it
  // under the registry's mutex, so the idle sweep can never drop it in between.
  std::shared_ptr<Entry> Find(const std::string& owner, const std::string& id,
                              const std::string& field, absl::Status* status, bool lease = false);
  void Sweep();  // The idle-expiry thread's loop.
  void Touch(Entry& entry);
  // Reserves `bytes` of the budget (RESOURCE_EXHAUSTED naming --cache-bytes when they do not
  // fit) or gives back -bytes.
  absl::Status Reserve(int64_t bytes);
  void Release(int64_t bytes);

  Backend& backend_;
  const CacheLimits limits_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<Entry>> entries_;  // By id.
  std::deque<std::string> expired_order_;                  // Bounded memory of expired ids.
  std::map<std::string, std::string> expired_;             // Expired id → owner.
  int64_t reserved_bytes_ = 0;                             // Pages of all live caches.
  int64_t created_ = 0;                                    // For List's oldest-first order.
  bool stopping_ = false;
  std::condition_variable wake_;
  std::thread sweeper_;
};

}  // namespace attn
