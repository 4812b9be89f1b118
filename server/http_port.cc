#include "server/http_port.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "server/security.h"

namespace attn {
namespace {

// The routes here are small GETs; the JSON gateway (gateway.cc), whose routes take bodies, raises
// this limit when it adds them. It is a second line only: the header checks refuse a body too
// large for its route before httplib would read it.
constexpr size_t kMaxRequestBodyBytes = size_t{1} << 20;
constexpr char kTextType[] = "text/plain; charset=utf-8";

void WriteText(httplib::Response& response, int status, absl::string_view text) {
  response.status = status;
  response.set_content(absl::StrCat(text, "\n"), kTextType);
}

// The methods httplib 0.11 reads a body for even without a Content-Length (until EOF).
bool ReadsUntilClose(absl::string_view method) {
  return method == "POST" || method == "PUT" || method == "PATCH" || method == "PRI";
}

}  // namespace

BodyFraming BodyFramingOf(const httplib::Request& request) {
  BodyFraming framing;
  const auto invalid = [&framing](std::string problem) {
    framing.kind = BodyFraming::Kind::kInvalid;
    framing.problem = std::move(problem);
    return framing;
  };
  const size_t lengths = request.get_header_value_count("Content-Length");
  const size_t encodings = request.get_header_value_count("Transfer-Encoding");
  if (lengths > 1) return invalid("the request has more than one Content-Length header");
  if (encodings > 1) return invalid("the request has more than one Transfer-Encoding header");
  if (encodings == 1) {
    if (lengths == 1) {
      return invalid("the request has both Content-Length and Transfer-Encoding headers");
    }
    // httplib takes exactly "chunked" (any case) as chunked; anything else it would misread.
    const std::string encoding = request.get_header_value("Transfer-Encoding");
    if (!absl::EqualsIgnoreCase(encoding, "chunked")) {
      return invalid(
          absl::StrCat("Transfer-Encoding \"", encoding, "\" is not supported (only chunked)"));
    }
    framing.kind = BodyFraming::Kind::kChunked;
    return framing;
  }
  if (lengths == 1) {
    const std::string value = request.get_header_value("Content-Length");
    uint64_t length = 0;
    if (value.empty() || !std::all_of(value.begin(), value.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(value, &length)) {
      return invalid(absl::StrCat("Content-Length \"", value, "\" is not a number of bytes"));
    }
    if (length > 0) {
      framing.kind = BodyFraming::Kind::kLength;
      framing.length = length;
    }
    return framing;
  }
  if (ReadsUntilClose(request.method)) framing.kind = BodyFraming::Kind::kUntilClose;
  return framing;
}

BodyRead ReadRequestBody(const httplib::Request& request, const httplib::ContentReader& reader,
                         size_t max_bytes, std::string& body) {
  using Clock = std::chrono::steady_clock;
  const BodyFraming framing = BodyFramingOf(request);
  if (framing.kind == BodyFraming::Kind::kLength) {
    body.reserve(static_cast<size_t>(std::min<uint64_t>(framing.length, max_bytes)));
  }
  const Clock::time_point start = Clock::now();
  Clock::time_point last_data = start;
  BodyRead outcome = BodyRead::kComplete;
  const bool read = reader([&](const char* data, size_t size) {
    if (size > max_bytes - body.size()) {
      outcome = BodyRead::kTooLarge;
      return false;
    }
    body.append(data, size);
    last_data = Clock::now();
    // kReadTimeout for a start, then the minimum rate: a trickled body runs out of time.
    const std::chrono::duration<double> allowed =
        kReadTimeout +
        std::chrono::duration<double>(static_cast<double>(body.size()) / kMinBodyBytesPerSecond);
    if (last_data - start > allowed) {
      outcome = BodyRead::kTooSlow;
      return false;
    }
    return true;
  });
  if (!read && outcome == BodyRead::kComplete) {
    // httplib's read gives up after kReadTimeout without data: a stall, not a broken connection.
    const bool stalled = Clock::now() - last_data >= kReadTimeout * 9 / 10;
    outcome = stalled ? BodyRead::kTooSlow : BodyRead::kFailed;
  }
  return outcome;
}

void CloseAfterAnswer(httplib::Response& response) {
  std::string type = response.get_header_value("Content-Type");
  if (type.empty()) type = kTextType;
  response.headers.erase("Content-Type");  // set_content_provider adds it again.
  auto body = std::make_shared<const std::string>(response.body.empty() ? std::string("\n")
                                                                        : std::move(response.body));
  response.body.clear();
  response.set_header("Connection", "close");
  // httplib writes a provider's answer and, when the provider returns false, stops serving the
  // connection (its write reports failure) and closes it: the one way to close that 0.11 offers.
  response.set_content_provider(
      body->size(), type, [body](size_t offset, size_t length, httplib::DataSink& sink) {
        if (offset < body->size()) {
          sink.write(body->data() + offset, std::min(length, body->size() - offset));
        }
        return false;
      });
}

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
  server_->set_keep_alive_timeout(kKeepAliveTimeout.count());
  server_->set_read_timeout(kReadTimeout.count());
  server_->set_write_timeout(kWriteTimeout.count());

  // Runs after the headers are read and before httplib reads any body (httplib 0.11's
  // Server::routing calls it first).
  server_->set_pre_routing_handler(
      [this](const httplib::Request& request, httplib::Response& response) {
        if (Judge(request, response) != HeaderVerdict::kAnswered) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        if (BodyFramingOf(request).kind != BodyFraming::Kind::kNone) CloseAfterAnswer(response);
        return httplib::Server::HandlerResponse::Handled;
      });
  // "Expect: 100-continue": httplib asks this before routing, and without it would invite the
  // body at once. A refused request is answered instead and its connection closed; an accepted
  // one is judged again by the pre-routing handler (on a fresh response, so nothing doubles).
  // httplib calls it outside its exception handling, hence the catch.
  server_->set_expect_100_continue_handler(
      [this](const httplib::Request& request, httplib::Response& response) {
        try {
          httplib::Response answer;
          if (Judge(request, answer) != HeaderVerdict::kAnswered) return 100;
          response.status = answer.status;
          for (const auto& header : answer.headers) response.headers.insert(header);
          response.body = std::move(answer.body);
          CloseAfterAnswer(response);
          // This path writes the answer without httplib's usual Content-Length.
          response.set_header("Content-Length", std::to_string(response.content_length_));
          return response.status;
        } catch (...) {
          return 100;  // The pre-routing handler judges it again, inside httplib's try.
        }
      });
  // httplib adds "Keep-Alive: …" to every answer it does not close itself; drop it from one
  // CloseAfterAnswer closes, so the answer does not contradict its "Connection: close".
  server_->set_post_routing_handler([](const httplib::Request&, httplib::Response& response) {
    if (response.get_header_value("Connection") == "close") response.headers.erase("Keep-Alive");
  });
  server_->set_exception_handler(
      [](const httplib::Request&, httplib::Response& response, std::exception_ptr error) {
        int status = 500;
        std::string message = "attnd: internal error";
        try {
          std::rethrow_exception(error);
        } catch (const std::bad_alloc&) {
          status = 429;
          message = "attnd ran out of memory answering this request; retry later";
        } catch (const std::exception& e) {
          message = absl::StrCat("attnd: internal error: ", e.what());
        } catch (...) {
        }
        try {
          response = httplib::Response();
          WriteText(response, status, message);
          CloseAfterAnswer(response);  // The handler may have left a body half read.
        } catch (...) {
          response.status = status;  // Out of memory even for the answer: the status alone.
        }
      });

  server_->Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& response) {
    response.set_content(metrics.Render(), std::string(MetricsRegistry::kContentType));
  });
  server_->Get("/healthz", [](const httplib::Request&, httplib::Response& response) {
    response.set_content("ok\n", kTextType);
  });
  server_->Get("/readyz", [&ready](const httplib::Request&, httplib::Response& response) {
    const bool is_ready = ready.Get();
    response.status = is_ready ? 200 : 503;
    response.set_content(is_ready ? "ready\n" : "not ready\n", kTextType);
  });
}

HttpPort::~HttpPort() { Stop(); }

void HttpPort::AddHeaderCheck(HeaderCheck check) { checks_.push_back(std::move(check)); }

HeaderVerdict HttpPort::Judge(const httplib::Request& request, httplib::Response& response) const {
  for (const HeaderCheck& check : checks_) {
    const HeaderVerdict verdict = check(request, response);
    if (verdict != HeaderVerdict::kPass) return verdict;
  }
  // No check took the request: its route (this port's, the viewer's) takes no body.
  const BodyFraming framing = BodyFramingOf(request);
  switch (framing.kind) {
    case BodyFraming::Kind::kNone:
      return HeaderVerdict::kAccept;
    case BodyFraming::Kind::kInvalid:
      WriteText(response, 400, framing.problem);
      break;
    case BodyFraming::Kind::kUntilClose:
      WriteText(response, 411,
                absl::StrCat(request.method, " ", request.path,
                             " needs a Content-Length (0: this route takes no body)"));
      break;
    case BodyFraming::Kind::kLength:
    case BodyFraming::Kind::kChunked:
      WriteText(response, 413,
                absl::StrCat(request.method, " ", request.path, " takes no request body"));
      break;
  }
  return HeaderVerdict::kAnswered;
}

absl::Status HttpPort::Start(absl::string_view listen, bool insecure) {
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

  if (!insecure && !IsLoopbackAddress(listen)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refusing to serve plain HTTP on --http-listen ", listen,
        ", which is not a loopback address: the HTTP port has no TLS, so anyone who can reach it "
        "could call the JSON gateway (and read a bearer token in transit). Listen on 127.0.0.1, "
        "or pass --insecure to allow it explicitly"));
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
