// OnlineSoftmax: the online-softmax state of one query row and its update step, the one piece
// of math that every Tiled kernel (CPU and CUDA), every trace and every Naive row softmax share,
// so that what a trace shows is exactly what Tiled computes.
//
// State of one query row: a running max m, a running denominator l and an accumulator
// acc[value_dim] (held by the caller, whose layout varies). Visiting a tile of scores s
// (already scaled; −inf where masked):
//
//   m'      = max(m, max(s))
//   rescale = exp(m − m')          0 when m is −inf (the first tile): never −inf − (−inf)
//   w_j     = exp(s_j − m')        0 when s_j is −inf
//   l'      = l · rescale + Σ w_j
//   acc'    = acc · rescale + Σ w_j · V_j
//
// At the end: output = acc / l (0 when l is 0: the row saw no key), lse = m + log(l) (−inf
// when l is 0); an attention sink joins the finished state as one more key of zero value
// (AddSink). Because every weight is taken relative to the running max, no exp ever sees
// a positive argument and nothing overflows however large the scores grow. Two states of one
// row over different keys merge by the same rule (MergeInto: max, denominator and accumulator),
// so a row's keys may be split over tiles, threads, chunks or servers and the parts combined.
//
// Who holds a row. A tile's scores of one row may be spread over the threads that share the
// row: one CPU thread (whose eight or sixteen vector lanes VisitTile reduces itself), the four
// lanes of a quad (the tensor-core kernel), a warp, a block. The Reduce policy — Max and Sum of one
// float over those threads, every thread getting the result — is the only thing that varies:
// SerialReduce below, the shuffle and block reductions in kernels/cuda/reduce.h. Every thread
// of a row holds the row's max (Rescale reduces it). `denominator` is this thread's share: the
// sum of the weights this thread added, rescaled like the whole; Finish() adds the shares once,
// after the last tile, and only then do Normalize and LogSumExp mean the row's values. Under
// SerialReduce the share is the whole, so a CPU trace may normalize after any tile.
//
// Not thread-safe: one object per row per thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/exp.h"
#include "kernels/geometry.h"
#include "kernels/host_device.h"
#include "kernels/lanes.h"

namespace attn {

// One thread holds the row.
struct SerialReduce {
  ATTN_HOST_DEVICE static float Max(float x) { return x; }
  ATTN_HOST_DEVICE static float Sum(float x) { return x; }
};

// The factors a merge rescales its two sides by (OnlineSoftmax::MergeInto).
struct MergeFactors {
  float mine = 0.f;    // exp(m₁ − m) for the state merged into; 0 when it saw no key.
  float theirs = 0.f;  // exp(m₂ − m) for the state merged in; 0 when it saw no key.
};

template <class Reduce>
struct OnlineSoftmax {
  float max = -INFINITY;
  float denominator = 0.f;  // This thread's share until Finish() (see above).

  // Moves the running max to cover a tile of which this thread's largest score is thread_max
  // (−inf if it holds none) and rescales the denominator. Every thread of the row calls it.
  // Returns the factor for the accumulator (RescaleAccumulator).
  ATTN_HOST_DEVICE float Rescale(float thread_max) {
    const float tile_max = Reduce::Max(thread_max);
    const float new_max = max > tile_max ? max : tile_max;
    const float rescale = (max == -INFINITY) ? 0.f : Exp(max - new_max);
    denominator *= rescale;
    max = new_max;
    return rescale;
  }

  // The weight of one score of the current tile (0 for a masked score).
  ATTN_HOST_DEVICE float Weight(float score) const {
    return score == -INFINITY ? 0.f : Exp(score - max);
  }

  // The weight of one of this thread's scores of the current tile, added to its share.
  ATTN_HOST_DEVICE float AddScore(float score) {
    const float weight = Weight(score);
    denominator += weight;
    return weight;
  }

  // acc · rescale for the `count` accumulator elements of this row that this thread holds,
  // element(i) naming the i-th (a float&). Skipped when the max did not move (rescale 1).
  template <class Element>
  ATTN_HOST_DEVICE static void RescaleAccumulator(float rescale, int count, Element&& element) {
    if (rescale == 1.f) return;
    ATTN_UNROLL
    for (int i = 0; i < count; ++i) element(i) *= rescale;
  }

  // Visits this thread's share of a tile of n scores, j = first, first + stride, … < n (the
  // other threads of the row take the rest): Rescale, then each weight written to weights[j]
  // (which may alias scores) and added to the share. Returns the rescale factor.
  ATTN_HOST_DEVICE float VisitShare(const float* scores, int64_t n, float* weights, int64_t first,
                                    int64_t stride) {
    float thread_max = -INFINITY;
    for (int64_t j = first; j < n; j += stride) {
      thread_max = scores[j] > thread_max ? scores[j] : thread_max;
    }
    const float rescale = Rescale(thread_max);
    for (int64_t j = first; j < n; j += stride) weights[j] = AddScore(scores[j]);
    return rescale;
  }

  // Visits a tile of n scores that this thread holds alone (SerialReduce): writes their weights
  // (weights may alias scores) and returns the rescale factor. On the CPU the max and the sum
  // run in lanes of a vector V — lanes::Floats (eight), or lanes::Floats16 in the AVX-512 clone —
  // combined in a fixed order, so the loops run on vector registers; on the GPU one thread walks
  // the tile.
#if defined(__CUDA_ARCH__)
  ATTN_HOST_DEVICE float VisitTile(const float* scores, int n, float* weights) {
    return VisitShare(scores, n, weights, 0, 1);
  }
#else
  template <class V = lanes::Floats>
  ATTN_HOST_DEVICE float VisitTile(const float* scores, int n, float* weights) {
    constexpr int kWidth = static_cast<int>(sizeof(V) / sizeof(float));
    const auto max_of = [](auto a, auto b) { return a > b ? a : b; };
    // The max in two chains of lanes (the loop is short, so the compare chain's latency shows).
    V lane_max = lanes::Splat<V>(-INFINITY), lane_max_odd = lane_max;
    int j = 0;
    for (; j + 2 * kWidth <= n; j += 2 * kWidth) {
      const V s = lanes::Load<V>(scores + j), s_odd = lanes::Load<V>(scores + j + kWidth);
      lane_max = s > lane_max ? s : lane_max;
      lane_max_odd = s_odd > lane_max_odd ? s_odd : lane_max_odd;
    }
    for (; j + kWidth <= n; j += kWidth) {
      const V s = lanes::Load<V>(scores + j);
      lane_max = s > lane_max ? s : lane_max;
    }
    lane_max = lane_max_odd > lane_max ? lane_max_odd : lane_max;
    float tile_max = lanes::Reduce(lane_max, max_of);
    for (; j < n; ++j) tile_max = scores[j] > tile_max ? scores[j] : tile_max;

    const float rescale = Rescale(tile_max);
    if (max == -INFINITY) {  // Every score so far is masked: no weight, and s − max is NaN.
      for (j = 0; j < n; ++j) weights[j] = 0.f;
      return rescale;
    }
    // With a finite max a masked score's s − max is −inf, whose Exp is exactly 0.
    const V max_lanes = lanes::Splat<V>(max);
    V lane_sum = lanes::Splat<V>(0.f);
    for (j = 0; j + kWidth <= n; j += kWidth) {
      const V s = lanes::Load<V>(scores + j);
      const V w = lanes::Exp(s - max_lanes);
      lanes::Store(weights + j, w);
      lane_sum += w;
    }
    float sum = lanes::Reduce(lane_sum, [](auto a, auto b) { return a + b; });
    for (; j < n; ++j) {
      weights[j] = Weight(scores[j]);
      sum += weights[j];
    }
    denominator += sum;
    return rescale;
  }
#endif

  // Merges the state of the same row over other keys (another key range, worker or server)
  // and its accumulator into this state and `accumulator` — the same rule as a tile's:
  // m = max(m₁, m₂), each side rescaled by exp(mᵢ − m) (0 for a side that saw no key), the
  // denominators added and acc[i] = acc[i] · mine + other_accumulator[i] · theirs for the `count`
  // accumulator elements this thread holds (the whole row, or one column of it). An other side
  // that saw no key (max −inf) adds nothing and leaves this one as it was: its accumulator is
  // never read, so whatever it holds stays out of the sum. Both states whole (one thread's, or
  // after Finish). Returns the two factors, for a caller that records the merge (they are
  // already applied).
  ATTN_HOST_DEVICE MergeFactors MergeInto(const OnlineSoftmax& other,
                                          const float* other_accumulator, float* accumulator,
                                          int64_t count) {
    const float new_max = max > other.max ? max : other.max;
    const MergeFactors factors{
        .mine = max == -INFINITY ? 0.f : Exp(max - new_max),
        .theirs = other.max == -INFINITY ? 0.f : Exp(other.max - new_max),
    };
    if (other.max == -INFINITY) return factors;
    denominator = denominator * factors.mine + other.denominator * factors.theirs;
    max = new_max;
    for (int64_t i = 0; i < count; ++i) {
      accumulator[i] = accumulator[i] * factors.mine + other_accumulator[i] * factors.theirs;
    }
    return factors;
  }

  // Adds the shares of the row's threads: after the last tile, once, by every thread of the row.
  ATTN_HOST_DEVICE void Finish() { denominator = Reduce::Sum(denominator); }

  // Adds an attention sink to a whole state (after Finish; every thread of the row with the
  // same sink): one more logit that takes weight but has no value — MergeInto with the state of
  // one key of score `sink` and a zero value row: m = max(m, sink), l = l · e^(m₁ − m) +
  // e^(sink − m). Returns the factor e^(m₁ − m) for the accumulator: the row's output is then
  // Normalize(acc · factor) and LogSumExp() includes the sink; a row that saw no key outputs 0
  // (factor 0) with lse = sink. sink = −inf is no sink (factor 1; 0 for a row that saw no key,
  // whose accumulator is 0 anyway).
  ATTN_HOST_DEVICE float AddSink(float sink) {
    OnlineSoftmax sink_state;
    sink_state.max = sink;
    sink_state.denominator = 1.f;
    return MergeInto(sink_state, nullptr, nullptr, 0).mine;
  }

  // The weight a row's sink took, from the row's final lse (which includes it): e^(sink − lse);
  // 0 for no sink (−inf), 1 for a row that saw no key (lse = sink).
  ATTN_HOST_DEVICE static float SinkShare(float sink, float lse) {
    return sink == -INFINITY ? 0.f : expf(sink - lse);
  }

  // One component of the current estimate (or of the final output): acc / l, 0 when l is 0.
  ATTN_HOST_DEVICE float Normalize(float accumulator) const {
    return denominator > 0.f ? accumulator / denominator : 0.f;
  }

  // Natural log of Σ exp(s) over every score visited; −inf when none was visible.
  ATTN_HOST_DEVICE float LogSumExp() const {
    return denominator > 0.f ? max + logf(denominator) : -INFINITY;
  }
};

// The state of a row one thread holds: CPU Tiled and Trace, the CUDA trace's steps.
using OnlineSoftmaxRow = OnlineSoftmax<SerialReduce>;

// The full-row stable softmax, Naive's W = softmax(S) and every trace's reference: the row's
// `visible` scores as a single tile, the sink added (AddSink; −inf: none), each weight then
// divided by the denominator (by one multiplication with its inverse); the other weights of the
// row's n are 0 (with a sink the weights sum to 1 − its share). The caller's threads share the
// row as in VisitShare (first, stride). Returns the finished state (for LogSumExp). On the CPU,
// Lanes picks VisitTile's vector (void: its default, eight lanes).
template <class Reduce, class Lanes = void>
ATTN_HOST_DEVICE OnlineSoftmax<Reduce> SoftmaxRow(const float* scores, float* weights, int64_t n,
                                                  KeyRange visible, float sink, int64_t first,
                                                  int64_t stride) {
  OnlineSoftmax<Reduce> row;
  const int64_t count = visible.size();
  const float* s = scores + visible.begin;
  float* w = weights + visible.begin;
#if !defined(__CUDA_ARCH__)
  if (first == 0 && stride == 1) {  // One CPU thread: the vector code.
    if constexpr (std::is_void_v<Lanes>) {
      row.VisitTile(s, static_cast<int>(count), w);
    } else {
      row.template VisitTile<Lanes>(s, static_cast<int>(count), w);
    }
  } else {
    row.VisitShare(s, count, w, first, stride);
  }
#else
  row.VisitShare(s, count, w, first, stride);
#endif
  row.Finish();
  const float factor = row.AddSink(sink);
  const float inverse = count > 0 && row.denominator > 0.f ? factor / row.denominator : 0.f;
  for (int64_t j = first; j < count; j += stride) w[j] *= inverse;
  for (int64_t j = first; j < visible.begin; j += stride) weights[j] = 0.f;
  for (int64_t j = visible.end + first; j < n; j += stride) weights[j] = 0.f;
  return row;
}

}  // namespace attn
