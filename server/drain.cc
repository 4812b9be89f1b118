#include "server/drain.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

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
  return absl::OkStatus();
}

int WaitForShutdownSignal() {
  unsigned char byte = 0;
  while (read(signal_pipe[0], &byte, 1) != 1) {
  }
  return byte;
}

void Drain(RunningServer& server, int signal, int grace_seconds) {
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
  // Health Watch streams end now (after sending NOT_SERVING), so gRPC need not wait for them.
  server.health.Shutdown();
  server.grpc->Shutdown(deadline);
  std::printf("attnd: drained, exiting\n");
  std::fflush(stdout);
}

}  // namespace attn
