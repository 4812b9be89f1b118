#include "client/cli/render.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace attn::cli {
namespace {

namespace v1 = attention::v1;

std::string Millis(int64_t ns) { return absl::StrFormat("%.3f ms", static_cast<double>(ns) / 1e6); }

std::string Row(const v1::RowRef& row) {
  return absl::StrCat("batch ", row.batch(), ", head ", row.head(), ", query ", row.row());
}

}  // namespace

std::string Bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", value, units[unit]);
}

void PrintResult(std::FILE* out, const char* method, const v1::AttentionResponse& response,
                 const client::Array& output, int64_t round_trip_ns, int rows) {
  const v1::ExecutionStats& stats = response.stats();
  absl::FPrintF(out, "%s on %s (%s): output [%s] %s\n", method, stats.backend(), stats.device(),
                absl::StrJoin(output.shape, ", "), v1::DType_Name(response.output().dtype()));
  const double seconds = static_cast<double>(stats.compute_ns()) / 1e9;
  absl::FPrintF(out, "  compute %s (%.2f GFLOP/s), server %s, round trip %s\n",
                Millis(stats.compute_ns()), seconds > 0 ? stats.flops() / seconds / 1e9 : 0.0,
                Millis(stats.server_ns()), Millis(round_trip_ns));
  absl::FPrintF(out, "  block_k %d; intermediate %s, scratch %s, peak %s\n", stats.block_k(),
                Bytes(stats.intermediate_bytes()), Bytes(stats.scratch_bytes()),
                Bytes(stats.peak_memory_bytes()));
  const int64_t width = output.shape.back();
  const int64_t total_rows = width > 0 ? static_cast<int64_t>(output.values.size()) / width : 0;
  for (int64_t i = 0; i < total_rows && i < rows; ++i) {
    std::vector<float> row(output.values.begin() + i * width,
                           output.values.begin() + (i + 1) * width);
    absl::FPrintF(out, "  out[%d] = %s\n", i, Vector(row));
  }
  if (total_rows > rows) absl::FPrintF(out, "  … %d more rows\n", total_rows - rows);
  if (response.has_lse()) {
    absl::FPrintF(out, "  lse: [%s] fp32\n", absl::StrJoin(response.lse().shape(), ", "));
  }
}

void TraceRenderer::OnEvent(const v1::TraceEvent& event) {
  switch (event.event_case()) {
    case v1::TraceEvent::kStart: {
      start_ = event.start();
      absl::FPrintF(
          out_,
          "Trace of [batch %d, heads %d (kv %d), %d queries × %d keys], head_dim %d, "
          "value_dim %d, scale %g%s%s%s%s%s%s\n",
          start_.batch(), start_.heads(), start_.kv_heads(), start_.query_len(), start_.key_len(),
          start_.head_dim(), start_.value_dim(), start_.scale(), start_.causal() ? ", causal" : "",
          start_.has_window_left() || start_.has_window_right()
              ? absl::StrCat(", window [p − ",
                             start_.has_window_left() ? absl::StrCat(start_.window_left())
                                                      : std::string("∞"),
                             ", p + ",
                             start_.has_window_right() ? absl::StrCat(start_.window_right())
                                                       : std::string("∞"),
                             "]")
              : std::string(),
          start_.softcap() > 0 ? absl::StrCat(", softcap ", start_.softcap()) : std::string(),
          start_.alibi_slopes_size() > 0
              ? absl::StrCat(", ALiBi slopes ", Vector(start_.alibi_slopes()))
              : std::string(),
          start_.sinks_size() > 0 ? absl::StrCat(", sinks ", Vector(start_.sinks()))
                                  : std::string(),
          start_.cu_seqlens_q_size() > 0
              ? absl::StrCat(", ", start_.cu_seqlens_q_size() - 1, " sequences (cu_seqlens_q [",
                             absl::StrJoin(start_.cu_seqlens_q(), ", "), "], cu_seqlens_k [",
                             absl::StrJoin(start_.cu_seqlens_k(), ", "), "])")
              : std::string());
      absl::FPrintF(out_,
                    "Naive moves %s through its score and weight matrices (16·B·H·Nq·Nk); "
                    "Tiled keeps %d floats per query row (block_k %d + value_dim %d + 2), "
                    "%d tiles per row.\n",
                    Bytes(start_.naive_intermediate_bytes()), start_.tiled_scratch_floats_per_row(),
                    start_.block_k(), start_.value_dim(), start_.tiles_per_row());
      break;
    }
    case v1::TraceEvent::kStep:
      steps_.push_back(event.step());
      break;
    case v1::TraceEvent::kRowDone:
      PrintRow(event.row_done());
      steps_.clear();
      break;
    case v1::TraceEvent::kEnd: {
      const v1::ExecutionStats& stats = event.end().stats();
      absl::FPrintF(out_, "\n%d rows, %d steps on %s (%s), compute %s, server %s\n",
                    event.end().rows(), event.end().steps(), stats.backend(), stats.device(),
                    Millis(stats.compute_ns()), Millis(stats.server_ns()));
      break;
    }
    case v1::TraceEvent::EVENT_NOT_SET:
      break;
  }
}

void TraceRenderer::PrintRow(const v1::RowDone& done) {
  absl::FPrintF(out_, "\nRow (%s): score → weight, then the weighted result\n", Row(done.row()));
  absl::FPrintF(out_, "  %6s  %12s  %10s\n", "key", "score", "weight");
  for (const v1::TileStep& step : steps_) {
    for (int j = 0; j < step.scores_size(); ++j) {
      const float score = step.scores(j);
      // The final weight of a key is exp(score − lse): its share of the whole row's softmax.
      const double weight = std::isinf(score) ? 0.0 : std::exp(double(score) - done.lse());
      const v1::Hidden hidden = j < step.hidden_size() ? step.hidden(j) : v1::HIDDEN_NONE;
      absl::FPrintF(out_, "  %6d  %12.6f  %10.6f%s\n", step.key_begin() + j, score, weight,
                    hidden == v1::HIDDEN_CAUSAL     ? "  (hidden: causal)"
                    : hidden == v1::HIDDEN_WINDOW   ? "  (hidden: window)"
                    : hidden == v1::HIDDEN_SEQUENCE ? "  (hidden: another sequence)"
                                                    : "");
    }
  }
  if (start_.sinks_size() > 0) {  // One more logit, with no value.
    absl::FPrintF(out_, "  %6s  %12.6f  %10.6f  (the head's attention sink: no value)\n", "sink",
                  start_.sinks(done.row().head()), done.sink_share());
  }
  absl::FPrintF(out_, "  result = Σ weight · value = %s\n", Vector(done.reference()));

  absl::FPrintF(out_, "\n  Online softmax, %d keys per tile:\n", start_.block_k());
  for (const v1::TileStep& step : steps_) {
    absl::FPrintF(out_, "  tile %d, keys [%d, %d)\n", step.tile(), step.key_begin(),
                  step.key_end());
    if (step.scaled_scores_size() > 0) {
      absl::FPrintF(out_, "    scaled       %s   (before the softcap and bias)\n",
                    Vector(step.scaled_scores()));
    }
    if (step.biases_size() > 0) {
      absl::FPrintF(out_, "    bias         %s   (ALiBi: −slope · |p − t|)\n",
                    Vector(step.biases()));
    }
    absl::FPrintF(out_, "    scores       %s\n", Vector(step.scores()));
    absl::FPrintF(out_, "    max          %g → %g   rescale %g\n", step.max_before(),
                  step.max_after(), step.rescale());
    absl::FPrintF(out_, "    weights      %s\n", Vector(step.weights()));
    absl::FPrintF(out_, "    denominator  %.6f\n", step.denominator());
    absl::FPrintF(out_, "    accumulator  %s\n", Vector(step.accumulator()));
    absl::FPrintF(out_, "    estimate     %s\n", Vector(step.estimate()));
  }
  if (steps_.empty()) absl::FPrintF(out_, "  (the causal mask hides every key from this row)\n");
  if (start_.sinks_size() > 0) {
    absl::FPrintF(out_, "\n  sink %g joins after the last tile: it takes %.6f of the row\n",
                  start_.sinks(done.row().head()), done.sink_share());
  }
  absl::FPrintF(out_, "\n  online output  %s\n", Vector(done.output()));
  absl::FPrintF(out_, "  full matrix    %s\n", Vector(done.reference()));
  absl::FPrintF(out_, "  max |online − full| = %.3g, lse = %g\n", done.max_abs_error(), done.lse());
}

void TraceFollower::OnEvent(const v1::TraceEvent& event) {
  switch (event.event_case()) {
    case v1::TraceEvent::kStart:
      start_ = event.start();
      absl::FPrintF(out_, "Following %d queries × %d keys, %d tiles of %d keys per row\n",
                    start_.query_len(), start_.key_len(), start_.tiles_per_row(), start_.block_k());
      break;
    case v1::TraceEvent::kStep:
      DrawStep(event.step());
      std::fflush(out_);
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms_));
      break;
    case v1::TraceEvent::kRowDone: {
      const v1::RowDone& done = event.row_done();
      absl::FPrintF(out_,
                    "  online output  %s\n  full matrix    %s\n  max |online − full| = %.3g\n",
                    Vector(done.output()), Vector(done.reference()), done.max_abs_error());
      frame_lines_ = 0;  // The next row draws below, leaving this one on screen.
      break;
    }
    case v1::TraceEvent::kEnd:
      absl::FPrintF(out_, "%d rows, %d steps\n", event.end().rows(), event.end().steps());
      break;
    case v1::TraceEvent::EVENT_NOT_SET:
      break;
  }
  std::fflush(out_);
}

void TraceFollower::DrawStep(const v1::TileStep& step) {
  // Over the previous frame: up to its first line, then clear to the end of the screen.
  if (redraw_ && frame_lines_ > 0) absl::FPrintF(out_, "\x1b[%dA\x1b[J", frame_lines_);
  const int tiles = std::max(start_.tiles_per_row(), 1);
  const int done = std::min(step.tile() + 1, tiles);
  constexpr int kBar = 30;
  const int filled = done * kBar / tiles;
  absl::FPrintF(out_, "Row (%s)  tile %d of %d, keys [%d, %d)  [%s%s]\n", Row(step.row()),
                step.tile() + 1, tiles, step.key_begin(), step.key_end(), std::string(filled, '#'),
                std::string(kBar - filled, '.'));
  if (step.scaled_scores_size() > 0) {
    absl::FPrintF(out_, "  scaled       %s   (before the softcap and bias)\n",
                  Vector(step.scaled_scores()));
  }
  if (step.biases_size() > 0) {
    absl::FPrintF(out_, "  bias         %s   (ALiBi: −slope · |p − t|)\n", Vector(step.biases()));
  }
  absl::FPrintF(out_, "  scores       %s\n", Vector(step.scores()));
  absl::FPrintF(out_, "  max          %g → %g   rescale %g\n", step.max_before(), step.max_after(),
                step.rescale());
  absl::FPrintF(out_, "  denominator  %.6f\n", step.denominator());
  absl::FPrintF(out_, "  estimate     %s\n", Vector(step.estimate()));
  frame_lines_ = 5;
}

}  // namespace attn::cli
