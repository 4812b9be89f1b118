#include "kernels/cpu/kv_tile.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/lanes.h"

namespace attn {
namespace {

constexpr int kPanel = kTilePanel;
using Floats8 = lanes::Floats;

// The kernels three times: for the portable baseline, for AVX2 + FMA and for AVX-512, the last
// two inside pragma regions (a per-function target attribute is not enough: GCC then builds each
// broadcast from four inserts instead of one vbroadcastss, and the kernels run at half speed).
// Register blocks: 6 query rows × 16 keys in 8-float lanes (12 accumulators + 2 panel halves of
// the 16 AVX registers); 12 rows × 32 keys (two panels) in 16-float lanes (24 + 2 of the 32
// AVX-512 ones: each key panel loaded once per dimension serves twice the rows, and each
// broadcast two FMAs).
namespace portable {
using Floats = lanes::Floats;
constexpr int kLanes = 8;
constexpr int kRows = 6;
constexpr int kBlockPanels = 1;
#include "kernels/cpu/kv_tile_kernels.inc"
}  // namespace portable

#if defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
namespace avx2 {
using Floats = lanes::Floats;
constexpr int kLanes = 8;
constexpr int kRows = 6;
constexpr int kBlockPanels = 1;
#include "kernels/cpu/kv_tile_kernels.inc"
}  // namespace avx2
#pragma clang attribute pop
#pragma clang attribute push( \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))), apply_to = function)
namespace avx512 {
using Floats = lanes::Floats16;
constexpr int kLanes = 16;
constexpr int kRows = 12;
constexpr int kBlockPanels = 2;
#include "kernels/cpu/kv_tile_kernels.inc"
}  // namespace avx512
#pragma clang attribute pop
#define ATTN_KV_TILE_X86 1
#elif defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using Floats = lanes::Floats;
constexpr int kLanes = 8;
constexpr int kRows = 6;
constexpr int kBlockPanels = 1;
#include "kernels/cpu/kv_tile_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
using Floats = lanes::Floats16;
constexpr int kLanes = 16;
constexpr int kRows = 12;
constexpr int kBlockPanels = 2;
#include "kernels/cpu/kv_tile_kernels.inc"
}  // namespace avx512
#pragma GCC pop_options
#define ATTN_KV_TILE_X86 1
#endif

}  // namespace

void KvTile::Load(const float* keys, const float* values, int n, int head_dim, int value_dim,
                  float scale, int value_stride) {
  if (value_stride <= 0) value_stride = value_dim;
  n_ = n;
  head_dim_ = head_dim;
  stride_ = AccStride(value_dim);
  keys_.resize(static_cast<size_t>((n + kPanel - 1) / kPanel) * head_dim * kPanel);
  values_.resize(static_cast<size_t>(n) * stride_);
#if defined(ATTN_KV_TILE_X86)
  if (CpuHasAvx512()) {
    avx512::PackKeys(keys, n, head_dim, scale, keys_.data());
    avx512::PackValues(values, n, value_dim, value_stride, values_.data());
    return;
  }
  if (CpuHasAvx2Fma()) {
    avx2::PackKeys(keys, n, head_dim, scale, keys_.data());
    avx2::PackValues(values, n, value_dim, value_stride, values_.data());
    return;
  }
#endif
  portable::PackKeys(keys, n, head_dim, scale, keys_.data());
  portable::PackValues(values, n, value_dim, value_stride, values_.data());
}

void KvTile::Scores(const float* queries, int m, float* scores) const {
#if defined(ATTN_KV_TILE_X86)
  if (CpuHasAvx512()) return avx512::Scores(queries, m, head_dim_, keys_.data(), n_, scores);
  if (CpuHasAvx2Fma()) return avx2::Scores(queries, m, head_dim_, keys_.data(), n_, scores);
#endif
  portable::Scores(queries, m, head_dim_, keys_.data(), n_, scores);
}

void KvTile::Accumulate(const float* weights, int m, float* acc) const {
#if defined(ATTN_KV_TILE_X86)
  if (CpuHasAvx512()) return avx512::Accumulate(weights, m, n_, values_.data(), stride_, acc);
  if (CpuHasAvx2Fma()) return avx2::Accumulate(weights, m, n_, values_.data(), stride_, acc);
#endif
  portable::Accumulate(weights, m, n_, values_.data(), stride_, acc);
}

}  // namespace attn
