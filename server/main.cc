// attnd: the attention server. Flags → config (server/config.h) → start (server/startup.h) →
// serve until SIGINT or SIGTERM → drain (server/drain.h).
//
// Exit status: 0 after a drain; 2 for a configuration or start-up error (its message on stderr);
// 1 when a second signal cuts the drain short; 3 after a drain whose flush to --cache-dir failed.
// --help, and flags Abseil cannot parse, exit inside ParseAttndFlags with Abseil's own status.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/config.h"
#include "server/drain.h"
#include "server/startup.h"

namespace {

[[noreturn]] void Die(const absl::Status& status) {
  std::fprintf(stderr, "attnd: %s\n", std::string(status.message()).c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil is built with absl::Mutex's lock-order (deadlock) detection on, which every
  // lock in gRPC and attnd then pays for on each call (a graph lookup per acquisition). The unit
  // tests keep it, so a lock-order cycle in attnd's code is still caught there.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (absl::Status status = attn::CatchShutdownSignals(); !status.ok()) Die(status);
  attn::ParseAttndFlags(argc, argv);
  const absl::StatusOr<attn::AttndConfig> config = attn::ConfigFromFlags();
  if (!config.ok()) Die(config.status());
  absl::StatusOr<std::unique_ptr<attn::RunningServer>> started = attn::StartServer(*config);
  if (!started.ok()) Die(started.status());
  attn::RunningServer& server = **started;
  attn::PrintStartupLines(server, *config);

  int status = 0;
  std::thread drainer([&] {
    const int signal = attn::WaitForShutdownSignal();
    status = attn::Drain(server, signal, *config);
  });
  server.grpc->Wait();
  drainer.join();
  server.http.Stop();
  return status;
}
