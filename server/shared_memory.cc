#include "server/shared_memory.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <type_traits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/request.h"

namespace attn {

namespace v1 = attention::v1;

// One registered region: its open file (closed with the last holder) and what it was given.
struct SharedMemoryRegistry::Region {
  v1::SharedMemoryRegion info;
  int fd = -1;
  ~Region() {
    if (fd >= 0) close(fd);
  }
};

namespace {

absl::Status Invalid(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > SharedMemoryRegistry::kMaxNameLength) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// The file under /dev/shm a key names: "/name" (shm_open's form) or "/dev/shm/name", one path
// component that is not "." or "..". Empty when the key is not of either form.
std::string ShmPath(const std::string& key) {
  constexpr absl::string_view kDir = "/dev/shm/";
  std::string component;
  if (absl::StartsWith(key, kDir)) {
    component = key.substr(kDir.size());
  } else if (absl::StartsWith(key, "/")) {
    component = key.substr(1);
  } else {
    return "";
  }
  if (component.empty() || component.size() > 255 || component == "." || component == ".." ||
      component.find('/') != std::string::npos || component.find('\0') != std::string::npos) {
    return "";
  }
  return absl::StrCat(kDir, component);
}

// Whether [offset, offset + size) lies within [0, limit), without overflow.
bool Within(int64_t offset, int64_t size, int64_t limit) {
  return offset >= 0 && size >= 0 && offset <= limit && size <= limit - offset;
}

// The file's size now, or −1.
int64_t FileSize(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return -1;
  return static_cast<int64_t>(st.st_size);
}

}  // namespace

SharedMemoryRegistry::SharedMemoryRegistry(bool allowed, int64_t max_bytes)
    : allowed_(allowed), max_bytes_(max_bytes) {}

SharedMemoryRegistry::~SharedMemoryRegistry() = default;

absl::Status SharedMemoryRegistry::CheckAllowed() const {
  if (allowed_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "shared memory is off on this server: attnd serves it only with --allow-shared-memory "
      "(for callers on its own machine); send the tensors' bytes in the request instead");
}

absl::StatusOr<v1::SharedMemoryRegion> SharedMemoryRegistry::Register(
    const std::string& owner, const v1::RegisterSharedMemoryRequest& request) {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  if (!ValidName(request.name())) {
    return Invalid("name",
                   absl::StrCat("must be 1 to ", kMaxNameLength, " characters of [A-Za-z0-9_.-]"));
  }
  const std::string path = ShmPath(request.key());
  if (path.empty()) {
    return Invalid("key",
                   "must name a file in /dev/shm: \"/NAME\" (as shm_open takes it) or "
                   "\"/dev/shm/NAME\", one path component");
  }
  if (request.offset() < 0) return Invalid("offset", absl::StrCat("is ", request.offset()));
  if (request.byte_size() < 1) {
    return Invalid("byte_size", absl::StrCat("is ", request.byte_size(), "; must be ≥ 1"));
  }
  auto region = std::make_shared<Region>();
  bool writable = true;
  region->fd = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (region->fd < 0 && (errno == EACCES || errno == EROFS || errno == EPERM)) {
    writable = false;
    region->fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  }
  if (region->fd < 0) {
    const int error = errno;
    if (error == ENOENT) return absl::NotFoundError(absl::StrCat("key: ", path, " does not exist"));
    return absl::FailedPreconditionError(
        absl::StrCat("key: cannot open ", path, ": ", std::strerror(error)));
  }
  struct stat st;
  if (fstat(region->fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return Invalid("key", absl::StrCat(path, " is not a regular file"));
  }
  if (!Within(request.offset(), request.byte_size(), static_cast<int64_t>(st.st_size))) {
    return absl::OutOfRangeError(absl::StrCat(
        "byte_size: offset ", request.offset(), " + byte_size ", request.byte_size(),
        " is past the end of ", path, " (", static_cast<int64_t>(st.st_size), " bytes)"));
  }
  region->info.set_name(request.name());
  region->info.set_key(request.key());
  region->info.set_offset(request.offset());
  region->info.set_byte_size(request.byte_size());
  region->info.set_writable(writable);

  std::lock_guard<std::mutex> lock(mutex_);
  const Key key{owner, request.name()};
  if (regions_.count(key) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("name: a region \"", request.name(),
                                                 "\" is registered already; unregister it first"));
  }
  int owned = 0;
  for (auto it = regions_.lower_bound({owner, ""});
       it != regions_.end() && it->first.first == owner; ++it) {
    ++owned;
  }
  if (owned >= kMaxRegionsPerOwner || static_cast<int>(regions_.size()) >= kMaxRegions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this caller has ", owned, " shared-memory regions (at most ", kMaxRegionsPerOwner,
        " per caller, ", kMaxRegions, " in all); unregister some first"));
  }
  regions_.emplace(key, region);
  return region->info;
}

absl::StatusOr<std::vector<std::string>> SharedMemoryRegistry::Unregister(const std::string& owner,
                                                                          const std::string& name) {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  std::vector<std::string> names;
  std::vector<std::shared_ptr<const Region>> released;  // Closed outside the lock.
  std::lock_guard<std::mutex> lock(mutex_);
  if (!name.empty()) {
    auto it = regions_.find({owner, name});
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("name: no shared-memory region \"", name, "\""));
    }
    released.push_back(std::move(it->second));
    regions_.erase(it);
    names.push_back(name);
    return names;
  }
  auto it = regions_.lower_bound({owner, ""});
  while (it != regions_.end() && it->first.first == owner) {
    names.push_back(it->first.second);
    released.push_back(std::move(it->second));
    it = regions_.erase(it);
  }
  return names;
}

absl::StatusOr<std::vector<v1::SharedMemoryRegion>> SharedMemoryRegistry::Status(
    const std::string& owner, const std::string& name) const {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  std::vector<v1::SharedMemoryRegion> regions;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!name.empty()) {
    auto it = regions_.find({owner, name});
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("name: no shared-memory region \"", name, "\""));
    }
    regions.push_back(it->second->info);
    return regions;
  }
  for (auto it = regions_.lower_bound({owner, ""});
       it != regions_.end() && it->first.first == owner; ++it) {
    regions.push_back(it->second->info);
  }
  return regions;
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegistry::Region>> SharedMemoryRegistry::Find(
    const std::string& owner, const v1::SharedMemoryRef& ref, const std::string& field) const {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = regions_.find({owner, ref.region()});
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat(field, ".region: no shared-memory region \"",
                                            ref.region(), "\" is registered by this caller"));
  }
  return it->second;
}

absl::Status SharedMemoryRegistry::ResolveTensor(const std::string& owner, const std::string& field,
                                                 v1::Tensor* tensor, int64_t* total) const {
  if (!tensor->has_shared_memory()) return absl::OkStatus();
  const std::string ref_field = absl::StrCat(field, ".shared_memory");
  const v1::SharedMemoryRef ref = tensor->shared_memory();
  if (!tensor->data().empty()) {
    return Invalid(absl::StrCat(field, ".data"),
                   "must be empty when shared_memory names the tensor's bytes");
  }
  absl::StatusOr<std::shared_ptr<const Region>> region = Find(owner, ref, ref_field);
  if (!region.ok()) return region.status();
  const v1::SharedMemoryRegion& info = (*region)->info;
  if (!Within(ref.offset(), ref.byte_size(), info.byte_size())) {
    return absl::OutOfRangeError(absl::StrCat(ref_field, ": offset ", ref.offset(), " + byte_size ",
                                              ref.byte_size(), " is outside region \"", info.name(),
                                              "\" (", info.byte_size(), " bytes)"));
  }
  if (const std::optional<int64_t> bytes = TensorBytes(*tensor);
      bytes && *bytes != ref.byte_size()) {
    return Invalid(absl::StrCat(ref_field, ".byte_size"),
                   absl::StrCat("is ", ref.byte_size(), " but the tensor's shape and dtype need ",
                                *bytes, " bytes"));
  }
  if (ref.byte_size() > max_bytes_ - *total) {
    return absl::ResourceExhaustedError(absl::StrCat(
        ref_field, ": the request's tensors in shared memory pass --max-message-bytes (",
        max_bytes_, "), the most an inline request may carry"));
  }
  *total += ref.byte_size();
  std::string* data = tensor->mutable_data();
  if (ref.byte_size() >= kPooledBytes) *data = TakeBuffer(ref.byte_size());
  data->resize(static_cast<size_t>(ref.byte_size()));
  int64_t done = 0;
  const int64_t start = info.offset() + ref.offset();
  while (done < ref.byte_size()) {
    const ssize_t n = pread((*region)->fd, data->data() + done,
                            static_cast<size_t>(ref.byte_size() - done), start + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          ref_field, ": region \"", info.name(), "\" ends at byte ", start + done,
          " of its file now (truncated under the call?): read ", done, " of ", ref.byte_size(),
          " bytes", n < 0 ? absl::StrCat(": ", std::strerror(errno)) : ""));
    }
    done += n;
  }
  tensor->clear_shared_memory();
  return absl::OkStatus();
}

bool SharedMemoryRegistry::NamesSharedMemory(const v1::AttentionRequest& request) {
  return request.query().has_shared_memory() || request.key().has_shared_memory() ||
         request.value().has_shared_memory() || request.has_output_to();
}

bool SharedMemoryRegistry::NamesSharedMemory(const v1::AppendCacheRequest& request) {
  return request.key().has_shared_memory() || request.value().has_shared_memory();
}

bool SharedMemoryRegistry::NamesSharedMemory(const v1::DecodeRequest& request) {
  for (const v1::DecodeItem& item : request.items()) {
    if (item.query().has_shared_memory() || item.key().has_shared_memory() ||
        item.value().has_shared_memory() || item.has_output_to()) {
      return true;
    }
  }
  return false;
}

namespace {

// A tensor field of a request, when present (null otherwise: asking for an absent field's
// mutable message would make it present).
template <class Message>
v1::Tensor* Present(bool has, Message* message, v1::Tensor* (Message::*mutable_field)()) {
  return has ? (message->*mutable_field)() : nullptr;
}

}  // namespace

std::string SharedMemoryRegistry::TakeBuffer(int64_t bytes) const {
  std::lock_guard<std::mutex> lock(pool_mutex_);
  for (size_t i = 0; i < pool_.size(); ++i) {
    if (static_cast<int64_t>(pool_[i].capacity()) < bytes) continue;
    std::string buffer = std::move(pool_[i]);
    pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(i));
    pooled_bytes_ -= static_cast<int64_t>(buffer.capacity());
    return buffer;
  }
  return std::string();
}

void SharedMemoryRegistry::GiveBack(v1::Tensor& tensor) const {
  std::string& data = *tensor.mutable_data();
  const int64_t capacity = static_cast<int64_t>(data.capacity());
  if (capacity < kPooledBytes) return;
  std::lock_guard<std::mutex> lock(pool_mutex_);
  if (static_cast<int>(pool_.size()) >= kPoolBuffers || pooled_bytes_ + capacity > max_bytes_) {
    return;
  }
  pooled_bytes_ += capacity;
  pool_.push_back(std::move(data));
}

template <class Request>
std::shared_ptr<Request> SharedMemoryRegistry::Recycled(Request* request) const {
  return std::shared_ptr<Request>(request, [this](Request* done) {
    if constexpr (std::is_same_v<Request, v1::DecodeRequest>) {
      for (v1::DecodeItem& item : *done->mutable_items()) {
        for (v1::Tensor* t : {item.mutable_query(), item.mutable_key(), item.mutable_value()}) {
          GiveBack(*t);
        }
      }
    } else if constexpr (std::is_same_v<Request, v1::AttentionRequest>) {
      for (v1::Tensor* t : {done->mutable_query(), done->mutable_key(), done->mutable_value()}) {
        GiveBack(*t);
      }
    } else {
      for (v1::Tensor* t : {done->mutable_key(), done->mutable_value()}) GiveBack(*t);
    }
    delete done;
  });
}

absl::Status SharedMemoryRegistry::ResolveEach(
    const std::string& owner, const std::vector<std::pair<std::string, v1::Tensor*>>& tensors,
    int64_t* total) const {
  for (const auto& [field, tensor] : tensors) {
    if (tensor == nullptr) continue;
    if (absl::Status status = ResolveTensor(owner, field, tensor, total); !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const v1::AttentionRequest>> SharedMemoryRegistry::Resolve(
    const std::string& owner, const v1::AttentionRequest& request) const {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  std::shared_ptr<v1::AttentionRequest> copy = Recycled(new v1::AttentionRequest(request));
  using M = v1::AttentionRequest;
  int64_t total = 0;
  if (absl::Status status =
          ResolveEach(owner,
                      {{"query", Present(copy->has_query(), copy.get(), &M::mutable_query)},
                       {"key", Present(copy->has_key(), copy.get(), &M::mutable_key)},
                       {"value", Present(copy->has_value(), copy.get(), &M::mutable_value)}},
                      &total);
      !status.ok()) {
    return status;
  }
  return copy;
}

absl::StatusOr<std::shared_ptr<const v1::AppendCacheRequest>> SharedMemoryRegistry::Resolve(
    const std::string& owner, const v1::AppendCacheRequest& request) const {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  std::shared_ptr<v1::AppendCacheRequest> copy = Recycled(new v1::AppendCacheRequest(request));
  using M = v1::AppendCacheRequest;
  int64_t total = 0;
  if (absl::Status status =
          ResolveEach(owner,
                      {{"key", Present(copy->has_key(), copy.get(), &M::mutable_key)},
                       {"value", Present(copy->has_value(), copy.get(), &M::mutable_value)}},
                      &total);
      !status.ok()) {
    return status;
  }
  return copy;
}

absl::StatusOr<std::shared_ptr<const v1::DecodeRequest>> SharedMemoryRegistry::Resolve(
    const std::string& owner, const v1::DecodeRequest& request) const {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  std::shared_ptr<v1::DecodeRequest> copy = Recycled(new v1::DecodeRequest(request));
  using M = v1::DecodeItem;
  int64_t total = 0;
  for (int i = 0; i < copy->items_size(); ++i) {
    M* item = copy->mutable_items(i);
    const std::string prefix = absl::StrCat("items[", i, "].");
    if (absl::Status status =
            ResolveEach(owner,
                        {{prefix + "query", Present(item->has_query(), item, &M::mutable_query)},
                         {prefix + "key", Present(item->has_key(), item, &M::mutable_key)},
                         {prefix + "value", Present(item->has_value(), item, &M::mutable_value)}},
                        &total);
        !status.ok()) {
      return status;
    }
  }
  return copy;
}

absl::Status SharedMemoryRegistry::WriteOutput(const std::string& owner,
                                               const v1::SharedMemoryRef& to,
                                               const std::string& field, v1::Tensor* tensor) const {
  absl::StatusOr<std::shared_ptr<const Region>> region = Find(owner, to, field);
  if (!region.ok()) return region.status();
  const v1::SharedMemoryRegion& info = (*region)->info;
  const int64_t bytes = static_cast<int64_t>(tensor->data().size());
  if (!info.writable()) {
    return absl::FailedPreconditionError(absl::StrCat(field, ".region: region \"", info.name(),
                                                      "\" was opened read-only; outputs need a "
                                                      "file attnd can write"));
  }
  if (to.byte_size() != bytes) {
    return Invalid(absl::StrCat(field, ".byte_size"),
                   absl::StrCat("is ", to.byte_size(), " but the output takes ", bytes, " bytes"));
  }
  if (!Within(to.offset(), to.byte_size(), info.byte_size())) {
    return absl::OutOfRangeError(absl::StrCat(field, ": offset ", to.offset(), " + byte_size ",
                                              to.byte_size(), " is outside region \"", info.name(),
                                              "\" (", info.byte_size(), " bytes)"));
  }
  const int64_t start = info.offset() + to.offset();
  // pwrite past the end would grow a file its owner truncated: check the size first.
  if (FileSize((*region)->fd) < start + bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": region \"", info.name(), "\" ends before byte ", start + bytes,
                     " of its file now (truncated under the call?)"));
  }
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = pwrite((*region)->fd, tensor->data().data() + done,
                             static_cast<size_t>(bytes - done), start + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": writing region \"", info.name(), "\" failed after ", done, " of ",
                       bytes, " bytes", n < 0 ? absl::StrCat(": ", std::strerror(errno)) : ""));
    }
    done += n;
  }
  tensor->clear_data();
  *tensor->mutable_shared_memory() = to;
  return absl::OkStatus();
}

}  // namespace attn
