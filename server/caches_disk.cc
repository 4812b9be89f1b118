// CacheRegistry (caches.h), its persistence: each cache's file (cache_file.h), the write-behind
// thread, the restore at start and the flush at shutdown.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/caches.h"
#include "server/caches_internal.h"

namespace attn {
namespace {

using Clock = std::chrono::steady_clock;
using caches_internal::IsCacheId;
using caches_internal::SteadyNs;
using caches_internal::WallNs;

// Copies tokens [from, from + n) of a store into `buffer` as a record holds them (the keys, then
// the values unless they are the keys'); *key_bytes says where the values start.
absl::Status CopyRecord(const KvStore& store, int64_t from, int64_t n, std::vector<char>& buffer,
                        int64_t* key_bytes) {
  const KvLayout& layout = store.layout();
  *key_bytes = KeyBytes(layout, n);
  buffer.resize(*key_bytes + StoredValueBytes(layout, n));
  return store.CopyOut(from, from + n, buffer.data(),
                       layout.values_from_keys ? nullptr : buffer.data() + *key_bytes);
}

bool SameLayout(const KvLayout& a, const KvLayout& b) {
  return a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.value_dim == b.value_dim &&
         a.dtype == b.dtype && a.values_from_keys == b.values_from_keys;
}

// Of n tokens read from a file at `start` (dense, as a record holds them), how many leading ones
// equal the store's tokens there, bit for bit (none past its length).
int64_t AgreeingTokens(const KvStore& store, int64_t start, int64_t n, const void* key,
                       const void* value, std::vector<char>& buffer) {
  const int64_t m = std::clamp<int64_t>(store.length() - start, 0, n);
  if (m == 0) return 0;
  const KvLayout& layout = store.layout();
  int64_t key_bytes;
  if (!CopyRecord(store, start, m, buffer, &key_bytes).ok()) return 0;
  const int64_t key_row = KeyBytes(layout, 1) / layout.kv_heads;
  const int64_t value_row = StoredValueBytes(layout, 1) / layout.kv_heads;
  auto row_equal = [&](const void* file, const char* mine, int64_t row, int64_t h, int64_t t) {
    return std::memcmp(static_cast<const char*>(file) + (h * n + t) * row, mine + (h * m + t) * row,
                       static_cast<size_t>(row)) == 0;
  };
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t h = 0; h < layout.kv_heads; ++h) {
      if (!row_equal(key, buffer.data(), key_row, h, t) ||
          (value_row > 0 && !row_equal(value, buffer.data() + key_bytes, value_row, h, t))) {
        return t;
      }
    }
  }
  return m;
}

// Tokens [from, n) of a dense [heads, n, row] tensor (row in bytes) into dense `out`.
void TokensFrom(const void* data, int64_t heads, int64_t n, int64_t row, int64_t from, char* out) {
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(out + h * (n - from) * row, static_cast<const char*>(data) + (h * n + from) * row,
                static_cast<size_t>((n - from) * row));
  }
}

}  // namespace

absl::Status CacheRegistry::CreateFile(Entry& entry) {
  if (disk_failed_.load()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the caches' disk (--cache-dir=", limits_.dir,
        ") is failing writes; no cache can be created or grown until they succeed again"));
  }
  CacheFileHeader header;
  header.id = entry.id;
  header.owner = entry.owner;
  header.layout = entry.store->layout();
  header.created_ns = entry.created_ns;
  header.parent = entry.parent;
  header.root = entry.root;
  absl::StatusOr<std::unique_ptr<CacheFile>> file = CacheFile::Create(limits_.dir, header);
  if (!file.ok()) return file.status();
  std::lock_guard<std::mutex> lock(entry.file_mutex);
  entry.file = *std::move(file);
  entry.file_bytes.store(entry.file->size());
  return absl::OkStatus();
}

absl::Status CacheRegistry::ReserveDisk(Entry& entry, int64_t tokens) {
  if (entry.file == nullptr) return absl::OkStatus();
  if (disk_failed_.load()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the caches' disk (--cache-dir=", limits_.dir,
        ") is failing writes; appends are refused until they succeed again (free space there)"));
  }
  const int64_t bound = entry.file->BoundFor(tokens);  // Of immutable fields: no lock needed.
  if (bound <= entry.disk_reserved.load()) return absl::OkStatus();  // A decode step, mostly.
  std::lock_guard<std::mutex> lock(entry.file_mutex);
  const absl::Status reserved = entry.file->Reserve(bound);
  entry.disk_reserved.store(entry.file->reserved());
  return reserved;
}

absl::Status CacheRegistry::CutFile(Entry& entry, int64_t length) {
  std::lock_guard<std::mutex> lock(entry.file_mutex);
  entry.cuts.fetch_add(1);  // Whatever the writer copied before this is stale now.
  if (entry.file == nullptr || length >= entry.file->tokens()) return absl::OkStatus();
  absl::Status cut = entry.file->Cut(length);
  if (cut.ok()) cut = entry.file->Sync();
  entry.file_bytes.store(entry.file->size());
  entry.durable.store(std::min(entry.durable.load(), entry.file->tokens()));
  if (!cut.ok()) {
    return absl::Status(
        cut.code(), absl::StrCat("cutting cache ", entry.id, " on disk (--cache-dir=", limits_.dir,
                                 "): ", cut.message()));
  }
  return absl::OkStatus();
}

absl::Status CacheRegistry::WriteFork(Entry& entry) {
  const int64_t length = entry.store->length();
  if (absl::Status file = CreateFile(entry); !file.ok()) return file;
  if (absl::Status disk = ReserveDisk(entry, length); !disk.ok()) return disk;
  std::lock_guard<std::mutex> lock(entry.file_mutex);
  std::vector<char> buffer;
  for (int64_t from = 0; from < length;) {
    const int64_t n = std::min(length - from, entry.file->TokensPerRecord());
    int64_t key_bytes;
    absl::Status written = CopyRecord(*entry.store, from, n, buffer, &key_bytes);
    if (written.ok()) written = entry.file->Write(n, buffer.data(), buffer.data() + key_bytes);
    if (!written.ok()) return written;
    from += n;
  }
  absl::Status synced = entry.file->Sync();
  entry.file_bytes.store(entry.file->size());
  if (!synced.ok()) return synced;
  entry.durable.store(entry.file->tokens());
  return absl::OkStatus();
}

void CacheRegistry::RemoveFile(Entry& entry) {
  std::lock_guard<std::mutex> lock(entry.file_mutex);
  if (entry.file != nullptr) entry.file->Remove();
  entry.file_bytes.store(0);
}

void CacheRegistry::SyncDir() {
  if (persistent()) SyncCacheDir(limits_.dir);
}

absl::StatusOr<std::vector<std::string>> CacheRegistry::Restore() {
  std::vector<std::string> lines;
  if (!persistent()) return lines;
  if (mkdir(limits_.dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(
        absl::StrCat("cannot create --cache-dir=", limits_.dir, ": ", std::strerror(errno)));
  }
  absl::StatusOr<std::unique_ptr<CacheDirLock>> lock = CacheDirLock::Take(limits_.dir);
  if (!lock.ok()) return lock.status();
  dir_lock_ = *std::move(lock);
  absl::StatusOr<std::vector<std::string>> paths = ListCacheFiles(limits_.dir);
  if (!paths.ok()) return paths.status();
  // Oldest first, so that a fork comes after the cache it was forked from. A header that does
  // not verify sorts first; Open below reports it.
  std::vector<std::pair<int64_t, std::string>> order;
  for (const std::string& path : *paths) {
    CacheFileHeader header;
    const bool read = CacheFile::ReadHeader(path, &header).ok();
    order.emplace_back(read ? header.created_ns : std::numeric_limits<int64_t>::min(), path);
  }
  std::sort(order.begin(), order.end());
  const Clock::time_point start = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    restoring_ = true;
  }
  struct Restoring {  // Reserve's own budget again, however Restore returns.
    CacheRegistry* registry;
    ~Restoring() {
      std::lock_guard<std::mutex> lock(registry->mutex_);
      registry->restoring_ = false;
    }
  } restoring{this};
  std::vector<std::shared_ptr<Entry>> restored;
  // For forks' sharing: the caches restored by id, and the first of each family (by its root).
  std::map<std::string, std::shared_ptr<Entry>> by_id, first_of_family;
  int64_t tokens = 0, bytes = 0, damaged = 0, shared = 0;
  std::vector<char> buffer, rest;
  for (const auto& ordered : order) {
    const std::string& path = ordered.second;  // A plain reference: the lambdas below capture it.
    CacheFileHeader header;
    std::shared_ptr<Entry> entry;
    std::optional<Lease> lease;
    // A fork's tokens are compared with the cache it shares pages with (its source, else its
    // family's root, else the first of its family restored) while they agree; then it is made a
    // fork of that many.
    std::shared_ptr<Entry> source;
    int64_t agreed = 0;
    // The cache's store and lease, made once the header is known (and for a fork, how many of
    // its tokens agree with its source).
    auto begin = [&]() -> absl::Status {
      if (entry != nullptr) return absl::OkStatus();
      const std::string name = path.substr(path.rfind('/') + 1);
      if (!IsCacheId(header.id) || name != header.id + ".kv") {
        return absl::DataLossError(
            absl::StrCat(path, ": names cache \"", header.id.substr(0, 64), "\", not its file's"));
      }
      absl::StatusOr<std::unique_ptr<KvStore>> store =
          source != nullptr ? source->store->Fork(agreed) : backend_.CreateKvStore(header.layout);
      if (!store.ok()) return store.status();
      entry = std::make_shared<Entry>(*this, header.id, header.owner, 0, header.created_ns,
                                      *std::move(store), SteadyNs(), source != nullptr);
      entry->parent = header.parent;
      entry->root = header.root;
      if (source != nullptr) {
        entry->max_abs_key = source->max_abs_key;
        entry->max_abs_value = source->max_abs_value;
        entry->table_bytes = (agreed + entry->store->page_tokens() - 1) /
                             entry->store->page_tokens() * kForkTableBytesPerPage;
        if (absl::Status reserved = Reserve(entry->table_bytes); !reserved.ok()) {
          entry->table_bytes = 0;
          return reserved;
        }
        shared += agreed;
      }
      entry->leases.fetch_add(1);  // The lease's.
      lease.emplace(Lease(this, entry));
      return absl::OkStatus();
    };
    auto share_with = [&]() {
      source = nullptr;
      if (header.parent.empty()) return;
      const std::pair<std::map<std::string, std::shared_ptr<Entry>>*, const std::string*> tries[] =
          {{&by_id, &header.parent}, {&by_id, &header.root}, {&first_of_family, &header.root}};
      for (const auto& [found, id] : tries) {
        const auto it = found->find(*id);
        if (it != found->end() && it->second->owner == header.owner &&
            SameLayout(it->second->store->layout(), header.layout)) {
          source = it->second;
          return;
        }
      }
    };
    CacheFile::Report report;
    bool looked = false;
    absl::StatusOr<std::unique_ptr<CacheFile>> file = CacheFile::Open(
        path, &header,
        [&](int64_t start, int64_t n, const void* key, const void* value) -> absl::Status {
          if (!looked) share_with(), looked = true;
          if (entry == nullptr && source != nullptr) {
            const int64_t same = AgreeingTokens(*source->store, start, n, key, value, buffer);
            agreed = start + same;
            if (same == n) return absl::OkStatus();
            if (absl::Status begun = begin(); !begun.ok()) return begun;
            const KvLayout& layout = header.layout;
            const int64_t key_bytes = KeyBytes(layout, n - same);
            rest.resize(key_bytes + StoredValueBytes(layout, n - same));
            TokensFrom(key, layout.kv_heads, n, KeyBytes(layout, 1) / layout.kv_heads, same,
                       rest.data());
            if (!layout.values_from_keys) {
              TokensFrom(value, layout.kv_heads, n, StoredValueBytes(layout, 1) / layout.kv_heads,
                         same, rest.data() + key_bytes);
            }
            return AppendStored(*lease, rest.data(), rest.data() + key_bytes, n - same, path);
          }
          if (absl::Status begun = begin(); !begun.ok()) return begun;
          return AppendStored(*lease, key, value, n, path);
        },
        [&](int64_t length) -> absl::Status {  // The entry has no file yet: memory only.
          if (!looked) share_with(), looked = true;
          if (entry == nullptr && source != nullptr) {
            agreed = std::min(agreed, length);  // Still the source's tokens.
            return absl::OkStatus();
          }
          if (absl::Status begun = begin(); !begun.ok()) return begun;
          return lease->Truncate(length);
        },
        &report);
    if (file.ok() && !looked) share_with();
    absl::Status status = file.ok() ? begin() : file.status();
    if (status.code() == absl::StatusCode::kResourceExhausted) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "restoring ", path, ": ", status.message(),
          ". The caches in --cache-dir need more than this budget: start with a larger "
          "--cache-bytes or --max-caches (nothing was dropped)"));
    }
    if (!status.ok()) {
      // Never served; kept for the operator under another name, so no later start reads it.
      const std::string aside = path + ".damaged";
      rename(path.c_str(), aside.c_str());
      lines.push_back(absl::StrCat("cache file ", path, " refused and renamed ", aside, ": ",
                                   status.message()));
      ++damaged;
      continue;
    }
    if (report.dropped_bytes > 0) {
      lines.push_back(absl::StrCat("cache ", header.id, ": kept its first ", report.tokens,
                                   " tokens; dropped the last ", report.dropped_bytes,
                                   " bytes of its file (", report.why_dropped, ")"));
    }
    lease->Commit();
    entry->file = *std::move(file);
    entry->durable.store(entry->file->tokens());
    entry->file_bytes.store(entry->file->size());
    tokens += entry->file->tokens();
    bytes += entry->file->size();
    lease.reset();
    by_id[entry->id] = entry;
    first_of_family.emplace(entry->root.empty() ? entry->id : entry->root, entry);
    restored.push_back(std::move(entry));
  }
  for (std::shared_ptr<Entry>& entry : restored) {
    entry->shared_bytes.store(entry->store->shared_bytes());
  }
  if (const int64_t in_use = CacheRegistry::bytes(); in_use > limits_.budget_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("restoring the caches in --cache-dir=", limits_.dir, ": they take ", in_use,
                     " bytes, over this server's --cache-bytes=", limits_.budget_bytes,
                     ". Start with a larger --cache-bytes (nothing was dropped)"));
  }
  for (std::shared_ptr<Entry>& entry : restored) {
    if (absl::Status inserted = Insert(entry); !inserted.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("restoring the caches in --cache-dir=", limits_.dir, ": ",
                       inserted.message(), " (nothing was dropped)"));
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  lines.insert(
      lines.begin(),
      absl::StrCat(
          "restored ", restored.size(), " caches (", tokens, " tokens, ", bytes,
          " bytes) from --cache-dir=", limits_.dir, " in ", absl::StrFormat("%.3f", seconds), " s",
          shared > 0 ? absl::StrCat("; forks share ", shared, " tokens with their sources again")
                     : "",
          damaged > 0 ? absl::StrCat("; ", damaged, " files refused") : ""));
  return lines;
}

void CacheRegistry::WriteBehind() {
  const auto period = std::chrono::milliseconds(std::max<int64_t>(limits_.sync_seconds * 500, 1));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, period);
    if (stopping_) break;
    lock.unlock();
    if (absl::Status written = WritePass(/*wait_for_every_cache=*/false); !written.ok()) {
      std::fprintf(stderr, "attnd: writing caches behind: %s\n",
                   std::string(written.message()).c_str());
    }
    lock.lock();
  }
}

absl::Status CacheRegistry::WritePass(bool wait_for_every_cache) {
  std::lock_guard<std::mutex> pass(write_mutex_);
  const int64_t pass_start = SteadyNs();  // Every token committed before it is written below.
  std::vector<std::shared_ptr<Entry>> dirty;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, entry] : entries_) {
      if (entry->file != nullptr && entry->length.load() > entry->durable.load()) {
        dirty.push_back(entry);
      }
    }
  }
  std::vector<char> buffer;
  absl::Status result;
  std::set<const Entry*> unwritten;  // Entries a write failed for.
  // Copies the entry's committed tokens past its file's out, a record at a time (the lease's
  // mutex held only for the copy), and writes them. False when `wait` is false and a call holds
  // the cache: a later round comes back for it.
  auto write = [&](Entry& entry, bool wait) -> bool {
    while (true) {
      std::unique_lock<std::mutex> hold(entry.mutex, std::defer_lock);
      if (wait) {
        hold.lock();
      } else if (!hold.try_lock()) {
        return false;
      }
      const int64_t cuts = entry.cuts.load();
      const int64_t from = entry.file->tokens();
      const int64_t to = entry.length.load();
      if (from >= to) return true;
      const int64_t n = std::min(to - from, entry.file->TokensPerRecord());
      int64_t key_bytes;
      absl::Status copied = CopyRecord(*entry.store, from, n, buffer, &key_bytes);
      hold.unlock();
      if (copied.ok()) {
        std::lock_guard<std::mutex> lock(entry.file_mutex);
        // A cut since the copy: those tokens may be gone or replaced; copy again.
        if (entry.cuts.load() != cuts) continue;
        copied = entry.file->Write(n, buffer.data(), buffer.data() + key_bytes);
        entry.file_bytes.store(entry.file->size());
      }
      if (!copied.ok()) {
        result.Update(copied);
        unwritten.insert(&entry);
        return true;
      }
    }
  };
  std::vector<std::shared_ptr<Entry>> busy;
  for (const auto& entry : dirty) {
    if (!write(*entry, wait_for_every_cache)) busy.push_back(entry);
  }
  for (const auto& entry : busy) write(*entry, true);
  for (const auto& entry : dirty) {
    std::lock_guard<std::mutex> lock(entry->file_mutex);
    if (absl::Status synced = entry->file->Sync(); !synced.ok()) {
      result.Update(synced);
      continue;
    }
    entry->durable.store(entry->file->tokens());
    // Caught up: nothing waits. Otherwise what waits came after the pass began, unless a write
    // failed: then the oldest waiting append's time stays, and the lag grows.
    if (unwritten.count(entry.get()) != 0) continue;
    entry->dirty_since_ns.store(entry->length.load() > entry->file->tokens() ? pass_start : 0);
  }
  const bool failed = !result.ok();
  if (failed != disk_failed_.exchange(failed)) {
    std::fprintf(stderr, "attnd: the caches' disk %s\n",
                 failed ? "is failing writes: appends are refused until they succeed again"
                        : "takes writes again: appends are accepted");
  }
  if (!failed) last_flush_ns_.store(WallNs());
  return result;
}

absl::Status CacheRegistry::Flush(bool shutdown) {
  if (!persistent()) return absl::OkStatus();
  absl::Status written = WritePass(/*wait_for_every_cache=*/true);
  if (shutdown) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, entry] : entries_) {
      std::lock_guard<std::mutex> file_lock(entry->file_mutex);
      if (entry->file != nullptr) entry->file->Trim();
      entry->disk_reserved.store(0);
    }
  }
  return written;
}

int64_t CacheRegistry::disk_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t bytes = 0;
  for (const auto& [id, entry] : entries_) bytes += entry->file_bytes.load();
  return bytes;
}

double CacheRegistry::disk_lag_seconds() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t oldest = 0;
  for (const auto& [id, entry] : entries_) {
    const int64_t since = entry->dirty_since_ns.load();
    if (since != 0 && (oldest == 0 || since < oldest)) oldest = since;
  }
  return oldest == 0 ? 0.0 : static_cast<double>(SteadyNs() - oldest) * 1e-9;
}

double CacheRegistry::last_flush_seconds() const {
  return static_cast<double>(last_flush_ns_.load()) * 1e-9;
}

}  // namespace attn
