// Shared memory for co-located callers (issue 32, part 2; server/shared_memory.h): the registry's
// checks (off by default, names, keys, ranges, limits, one caller's regions invisible to
// another, a region truncated or unregistered under use failing the call and not the server),
// and through a service on loopback: Tiled and Decode with inputs and outputs in a region give
// the bits of the same calls inline, and bad references are refused naming the field, changing
// no cache.
#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/dtype_mapping.h"
#include "server/service.h"
#include "tests/reference.h"

namespace attn {
namespace {

namespace v1 = attention::v1;

// A file in /dev/shm of `size` bytes, removed with the object.
class ShmFile {
 public:
  explicit ShmFile(int64_t size) {
    static std::atomic<int> count{0};
    name_ = "/attn-shm-test-" + std::to_string(getpid()) + "-" + std::to_string(count++);
    fd_ = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd_, size), 0);
  }
  ~ShmFile() {
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& key() const { return name_; }
  void Write(int64_t offset, const void* data, size_t size) {
    ASSERT_EQ(pwrite(fd_, data, size, offset), static_cast<ssize_t>(size));
  }
  std::string Read(int64_t offset, size_t size) {
    std::string bytes(size, '\0');
    EXPECT_EQ(pread(fd_, bytes.data(), size, offset), static_cast<ssize_t>(size));
    return bytes;
  }
  void Truncate(int64_t size) { ASSERT_EQ(ftruncate(fd_, size), 0); }

 private:
  std::string name_;
  int fd_ = -1;
};

v1::RegisterSharedMemoryRequest Registration(const std::string& name, const std::string& key,
                                             int64_t offset, int64_t byte_size) {
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return request;
}

v1::SharedMemoryRef Ref(const std::string& region, int64_t offset, int64_t byte_size) {
  v1::SharedMemoryRef ref;
  ref.set_region(region);
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

v1::Tensor Inline(std::vector<int64_t> shape, const std::vector<uint8_t>& bytes, DType dtype) {
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_dtype(ToProtoDType(dtype));
  tensor.set_data(bytes.data(), bytes.size());
  return tensor;
}

// The same tensor with its bytes at `offset` of region "io" (written there) instead.
v1::Tensor InRegion(const v1::Tensor& tensor, ShmFile& file, int64_t region_offset,
                    int64_t offset) {
  v1::Tensor shared = tensor;
  shared.clear_data();
  file.Write(region_offset + offset, tensor.data().data(), tensor.data().size());
  *shared.mutable_shared_memory() = Ref("io", offset, static_cast<int64_t>(tensor.data().size()));
  return shared;
}

void ExpectCode(const absl::Status& status, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(text), std::string::npos) << status;
}

TEST(SharedMemoryRegistryTest, OffByDefaultNamesTheFlag) {
  ShmFile file(4096);
  SharedMemoryRegistry registry(false, 1 << 20);
  ExpectCode(registry.Register("", Registration("io", file.key(), 0, 4096)).status(),
             absl::StatusCode::kFailedPrecondition, "--allow-shared-memory");
  v1::AttentionRequest request;
  *request.mutable_query()->mutable_shared_memory() = Ref("io", 0, 16);
  ExpectCode(registry.Resolve("", request).status(), absl::StatusCode::kFailedPrecondition,
             "--allow-shared-memory");
}

TEST(SharedMemoryRegistryTest, RegisterChecksNameKeyRangeAndLimits) {
  ShmFile file(4096);
  SharedMemoryRegistry registry(true, 1 << 20);
  ExpectCode(registry.Register("", Registration("", file.key(), 0, 16)).status(),
             absl::StatusCode::kInvalidArgument, "name:");
  ExpectCode(registry.Register("", Registration("a b", file.key(), 0, 16)).status(),
             absl::StatusCode::kInvalidArgument, "name:");
  for (const std::string key : {"/../etc/passwd", "/dev/shm/../x", "relative", "/a/b", "/", ".."}) {
    SCOPED_TRACE(key);
    ExpectCode(registry.Register("", Registration("io", key, 0, 16)).status(),
               absl::StatusCode::kInvalidArgument, "key:");
  }
  ExpectCode(registry.Register("", Registration("io", "/attn-no-such-file", 0, 16)).status(),
             absl::StatusCode::kNotFound, "does not exist");
  ExpectCode(registry.Register("", Registration("io", file.key(), 4000, 97)).status(),
             absl::StatusCode::kOutOfRange, "past the end");
  ExpectCode(registry.Register("", Registration("io", file.key(), -1, 16)).status(),
             absl::StatusCode::kInvalidArgument, "offset:");
  ExpectCode(registry.Register("", Registration("io", file.key(), 0, 0)).status(),
             absl::StatusCode::kInvalidArgument, "byte_size:");
  // The /dev/shm path form names the same file.
  absl::StatusOr<v1::SharedMemoryRegion> region =
      registry.Register("", Registration("io", "/dev/shm" + file.key(), 96, 4000));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_TRUE(region->writable());
  EXPECT_EQ(region->byte_size(), 4000);
  ExpectCode(registry.Register("", Registration("io", file.key(), 0, 16)).status(),
             absl::StatusCode::kAlreadyExists, "name:");
  for (int i = 1; i < SharedMemoryRegistry::kMaxRegionsPerOwner; ++i) {
    ASSERT_TRUE(
        registry.Register("", Registration("r" + std::to_string(i), file.key(), 0, 16)).ok());
  }
  ExpectCode(registry.Register("", Registration("one-more", file.key(), 0, 16)).status(),
             absl::StatusCode::kResourceExhausted, "at most 64 per caller");
  absl::StatusOr<std::vector<std::string>> all = registry.Unregister("", "");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), static_cast<size_t>(SharedMemoryRegistry::kMaxRegionsPerOwner));
  EXPECT_TRUE(registry.Status("", "")->empty());
  ExpectCode(registry.Unregister("", "io").status(), absl::StatusCode::kNotFound, "name:");
}

// Regions belong to the identity that registered them: another sees none, cannot use one by
// name, and may register the same name for itself.
TEST(SharedMemoryRegistryTest, ACallerSeesAndUsesOnlyItsOwnRegions) {
  ShmFile file(4096);
  SharedMemoryRegistry registry(true, 1 << 20);
  ASSERT_TRUE(registry.Register("x509:A", Registration("io", file.key(), 0, 4096)).ok());
  EXPECT_EQ(registry.Status("x509:A", "")->size(), 1u);
  EXPECT_TRUE(registry.Status("x509:B", "")->empty());
  ExpectCode(registry.Status("x509:B", "io").status(), absl::StatusCode::kNotFound, "io");
  v1::AttentionRequest request;
  request.mutable_query()->add_shape(2);
  request.mutable_query()->add_shape(2);
  request.mutable_query()->set_dtype(v1::DTYPE_FLOAT32);
  *request.mutable_query()->mutable_shared_memory() = Ref("io", 0, 16);
  ExpectCode(registry.Resolve("x509:B", request).status(), absl::StatusCode::kNotFound,
             "query.shared_memory.region");
  EXPECT_TRUE(registry.Resolve("x509:A", request).ok());
  ExpectCode(registry.Unregister("x509:B", "io").status(), absl::StatusCode::kNotFound, "io");
  EXPECT_TRUE(registry.Register("x509:B", Registration("io", file.key(), 0, 64)).ok());
}

// A region truncated under the server fails the call that reads or writes it (no SIGBUS: the
// file is never mapped), and the call after the file grows back succeeds. A region unregistered
// is NOT_FOUND to the next call.
TEST(SharedMemoryRegistryTest, ATruncatedOrUnregisteredRegionFailsTheCallOnly) {
  ShmFile file(4096);
  SharedMemoryRegistry registry(true, 1 << 20);
  ASSERT_TRUE(registry.Register("", Registration("io", file.key(), 1024, 2048)).ok());
  v1::DecodeRequest request;
  v1::Tensor* query = request.add_items()->mutable_query();
  query->add_shape(4);
  query->add_shape(8);
  query->set_dtype(v1::DTYPE_FLOAT32);
  *query->mutable_shared_memory() = Ref("io", 512, 128);
  const std::vector<float> values = {1.5f, -2.f, 3.25f};
  file.Write(1024 + 512, values.data(), sizeof(float) * values.size());
  absl::StatusOr<std::shared_ptr<const v1::DecodeRequest>> resolved = registry.Resolve("", request);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_FALSE((*resolved)->items(0).query().has_shared_memory());
  ASSERT_EQ((*resolved)->items(0).query().data().size(), 128u);
  EXPECT_EQ(std::memcmp((*resolved)->items(0).query().data().data(), values.data(), 12), 0);

  file.Truncate(1024 + 600);  // Inside the query's range.
  ExpectCode(registry.Resolve("", request).status(), absl::StatusCode::kFailedPrecondition,
             "items[0].query.shared_memory: region \"io\" ends at byte");
  v1::Tensor output = (*resolved)->items(0).query();
  ExpectCode(registry.WriteOutput("", Ref("io", 512, 128), "items[0].output_to", &output),
             absl::StatusCode::kFailedPrecondition, "items[0].output_to: region \"io\" ends");
  EXPECT_EQ(output.data().size(), 128u);  // Untouched.
  file.Truncate(4096);
  EXPECT_TRUE(registry.Resolve("", request).ok());

  // Wrong sizes and ranges, each naming the field.
  query->mutable_shared_memory()->set_byte_size(64);
  ExpectCode(registry.Resolve("", request).status(), absl::StatusCode::kInvalidArgument,
             "items[0].query.shared_memory.byte_size: is 64 but the tensor's shape and dtype "
             "need 128 bytes");
  *query->mutable_shared_memory() = Ref("io", 2000, 128);
  ExpectCode(registry.Resolve("", request).status(), absl::StatusCode::kOutOfRange,
             "items[0].query.shared_memory: offset 2000 + byte_size 128 is outside region");
  *query->mutable_shared_memory() = Ref("io", 0, 128);
  query->set_data("x");
  ExpectCode(registry.Resolve("", request).status(), absl::StatusCode::kInvalidArgument,
             "items[0].query.data: must be empty");
  query->clear_data();
  ExpectCode(registry.WriteOutput("", Ref("io", 0, 100), "output_to", &output),
             absl::StatusCode::kInvalidArgument, "output_to.byte_size: is 100 but the output");

  ASSERT_TRUE(registry.Unregister("", "io").ok());
  ExpectCode(registry.Resolve("", request).status(), absl::StatusCode::kNotFound,
             "items[0].query.shared_memory.region");
}

// A request may name at most --max-message-bytes in shared memory, all its tensors together.
TEST(SharedMemoryRegistryTest, ARequestNamesAtMostAMessagesBytes) {
  ShmFile file(8192);
  SharedMemoryRegistry registry(true, 4096);
  ASSERT_TRUE(registry.Register("", Registration("io", file.key(), 0, 8192)).ok());
  v1::AttentionRequest request;
  for (v1::Tensor* tensor : {request.mutable_query(), request.mutable_key()}) {
    tensor->add_shape(16);
    tensor->add_shape(48);
    tensor->set_dtype(v1::DTYPE_FLOAT32);
  }
  *request.mutable_query()->mutable_shared_memory() = Ref("io", 0, 3072);
  *request.mutable_key()->mutable_shared_memory() = Ref("io", 3072, 3072);
  ExpectCode(registry.Resolve("", request).status(), absl::StatusCode::kResourceExhausted,
             "key.shared_memory: the request's tensors in shared memory pass --max-message-bytes");
}

class SharedMemoryServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = std::make_unique<CpuBackend>(2, int64_t{1} << 28);
    ServiceConfig config;
    config.caches = {.budget_bytes = int64_t{64} << 20, .idle_seconds = 0};
    config.allow_shared_memory = true;
    service_ = std::make_unique<AttentionService>(*backend_, config);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::AttentionService::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                              grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  template <class Request, class Response>
  grpc::Status Call(grpc::Status (v1::AttentionService::Stub::*method)(grpc::ClientContext*,
                                                                       const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return (stub_.get()->*method)(&context, request, response);
  }

  // Registers `file` from byte 256 on as region "io".
  void RegisterIo(ShmFile& file, int64_t size) {
    v1::SharedMemoryRegion region;
    const grpc::Status status = Call(&v1::AttentionService::Stub::RegisterSharedMemory,
                                     Registration("io", file.key(), 256, size - 256), &region);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  std::string CreateCache(int64_t kv_heads, int64_t head_dim, DType dtype) {
    v1::CreateCacheRequest request;
    request.set_kv_heads(kv_heads);
    request.set_head_dim(head_dim);
    request.set_dtype(ToProtoDType(dtype));
    v1::CacheInfo info;
    EXPECT_TRUE(Call(&v1::AttentionService::Stub::CreateCache, request, &info).ok());
    return info.cache_id();
  }

  std::unique_ptr<CpuBackend> backend_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

// Tiled with q, k and v in a region and its output written into the region: the output's bytes
// are those of the same call inline, and the answer names where they are.
TEST_F(SharedMemoryServiceTest, TiledFromAndIntoARegionGivesTheInlineBits) {
  const testing::HostProblem p = testing::RandomProblem(testing::MakeShape(1, 6, 2, 13, 37, 24, 17),
                                                        DType::kBFloat16, true, 8, 7);
  const Shape& s = p.shape;
  v1::AttentionRequest inline_request;
  *inline_request.mutable_query() =
      Inline({s.heads, s.query_len, s.head_dim}, p.query_bytes, p.dtype);
  *inline_request.mutable_key() = Inline({s.kv_heads, s.key_len, s.head_dim}, p.key_bytes, p.dtype);
  *inline_request.mutable_value() =
      Inline({s.kv_heads, s.key_len, s.value_dim}, p.value_bytes, p.dtype);
  inline_request.mutable_options()->set_causal(true);
  inline_request.mutable_options()->set_block_k(8);
  v1::AttentionResponse inline_response;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::Tiled, inline_request, &inline_response).ok());

  ShmFile file(1 << 16);
  RegisterIo(file, 1 << 16);
  v1::AttentionRequest request = inline_request;
  int64_t offset = 0;
  for (v1::Tensor* tensor :
       {request.mutable_query(), request.mutable_key(), request.mutable_value()}) {
    *tensor = InRegion(*tensor, file, 256, offset);
    offset += tensor->shared_memory().byte_size();
  }
  const int64_t output_bytes = static_cast<int64_t>(inline_response.output().data().size());
  *request.mutable_output_to() = Ref("io", offset, output_bytes);
  EXPECT_LT(request.ByteSizeLong(), 200u);  // Shapes and references only.
  v1::AttentionResponse response;
  const grpc::Status status = Call(&v1::AttentionService::Stub::Tiled, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(response.output().data().empty());
  EXPECT_EQ(response.output().shared_memory().offset(), offset);
  EXPECT_EQ(response.output().shape_size(), 3);
  EXPECT_EQ(file.Read(256 + offset, output_bytes), inline_response.output().data());

  // The output's range of the wrong size: refused naming it.
  request.mutable_output_to()->set_byte_size(output_bytes - 2);
  EXPECT_EQ(Call(&v1::AttentionService::Stub::Tiled, request, &response).error_message(),
            "output_to.byte_size: is " + std::to_string(output_bytes - 2) +
                " but the output takes " + std::to_string(output_bytes) + " bytes");
  // A Trace takes its tensors inline.
  v1::TraceRequest trace;
  *trace.mutable_attention() = request;
  trace.mutable_attention()->clear_output_to();
  grpc::ClientContext context;
  auto reader = stub_->Trace(&context, trace);
  v1::TraceEvent event;
  while (reader->Read(&event)) {
  }
  const grpc::Status traced = reader->Finish();
  EXPECT_EQ(traced.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(traced.error_message().find("query.shared_memory: this call takes its tensors inline"),
            std::string::npos)
      << traced.error_message();
}

// A decode step with the new token's q, k, v in a region and its output into it equals the same
// step inline on a twin cache, bit for bit; a bad output range fails the whole step and leaves
// its cache as it was.
TEST_F(SharedMemoryServiceTest, ADecodeStepFromAndIntoARegionEqualsTheInlineStep) {
  const testing::HostProblem p = testing::RandomProblem(testing::MakeShape(1, 8, 2, 1, 41, 32, 32),
                                                        DType::kBFloat16, true, 8, 9);
  const Shape& s = p.shape;
  const int64_t cached = s.key_len - 1, element = 2;
  const std::string inline_id = CreateCache(s.kv_heads, s.head_dim, p.dtype);
  const std::string shared_id = CreateCache(s.kv_heads, s.head_dim, p.dtype);
  auto tokens = [&](const std::vector<uint8_t>& bytes, int64_t begin, int64_t end) {
    std::vector<uint8_t> slice;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const uint8_t* first = bytes.data() + (h * s.key_len + begin) * s.head_dim * element;
      slice.insert(slice.end(), first, first + (end - begin) * s.head_dim * element);
    }
    return Inline({s.kv_heads, end - begin, s.head_dim}, slice, p.dtype);
  };
  for (const std::string& id : {inline_id, shared_id}) {
    v1::AppendCacheRequest append;
    append.set_cache_id(id);
    *append.mutable_key() = tokens(p.key_bytes, 0, cached);
    *append.mutable_value() = tokens(p.value_bytes, 0, cached);
    v1::CacheInfo info;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::AppendCache, append, &info).ok());
  }
  v1::DecodeRequest inline_step;
  inline_step.mutable_options()->set_causal(true);
  v1::DecodeItem* item = inline_step.add_items();
  item->set_cache_id(inline_id);
  item->set_expected_length(cached);
  *item->mutable_query() = Inline({s.heads, 1, s.head_dim}, p.query_bytes, p.dtype);
  *item->mutable_key() = tokens(p.key_bytes, cached, s.key_len);
  *item->mutable_value() = tokens(p.value_bytes, cached, s.key_len);
  v1::DecodeResponse inline_response;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::Decode, inline_step, &inline_response).ok());

  ShmFile file(1 << 14);
  RegisterIo(file, 1 << 14);
  v1::DecodeRequest step = inline_step;
  v1::DecodeItem* shared = step.mutable_items(0);
  shared->set_cache_id(shared_id);
  *shared->mutable_query() = InRegion(shared->query(), file, 256, 0);
  *shared->mutable_key() = InRegion(shared->key(), file, 256, 4096);
  *shared->mutable_value() = InRegion(shared->value(), file, 256, 6144);
  const int64_t output_bytes = static_cast<int64_t>(inline_response.outputs(0).data().size());
  *shared->mutable_output_to() = Ref("io", 8192, output_bytes - 1);
  v1::DecodeResponse response;
  EXPECT_EQ(Call(&v1::AttentionService::Stub::Decode, step, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::GetCacheInfoRequest info_request;
  info_request.set_cache_id(shared_id);
  v1::CacheInfo info;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::GetCacheInfo, info_request, &info).ok());
  EXPECT_EQ(info.length(), cached);  // The failed step's token was taken back.

  shared->mutable_output_to()->set_byte_size(output_bytes);
  const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, step, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.caches(0).length(), cached + 1);
  EXPECT_TRUE(response.outputs(0).data().empty());
  EXPECT_EQ(file.Read(256 + 8192, output_bytes), inline_response.outputs(0).data());

  // An unknown region: NOT_FOUND naming the field, the cache as it was.
  shared->mutable_query()->mutable_shared_memory()->set_region("elsewhere");
  shared->set_expected_length(cached + 1);
  const grpc::Status unknown = Call(&v1::AttentionService::Stub::Decode, step, &response);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(unknown.error_message().find("items[0].query.shared_memory.region"), std::string::npos)
      << unknown.error_message();
}

// Regions unregistered, registered again, truncated and grown back while calls read them from
// two threads: every call answers OK (the bytes it read) or fails cleanly — NOT_FOUND (no such
// region then), FAILED_PRECONDITION (the file ended under it) or OUT_OF_RANGE (a new, shorter
// registration) — and the server goes on answering.
TEST_F(SharedMemoryServiceTest, RegionsChangingUnderCallsFailThoseCallsOnly) {
  const testing::HostProblem p = testing::RandomProblem(testing::MakeShape(1, 4, 2, 7, 300, 32, 32),
                                                        DType::kFloat32, false, 8, 11);
  const Shape& s = p.shape;
  ShmFile file(1 << 18);
  RegisterIo(file, 1 << 18);
  v1::AttentionRequest request;
  int64_t offset = 0;
  const struct {
    v1::Tensor* tensor;
    std::vector<int64_t> shape;
    const std::vector<uint8_t>* bytes;
  } inputs[] = {{request.mutable_query(), {s.heads, s.query_len, s.head_dim}, &p.query_bytes},
                {request.mutable_key(), {s.kv_heads, s.key_len, s.head_dim}, &p.key_bytes},
                {request.mutable_value(), {s.kv_heads, s.key_len, s.value_dim}, &p.value_bytes}};
  for (const auto& input : inputs) {
    *input.tensor = InRegion(Inline(input.shape, *input.bytes, p.dtype), file, 256, offset);
    offset += static_cast<int64_t>(input.bytes->size());
  }
  std::atomic<bool> done{false};
  std::atomic<int> ok{0}, refused{0}, other{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 2; ++t) {
    callers.emplace_back([&] {
      while (!done.load()) {
        v1::AttentionResponse response;
        const grpc::Status status = Call(&v1::AttentionService::Stub::Tiled, request, &response);
        const grpc::StatusCode code = status.error_code();
        if (code == grpc::StatusCode::OK) {
          ++ok;
        } else if (code == grpc::StatusCode::NOT_FOUND ||
                   code == grpc::StatusCode::FAILED_PRECONDITION ||
                   code == grpc::StatusCode::OUT_OF_RANGE) {
          ++refused;
        } else {
          ++other;
          ADD_FAILURE() << status.error_code() << ": " << status.error_message();
        }
      }
    });
  }
  for (int round = 0; round < 200; ++round) {
    v1::UnregisterSharedMemoryRequest unregister;
    unregister.set_name("io");
    v1::UnregisterSharedMemoryResponse names;
    ASSERT_TRUE(Call(&v1::AttentionService::Stub::UnregisterSharedMemory, unregister, &names).ok());
    RegisterIo(file, round % 2 == 0 ? 1 << 18 : 4096);  // Shorter: the key's range is outside.
    file.Truncate(round % 3 == 0 ? 300 : 1 << 18);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    file.Truncate(1 << 18);
  }
  done.store(true);
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(ok.load() + refused.load(), 0);
  v1::ServerInfo info;
  EXPECT_TRUE(
      Call(&v1::AttentionService::Stub::GetServerInfo, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_TRUE(info.shared_memory());
}

// Off by default: every shared-memory call is FAILED_PRECONDITION naming the flag.
TEST(SharedMemoryOffTest, RegisterAndTensorsInRegionsNameTheFlag) {
  CpuBackend backend(1, int64_t{1} << 28);
  AttentionService service(backend, ServiceConfig{});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  ShmFile file(4096);
  {
    grpc::ClientContext context;
    v1::SharedMemoryRegion region;
    const grpc::Status status =
        stub->RegisterSharedMemory(&context, Registration("io", file.key(), 0, 4096), &region);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(status.error_message().find("--allow-shared-memory"), std::string::npos);
  }
  {
    grpc::ClientContext context;
    v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
    EXPECT_FALSE(info.shared_memory());
  }
  server->Shutdown();
}

}  // namespace
}  // namespace attn
