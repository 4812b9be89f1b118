// The online-softmax update step: the one piece of math that Tiled, Trace and (later) the CUDA
// kernels share, so that what a trace shows is exactly what Tiled computes.
//
// State of one query row: a running max m, a running denominator l and an accumulator
// acc[value_dim] (owned by the caller, whose memory layout varies). Visiting a tile of scores
// s (already scaled; −inf where masked):
//
//   m'      = max(m, max(s))
//   rescale = exp(m − m')          0 when m is −inf (the first tile): never −inf − (−inf)
//   w_j     = exp(s_j − m')        0 when s_j is −inf
//   l'      = l · rescale + Σ w_j
//   acc'    = acc · rescale + Σ w_j · V_j      (the caller's part, with Rescale's return value)
//
// At the end: output = acc / l (0 when l is 0: the row saw no key), lse = m + log(l) (−inf
// when l is 0). Because every weight is taken relative to the running max, no exp ever sees
// a positive argument and nothing overflows however large the scores grow.
#pragma once

#include <cmath>

#include "kernels/host_device.h"

namespace attn {

struct OnlineSoftmaxRow {
  float max = -INFINITY;
  float denominator = 0.f;

  // Moves the running max to cover a tile whose largest score is tile_max and rescales the
  // denominator. Returns the factor the caller must apply to its accumulator.
  ATTN_HOST_DEVICE float Rescale(float tile_max) {
    const float new_max = fmaxf(max, tile_max);
    const float rescale = (max == -INFINITY) ? 0.f : expf(max - new_max);
    denominator *= rescale;
    max = new_max;
    return rescale;
  }

  // The weight of one score of the current tile (0 for a masked score).
  ATTN_HOST_DEVICE float Weight(float score) const {
    return score == -INFINITY ? 0.f : expf(score - max);
  }

  // Visits a tile of n scores: writes their weights (weights may alias scores) and returns the
  // rescale factor for the accumulator. The caller then sets acc = acc · rescale + Σ w_j · V_j.
  ATTN_HOST_DEVICE float VisitTile(const float* scores, int n, float* weights) {
    float tile_max = -INFINITY;
    for (int j = 0; j < n; ++j) tile_max = fmaxf(tile_max, scores[j]);
    const float rescale = Rescale(tile_max);
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
      weights[j] = Weight(scores[j]);
      sum += weights[j];
    }
    denominator += sum;
    return rescale;
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

}  // namespace attn
