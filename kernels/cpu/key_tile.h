// The two matrix products of one key tile on the CPU — scores = scale · Q·Kᵀ (TileKeys) and
// acc += W·V (TileValues) — for Tiled and Trace alike, so that a traced row is computed exactly
// as Tiled computes it.
//
// Vector kernels of our own rather than BLAS calls: the shapes are small and skinny (a block of
// query rows × a tile of keys × head_dim), where a BLAS call's packing and dispatch cost a large
// share (docs/perf.md). TileKeys packs the keys transposed into panels of 16 (so a score block is
// 6 query rows × 16 keys held in 12 registers, one broadcast and two FMAs per row and dimension)
// and TileValues pads the values to whole panels. Each output element is summed in a fixed order
// (over head_dim, then over the tile's keys) whatever the number of rows computed together, so the
// results do not depend on the block size, the thread count or Tiled versus Trace. Dispatched
// at run time: AVX2 + FMA where the CPU has both, the portable baseline elsewhere.
#pragma once

#include <cstdint>
#include <vector>

namespace attn {

// Keys per packed panel, and value columns per accumulator block.
inline constexpr int kTilePanel = 16;

// Row stride of an accumulator for value_dim columns: rounded up to a whole panel.
inline int AccStride(int value_dim) {
  return (value_dim + kTilePanel - 1) / kTilePanel * kTilePanel;
}

// A tile's keys, packed for Scores. Tiled keeps a head's packed tiles for all of its row blocks.
class TileKeys {
 public:
  // Takes the tile's n keys [n, head_dim], fp32 rows, and the softmax scale (folded into the
  // packed keys: exact for a power of two such as 1/√64).
  void Load(const float* keys, int n, int head_dim, float scale);

  // scores [m, n] (row stride n) = queries [m, head_dim] · (scale · keys)ᵀ.
  void Scores(const float* queries, int m, float* scores) const;

  int n() const { return n_; }
  int64_t scratch_bytes() const { return static_cast<int64_t>(keys_.capacity() * sizeof(float)); }

 private:
  int n_ = 0, head_dim_ = 0;
  std::vector<float> keys_;  // [panel][head_dim][kTilePanel]: Kᵀ, zero past the tile's last key.
};

// A tile's values, for Accumulate.
class TileValues {
 public:
  // Takes the tile's n values [n, value_dim], fp32 rows. They are used in place when value_dim
  // is a multiple of kTilePanel: they must then outlive Accumulate.
  void Load(const float* values, int n, int value_dim);

  // acc [m, AccStride(value_dim)] += weights [m, n] (row stride n) · values.
  void Accumulate(const float* weights, int m, float* acc) const;

  int64_t scratch_bytes() const { return static_cast<int64_t>(values_.capacity() * sizeof(float)); }

 private:
  int n_ = 0, stride_ = 0;
  std::vector<float> values_;  // [n][stride_]: V, zero past value_dim, when it needs padding.
  const float* values_view_ = nullptr;  // The values Accumulate reads: the caller's or values_.
};

}  // namespace attn
