// HttpPort: attnd's HTTP side port (--http-listen), on cpp-httplib. It serves
//   GET /metrics  the MetricsRegistry in the Prometheus text format (metrics.h)
//   GET /healthz  200 "ok" while the process runs (liveness)
//   GET /readyz   200 "ready" while the ReadyFlag is set, else 503 "not ready" (readiness)
// and whatever routes other modules add through server() before Start (the JSON gateway and the
// trace viewer, gateway.h, share this one server object).
//
// Start binds and serves on a thread of its own, handlers running on a small pool of workers;
// Stop (or the destructor) closes the listening socket, lets running handlers finish and joins.
// The registry and the flag must outlive the port. Not thread-safe itself: one owner calls
// Start and Stop; handlers run concurrently with everything.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/metrics.h"

namespace httplib {
class Server;
}

namespace attn {

// Whether attnd is ready to serve: main sets it once gRPC is up, and clears it when the device
// is lost or shutdown begins. Thread-safe.
class ReadyFlag {
 public:
  void Set(bool ready) { ready_.store(ready, std::memory_order_relaxed); }
  bool Get() const { return ready_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> ready_{false};
};

class HttpPort {
 public:
  // threads: handler workers (connections served at once; a keep-alive connection holds one).
  HttpPort(const MetricsRegistry& metrics, const ReadyFlag& ready, int threads = 4);
  ~HttpPort();
  HttpPort(const HttpPort&) = delete;
  HttpPort& operator=(const HttpPort&) = delete;

  // The routes (httplib::Server::Get, Post, set_mount_point, …), to extend before Start.
  httplib::Server& server() { return *server_; }

  // Binds `listen`, "host:port" or "[v6 address]:port" (port 0 = a free port, see port()), and
  // starts serving. INVALID_ARGUMENT for a malformed address, UNAVAILABLE when it cannot bind
  // (in use, no such address), FAILED_PRECONDITION when already started.
  absl::Status Start(absl::string_view listen);

  // The bound port once started, else 0; and "host:port" with that port (for the banner).
  int port() const { return port_; }
  std::string address() const;

  // Stops serving and joins; a no-op when not serving. Called by the destructor.
  void Stop();

 private:
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::atomic<bool> finished_{false};  // The serving thread returned from its loop.
  std::string host_;                   // As given to Start, brackets and all.
  int port_ = 0;
};

}  // namespace attn
