// attnd's transport security: TLS (optionally mutual) from PEM files, a bearer token every call
// but grpc.health.v1 must carry, and the rule that a plaintext listener stays on loopback unless
// --insecure says otherwise.
//
// The token is checked by gRPC core's server auth filter (an auth metadata processor on the
// listener's credentials), before any handler, interceptor or reflection code sees the call, for
// plaintext and TLS listeners alike. A server interceptor cannot do this: gRPC C++ server
// interceptors can observe a call but not fail it, and grpc::InsecureServerCredentials() refuses
// a processor. A refused call ends with UNAUTHENTICATED; an accepted call's `authorization`
// metadata is consumed, so handlers and request logs never see the token.
//
// Every failure is reported as an absl::Status whose message names the flag or file at fault and
// never contains the token. Thread-safety: the returned credentials are used by gRPC from any
// thread; the token they hold is immutable.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace attn {

// The security flags, as given.
struct SecurityConfig {
  std::string tls_cert_file{};       // PEM certificate chain; with tls_key_file, or neither.
  std::string tls_key_file{};        // PEM private key of tls_cert_file.
  std::string tls_client_ca_file{};  // PEM CA bundle: clients must present a certificate it signed.
  std::string auth_token_file{};     // File holding the bearer token (trailing whitespace ignored).
  bool insecure = false;             // Allows plaintext on a non-loopback address.
};

// Credentials for builder.AddListeningPort, and a one-line description for the start-up banner
// (never containing the token).
struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::string summary;     // e.g. "TLS (mutual: client certificates required), bearer token".
  std::string auth_token;  // The bearer token ("" when none), for checks outside gRPC's.
};

// Validates `config` for a server listening on `listen` and builds its credentials.
// INVALID_ARGUMENT when only one of cert/key is given, when --tls-client-ca comes without them,
// or when a file cannot be read, is not PEM, or the token file is empty or holds characters
// other than visible ASCII (proto/credential_files.h reads them); FAILED_PRECONDITION (its message
// naming --insecure) when `listen` is not a loopback address and neither TLS nor --insecure is
// given — a token alone does not suffice, since over plaintext anyone on the path could read it.
absl::StatusOr<ServerSecurity> MakeServerSecurity(const SecurityConfig& config,
                                                  absl::string_view listen);

// Who a call is, for owning server-resident state (KV caches): "x509:" and the subject of the
// client's certificate under mutual TLS; otherwise "", the whole server (every caller holding
// the one bearer token, or any caller of an open server, is the same identity).
std::string CallerIdentity(const grpc::ServerContextBase& context);

// Whether a gRPC listen address ("host:port", "[v6]:port", "unix:path") only accepts
// connections from this machine: 127.0.0.0/8, ::1 (or IPv4-mapped 127/8), "localhost", or a
// Unix socket. A wildcard (0.0.0.0, [::], an empty host) or any other name or address is not.
bool IsLoopbackAddress(absl::string_view listen);

// The check the auth processor applies to one call, exposed for tests. `path` is the call's
// ":path" ("/package.Service/Method"); `authorization` its authorization metadata values (none
// when absent). OK for any grpc.health.v1 call and for exactly one "Bearer <expected_token>"
// (the scheme case-insensitive, the token compared in constant time); UNAUTHENTICATED
// otherwise, with a message that says what was wrong but never echoes a token.
absl::Status CheckBearerToken(absl::string_view expected_token, absl::string_view path,
                              absl::Span<const absl::string_view> authorization);

// Compares `given` with `expected` in time that depends only on given.size(), never on where
// they first differ (nor on the expected token's length).
bool ConstantTimeEquals(absl::string_view given, absl::string_view expected);

}  // namespace attn
