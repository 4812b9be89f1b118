// SharedMemoryRegistry: the shared-memory regions callers on the server's machine registered
// (RegisterSharedMemory), and the reads and writes of tensors that name them instead of carrying
// their bytes (Tensor.shared_memory, AttentionRequest.output_to, DecodeItem.output_to).
//
// A region is a byte range of a file in /dev/shm, registered under a name by one caller
// identity (CallerIdentity: its client certificate under mutual TLS) and visible to that identity
// alone. The registry holds the file open (the descriptor is the region's, not the name's: a file
// replaced under the same name is not followed) and never maps it: inputs are read with pread and
// outputs written with pwrite, each checked against the file's size at that moment, so a region
// that is truncated or removed under a call fails that call with FAILED_PRECONDITION naming the
// tensor — no SIGBUS can reach the server. A call holds the regions it uses (shared_ptr) until it
// is done with them, so unregistering one under a call lets that call finish with it.
//
// What it costs the server: one open file per region, at most kMaxRegionsPerOwner per identity
// and kMaxRegions in all (RESOURCE_EXHAUSTED past either); a request's tensors are read into
// its own copy of the request, at most --max-message-bytes of them (a shared-memory call never
// holds more than an inline one could). Off unless attnd --allow-shared-memory: every call
// then is FAILED_PRECONDITION naming the flag. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"

namespace attn {

class SharedMemoryRegistry {
 public:
  static constexpr int kMaxRegionsPerOwner = 64;
  static constexpr int kMaxRegions = 1024;
  static constexpr size_t kMaxNameLength = 128;

  // max_bytes: the most bytes one request may name in all (attnd --max-message-bytes).
  SharedMemoryRegistry(bool allowed, int64_t max_bytes);
  ~SharedMemoryRegistry();
  SharedMemoryRegistry(const SharedMemoryRegistry&) = delete;
  SharedMemoryRegistry& operator=(const SharedMemoryRegistry&) = delete;

  bool allowed() const { return allowed_; }

  absl::StatusOr<attention::v1::SharedMemoryRegion> Register(
      const std::string& owner, const attention::v1::RegisterSharedMemoryRequest& request);
  // Empty name: every region of the owner (possibly none). The names unregistered.
  absl::StatusOr<std::vector<std::string>> Unregister(const std::string& owner,
                                                      const std::string& name);
  // Empty name: every region of the owner, by name.
  absl::StatusOr<std::vector<attention::v1::SharedMemoryRegion>> Status(
      const std::string& owner, const std::string& name) const;

  // Whether any tensor of the request names shared memory (an input, or output_to).
  static bool NamesSharedMemory(const attention::v1::AttentionRequest& request);
  static bool NamesSharedMemory(const attention::v1::AppendCacheRequest& request);
  static bool NamesSharedMemory(const attention::v1::DecodeRequest& request);

  // A copy of the request whose shared-memory tensors hold their bytes (data filled, the
  // reference cleared); output_to is kept. Errors name the field ("query.shared_memory.region",
  // "items[2].key.shared_memory.byte_size", …).
  absl::StatusOr<std::shared_ptr<const attention::v1::AttentionRequest>> Resolve(
      const std::string& owner, const attention::v1::AttentionRequest& request) const;
  absl::StatusOr<std::shared_ptr<const attention::v1::AppendCacheRequest>> Resolve(
      const std::string& owner, const attention::v1::AppendCacheRequest& request) const;
  absl::StatusOr<std::shared_ptr<const attention::v1::DecodeRequest>> Resolve(
      const std::string& owner, const attention::v1::DecodeRequest& request) const;

  // Moves an answer tensor's bytes into `to` (a writable region's range of exactly its size):
  // the tensor keeps its shape and dtype, its data is cleared and shared_memory names `to`.
  // `field` names `to` in errors ("output_to", "items[1].output_to").
  absl::Status WriteOutput(const std::string& owner, const attention::v1::SharedMemoryRef& to,
                           const std::string& field, attention::v1::Tensor* tensor) const;
  // WriteOutput for several outputs (a decode batch's): every range checked, and each region's
  // file size read once, before any is written; outputs back to back in a file go in one write.
  struct OutputWrite {
    const attention::v1::SharedMemoryRef* to;
    std::string field;
    attention::v1::Tensor* tensor;
  };
  absl::Status WriteOutputs(const std::string& owner, std::vector<OutputWrite>& writes) const;

 private:
  struct Region;
  using Key = std::pair<std::string, std::string>;  // (owner, name)

  absl::Status CheckAllowed() const;
  // The region a reference names, held; NOT_FOUND naming `field` + ".region".
  absl::StatusOr<std::shared_ptr<const Region>> Find(const std::string& owner,
                                                     const attention::v1::SharedMemoryRef& ref,
                                                     const std::string& field) const;
  // A tensor's bytes to read: where, and the region holding them open.
  struct PendingRead {
    std::string field;  // "items[2].key.shared_memory", for errors.
    attention::v1::Tensor* tensor = nullptr;
    std::shared_ptr<const Region> region;
    int64_t start = 0, bytes = 0;  // In the region's file.
  };
  // Checks a tensor's reference (named `field`), adding its bytes to *total.
  absl::Status CheckTensorRef(const std::string& owner, const std::string& field,
                              const attention::v1::Tensor& tensor, int64_t* total,
                              PendingRead* read) const;
  // Fills each tensor given (named fields[i]) that names shared memory with its bytes, all
  // references checked first; null tensors (absent fields) are skipped.
  absl::Status ResolveEach(const std::string& owner, const std::vector<std::string>& fields,
                           const std::vector<attention::v1::Tensor*>& tensors) const;
  // A request's input tensors (null for an absent one), and with `fields` their names for errors.
  static std::vector<attention::v1::Tensor*> TensorsOf(attention::v1::AttentionRequest& request,
                                                       std::vector<std::string>* fields);
  static std::vector<attention::v1::Tensor*> TensorsOf(attention::v1::AppendCacheRequest& request,
                                                       std::vector<std::string>* fields);
  static std::vector<attention::v1::Tensor*> TensorsOf(attention::v1::DecodeRequest& request,
                                                       std::vector<std::string>* fields);
  // Resolve's one body: the copy, its tensors read.
  template <class Request>
  absl::StatusOr<std::shared_ptr<const Request>> ResolveCopy(const std::string& owner,
                                                             const Request& request) const;

  // Buffers of tensors read from regions come back here when their request is done (Recycled),
  // at most kPoolBuffers of at least kPooledBytes each and max_bytes in all: the next read of a
  // large tensor then goes into memory already mapped (a fresh 25 MiB buffer costs 6400 page
  // faults and a zeroing pass: 20 ms on the 2-core VM, three times the read itself).
  static constexpr int kPoolBuffers = 4;
  static constexpr int64_t kPooledBytes = int64_t{1} << 20;
  // Small tensors of a region are read in one span when it is at most twice their bytes and this.
  static constexpr int64_t kSpanSlackBytes = int64_t{64} << 10;
  static constexpr int64_t kMaxSpanBytes = int64_t{4} << 20;  // Each thread keeps its span buffer.
  std::string TakeBuffer(int64_t bytes) const;                // Empty when none is large enough.
  void GiveBack(attention::v1::Tensor& tensor) const;
  // The request, owned, giving its tensors' buffers back when the last holder lets go.
  template <class Request>
  std::shared_ptr<Request> Recycled(Request* request) const;

  const bool allowed_;
  const int64_t max_bytes_;
  mutable std::mutex pool_mutex_;
  mutable std::vector<std::string> pool_;  // Needs pool_mutex_.
  mutable int64_t pooled_bytes_ = 0;       // Needs pool_mutex_.
  mutable std::mutex mutex_;
  std::map<Key, std::shared_ptr<const Region>> regions_;  // Needs mutex_.
};

}  // namespace attn
