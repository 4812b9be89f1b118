// Text rendering for the attn CLI: results, stats and the online-softmax trace.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"

namespace attn::cli {

// A byte count for people: "512 B", "1.5 KiB", "260.0 MiB".
std::string Bytes(int64_t bytes);

// A vector for people: its first eight components to six decimals, "[0.500000, …, … (64 values)]".
template <class Values>
std::string Vector(const Values& values) {
  constexpr int kMaxShown = 8;
  std::vector<std::string> shown;
  int i = 0;
  for (const auto x : values) {
    if (i++ == kMaxShown) {
      shown.push_back(absl::StrCat("… (", values.size(), " values)"));
      break;
    }
    shown.push_back(absl::StrFormat("%.6f", static_cast<double>(x)));
  }
  return absl::StrCat("[", absl::StrJoin(shown, ", "), "]");
}

// Prints a Naive/Tiled answer: shape, stats, round-trip time and the first `rows` output rows.
void PrintResult(std::FILE* out, const char* method,
                 const attention::v1::AttentionResponse& response, const client::Array& output,
                 int64_t round_trip_ns, int rows);

// Renders a trace as its events arrive. For each row, after its RowDone: the score row →
// weights → result table, each tile's step, then the online result beside the full-matrix one.
class TraceRenderer {
 public:
  explicit TraceRenderer(std::FILE* out) : out_(out) {}
  void OnEvent(const attention::v1::TraceEvent& event);

 private:
  void PrintRow(const attention::v1::RowDone& done);

  std::FILE* out_;
  attention::v1::TraceStart start_;
  std::vector<attention::v1::TileStep> steps_;  // Of the row in progress.
};

// Animates a trace in the terminal as it arrives (attn trace --follow): each step of the row in
// progress redraws one frame in place — the tile's scores, the running max and rescale, the
// denominator and the estimate converging, with a progress bar — pausing `step_ms` between steps
// so a person can follow; each finished row leaves its online and full-matrix results. On a
// non-terminal `out` the frames are printed one after another instead of redrawn.
class TraceFollower {
 public:
  TraceFollower(std::FILE* out, int step_ms, bool redraw)
      : out_(out), step_ms_(step_ms), redraw_(redraw) {}
  void OnEvent(const attention::v1::TraceEvent& event);

 private:
  void DrawStep(const attention::v1::TileStep& step);

  std::FILE* out_;
  const int step_ms_;
  const bool redraw_;
  attention::v1::TraceStart start_;
  int frame_lines_ = 0;  // Lines of the frame on screen, to redraw over.
};

}  // namespace attn::cli
