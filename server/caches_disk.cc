// CacheRegistry (caches.h), its persistence: each cache's file (cache_file.h), the write-behind
// thread, the restore at start and the flush at shutdown.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
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
  const Clock::time_point start = Clock::now();
  std::vector<std::shared_ptr<Entry>> restored;
  int64_t tokens = 0, bytes = 0, damaged = 0;
  for (const std::string& path : *paths) {
    CacheFileHeader header;
    std::shared_ptr<Entry> entry;
    std::optional<Lease> lease;
    // The cache's store and lease, made once the header is known.
    auto begin = [&]() -> absl::Status {
      if (entry != nullptr) return absl::OkStatus();
      const std::string name = path.substr(path.rfind('/') + 1);
      if (!IsCacheId(header.id) || name != header.id + ".kv") {
        return absl::DataLossError(
            absl::StrCat(path, ": names cache \"", header.id.substr(0, 64), "\", not its file's"));
      }
      absl::StatusOr<std::unique_ptr<KvStore>> store = backend_.CreateKvStore(header.layout);
      if (!store.ok()) return store.status();
      entry = std::make_shared<Entry>(*this, header.id, header.owner, 0, header.created_ns,
                                      *std::move(store), SteadyNs());
      entry->leases.fetch_add(1);  // The lease's.
      lease.emplace(Lease(this, entry));
      return absl::OkStatus();
    };
    CacheFile::Report report;
    absl::StatusOr<std::unique_ptr<CacheFile>> file = CacheFile::Open(
        path, &header,
        [&](int64_t, int64_t n, const void* key, const void* value) -> absl::Status {
          if (absl::Status begun = begin(); !begun.ok()) return begun;
          return AppendStored(*lease, key, value, n, path);
        },
        [&](int64_t length) -> absl::Status {  // The entry has no file yet: memory only.
          if (absl::Status begun = begin(); !begun.ok()) return begun;
          return lease->Truncate(length);
        },
        &report);
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
    restored.push_back(std::move(entry));
  }
  std::sort(restored.begin(), restored.end(),
            [](const auto& a, const auto& b) { return a->created_ns < b->created_ns; });
  for (std::shared_ptr<Entry>& entry : restored) {
    if (absl::Status inserted = Insert(entry); !inserted.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("restoring the caches in --cache-dir=", limits_.dir, ": ",
                       inserted.message(), " (nothing was dropped)"));
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  lines.insert(lines.begin(),
               absl::StrCat("restored ", restored.size(), " caches (", tokens, " tokens, ", bytes,
                            " bytes) from --cache-dir=", limits_.dir, " in ",
                            absl::StrFormat("%.3f", seconds), " s",
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
      const KvLayout& layout = entry.store->layout();
      const int64_t n = std::min(to - from, entry.file->TokensPerRecord());
      const int64_t key_bytes = KeyBytes(layout, n);
      buffer.resize(key_bytes + StoredValueBytes(layout, n));  // A record holds what is stored.
      absl::Status copied =
          entry.store->CopyOut(from, from + n, buffer.data(),
                               layout.values_from_keys ? nullptr : buffer.data() + key_bytes);
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
