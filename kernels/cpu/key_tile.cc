#include "kernels/cpu/key_tile.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/online_softmax.h"

namespace attn {
namespace {

constexpr int kPanel = kTilePanel;
constexpr int kRows = 6;  // Query rows per register block: 12 accumulators + 2 panel halves.
using lanes::Floats;

// The kernels twice: for the portable baseline, and for AVX2 + FMA inside a pragma region (a
// per-function target attribute is not enough: GCC then builds each broadcast from four inserts
// instead of one vbroadcastss, and the kernels run at half speed).
namespace portable {
#include "kernels/cpu/key_tile_kernels.inc"
}  // namespace portable

#if defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
namespace avx2 {
#include "kernels/cpu/key_tile_kernels.inc"
}  // namespace avx2
#pragma clang attribute pop
#define ATTN_KEY_TILE_AVX2 1
#elif defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "kernels/cpu/key_tile_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options
#define ATTN_KEY_TILE_AVX2 1
#endif

}  // namespace

void TileKeys::Load(const float* keys, int n, int head_dim, float scale) {
  n_ = n;
  head_dim_ = head_dim;
  keys_.resize(static_cast<size_t>((n + kPanel - 1) / kPanel) * head_dim * kPanel);
#if defined(ATTN_KEY_TILE_AVX2)
  if (CpuHasAvx2Fma()) {
    avx2::PackKeys(keys, n, head_dim, scale, keys_.data());
  } else {
    portable::PackKeys(keys, n, head_dim, scale, keys_.data());
  }
#else
  portable::PackKeys(keys, n, head_dim, scale, keys_.data());
#endif
}

void TileKeys::Scores(const float* queries, int m, float* scores) const {
#if defined(ATTN_KEY_TILE_AVX2)
  if (CpuHasAvx2Fma()) return avx2::Scores(queries, m, head_dim_, keys_.data(), n_, scores);
#endif
  portable::Scores(queries, m, head_dim_, keys_.data(), n_, scores);
}

void TileValues::Load(const float* values, int n, int value_dim) {
  n_ = n;
  stride_ = AccStride(value_dim);
  if (value_dim == stride_) {  // Already whole panels: used in place.
    values_view_ = values;
    return;
  }
  values_.resize(static_cast<size_t>(n) * stride_);
  for (int j = 0; j < n; ++j) {
    float* row = values_.data() + static_cast<size_t>(j) * stride_;
    std::copy(values + static_cast<size_t>(j) * value_dim,
              values + static_cast<size_t>(j + 1) * value_dim, row);
    std::fill(row + value_dim, row + stride_, 0.f);
  }
  values_view_ = values_.data();
}

void TileValues::Accumulate(const float* weights, int m, float* acc) const {
#if defined(ATTN_KEY_TILE_AVX2)
  if (CpuHasAvx2Fma()) return avx2::Accumulate(weights, m, n_, values_view_, stride_, acc);
#endif
  portable::Accumulate(weights, m, n_, values_view_, stride_, acc);
}

}  // namespace attn
