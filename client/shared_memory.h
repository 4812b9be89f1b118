// Shared memory from the caller's side (attnd --allow-shared-memory; attention.proto's
// RegisterSharedMemory): a file in /dev/shm this process creates and maps, and Tensors that name
// a range of a registered region instead of carrying their bytes. Register the file with
// Client::RegisterSharedMemory({name, file.key(), 0, file.size()}), write inputs into data(),
// send SharedTensor(...)s (and an output_to for the answer), read outputs from data().
//
// The server never maps the file (it reads and writes it by offset), so truncating or removing
// it under a call fails that call only. Only callers on the server's machine can use it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"

namespace attn::client {

class SharedMemoryFile {
 public:
  // Creates /dev/shm/NAME (key "/NAME": shm_open's name) of `size` bytes, mapped read-write;
  // ALREADY_EXISTS when the name is taken. The file is removed with the object.
  static absl::StatusOr<std::unique_ptr<SharedMemoryFile>> Create(const std::string& name,
                                                                  int64_t size);
  ~SharedMemoryFile();
  SharedMemoryFile(const SharedMemoryFile&) = delete;
  SharedMemoryFile& operator=(const SharedMemoryFile&) = delete;

  const std::string& key() const { return key_; }
  int64_t size() const { return size_; }
  char* data() const { return data_; }

 private:
  SharedMemoryFile(std::string key, int64_t size, char* data)
      : key_(std::move(key)), size_(size), data_(data) {}
  std::string key_;
  int64_t size_;
  char* data_;
};

// A Tensor of `shape` and `dtype` whose bytes are at `offset` of the caller's region `region`
// (byte_size from the shape and dtype).
attention::v1::Tensor SharedTensor(const std::vector<int64_t>& shape, attention::v1::DType dtype,
                                   const std::string& region, int64_t offset);

// The reference to `bytes` bytes at `offset` of region `region` (an output_to).
attention::v1::SharedMemoryRef SharedRange(const std::string& region, int64_t offset,
                                           int64_t bytes);

}  // namespace attn::client
