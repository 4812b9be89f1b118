#include "server/drain.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "server/handover.h"

namespace attn {
namespace {

int signal_pipe[2] = {-1, -1};

// Async-signal-safe: hands the signal number to WaitForShutdownSignal.
void ForwardSignal(int signal) {
  const unsigned char byte = static_cast<unsigned char>(signal);
  [[maybe_unused]] const ssize_t written = write(signal_pipe[1], &byte, 1);
}

}  // namespace

absl::Status CatchShutdownSignals() {
  if (pipe(signal_pipe) != 0) return absl::InternalError("cannot create the signal pipe");
  struct sigaction action = {};
  action.sa_handler = ForwardSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  // A write past a file-size limit (ulimit -f) must fail with EFBIG, which the cache files report
  // as a full disk, not kill the process with every cache in it.
  signal(SIGXFSZ, SIG_IGN);
  return absl::OkStatus();
}

int WaitForShutdownSignal() {
  unsigned char byte = 0;
  while (read(signal_pipe[0], &byte, 1) != 1) {
  }
  return byte;
}

int Drain(RunningServer& server, int signal, const AttndConfig& config) {
  const int grace_seconds = config.shutdown_grace_seconds;
  std::printf("attnd: signal %d, draining (in-flight calls get %d s; signal again to exit now)\n",
              signal, grace_seconds);
  std::fflush(stdout);
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(grace_seconds);
  server.service.StartDrain();
  server.ready.Set(false);
  server.health.SetServing(false);
  std::thread([] {
    const int again = WaitForShutdownSignal();
    std::fprintf(stderr, "attnd: signal %d again, exiting without waiting\n", again);
    std::_Exit(1);
  }).detach();
  // The JSON gateway first: /v1 answers 503 from now on, and its calls in flight get the grace
  // (shutting gRPC down would end its in-process calls at once).
  server.gateway.Drain(deadline);
  const bool answering = !server.service.Idle();
  if (server.service.WaitUntilIdle(deadline) && answering) {
    std::this_thread::sleep_until(
        std::min(deadline, std::chrono::system_clock::now() + std::chrono::seconds(1)));
  }
  // Calls that never reached a compute worker are answered now (UNAVAILABLE), before gRPC
  // cancels what is left; none may run once the server is gone.
  server.service.CancelQueued();
  CacheRegistry& caches = server.service.caches();
  if (!config.drain_to.empty()) {
    const HandOverResult handed =
        HandOverCaches(caches, config.drain_to, config.security.auth_token);
    for (const std::string& line : handed.lines) std::printf("attnd: %s\n", line.c_str());
    std::fflush(stdout);
    if (handed.moved > 0) {
      std::this_thread::sleep_until(
          std::min(deadline, std::chrono::system_clock::now() + std::chrono::seconds(2)));
    }
  }
  int status = 0;
  if (caches.persistent()) {
    const absl::Status flushed = caches.Flush(/*shutdown=*/true);
    if (flushed.ok()) {
      std::printf("attnd: caches flushed to --cache-dir=%s (%lld bytes)\n",
                  caches.limits().dir.c_str(), static_cast<long long>(caches.disk_bytes()));
    } else {
      std::fprintf(stderr, "attnd: caches NOT all flushed to --cache-dir: %s\n",
                   std::string(flushed.message()).c_str());
      status = 3;
    }
    std::fflush(stdout);
  }
  // Health Watch streams end now (after sending NOT_SERVING), so gRPC need not wait for them.
  server.health.Shutdown();
  server.grpc->Shutdown(deadline);
  std::printf("attnd: drained, exiting\n");
  std::fflush(stdout);
  return status;
}

}  // namespace attn
