// What no request, fault or shutdown may do to attnd (issue 27), on an in-process service with
// the CPU backend behind a backend that injects faults: an answer too large to send is refused
// before it is allocated; what a computation throws fails that call only; a Decode batch that
// fails at any stage leaves every cache as it was, and no reader ever sees its tokens; a trace
// nobody reads is cancelled; queued calls are answered at shutdown.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "attention/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/dtype_mapping.h"
#include "server/service.h"
#include "tests/reference.h"

namespace attn {
namespace {

namespace v1 = attention::v1;
using std::chrono::milliseconds;

// What the backend below does instead of computing.
enum class Fault { kNone, kError, kThrowBadAlloc, kThrowOther, kFailAppend };

// A KvStore whose appends fail while *fault is kFailAppend, once *countdown (shared by every
// store) reaches 0.
class FaultyStore final : public KvStore {
 public:
  FaultyStore(std::unique_ptr<KvStore> inner, const std::atomic<Fault>* fault,
              std::atomic<int>* countdown)
      : inner_(std::move(inner)), fault_(fault), countdown_(countdown) {}
  const KvLayout& layout() const override { return inner_->layout(); }
  int64_t page_tokens() const override { return inner_->page_tokens(); }
  int64_t length() const override { return inner_->length(); }
  int64_t bytes() const override { return inner_->bytes(); }
  int64_t BytesFor(int64_t length) const override { return inner_->BytesFor(length); }
  absl::Status Append(const TensorView& key, const TensorView& value, int64_t n) override {
    if (fault_->load() == Fault::kFailAppend && countdown_->fetch_sub(1) == 1) {
      return absl::ResourceExhaustedError("injected: the device is out of cache pages");
    }
    return inner_->Append(key, value, n);
  }
  void Truncate(int64_t length) override { inner_->Truncate(length); }
  const PagedKv& pages() const override { return inner_->pages(); }
  absl::Status CopyOut(int64_t begin, int64_t end, void* key, void* value) const override {
    return inner_->CopyOut(begin, end, key, value);
  }

 private:
  std::unique_ptr<KvStore> inner_;
  const std::atomic<Fault>* fault_;
  std::atomic<int>* countdown_;
};

// A trace cursor that throws after its first event.
class ThrowingCursor final : public TraceCursor {
 public:
  explicit ThrowingCursor(std::unique_ptr<TraceCursor> inner) : inner_(std::move(inner)) {}
  bool Next(TraceItem* item) override {
    if (events_++ > 0) throw std::runtime_error("injected: the trace cursor broke");
    return inner_->Next(item);
  }
  Stats stats() const override { return inner_->stats(); }

 private:
  std::unique_ptr<TraceCursor> inner_;
  int events_ = 0;
};

// The CPU backend, with `fault` injected into Naive, Tiled, Trace and Decode after `delay` (so
// that concurrent readers get a window in which a failing call has appended its tokens).
class FaultyBackend final : public Backend {
 public:
  FaultyBackend() : inner_(2, 0) {}
  std::atomic<Fault> fault{Fault::kNone};
  std::atomic<int> delay_ms{0};
  std::atomic<int> appends_until_failure{0};

  const char* name() const override { return inner_.name(); }
  std::string device() const override { return inner_.device(); }
  int64_t memory_bytes() const override { return inner_.memory_bytes(); }
  int default_block_k() const override { return inner_.default_block_k(); }
  int64_t max_naive_bytes() const override { return inner_.max_naive_bytes(); }
  int concurrency() const override { return 1; }
  absl::StatusOr<Stats> Naive(const Problem& problem, const Outputs& outputs) override {
    if (absl::Status injected = Inject(outputs); !injected.ok()) return injected;
    return inner_.Naive(problem, outputs);
  }
  absl::StatusOr<Stats> Tiled(const Problem& problem, const Outputs& outputs) override {
    if (absl::Status injected = Inject(outputs); !injected.ok()) return injected;
    return inner_.Tiled(problem, outputs);
  }
  absl::StatusOr<std::unique_ptr<TraceCursor>> Trace(const Problem& problem,
                                                     std::vector<RowRef> rows) override {
    absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = inner_.Trace(problem, std::move(rows));
    if (!cursor.ok() || fault.load() != Fault::kThrowOther) return cursor;
    return std::make_unique<ThrowingCursor>(*std::move(cursor));
  }
  absl::StatusOr<std::unique_ptr<KvStore>> CreateKvStore(const KvLayout& layout) override {
    absl::StatusOr<std::unique_ptr<KvStore>> store = inner_.CreateKvStore(layout);
    if (!store.ok()) return store;
    return std::make_unique<FaultyStore>(*std::move(store), &fault, &appends_until_failure);
  }
  int64_t kv_page_tokens() const override { return inner_.kv_page_tokens(); }
  absl::StatusOr<Stats> Decode(const std::vector<Problem>& problems,
                               const std::vector<Outputs>& outputs) override {
    if (absl::Status injected = Inject(outputs[0]); !injected.ok()) return injected;
    return inner_.Decode(problems, outputs);
  }

 private:
  // The fault, after the delay; then the call's interruption (a deadline passed meanwhile), as
  // a kernel checks it between pieces of work.
  absl::Status Inject(const Outputs& outputs) {
    std::this_thread::sleep_for(milliseconds(delay_ms.load()));
    switch (fault.load()) {
      case Fault::kError:
        return absl::InternalError("injected: the kernel failed");
      case Fault::kThrowBadAlloc:
        throw std::bad_alloc();
      case Fault::kThrowOther:
        throw std::runtime_error("injected: the kernel threw");
      default:
        return outputs.interrupt ? outputs.interrupt() : absl::OkStatus();
    }
  }
  CpuBackend inner_;
};

v1::Tensor Float32Tensor(std::vector<int64_t> shape, const std::vector<float>& values) {
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_dtype(v1::DTYPE_FLOAT32);
  tensor.set_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

std::vector<float> Random(size_t n, uint64_t seed) {
  std::vector<float> values(n);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& v : values) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<float>(static_cast<int64_t>(state >> 40) % 2001 - 1000) / 1000.f;
  }
  return values;
}

constexpr int64_t kMaxMessageBytes = int64_t{4} << 20;  // The service's reply limit here.
// The caches of the batch tests: 3 kv heads over 6 query heads, head_dim 7, value_dim 5.
constexpr int64_t kKvHeads = 3, kHeads = 6, kHeadDim = 7, kValueDim = 5;

class FaultTest : public ::testing::Test {
 protected:
  void Start(ServiceConfig config = {}) {
    config.max_message_bytes = kMaxMessageBytes;
    service_ = std::make_unique<AttentionService>(backend_, config);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(64 << 20);  // Larger than the reply limit: the service's.
    builder.SetMaxSendMessageSize(64 << 20);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::AttentionService::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                              grpc::InsecureChannelCredentials()));
  }
  void SetUp() override { Start(); }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  template <class Request, class Response>
  grpc::Status Call(grpc::Status (v1::AttentionService::Stub::*method)(grpc::ClientContext*,
                                                                       const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return (stub_.get()->*method)(&context, request, response);
  }

  // A cache of kKvHeads × kHeadDim / kValueDim fp32 holding `length` random tokens.
  std::string Cache(int64_t length, uint64_t seed, int64_t value_dim = kValueDim,
                    int64_t head_dim = kHeadDim, int64_t kv_heads = kKvHeads) {
    v1::CreateCacheRequest create;
    create.set_kv_heads(kv_heads);
    create.set_head_dim(head_dim);
    create.set_value_dim(value_dim);
    create.set_dtype(v1::DTYPE_FLOAT32);
    v1::CacheInfo info;
    grpc::Status status = Call(&v1::AttentionService::Stub::CreateCache, create, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    v1::AppendCacheRequest append;
    append.set_cache_id(info.cache_id());
    *append.mutable_key() =
        Float32Tensor({kv_heads, length, head_dim}, Random(kv_heads * length * head_dim, seed));
    *append.mutable_value() = Float32Tensor({kv_heads, length, value_dim},
                                            Random(kv_heads * length * value_dim, seed + 1));
    status = Call(&v1::AttentionService::Stub::AppendCache, append, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.cache_id();
  }

  int64_t LengthOf(const std::string& id) {
    v1::GetCacheInfoRequest request;
    request.set_cache_id(id);
    v1::CacheInfo info;
    const grpc::Status status = Call(&v1::AttentionService::Stub::GetCacheInfo, request, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.length();
  }

  // One Decode item over cache `id` (of the batch tests' layout) at its length now: `rows` query
  // rows, and `add` new tokens when > 0.
  v1::DecodeItem Item(const std::string& id, int64_t rows, int64_t add, uint64_t seed,
                      int64_t value_dim = kValueDim) {
    v1::DecodeItem item;
    item.set_cache_id(id);
    item.set_expected_length(LengthOf(id));
    *item.mutable_query() =
        Float32Tensor({kHeads, rows, kHeadDim}, Random(kHeads * rows * kHeadDim, seed));
    if (add > 0) {
      *item.mutable_key() =
          Float32Tensor({kKvHeads, add, kHeadDim}, Random(kKvHeads * add * kHeadDim, seed + 7));
      *item.mutable_value() =
          Float32Tensor({kKvHeads, add, value_dim}, Random(kKvHeads * add * value_dim, seed + 9));
    }
    return item;
  }

  // The output bytes of a Decode of one query row (no new tokens) over each cache.
  std::vector<std::string> Snapshot(const std::vector<std::string>& ids) {
    std::vector<std::string> outputs;
    for (const std::string& id : ids) {
      v1::DecodeRequest request;
      *request.add_items() = Item(id, 1, 0, 99);
      v1::DecodeResponse response;
      const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, request, &response);
      EXPECT_TRUE(status.ok()) << status.error_message();
      outputs.push_back(status.ok() ? response.outputs(0).data() : "");
    }
    return outputs;
  }

  FaultyBackend backend_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

void ExpectRefused(const grpc::Status& status, grpc::StatusCode code, const std::string& needle) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_NE(status.error_message().find(needle), std::string::npos) << status.error_message();
}

// The attack: 4.3 MB asking for a 262 GB output. Before the fix, the process died of
// std::bad_alloc; now the call is refused, naming the field and the limit, and every cache
// decodes exactly as before.
TEST_F(FaultTest, AnAnswerTooLargeToSendIsRefusedBeforeItIsAllocated) {
  const std::vector<std::string> caches = {Cache(37, 1), Cache(300, 2)};
  const std::vector<std::string> before = Snapshot(caches);
  v1::AttentionRequest attack;
  *attack.mutable_query() = Float32Tensor({65536, 1}, std::vector<float>(65536, 0.5f));
  *attack.mutable_key() = Float32Tensor({1, 1}, {0.25f});
  *attack.mutable_value() = Float32Tensor({1, 1000000}, std::vector<float>(1000000, 1.f));
  for (bool lse : {false, true}) {
    attack.mutable_options()->set_return_lse(lse);
    v1::AttentionResponse response;
    ExpectRefused(Call(&v1::AttentionService::Stub::Tiled, attack, &response),
                  grpc::StatusCode::RESOURCE_EXHAUSTED, "query: ");
    ExpectRefused(Call(&v1::AttentionService::Stub::Naive, attack, &response),
                  grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-message-bytes=4194304");
  }
  // Over a cache: head_dim 1, value_dim 65536; 64 query rows of 8 heads make 16 MiB.
  const std::string wide = Cache(1, 3, 65536, 1, 1);
  v1::AttentionRequest over;
  over.set_cache_id(wide);
  *over.mutable_query() = Float32Tensor({8, 64, 1}, std::vector<float>(512, 0.5f));
  v1::AttentionResponse response;
  ExpectRefused(Call(&v1::AttentionService::Stub::Tiled, over, &response),
                grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-message-bytes");
  v1::DecodeRequest decode;
  v1::DecodeItem* item = decode.add_items();
  item->set_cache_id(wide);
  *item->mutable_query() = over.query();
  v1::DecodeResponse decoded;
  ExpectRefused(Call(&v1::AttentionService::Stub::Decode, decode, &decoded),
                grpc::StatusCode::RESOURCE_EXHAUSTED, "items[0].query: ");
  // A batch whose items fit one by one but not together (3 × 1.5 MiB), each with a new token
  // that must not be applied.
  decode.Clear();
  for (int i = 0; i < 3; ++i) {
    *decode.add_items() = Item(Cache(5, 10 + i, 65536), 1, 1, 20 + i, 65536);
  }
  const std::string first = decode.items(0).cache_id();
  ExpectRefused(Call(&v1::AttentionService::Stub::Decode, decode, &decoded),
                grpc::StatusCode::RESOURCE_EXHAUSTED, "items: ");
  EXPECT_EQ(LengthOf(first), 5);
  EXPECT_EQ(Snapshot(caches), before);
  EXPECT_EQ(LengthOf(caches[0]), 37);
}

// What a computation throws fails that call with RESOURCE_EXHAUSTED (an allocation failure) or
// INTERNAL, and the server goes on answering.
TEST_F(FaultTest, WhatAComputationThrowsFailsOnlyThatCall) {
  const std::vector<std::string> caches = {Cache(40, 4)};
  const std::vector<std::string> before = Snapshot(caches);
  v1::AttentionRequest request;
  *request.mutable_query() = Float32Tensor({3, 65, 9}, Random(3 * 65 * 9, 5));
  *request.mutable_key() = Float32Tensor({3, 70, 9}, Random(3 * 70 * 9, 6));
  *request.mutable_value() = Float32Tensor({3, 70, 11}, Random(3 * 70 * 11, 7));
  for (const auto& [fault, code] :
       {std::pair{Fault::kThrowBadAlloc, grpc::StatusCode::RESOURCE_EXHAUSTED},
        std::pair{Fault::kThrowOther, grpc::StatusCode::INTERNAL}}) {
    backend_.fault = fault;
    v1::AttentionResponse response;
    EXPECT_EQ(Call(&v1::AttentionService::Stub::Tiled, request, &response).error_code(), code);
    EXPECT_EQ(Call(&v1::AttentionService::Stub::Naive, request, &response).error_code(), code);
    v1::DecodeRequest decode;
    *decode.add_items() = Item(caches[0], 2, 3, 8);
    v1::DecodeResponse decoded;
    EXPECT_EQ(Call(&v1::AttentionService::Stub::Decode, decode, &decoded).error_code(), code);
    EXPECT_EQ(LengthOf(caches[0]), 40);
  }
  // A trace whose cursor throws after its first event ends with INTERNAL after TraceStart and
  // that event.
  backend_.fault = Fault::kThrowOther;
  v1::TraceRequest trace;
  *trace.mutable_attention() = request;
  {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> reader = stub_->Trace(&context, trace);
    v1::TraceEvent event;
    int events = 0;
    while (reader->Read(&event)) ++events;
    EXPECT_EQ(events, 2);
    ExpectRefused(reader->Finish(), grpc::StatusCode::INTERNAL, "cursor broke");
  }
  backend_.fault = Fault::kNone;
  v1::AttentionResponse response;
  EXPECT_TRUE(Call(&v1::AttentionService::Stub::Tiled, request, &response).ok());
  EXPECT_EQ(Snapshot(caches), before);
}

// A 3-item Decode batch, every item with new tokens, failing at each stage: an append refused
// by the store, the kernel's error, an allocation failure and an exception thrown by the kernel,
// an interruption (the deadline passes mid-kernel). Meanwhile a reader polls every cache's
// length: it must never see a token of the failing batch, and afterwards every cache decodes
// exactly as before.
TEST_F(FaultTest, AFailingDecodeBatchLeavesEveryCacheAsItWasAndNoReaderSeesItsTokens) {
  const std::vector<std::string> caches = {Cache(17, 30), Cache(256, 31), Cache(1, 32)};
  const std::vector<int64_t> lengths = {17, 256, 1};
  const std::vector<std::string> before = Snapshot(caches);
  std::atomic<bool> stop{false};
  std::atomic<int> polls{0}, torn{0};
  std::thread reader([&] {
    while (!stop.load()) {
      for (size_t i = 0; i < caches.size(); ++i) {
        if (LengthOf(caches[i]) != lengths[i]) ++torn;
      }
      ++polls;
    }
  });
  backend_.delay_ms = 30;
  for (const Fault fault :
       {Fault::kFailAppend, Fault::kError, Fault::kThrowBadAlloc, Fault::kThrowOther}) {
    backend_.fault = fault;
    backend_.appends_until_failure = 3;  // kFailAppend: the third item's append fails.
    v1::DecodeRequest decode;
    for (size_t i = 0; i < caches.size(); ++i) {
      *decode.add_items() = Item(caches[i], 2, 3, 40 + i);
    }
    v1::DecodeResponse response;
    const grpc::Status status = Call(&v1::AttentionService::Stub::Decode, decode, &response);
    EXPECT_FALSE(status.ok()) << static_cast<int>(fault);
  }
  // The interruption: the call's deadline passes while the kernel waits.
  backend_.fault = Fault::kNone;
  backend_.delay_ms = 300;
  {
    v1::DecodeRequest decode;
    for (size_t i = 0; i < caches.size(); ++i) *decode.add_items() = Item(caches[i], 1, 2, 50 + i);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + milliseconds(100));
    v1::DecodeResponse response;
    EXPECT_EQ(stub_->Decode(&context, decode, &response).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
    std::this_thread::sleep_for(milliseconds(400));  // The kernel ends, the batch is undone.
  }
  backend_.delay_ms = 0;
  stop = true;
  reader.join();
  EXPECT_GT(polls.load(), 5);
  EXPECT_EQ(torn.load(), 0) << "a reader saw the length of a batch that failed";
  for (size_t i = 0; i < caches.size(); ++i) EXPECT_EQ(LengthOf(caches[i]), lengths[i]);
  EXPECT_EQ(Snapshot(caches), before);
}

// A block_k as large as the contract allows over a long, one-wide key would make a CPU worker's
// scores (128 rows × block_k) hundreds of times the request: it is capped at 65536, and the
// answer is still the float64 reference's.
TEST_F(FaultTest, AHugeBlockKIsCappedAndTheAnswerStaysRight) {
  constexpr int64_t kKeys = 70001, kRows = 129;
  const std::vector<float> q = Random(kRows, 90), k = Random(kKeys, 91), v = Random(kKeys, 92);
  v1::AttentionRequest request;
  *request.mutable_query() = Float32Tensor({kRows, 1}, q);
  *request.mutable_key() = Float32Tensor({kKeys, 1}, k);
  *request.mutable_value() = Float32Tensor({kKeys, 1}, v);
  request.mutable_options()->set_block_k(std::numeric_limits<int32_t>::max());
  v1::AttentionResponse response;
  const grpc::Status status = Call(&v1::AttentionService::Stub::Tiled, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.stats().block_k(), 65536);
  ASSERT_EQ(response.output().data().size(), kRows * sizeof(float));
  std::vector<float> out(kRows);
  std::memcpy(out.data(), response.output().data().data(), out.size() * sizeof(float));
  for (int64_t i = 0; i < kRows; ++i) {  // float64 softmax over every key (scale 1/√1 = 1).
    double max = -1e300, sum = 0, weighted = 0;
    for (int64_t j = 0; j < kKeys; ++j) max = std::max(max, double{q[i]} * k[j]);
    for (int64_t j = 0; j < kKeys; ++j) {
      const double w = std::exp(double{q[i]} * k[j] - max);
      sum += w;
      weighted += w * v[j];
    }
    EXPECT_NEAR(out[i], weighted / sum, 1e-5) << "row " << i;
  }
}

TEST_F(FaultTest, MaxCachesBoundsTheCachesAlive) {
  ServiceConfig config;
  config.caches = {.budget_bytes = 64 << 20, .idle_seconds = 0, .max_caches = 3};
  Start(config);
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(Cache(2, 60 + i));
  v1::CreateCacheRequest create;
  create.set_kv_heads(1);
  create.set_head_dim(4);
  create.set_dtype(v1::DTYPE_FLOAT32);
  v1::CacheInfo info;
  ExpectRefused(Call(&v1::AttentionService::Stub::CreateCache, create, &info),
                grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-caches=3");
  v1::DeleteCacheRequest del;
  del.set_cache_id(ids[0]);
  v1::DeleteCacheResponse deleted;
  ASSERT_TRUE(Call(&v1::AttentionService::Stub::DeleteCache, del, &deleted).ok());
  EXPECT_TRUE(Call(&v1::AttentionService::Stub::CreateCache, create, &info).ok());
  v1::ServerInfo server;
  ASSERT_TRUE(
      Call(&v1::AttentionService::Stub::GetServerInfo, v1::GetServerInfoRequest(), &server).ok());
  EXPECT_EQ(server.max_caches(), 3);
  EXPECT_EQ(server.trace_idle_seconds(), TraceLimits::kDefaultIdleSeconds);
  EXPECT_GT(server.max_inflight_bytes(), 0);  // A quarter of physical memory.
}

// A trace whose reader takes nothing is cancelled after --trace-idle-seconds and frees its slot.
TEST_F(FaultTest, ATraceNobodyReadsIsCancelledAndFreesItsSlot) {
  ServiceConfig config;
  config.trace.max_streams = 1;
  config.trace.idle_seconds = 1;
  Start(config);
  // One row over 20000 keys in tiles of 1: 20000 steps of about 1 KiB (the accumulator and the
  // estimate, 128 wide), far more than the transport buffers.
  constexpr int64_t kKeys = 20000;
  v1::TraceRequest trace;
  v1::AttentionRequest* attention = trace.mutable_attention();
  *attention->mutable_query() = Float32Tensor({1, 16}, Random(16, 70));
  *attention->mutable_key() = Float32Tensor({kKeys, 16}, Random(kKeys * 16, 71));
  *attention->mutable_value() = Float32Tensor({kKeys, 128}, Random(kKeys * 128, 72));
  attention->mutable_options()->set_block_k(1);
  grpc::ClientContext idle_context;
  std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> idle = stub_->Trace(&idle_context, trace);
  v1::TraceEvent event;
  ASSERT_TRUE(idle->Read(&event));  // The stream is open and holds the one slot.
  {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> second = stub_->Trace(&context, trace);
    while (second->Read(&event)) {
    }
    ExpectRefused(second->Finish(), grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-traces=1");
  }
  std::this_thread::sleep_for(milliseconds(2500));  // Idle limit 1 s, checked every 250 ms.
  EXPECT_EQ(service_->idle_traces_cancelled(), 1);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> third = stub_->Trace(&context, trace);
  int events = 0;
  while (third->Read(&event)) ++events;
  EXPECT_TRUE(third->Finish().ok());
  EXPECT_GT(events, kKeys);
  idle_context.TryCancel();
  idle->Finish();
}

// At shutdown, calls still waiting for a compute worker are answered UNAVAILABLE and never run.
TEST_F(FaultTest, CallsStillQueuedAtShutdownAreAnsweredUnavailable) {
  const std::string cache = Cache(9, 80);
  backend_.delay_ms = 500;  // The first call holds the one worker.
  v1::AttentionRequest request;
  *request.mutable_query() = Float32Tensor({2, 33, 8}, Random(2 * 33 * 8, 81));
  *request.mutable_key() = Float32Tensor({2, 40, 8}, Random(2 * 40 * 8, 82));
  *request.mutable_value() = Float32Tensor({2, 40, 8}, Random(2 * 40 * 8, 83));
  std::vector<std::thread> callers;
  std::vector<grpc::StatusCode> codes(4, grpc::StatusCode::OK);
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      if (i == 3) {  // A Decode with a new token: queued, refused, never applied.
        v1::DecodeRequest decode;
        *decode.add_items() = Item(cache, 1, 1, 84);
        v1::DecodeResponse response;
        codes[i] = Call(&v1::AttentionService::Stub::Decode, decode, &response).error_code();
      } else {
        v1::AttentionResponse response;
        codes[i] = Call(&v1::AttentionService::Stub::Tiled, request, &response).error_code();
      }
    });
    std::this_thread::sleep_for(milliseconds(50));
  }
  service_->CancelQueued();
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(codes[0], grpc::StatusCode::OK);  // It was running: it finished.
  for (int i = 1; i < 4; ++i) EXPECT_EQ(codes[i], grpc::StatusCode::UNAVAILABLE) << i;
  backend_.delay_ms = 0;
  EXPECT_EQ(LengthOf(cache), 9);
}

}  // namespace
}  // namespace attn
