#include "tests/simt/mma.h"

#include <cstdint>

#include "kernels/dtype.h"

namespace simt::mma {
namespace {

constexpr int kLanes = 32;
constexpr int kM = 16;
constexpr int kN = 8;
constexpr int kK = 16;

// Half h (0 = low) of a packed register, widened. Both formats fit float64 exactly, and so does
// any product of two of them, which is what lets the sum below stand for exact products.
double Element(Type type, uint32_t packed, int h) {
  const uint16_t bits = static_cast<uint16_t>(h == 0 ? packed & 0xffffu : packed >> 16);
  return type == Type::kF16 ? attn::HalfToFloat(bits) : attn::BFloat16ToFloat(bits);
}

float ToFloat(double value) {
  const float rounded = static_cast<float>(value);
  // One NaN pattern whatever the inputs' payloads, so that runs compare bit for bit.
  return rounded != rounded ? attn::BitsToFloat(0x7fffffffu) : rounded;
}

}  // namespace

void M16n8k16(Type type, const uint32_t (*a)[4], const uint32_t (*b)[2], const float (*c)[4],
              float (*d)[4]) {
  // Gather the warp's registers into whole matrices first: d may alias c, and every output
  // depends on registers of other lanes.
  double a_matrix[kM][kK], b_matrix[kK][kN], c_matrix[kM][kN];
  for (int lane = 0; lane < kLanes; ++lane) {
    const int group = lane / 4;
    const int tig = lane % 4;
    for (int r = 0; r < 4; ++r) {
      for (int h = 0; h < 2; ++h) {
        a_matrix[group + 8 * (r & 1)][2 * tig + 8 * (r >> 1) + h] = Element(type, a[lane][r], h);
      }
    }
    for (int r = 0; r < 2; ++r) {
      for (int h = 0; h < 2; ++h)
        b_matrix[2 * tig + 8 * r + h][group] = Element(type, b[lane][r], h);
    }
    for (int e = 0; e < 4; ++e) c_matrix[group + 8 * (e >> 1)][2 * tig + (e & 1)] = c[lane][e];
  }

  double d_matrix[kM][kN];
  for (int m = 0; m < kM; ++m) {
    for (int n = 0; n < kN; ++n) {
      // Starting from the first product rather than +0 keeps the sign of an all −0 sum.
      double sum = a_matrix[m][0] * b_matrix[0][n];
      for (int k = 1; k < kK; ++k) sum += a_matrix[m][k] * b_matrix[k][n];
      d_matrix[m][n] = sum + c_matrix[m][n];
    }
  }

  for (int lane = 0; lane < kLanes; ++lane) {
    for (int e = 0; e < 4; ++e) {
      d[lane][e] = ToFloat(d_matrix[lane / 4 + 8 * (e >> 1)][2 * (lane % 4) + (e & 1)]);
    }
  }
}

}  // namespace simt::mma
