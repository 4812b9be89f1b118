// CacheRegistry's entry (server/caches.h): one cache as the registry's two files see it,
// caches.cc (ids, owners, budget, leases, expiry, import) and caches_disk.cc (its file, the
// writer thread, restore). Nothing else includes this.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "server/cache_file.h"
#include "server/caches.h"

namespace attn {
namespace caches_internal {

// The steady clock (idle expiry, the disk's lag) and the wall clock (a cache's creation time,
// kept in its file; the last flush), in ns.
inline int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline int64_t WallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A cache id as this server draws them: 32 lowercase hex digits (also a file's name).
inline bool IsCacheId(const std::string& id) {
  return id.size() == 32 && std::all_of(id.begin(), id.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

}  // namespace caches_internal

struct CacheRegistry::Entry {
  Entry(CacheRegistry& registry, std::string id, std::string owner, int64_t serial,
        int64_t created_ns, std::unique_ptr<KvStore> store, int64_t now_ns, bool forked = false)
      : registry(registry),
        id(std::move(id)),
        owner(std::move(owner)),
        serial(serial),
        created_ns(created_ns),
        store(std::move(store)),
        last_used_ns(now_ns) {
    // The budget counts pages, each once: a page's bytes go back when the last store holding
    // it (this one or a fork's) frees it. A fork's store reports to its source's already.
    if (!forked) {
      this->store->OnPageFreed([registry = &registry](int64_t bytes) { registry->Release(bytes); });
    }
  }
  // The last lease has ended and the registry has let go: a tentative cut's hold and a fork's
  // page table go back now, the pages as the store frees them (those a fork still holds, when
  // it lets go).
  ~Entry() { registry.Release(held_bytes + table_bytes); }

  CacheRegistry& registry;
  std::string id;  // Set before the entry is in the registry (an import may draw a new one).
  const std::string owner;
  int64_t serial;            // List's order (oldest first); set with id.
  const int64_t created_ns;  // Wall clock at creation, kept in the file for List's order.

  std::mutex mutex;  // Held by a Lease: guards store, held_bytes and the maxima.
  std::unique_ptr<KvStore> store;
  // Of the registry's budget besides the pages: what a tentative cut freed, kept until the
  // lease commits or rolls back (so that putting the tokens back cannot run out of budget).
  int64_t held_bytes = 0;
  int64_t table_bytes = 0;  // A fork's page table (CacheRegistry::Fork), set before it is shared.
  double max_abs_key = 0, max_abs_value = 0;
  // A fork's source and its family's root (the first cache, which no fork made), for its file
  // and a restore's sharing; empty for a cache that is not a fork. Set before it is shared.
  std::string parent, root;

  // Readable without the mutex (Describe, List, metrics, expiry).
  std::atomic<int64_t> length{0};
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> shared_bytes{0};  // store->shared_bytes() when last read under mutex.
  std::atomic<int64_t> last_used_ns;
  std::atomic<int> leases{0};

  // With a directory: the file (its calls under file_mutex; `file` itself is set before the
  // entry is shared and never changes after), the tokens in it and fsynced, since when (steady
  // ns) committed tokens have waited for the disk (0: none wait), its size and its allocation.
  std::mutex file_mutex;
  std::unique_ptr<CacheFile> file;
  std::atomic<int64_t> durable{0};
  std::atomic<int64_t> dirty_since_ns{0};
  std::atomic<int64_t> file_bytes{0};
  // Cuts committed (CutFile, under file_mutex): the writer writes what it copied only if no cut
  // came in between, and an export only if none came during it.
  std::atomic<int64_t> cuts{0};
  std::atomic<int64_t> disk_reserved{0};  // file->reserved(), readable without file_mutex.
};

}  // namespace attn
