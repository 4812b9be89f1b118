// The credential files both ends of the contract are given on their command lines: PEM files for
// TLS and the file holding the bearer token ("authorization: Bearer <token>"). attnd
// (server/security.cc) and attn (client/cli/main.cc) both read them here, so a file means the
// same to both.
//
// Errors: INVALID_ARGUMENT whose message starts with the flag that named the file
// ("--auth-token-file: ..."), then the path and what is wrong; never the token itself.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attn {

// The contents of the file at `path`; "FLAG: cannot read PATH: reason" when it cannot be read.
absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag, const std::string& path);

// A PEM file: as ReadFlagFile, and "FLAG: PATH is not a PEM file" when it holds no PEM block.
absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path);

// A bearer token: the file's contents less trailing whitespace (a final newline). Also
// "FLAG: PATH is empty" when nothing is left, and "FLAG: PATH holds a character that is not
// visible ASCII ..." for a space, a control character or a non-ASCII byte (gRPC metadata could
// not carry it as one word).
absl::StatusOr<std::string> ReadTokenFile(absl::string_view flag, const std::string& path);

}  // namespace attn
