// The service over real loopback TCP: every RPC through the client library, every bad-input
// case, the Naive memory limit, and cancellation of a long trace.
#include "server/service.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "proto/dtype_mapping.h"
#include "tests/reference.h"

namespace attn {
namespace {

namespace v1 = attention::v1;
using testing::HostProblem;

// Counts the trace events a backend's cursors compute, to see a cancelled trace stop.
class CountingBackend final : public Backend {
 public:
  explicit CountingBackend(Backend& inner) : inner_(inner) {}
  const char* name() const override { return inner_.name(); }
  std::string device() const override { return inner_.device(); }
  int64_t memory_bytes() const override { return inner_.memory_bytes(); }
  int default_block_k() const override { return inner_.default_block_k(); }
  int64_t max_naive_bytes() const override { return inner_.max_naive_bytes(); }
  // The inner backend's answer when inline_calls is set; never otherwise, so that every call
  // takes the compute queue.
  bool RunsInline(const Problem& p) const override {
    const bool runs_inline = inline_calls.load() && inner_.RunsInline(p);
    if (runs_inline) ++inline_answers;
    return runs_inline;
  }
  absl::StatusOr<Stats> Naive(const Problem& p, const Outputs& o) override {
    return inner_.Naive(p, o);
  }
  absl::StatusOr<Stats> Tiled(const Problem& p, const Outputs& o) override {
    ++tiled_calls;
    Outputs slowed = o;  // block_delay_ms before each row block: seconds of work from a small call.
    slowed.interrupt = [this, inner = o.interrupt] {
      std::this_thread::sleep_for(std::chrono::milliseconds(block_delay_ms.load()));
      return inner ? inner() : absl::OkStatus();
    };
    absl::StatusOr<Stats> stats = inner_.Tiled(p, slowed);
    last_tiled_code = stats.status().code();
    return stats;
  }
  absl::StatusOr<std::unique_ptr<TraceCursor>> Trace(const Problem& p,
                                                     std::vector<RowRef> rows) override {
    absl::StatusOr<std::unique_ptr<TraceCursor>> cursor = inner_.Trace(p, std::move(rows));
    if (!cursor.ok()) return cursor;
    return std::unique_ptr<TraceCursor>(new Counting(*std::move(cursor), events));
  }

  std::atomic<int64_t> events{0};
  std::atomic<int64_t> tiled_calls{0};
  std::atomic<int> block_delay_ms{0};
  std::atomic<bool> inline_calls{false};
  mutable std::atomic<int64_t> inline_answers{0};
  std::atomic<absl::StatusCode> last_tiled_code{absl::StatusCode::kOk};

 private:
  class Counting final : public TraceCursor {
   public:
    Counting(std::unique_ptr<TraceCursor> inner, std::atomic<int64_t>& events)
        : inner_(std::move(inner)), events_(events) {}
    bool Next(TraceItem* item) override {
      ++events_;
      return inner_->Next(item);
    }
    Stats stats() const override { return inner_->stats(); }

   private:
    std::unique_ptr<TraceCursor> inner_;
    std::atomic<int64_t>& events_;
  };
  Backend& inner_;
};

// An attnd service on an ephemeral loopback port, and a client connected to it.
class ServiceTest : public ::testing::Test {
 protected:
  friend struct Busy;
  void StartServer(int64_t max_naive_bytes = 0, TraceLimits limits = {},
                   AdmissionLimits admission = {.max_inflight = 0, .memory_bytes = 0}) {
    cpu_ = std::make_unique<CpuBackend>(2, max_naive_bytes);
    backend_ = std::make_unique<CountingBackend>(*cpu_);
    ServiceConfig config;
    config.trace = limits;
    config.admission = admission;
    service_ = std::make_unique<AttentionService>(*backend_, config);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(1 << 30);
    builder.SetMaxSendMessageSize(1 << 30);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port, 0);
    target_ = "127.0.0.1:" + std::to_string(port);
    client_ = std::make_unique<client::Client>(target_);
  }

  // A client whose every call has the given deadline.
  client::Client ClientWithDeadline(std::chrono::milliseconds timeout) const {
    return client::Client(target_, {.timeout = timeout});
  }

  void SetUp() override { StartServer(); }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  std::unique_ptr<CpuBackend> cpu_;
  std::unique_ptr<CountingBackend> backend_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<client::Client> client_;
  std::string target_;
};

v1::Tensor ToTensor(std::vector<int64_t> shape, const std::vector<uint8_t>& bytes, DType dtype) {
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_dtype(ToProtoDType(dtype));
  tensor.set_data(bytes.data(), bytes.size());
  return tensor;
}

// The request for a HostProblem, rank 4 (or rank 2 for a single head).
v1::AttentionRequest ToRequest(const HostProblem& p, bool rank2 = false) {
  const Shape& s = p.shape;
  auto shape = [&](int64_t heads, int64_t len, int64_t dim) {
    return rank2 ? std::vector<int64_t>{len, dim} : std::vector<int64_t>{s.batch, heads, len, dim};
  };
  v1::AttentionRequest request;
  *request.mutable_query() =
      ToTensor(shape(s.heads, s.query_len, s.head_dim), p.query_bytes, p.dtype);
  *request.mutable_key() = ToTensor(shape(s.kv_heads, s.key_len, s.head_dim), p.key_bytes, p.dtype);
  *request.mutable_value() =
      ToTensor(shape(s.kv_heads, s.key_len, s.value_dim), p.value_bytes, p.dtype);
  request.mutable_options()->set_causal(p.causal);
  request.mutable_options()->set_block_k(p.block_k);
  request.mutable_options()->set_return_lse(p.return_lse);
  request.mutable_options()->set_key_position(p.key_position);
  if (p.query_position) request.mutable_options()->set_query_position(*p.query_position);
  if (p.window_left) request.mutable_options()->set_window_left(*p.window_left);
  if (p.window_right) request.mutable_options()->set_window_right(*p.window_right);
  request.mutable_options()->set_softcap(p.softcap);
  request.mutable_options()->mutable_alibi_slopes()->Assign(p.alibi_slopes.begin(),
                                                            p.alibi_slopes.end());
  request.mutable_options()->mutable_sinks()->Assign(p.sinks.begin(), p.sinks.end());
  return request;
}

std::vector<float> OutputOf(const v1::AttentionResponse& response) {
  absl::StatusOr<client::Array> output = client::FromTensor(response.output());
  EXPECT_TRUE(output.ok()) << output.status();
  return output.ok() ? output->values : std::vector<float>{};
}

TEST_F(ServiceTest, ServerInfoDescribesBackendAndLimits) {
  absl::StatusOr<v1::ServerInfo> info = client_->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->device().empty());
  EXPECT_GT(info->device_memory_bytes(), 0);
  EXPECT_EQ(info->dtypes_size(), 3);
  EXPECT_EQ(info->max_message_bytes(), int64_t{1} << 30);
  EXPECT_GT(info->max_naive_bytes(), 0);
  EXPECT_EQ(info->default_block_k(), cpu_->default_block_k());
}

TEST_F(ServiceTest, HealthIsServing) {
  auto status = client_->Health();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(ServiceTest, SeedExampleThroughNaiveAndTiled) {
  const HostProblem seed = testing::SeedExample(1.f, 3);
  const std::vector<float> expected = {-0.593223f, 0.406777f, -1.332858f, -0.371937f};
  for (bool naive : {true, false}) {
    SCOPED_TRACE(naive ? "Naive" : "Tiled");
    absl::StatusOr<v1::AttentionResponse> response =
        naive ? client_->Naive(ToRequest(seed, true)) : client_->Tiled(ToRequest(seed, true));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->output().shape_size(), 2);
    const std::vector<float> out = OutputOf(*response);
    for (int c = 0; c < 4; ++c) EXPECT_NEAR(out[c], expected[c], 1e-6);
    const v1::ExecutionStats& stats = response->stats();
    EXPECT_EQ(stats.backend(), "cpu");
    EXPECT_EQ(stats.intermediate_bytes(), naive ? 16 * 8 * 8 : 0);
    EXPECT_EQ(stats.block_k(), naive ? 0 : 3);
    EXPECT_DOUBLE_EQ(stats.flops(), 4.0 * 8 * 8 * 4);
    EXPECT_GT(stats.server_ns(), 0);
    EXPECT_GE(stats.server_ns(), stats.compute_ns());
    EXPECT_GE(stats.peak_memory_bytes(), stats.scratch_bytes());
    // Where server_ns went: the stages (run inline here: the queue is the lambda's start).
    const v1::ServerStages& stages = stats.stages();
    EXPECT_GT(stages.handler_ns(), 0);
    EXPECT_GE(stages.queue_ns(), 0);
    EXPECT_GT(stages.prepare_ns(), 0);  // The values' scan and the output's allocation.
    EXPECT_GE(stages.finish_ns(), 0);
    EXPECT_LE(stages.handler_ns() + stages.queue_ns() + stages.prepare_ns() + stats.compute_ns() +
                  stages.finish_ns(),
              stats.server_ns());
  }
}

TEST_F(ServiceTest, RandomProblemsMatchTheFloat64Reference) {
  const Shape shape{.batch = 2,
                    .heads = 4,
                    .kv_heads = 2,
                    .query_len = 37,
                    .key_len = 53,
                    .head_dim = 33,
                    .value_dim = 20};
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    HostProblem p = testing::RandomProblem(shape, dtype, /*causal=*/true, /*block_k=*/7, 11);
    const testing::Reference ref = testing::ReferenceAttention(p);
    for (bool naive : {true, false}) {
      SCOPED_TRACE(std::string(naive ? "Naive " : "Tiled ") + DTypeName(dtype));
      v1::AttentionRequest request = ToRequest(p);
      request.mutable_options()->set_output_dtype(v1::DTYPE_FLOAT32);
      absl::StatusOr<v1::AttentionResponse> response =
          naive ? client_->Naive(request) : client_->Tiled(request);
      ASSERT_TRUE(response.ok()) << response.status();
      EXPECT_EQ(response->output().dtype(), v1::DTYPE_FLOAT32);
      EXPECT_EQ(std::vector<int64_t>(response->output().shape().begin(),
                                     response->output().shape().end()),
                (std::vector<int64_t>{2, 4, 37, 20}));
      // fp32 output of (rounded) inputs: the fp32 bound applies whatever the input dtype.
      EXPECT_LE(testing::MaxAbsError(OutputOf(*response), ref.output),
                1e-5 * testing::MaxAbs(ref.output));
      ASSERT_TRUE(response->has_lse());
      EXPECT_EQ(response->lse().shape_size(), 3);
      absl::StatusOr<client::Array> lse_array = client::FromTensor(response->lse());
      ASSERT_TRUE(lse_array.ok());
      EXPECT_LE(testing::MaxAbsError(lse_array->values, ref.lse), 1e-4);
    }
  }
}

// A slice of a causal problem's keys, placed by key_position, and queries placed mid-sequence by
// query_position: Naive and Tiled compute exactly that part, and a trace reports the positions.
TEST_F(ServiceTest, PositionsPlaceSlicesOfTheKeysAndQueries) {
  const Shape shape{.batch = 1,
                    .heads = 6,
                    .kv_heads = 2,
                    .query_len = 21,
                    .key_len = 17,
                    .head_dim = 12,
                    .value_dim = 9};
  HostProblem p = testing::RandomProblem(shape, DType::kFloat32, /*causal=*/true, 5, 12);
  p.key_position = 30;
  p.query_position = 25;  // Rows 0..4 see no key, row 5 one, rows 21 − 5 … all.
  const testing::Reference ref = testing::ReferenceAttention(p);
  for (bool naive : {true, false}) {
    SCOPED_TRACE(naive ? "Naive" : "Tiled");
    const v1::AttentionRequest request = ToRequest(p);
    absl::StatusOr<v1::AttentionResponse> response =
        naive ? client_->Naive(request) : client_->Tiled(request);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_LE(testing::MaxAbsError(OutputOf(*response), ref.output),
              1e-5 * testing::MaxAbs(ref.output));
    absl::StatusOr<client::Array> lse = client::FromTensor(response->lse());
    ASSERT_TRUE(lse.ok());
    ASSERT_EQ(lse->values.size(), ref.lse.size());
    for (size_t i = 0; i < ref.lse.size(); ++i) {
      if (std::isinf(ref.lse[i])) {  // A row that sees no key: exactly −inf.
        EXPECT_EQ(lse->values[i], -INFINITY) << "row " << i % shape.query_len;
      } else {
        EXPECT_NEAR(lse->values[i], ref.lse[i], 1e-4) << "row " << i % shape.query_len;
      }
    }
    EXPECT_EQ(lse->values[0], -INFINITY) << "row 0 sees no key";
  }
  v1::TraceRequest trace;
  *trace.mutable_attention() = ToRequest(p);
  v1::TraceStart start;
  ASSERT_TRUE(client_
                  ->Trace(trace,
                          [&](const v1::TraceEvent& event) {
                            if (event.has_start()) start = event.start();
                            return true;
                          })
                  .ok());
  EXPECT_EQ(start.key_position(), 30);
  EXPECT_EQ(start.query_position(), 25);
  // Unset, the query position is bottom-right against the (moved) keys.
  p.query_position.reset();
  *trace.mutable_attention() = ToRequest(p);
  ASSERT_TRUE(client_
                  ->Trace(trace,
                          [&](const v1::TraceEvent& event) {
                            if (event.has_start()) start = event.start();
                            return true;
                          })
                  .ok());
  EXPECT_EQ(start.query_position(), 30 + 17 - 21);
}

// A sliding window through the service: Naive and Tiled answer the windowed problem, a trace
// reports the window and starts at the first tile a row sees.
TEST_F(ServiceTest, WindowsReachTheKernelsAndTheTrace) {
  HostProblem p = testing::RandomProblem({.batch = 1,
                                          .heads = 4,
                                          .kv_heads = 2,
                                          .query_len = 37,
                                          .key_len = 37,
                                          .head_dim = 8,
                                          .value_dim = 6},
                                         DType::kFloat32, /*causal=*/true, 4, 13);
  p.window_left = 6;
  const testing::Reference ref = testing::ReferenceAttention(p);
  for (bool naive : {true, false}) {
    SCOPED_TRACE(naive ? "Naive" : "Tiled");
    absl::StatusOr<v1::AttentionResponse> response =
        naive ? client_->Naive(ToRequest(p)) : client_->Tiled(ToRequest(p));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_LE(testing::MaxAbsError(OutputOf(*response), ref.output),
              1e-5 * testing::MaxAbs(ref.output));
  }
  v1::TraceRequest trace;
  *trace.mutable_attention() = ToRequest(p);
  trace.add_rows()->set_row(30);  // Sees keys 24..30: tiles 6 and 7 of 4 keys.
  v1::TraceStart start;
  std::vector<int> tiles, hidden;
  ASSERT_TRUE(client_
                  ->Trace(trace,
                          [&](const v1::TraceEvent& event) {
                            if (event.has_start()) start = event.start();
                            if (!event.has_step()) return true;
                            tiles.push_back(event.step().tile());
                            hidden.insert(hidden.end(), event.step().hidden().begin(),
                                          event.step().hidden().end());
                            return true;
                          })
                  .ok());
  EXPECT_EQ(start.window_left(), 6);
  EXPECT_FALSE(start.has_window_right());
  EXPECT_EQ(tiles, (std::vector<int>{6, 7}));
  // Keys 24 … 31: the row sees 24 … 30; 31 is past it (causal).
  EXPECT_EQ(hidden, (std::vector<int>{v1::HIDDEN_NONE, v1::HIDDEN_NONE, v1::HIDDEN_NONE,
                                      v1::HIDDEN_NONE, v1::HIDDEN_NONE, v1::HIDDEN_NONE,
                                      v1::HIDDEN_NONE, v1::HIDDEN_CAUSAL}));
}

// ALiBi through the service: Naive and Tiled answer the biased problem, a trace repeats the
// slopes and gives each key's bias, −slope · |p − t| of the traced row's head.
TEST_F(ServiceTest, AlibiReachesTheKernelsAndTheTrace) {
  HostProblem p = testing::RandomProblem({.batch = 1,
                                          .heads = 4,
                                          .kv_heads = 2,
                                          .query_len = 19,
                                          .key_len = 23,
                                          .head_dim = 8,
                                          .value_dim = 6},
                                         DType::kFloat32, /*causal=*/true, 4, 17);
  p.alibi_slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
  const testing::Reference ref = testing::ReferenceAttention(p);
  for (bool naive : {true, false}) {
    SCOPED_TRACE(naive ? "Naive" : "Tiled");
    absl::StatusOr<v1::AttentionResponse> response =
        naive ? client_->Naive(ToRequest(p)) : client_->Tiled(ToRequest(p));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_LE(testing::MaxAbsError(OutputOf(*response), ref.output),
              1e-5 * testing::MaxAbs(ref.output));
  }
  v1::TraceRequest trace;
  *trace.mutable_attention() = ToRequest(p);
  v1::RowRef* row = trace.add_rows();
  row->set_head(1);
  row->set_row(11);
  v1::TraceStart start;
  int biases = 0;
  ASSERT_TRUE(client_
                  ->Trace(trace,
                          [&](const v1::TraceEvent& event) {
                            if (event.has_start()) start = event.start();
                            if (!event.has_step()) return true;
                            const v1::TileStep& step = event.step();
                            EXPECT_EQ(step.biases_size(), step.key_end() - step.key_begin());
                            EXPECT_EQ(step.scaled_scores_size(), step.biases_size());
                            EXPECT_EQ(step.hidden_size(), step.biases_size());
                            for (int j = 0; j < step.biases_size(); ++j) {
                              const int64_t key = step.key_begin() + j;
                              EXPECT_EQ(step.hidden(j), testing::ReferenceSees(p, 11, key)
                                                            ? v1::HIDDEN_NONE
                                                            : v1::HIDDEN_CAUSAL);
                              EXPECT_NEAR(step.biases(j),
                                          testing::ReferenceBias(p, 1, 11, step.key_begin() + j),
                                          1e-6);
                              ++biases;
                            }
                            return true;
                          })
                  .ok());
  EXPECT_EQ(std::vector<float>(start.alibi_slopes().begin(), start.alibi_slopes().end()),
            p.alibi_slopes);
  EXPECT_GT(biases, 0);
}

// Sinks through the service: Naive and Tiled answer with each head's sink (lse included), a
// trace repeats the sinks on TraceStart and gives the traced row's sink_share on RowDone.
TEST_F(ServiceTest, SinksReachTheKernelsAndTheTrace) {
  HostProblem p = testing::RandomProblem({.batch = 1,
                                          .heads = 4,
                                          .kv_heads = 2,
                                          .query_len = 19,
                                          .key_len = 23,
                                          .head_dim = 8,
                                          .value_dim = 6},
                                         DType::kFloat32, /*causal=*/true, 4, 19);
  p.window_left = 7;
  p.sinks = {0.5f, -1.f, 2.f, 1.25f};
  const testing::Reference ref = testing::ReferenceAttention(p);
  for (bool naive : {true, false}) {
    SCOPED_TRACE(naive ? "Naive" : "Tiled");
    absl::StatusOr<v1::AttentionResponse> response =
        naive ? client_->Naive(ToRequest(p)) : client_->Tiled(ToRequest(p));
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_LE(testing::MaxAbsError(OutputOf(*response), ref.output),
              1e-5 * testing::MaxAbs(ref.output));
    const std::string& lse = response->lse().data();
    ASSERT_EQ(lse.size(), ref.lse.size() * 4);
    for (size_t i = 0; i < ref.lse.size(); ++i) {
      float value;
      std::memcpy(&value, lse.data() + 4 * i, 4);
      EXPECT_NEAR(value, ref.lse[i], 1e-5 * std::max(1.0, std::abs(ref.lse[i]))) << "lse " << i;
    }
  }
  v1::TraceRequest trace;
  *trace.mutable_attention() = ToRequest(p);
  v1::RowRef* row = trace.add_rows();
  row->set_head(2);
  row->set_row(11);
  v1::TraceStart start;
  v1::RowDone done;
  ASSERT_TRUE(client_
                  ->Trace(trace,
                          [&](const v1::TraceEvent& event) {
                            if (event.has_start()) start = event.start();
                            if (event.has_row_done()) done = event.row_done();
                            return true;
                          })
                  .ok());
  EXPECT_EQ(std::vector<float>(start.sinks().begin(), start.sinks().end()), p.sinks);
  const double lse = ref.lse[2 * p.shape.query_len + 11];
  EXPECT_NEAR(done.lse(), lse, 1e-5 * std::max(1.0, std::abs(lse)));
  EXPECT_NEAR(done.sink_share(), std::exp(2.0 - lse), 1e-6);
  EXPECT_GT(done.sink_share(), 0.01f);
}

TEST_F(ServiceTest, OutputDtypeDefaultsToTheQuerys) {
  HostProblem p = testing::RandomProblem(
      {.heads = 1, .query_len = 5, .key_len = 9, .head_dim = 3, .value_dim = 3}, DType::kFloat16,
      false, 4, 3);
  p.return_lse = false;
  absl::StatusOr<v1::AttentionResponse> response = client_->Tiled(ToRequest(p));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->output().dtype(), v1::DTYPE_FLOAT16);
  EXPECT_FALSE(response->has_lse());
}

// One malformed request and the field its error must name.
struct BadInput {
  const char* name;
  std::function<void(v1::AttentionRequest&)> mutate;
  const char* field;
};

// The valid request below (batch 2 of 16 rows and keys) as one packed batch of 32 rows and keys
// (rank 3), with these cumulative lengths.
void MakeRagged(v1::AttentionRequest& r, std::vector<int64_t> q, std::vector<int64_t> k) {
  for (v1::Tensor* tensor : {r.mutable_query(), r.mutable_key(), r.mutable_value()}) {
    const int64_t heads = tensor->shape(0) * tensor->shape(1), dim = tensor->shape(3);
    tensor->clear_shape();
    for (int64_t d : {heads / 2, int64_t{32}, dim}) tensor->add_shape(d);
  }
  r.mutable_cu_seqlens_q()->Assign(q.begin(), q.end());
  r.mutable_cu_seqlens_k()->Assign(k.begin(), k.end());
}

std::vector<BadInput> BadInputs() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return {
      {"cu_seqlens_q without cu_seqlens_k",
       [](auto& r) {
         MakeRagged(r, {0, 10, 32}, {});
       },
       "cu_seqlens_k"},
      {"cu_seqlens of different counts",
       [](auto& r) {
         MakeRagged(r, {0, 10, 32}, {0, 32});
       },
       "cu_seqlens_k"},
      {"cu_seqlens of one entry", [](auto& r) { MakeRagged(r, {32}, {32}); }, "cu_seqlens_q"},
      {"cu_seqlens_q not from 0",
       [](auto& r) {
         MakeRagged(r, {1, 10, 32}, {0, 10, 32});
       },
       "cu_seqlens_q[0]"},
      {"decreasing cu_seqlens_q",
       [](auto& r) {
         MakeRagged(r, {0, 20, 10, 32}, {0, 1, 2, 32});
       },
       "cu_seqlens_q[2]"},
      {"cu_seqlens_k short of the packed keys",
       [](auto& r) {
         MakeRagged(r, {0, 10, 32}, {0, 10, 31});
       },
       "cu_seqlens_k[2]"},
      {"cu_seqlens with batch 2",
       [](auto& r) {
         for (auto* cu : {r.mutable_cu_seqlens_q(), r.mutable_cu_seqlens_k()}) {
           for (int64_t length : {0, 16}) cu->Add(length);
         }
       },
       "query.shape[0]"},
      {"cu_seqlens with a key_position",
       [](auto& r) {
         MakeRagged(r, {0, 10, 32}, {0, 12, 32});
         r.mutable_options()->set_key_position(4);
       },
       "options.key_position"},
      {"missing query", [](auto& r) { r.clear_query(); }, "query"},
      {"missing key", [](auto& r) { r.clear_key(); }, "key"},
      {"missing value", [](auto& r) { r.clear_value(); }, "value"},
      {"rank 1",
       [](auto& r) {
         r.mutable_query()->mutable_shape()->Clear();
         r.mutable_query()->add_shape(96);
       },
       "query.shape"},
      {"rank 5", [](auto& r) { r.mutable_query()->mutable_shape()->Add(1); }, "query.shape"},
      {"ranks differ",
       [](auto& r) {
         // Same elements as [2, 3, 16, 4] but rank 3.
         auto* shape = r.mutable_key()->mutable_shape();
         shape->Clear();
         for (int64_t d : {6, 16, 4}) shape->Add(d);
       },
       "key.shape"},
      {"unspecified dtype", [](auto& r) { r.mutable_key()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       "key.dtype"},
      {"unknown dtype", [](auto& r) { r.mutable_value()->set_dtype(static_cast<v1::DType>(7)); },
       "value.dtype"},
      {"short data", [](auto& r) { r.mutable_query()->mutable_data()->pop_back(); }, "query.data"},
      {"zero dim", [](auto& r) { r.mutable_key()->set_shape(2, 0); }, "key.shape[2]"},
      {"negative dim", [](auto& r) { r.mutable_query()->set_shape(1, -3); }, "query.shape[1]"},
      {"overflowing shape",
       [](auto& r) {
         for (int i = 0; i < 4; ++i) r.mutable_query()->set_shape(i, int64_t{1} << 20);
       },
       "query.shape"},
      {"non-finite input",
       [nan](auto& r) { std::memcpy(r.mutable_value()->mutable_data()->data() + 8, &nan, 4); },
       "value.data"},
      {"batch mismatch",
       [](auto& r) {
         r.mutable_key()->set_shape(0, 1);
         r.mutable_key()->mutable_data()->resize(r.key().data().size() / 2);
       },
       "key.shape[0]"},
      {"value heads differ from key heads",
       [](auto& r) {
         r.mutable_value()->set_shape(1, 1);
         r.mutable_value()->mutable_data()->resize(r.value().data().size() / 3);
       },
       "value.shape[1]"},
      {"query heads not a multiple of key heads",
       [](auto& r) {
         r.mutable_query()->set_shape(1, 4);
         r.mutable_query()->mutable_data()->resize(r.query().data().size() / 6 * 4);
       },
       "key.shape[1]"},
      {"key_len mismatch",
       [](auto& r) {
         r.mutable_value()->set_shape(2, 8);
         r.mutable_value()->mutable_data()->resize(r.value().data().size() / 2);
       },
       "value.shape[2]"},
      {"head_dim mismatch",
       [](auto& r) {
         r.mutable_key()->set_shape(3, 2);
         r.mutable_key()->mutable_data()->resize(r.key().data().size() / 2);
       },
       "key.shape[3]"},
      {"infinite scale", [](auto& r) { r.mutable_options()->set_scale(INFINITY); },
       "options.scale"},
      {"NaN scale", [nan](auto& r) { r.mutable_options()->set_scale(nan); }, "options.scale"},
      {"negative block_k", [](auto& r) { r.mutable_options()->set_block_k(-1); },
       "options.block_k"},
      {"unknown output dtype",
       [](auto& r) { r.mutable_options()->set_output_dtype(static_cast<v1::DType>(9)); },
       "options.output_dtype"},
      {"negative key_position", [](auto& r) { r.mutable_options()->set_key_position(-1); },
       "options.key_position"},
      {"negative query_position", [](auto& r) { r.mutable_options()->set_query_position(-3); },
       "options.query_position"},
      {"query_position past 2^62",
       [](auto& r) { r.mutable_options()->set_query_position((int64_t{1} << 62) + 1); },
       "options.query_position"},
      {"negative window_left", [](auto& r) { r.mutable_options()->set_window_left(-1); },
       "options.window_left"},
      {"negative window_right", [](auto& r) { r.mutable_options()->set_window_right(-5); },
       "options.window_right"},
      {"negative softcap", [](auto& r) { r.mutable_options()->set_softcap(-1.f); },
       "options.softcap"},
      {"infinite softcap", [](auto& r) { r.mutable_options()->set_softcap(INFINITY); },
       "options.softcap"},
      {"NaN softcap", [nan](auto& r) { r.mutable_options()->set_softcap(nan); }, "options.softcap"},
      {"one ALiBi slope for 6 heads", [](auto& r) { r.mutable_options()->add_alibi_slopes(0.5f); },
       "options.alibi_slopes"},
      {"7 ALiBi slopes for 6 heads",
       [](auto& r) {
         for (int h = 0; h < 7; ++h) r.mutable_options()->add_alibi_slopes(0.5f);
       },
       "options.alibi_slopes"},
      {"NaN ALiBi slope",
       [nan](auto& r) {
         for (int h = 0; h < 6; ++h) r.mutable_options()->add_alibi_slopes(h == 2 ? nan : 0.5f);
       },
       "options.alibi_slopes[2]"},
      {"ALiBi slopes whose biases overflow fp32",
       [](auto& r) {
         for (int h = 0; h < 6; ++h) r.mutable_options()->add_alibi_slopes(1e38f);
       },
       "options.alibi_slopes"},
      {"window_right past 2^62",
       [](auto& r) { r.mutable_options()->set_window_right((int64_t{1} << 62) + 1); },
       "options.window_right"},
      {"one sink for 6 heads", [](auto& r) { r.mutable_options()->add_sinks(0.5f); },
       "options.sinks"},
      {"7 sinks for 6 heads",
       [](auto& r) {
         for (int h = 0; h < 7; ++h) r.mutable_options()->add_sinks(0.5f);
       },
       "options.sinks"},
      {"NaN sink",
       [nan](auto& r) {
         for (int h = 0; h < 6; ++h) r.mutable_options()->add_sinks(h == 4 ? nan : 0.5f);
       },
       "options.sinks[4]"},
      {"infinite sink",
       [](auto& r) {
         for (int h = 0; h < 6; ++h) r.mutable_options()->add_sinks(h == 0 ? -INFINITY : 0.5f);
       },
       "options.sinks[0]"},
  };
}

// A valid request: batch 2, 6 query heads, 3 kv heads, 16 queries and keys, head_dim 4.
v1::AttentionRequest ValidRequest() {
  const HostProblem p = testing::RandomProblem({.batch = 2,
                                                .heads = 6,
                                                .kv_heads = 3,
                                                .query_len = 16,
                                                .key_len = 16,
                                                .head_dim = 4,
                                                .value_dim = 4},
                                               DType::kFloat32, false, 4, 5);
  return ToRequest(p);
}

TEST_F(ServiceTest, EveryBadInputIsInvalidArgumentNamingTheField) {
  ASSERT_TRUE(client_->Tiled(ValidRequest()).ok());
  // Each case through the compute queue, and as a call small enough to run on gRPC's thread.
  for (const auto& [inline_calls, bad] : [] {
         std::vector<std::pair<bool, BadInput>> cases;
         for (bool inline_calls : {false, true}) {
           for (BadInput& bad : BadInputs()) cases.emplace_back(inline_calls, std::move(bad));
         }
         return cases;
       }()) {
    SCOPED_TRACE(std::string(bad.name) + (inline_calls ? ", inline" : ", queued"));
    backend_->inline_calls = inline_calls;
    v1::AttentionRequest request = ValidRequest();
    bad.mutate(request);
    for (int method = 0; method < 3; ++method) {
      absl::Status status;
      if (method == 0) status = client_->Naive(request).status();
      if (method == 1) status = client_->Tiled(request).status();
      if (method == 2) {
        v1::TraceRequest trace;
        *trace.mutable_attention() = request;
        int events = 0;
        status = client_->Trace(trace, [&](const v1::TraceEvent&) { return ++events > 0; });
        EXPECT_EQ(events, 0);
      }
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find(bad.field), std::string::npos)
          << "message \"" << status.message() << "\" does not name " << bad.field;
    }
  }
  EXPECT_GT(backend_->inline_answers.load(), 0) << "no call took the inline path";
  // The server is still answering after all of that.
  EXPECT_TRUE(client_->Tiled(ValidRequest()).ok());
}

TEST_F(ServiceTest, NaiveOverItsMemoryBudgetNamesTiled) {
  TearDown();
  StartServer(/*max_naive_bytes=*/2 * 16 * 16 * 12 * 4 - 1);  // One byte short for ValidRequest.
  absl::StatusOr<v1::AttentionResponse> naive = client_->Naive(ValidRequest());
  EXPECT_EQ(naive.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(naive.status().message().find("Tiled"), std::string::npos) << naive.status();
  EXPECT_TRUE(client_->Tiled(ValidRequest()).ok());
}

v1::TraceRequest TraceOf(const v1::AttentionRequest& request,
                         std::vector<std::array<int64_t, 3>> rows) {
  v1::TraceRequest trace;
  *trace.mutable_attention() = request;
  for (const auto& [batch, head, row] : rows) {
    v1::RowRef* ref = trace.add_rows();
    ref->set_batch(batch);
    ref->set_head(head);
    ref->set_row(row);
  }
  return trace;
}

TEST_F(ServiceTest, TraceStreamsStartStepsRowDoneEnd) {
  const HostProblem seed = testing::SeedExample(1.f, 3);
  std::vector<v1::TraceEvent> events;
  const absl::Status status =
      client_->Trace(TraceOf(ToRequest(seed, true), {}), [&](const v1::TraceEvent& event) {
        events.push_back(event);
        return true;
      });
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(events.size(), 6u);  // start, 3 steps, row_done, end
  EXPECT_TRUE(events[0].has_start());
  EXPECT_EQ(events[0].start().naive_intermediate_bytes(), 16 * 8 * 8);
  EXPECT_EQ(events[0].start().tiled_scratch_floats_per_row(), 3 + 4 + 2);
  EXPECT_EQ(events[0].start().tiles_per_row(), 3);
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(events[i].has_step());
    EXPECT_EQ(events[i].step().tile(), i - 1);
  }
  EXPECT_TRUE(std::isinf(events[1].step().max_before()));
  EXPECT_EQ(events[1].step().rescale(), 0.f);
  ASSERT_TRUE(events[4].has_row_done());
  EXPECT_NEAR(events[4].row_done().output(0), -0.593223f, 1e-6);
  EXPECT_LT(events[4].row_done().max_abs_error(), 1e-6);
  ASSERT_TRUE(events[5].has_end());
  EXPECT_EQ(events[5].end().rows(), 1);
  EXPECT_EQ(events[5].end().steps(), 3);
  EXPECT_EQ(events[5].end().stats().backend(), "cpu");
}

TEST_F(ServiceTest, TraceRowsAndLimitsAreChecked) {
  TearDown();
  StartServer(0, TraceLimits{.max_rows = 2, .max_steps = 10});
  const v1::AttentionRequest request = ValidRequest();  // [2, 6, 16, 4], default block_k 4.
  const std::pair<std::vector<std::array<int64_t, 3>>, const char*> cases[] = {
      {{{2, 0, 0}}, "rows[0].batch"},
      {{{0, 0, 0}, {0, 6, 0}}, "rows[1].head"},
      {{{0, 0, 16}}, "rows[0].row"},
      {{{0, 0, -1}}, "rows[0].row"},
      {{{0, 0, 0}, {0, 0, 1}, {0, 0, 2}}, "--max-trace-rows"},
      {{
           {0, 0, 0},
           {1, 5, 15},
       },
       "--max-trace-steps"},  // block_k 1: 2 × 16 steps > 10
  };
  for (const auto& [rows, field] : cases) {
    SCOPED_TRACE(field);
    v1::TraceRequest trace = TraceOf(request, rows);
    if (std::string(field) == "--max-trace-steps")
      trace.mutable_attention()->mutable_options()->set_block_k(1);
    const absl::Status status = client_->Trace(trace, [](const v1::TraceEvent&) { return true; });
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
  }
  v1::TraceRequest valid = TraceOf(request, {{0, 0, 0}, {1, 5, 15}});
  int64_t steps = 0;
  ASSERT_TRUE(client_
                  ->Trace(valid,
                          [&](const v1::TraceEvent& e) {
                            steps += e.has_step();
                            return true;
                          })
                  .ok());
  EXPECT_EQ(steps, 8);
}

TEST_F(ServiceTest, CancellingALongTraceStopsTheServerPromptly) {
  TearDown();
  StartServer(0, TraceLimits{.max_rows = 1, .max_steps = 1 << 20});
  HostProblem p =
      testing::RandomProblem({.query_len = 1, .key_len = 200000, .head_dim = 8, .value_dim = 8},
                             DType::kFloat32, false, 1, 9);
  const int64_t total_events = 200000 + 1;  // One step per key, then RowDone.
  int received = 0;
  const absl::Status status = client_->Trace(
      TraceOf(ToRequest(p), {}), [&](const v1::TraceEvent&) { return ++received < 50; });
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(received, 50);
  // Flow control bounds how far the server ran ahead; once it sees the cancellation it stops.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int64_t after_cancel = backend_->events.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(backend_->events.load(), after_cancel) << "the trace kept computing after cancel";
  EXPECT_LT(after_cancel, total_events / 10);
  EXPECT_TRUE(client_->Tiled(ValidRequest()).ok());
}

// A Tiled call of 32 row blocks (one head, 4096 rows): with the backend's block_delay_ms at 200
// and its two threads it computes for over 3.2 s whatever the machine, from a request of 3 MiB
// that arrives at once.
v1::AttentionRequest LongRequest() {
  HostProblem p =
      testing::RandomProblem({.query_len = 4096, .key_len = 4096, .head_dim = 64, .value_dim = 64},
                             DType::kFloat32, false, 0, 11);
  return ToRequest(p);
}

// Polls `done` every 5 ms for up to 20 s; false if it never became true.
bool WaitFor(const std::function<bool()>& done) {
  for (int i = 0; i < 4000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST_F(ServiceTest, ADeadlineStopsTheComputationAndFreesTheWorker) {
  backend_->block_delay_ms = 200;
  const v1::AttentionRequest long_request = LongRequest();
  const Clock::time_point start = Clock::now();
  absl::StatusOr<v1::AttentionResponse> cut =
      ClientWithDeadline(std::chrono::milliseconds(1000)).Tiled(long_request);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kDeadlineExceeded) << cut.status();
  ASSERT_TRUE(WaitFor([&] { return service_->computing() == 0; }));
  EXPECT_EQ(backend_->last_tiled_code.load(), absl::StatusCode::kDeadlineExceeded)
      << "the kernel ran to the end instead of stopping at the deadline";
  // The only worker (max-inflight 1 on the CPU) is free again: the kernel gave up early.
  // Run to the end, it would have taken over 3.2 s.
  EXPECT_LT(SecondsSince(start), 3.0) << "the computation went on after its deadline";
  backend_->block_delay_ms = 0;
  ASSERT_TRUE(client_->Tiled(ValidRequest()).ok());
  EXPECT_EQ(backend_->tiled_calls.load(), 2);
}

TEST_F(ServiceTest, ClientCancelStopsTheComputation) {
  backend_->block_delay_ms = 200;
  const v1::AttentionRequest long_request = LongRequest();
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::AttentionService::Stub> stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  v1::AttentionResponse response;
  Clock::time_point cancelled;
  std::thread canceller([&] {
    WaitFor([&] { return service_->computing() > 0; });
    cancelled = Clock::now();
    context.TryCancel();
  });
  const grpc::Status status = stub->Tiled(&context, long_request, &response);
  canceller.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  ASSERT_TRUE(WaitFor([&] { return service_->computing() == 0; }));
  EXPECT_EQ(backend_->last_tiled_code.load(), absl::StatusCode::kCancelled)
      << "the kernel ran to the end instead of stopping at the cancel";
  EXPECT_LT(SecondsSince(cancelled), 1.0) << "the computation went on after the cancel";
  backend_->block_delay_ms = 0;
  ASSERT_TRUE(client_->Tiled(ValidRequest()).ok());
}

// A server of one worker and a queue of one (max_inflight = max_queue = 1) kept busy: `request`
// (a long Tiled call, with the backend's block_delay_ms at 200) running until its 2 s deadline,
// and a second one waiting until `waiting_deadline`. started: both got that far.
struct Busy {
  Busy(ServiceTest& test, const v1::AttentionRequest& request,
       std::chrono::milliseconds waiting_deadline) {
    test.backend_->block_delay_ms = 200;
    first = std::thread([&test, &request, this] {
      running = test.ClientWithDeadline(std::chrono::milliseconds(2000)).Tiled(request).status();
    });
    if (!WaitFor([&] { return test.backend_->tiled_calls.load() > 0; })) return;
    second = std::thread([&test, &request, waiting_deadline, this] {
      waiting = test.ClientWithDeadline(waiting_deadline).Tiled(request).status();
    });
    started = WaitFor([&] { return test.service_->queued() > 0; });
  }
  ~Busy() { Join(); }
  void Join() {
    if (first.joinable()) first.join();
    if (second.joinable()) second.join();
  }

  bool started = false;
  absl::Status running, waiting;
  std::thread first, second;
};

TEST_F(ServiceTest, AFullQueueRefusesAtOnceAndAnExpiredWaiterNeverStarts) {
  TearDown();
  StartServer(0, {}, {.max_inflight = 1, .max_queue = 1, .memory_bytes = 0});
  const v1::AttentionRequest long_request = LongRequest();
  Busy busy(*this, long_request, std::chrono::milliseconds(800));
  ASSERT_TRUE(busy.started);

  const Clock::time_point start = Clock::now();
  absl::StatusOr<v1::AttentionResponse> refused = client_->Tiled(ValidRequest());
  EXPECT_LT(SecondsSince(start), 0.5) << "a full queue must refuse at once";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("--max-queue=1"), std::string::npos)
      << refused.status();

  busy.Join();
  EXPECT_EQ(busy.running.code(), absl::StatusCode::kDeadlineExceeded) << busy.running;
  EXPECT_EQ(busy.waiting.code(), absl::StatusCode::kDeadlineExceeded) << busy.waiting;
  ASSERT_TRUE(WaitFor([&] { return service_->computing() + service_->queued() == 0; }));
  EXPECT_EQ(backend_->tiled_calls.load(), 1) << "the waiter started after its deadline";
  backend_->block_delay_ms = 0;
  EXPECT_TRUE(client_->Tiled(ValidRequest()).ok());
  absl::StatusOr<v1::ServerInfo> info = client_->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->max_inflight(), 1);
  EXPECT_EQ(info->max_queue(), 1);
}

// Non-finite elements anywhere in a large request (one that takes the compute queue, where the
// pass over its elements runs) are refused naming the tensor, by every method.
TEST_F(ServiceTest, ALargeRequestWithANonFiniteElementIsRefusedNamingTheTensor) {
  backend_->inline_calls = true;
  const HostProblem p = testing::RandomProblem(
      {.heads = 2, .query_len = 301, .key_len = 1201, .head_dim = 33, .value_dim = 31},
      DType::kBFloat16, false, 0, 17);
  const v1::AttentionRequest valid = ToRequest(p);
  ASSERT_TRUE(client_->Tiled(valid).ok());
  EXPECT_EQ(backend_->inline_answers.load(), 0) << "a large request ran on gRPC's thread";
  const uint16_t bf16_inf = 0x7f80, bf16_nan = 0xffc1;
  struct Poison {
    const char* field;
    int64_t element;
    uint16_t bits;
  };
  for (const Poison& poison :
       {Poison{"query.data", 2 * 301 * 33 - 1, bf16_inf},
        Poison{"key.data", 1201 * 33 / 2, bf16_nan}, Poison{"value.data", 17, bf16_inf}}) {
    SCOPED_TRACE(poison.field);
    v1::AttentionRequest request = valid;
    v1::Tensor* tensor = poison.field[0] == 'q'   ? request.mutable_query()
                         : poison.field[0] == 'k' ? request.mutable_key()
                                                  : request.mutable_value();
    std::memcpy(tensor->mutable_data()->data() + 2 * poison.element, &poison.bits, 2);
    const std::string element = absl::StrCat("element ", poison.element, " is ");
    for (const absl::Status& status :
         {client_->Naive(request).status(), client_->Tiled(request).status(),
          client_->Trace(TraceOf(request, {}), [](const v1::TraceEvent&) { return true; })}) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find(poison.field), std::string::npos) << status;
      EXPECT_NE(status.message().find(element), std::string::npos) << status;
    }
  }
  EXPECT_TRUE(WaitFor([&] { return service_->computing() + service_->queued() == 0; }));
}

// With the only worker busy and the queue full, a call too small to matter still runs at once,
// on gRPC's thread, and right; a large one is refused as before.
TEST_F(ServiceTest, ASmallCallRunsAtOnceWhileTheWorkerAndTheQueueAreBusy) {
  TearDown();
  StartServer(0, {}, {.max_inflight = 1, .max_queue = 1, .memory_bytes = 0});
  backend_->inline_calls = true;
  const v1::AttentionRequest long_request = LongRequest();
  Busy busy(*this, long_request, std::chrono::milliseconds(1500));
  ASSERT_TRUE(busy.started);

  const HostProblem small = testing::RandomProblem(
      {.heads = 2, .kv_heads = 1, .query_len = 5, .key_len = 7, .head_dim = 3, .value_dim = 5},
      DType::kFloat32, true, 0, 23);
  const testing::Reference ref = testing::ReferenceAttention(small);
  const Clock::time_point start = Clock::now();
  absl::StatusOr<v1::AttentionResponse> answer = client_->Naive(ToRequest(small));
  int events = 0;
  const absl::Status trace = client_->Trace(TraceOf(ToRequest(small), {}),
                                            [&](const v1::TraceEvent&) { return ++events > 0; });
  EXPECT_LT(SecondsSince(start), 0.5) << "the small calls waited for the busy worker";
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_LE(testing::MaxAbsError(OutputOf(*answer), ref.output),
            1e-5 * testing::MaxAbs(ref.output));
  EXPECT_TRUE(trace.ok()) << trace;
  EXPECT_GT(events, 2);
  EXPECT_EQ(client_->Tiled(long_request).status().code(), absl::StatusCode::kResourceExhausted);

  busy.Join();
  EXPECT_EQ(busy.running.code(), absl::StatusCode::kDeadlineExceeded) << busy.running;
  EXPECT_EQ(busy.waiting.code(), absl::StatusCode::kDeadlineExceeded) << busy.waiting;
  backend_->block_delay_ms = 0;
}

TEST_F(ServiceTest, DrainingRefusesNewCallsWithUnavailable) {
  ASSERT_TRUE(client_->Tiled(ValidRequest()).ok());
  service_->StartDrain();
  EXPECT_EQ(client_->Tiled(ValidRequest()).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client_->Naive(ValidRequest()).status().code(), absl::StatusCode::kUnavailable);
  const absl::Status trace =
      client_->Trace(TraceOf(ValidRequest(), {}), [](const v1::TraceEvent&) { return true; });
  EXPECT_EQ(trace.code(), absl::StatusCode::kUnavailable) << trace;
  EXPECT_TRUE(client_->Info().ok()) << "GetServerInfo still answers while draining";
}

TEST_F(ServiceTest, AClientThatStopsReadingHoldsTheTraceAtTheFlowControlWindow) {
  TearDown();
  StartServer(0, TraceLimits{.max_rows = 1, .max_steps = 1 << 20});
  HostProblem p =
      testing::RandomProblem({.query_len = 1, .key_len = 200000, .head_dim = 8, .value_dim = 8},
                             DType::kFloat32, false, 1, 9);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
  std::unique_ptr<v1::AttentionService::Stub> stub = v1::AttentionService::NewStub(channel);
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> reader =
      stub->Trace(&context, TraceOf(ToRequest(p), {}));
  v1::TraceEvent event;
  ASSERT_TRUE(reader->Read(&event));
  // The client reads nothing more: the server computes only what the transport buffers, then
  // waits (on a busy machine filling the windows takes a while: wait for the count to settle).
  // gRPC may widen its windows a few times (BDP probing), so "settled" means a whole second
  // without a new event, within 30 s.
  int64_t stalled = backend_->events.load();
  for (int quiet_ms = 0, waited_ms = 0; quiet_ms < 1000 && waited_ms < 30000; waited_ms += 100) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int64_t now = backend_->events.load();
    quiet_ms = now == stalled ? quiet_ms + 100 : 0;
    stalled = now;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(backend_->events.load(), stalled) << "the server kept computing for a stalled reader";
  // What it computed is what the HTTP/2 windows hold (a few MiB), not the trace.
  EXPECT_LT(stalled, 200000 / 2) << "the server buffered most of the trace";
  // Reading again drains the windows and the server resumes.
  int64_t read = 0;
  while (read < 150000 && backend_->events.load() == stalled && reader->Read(&event)) ++read;
  EXPECT_GT(backend_->events.load(), stalled) << "the stream did not resume after " << read;
  context.TryCancel();
  reader->Finish();
}

TEST_F(ServiceTest, TraceStreamsPastMaxTracesAreRefusedUntilOneCloses) {
  TearDown();
  StartServer(0, TraceLimits{.max_rows = 1, .max_steps = 1 << 20, .max_streams = 1});
  HostProblem p =
      testing::RandomProblem({.query_len = 1, .key_len = 200000, .head_dim = 8, .value_dim = 8},
                             DType::kFloat32, false, 1, 9);
  const v1::TraceRequest long_trace = TraceOf(ToRequest(p), {});
  auto open_stream = [&](grpc::ClientContext& context) {
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
    return v1::AttentionService::NewStub(channel)->Trace(&context, long_trace);
  };
  grpc::ClientContext first_context;
  std::unique_ptr<grpc::ClientReader<v1::TraceEvent>> first = open_stream(first_context);
  v1::TraceEvent event;
  ASSERT_TRUE(first->Read(&event));  // The first stream is open and holds the only slot.

  const absl::Status refused =
      client_->Trace(TraceOf(ValidRequest(), {}), [](const v1::TraceEvent&) { return true; });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("--max-traces=1"), std::string::npos) << refused;

  first_context.TryCancel();
  first->Finish();
  // The slot comes back when the server sees the stream end.
  absl::Status again = refused;
  for (int i = 0; i < 200 && !again.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    again = client_->Trace(TraceOf(ValidRequest(), {}), [](const v1::TraceEvent&) { return true; });
  }
  EXPECT_TRUE(again.ok()) << again;
}

}  // namespace
}  // namespace attn
