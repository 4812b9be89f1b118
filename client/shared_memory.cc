#include "client/shared_memory.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "proto/dtype_mapping.h"

namespace attn::client {

namespace v1 = attention::v1;

absl::StatusOr<std::unique_ptr<SharedMemoryFile>> SharedMemoryFile::Create(const std::string& name,
                                                                           int64_t size) {
  if (size < 1) return absl::InvalidArgumentError("a shared-memory file needs at least one byte");
  const std::string key = absl::StrCat("/", name);
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int error = errno;
    if (error == EEXIST) return absl::AlreadyExistsError(absl::StrCat("/dev/shm", key, " exists"));
    return absl::InternalError(absl::StrCat("shm_open ", key, ": ", std::strerror(error)));
  }
  void* data = MAP_FAILED;
  if (ftruncate(fd, size) == 0) {
    data = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int error = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot size or map ", size, " bytes of /dev/shm", key, ": ", std::strerror(error)));
  }
  return std::unique_ptr<SharedMemoryFile>(
      new SharedMemoryFile(key, size, static_cast<char*>(data)));
}

SharedMemoryFile::~SharedMemoryFile() {
  munmap(data_, static_cast<size_t>(size_));
  shm_unlink(key_.c_str());
}

v1::Tensor SharedTensor(const std::vector<int64_t>& shape, v1::DType dtype,
                        const std::string& region, int64_t offset) {
  v1::Tensor tensor;
  int64_t bytes = ElementSize(FromProtoDType(dtype).value_or(DType::kFloat32));
  for (const int64_t extent : shape) {
    tensor.add_shape(extent);
    bytes *= extent;
  }
  tensor.set_dtype(dtype);
  *tensor.mutable_shared_memory() = SharedRange(region, offset, bytes);
  return tensor;
}

v1::SharedMemoryRef SharedRange(const std::string& region, int64_t offset, int64_t bytes) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(bytes);
  return ref;
}

}  // namespace attn::client
