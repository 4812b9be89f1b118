// The shared online-softmax step (kernels/online_softmax.h) on the CPU: its exp (kernels/exp.h)
// against float64, the vector lanes (kernels/lanes.h) against the scalar code, and a row
// visited tile by tile, or in strided shares, or in parts merged with MergeInto, against the
// float64 softmax of the whole row.

#include "kernels/online_softmax.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "kernels/exp.h"
#include "kernels/lanes.h"

namespace attn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// |Exp(x) − e^x| / e^x over [−87, 88]: a few ulp (fp32's ulp at 1 is 1.19e-7).
TEST(ExpTest, WithinFourUlpOfFloat64) {
  std::mt19937 rng(20261129);
  std::uniform_real_distribution<float> uniform(-87.f, 88.f);
  std::vector<float> xs = {0.f, -0.f, 1.f, -1.f, 0.5f, -0.34657359f, 0.34657359f, 88.f, -87.f};
  for (int i = 0; i < 200000; ++i) xs.push_back(uniform(rng));
  for (int i = -870; i <= 880; ++i) xs.push_back(i * 0.1f);
  double worst = 0;
  float worst_x = 0;
  for (float x : xs) {
    const double exact = std::exp(static_cast<double>(x));
    const double error = std::abs(Exp(x) - exact) / exact;
    if (error > worst) {
      worst = error;
      worst_x = x;
    }
  }
  EXPECT_LT(worst, 4 * 1.19e-7) << "at x = " << worst_x;
  EXPECT_EQ(Exp(0.f), 1.f);
}

TEST(ExpTest, UnderflowsToExactlyZero) {
  for (float x : {-87.7f, -88.f, -100.f, -1e4f, -3.4e38f, -kInf}) {
    EXPECT_EQ(Exp(x), 0.f) << "x = " << x;
  }
  // Just above the cut the result is tiny but never negative or NaN.
  for (float x = -87.7f; x <= -85.f; x += 0.01f) {
    const float e = Exp(x);
    EXPECT_GE(e, 0.f) << "x = " << x;
    EXPECT_LE(e, 2e-37f) << "x = " << x;
  }
}

TEST(ExpTest, LanesEqualTheScalarCodeBitForBit) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-120.f, 88.f);
  std::vector<float> xs = {-kInf, 0.f, -0.f, -87.68f, -87.69f, 88.f, -100.f, -101.f};
  for (int i = 0; i < 4096; ++i) xs.push_back(wide(rng));
  while (xs.size() % lanes::kWidth != 0) xs.push_back(0.f);
  for (size_t i = 0; i < xs.size(); i += lanes::kWidth) {
    const lanes::Floats v = lanes::Exp(lanes::Load(xs.data() + i));
    for (int l = 0; l < lanes::kWidth; ++l) {
      const float scalar = Exp(xs[i + l]);
      EXPECT_EQ(std::memcmp(&v[l], &scalar, sizeof scalar), 0)
          << "x = " << xs[i + l] << ": lane " << v[l] << ", scalar " << scalar;
    }
  }
}

// A row of scores visited in tiles of odd widths (vector body and scalar tail), with masked
// scores and a first tile that is entirely masked, ends with the float64 softmax's denominator
// and weights, and each tile's weights are relative to the running max.
TEST(OnlineSoftmaxRowTest, TilesReproduceTheWholeRowSoftmax) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 4.f);
  for (int tile : {1, 7, 8, 13, 37}) {
    const int n = 101;
    std::vector<float> scores(n);
    for (float& s : scores) s = normal(rng);
    for (int j = 0; j < tile && j < n; ++j) scores[j] = -kInf;  // The first tile: all masked.
    for (int j = tile; j < n; j += 5) scores[j] = -kInf;

    double max = -INFINITY;
    for (float s : scores) max = std::max<double>(max, s);
    double sum = 0;
    for (float s : scores) sum += std::exp(static_cast<double>(s) - max);

    OnlineSoftmaxRow row;
    std::vector<float> weights(n);
    std::vector<double> tile_max_after(n);
    double acc = 0;  // Σ w_j · v_j with v_j = j, rescaled as the caller does.
    for (int begin = 0; begin < n; begin += tile) {
      const int width = std::min(tile, n - begin);
      const float max_before = row.max;
      const float rescale = row.VisitTile(scores.data() + begin, width, weights.data() + begin);
      if (max_before == -kInf) {
        EXPECT_EQ(rescale, 0.f);
      } else {
        EXPECT_GT(rescale, 0.f);
        EXPECT_LE(rescale, 1.f);
      }
      acc *= rescale;
      for (int j = begin; j < begin + width; ++j) {
        acc += weights[j] * static_cast<double>(j);
        tile_max_after[j] = row.max;
        if (scores[j] == -kInf) {
          EXPECT_EQ(weights[j], 0.f) << "tile " << tile << " j " << j;
        }
      }
    }
    EXPECT_EQ(row.max, static_cast<float>(max));
    EXPECT_NEAR(row.denominator / sum, 1.0, 1e-6) << "tile " << tile;
    EXPECT_NEAR(row.LogSumExp(), max + std::log(sum), 1e-5) << "tile " << tile;
    double expected_acc = 0;
    for (int j = 0; j < n; ++j) {
      expected_acc += std::exp(static_cast<double>(scores[j]) - max) * j;
      const double expected_weight =
          scores[j] == -kInf ? 0.0 : std::exp(static_cast<double>(scores[j]) - tile_max_after[j]);
      EXPECT_NEAR(weights[j], expected_weight, 1e-6 * std::max(1.0, expected_weight))
          << "tile " << tile << " j " << j;
    }
    EXPECT_NEAR(row.Normalize(static_cast<float>(acc)), expected_acc / sum, 1e-4)
        << "tile " << tile;
  }
}

TEST(OnlineSoftmaxRowTest, AFullyMaskedRowHasNoWeightAndZeroOutput) {
  OnlineSoftmaxRow row;
  std::vector<float> scores(19, -kInf), weights(19, 123.f);
  for (int pass = 0; pass < 2; ++pass) {
    EXPECT_EQ(row.VisitTile(scores.data(), 19, weights.data()), 0.f);
    for (float w : weights) EXPECT_EQ(w, 0.f);
  }
  EXPECT_EQ(row.denominator, 0.f);
  EXPECT_EQ(row.Normalize(5.f), 0.f);
  EXPECT_EQ(row.LogSumExp(), -kInf);
}

// The full-row softmax (Naive's and every trace reference's) against float64: weights that sum
// to 1 over the visible range, zeros outside it, the log-sum-exp; and one thread's share visited
// with VisitShare (the GPU's scalar path) gives the vector path's max and, within rounding, its
// sum; and a row shared by threads (first, stride) gives the same weights.
TEST(SoftmaxRowTest, MatchesFloat64AndTheScalarShare) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.f, 5.f);
  const int n = 103;
  for (const KeyRange visible :
       {KeyRange{0, 0}, KeyRange{0, 1}, KeyRange{0, 7}, KeyRange{0, 8}, KeyRange{3, 12},
        KeyRange{40, 71}, KeyRange{50, 50}, KeyRange{102, 103}, KeyRange{0, 103}}) {
    SCOPED_TRACE(::testing::Message()
                 << "visible [" << visible.begin << ", " << visible.end << ")");
    std::vector<float> scores(n);
    for (float& s : scores) s = normal(rng);
    std::vector<float> weights(n, 123.f);
    const OnlineSoftmaxRow row =
        SoftmaxRow<SerialReduce>(scores.data(), weights.data(), n, visible, -kInf, 0, 1);
    double max = -INFINITY, sum = 0;
    for (int64_t j = visible.begin; j < visible.end; ++j) {
      max = std::max<double>(max, scores[j]);
    }
    for (int64_t j = visible.begin; j < visible.end; ++j) {
      sum += std::exp(static_cast<double>(scores[j]) - max);
    }
    for (int j = 0; j < n; ++j) {
      const double expected = visible.Contains(j) ? std::exp(scores[j] - max) / sum : 0.0;
      EXPECT_NEAR(weights[j], expected, 1e-6) << "j " << j;
    }
    // Three threads sharing the row (the CUDA kernels' layout), run one after another.
    std::vector<float> shared(n, 123.f);
    for (int first = 0; first < 3; ++first) {
      SoftmaxRow<SerialReduce>(scores.data(), shared.data(), n, visible, -kInf, first, 3);
    }
    for (int j = 0; j < n; ++j) {
      if (!visible.Contains(j)) {
        EXPECT_EQ(shared[j], 0.f) << "j " << j;
      }
    }
    if (visible.size() == 0) {
      EXPECT_EQ(row.LogSumExp(), -kInf);
      continue;
    }
    EXPECT_NEAR(row.LogSumExp(), max + std::log(sum), 1e-5);

    OnlineSoftmaxRow share;
    const int count = static_cast<int>(visible.size());
    std::vector<float> share_weights(count);
    EXPECT_EQ(share.VisitShare(scores.data() + visible.begin, count, share_weights.data(), 0, 1),
              0.f);
    EXPECT_EQ(share.max, row.max);
    EXPECT_NEAR(share.denominator / row.denominator, 1.0, 1e-6);
  }
}

// MergeInto (the rule that combines key ranges, workers and servers): a row split anywhere and
// its two halves' states merged gives the whole row's max, denominator, accumulator and lse.
TEST(MergeTest, SplitAnywhereEqualsTheWholeRow) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.f, 6.f);
  const int n = 61;
  std::vector<float> scores(n), values(n);
  for (float& s : scores) s = normal(rng);
  for (float& v : values) v = normal(rng);
  for (int j = 5; j < n; j += 9) scores[j] = -kInf;
  // A row's state and Σ w·v over scores [begin, end), in tiles of 8.
  auto visit = [&](int begin, int end, float* acc) {
    OnlineSoftmaxRow row;
    *acc = 0.f;
    std::vector<float> weights(n);
    for (int t = begin; t < end; t += 8) {
      const int width = std::min(8, end - t);
      const float rescale = row.VisitTile(scores.data() + t, width, weights.data() + t);
      *acc *= rescale;
      for (int j = t; j < t + width; ++j) *acc += weights[j] * values[j];
    }
    return row;
  };
  float whole_acc;
  const OnlineSoftmaxRow whole = visit(0, n, &whole_acc);
  for (int split = 0; split <= n; ++split) {
    float acc, right_acc;
    OnlineSoftmaxRow merged = visit(0, split, &acc);
    const OnlineSoftmaxRow right = visit(split, n, &right_acc);
    merged.MergeInto(right, &right_acc, &acc, 1);
    EXPECT_EQ(merged.max, whole.max) << "split " << split;
    EXPECT_NEAR(merged.denominator / whole.denominator, 1.0, 1e-6) << "split " << split;
    EXPECT_NEAR(merged.LogSumExp(), whole.LogSumExp(), 1e-6) << "split " << split;
    EXPECT_NEAR(merged.Normalize(acc), whole.Normalize(whole_acc),
                1e-5 * std::max(1.f, std::abs(whole.Normalize(whole_acc))))
        << "split " << split;
    if (split == 0 || split == n) {  // One side empty: the other comes back exactly.
      EXPECT_EQ(merged.denominator, whole.denominator);
      EXPECT_EQ(acc, whole_acc);
    }
  }
}

// Rows of odd lengths and widths cut into parts of odd sizes — among them an empty part and a
// part whose every key is masked, both of which saw no key (max −inf) — each part visited in
// tiles of 5 with its own accumulator, then merged into one state part by part with MergeInto:
// the max, lse and output of the float64 softmax of one pass over all the keys.
TEST(MergeTest, MergeIntoEqualsOnePassOverAllKeysInFloat64) {
  std::mt19937 rng(29);
  std::normal_distribution<float> normal(0.f, 5.f);
  for (const auto& [n, dv] : {std::pair{37, 7}, std::pair{101, 3}, std::pair{13, 1}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n << " dv " << dv);
    std::vector<float> scores(n), values(n * dv);
    for (float& s : scores) s = normal(rng);
    for (float& v : values) v = normal(rng);
    // Parts [cuts[i], cuts[i + 1]): the second one empty, the third one all masked.
    const std::vector<int> cuts = {0, 3, 3, 8, n / 2 + 1, n - 2, n};
    for (int j = 3; j < 8; ++j) scores[j] = -kInf;
    for (int j = 9; j < n; j += 6) scores[j] = -kInf;

    OnlineSoftmaxRow merged;
    std::vector<float> acc(dv, 0.f);
    for (size_t part = 0; part + 1 < cuts.size(); ++part) {
      OnlineSoftmaxRow row;
      std::vector<float> part_acc(dv, 0.f), weights(n);
      for (int t = cuts[part]; t < cuts[part + 1]; t += 5) {
        const int width = std::min(5, cuts[part + 1] - t);
        const float rescale = row.VisitTile(scores.data() + t, width, weights.data() + t);
        for (int c = 0; c < dv; ++c) {
          part_acc[c] *= rescale;
          for (int j = t; j < t + width; ++j) part_acc[c] += weights[j] * values[j * dv + c];
        }
      }
      // A part that saw no key is never read: garbage in its accumulator changes nothing.
      if (row.max == -kInf) part_acc.assign(dv, std::numeric_limits<float>::quiet_NaN());
      merged.MergeInto(row, part_acc.data(), acc.data(), dv);
    }

    double max = -INFINITY;
    for (float s : scores) max = std::max<double>(max, s);
    double sum = 0;
    std::vector<double> expected(dv, 0.0);
    for (int j = 0; j < n; ++j) {
      const double w = scores[j] == -kInf ? 0.0 : std::exp(static_cast<double>(scores[j]) - max);
      sum += w;
      for (int c = 0; c < dv; ++c) expected[c] += w * values[j * dv + c];
    }
    EXPECT_EQ(merged.max, static_cast<float>(max));
    EXPECT_NEAR(merged.LogSumExp(), max + std::log(sum), 1e-5 * std::max(1.0, std::abs(max)));
    double scale = 0;
    for (int c = 0; c < dv; ++c) scale = std::max(scale, std::abs(expected[c] / sum));
    for (int c = 0; c < dv; ++c) {
      EXPECT_NEAR(merged.Normalize(acc[c]), expected[c] / sum, 1e-5 * std::max(1.0, scale))
          << "column " << c;
    }
  }
}

// A side that saw no key (max −inf) contributes a factor of exactly 0 and leaves the other
// side's state and accumulator bit for bit, on either side of the merge.
TEST(MergeTest, ASideWithNoKeyLeavesTheOtherExactly) {
  OnlineSoftmaxRow seen;
  seen.max = 3.25f;
  seen.denominator = 1.75f;
  const float seen_acc[2] = {-2.5f, 0.375f};
  const OnlineSoftmaxRow empty;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float unread[2] = {nan, nan};  // An empty state's accumulator is never read.
  OnlineSoftmaxRow left = seen;
  float left_acc[2] = {seen_acc[0], seen_acc[1]};
  MergeFactors factors = left.MergeInto(empty, unread, left_acc, 2);
  EXPECT_EQ(factors.mine, 1.f);
  EXPECT_EQ(factors.theirs, 0.f);
  EXPECT_EQ(left.max, seen.max);
  EXPECT_EQ(left.denominator, seen.denominator);
  EXPECT_EQ(left_acc[0], seen_acc[0]);
  EXPECT_EQ(left_acc[1], seen_acc[1]);
  OnlineSoftmaxRow right = empty;
  float right_acc[2] = {0.f, 0.f};  // The empty state's.
  factors = right.MergeInto(seen, seen_acc, right_acc, 2);
  EXPECT_EQ(factors.mine, 0.f);
  EXPECT_EQ(factors.theirs, 1.f);
  EXPECT_EQ(right.max, seen.max);
  EXPECT_EQ(right.denominator, seen.denominator);
  EXPECT_EQ(right_acc[0], seen_acc[0]);
  EXPECT_EQ(right_acc[1], seen_acc[1]);
}

// Two empty sides: still empty — max −inf, denominator 0, both factors 0 (never −inf − −inf),
// output 0, lse −inf.
TEST(MergeTest, BothSidesEmptyStayEmpty) {
  OnlineSoftmaxRow row;
  float acc = 0.f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const MergeFactors factors = row.MergeInto(OnlineSoftmaxRow{}, &nan, &acc, 1);
  EXPECT_EQ(factors.mine, 0.f);
  EXPECT_EQ(factors.theirs, 0.f);
  EXPECT_EQ(row.max, -kInf);
  EXPECT_EQ(row.denominator, 0.f);
  EXPECT_EQ(acc, 0.f);
  EXPECT_EQ(row.Normalize(acc), 0.f);
  EXPECT_EQ(row.LogSumExp(), -kInf);
}

// A sink joins a finished row as one more logit with no value: against float64 for sinks below,
// among and far above the scores (e^(sink − max) would overflow fp32 unless the max moves), the
// weight it took, SoftmaxRow's weights summing to 1 − that share, and a row that saw no key
// (output 0, lse = sink). −inf is no sink.
TEST(SinkTest, OneMoreLogitWithNoValue) {
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> uniform(-4.f, 4.f);
  const int n = 37, dv = 3;
  std::vector<float> scores(n), values(n * dv);
  for (float& x : scores) x = uniform(rng);
  for (float& x : values) x = uniform(rng);
  for (float sink : {-kInf, -30.f, 0.5f, 3.9f, 200.f, -3e38f}) {
    OnlineSoftmaxRow row;
    std::vector<float> weights(n), acc(dv, 0.f);
    const float rescale = row.VisitTile(scores.data(), n, weights.data());
    OnlineSoftmaxRow::RescaleAccumulator(rescale, dv, [&](int c) -> float& { return acc[c]; });
    for (int j = 0; j < n; ++j) {
      for (int c = 0; c < dv; ++c) acc[c] += weights[j] * values[j * dv + c];
    }
    row.Finish();
    const float factor = row.AddSink(sink);
    double max = sink;
    for (float x : scores) max = std::max(max, double(x));
    double sum = std::isinf(sink) ? 0.0 : std::exp(double(sink) - max);
    const double sink_weight = sum;
    for (float x : scores) sum += std::exp(double(x) - max);
    for (int c = 0; c < dv; ++c) {
      double expected = 0;
      for (int j = 0; j < n; ++j)
        expected += std::exp(double(scores[j]) - max) * values[j * dv + c];
      EXPECT_NEAR(row.Normalize(acc[c] * factor), expected / sum, 1e-5) << "sink " << sink;
    }
    EXPECT_NEAR(row.LogSumExp(), max + std::log(sum), 1e-5 * std::max(1.0, std::abs(max)))
        << "sink " << sink;
    EXPECT_NEAR(OnlineSoftmaxRow::SinkShare(sink, row.LogSumExp()), sink_weight / sum, 1e-5)
        << "sink " << sink;

    std::vector<float> full(n);
    const OnlineSoftmaxRow whole =
        SoftmaxRow<SerialReduce>(scores.data(), full.data(), n, KeyRange{0, n}, sink, 0, 1);
    double weight_sum = 0;
    for (float w : full) weight_sum += w;
    EXPECT_NEAR(weight_sum, 1.0 - sink_weight / sum, 1e-5) << "sink " << sink;
    EXPECT_NEAR(whole.LogSumExp(), row.LogSumExp(), 1e-5 * std::max(1.0, std::abs(max)));
  }
  OnlineSoftmaxRow none;  // Saw no key.
  none.Finish();
  EXPECT_EQ(none.AddSink(1.5f), 0.f);
  EXPECT_EQ(none.Normalize(0.f), 0.f);
  EXPECT_EQ(none.LogSumExp(), 1.5f);
  EXPECT_EQ(OnlineSoftmaxRow::SinkShare(1.5f, none.LogSumExp()), 1.f);
  OnlineSoftmaxRow unsunk;
  EXPECT_EQ(unsunk.AddSink(-kInf), 0.f);
  EXPECT_EQ(unsunk.LogSumExp(), -kInf);
}

}  // namespace
}  // namespace attn
