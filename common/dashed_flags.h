// common/ holds header-only helpers shared by the server (attnd) and the client (attn, the
// benchmarks) that depend on nothing of the project, so either side may include them without
// an arrow from client/ into server/ or back.
//
// DashedFlags lets attnd and attn take flags spelled with dashes (--max-naive-bytes), as their
// docs do, although Abseil's flag names use underscores (--max_naive_bytes).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace attn {

// Rewrites argv so each "--flag-name[=value]" reads "--flag_name[=value]"; values, positional
// arguments and everything after a bare "--" are untouched. The object owns the rewritten text;
// hand argc() and argv() to absl::ParseCommandLine while it lives.
class DashedFlags {
 public:
  DashedFlags(int argc, char** argv) {
    bool flags_ended = false;
    for (int i = 0; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "--") flags_ended = true;
      if (i > 0 && !flags_ended && arg.size() > 2 && arg[0] == '-') {
        const size_t end = arg.find('=');
        for (size_t c = 1; c < std::min(end, arg.size()); ++c) {
          if (arg[c] == '-' && c > 1) arg[c] = '_';
        }
      }
      args_.push_back(std::move(arg));
    }
    for (std::string& arg : args_) pointers_.push_back(arg.data());
    pointers_.push_back(nullptr);
  }

  int argc() const { return static_cast<int>(args_.size()); }
  char** argv() { return pointers_.data(); }

 private:
  std::vector<std::string> args_;
  std::vector<char*> pointers_;
};

}  // namespace attn
