#include "server/http_port.h"

#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace attn {
namespace {

// The routes here are small GETs; the JSON gateway (gateway.cc), whose routes take bodies, raises
// this limit when it adds them.
constexpr size_t kMaxRequestBodyBytes = size_t{1} << 20;
constexpr time_t kKeepAliveSeconds = 1;

}  // namespace

HttpPort::HttpPort(const MetricsRegistry& metrics, const ReadyFlag& ready, int threads)
    : server_(std::make_unique<httplib::Server>()) {
  const size_t workers = threads > 0 ? static_cast<size_t>(threads) : 1;
  server_->new_task_queue = [workers] { return new httplib::ThreadPool(workers); };
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a second attnd
  // bind the same port silently instead of failing at start-up.
  server_->set_socket_options([](socket_t socket) {
    const int yes = 1;
    setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  server_->set_payload_max_length(kMaxRequestBodyBytes);
  // An idle keep-alive connection holds a worker, and Stop waits for it: keep that short.
  server_->set_keep_alive_timeout(kKeepAliveSeconds);

  server_->Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& response) {
    response.set_content(metrics.Render(), std::string(MetricsRegistry::kContentType));
  });
  server_->Get("/healthz", [](const httplib::Request&, httplib::Response& response) {
    response.set_content("ok\n", "text/plain; charset=utf-8");
  });
  server_->Get("/readyz", [&ready](const httplib::Request&, httplib::Response& response) {
    const bool is_ready = ready.Get();
    response.status = is_ready ? 200 : 503;
    response.set_content(is_ready ? "ready\n" : "not ready\n", "text/plain; charset=utf-8");
  });
}

HttpPort::~HttpPort() { Stop(); }

absl::Status HttpPort::Start(absl::string_view listen) {
  if (thread_.joinable()) return absl::FailedPreconditionError("the HTTP port is already serving");
  const size_t colon = listen.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP address \"", listen, "\" is not host:port"));
  }
  host_ = std::string(listen.substr(0, colon));
  std::string host = host_;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) host = "0.0.0.0";
  int port = 0;
  if (!absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("HTTP address \"", listen, "\" has no port in [0, 65535]"));
  }

  errno = 0;
  const bool bound =
      port == 0 ? (port = server_->bind_to_any_port(host)) > 0 : server_->bind_to_port(host, port);
  if (!bound) {
    const int error = errno;
    return absl::UnavailableError(absl::StrCat("cannot bind HTTP to ", listen,
                                               error != 0 ? ": " : "",
                                               error != 0 ? std::strerror(error) : ""));
  }
  port_ = port;
  finished_ = false;
  thread_ = std::thread([this] {
    server_->listen_after_bind();
    finished_ = true;
  });
  return absl::OkStatus();
}

std::string HttpPort::address() const { return absl::StrCat(host_, ":", port_); }

void HttpPort::Stop() {
  if (!thread_.joinable()) return;
  // httplib's stop() acts only once the loop runs; wait for that (or for the loop to have
  // ended on its own) so a Stop right after Start is not lost.
  while (!finished_ && !server_->is_running()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  server_->stop();
  thread_.join();
  port_ = 0;
}

}  // namespace attn
