#include "server/shared_memory.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <limits>

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

absl::Status SharedMemoryRegistry::CheckTensorRef(const std::string& owner,
                                                  const std::string& field,
                                                  const v1::Tensor& tensor, int64_t* total,
                                                  PendingRead* read) const {
  read->field = absl::StrCat(field, ".shared_memory");
  const v1::SharedMemoryRef& ref = tensor.shared_memory();
  if (!tensor.data().empty()) {
    return Invalid(absl::StrCat(field, ".data"),
                   "must be empty when shared_memory names the tensor's bytes");
  }
  absl::StatusOr<std::shared_ptr<const Region>> region = Find(owner, ref, read->field);
  if (!region.ok()) return region.status();
  const v1::SharedMemoryRegion& info = (*region)->info;
  if (!Within(ref.offset(), ref.byte_size(), info.byte_size())) {
    return absl::OutOfRangeError(
        absl::StrCat(read->field, ": offset ", ref.offset(), " + byte_size ", ref.byte_size(),
                     " is outside region \"", info.name(), "\" (", info.byte_size(), " bytes)"));
  }
  if (const std::optional<int64_t> bytes = TensorBytes(tensor);
      bytes && *bytes != ref.byte_size()) {
    return Invalid(absl::StrCat(read->field, ".byte_size"),
                   absl::StrCat("is ", ref.byte_size(), " but the tensor's shape and dtype need ",
                                *bytes, " bytes"));
  }
  if (ref.byte_size() > max_bytes_ - *total) {
    return absl::ResourceExhaustedError(absl::StrCat(
        read->field, ": the request's tensors in shared memory pass --max-message-bytes (",
        max_bytes_, "), the most an inline request may carry"));
  }
  *total += ref.byte_size();
  read->region = *std::move(region);
  read->start = info.offset() + ref.offset();
  read->bytes = ref.byte_size();
  return absl::OkStatus();
}

namespace {

// Reads file bytes [start, start + bytes) into `out`; how many it could (short: the file ends).
int64_t ReadFully(int fd, char* out, int64_t start, int64_t bytes, int* error) {
  int64_t done = 0;
  *error = 0;
  while (done < bytes) {
    const ssize_t n = pread(fd, out + done, static_cast<size_t>(bytes - done), start + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      *error = n < 0 ? errno : 0;
      break;
    }
    done += n;
  }
  return done;
}

absl::Status Truncated(const std::string& field, const std::string& region, int64_t at,
                       int64_t wanted_end, int error) {
  return absl::FailedPreconditionError(
      absl::StrCat(field, ": region \"", region, "\" ends at byte ", at,
                   " of its file now (truncated under the call?), before byte ", wanted_end,
                   error != 0 ? absl::StrCat(": ", std::strerror(error)) : ""));
}

}  // namespace

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

std::vector<v1::Tensor*> SharedMemoryRegistry::TensorsOf(v1::AttentionRequest& request,
                                                         std::vector<std::string>* fields) {
  using M = v1::AttentionRequest;
  if (fields != nullptr) *fields = {"query", "key", "value"};
  return {Present(request.has_query(), &request, &M::mutable_query),
          Present(request.has_key(), &request, &M::mutable_key),
          Present(request.has_value(), &request, &M::mutable_value)};
}

std::vector<v1::Tensor*> SharedMemoryRegistry::TensorsOf(v1::AppendCacheRequest& request,
                                                         std::vector<std::string>* fields) {
  using M = v1::AppendCacheRequest;
  if (fields != nullptr) *fields = {"key", "value"};
  return {Present(request.has_key(), &request, &M::mutable_key),
          Present(request.has_value(), &request, &M::mutable_value)};
}

std::vector<v1::Tensor*> SharedMemoryRegistry::TensorsOf(v1::DecodeRequest& request,
                                                         std::vector<std::string>* fields) {
  using M = v1::DecodeItem;
  std::vector<v1::Tensor*> tensors;
  for (int i = 0; i < request.items_size(); ++i) {
    M* item = request.mutable_items(i);
    tensors.push_back(Present(item->has_query(), item, &M::mutable_query));
    tensors.push_back(Present(item->has_key(), item, &M::mutable_key));
    tensors.push_back(Present(item->has_value(), item, &M::mutable_value));
    if (fields != nullptr) {
      for (const char* name : {"query", "key", "value"}) {
        fields->push_back(absl::StrCat("items[", i, "].", name));
      }
    }
  }
  return tensors;
}

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
    for (v1::Tensor* tensor : TensorsOf(*done, nullptr)) {
      if (tensor != nullptr) GiveBack(*tensor);
    }
    delete done;
  });
}

absl::Status SharedMemoryRegistry::ResolveEach(const std::string& owner,
                                               const std::vector<std::string>& fields,
                                               const std::vector<v1::Tensor*>& tensors) const {
  // Every reference checked before any byte is read; their bytes together within max_bytes_.
  std::vector<PendingRead> reads;
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    v1::Tensor* tensor = tensors[i];
    if (tensor == nullptr || !tensor->has_shared_memory()) continue;
    PendingRead read;
    read.tensor = tensor;
    if (absl::Status status = CheckTensorRef(owner, fields[i], *tensor, &total, &read);
        !status.ok()) {
      return status;
    }
    reads.push_back(std::move(read));
  }
  // Small tensors of one region (a decode step's q, k and v of every item) in one read of the
  // span that covers them, when that span is mostly theirs: a system call per tensor costs more
  // than their bytes. Large ones each into a recycled buffer of their own.
  std::vector<bool> done(reads.size(), false);
  // Kept by each thread between calls: a fresh buffer of this size costs page faults that cost
  // more than the read.
  thread_local std::string span;
  for (size_t first = 0; first < reads.size(); ++first) {
    if (done[first] || reads[first].bytes >= kPooledBytes) continue;
    const Region* region = reads[first].region.get();
    int64_t begin = reads[first].start, end = reads[first].start + reads[first].bytes, sum = 0;
    std::vector<size_t> group;
    for (size_t i = first; i < reads.size(); ++i) {
      if (done[i] || reads[i].region.get() != region || reads[i].bytes >= kPooledBytes) continue;
      group.push_back(i);
      begin = std::min(begin, reads[i].start);
      end = std::max(end, reads[i].start + reads[i].bytes);
      sum += reads[i].bytes;
    }
    if (group.size() < 2 || end - begin > 2 * sum + kSpanSlackBytes ||
        end - begin > kMaxSpanBytes) {
      continue;
    }
    span.resize(static_cast<size_t>(end - begin));
    int error;
    const int64_t got = ReadFully(region->fd, span.data(), begin, end - begin, &error);
    for (const size_t i : group) {
      PendingRead& read = reads[i];
      if (read.start + read.bytes > begin + got) {
        return Truncated(read.field, region->info.name(), begin + got, read.start + read.bytes,
                         error);
      }
      read.tensor->mutable_data()->assign(span.data() + (read.start - begin),
                                          static_cast<size_t>(read.bytes));
      done[i] = true;
    }
  }
  for (size_t i = 0; i < reads.size(); ++i) {
    if (done[i]) continue;
    PendingRead& read = reads[i];
    std::string* data = read.tensor->mutable_data();
    if (read.bytes >= kPooledBytes) *data = TakeBuffer(read.bytes);
    data->resize(static_cast<size_t>(read.bytes));
    int error;
    const int64_t got = ReadFully(read.region->fd, data->data(), read.start, read.bytes, &error);
    if (got < read.bytes) {
      return Truncated(read.field, read.region->info.name(), read.start + got,
                       read.start + read.bytes, error);
    }
  }
  for (PendingRead& read : reads) read.tensor->clear_shared_memory();
  return absl::OkStatus();
}

template <class Request>
absl::StatusOr<std::shared_ptr<const Request>> SharedMemoryRegistry::ResolveCopy(
    const std::string& owner, const Request& request) const {
  if (absl::Status status = CheckAllowed(); !status.ok()) return status;
  std::shared_ptr<Request> copy = Recycled(new Request(request));
  std::vector<std::string> fields;
  const std::vector<v1::Tensor*> tensors = TensorsOf(*copy, &fields);
  if (absl::Status status = ResolveEach(owner, fields, tensors); !status.ok()) return status;
  return copy;
}

absl::StatusOr<std::shared_ptr<const v1::AttentionRequest>> SharedMemoryRegistry::Resolve(
    const std::string& owner, const v1::AttentionRequest& request) const {
  return ResolveCopy(owner, request);
}

absl::StatusOr<std::shared_ptr<const v1::AppendCacheRequest>> SharedMemoryRegistry::Resolve(
    const std::string& owner, const v1::AppendCacheRequest& request) const {
  return ResolveCopy(owner, request);
}

absl::StatusOr<std::shared_ptr<const v1::DecodeRequest>> SharedMemoryRegistry::Resolve(
    const std::string& owner, const v1::DecodeRequest& request) const {
  return ResolveCopy(owner, request);
}

absl::Status SharedMemoryRegistry::WriteOutput(const std::string& owner,
                                               const v1::SharedMemoryRef& to,
                                               const std::string& field, v1::Tensor* tensor) const {
  std::vector<OutputWrite> writes = {{&to, field, tensor}};
  return WriteOutputs(owner, writes);
}

namespace {

// Writes `pieces` to the file from byte `start` on, back to back: one pwritev, then piece by
// piece from wherever it stopped. How many bytes were written.
int64_t WriteRun(int fd, int64_t start, const std::vector<iovec>& pieces, int* error) {
  int64_t total = 0;
  for (const iovec& piece : pieces) total += static_cast<int64_t>(piece.iov_len);
  *error = 0;
  int64_t done = 0;
  if (pieces.size() <= static_cast<size_t>(IOV_MAX)) {
    const ssize_t n = pwritev(fd, pieces.data(), static_cast<int>(pieces.size()), start);
    if (n > 0) done = n;
  }
  int64_t offset = 0;  // Of the current piece within the run.
  for (const iovec& piece : pieces) {
    const int64_t size = static_cast<int64_t>(piece.iov_len);
    while (done < offset + size) {
      const ssize_t n = pwrite(fd, static_cast<const char*>(piece.iov_base) + (done - offset),
                               static_cast<size_t>(offset + size - done), start + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        *error = n < 0 ? errno : 0;
        return done;
      }
      done += n;
    }
    offset += size;
  }
  return done;
}

}  // namespace

absl::Status SharedMemoryRegistry::WriteOutputs(const std::string& owner,
                                                std::vector<OutputWrite>& writes) const {
  struct Planned {
    OutputWrite* write;
    std::shared_ptr<const Region> region;
    int64_t start, bytes;
  };
  // Every range checked, and each region's file size read once, before any byte is written.
  std::vector<Planned> plan;
  for (OutputWrite& write : writes) {
    const v1::SharedMemoryRef& to = *write.to;
    const std::string& field = write.field;
    absl::StatusOr<std::shared_ptr<const Region>> region = Find(owner, to, field);
    if (!region.ok()) return region.status();
    const v1::SharedMemoryRegion& info = (*region)->info;
    const int64_t bytes = static_cast<int64_t>(write.tensor->data().size());
    if (!info.writable()) {
      return absl::FailedPreconditionError(absl::StrCat(field, ".region: region \"", info.name(),
                                                        "\" was opened read-only; outputs need a "
                                                        "file attnd can write"));
    }
    if (to.byte_size() != bytes) {
      return Invalid(
          absl::StrCat(field, ".byte_size"),
          absl::StrCat("is ", to.byte_size(), " but the output takes ", bytes, " bytes"));
    }
    if (!Within(to.offset(), to.byte_size(), info.byte_size())) {
      return absl::OutOfRangeError(absl::StrCat(field, ": offset ", to.offset(), " + byte_size ",
                                                to.byte_size(), " is outside region \"",
                                                info.name(), "\" (", info.byte_size(), " bytes)"));
    }
    plan.push_back({&write, *std::move(region), info.offset() + to.offset(), bytes});
  }
  // pwrite past the end would grow a file its owner truncated: each region's size checked first.
  std::map<const Region*, int64_t> sizes;
  for (const Planned& p : plan) {
    auto [it, fresh] = sizes.emplace(p.region.get(), 0);
    if (fresh) it->second = FileSize(p.region->fd);
    if (it->second < p.start + p.bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat(p.write->field, ": region \"", p.region->info.name(), "\" ends before byte ",
                       p.start + p.bytes, " of its file now (truncated under the call?)"));
    }
  }
  // Outputs that lie back to back in one file (a decode batch's) in one pwritev.
  std::sort(plan.begin(), plan.end(), [](const Planned& a, const Planned& b) {
    return a.region.get() != b.region.get() ? a.region.get() < b.region.get() : a.start < b.start;
  });
  for (size_t first = 0; first < plan.size();) {
    size_t last = first + 1;
    while (last < plan.size() && plan[last].region == plan[first].region &&
           plan[last].start == plan[last - 1].start + plan[last - 1].bytes) {
      ++last;
    }
    std::vector<iovec> pieces;
    for (size_t i = first; i < last; ++i) {
      const std::string& data = plan[i].write->tensor->data();
      pieces.push_back({const_cast<char*>(data.data()), data.size()});
    }
    int error;
    const int64_t written = WriteRun(plan[first].region->fd, plan[first].start, pieces, &error);
    for (size_t i = first; i < last; ++i) {
      if (plan[i].start + plan[i].bytes > plan[first].start + written) {
        return absl::FailedPreconditionError(
            absl::StrCat(plan[i].write->field, ": writing region \"", plan[i].region->info.name(),
                         "\" stopped at byte ", plan[first].start + written,
                         error != 0 ? absl::StrCat(": ", std::strerror(error)) : ""));
      }
    }
    first = last;
  }
  for (OutputWrite& write : writes) {
    write.tensor->clear_data();
    *write.tensor->mutable_shared_memory() = *write.to;
  }
  return absl::OkStatus();
}

}  // namespace attn
