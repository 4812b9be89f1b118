// attnd's grpc.health.v1 service (server/health.h) over loopback: Check for "", the attention
// service and an unknown name; Watch's first status, its changes (coalesced to the latest) and
// SERVICE_UNKNOWN; the --max-health-watches bound and its slot freed by a client cancel; a
// stream whose reader stopped reading cancelled; Server::Shutdown with streams open.
#include "server/health.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace attn {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using std::chrono::milliseconds;
using ServingStatus = HealthCheckResponse::ServingStatus;

constexpr char kAttentionService[] = "attention.v1.AttentionService";

// One client Watch stream, read one status at a time; cancelled and finished when destroyed.
class WatchStream {
 public:
  WatchStream(Health::Stub& stub, const std::string& service, milliseconds deadline) {
    context_.set_deadline(std::chrono::system_clock::now() + deadline);
    HealthCheckRequest request;
    request.set_service(service);
    reader_ = stub.Watch(&context_, request);
  }
  ~WatchStream() {
    if (status_.has_value()) return;
    context_.TryCancel();
    reader_->Finish();
  }

  // The next status sent, or nullopt once the stream has ended (status() then says how).
  std::optional<ServingStatus> Next() {
    HealthCheckResponse response;
    if (!status_.has_value() && reader_->Read(&response)) return response.status();
    if (!status_.has_value()) status_ = reader_->Finish();
    return std::nullopt;
  }
  grpc::Status status() const {
    return status_.value_or(grpc::Status(grpc::StatusCode::UNKNOWN, "the stream is still open"));
  }
  void Cancel() { context_.TryCancel(); }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader_;
  std::optional<grpc::Status> status_;
};

// Runs `call` on its own thread and expects it to return within `limit`. A call that never
// returns would also hang the test binary's exit, so then the process ends at once, saying why.
void ExpectReturnsWithin(milliseconds limit, const char* what, std::function<void()> call) {
  auto returned = std::make_shared<std::promise<void>>();
  std::future<void> future = returned->get_future();
  std::thread([call = std::move(call), returned] {
    call();
    returned->set_value();
  }).detach();
  if (future.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: %s did not return within %lld ms\n", what,
                 static_cast<long long>(limit.count()));
    std::fflush(stderr);
    std::_Exit(1);
  }
}

// Polls `condition` every 10 ms for up to 10 s; whether it came true.
bool Eventually(const std::function<bool()>& condition) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

class HealthTest : public ::testing::Test {
 protected:
  void Start(int64_t max_watches, int64_t idle_seconds = HealthService::kDefaultIdleSeconds,
             const grpc::ChannelArguments& client_arguments = {}) {
    health_ = std::make_unique<HealthService>(max_watches, idle_seconds);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(health_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = Health::NewStub(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), client_arguments));
  }
  void TearDown() override {
    if (server_ == nullptr) return;
    health_->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    HealthCheckRequest request;
    request.set_service(service);
    return stub_->Check(&context, request, response);
  }

  std::unique_ptr<WatchStream> Watch(const std::string& service,
                                     milliseconds deadline = milliseconds(30000)) {
    return std::make_unique<WatchStream>(*stub_, service, deadline);
  }

  std::unique_ptr<HealthService> health_;  // Outlives server_.
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(HealthTest, CheckKnowsTheServerAndTheAttentionService) {
  Start(4);
  for (const bool serving : {true, false, true}) {
    health_->SetServing(serving);
    const ServingStatus expected =
        serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
    for (const std::string service : {"", kAttentionService}) {
      HealthCheckResponse response;
      const grpc::Status status = Check(service, &response);
      ASSERT_TRUE(status.ok()) << "\"" << service << "\": " << status.error_message();
      EXPECT_EQ(response.status(), expected) << "\"" << service << "\"";
    }
    HealthCheckResponse response;
    const grpc::Status unknown = Check("attention.v1.NoSuchService", &response);
    EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << unknown.error_message();
    EXPECT_NE(unknown.error_message().find("\"attention.v1.NoSuchService\""), std::string::npos)
        << unknown.error_message();
  }
}

TEST_F(HealthTest, WatchSendsTheStatusAtOnceThenEachChange) {
  Start(4);
  std::unique_ptr<WatchStream> server = Watch("");
  std::unique_ptr<WatchStream> attention = Watch(kAttentionService);
  for (WatchStream* stream : {server.get(), attention.get()}) {
    EXPECT_EQ(stream->Next(), HealthCheckResponse::SERVING);
  }
  health_->SetServing(false);
  for (WatchStream* stream : {server.get(), attention.get()}) {
    EXPECT_EQ(stream->Next(), HealthCheckResponse::NOT_SERVING);
  }
  // No change, nothing sent: the next status is the next change's, not NOT_SERVING again.
  health_->SetServing(false);
  health_->SetServing(true);
  for (WatchStream* stream : {server.get(), attention.get()}) {
    EXPECT_EQ(stream->Next(), HealthCheckResponse::SERVING);
  }
  EXPECT_EQ(health_->open_watches(), 2);
}

TEST_F(HealthTest, WatchOfAnUnknownServiceSendsServiceUnknownAndStaysOpen) {
  Start(4);
  std::unique_ptr<WatchStream> unknown = Watch("attention.v1.NoSuchService", milliseconds(1500));
  EXPECT_EQ(unknown->Next(), HealthCheckResponse::SERVICE_UNKNOWN);
  EXPECT_EQ(health_->open_watches(), 1);
  health_->SetServing(false);  // Says nothing about an unknown service.
  EXPECT_EQ(unknown->Next(), std::nullopt);
  // Open, and silent, until the client's deadline ended it.
  EXPECT_EQ(unknown->status().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << unknown->status().error_message();
}

// 1001 changes while the stream's writes are in flight: a watcher gets no repeat and always ends
// on the latest status.
TEST_F(HealthTest, ChangesAreCoalescedToTheLatestStatus) {
  Start(4);
  std::unique_ptr<WatchStream> stream = Watch("", milliseconds(2000));
  ASSERT_EQ(stream->Next(), HealthCheckResponse::SERVING);
  for (int i = 0; i <= 1000; ++i) health_->SetServing(i % 2 == 1);  // Ends on false.
  std::vector<ServingStatus> sent;
  for (std::optional<ServingStatus> status = stream->Next(); status; status = stream->Next()) {
    sent.push_back(*status);
  }
  EXPECT_EQ(stream->status().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ASSERT_FALSE(sent.empty());
  EXPECT_LE(sent.size(), 1001u);
  EXPECT_EQ(sent.back(), HealthCheckResponse::NOT_SERVING);
  ServingStatus previous = HealthCheckResponse::SERVING;
  for (const ServingStatus status : sent) {
    EXPECT_NE(status, previous) << "a status sent twice in a row";
    previous = status;
  }
}

TEST_F(HealthTest, TheWatchBeyondMaxWatchesIsRefusedUntilOneEnds) {
  constexpr int kMaxWatches = 3;
  Start(kMaxWatches);
  EXPECT_EQ(health_->max_watches(), kMaxWatches);
  std::vector<std::unique_ptr<WatchStream>> open;
  for (int i = 0; i < kMaxWatches; ++i) {
    // An unknown service's stream counts like any other.
    open.push_back(Watch(i == 2 ? "attention.v1.NoSuchService" : ""));
    ASSERT_NE(open.back()->Next(), std::nullopt) << open.back()->status().error_message();
  }
  std::unique_ptr<WatchStream> refused = Watch("");
  EXPECT_EQ(refused->Next(), std::nullopt);
  EXPECT_EQ(refused->status().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused->status().error_message().find("--max-health-watches=3"), std::string::npos)
      << refused->status().error_message();
  HealthCheckResponse response;  // Check is not bounded by the watches.
  EXPECT_TRUE(Check("", &response).ok());

  open.front()->Cancel();
  EXPECT_EQ(open.front()->Next(), std::nullopt);
  EXPECT_EQ(open.front()->status().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(Eventually([&] { return health_->open_watches() == kMaxWatches - 1; }))
      << health_->open_watches() << " streams open";
  std::unique_ptr<WatchStream> again = Watch("");
  EXPECT_EQ(again->Next(), HealthCheckResponse::SERVING) << again->status().error_message();
  std::unique_ptr<WatchStream> one_more = Watch("");
  EXPECT_EQ(one_more->Next(), std::nullopt);
  EXPECT_EQ(one_more->status().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

// A client that opens a Watch and never reads: its flow-control window fills with changes, a
// write stays pending, and after the idle limit (1 s here) the stream is cancelled and frees
// its slot.
TEST_F(HealthTest, AWatchWhoseReaderStopsReadingIsCancelled) {
  grpc::ChannelArguments small_window;  // Fewer changes fill it.
  small_window.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  small_window.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  Start(1, 1, small_window);
  std::unique_ptr<WatchStream> stalled = Watch("");
  ASSERT_EQ(stalled->Next(), HealthCheckResponse::SERVING);
  const auto start = std::chrono::steady_clock::now();
  bool serving = true;
  while (health_->idle_watches_cancelled() == 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
    serving = !serving;
    health_->SetServing(serving);
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  EXPECT_EQ(health_->idle_watches_cancelled(), 1);
  ASSERT_TRUE(Eventually([&] { return health_->open_watches() == 0; }));
  std::unique_ptr<WatchStream> next = Watch("");
  EXPECT_NE(next->Next(), std::nullopt) << next->status().error_message();
}

// Clients opening, reading and cancelling streams on 6 threads while the status flips, then
// Shutdown: every stream gets a status or the bound's refusal, none is left open, and every slot
// comes back (run under ASan, this is the test of the watchers' lifetime).
TEST_F(HealthTest, ConcurrentWatchesChangesAndCancels) {
  constexpr int kMaxWatches = 4;
  Start(kMaxWatches);
  std::atomic<bool> stop{false};
  std::atomic<int> unexpected{0};
  std::atomic<int> opened{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 6; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        std::unique_ptr<WatchStream> stream = Watch((i + t) % 3 == 0 ? "nope" : "");
        const std::optional<ServingStatus> first = stream->Next();
        if (!first.has_value()) {
          const grpc::StatusCode code = stream->status().error_code();
          // The bound's refusal; after Shutdown, its refusal.
          if (code != grpc::StatusCode::RESOURCE_EXHAUSTED &&
              !(stop.load() && code == grpc::StatusCode::UNAVAILABLE)) {
            ++unexpected;
          }
          continue;
        }
        ++opened;
        if (i % 2 == 0) stream->Next();  // Another change, or (Shutdown) the end.
        if (i % 3 == 0) stream->Cancel();
      }
    });
  }
  const auto start = std::chrono::steady_clock::now();
  for (bool serving = false; std::chrono::steady_clock::now() - start < milliseconds(1500);
       serving = !serving) {
    health_->SetServing(serving);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  stop = true;
  health_->Shutdown();  // Ends the streams the clients are still reading.
  for (std::thread& client : clients) client.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_GT(opened.load(), kMaxWatches);
  ExpectReturnsWithin(milliseconds(5000), "Server::Shutdown()", [&] { server_->Shutdown(); });
  EXPECT_EQ(health_->open_watches(), 0);
}

// Shutdown first (as attnd drains): each stream sends the status it owes, then ends UNAVAILABLE,
// and Server::Shutdown with no deadline returns at once.
TEST_F(HealthTest, ShutdownEndsEveryWatchSoServerShutdownReturns) {
  Start(4);
  std::vector<std::unique_ptr<WatchStream>> open;
  for (const std::string service : {"", kAttentionService, "", "attention.v1.NoSuchService"}) {
    open.push_back(Watch(service));
    ASSERT_NE(open.back()->Next(), std::nullopt) << open.back()->status().error_message();
  }
  health_->SetServing(false);
  health_->Shutdown();
  for (size_t i = 0; i < open.size(); ++i) {
    if (i != 3) {  // The unknown service's stream owes nothing.
      EXPECT_EQ(open[i]->Next(), HealthCheckResponse::NOT_SERVING) << i;
    }
    EXPECT_EQ(open[i]->Next(), std::nullopt) << i;
    EXPECT_EQ(open[i]->status().error_code(), grpc::StatusCode::UNAVAILABLE)
        << i << ": " << open[i]->status().error_message();
  }
  std::unique_ptr<WatchStream> late = Watch("");
  EXPECT_EQ(late->Next(), std::nullopt);
  EXPECT_EQ(late->status().error_code(), grpc::StatusCode::UNAVAILABLE);
  ExpectReturnsWithin(milliseconds(5000), "Server::Shutdown()", [&] { server_->Shutdown(); });
  EXPECT_EQ(health_->open_watches(), 0);
}

// Without Shutdown: Server::Shutdown's deadline cancels the open streams, and each ends then.
TEST_F(HealthTest, ServerShutdownCancelsOpenWatches) {
  Start(4);
  std::vector<std::unique_ptr<WatchStream>> open;
  for (int i = 0; i < 4; ++i) {
    open.push_back(Watch(i == 3 ? "attention.v1.NoSuchService" : ""));
    ASSERT_NE(open.back()->Next(), std::nullopt) << open.back()->status().error_message();
  }
  ExpectReturnsWithin(milliseconds(5000), "Server::Shutdown(200 ms)", [&] {
    server_->Shutdown(std::chrono::system_clock::now() + milliseconds(200));
  });
  EXPECT_EQ(health_->open_watches(), 0);
  for (const std::unique_ptr<WatchStream>& stream : open) {
    EXPECT_EQ(stream->Next(), std::nullopt);
    EXPECT_FALSE(stream->status().ok());
  }
}

}  // namespace
}  // namespace attn
