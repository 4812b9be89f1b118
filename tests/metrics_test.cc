// Metrics and request logs: the registry's exact Prometheus text and histogram bucket math, the
// request log's line format, and, end to end over loopback, a server with the request observer
// and the HTTP port: a few RPCs, then /metrics (counters by method and code, histogram counts,
// bytes), /healthz, /readyz and the log lines they produced.
#include "server/metrics.h"

#include <chrono>
#include <cmath>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/http_port.h"
#include "server/request_log.h"
#include "server/service.h"

namespace attn {
namespace {

namespace v1 = attention::v1;

// --- The registry's text ----------------------------------------------------------------------

TEST(MetricsRegistryTest, RendersExactText) {
  MetricsRegistry registry;
  Family<Counter>& requests =
      registry.AddCounter("test_requests_total", "Requests, by method.", {"method", "code"});
  Gauge& temperature = registry.AddGauge("test_temperature", "A gauge.").WithLabels({});
  Family<Histogram>& latency =
      registry.AddHistogram("test_seconds", "Latency.", {0.0005, 0.5, 1, 1e7}, {"method"});
  registry.AddGaugeCallback("test_callback", "Read at render.", [] { return 42.0; });

  requests.WithLabels({"Tiled", "OK"}).Increment();
  requests.WithLabels({"Tiled", "OK"}).Increment(2);
  requests.WithLabels({"Naive", "INVALID_ARGUMENT"}).Increment();
  temperature.Set(-1.5e-7);
  Histogram& tiled = latency.WithLabels({"Tiled"});
  for (const double seconds : {0.25, 0.5, 2.0, 100.0}) tiled.Observe(seconds);

  EXPECT_EQ(registry.Render(),
            "# HELP test_requests_total Requests, by method.\n"
            "# TYPE test_requests_total counter\n"
            "test_requests_total{method=\"Naive\",code=\"INVALID_ARGUMENT\"} 1\n"
            "test_requests_total{method=\"Tiled\",code=\"OK\"} 3\n"
            "# HELP test_temperature A gauge.\n"
            "# TYPE test_temperature gauge\n"
            "test_temperature -1.5e-07\n"
            "# HELP test_seconds Latency.\n"
            "# TYPE test_seconds histogram\n"
            "test_seconds_bucket{method=\"Tiled\",le=\"0.0005\"} 0\n"
            "test_seconds_bucket{method=\"Tiled\",le=\"0.5\"} 2\n"
            "test_seconds_bucket{method=\"Tiled\",le=\"1\"} 2\n"
            "test_seconds_bucket{method=\"Tiled\",le=\"10000000\"} 4\n"
            "test_seconds_bucket{method=\"Tiled\",le=\"+Inf\"} 4\n"
            "test_seconds_sum{method=\"Tiled\"} 102.75\n"
            "test_seconds_count{method=\"Tiled\"} 4\n"
            "# HELP test_callback Read at render.\n"
            "# TYPE test_callback gauge\n"
            "test_callback 42\n");
}

TEST(MetricsRegistryTest, EmptyFamiliesAndUnlabelledHistograms) {
  MetricsRegistry registry;
  registry.AddCounter("a_total", "Labelled, never used.", {"x"});
  registry.AddCounter("b_total", "Unlabelled: 0 from the start.");
  registry.AddHistogram("c_seconds", "Unlabelled histogram.", {1});
  EXPECT_EQ(registry.Render(),
            "# HELP a_total Labelled, never used.\n"
            "# TYPE a_total counter\n"
            "# HELP b_total Unlabelled: 0 from the start.\n"
            "# TYPE b_total counter\n"
            "b_total 0\n"
            "# HELP c_seconds Unlabelled histogram.\n"
            "# TYPE c_seconds histogram\n"
            "c_seconds_bucket{le=\"1\"} 0\n"
            "c_seconds_bucket{le=\"+Inf\"} 0\n"
            "c_seconds_sum 0\n"
            "c_seconds_count 0\n");
}

TEST(MetricsRegistryTest, EscapesHelpAndLabelValues) {
  MetricsRegistry registry;
  registry.AddGauge("g", "Back\\slash and\nnewline \"quoted\".", {"v"})
      .WithLabels({"a\"b\\c\nd"})
      .Set(std::numeric_limits<double>::infinity());
  EXPECT_EQ(registry.Render(),
            "# HELP g Back\\\\slash and\\nnewline \"quoted\".\n"
            "# TYPE g gauge\n"
            "g{v=\"a\\\"b\\\\c\\nd\"} +Inf\n");
}

TEST(HistogramTest, BucketsCountValuesLessThanOrEqualToTheirBound) {
  Histogram histogram({0.001, 0.01, 0.1});
  for (const double value : {-5.0, 0.0, 0.001, 0.0010001, 0.01, 0.1, 0.1000001, 1e9}) {
    histogram.Observe(value);
  }
  histogram.Observe(std::nan(""));  // Dropped.
  const Histogram::Snapshot snapshot = histogram.snapshot();
  EXPECT_EQ(snapshot.bounds, (std::vector<double>{0.001, 0.01, 0.1}));
  // ≤ 0.001: -5, 0, 0.001; ≤ 0.01: + 0.0010001, 0.01; ≤ 0.1: + 0.1; +Inf: + 0.1000001, 1e9.
  EXPECT_EQ(snapshot.cumulative, (std::vector<int64_t>{3, 5, 6}));
  EXPECT_EQ(snapshot.count, 8);
  EXPECT_DOUBLE_EQ(snapshot.sum, -5 + 0.001 + 0.0010001 + 0.01 + 0.1 + 0.1000001 + 1e9);
}

TEST(HistogramTest, LatencyBucketsIncrease) {
  const std::vector<double> bounds = LatencyBuckets();
  ASSERT_FALSE(bounds.empty());
  for (size_t i = 1; i < bounds.size(); ++i) EXPECT_LT(bounds[i - 1], bounds[i]);
}

// --- The request log --------------------------------------------------------------------------

TEST(RequestLogTest, ParsesLevels) {
  EXPECT_EQ(*ParseLogLevel("error"), LogLevel::kError);
  EXPECT_EQ(*ParseLogLevel("info"), LogLevel::kInfo);
  EXPECT_EQ(*ParseLogLevel("debug"), LogLevel::kDebug);
  const absl::StatusOr<LogLevel> bad = ParseLogLevel("verbose");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("error, info or debug"), std::string::npos);
}

TEST(RequestLogTest, FormatsOneLogfmtLine) {
  RequestRecord record;
  record.path = "/attention.v1.AttentionService/Tiled";
  record.service = "attention.v1.AttentionService";
  record.method = "Tiled";
  record.peer = "ipv4:127.0.0.1:40000";
  record.shape = "1,8,2048,2048,64";
  record.dtype = "bf16";
  record.seconds = 0.0123456;
  record.bytes_received = 1000;
  record.bytes_sent = 200;
  const absl::Time now = absl::FromUnixMillis(1700000000123);
  EXPECT_EQ(FormatRequestLine(record, now),
            "2023-11-14T22:13:20.123Z attnd level=info "
            "method=/attention.v1.AttentionService/Tiled code=OK ms=12.346 "
            "shape=1,8,2048,2048,64 dtype=bf16 bytes_in=1000 bytes_out=200 "
            "peer=ipv4:127.0.0.1:40000");

  record.code = grpc::StatusCode::INVALID_ARGUMENT;
  record.message = "key.shape[3]: \"x\"\nforged=1";
  EXPECT_EQ(FormatRequestLine(record, now),
            "2023-11-14T22:13:20.123Z attnd level=error "
            "method=/attention.v1.AttentionService/Tiled code=INVALID_ARGUMENT ms=12.346 "
            "shape=1,8,2048,2048,64 dtype=bf16 bytes_in=1000 bytes_out=200 "
            "peer=ipv4:127.0.0.1:40000 message=\"key.shape[3]: \\\"x\\\"\\nforged=1\"");

  RequestRecord health;
  health.path = "/grpc.health.v1.Health/Check";
  health.service = "grpc.health.v1.Health";
  health.method = "Check";
  health.peer = "ipv6:[::1]:5";
  EXPECT_EQ(FormatRequestLine(health, now),
            "2023-11-14T22:13:20.123Z attnd level=debug method=/grpc.health.v1.Health/Check "
            "code=OK ms=0.000 bytes_in=0 bytes_out=0 peer=ipv6:[::1]:5");

  // A Watch ends when its client leaves or the server stops: not an error. Any other failure of
  // it, or a Check's, is.
  health.path = "/grpc.health.v1.Health/Watch";
  health.method = "Watch";
  for (const grpc::StatusCode code : {grpc::StatusCode::CANCELLED, grpc::StatusCode::UNAVAILABLE}) {
    health.code = code;
    EXPECT_NE(FormatRequestLine(health, now).find(" level=debug "), std::string::npos);
  }
  health.code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  EXPECT_NE(FormatRequestLine(health, now).find(" level=error "), std::string::npos);
  health.path = "/grpc.health.v1.Health/Check";
  health.code = grpc::StatusCode::CANCELLED;
  EXPECT_NE(FormatRequestLine(health, now).find(" level=error "), std::string::npos);
}

TEST(RequestLogTest, NamesCodesAsGrpcDoes) {
  RequestRecord record;
  record.path = "/attention.v1.AttentionService/Tiled";
  const char* const names[] = {"OK",
                               "CANCELLED",
                               "UNKNOWN",
                               "INVALID_ARGUMENT",
                               "DEADLINE_EXCEEDED",
                               "NOT_FOUND",
                               "ALREADY_EXISTS",
                               "PERMISSION_DENIED",
                               "RESOURCE_EXHAUSTED",
                               "FAILED_PRECONDITION",
                               "ABORTED",
                               "OUT_OF_RANGE",
                               "UNIMPLEMENTED",
                               "INTERNAL",
                               "UNAVAILABLE",
                               "DATA_LOSS",
                               "UNAUTHENTICATED"};
  for (int code = 0; code <= 16; ++code) {
    record.code = static_cast<grpc::StatusCode>(code);
    EXPECT_NE(
        FormatRequestLine(record, absl::UnixEpoch()).find(absl::StrCat(" code=", names[code], " ")),
        std::string::npos)
        << code;
  }
  // A number no code has (a handler may build any grpc::Status) is never an empty field. 31: the
  // largest value grpc::StatusCode can hold (its codes need 5 bits; a larger one is undefined).
  record.code = static_cast<grpc::StatusCode>(31);
  EXPECT_NE(FormatRequestLine(record, absl::UnixEpoch()).find(" code=UNKNOWN "), std::string::npos);
}

// --- End to end: a server with the observer and the HTTP port ---------------------------------

v1::Tensor FloatTensor(std::vector<int64_t> shape, float start) {
  int64_t count = 1;
  for (const int64_t n : shape) count *= n;
  std::vector<float> values(count);
  for (int64_t i = 0; i < count; ++i) values[i] = start + 0.01f * static_cast<float>(i % 37);
  v1::Tensor tensor;
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_dtype(v1::DTYPE_FLOAT32);
  tensor.set_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

// [1, 2, 5, 4] queries over 7 keys.
v1::AttentionRequest SmallRequest() {
  v1::AttentionRequest request;
  *request.mutable_query() = FloatTensor({1, 2, 5, 4}, 0.5f);
  *request.mutable_key() = FloatTensor({1, 2, 7, 4}, -0.25f);
  *request.mutable_value() = FloatTensor({1, 2, 7, 4}, 1.0f);
  return request;
}

// The value of the sample `series` (name and labels, exactly as rendered), or NaN when absent.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, series + " ")) {
      return std::stod(std::string(line.substr(series.size() + 1)));
    }
  }
  return std::nan("");
}

std::string Rpc(absl::string_view method, absl::string_view code) {
  return absl::StrCat("{service=\"attention.v1.AttentionService\",method=\"", method, "\",code=\"",
                      code, "\"}");
}

class ObservedServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = std::make_unique<CpuBackend>(2, 0);
    service_ = std::make_unique<AttentionService>(*backend_, ServiceConfig{});
    observer_ = std::make_unique<RequestObserver>(registry_, LogLevel::kInfo,
                                                  [this](absl::string_view line) {
                                                    std::lock_guard<std::mutex> lock(mutex_);
                                                    log_.emplace_back(line);
                                                  });
    AddServerGauges(registry_, *service_, *backend_);
    http_ = std::make_unique<HttpPort>(registry_, ready_);
    ASSERT_TRUE(http_->Start("127.0.0.1:0").ok());
    ASSERT_NE(http_->port(), 0);

    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(observer_->InterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = absl::StrCat("127.0.0.1:", port);
    client_ = std::make_unique<client::Client>(target_);
    ready_.Set(true);
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    http_->Stop();
  }

  // GET path on the HTTP port: {status, body}; status -1 when the request failed.
  std::pair<int, std::string> Get(const std::string& path) {
    httplib::Client http("127.0.0.1", http_->port());
    httplib::Result result = http.Get(path);
    if (!result) return {-1, ""};
    return {result->status, result->body};
  }

  std::vector<std::string> Log() {
    std::lock_guard<std::mutex> lock(mutex_);
    return log_;
  }

  MetricsRegistry registry_;
  ReadyFlag ready_;
  std::unique_ptr<CpuBackend> backend_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<RequestObserver> observer_;
  std::unique_ptr<HttpPort> http_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::unique_ptr<client::Client> client_;
  std::mutex mutex_;
  std::vector<std::string> log_;
};

TEST_F(ObservedServerTest, MetricsCountRpcsByMethodAndCode) {
  const v1::AttentionRequest good = SmallRequest();
  v1::AttentionRequest bad = SmallRequest();
  *bad.mutable_key() = FloatTensor({1, 2, 7, 3}, 0.f);  // head_dim 3, query's 4.

  int64_t sent_ok = 0;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<v1::AttentionResponse> response = client_->Tiled(good);
    ASSERT_TRUE(response.ok()) << response.status();
    sent_ok += static_cast<int64_t>(response->ByteSizeLong());
  }
  absl::StatusOr<v1::AttentionResponse> refused = client_->Naive(bad);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  ASSERT_TRUE(client_->Health().ok());

  const auto [status, text] = Get("/metrics");
  ASSERT_EQ(status, 200);
  EXPECT_EQ(Sample(text, "attnd_rpc_requests_total" + Rpc("Tiled", "OK")), 2) << text;
  EXPECT_EQ(Sample(text, "attnd_rpc_requests_total" + Rpc("Naive", "INVALID_ARGUMENT")), 1);
  EXPECT_TRUE(std::isnan(Sample(text, "attnd_rpc_requests_total" + Rpc("Naive", "OK"))));
  EXPECT_EQ(Sample(text,
                   "attnd_rpc_requests_total{service=\"grpc.health.v1.Health\",method=\"Check\","
                   "code=\"OK\"}"),
            1);

  // The histogram: every call in +Inf and _count; the buckets never decrease.
  const std::string tiled_ok = Rpc("Tiled", "OK");
  EXPECT_EQ(Sample(text, "attnd_rpc_duration_seconds_count" + tiled_ok), 2);
  const std::string inf_bucket =
      absl::StrCat(tiled_ok.substr(0, tiled_ok.size() - 1), ",le=\"+Inf\"}");
  EXPECT_EQ(Sample(text, "attnd_rpc_duration_seconds_bucket" + inf_bucket), 2);
  EXPECT_GT(Sample(text, "attnd_rpc_duration_seconds_sum" + tiled_ok), 0);
  EXPECT_EQ(Sample(text, "attnd_rpc_duration_seconds_count" + Rpc("Naive", "INVALID_ARGUMENT")), 1);
  const std::string bucket_prefix = absl::StrCat("attnd_rpc_duration_seconds_bucket",
                                                 tiled_ok.substr(0, tiled_ok.size() - 1), ",le=");
  int buckets = 0;
  double previous = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, bucket_prefix)) continue;
    const double count = std::stod(std::string(line.substr(line.rfind(' ') + 1)));
    EXPECT_GE(count, previous) << line;
    previous = count;
    ++buckets;
  }
  EXPECT_EQ(buckets, static_cast<int>(LatencyBuckets().size()) + 1);

  // Bytes: the requests' and responses' message sizes.
  EXPECT_EQ(Sample(text, "attnd_rpc_received_bytes_total" + tiled_ok),
            2 * static_cast<double>(good.ByteSizeLong()));
  EXPECT_EQ(Sample(text, "attnd_rpc_sent_bytes_total" + tiled_ok), static_cast<double>(sent_ok));
  EXPECT_EQ(Sample(text, "attnd_rpc_received_bytes_total" + Rpc("Naive", "INVALID_ARGUMENT")),
            static_cast<double>(bad.ByteSizeLong()));
  EXPECT_EQ(Sample(text, "attnd_rpc_sent_bytes_total" + Rpc("Naive", "INVALID_ARGUMENT")), 0);
  // Only attention.v1 requests are counted (request_log.h): a health check's are not.
  EXPECT_EQ(Sample(text,
                   "attnd_rpc_received_bytes_total{service=\"grpc.health.v1.Health\","
                   "method=\"Check\",code=\"OK\"}"),
            0);

  // Gauges: nothing in flight once the calls returned; the process uses some memory.
  EXPECT_EQ(
      Sample(text,
             "attnd_rpc_inflight{service=\"attention.v1.AttentionService\",method=\"Tiled\"}"),
      0);
  EXPECT_EQ(Sample(text, "attnd_compute_inflight"), 0);
  EXPECT_EQ(Sample(text, "attnd_compute_queued"), 0);
  EXPECT_EQ(Sample(text, "attnd_inflight_request_bytes"), 0);  // Every answered call gave its back.
  EXPECT_EQ(Sample(text, "attnd_trace_idle_cancelled"), 0);
  EXPECT_GT(Sample(text, "attnd_host_memory_rss_bytes"), 1 << 20);
  EXPECT_NE(text.find("# TYPE attnd_rpc_duration_seconds histogram\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE attnd_rpc_requests_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("attnd_build_info{version=\""), std::string::npos);
}

TEST_F(ObservedServerTest, UnknownMethodsShareOneLabel) {
  grpc::GenericStub stub(grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
  for (const char* method : {"/no.Such/Method", "/attention.v1.AttentionService/Nope"}) {
    grpc::ClientContext context;
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1);  // A default ByteBuffer is no message at all.
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status status) { done.set_value(status); });
    EXPECT_EQ(done.get_future().get().error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  const std::string text = Get("/metrics").second;
  const double unknown = Sample(
      text,
      "attnd_rpc_requests_total{service=\"unknown\",method=\"unknown\",code=\"UNIMPLEMENTED\"}");
  EXPECT_EQ(unknown, 2) << text;
  EXPECT_EQ(text.find("no.Such"), std::string::npos);
  EXPECT_EQ(text.find("Nope"), std::string::npos);
}

TEST_F(ObservedServerTest, LogsOneLinePerRequestAtItsLevel) {
  ASSERT_TRUE(client_->Tiled(SmallRequest()).ok());
  v1::AttentionRequest bad = SmallRequest();
  bad.mutable_query()->set_dtype(v1::DTYPE_FLOAT16);  // Byte length now wrong for the shape.
  ASSERT_FALSE(client_->Naive(bad).ok());
  ASSERT_TRUE(client_->Health().ok());  // A debug-level call: not written at info.

  const std::vector<std::string> log = Log();
  ASSERT_EQ(log.size(), 2u) << absl::StrJoin(log, "");
  EXPECT_NE(log[0].find(" attnd level=info method=/attention.v1.AttentionService/Tiled code=OK "),
            std::string::npos)
      << log[0];
  EXPECT_NE(log[0].find(" shape=1,2,5,7,4 dtype=f32 "), std::string::npos) << log[0];
  EXPECT_NE(log[0].find(" peer=ipv"), std::string::npos) << log[0];
  EXPECT_EQ(log[0].back(), '\n');
  EXPECT_NE(log[1].find(" level=error method=/attention.v1.AttentionService/Naive "
                        "code=INVALID_ARGUMENT "),
            std::string::npos)
      << log[1];
  EXPECT_NE(log[1].find(" dtype=f16 "), std::string::npos) << log[1];
  EXPECT_NE(log[1].find(" message=\"query"), std::string::npos) << log[1];
}

TEST_F(ObservedServerTest, LogsTheShapeOfEveryRank) {
  // Rank 2 and 3 drop leading dimensions of 1; another rank, or ranks that differ, log "?".
  v1::AttentionRequest rank3;
  *rank3.mutable_query() = FloatTensor({2, 5, 4}, 0.5f);
  *rank3.mutable_key() = FloatTensor({2, 7, 4}, -0.25f);
  *rank3.mutable_value() = FloatTensor({2, 7, 4}, 1.0f);
  ASSERT_TRUE(client_->Tiled(rank3).ok());
  v1::AttentionRequest rank2;
  *rank2.mutable_query() = FloatTensor({5, 4}, 0.5f);
  *rank2.mutable_key() = FloatTensor({7, 4}, -0.25f);
  *rank2.mutable_value() = FloatTensor({7, 4}, 1.0f);
  ASSERT_TRUE(client_->Naive(rank2).ok());
  v1::AttentionRequest rank5 = SmallRequest();
  *rank5.mutable_query() = FloatTensor({1, 1, 2, 5, 4}, 0.5f);
  ASSERT_FALSE(client_->Tiled(rank5).ok());
  v1::AttentionRequest mixed = SmallRequest();
  *mixed.mutable_key() = FloatTensor({2, 7, 4}, -0.25f);
  ASSERT_FALSE(client_->Tiled(mixed).ok());

  const std::vector<std::string> log = Log();
  ASSERT_EQ(log.size(), 4u) << absl::StrJoin(log, "");
  EXPECT_NE(log[0].find(" shape=1,2,5,7,4 "), std::string::npos) << log[0];
  EXPECT_NE(log[1].find(" shape=1,1,5,7,4 "), std::string::npos) << log[1];
  EXPECT_NE(log[2].find(" shape=? "), std::string::npos) << log[2];
  EXPECT_NE(log[3].find(" shape=? "), std::string::npos) << log[3];
}

TEST_F(ObservedServerTest, HealthAndReadiness) {
  EXPECT_EQ(Get("/healthz"), std::make_pair(200, std::string("ok\n")));
  EXPECT_EQ(Get("/readyz"), std::make_pair(200, std::string("ready\n")));
  ready_.Set(false);
  EXPECT_EQ(Get("/readyz"), std::make_pair(503, std::string("not ready\n")));
  EXPECT_EQ(Get("/healthz").first, 200);
  EXPECT_EQ(Get("/no-such-page").first, 404);
}

TEST(HttpPortTest, RefusesABusyPortAndBadAddresses) {
  MetricsRegistry registry;
  ReadyFlag ready;
  HttpPort first(registry, ready);
  ASSERT_TRUE(first.Start("127.0.0.1:0").ok());
  HttpPort second(registry, ready);
  const absl::Status busy = second.Start(absl::StrCat("127.0.0.1:", first.port()));
  EXPECT_EQ(busy.code(), absl::StatusCode::kUnavailable) << busy;
  EXPECT_NE(busy.message().find("cannot bind HTTP to 127.0.0.1:"), std::string::npos) << busy;
  EXPECT_EQ(second.Start("localhost").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(second.Start("127.0.0.1:http").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(second.Start("127.0.0.1:65536").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(first.Start("127.0.0.1:0").code(), absl::StatusCode::kFailedPrecondition);
  first.Stop();
  first.Stop();  // Idempotent.
}

TEST(HttpPortTest, StopsRightAfterStart) {
  MetricsRegistry registry;
  ReadyFlag ready;
  for (int i = 0; i < 20; ++i) {
    HttpPort port(registry, ready);
    ASSERT_TRUE(port.Start("127.0.0.1:0").ok());
    port.Stop();
  }
}

}  // namespace
}  // namespace attn
