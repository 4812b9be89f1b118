// KvTile: the two matrix products of one tile of keys and values on the CPU — scores =
// scale · Q·Kᵀ and acc += W·V — for Tiled and Trace alike, so that a traced row is computed
// exactly as Tiled computes it.
//
// Vector kernels of our own rather than BLAS calls: the shapes are small and skinny (a block of
// query rows × a tile of keys × head_dim), where a BLAS call's packing and dispatch cost a large
// share (docs/perf.md). Load packs the keys transposed into panels of 16 (so a score block is
// 6 query rows × 16 keys held in 12 AVX registers, one broadcast and two FMAs per row and
// dimension; under AVX-512 12 rows × two panels in 24 registers, one broadcast and two FMAs per
// row and dimension) and the values into column panels of 16, each contiguous (a block of acc
// is 6 rows × 16 columns or 12 rows × 32, read in order as the keys go by). Each output element
// is summed in a fixed order (over head_dim, then over the tile's keys) whatever the number of rows
// computed together, so the results do not depend on the block size, the thread count or Tiled
// versus Trace. Dispatched at run time (cpu_dispatch.h): AVX-512, else AVX2 + FMA, else the
// portable baseline.
#pragma once

#include <cstdint>

#include "kernels/cpu/aligned.h"

namespace attn {

// Keys per packed panel, and value columns per accumulator block.
inline constexpr int kTilePanel = 16;

// Row stride of an accumulator for value_dim columns: rounded up to a whole panel.
inline int AccStride(int value_dim) {
  return (value_dim + kTilePanel - 1) / kTilePanel * kTilePanel;
}

// One tile's keys and values, packed for the two products. Tiled keeps a head's packed
// tiles for all the head's row blocks a worker runs (tiled.cc).
class KvTile {
 public:
  // Packs the tile's n keys [n, head_dim] and values [n, value_dim] (rows value_stride apart;
  // ≤ 0: value_dim), fp32 rows, with the softmax scale folded into the keys (exact for a power
  // of two such as 1/√64). Copies both: the inputs may be freed or reused afterwards. A latent
  // cache's values are its keys' first columns: values = keys, value_stride = head_dim.
  void Load(const float* keys, const float* values, int n, int head_dim, int value_dim, float scale,
            int value_stride = 0);

  // scores [m, n] (row stride n) = queries [m, head_dim] · (scale · keys)ᵀ.
  void Scores(const float* queries, int m, float* scores) const;

  // acc [m, AccStride(value_dim)] += weights [m, n] (row stride n) · values.
  void Accumulate(const float* weights, int m, float* acc) const;

  // Bytes Load packs for a tile of n keys.
  static int64_t PackedBytes(int n, int head_dim, int value_dim) {
    return int64_t{(n + kTilePanel - 1) / kTilePanel * kTilePanel} *
           (head_dim + AccStride(value_dim)) * int64_t{sizeof(float)};
  }

  int64_t scratch_bytes() const {
    return static_cast<int64_t>((keys_.capacity() + values_.capacity()) * sizeof(float));
  }

 private:
  int n_ = 0, head_dim_ = 0, stride_ = 0;
  AlignedVector<float> keys_;  // [panel][head_dim][kTilePanel]: Kᵀ, zero past the tile's last key.
  AlignedVector<float> values_;  // [column panel][n][kTilePanel]: V, zero past value_dim.
};

}  // namespace attn
