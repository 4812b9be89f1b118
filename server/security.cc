#include "server/security.h"

#include <arpa/inet.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/credential_files.h"

namespace attn {
namespace {

constexpr absl::string_view kHealthPathPrefix = "/grpc.health.v1.Health/";
constexpr absl::string_view kBearerScheme = "Bearer ";

// The PEM material of a TLS listener.
struct TlsPem {
  std::string cert_chain;
  std::string private_key;
  std::string client_ca;  // Empty: client certificates are neither requested nor checked.
};

absl::string_view View(const grpc_slice& slice) {
  return absl::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)),
                           GRPC_SLICE_LENGTH(slice));
}

// gRPC core's auth metadata processor: runs CheckBearerToken on each call's metadata before the
// call reaches any handler. Called synchronously (it never blocks), so it answers inline.
void ProcessAuthMetadata(void* state, grpc_auth_context* /*context*/, const grpc_metadata* md,
                         size_t num_md, grpc_process_auth_metadata_done_cb done, void* user_data) {
  const std::string& token = *static_cast<const std::string*>(state);
  absl::string_view path;
  std::vector<absl::string_view> authorization;
  std::vector<grpc_metadata> consumed;
  for (size_t i = 0; i < num_md; ++i) {
    const absl::string_view key = View(md[i].key);
    if (key == ":path") path = View(md[i].value);
    if (key == "authorization") {
      authorization.push_back(View(md[i].value));
      consumed.push_back(md[i]);
    }
  }
  const absl::Status status = CheckBearerToken(token, path, authorization);
  if (!status.ok()) {
    const std::string message(status.message());
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED, message.c_str());
    return;
  }
  // Consumed metadata is removed from the call: handlers and logs never see the token.
  done(user_data, consumed.data(), consumed.size(), nullptr, 0, GRPC_STATUS_OK, nullptr);
}

void DestroyAuthState(void* state) { delete static_cast<std::string*>(state); }

// grpc::ServerCredentials over gRPC core's credentials, so a plaintext listener can carry an
// auth metadata processor too (grpc::InsecureServerCredentials() refuses one). gRPC's Server
// calls the private AddPortToServer hook, as it does for its own credential types.
class CoreServerCredentials final : public grpc::ServerCredentials {
 public:
  // Plaintext when `tls` is null; a token check when `token` is non-empty. The base class has
  // initialized gRPC by the time the body runs.
  CoreServerCredentials(const TlsPem* tls, const std::string& token) {
    if (tls == nullptr) {
      credentials_ = grpc_insecure_server_credentials_create();
    } else {
      grpc_ssl_pem_key_cert_pair pair = {tls->private_key.c_str(), tls->cert_chain.c_str()};
      credentials_ = grpc_ssl_server_credentials_create_ex(
          tls->client_ca.empty() ? nullptr : tls->client_ca.c_str(), &pair, 1,
          tls->client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY,
          nullptr);
    }
    if (!token.empty()) {
      grpc_server_credentials_set_auth_metadata_processor(credentials_,
                                                          {.process = ProcessAuthMetadata,
                                                           .destroy = DestroyAuthState,
                                                           .state = new std::string(token)});
    }
  }
  ~CoreServerCredentials() override { grpc_server_credentials_release(credentials_); }
  CoreServerCredentials(const CoreServerCredentials&) = delete;
  CoreServerCredentials& operator=(const CoreServerCredentials&) = delete;

  // The token check is this credential's processor; another one is not supported (gRPC's
  // ServerBuilder never sets one).
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), credentials_);
  }

  grpc_server_credentials* credentials_ = nullptr;
};

}  // namespace

bool ConstantTimeEquals(absl::string_view given, absl::string_view expected) {
  if (expected.empty()) return given.empty();
  // Every byte of `given` is visited and compared against some byte of `expected`; no branch
  // depends on the contents.
  unsigned difference = given.size() != expected.size() ? 1u : 0u;
  for (size_t i = 0; i < given.size(); ++i) {
    difference |= static_cast<unsigned char>(given[i]) ^
                  static_cast<unsigned char>(expected[i % expected.size()]);
  }
  return difference == 0;
}

absl::Status CheckBearerToken(absl::string_view expected_token, absl::string_view path,
                              absl::Span<const absl::string_view> authorization) {
  if (absl::StartsWith(path, kHealthPathPrefix)) return absl::OkStatus();
  if (authorization.empty()) {
    return absl::UnauthenticatedError(
        "this server requires a bearer token: send metadata \"authorization: Bearer <token>\" "
        "(attn --token-file FILE)");
  }
  if (authorization.size() > 1) {
    return absl::UnauthenticatedError(
        absl::StrCat("send one authorization metadata entry, not ", authorization.size()));
  }
  const absl::string_view value = authorization.front();
  if (value.size() < kBearerScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kBearerScheme.size()), kBearerScheme)) {
    return absl::UnauthenticatedError(
        "the authorization metadata must read \"Bearer <token>\"; no token was checked");
  }
  if (!ConstantTimeEquals(value.substr(kBearerScheme.size()), expected_token)) {
    return absl::UnauthenticatedError("the bearer token was not accepted");
  }
  return absl::OkStatus();
}

std::string CallerIdentity(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return "";
  const std::vector<grpc::string_ref> subject =
      auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME);
  if (subject.empty()) return "";
  return absl::StrCat("x509:", absl::string_view(subject.front().data(), subject.front().size()));
}

bool IsLoopbackAddress(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) {
    return true;
  }
  // Split "host:port" as gRPC does: "[v6]:port", or an unbracketed host with one colon at most.
  absl::string_view host = listen;
  if (absl::StartsWith(listen, "[")) {
    const size_t close = listen.find(']');
    if (close == absl::string_view::npos) return false;
    host = listen.substr(1, close - 1);
  } else if (const size_t colon = listen.find(':');
             colon != absl::string_view::npos &&
             listen.find(':', colon + 1) == absl::string_view::npos) {
    host = listen.substr(0, colon);
  }
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  const std::string host_string(host);
  in_addr v4;
  if (inet_pton(AF_INET, host_string.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, host_string.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return false;  // A wildcard, an empty host or a name other than localhost.
}

absl::StatusOr<ServerSecurity> MakeServerSecurity(const SecurityConfig& config,
                                                  absl::string_view listen) {
  if (config.tls_cert_file.empty() != config.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together: give both or neither");
  }
  const bool tls = !config.tls_cert_file.empty();
  if (!tls && !config.tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-client-ca (mutual TLS) needs TLS: give --tls-cert and --tls-key too");
  }
  if (!tls && !config.insecure && !IsLoopbackAddress(listen)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refusing to serve plaintext on ", listen,
        ", which is not a loopback address: anyone who can reach it could call it (and read a "
        "bearer token in transit). Give --tls-cert and --tls-key, listen on 127.0.0.1, or pass "
        "--insecure to allow it explicitly"));
  }

  TlsPem pem;
  if (tls) {
    absl::StatusOr<std::string> cert = ReadPemFile("--tls-cert", config.tls_cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile("--tls-key", config.tls_key_file);
    if (!key.ok()) return key.status();
    pem.cert_chain = *std::move(cert);
    pem.private_key = *std::move(key);
    if (!config.tls_client_ca_file.empty()) {
      absl::StatusOr<std::string> ca = ReadPemFile("--tls-client-ca", config.tls_client_ca_file);
      if (!ca.ok()) return ca.status();
      pem.client_ca = *std::move(ca);
    }
  }
  std::string token;
  if (!config.auth_token_file.empty()) {
    absl::StatusOr<std::string> loaded = ReadTokenFile("--auth-token-file", config.auth_token_file);
    if (!loaded.ok()) return loaded.status();
    token = *std::move(loaded);
  }

  ServerSecurity security;
  security.credentials = std::make_shared<CoreServerCredentials>(tls ? &pem : nullptr, token);
  security.summary = !tls                    ? "plaintext"
                     : pem.client_ca.empty() ? "TLS"
                                             : "mutual TLS (client certificates required)";
  if (!token.empty()) {
    absl::StrAppend(&security.summary, ", bearer token required (not for grpc.health.v1)");
  }
  if (!tls && !IsLoopbackAddress(listen)) absl::StrAppend(&security.summary, " [--insecure]");
  security.auth_token = std::move(token);
  return security;
}

}  // namespace attn
