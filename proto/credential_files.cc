#include "proto/credential_files.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace attn {

absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag, const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  return std::move(contents).str();
}

absl::StatusOr<std::string> ReadPemFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadFlagFile(flag, path);
  if (pem.ok() && !absl::StrContains(*pem, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a PEM file"));
  }
  return pem;
}

absl::StatusOr<std::string> ReadTokenFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> token = ReadFlagFile(flag, path);
  if (!token.ok()) return token.status();
  absl::StripTrailingAsciiWhitespace(&*token);
  if (token->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  }
  for (const char c : *token) {
    if (c < '!' || c > '~') {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": ", path,
          " holds a character that is not visible ASCII (space, control or non-ASCII byte); a "
          "bearer token must be one word of printable characters"));
    }
  }
  return token;
}

}  // namespace attn
