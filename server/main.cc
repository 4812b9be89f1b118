// attnd: the attention server. Flags → backend and service → a gRPC server on --listen.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kernels/backend.h"
#include "server/dashed_flags.h"
#include "server/service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "Address to serve gRPC on (host:port).");
ABSL_FLAG(std::string, device, "auto",
          "Compute device: auto (the first CUDA device if there is one, else the CPU), cpu, "
          "cuda or cuda:N.");
ABSL_FLAG(int, threads, 0, "CPU worker threads per computation; 0 = every hardware thread.");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{1} << 30,
          "Largest request or response message, bytes (receive and send).");
ABSL_FLAG(int64_t, max_naive_bytes, 0,
          "Largest score + weight storage Naive may allocate, bytes; 0 = 1/4 of physical memory.");
ABSL_FLAG(int64_t, max_trace_rows, 64, "Most query rows one Trace call may follow.");
ABSL_FLAG(int64_t, max_trace_steps, 65536, "Most tile steps one Trace call may stream.");

namespace {

constexpr auto kShutdownGrace = std::chrono::seconds(5);

// Exits with a message on a configuration error; used only at start-up.
[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "attnd: %s\n", message.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("attnd: scaled dot-product attention over gRPC (attention.v1).");
  attn::DashedFlags flags(argc, argv);
  absl::ParseCommandLine(flags.argc(), flags.argv());

  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes < 1024 || max_message_bytes > INT32_MAX) {
    Die(absl::StrCat("--max-message-bytes must be in [1024, ", INT32_MAX, "], got ",
                     max_message_bytes));
  }
  attn::ServiceConfig config;
  config.max_message_bytes = max_message_bytes;
  config.trace.max_rows = absl::GetFlag(FLAGS_max_trace_rows);
  config.trace.max_steps = absl::GetFlag(FLAGS_max_trace_steps);
  if (config.trace.max_rows < 1) Die("--max-trace-rows must be ≥ 1");
  if (config.trace.max_steps < 1) Die("--max-trace-steps must be ≥ 1");

  absl::StatusOr<std::unique_ptr<attn::Backend>> backend =
      attn::MakeBackend({.device = absl::GetFlag(FLAGS_device),
                         .threads = absl::GetFlag(FLAGS_threads),
                         .max_naive_bytes = absl::GetFlag(FLAGS_max_naive_bytes)});
  if (!backend.ok()) Die(std::string(backend.status().message()));

  // SIGINT/SIGTERM are taken by a thread that shuts the server down; block them first so no
  // other thread receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::Server* running = nullptr;  // Set once built; the service only calls back after that.
  config.on_device_lost = [&running] {
    std::fprintf(stderr, "attnd: the device failed; health is now NOT_SERVING\n");
    if (running != nullptr) running->GetHealthCheckService()->SetServingStatus(false);
  };
  attn::AttentionService service(**backend, config);
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) Die(absl::StrCat("cannot listen on ", listen));
  running = server.get();

  std::printf(
      "attnd %s serving attention.v1 on %s (port %d)\n  device: %s [%s]\n  limits: "
      "max-message-bytes=%lld max-naive-bytes=%lld max-trace-rows=%lld max-trace-steps=%lld "
      "default-block-k=%d\n",
      ATTN_VERSION, listen.c_str(), port, (*backend)->device().c_str(),
      std::string((*backend)->name()).c_str(), static_cast<long long>(max_message_bytes),
      static_cast<long long>((*backend)->max_naive_bytes()),
      static_cast<long long>(config.trace.max_rows), static_cast<long long>(config.trace.max_steps),
      (*backend)->default_block_k());
  std::fflush(stdout);

  std::thread stopper([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    std::printf("attnd: signal %d, shutting down (in-flight calls get %lld s)\n", signal,
                static_cast<long long>(kShutdownGrace.count()));
    std::fflush(stdout);
    server->Shutdown(std::chrono::system_clock::now() + kShutdownGrace);
  });
  server->Wait();
  stopper.join();
  return 0;
}
