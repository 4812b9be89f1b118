// HttpPort: attnd's HTTP side port (--http-listen), on cpp-httplib. It serves
//   GET /metrics  the MetricsRegistry in the Prometheus text format (metrics.h)
//   GET /healthz  200 "ok" while the process runs (liveness)
//   GET /readyz   200 "ready" while the ReadyFlag is set, else 503 "not ready" (readiness)
// and whatever routes other modules add through server() before Start (the JSON gateway and the
// trace viewer, gateway.h, share this one server object).
//
// The port is plain HTTP (no TLS), so Start refuses an address that is not loopback
// (security.h's IsLoopbackAddress) unless told `insecure` (main passes --insecure), as
// MakeServerSecurity refuses a plaintext --listen.
//
// Every request is judged from its headers before any body is read (httplib's pre-routing
// handler, and its Expect: 100-continue handler, so a client that asks first is refused before
// it sends the body): the HeaderChecks modules add run in order, and a request none of them
// accepted may carry no body (BodyFramingOf: any announced body is 413, a POST, PUT or PATCH
// without a length 411), since this port's routes and the viewer's are GETs. A request answered
// there whose headers announce a body gets its answer and then the connection is closed with the
// body unread (CloseAfterAnswer), so what it sends is never parsed as another request.
//
// Slow clients: a read that finds no data for kReadTimeout, or a write blocked for kWriteTimeout,
// drops the connection (a stalled body, a reader that stopped reading a trace stream); a body
// read with ReadRequestBody must also keep up kMinBodyBytesPerSecond once kReadTimeout has
// passed (a trickled body); an idle keep-alive connection is closed after kKeepAliveTimeout.
// Not bounded here: how long a client takes over its headers, and how many header lines it sends,
// beyond the per-read timeout and httplib's 8 KiB per line (httplib 0.11 reads them itself).
//
// An exception that escapes a route handler (or a check) answers its request, std::bad_alloc with
// 429 and anything else with 500, and closes the connection; it never ends the process
// (httplib's exception handler). Content providers (streamed answers) must catch their own:
// httplib calls them outside that handler.
//
// Start binds and serves on a thread of its own, handlers running on a small pool of workers;
// Stop (or the destructor) closes the listening socket, lets running handlers finish and joins.
// The registry and the flag must outlive the port. Not thread-safe itself: one owner adds checks
// and calls Start and Stop; handlers and checks run concurrently with everything.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/metrics.h"

namespace httplib {
class Server;
class ContentReader;
struct Request;
struct Response;
}  // namespace httplib

namespace attn {

// The slow-client limits above.
inline constexpr std::chrono::seconds kReadTimeout{10};
inline constexpr std::chrono::seconds kWriteTimeout{30};
inline constexpr std::chrono::seconds kKeepAliveTimeout{1};
inline constexpr int64_t kMinBodyBytesPerSecond = int64_t{256} << 10;

// Whether attnd is ready to serve: StartServer (server/startup.cc) sets it once gRPC is up, and
// clears it when the device is lost or shutdown begins. Thread-safe.
class ReadyFlag {
 public:
  void Set(bool ready) { ready_.store(ready, std::memory_order_relaxed); }
  bool Get() const { return ready_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> ready_{false};
};

// How a request's headers say its body is framed, as httplib 0.11 would read it.
struct BodyFraming {
  enum class Kind {
    kNone,        // No body: no Transfer-Encoding, and no Content-Length or "Content-Length: 0".
    kLength,      // Content-Length: `length` (> 0) bytes.
    kChunked,     // Transfer-Encoding: chunked (the length is known only once read).
    kUntilClose,  // A POST, PUT or PATCH with neither header: httplib would read until EOF.
    kInvalid,     // Malformed or ambiguous framing; `problem` says how.
  };
  Kind kind = Kind::kNone;
  uint64_t length = 0;
  std::string problem{};
};
BodyFraming BodyFramingOf(const httplib::Request& request);

// What a HeaderCheck decided about a request, from its headers alone.
enum class HeaderVerdict {
  kPass,      // Not this check's: the next check (or the port's no-body rule) decides.
  kAccept,    // The request goes to its route, which may read the body its headers announce.
  kAnswered,  // The check wrote the answer into the response; the route and the body are skipped.
};
using HeaderCheck = std::function<HeaderVerdict(const httplib::Request&, httplib::Response&)>;

// The outcome of ReadRequestBody.
enum class BodyRead {
  kComplete,  // `body` holds the whole body.
  kTooLarge,  // The body passed max_bytes; reading stopped there.
  kTooSlow,   // The body stalled for kReadTimeout or fell below kMinBodyBytesPerSecond.
  kFailed,    // The connection ended early or the chunked framing was bad.
};

// Reads the body of `request` through the route's `reader` into `body` (reserving a declared
// Content-Length up to max_bytes). Anything but kComplete leaves the body partly read, so the
// answer must be given with CloseAfterAnswer.
BodyRead ReadRequestBody(const httplib::Request& request, const httplib::ContentReader& reader,
                         size_t max_bytes, std::string& body);

// Makes the answer already in `response` (status, headers, body) the connection's last: it is
// sent whole, with "Connection: close", and then the connection is closed instead of being read
// for another request (what would follow may be the unread rest of a body). httplib 0.11 has no
// call for this; a content provider that returns false after writing the body makes it close.
void CloseAfterAnswer(httplib::Response& response);

class HttpPort {
 public:
  // threads: handler workers (connections served at once; a keep-alive connection holds one).
  HttpPort(const MetricsRegistry& metrics, const ReadyFlag& ready, int threads = 4);
  ~HttpPort();
  HttpPort(const HttpPort&) = delete;
  HttpPort& operator=(const HttpPort&) = delete;

  // The routes (httplib::Server::Get, Post, set_mount_point, …), to extend before Start. Leave
  // its pre-routing, Expect: 100-continue and exception handlers to the port.
  httplib::Server& server() { return *server_; }

  // Adds a check on every request's headers (see above); call before Start.
  void AddHeaderCheck(HeaderCheck check);

  // Binds `listen`, "host:port" or "[v6 address]:port" (port 0 = a free port, see port()), and
  // starts serving. INVALID_ARGUMENT for a malformed address; FAILED_PRECONDITION, naming
  // --http-listen and --insecure, for one that is not loopback (IsLoopbackAddress) unless
  // `insecure` allows it, and when already started; UNAVAILABLE when it cannot bind (in use, no
  // such address).
  absl::Status Start(absl::string_view listen, bool insecure = false);

  // The bound port once started, else 0; and "host:port" with that port (for the banner).
  int port() const { return port_; }
  std::string address() const;

  // Stops serving and joins; a no-op when not serving. Called by the destructor.
  void Stop();

 private:
  // The checks, then the no-body rule, for one request; writes the answer when kAnswered.
  HeaderVerdict Judge(const httplib::Request& request, httplib::Response& response) const;

  std::unique_ptr<httplib::Server> server_;
  std::vector<HeaderCheck> checks_;
  std::thread thread_;
  std::atomic<bool> finished_{false};  // The serving thread returned from its loop.
  std::string host_;                   // As given to Start, brackets and all.
  int port_ = 0;
};

}  // namespace attn
