#include "kernels/cpu/trace.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "kernels/cpu/fp32_rows.h"
#include "kernels/cpu/kv_tile.h"
#include "kernels/cpu/naive.h"
#include "kernels/cpu/tiled.h"
#include "kernels/online_softmax.h"

namespace attn {
namespace {

class CpuTraceCursor final : public TraceCursor {
 public:
  CpuTraceCursor(const Problem& problem, std::vector<RowRef> rows)
      : problem_(problem), rows_(std::move(rows)) {
    stats_.block_k = problem_.block_k;
  }

  bool Next(TraceItem* item) override {
    if (row_index_ >= rows_.size()) return false;
    const auto start = std::chrono::steady_clock::now();
    if (!row_started_) StartRow();
    if (tile_ < problem_.VisitedTiles(rows_[row_index_].row).end) {
      *item = Step();
    } else {
      *item = FinishRow();
    }
    stats_.compute_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - start)
                             .count();
    return true;
  }

  Stats stats() const override {
    Stats stats = stats_;
    stats.scratch_bytes =
        query_.scratch_bytes() + key_.scratch_bytes() + value_.scratch_bytes() +
        key_tile_.scratch_bytes() +
        static_cast<int64_t>((scores_.capacity() + acc_.capacity() + reference_.capacity()) *
                             sizeof(float));
    stats.peak_memory_bytes = stats.scratch_bytes;
    return stats;
  }

 private:
  void StartRow() {
    const RowRef& ref = rows_[row_index_];
    const Shape& s = problem_.shape;
    const int64_t kv_head = problem_.KvHead(ref.head);  // Grouped-query attention.
    q_row_ =
        query_.Load(problem_.query, problem_.QueryOffset(ref.batch, ref.head, ref.row), s.head_dim);
    key_rows_ = key_.LoadKeys(problem_, ref.batch, kv_head, 0, s.key_len);
    value_rows_ = value_.LoadValues(problem_, ref.batch, kv_head, 0, s.key_len);
    state_ = OnlineSoftmaxRow{};
    tile_ = problem_.VisitedTiles(ref.row).begin;  // The first tile the row sees a key of.
    scores_.assign(problem_.block_k, 0.f);
    acc_.assign(AccStride(static_cast<int>(s.value_dim)), 0.f);
    row_started_ = true;
  }

  TraceStep Step() {
    const RowRef& ref = rows_[row_index_];
    const Shape& s = problem_.shape;
    TraceStep step;
    step.row = ref;
    step.tile = static_cast<int>(tile_);
    step.key_begin = tile_ * problem_.block_k;
    step.key_end = std::min<int64_t>(step.key_begin + problem_.block_k, s.key_len);
    const int n = static_cast<int>(step.key_end - step.key_begin);
    const int d = static_cast<int>(s.head_dim);
    const int dv = static_cast<int>(s.value_dim);
    // Tiled's own tile step, for a block of one row.
    key_tile_.Load(key_rows_ + step.key_begin * d, value_rows_ + step.key_begin * dv, n, d, dv,
                   problem_.scale);
    key_tile_.Scores(q_row_, 1, scores_.data());
    step.scores.assign(scores_.begin(), scores_.begin() + n);
    if (!problem_.transforms().Identity()) step.scaled_scores = step.scores;
    // The transformed and masked scores, as VisitKeyTileRows sees them.
    TransformTile(problem_, ref.head, ref.row, step.key_begin, step.scores.data(), n);
    MaskTile(problem_.Visible(ref.row), step.key_begin, n, step.scores.data());
    const Geometry geometry = problem_.geometry();
    if (problem_.alibi_slopes != nullptr) {
      // The bias TransformTile added to each key: ScoreTransform::Apply's, from the tile's
      // first distance, float(p − t₀) − j.
      const ScoreTransform transform = problem_.transform(ref.head);
      const float first = static_cast<float>(geometry.Distance(ref.row, step.key_begin));
      step.biases.resize(n);
      for (int j = 0; j < n; ++j) step.biases[j] = transform.Bias(first - static_cast<float>(j));
    }
    if (geometry.Masked()) {  // Why MaskTile hid each key it hid.
      step.hidden.resize(n);
      for (int j = 0; j < n; ++j) step.hidden[j] = geometry.HiddenBy(ref.row, step.key_begin + j);
    }
    step.max_before = state_.max;
    VisitKeyTileRows(problem_, ref.head, ref.row, 1, step.key_begin, n, scores_.data(), acc_.data(),
                     static_cast<int>(acc_.size()), &state_, &step.rescale);
    step.max_after = state_.max;
    step.weights.assign(scores_.begin(), scores_.begin() + n);
    key_tile_.Accumulate(scores_.data(), 1, acc_.data());
    step.denominator = state_.denominator;
    step.accumulator.assign(acc_.begin(), acc_.begin() + dv);
    step.estimate.resize(dv);
    for (int c = 0; c < dv; ++c) step.estimate[c] = state_.Normalize(acc_[c]);
    stats_.flops += problem_.TraceTileFlops(ref.row, tile_);
    ++tile_;
    return step;
  }

  TraceRowDone FinishRow() {
    const RowRef& ref = rows_[row_index_];
    const Shape& s = problem_.shape;
    TraceRowDone done;
    done.row = ref;
    const float sink = problem_.transforms().Sink(ref.head);
    const float factor = state_.AddSink(sink);  // As Tiled finishes a row.
    done.lse = state_.LogSumExp();
    done.sink_share = OnlineSoftmaxRow::SinkShare(sink, done.lse);
    done.output.resize(s.value_dim);
    for (int64_t c = 0; c < s.value_dim; ++c) done.output[c] = state_.Normalize(acc_[c] * factor);

    // The full-matrix row, by Naive's own code (the head packed as Naive packs it).
    key_tile_.Load(key_rows_, value_rows_, static_cast<int>(s.key_len),
                   static_cast<int>(s.head_dim), static_cast<int>(s.value_dim), problem_.scale);
    reference_.resize(2 * s.key_len + AccStride(static_cast<int>(s.value_dim)));
    NaiveRows(problem_, q_row_, key_tile_, ref.head, ref.row, 1, reference_.data(),
              reference_.data() + s.key_len, nullptr, reference_.data() + 2 * s.key_len);
    done.reference.assign(reference_.begin() + 2 * s.key_len,
                          reference_.begin() + 2 * s.key_len + s.value_dim);
    done.max_abs_error = MaxAbsError(done.output, done.reference);

    ++row_index_;
    tile_ = 0;
    row_started_ = false;
    return done;
  }

  const Problem problem_;
  const std::vector<RowRef> rows_;
  size_t row_index_ = 0;
  int64_t tile_ = 0;
  bool row_started_ = false;

  Fp32Rows query_, key_, value_;
  const float* q_row_ = nullptr;
  const float* key_rows_ = nullptr;
  const float* value_rows_ = nullptr;
  KvTile key_tile_;  // The step's tile; in FinishRow the whole head, for the reference row.
  OnlineSoftmaxRow state_;
  std::vector<float> scores_, acc_, reference_;
  Stats stats_;
};

}  // namespace

std::unique_ptr<TraceCursor> MakeCpuTraceCursor(const Problem& problem, std::vector<RowRef> rows) {
  return std::make_unique<CpuTraceCursor>(problem, std::move(rows));
}

}  // namespace attn
