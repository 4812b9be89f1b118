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
// arguments and everything after a bare "--" are untouched. A flag's name starts with a letter,
// so a separate value that starts with a dash ("--sinks -2,-1.5", "--window -1,4") is a value,
// not a flag, and keeps its dashes. The object owns the rewritten text; hand argc() and argv()
// to absl::ParseCommandLine while it lives.
class DashedFlags {
 public:
  DashedFlags(int argc, char** argv) {
    bool flags_ended = false;
    for (int i = 0; i < argc; ++i) {
      std::string arg = argv[i];
      if (arg == "--") flags_ended = true;
      const size_t name = arg.rfind("--", 0) == 0 ? 2 : 1;  // where the name starts
      if (i > 0 && !flags_ended && arg.size() > 2 && arg[0] == '-' && IsLetter(arg[name])) {
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
  static bool IsLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

  std::vector<std::string> args_;
  std::vector<char*> pointers_;
};

}  // namespace attn
