// KeyTile: the two matrix products of one key tile on the CPU — scores = scale · Q·Kᵀ and
// acc += W·V — for Tiled and Trace alike, so that a traced row is computed exactly as Tiled
// computes it.
//
// Vector kernels of our own rather than BLAS calls: the shapes are small and skinny (a block of
// query rows × a tile of keys × head_dim), where a BLAS call's packing and dispatch cost a large
// share (docs/perf.md). Load packs the keys transposed into panels of 16 (so a score block is
// 6 query rows × 16 keys held in 12 registers, one broadcast and two FMAs per row and dimension)
// and pads the values to whole panels. Each output element is summed in a fixed order (over
// head_dim, then over the tile's keys) whatever the number of rows computed together, so the
// results do not depend on the block size, the thread count or Tiled versus Trace. Dispatched
// at run time: AVX2 + FMA where the CPU has both, the portable baseline elsewhere.
#pragma once

#include <cstdint>
#include <vector>

namespace attn {

class KeyTile {
 public:
  static constexpr int kPanel = 16;  // Keys per packed panel; value columns per block.

  // Row stride of an accumulator for value_dim columns: rounded up to a whole panel.
  static int AccStride(int value_dim) { return (value_dim + kPanel - 1) / kPanel * kPanel; }

  // Takes the tile's n keys [n, head_dim] and values [n, value_dim], fp32 rows, and the softmax
  // scale (folded into the packed keys: exact for a power of two such as 1/√64). The values are
  // used in place when value_dim is a multiple of kPanel: they must then outlive Accumulate.
  void Load(const float* keys, const float* values, int n, int head_dim, int value_dim,
            float scale);

  // scores [m, n] (row stride n) = queries [m, head_dim] · (scale · keys)ᵀ.
  void Scores(const float* queries, int m, float* scores) const;

  // acc [m, AccStride(value_dim)] += weights [m, n] (row stride n) · values.
  void Accumulate(const float* weights, int m, float* acc) const;

  int64_t scratch_bytes() const {
    return static_cast<int64_t>((keys_.capacity() + values_.capacity()) * sizeof(float));
  }

 private:
  int n_ = 0, head_dim_ = 0, stride_ = 0;
  std::vector<float> keys_;    // [panel][head_dim][kPanel]: Kᵀ, zero past the tile's last key.
  std::vector<float> values_;  // [n][stride_]: V, zero past value_dim, when it needs padding.
  const float* values_view_ = nullptr;  // The values Accumulate reads: the caller's or values_.
};

}  // namespace attn
