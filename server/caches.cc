#include "server/caches.h"

#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/caches_internal.h"
#include "server/value_scan.h"

namespace attn {
namespace {

using caches_internal::IsCacheId;
using caches_internal::SteadyNs;
using caches_internal::WallNs;

constexpr size_t kRememberedExpired = 1 << 16;  // Expired ids kept for their NOT_FOUND message.

// 128 bits from the kernel's CSPRNG as 32 lowercase hex digits.
absl::StatusOr<std::string> NewId() {
  unsigned char bits[16];
  size_t got = 0;
  while (got < sizeof bits) {
    const ssize_t n = getrandom(bits + got, sizeof bits - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError("getrandom failed: no cache id could be drawn");
    }
    got += static_cast<size_t>(n);
  }
  std::string id;
  for (unsigned char byte : bits) absl::StrAppendFormat(&id, "%02x", byte);
  return id;
}

absl::Status TooMany(size_t caches, int64_t max_caches) {
  return absl::ResourceExhaustedError(absl::StrCat("this server holds ", caches,
                                                   " caches, its --max-caches=", max_caches,
                                                   "; delete caches you no longer need"));
}

absl::Status Taken(const std::string& field, const std::string& id) {
  return absl::AlreadyExistsError(
      absl::StrCat(field, field.empty() ? "" : ": ", "cache ", id,
                   " already exists on this server; import with a new "
                   "id (CacheChunk.new_id_if_taken) or delete it first"));
}

}  // namespace

namespace {

// Past this an idle limit is "never" in all but name; capping it keeps the sweep's nanosecond
// arithmetic within int64.
constexpr int64_t kMaxIdleSeconds = int64_t{1} << 31;

CacheLimits Capped(CacheLimits limits) {
  limits.idle_seconds = std::clamp<int64_t>(limits.idle_seconds, 0, kMaxIdleSeconds);
  return limits;
}

}  // namespace

CacheRegistry::CacheRegistry(Backend& backend, CacheLimits limits)
    : backend_(backend), limits_(Capped(limits)) {
  if (limits_.idle_seconds > 0) sweeper_ = std::thread([this] { Sweep(); });
  if (persistent()) writer_ = std::thread([this] { WriteBehind(); });
}

CacheRegistry::~CacheRegistry() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
  if (writer_.joinable()) writer_.join();
  if (persistent()) {
    if (absl::Status flushed = Flush(/*shutdown=*/true); !flushed.ok()) {
      std::fprintf(stderr, "attnd: caches not all on disk at exit: %s\n",
                   std::string(flushed.message()).c_str());
    }
  }
  std::map<std::string, std::shared_ptr<Entry>> entries;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entries.swap(entries_);
  }
  entries.clear();  // Entries release into the registry: outside its mutex.
}

absl::Status CacheRegistry::Reserve(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A restore replays each file's history (a cut record follows the tokens it drops), so it may
  // pass the budget on the way, by one budget at most; Restore checks where it ends.
  const int64_t budget = restoring_ ? 2 * limits_.budget_bytes : limits_.budget_bytes;
  if (bytes > budget - reserved_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the caches would need ", reserved_bytes_ + bytes, " bytes, over this server's ",
        "--cache-bytes=", limits_.budget_bytes, " (", reserved_bytes_,
        " in use); delete caches you no longer need, or ask for fewer tokens"));
  }
  reserved_bytes_ += bytes;
  return absl::OkStatus();
}

void CacheRegistry::Hold(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_bytes_ += bytes;
}

void CacheRegistry::Release(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_bytes_ -= bytes;
}

absl::StatusOr<CacheDescription> CacheRegistry::Create(const std::string& owner,
                                                       const KvLayout& layout) {
  absl::StatusOr<std::unique_ptr<KvStore>> store = backend_.CreateKvStore(layout);
  if (!store.ok()) return store.status();
  const int64_t first_page = (*store)->BytesFor(1);
  absl::StatusOr<std::string> id = NewId();
  if (!id.ok()) return id.status();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (first_page > limits_.budget_bytes - reserved_bytes_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a cache's first page takes ", first_page,
          " bytes and this server's --cache-bytes=", limits_.budget_bytes, " has ",
          limits_.budget_bytes - reserved_bytes_, " left; delete caches you no longer need"));
    }
  }
  auto entry =
      std::make_shared<Entry>(*this, *id, owner, 0, WallNs(), *std::move(store), SteadyNs());
  if (persistent()) {
    if (absl::Status file = CreateFile(*entry); !file.ok()) return file;
  }
  if (absl::Status inserted = Insert(entry); !inserted.ok()) {
    if (entry->file != nullptr) entry->file->Remove();
    return inserted;
  }
  CacheDescription description;
  description.id = entry->id;
  description.layout = layout;
  description.page_tokens = entry->store->page_tokens();
  if (persistent()) description.durable_length = 0;
  return description;
}

absl::Status CacheRegistry::Insert(std::shared_ptr<Entry> entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (static_cast<int64_t>(entries_.size()) >= limits_.max_caches) {
    return TooMany(entries_.size(), limits_.max_caches);
  }
  if (entries_.count(entry->id) != 0) return Taken("", entry->id);
  entry->serial = created_++;
  moved_.erase(entry->id);
  entries_.emplace(entry->id, std::move(entry));
  return absl::OkStatus();
}

std::shared_ptr<CacheRegistry::Entry> CacheRegistry::Find(const std::string& owner,
                                                          const std::string& id,
                                                          const std::string& field,
                                                          absl::Status* status, bool lease) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto found = entries_.find(id);
  if (found != entries_.end() && found->second->owner == owner) {
    if (lease) found->second->leases.fetch_add(1);  // A cache someone waits for is not idle.
    return found->second;
  }
  const auto moved = moved_.find(id);
  if (moved != moved_.end() && moved->second.first == owner) {
    *status = absl::NotFoundError(absl::StrCat(field, ": cache ", id,
                                               " was handed to another server while this one "
                                               "drained; moved_to=",
                                               moved->second.second));
    return nullptr;
  }
  const auto expired = expired_.find(id);
  if (expired != expired_.end() && expired->second == owner) {
    *status = absl::NotFoundError(absl::StrCat(field, ": cache ", id, " expired after ",
                                               limits_.idle_seconds,
                                               " s unused (--cache-idle-seconds); create a new "
                                               "one and append its tokens again"));
  } else {
    *status = absl::NotFoundError(absl::StrCat(
        field, ": no cache \"", id.substr(0, 64),
        "\" (unknown, deleted, or lost in a restart of a server without --cache-dir)"));
  }
  return nullptr;
}

void CacheRegistry::Touch(Entry& entry) { entry.last_used_ns.store(SteadyNs()); }

namespace {

// Reads the entry's shared bytes afresh when no call holds it (what another cache's fork or
// delete changed shows at once); while one does, they stay as its last change left them.
void RefreshShared(CacheRegistry::Entry& entry) {
  std::unique_lock<std::mutex> hold(entry.mutex, std::try_to_lock);
  if (hold.owns_lock()) entry.shared_bytes.store(entry.store->shared_bytes());
}

CacheDescription DescriptionOf(const CacheRegistry::Entry& entry, int64_t length, int64_t bytes,
                               bool persistent) {
  CacheDescription description;
  description.id = entry.id;
  description.layout = entry.store->layout();
  description.length = length;
  description.bytes = bytes;
  description.shared_bytes = std::min(bytes, entry.shared_bytes.load());
  description.page_tokens = entry.store->page_tokens();
  if (persistent) description.durable_length = std::min(length, entry.durable.load());
  return description;
}

}  // namespace

absl::StatusOr<CacheDescription> CacheRegistry::Describe(const std::string& owner,
                                                         const std::string& id) {
  absl::Status status;
  std::shared_ptr<Entry> entry = Find(owner, id, "cache_id", &status);
  if (entry == nullptr) return status;
  Touch(*entry);
  RefreshShared(*entry);
  return DescriptionOf(*entry, entry->length.load(), entry->bytes.load(), persistent());
}

absl::Status CacheRegistry::Delete(const std::string& owner, const std::string& id) {
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = entries_.find(id);
    if (found != entries_.end() && found->second->owner == owner) {
      entry = std::move(found->second);
      entries_.erase(found);
      RemoveFile(*entry);  // Under the mutex: an import may take the id as soon as it is free.
    }
  }
  if (entry == nullptr) {
    absl::Status status;
    Find(owner, id, "cache_id", &status);
    return status;
  }
  SyncDir();
  return absl::OkStatus();  // The memory goes when the last lease on it ends (entry's release).
}

std::vector<CacheDescription> CacheRegistry::List(const std::string& owner) {
  std::vector<std::shared_ptr<Entry>> mine;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, entry] : entries_) {
      if (entry->owner == owner) mine.push_back(entry);
    }
  }
  std::sort(mine.begin(), mine.end(),
            [](const auto& a, const auto& b) { return a->serial < b->serial; });
  std::vector<CacheDescription> descriptions;
  for (const auto& entry : mine) {
    RefreshShared(*entry);
    descriptions.push_back(
        DescriptionOf(*entry, entry->length.load(), entry->bytes.load(), persistent()));
  }
  return descriptions;
}

absl::StatusOr<KvLayout> CacheRegistry::LayoutOf(const std::string& owner, const std::string& id,
                                                 const std::string& field) {
  absl::Status status;
  std::shared_ptr<Entry> entry = Find(owner, id, field, &status);
  if (entry == nullptr) return status;
  return entry->store->layout();
}

absl::StatusOr<CacheDescription> CacheRegistry::Fork(Lease& source, int64_t length) {
  Entry& from = *source.entry_;
  const int64_t page_tokens = from.store->page_tokens();
  const int64_t table = (length + page_tokens - 1) / page_tokens * kForkTableBytesPerPage;
  {
    std::lock_guard<std::mutex> lock(mutex_);  // Before the work: Insert checks again.
    if (static_cast<int64_t>(entries_.size()) >= limits_.max_caches) {
      return TooMany(entries_.size(), limits_.max_caches);
    }
  }
  absl::StatusOr<std::string> id = NewId();
  if (!id.ok()) return id.status();
  if (absl::Status reserved = Reserve(table); !reserved.ok()) return reserved;
  absl::StatusOr<std::unique_ptr<KvStore>> store = from.store->Fork(length);
  if (!store.ok()) {
    Release(table);
    return store.status();
  }
  auto entry = std::make_shared<Entry>(*this, *id, from.owner, 0, WallNs(), *std::move(store),
                                       SteadyNs(), /*forked=*/true);
  entry->table_bytes = table;  // Given back when the entry goes.
  entry->parent = from.id;
  entry->root = from.root.empty() ? from.id : from.root;
  // The source's maxima bound the fork's (its tokens are a prefix): the score bounds stay safe.
  entry->max_abs_key = from.max_abs_key;
  entry->max_abs_value = from.max_abs_value;
  entry->length.store(length);
  entry->bytes.store(entry->store->bytes());
  if (persistent()) {
    if (absl::Status file = WriteFork(*entry); !file.ok()) {
      RemoveFile(*entry);
      return file;
    }
  }
  entry->shared_bytes.store(entry->store->shared_bytes());  // Before others can hold it.
  if (absl::Status inserted = Insert(entry); !inserted.ok()) {
    RemoveFile(*entry);
    return inserted;
  }
  from.shared_bytes.store(from.store->shared_bytes());
  return DescriptionOf(*entry, length, entry->bytes.load(), persistent());
}

absl::StatusOr<CacheRegistry::Lease> CacheRegistry::Acquire(const std::string& owner,
                                                            const std::string& id,
                                                            const std::string& field) {
  absl::Status status;
  std::shared_ptr<Entry> entry = Find(owner, id, field, &status, /*lease=*/true);
  if (entry == nullptr) return status;
  return Lease(this, std::move(entry));
}

absl::StatusOr<CacheRegistry::LeaseGroup> CacheRegistry::AcquireAll(
    const std::string& owner, const std::vector<std::string>& ids,
    const std::vector<std::string>& fields) {
  std::vector<size_t> order(ids.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ids[a] < ids[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    if (ids[order[i]] == ids[order[i - 1]]) {
      return absl::InvalidArgumentError(
          absl::StrCat(fields[std::max(order[i], order[i - 1])],
                       ": names a cache this call already holds; one call takes each cache once"));
    }
  }
  std::vector<std::optional<Lease>> held(ids.size());
  for (size_t i : order) {
    absl::StatusOr<Lease> lease = Acquire(owner, ids[i], fields[i]);
    if (!lease.ok()) return lease.status();  // `held` releases the ones taken.
    held[i].emplace(*std::move(lease));
  }
  std::vector<Lease> leases;
  leases.reserve(held.size());
  for (std::optional<Lease>& lease : held) leases.push_back(*std::move(lease));
  return LeaseGroup(std::move(leases));
}

void CacheRegistry::LeaseGroup::Commit() {
  for (Lease& lease : leases_) lease.Commit();
}

void CacheRegistry::LeaseGroup::Rollback() {
  for (Lease& lease : leases_) lease.Rollback();
}

CacheRegistry::Lease::Lease(CacheRegistry* registry, std::shared_ptr<Entry> entry)
    : registry_(registry), entry_(std::move(entry)) {
  hold_ = std::unique_lock<std::mutex>(entry_->mutex);  // Find counted the lease already.
  length_at_start_ = entry_->store->length();
  max_abs_key_at_start_ = entry_->max_abs_key;
  max_abs_value_at_start_ = entry_->max_abs_value;
  registry_->Touch(*entry_);
}

CacheRegistry::Lease::~Lease() {
  if (entry_ == nullptr) return;  // Moved from.
  Rollback();  // Appends never committed: the call that made them failed or threw.
  registry_->Touch(*entry_);
  hold_.unlock();
  entry_->leases.fetch_sub(1);
}

const KvLayout& CacheRegistry::Lease::layout() const { return entry_->store->layout(); }
int64_t CacheRegistry::Lease::length() const { return entry_->store->length(); }
const PagedKv& CacheRegistry::Lease::pages() const { return entry_->store->pages(); }
double CacheRegistry::Lease::max_abs_key() const { return entry_->max_abs_key; }
double CacheRegistry::Lease::max_abs_value() const { return entry_->max_abs_value; }

CacheDescription CacheRegistry::Lease::Describe() const {
  entry_->shared_bytes.store(entry_->store->shared_bytes());
  return DescriptionOf(*entry_, entry_->store->length(), entry_->store->bytes(),
                       registry_->persistent());
}

absl::Status CacheRegistry::Lease::CopyOut(int64_t begin, int64_t end, void* key,
                                           void* value) const {
  return entry_->store->CopyOut(begin, end, key, value);
}

absl::Status CacheRegistry::Lease::Append(const TensorView& key, const TensorView& value, int64_t n,
                                          double max_abs_key, double max_abs_value) {
  Entry& entry = *entry_;
  KvStore& store = *entry.store;
  if (absl::Status disk = registry_->ReserveDisk(entry, store.length() + n); !disk.ok()) {
    return disk;
  }
  // The pages it allocates (a copy of a shared last page included): theirs from now on, given
  // back when they are freed.
  const int64_t more = store.BytesToAppend(n);
  if (absl::Status reserved = registry_->Reserve(more); !reserved.ok()) return reserved;
  if (absl::Status appended = store.Append(key, value, n); !appended.ok()) {
    registry_->Release(more);
    return appended;
  }
  entry.max_abs_key = std::max(entry.max_abs_key, max_abs_key);
  entry.max_abs_value = std::max(entry.max_abs_value, max_abs_value);
  appended_ = true;
  return absl::OkStatus();
}

absl::Status CacheRegistry::Lease::Truncate(int64_t length) {
  Entry& entry = *entry_;
  if (cut_to_.has_value()) {
    return absl::FailedPreconditionError("a lease cuts its cache once");
  }
  if (length == entry.store->length()) return absl::OkStatus();  // Nothing to cut.
  if (absl::Status on_disk = registry_->CutFile(entry, length); !on_disk.ok()) return on_disk;
  entry.store->Truncate(length);  // Its freed pages go back to the budget.
  length_at_start_ = std::min(length_at_start_, length);
  if (!appended_) CaughtUpAfterCut(entry);
  return absl::OkStatus();
}

void CacheRegistry::Lease::CaughtUpAfterCut(Entry& entry) {
  // The writer only visits caches longer than their disk: a cut that leaves nothing to write
  // must end the wait itself, or the disk-lag gauge would grow for ever.
  if (entry.file != nullptr && entry.store->length() <= entry.durable.load()) {
    entry.dirty_since_ns.store(0);
  }
}

absl::Status CacheRegistry::Lease::TruncateTentatively(int64_t length) {
  Entry& entry = *entry_;
  KvStore& store = *entry.store;
  if (cut_to_.has_value() || appended_ || store.length() != length_at_start_) {
    return absl::FailedPreconditionError("a tentative cut comes first in its lease, and once");
  }
  const KvLayout& layout = store.layout();
  const int64_t n = store.length() - length;
  if (n == 0) return absl::OkStatus();  // Nothing to cut.
  const int64_t key_bytes = KeyBytes(layout, n);
  cut_tokens_.resize(n * TokenBytes(layout));  // Bounded by the caller. The stored bytes only.
  if (absl::Status copied =
          store.CopyOut(length, store.length(), cut_tokens_.data(),
                        layout.values_from_keys ? nullptr : cut_tokens_.data() + key_bytes);
      !copied.ok()) {
    cut_tokens_.clear();
    return copied;
  }
  // The budget of the pages it drops stays held until Commit (Rollback puts them back).
  entry.held_bytes = store.bytes() - store.BytesFor(length);
  registry_->Hold(entry.held_bytes);
  store.Truncate(length);
  cut_to_ = length;
  cut_persisted_ = false;
  return absl::OkStatus();
}

absl::Status CacheRegistry::Lease::PersistCut() {
  if (!cut_to_.has_value() || cut_persisted_) return absl::OkStatus();
  if (absl::Status on_disk = registry_->CutFile(*entry_, *cut_to_); !on_disk.ok()) return on_disk;
  cut_persisted_ = true;
  return absl::OkStatus();
}

int64_t CacheRegistry::Lease::cuts() const { return entry_->cuts.load(); }

void CacheRegistry::Lease::Commit() {
  Entry& entry = *entry_;
  if (cut_to_.has_value()) {
    // The callers persist first (their errors roll back); this is the last line of defence.
    if (absl::Status persisted = PersistCut(); !persisted.ok()) {
      std::fprintf(stderr, "attnd: cache %s: a cut committed without reaching the disk: %s\n",
                   entry.id.c_str(), std::string(persisted.message()).c_str());
    }
    registry_->Release(entry.held_bytes);
    entry.held_bytes = 0;
    cut_to_.reset();
    cut_tokens_ = std::vector<char>();
    if (!appended_) CaughtUpAfterCut(entry);
  }
  if (appended_ && entry.file != nullptr) {
    int64_t clean = 0;
    entry.dirty_since_ns.compare_exchange_strong(clean, SteadyNs());
  }
  appended_ = false;
  length_at_start_ = entry.store->length();
  max_abs_key_at_start_ = entry.max_abs_key;
  max_abs_value_at_start_ = entry.max_abs_value;
  entry.length.store(entry.store->length());
  entry.bytes.store(entry.store->bytes());
  entry.shared_bytes.store(entry.store->shared_bytes());
}

void CacheRegistry::Lease::Rollback() {
  Entry& entry = *entry_;
  KvStore& store = *entry.store;
  appended_ = false;
  if (cut_to_.has_value()) {
    // The tokens appended after the cut go, the ones it dropped come back (their pages' budget
    // was kept). A cut already on disk is followed by the writer rewriting them.
    store.Truncate(*cut_to_);
    const KvLayout& layout = store.layout();
    const int64_t n = length_at_start_ - *cut_to_;
    const int64_t key_bytes = KeyBytes(layout, n);
    // The pages come back under the cut's hold (more only if a shared page must be copied).
    const int64_t more = store.BytesToAppend(n);
    if (more > entry.held_bytes) registry_->Hold(more - entry.held_bytes);
    registry_->Release(entry.held_bytes - std::min(more, entry.held_bytes));
    entry.held_bytes = 0;
    absl::Status restored =
        store.Append(TensorView{cut_tokens_.data(), layout.dtype},
                     TensorView{cut_tokens_.data() + key_bytes, layout.dtype}, n);
    if (!restored.ok()) registry_->Release(more);
    if (!restored.ok()) {
      // Out of memory for pages just freed: the cache stays its (correct) prefix, and says so.
      std::fprintf(stderr, "attnd: cache %s: cannot put back %lld tokens after a failed cut: %s\n",
                   entry.id.c_str(), static_cast<long long>(n),
                   std::string(restored.message()).c_str());
      length_at_start_ = store.length();
      entry.length.store(store.length());
      entry.bytes.store(store.bytes());
    } else if (cut_persisted_) {
      int64_t clean = 0;
      entry.dirty_since_ns.compare_exchange_strong(clean, SteadyNs());
    }
    cut_to_.reset();
    cut_tokens_ = std::vector<char>();
  }
  if (store.length() != length_at_start_) store.Truncate(length_at_start_);  // Frees its pages.
  entry.max_abs_key = max_abs_key_at_start_;
  entry.max_abs_value = max_abs_value_at_start_;
}

void CacheRegistry::Sweep() {
  const auto period =
      std::chrono::milliseconds(std::min<int64_t>(1000, limits_.idle_seconds * 250));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, period);
    if (stopping_) break;
    const int64_t cutoff = SteadyNs() - limits_.idle_seconds * 1'000'000'000;
    std::vector<std::shared_ptr<Entry>> dropped;  // Destroyed outside the mutex.
    for (auto it = entries_.begin(); it != entries_.end();) {
      Entry& entry = *it->second;
      if (entry.leases.load() == 0 && entry.last_used_ns.load() < cutoff) {
        expired_[it->first] = entry.owner;
        expired_order_.push_back(it->first);
        if (expired_order_.size() > kRememberedExpired) {
          expired_.erase(expired_order_.front());
          expired_order_.pop_front();
        }
        RemoveFile(entry);
        dropped.push_back(std::move(it->second));
        it = entries_.erase(it);
      } else {
        ++it;
      }
    }
    lock.unlock();
    if (!dropped.empty()) SyncDir();
    dropped.clear();
    lock.lock();
  }
}

absl::StatusOr<CacheRegistry::Import> CacheRegistry::BeginImport(const std::string& owner,
                                                                 const std::string& id,
                                                                 const std::string& field,
                                                                 const KvLayout& layout,
                                                                 bool new_id_if_taken) {
  if (!IsCacheId(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": \"", id.substr(0, 64),
                     "\" is not a cache id (32 lowercase hex digits, as ExportCache sends)"));
  }
  absl::StatusOr<std::unique_ptr<KvStore>> store = backend_.CreateKvStore(layout);
  if (!store.ok()) return store.status();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (static_cast<int64_t>(entries_.size()) >= limits_.max_caches) {
      return TooMany(entries_.size(), limits_.max_caches);
    }
    if (!new_id_if_taken && (entries_.count(id) != 0 || importing_.count(id) != 0)) {
      return Taken(field, id);
    }
  }
  auto entry =
      std::make_shared<Entry>(*this, id, owner, 0, WallNs(), *std::move(store), SteadyNs());
  return Import(this, std::move(entry), new_id_if_taken);
}

CacheRegistry::Import::Import(CacheRegistry* registry, std::shared_ptr<Entry> entry,
                              bool new_id_if_taken)
    : registry_(registry), entry_(std::move(entry)), new_id_if_taken_(new_id_if_taken) {
  entry_->leases.fetch_add(1);  // The Lease's, given back when it ends.
  lease_.emplace(Lease(registry_, entry_));
}

CacheRegistry::Import::~Import() = default;  // The lease rolls back what was not finished.

const KvLayout& CacheRegistry::Import::layout() const { return lease_->layout(); }
int64_t CacheRegistry::Import::length() const { return lease_->length(); }

absl::Status CacheRegistry::Import::Append(const void* key, const void* value, int64_t n,
                                           const std::string& field) {
  return AppendStored(*lease_, key, value, n, field);
}

absl::Status CacheRegistry::AppendStored(Lease& lease, const void* key, const void* value,
                                         int64_t n, const std::string& field) {
  const KvLayout& layout = lease.layout();
  auto scan = [&](const void* data, int64_t width) {
    return layout.dtype == DType::kFloat8E4M3
               ? ScanFp8Rows(data, layout.kv_heads * n, width)
               : ScanValues(data, layout.dtype, layout.kv_heads * n * width);
  };
  const ValueScan keys = scan(key, layout.head_dim);
  const ValueScan values =  // None stored in a latent cache: its values are within its keys.
      layout.values_from_keys ? keys : scan(value, layout.value_dim);
  for (const auto& [scan, what] : {std::pair{keys, "key"}, std::pair{values, "value"}}) {
    if (scan.first_non_finite >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": a ", what, " element is ", scan.non_finite_value, " (element ",
                       scan.first_non_finite, " of the ", n, " tokens at ", lease.length(),
                       "); a cache holds finite values only"));
    }
  }
  return lease.Append(TensorView{key, layout.dtype}, TensorView{value, layout.dtype}, n,
                      keys.max_abs, values.max_abs);
}

absl::StatusOr<CacheDescription> CacheRegistry::Import::Finish() {
  Entry& entry = *entry_;
  // Take the id first (the file is named by it, so no other import may write that file
  // meanwhile), then write the file's header and reserve its blocks, then show the cache: a
  // failure at any step leaves nothing behind.
  {
    std::lock_guard<std::mutex> lock(registry_->mutex_);
    const auto taken = [&] {
      return registry_->entries_.count(entry.id) != 0 || registry_->importing_.count(entry.id) != 0;
    };
    if (taken()) {
      if (!new_id_if_taken_) return Taken("", entry.id);
      do {
        absl::StatusOr<std::string> id = NewId();
        if (!id.ok()) return id.status();
        entry.id = *id;
      } while (taken());
    }
    registry_->importing_.insert(entry.id);
  }
  struct Untake {
    CacheRegistry* registry;
    const std::string id;
    ~Untake() {
      std::lock_guard<std::mutex> lock(registry->mutex_);
      registry->importing_.erase(id);
    }
  } untake{registry_, entry.id};
  if (registry_->persistent()) {
    if (absl::Status file = registry_->CreateFile(entry); !file.ok()) return file;
    if (absl::Status disk = registry_->ReserveDisk(entry, entry.store->length()); !disk.ok()) {
      entry.file->Remove();
      return disk;
    }
  }
  lease_->Commit();
  if (entry.file != nullptr && entry.store->length() > 0) entry.dirty_since_ns.store(SteadyNs());
  if (absl::Status inserted = registry_->Insert(entry_); !inserted.ok()) {
    if (entry.file != nullptr) entry.file->Remove();
    return inserted;
  }
  CacheDescription description = lease_->Describe();
  lease_.reset();
  return description;
}

void CacheRegistry::MarkMoved(const std::string& owner, const std::string& id,
                              const std::string& target) {
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = entries_.find(id);
    if (found == entries_.end() || found->second->owner != owner) return;
    entry = std::move(found->second);
    entries_.erase(found);
    moved_[id] = {owner, target};
    RemoveFile(*entry);
  }
  SyncDir();
}

std::vector<std::pair<std::string, std::string>> CacheRegistry::AllCaches() const {
  std::vector<std::shared_ptr<Entry>> all;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, entry] : entries_) all.push_back(entry);
  }
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a->serial < b->serial; });
  std::vector<std::pair<std::string, std::string>> caches;
  for (const auto& entry : all) caches.emplace_back(entry->owner, entry->id);
  return caches;
}

int64_t CacheRegistry::caches() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(entries_.size());
}

int64_t CacheRegistry::tokens() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t tokens = 0;
  for (const auto& [id, entry] : entries_) tokens += entry->length.load();
  return tokens;
}

int64_t CacheRegistry::bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_bytes_;
}

}  // namespace attn
