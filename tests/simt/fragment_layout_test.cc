// The emulated m16n8k16 MMA (tests/simt/mma.h) checked from outside against the PTX ISA's
// fragment tables, and the fp16/bf16 headers it is fed through.
//
// The tables are transcribed here from the PTX ISA itself, not taken from mma.cc, so a mistake
// in mma.cc's mapping cannot hide behind the same mistake in the test. Known matrices are
// scattered into the 32 lanes' registers by the tables (packed with the headers'
// __floats2half2_rn / __floats2bfloat162_rn, as the kernels' Pack<T> does), M16n8k16 runs, D is
// gathered by the accumulator table and compared with a float64 matmul. One-hot inputs name the
// element each lane/register/half holds; random odd-valued ones check every position at once
// (small odd integers keep every sum exact, so the comparison is exact). Deliberately wrong
// tables must make that comparison fail, which shows it can.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/simt/mma.h"

namespace {

using simt::mma::M16n8k16;
using simt::mma::Type;

constexpr int kLanes = 32;
constexpr int kM = 16;
constexpr int kN = 8;
constexpr int kK = 16;

// --- The PTX ISA's tables ---------------------------------------------------------------------
// PTX ISA §9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type"
// (docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float),
// Figure 79 (A, .f16/.bf16), Figure 81 (B, .f16/.bf16), Figure 83 (C/D, .f32). Written in the
// page's own terms (element index i, groupID, threadID_in_group) so each line can be read
// against it. Its "Elements (low to high)" column packs A's a0..a7 and B's b0..b3 two to an
// .f16x2 register, the lower index in the low half: element i is register i / 2, half i % 2.
struct Coord {
  int row, col;
  bool operator==(const Coord&) const = default;
};

void PrintTo(const Coord& c, std::ostream* os) { *os << "(" << c.row << ", " << c.col << ")"; }

// groupID = %laneid >> 2, threadID_in_group = %laneid % 4;
// row = groupID for ai where 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
// col = (threadID_in_group * 2) + (i & 0x1) for ai where i < 4, the same + 8 for i >= 4.
Coord PtxA(int lane, int i) {
  const int group_id = lane >> 2;
  const int thread_id_in_group = lane % 4;
  const int row = ((0 <= i && i < 2) || (4 <= i && i < 6)) ? group_id : group_id + 8;
  const int col =
      i < 4 ? (thread_id_in_group * 2) + (i & 0x1) : (thread_id_in_group * 2) + (i & 0x1) + 8;
  return {row, col};
}

// row = (threadID_in_group * 2) + (i & 0x1) for bi where i < 2, the same + 8 for i >= 2;
// col = groupID.
Coord PtxB(int lane, int i) {
  const int group_id = lane >> 2;
  const int thread_id_in_group = lane % 4;
  const int row =
      i < 2 ? (thread_id_in_group * 2) + (i & 0x1) : (thread_id_in_group * 2) + (i & 0x1) + 8;
  return {row, group_id};
}

// row = groupID for ci where i < 2, groupID + 8 for i >= 2;
// col = (threadID_in_group * 2) + (i & 0x1) for ci where i = {0,..,3}.
Coord PtxC(int lane, int i) {
  const int group_id = lane >> 2;
  const int thread_id_in_group = lane % 4;
  return {i < 2 ? group_id : group_id + 8, (thread_id_in_group * 2) + (i & 0x1)};
}

// Where each element of A (i = 0..7), B (i = 0..3) and C/D (i = 0..3) sits, per lane.
struct Layout {
  Coord (*a)(int lane, int i);
  Coord (*b)(int lane, int i);
  Coord (*c)(int lane, int i);
};

constexpr Layout kPtx{PtxA, PtxB, PtxC};

// Mistakes a hand-written mapping plausibly makes: halves of a register exchanged; A's
// registers 1 and 2 exchanged (rows +8 taken for columns +8); C's c1 and c2 exchanged.
Coord SwappedHalvesA(int lane, int i) { return PtxA(lane, i ^ 1); }
Coord SwappedHalvesB(int lane, int i) { return PtxB(lane, i ^ 1); }
Coord SwappedRegistersA(int lane, int i) {
  const int r = i / 2;
  return PtxA(lane, r == 1 ? i + 2 : r == 2 ? i - 2 : i);
}
Coord SwappedElementsC(int lane, int i) { return PtxC(lane, i == 1 ? 2 : i == 2 ? 1 : i); }

// --- Matrices, registers and the reference ------------------------------------------------------
struct Matrices {
  double a[kM][kK] = {};
  double b[kK][kN] = {};
  double c[kM][kN] = {};
};

struct Warp {
  uint32_t a[kLanes][4] = {};
  uint32_t b[kLanes][2] = {};
  float c[kLanes][4] = {};
  float d[kLanes][4] = {};
};

// Two values as one register, the first in the low half, the way the kernels' Pack<T> makes it.
uint32_t Pack(Type type, double low, double high) {
  if (type == Type::kF16) {
    return std::bit_cast<uint32_t>(
        __floats2half2_rn(static_cast<float>(low), static_cast<float>(high)));
  }
  return std::bit_cast<uint32_t>(
      __floats2bfloat162_rn(static_cast<float>(low), static_cast<float>(high)));
}

// A register holding `value` in half h and zero in the other.
uint32_t OneHalf(Type type, int h, double value) {
  return h == 0 ? Pack(type, value, 0) : Pack(type, 0, value);
}

Warp Scatter(const Layout& layout, Type type, const Matrices& m) {
  Warp w;
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int r = 0; r < 4; ++r) {
      const Coord low = layout.a(lane, 2 * r), high = layout.a(lane, 2 * r + 1);
      w.a[lane][r] = Pack(type, m.a[low.row][low.col], m.a[high.row][high.col]);
    }
    for (int r = 0; r < 2; ++r) {
      const Coord low = layout.b(lane, 2 * r), high = layout.b(lane, 2 * r + 1);
      w.b[lane][r] = Pack(type, m.b[low.row][low.col], m.b[high.row][high.col]);
    }
    for (int i = 0; i < 4; ++i) {
      const Coord at = layout.c(lane, i);
      w.c[lane][i] = static_cast<float>(m.c[at.row][at.col]);
    }
  }
  return w;
}

struct Output {
  double d[kM][kN] = {};
};

Output Gather(const Layout& layout, const Warp& w) {
  Output out;
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const Coord at = layout.c(lane, i);
      out.d[at.row][at.col] = w.d[lane][i];
    }
  }
  return out;
}

Output MmaAndGather(Type type, Warp& w) {
  M16n8k16(type, w.a, w.b, w.c, w.d);
  return Gather(kPtx, w);
}

Output Reference(const Matrices& m) {
  Output out;
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kN; ++j) {
      double sum = m.c[i][j];
      for (int k = 0; k < kK; ++k) sum += m.a[i][k] * m.b[k][j];
      out.d[i][j] = sum;
    }
  }
  return out;
}

// Whether every output is within `tolerance` of the reference (0: exactly equal).
bool Matches(const Output& got, const Output& want, double tolerance) {
  for (int i = 0; i < kM; ++i) {
    for (int j = 0; j < kN; ++j) {
      if (!(std::abs(got.d[i][j] - want.d[i][j]) <= tolerance)) return false;
    }
  }
  return true;
}

// Odd integers: no accidental zeros that would let a misplaced element go unnoticed, and small
// enough (|a·b| ≤ 225, 16 terms) that fp16, bf16 (8-bit significands) and fp32 hold every value
// and every partial sum exactly.
Matrices RandomOdd(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-7, 7), large(-49, 49);
  Matrices m;
  for (auto& row : m.a)
    for (double& x : row) x = 2 * small(rng) + 1;
  for (auto& row : m.b)
    for (double& x : row) x = 2 * small(rng) + 1;
  for (auto& row : m.c)
    for (double& x : row) x = 2 * large(rng) + 1;
  return m;
}

// The value a float takes once stored in the type.
double RoundTo(Type type, double x) {
  return type == Type::kF16 ? __half2float(__float2half_rn(static_cast<float>(x)))
                            : __bfloat162float(__float2bfloat16_rn(static_cast<float>(x)));
}

std::string TypeName(const testing::TestParamInfo<Type>& info) {
  return info.param == Type::kF16 ? "F16" : "BF16";
}

// --- The transcription itself -------------------------------------------------------------------
// Each table must place every element of its matrix exactly once, or the tests below would
// check only part of the instruction.
TEST(PtxTables, EveryElementOnce) {
  int a_count[kM][kK] = {}, b_count[kK][kN] = {}, c_count[kM][kN] = {};
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 8; ++i) ++a_count[PtxA(lane, i).row][PtxA(lane, i).col];
    for (int i = 0; i < 4; ++i) ++b_count[PtxB(lane, i).row][PtxB(lane, i).col];
    for (int i = 0; i < 4; ++i) ++c_count[PtxC(lane, i).row][PtxC(lane, i).col];
  }
  for (const auto& row : a_count)
    for (int n : row) EXPECT_EQ(n, 1);
  for (const auto& row : b_count)
    for (int n : row) EXPECT_EQ(n, 1);
  for (const auto& row : c_count)
    for (int n : row) EXPECT_EQ(n, 1);
}

// --- The MMA against the tables -----------------------------------------------------------------
class FragmentLayout : public testing::TestWithParam<Type> {};

// A one-hot A (a single 1 in one lane's register half, written without any table) times a B
// whose entries are all distinct: D's only nonzero row is the 1's row in A, and its values are
// the B row of the 1's column. Reading them back names the element that half holds.
TEST_P(FragmentLayout, OneHotANamesEachElement) {
  const Type type = GetParam();
  Matrices m;
  for (int k = 0; k < kK; ++k)
    for (int n = 0; n < kN; ++n) m.b[k][n] = 1 + k * kN + n;  // 1..128: exact in both types.
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 8; ++i) {
      Warp w = Scatter(kPtx, type, m);  // B by the table; A and C all zeros.
      w.a[lane][i / 2] = OneHalf(type, i % 2, 1.0);
      const Output out = MmaAndGather(type, w);
      std::vector<Coord> found;  // (row of D, row of B it equals) for each nonzero row.
      for (int r = 0; r < kM; ++r) {
        bool nonzero = false;
        for (int n = 0; n < kN; ++n) nonzero = nonzero || out.d[r][n] != 0;
        if (!nonzero) continue;
        Coord element{r, -1};
        for (int k = 0; k < kK; ++k) {
          bool equal = true;
          for (int n = 0; n < kN; ++n) equal = equal && out.d[r][n] == m.b[k][n];
          if (equal) element.col = k;
        }
        found.push_back(element);
      }
      EXPECT_EQ(found, std::vector<Coord>{PtxA(lane, i)}) << "lane " << lane << " a" << i;
    }
  }
}

// The same for B: A's entries distinct, one B half set; D's only nonzero column is the 1's
// column, holding the A column of the 1's row.
TEST_P(FragmentLayout, OneHotBNamesEachElement) {
  const Type type = GetParam();
  Matrices m;
  for (int r = 0; r < kM; ++r)
    for (int k = 0; k < kK; ++k) m.a[r][k] = 1 + r * kK + k;  // 1..256: exact in both types.
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      Warp w = Scatter(kPtx, type, m);  // A by the table; B and C all zeros.
      w.b[lane][i / 2] = OneHalf(type, i % 2, 1.0);
      const Output out = MmaAndGather(type, w);
      std::vector<Coord> found;  // (column of A it equals, column of D) for each nonzero column.
      for (int n = 0; n < kN; ++n) {
        bool nonzero = false;
        for (int r = 0; r < kM; ++r) nonzero = nonzero || out.d[r][n] != 0;
        if (!nonzero) continue;
        Coord element{-1, n};
        for (int k = 0; k < kK; ++k) {
          bool equal = true;
          for (int r = 0; r < kM; ++r) equal = equal && out.d[r][n] == m.a[r][k];
          if (equal) element.row = k;
        }
        found.push_back(element);
      }
      EXPECT_EQ(found, std::vector<Coord>{PtxB(lane, i)}) << "lane " << lane << " b" << i;
    }
  }
}

// D's registers, read raw: A·B = 16·row + column + 1 (A = [row, 1, 1, 0…], B's first rows
// [16…], [column…], [1…]) gives each element of D its own value, 1..248, exact in both types.
TEST_P(FragmentLayout, EachAccumulatorNamesItsElement) {
  const Type type = GetParam();
  Matrices m;
  for (int r = 0; r < kM; ++r) {
    m.a[r][0] = r;
    m.a[r][1] = 1;
    m.a[r][2] = 1;
  }
  for (int n = 0; n < kN; ++n) {
    m.b[0][n] = 16;
    m.b[1][n] = n;
    m.b[2][n] = 1;
  }
  Warp w = Scatter(kPtx, type, m);
  M16n8k16(type, w.a, w.b, w.c, w.d);
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const float value = w.d[lane][i];
      ASSERT_TRUE(value >= 1 && value <= 248 && value == std::floor(value)) << value;
      const int code = static_cast<int>(value) - 1;
      EXPECT_EQ((Coord{code / 16, code % 16}), PtxC(lane, i)) << "lane " << lane << " d" << i;
    }
  }
}

// C in, D out, same place: A·B = 0 leaves D = C bit for bit, one-hot register by register.
TEST_P(FragmentLayout, OneHotCComesBackInPlace) {
  const Type type = GetParam();
  for (int lane = 0; lane < kLanes; ++lane) {
    for (int i = 0; i < 4; ++i) {
      Warp w;
      w.c[lane][i] = 3.5f;
      M16n8k16(type, w.a, w.b, w.c, w.d);
      for (int l = 0; l < kLanes; ++l) {
        for (int e = 0; e < 4; ++e) EXPECT_EQ(w.d[l][e], l == lane && e == i ? 3.5f : 0.f);
      }
    }
  }
}

TEST_P(FragmentLayout, RandomOddMatricesExactly) {
  const Type type = GetParam();
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const Matrices m = RandomOdd(seed);
    Warp w = Scatter(kPtx, type, m);
    EXPECT_TRUE(Matches(MmaAndGather(type, w), Reference(m), 0)) << "seed " << seed;
  }
}

// The kernels' own call: d is c (Mma<T> accumulates in place).
TEST_P(FragmentLayout, AccumulatesInPlace) {
  const Type type = GetParam();
  const Matrices m = RandomOdd(77);
  Warp w = Scatter(kPtx, type, m);
  M16n8k16(type, w.a, w.b, w.c, w.c);
  for (int lane = 0; lane < kLanes; ++lane)
    for (int i = 0; i < 4; ++i) w.d[lane][i] = w.c[lane][i];
  EXPECT_TRUE(Matches(Gather(kPtx, w), Reference(m), 0));
}

// Values with full significands, where fp32 can no longer hold the sums exactly: within a few
// fp32 ulps of the float64 result (of the terms' magnitude, as any fp32 accumulation).
TEST_P(FragmentLayout, RandomFractionalMatricesClosely) {
  const Type type = GetParam();
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> uniform(-2, 2);
  for (int trial = 0; trial < 20; ++trial) {
    Matrices m;
    for (auto& row : m.a)
      for (double& x : row) x = RoundTo(type, uniform(rng));
    for (auto& row : m.b)
      for (double& x : row) x = RoundTo(type, uniform(rng));
    for (auto& row : m.c)
      for (double& x : row) x = static_cast<float>(uniform(rng));
    Warp w = Scatter(kPtx, type, m);
    // |terms| ≤ 16·4 + 2 = 66 < 2^7: 4 ulps at 2^7 is 2^-16.
    EXPECT_TRUE(Matches(MmaAndGather(type, w), Reference(m), std::ldexp(1.0, -16)))
        << "trial " << trial;
  }
}

// The negative check: the same comparison fed by a wrong table fails, so a wrong mapping in
// mma.cc could not pass it.
TEST_P(FragmentLayout, WrongTablesFailTheComparison) {
  const Type type = GetParam();
  const struct {
    const char* name;
    Layout layout;
  } wrong[] = {
      {"A halves swapped", {SwappedHalvesA, PtxB, PtxC}},
      {"B halves swapped", {PtxA, SwappedHalvesB, PtxC}},
      {"A registers 1 and 2 swapped", {SwappedRegistersA, PtxB, PtxC}},
      {"c1 and c2 swapped", {PtxA, PtxB, SwappedElementsC}},
  };
  const Matrices m = RandomOdd(3);
  {
    Warp w = Scatter(kPtx, type, m);
    ASSERT_TRUE(Matches(MmaAndGather(type, w), Reference(m), 0)) << "the right table must pass";
  }
  for (const auto& [name, layout] : wrong) {
    Warp w = Scatter(layout, type, m);
    M16n8k16(type, w.a, w.b, w.c, w.d);
    ASSERT_FALSE(Matches(Gather(layout, w), Reference(m), 0)) << name;
  }
}

// Special values go where their row and column say: NaN and inf spread along their row of D
// only, inf · 0 is NaN, and subnormal products come out exact.
TEST_P(FragmentLayout, SpecialValues) {
  const Type type = GetParam();
  Matrices m;
  for (int k = 0; k < kK; ++k)
    for (int n = 0; n < kN; ++n) m.b[k][n] = 1;
  m.b[2][5] = 0;  // Column 5 meets row 1's inf at k = 2 with a zero.
  m.a[0][3] = std::numeric_limits<double>::quiet_NaN();
  m.a[1][2] = std::numeric_limits<double>::infinity();
  // The smallest subnormal of each type, times 1: exact in fp32.
  const double tiny = type == Type::kF16 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -133);
  m.a[9][7] = tiny;
  Warp w = Scatter(kPtx, type, m);
  const Output out = MmaAndGather(type, w);
  for (int n = 0; n < kN; ++n) {
    EXPECT_TRUE(std::isnan(out.d[0][n])) << n;
    if (n == 5) {
      EXPECT_TRUE(std::isnan(out.d[1][n]));
    } else {
      EXPECT_EQ(out.d[1][n], std::numeric_limits<double>::infinity()) << n;
    }
    EXPECT_EQ(out.d[9][n], tiny) << n;
    EXPECT_EQ(out.d[4][n], 0) << n;
  }
  // NaN in D is CUDA's canonical pattern, whatever the input's payload.
  for (int lane = 0; lane < 4; ++lane) {  // Lanes 0..3 hold row 0 in d0 and d1.
    EXPECT_EQ(std::bit_cast<uint32_t>(w.d[lane][0]), 0x7fffffffu);
  }
}

// bf16 reaches fp32's range: 2^64 · 2^64 overflows fp32 to inf, as the hardware's fp32 result.
TEST(FragmentLayoutBF16, ProductsPastFp32RangeAreInfinite) {
  Matrices m;
  m.a[0][0] = std::ldexp(1.0, 64);
  m.b[0][0] = std::ldexp(1.0, 64);
  m.a[1][0] = -std::ldexp(1.0, 64);
  Warp w = Scatter(kPtx, Type::kBF16, m);
  const Output out = MmaAndGather(Type::kBF16, w);
  EXPECT_EQ(out.d[0][0], std::numeric_limits<double>::infinity());
  EXPECT_EQ(out.d[1][0], -std::numeric_limits<double>::infinity());
}

INSTANTIATE_TEST_SUITE_P(Types, FragmentLayout, testing::Values(Type::kF16, Type::kBF16), TypeName);

// --- The headers the fragments are packed with
// ---------------------------------------------------- Bit patterns CUDA produces, the register
// layout the kernels rely on, and round to nearest even checked on every tie of each format (every
// value halfway between two neighbours).
TEST(Fp16Header, PairLayoutAndSpecialValues) {
  EXPECT_EQ(std::bit_cast<uint32_t>(__floats2half2_rn(1.f, -2.f)), 0xc0003c00u);  // x low.
  EXPECT_EQ(__half_as_ushort(__low2half(__floats2half2_rn(1.f, -2.f))), 0x3c00u);
  EXPECT_EQ(__high2float(__floats2half2_rn(1.f, -2.f)), -2.f);
  EXPECT_EQ(__low2float(__floats2half2_rn(1.f, -2.f)), 1.f);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(65519.f)), 0x7bffu);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(65520.f)), 0x7c00u);  // The tie rounds to inf.
  EXPECT_EQ(__half_as_ushort(__float2half(-1e9f)), 0xfc00u);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(std::ldexp(1.f, -25))), 0x0000u);  // Tie to 0.
  EXPECT_EQ(__half_as_ushort(__float2half_rn(3 * std::ldexp(1.f, -25))), 0x0002u);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(-0.f)), 0x8000u);
  EXPECT_EQ(__half_as_ushort(__float2half_rn(-std::numeric_limits<float>::quiet_NaN())), 0x7fffu);
  EXPECT_EQ(std::bit_cast<uint32_t>(__half2float(__ushort_as_half(0xfe01u))), 0x7fffffffu);
  EXPECT_EQ(__half2float(__ushort_as_half(0x0001u)), std::ldexp(1.f, -24));
  EXPECT_EQ(__half2float(__ushort_as_half(0xfc00u)), -std::numeric_limits<float>::infinity());
  const __half h = 0.1f;  // The constructor rounds as __float2half_rn.
  EXPECT_EQ(__half_as_ushort(h), __half_as_ushort(__float2half_rn(0.1f)));
  EXPECT_EQ(static_cast<float>(h), __half2float(h));
}

TEST(Fp16Header, EveryValueAndEveryTie) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto h = static_cast<unsigned short>(bits);
    const float f = __half2float(__ushort_as_half(h));
    if ((h & 0x7fffu) > 0x7c00u) {
      EXPECT_TRUE(std::isnan(f)) << bits;
      continue;
    }
    EXPECT_EQ(__half_as_ushort(__float2half_rn(f)), h) << bits;
    if ((h & 0x7fffu) >= 0x7bffu) continue;  // No finite neighbour above.
    const float next = __half2float(__ushort_as_half(static_cast<unsigned short>(h + 1)));
    const float tie = (f + next) / 2;  // Exact: fp32 has 13 more significand bits.
    EXPECT_EQ(__half_as_ushort(__float2half_rn(tie)), (h & 1) ? h + 1 : h) << bits;
    EXPECT_EQ(__half_as_ushort(__float2half_rn(std::nextafter(tie, next))), h + 1) << bits;
    EXPECT_EQ(__half_as_ushort(__float2half_rn(std::nextafter(tie, f))), h) << bits;
  }
}

TEST(Bf16Header, PairLayoutAndSpecialValues) {
  EXPECT_EQ(std::bit_cast<uint32_t>(__floats2bfloat162_rn(1.f, -2.f)), 0xc0003f80u);  // x low.
  EXPECT_EQ(__bfloat16_as_ushort(__low2bfloat16(__floats2bfloat162_rn(1.f, -2.f))), 0x3f80u);
  EXPECT_EQ(__high2float(__floats2bfloat162_rn(1.f, -2.f)), -2.f);
  EXPECT_EQ(__low2float(__floats2bfloat162_rn(1.f, -2.f)), 1.f);
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(FLT_MAX)), 0x7f80u);  // Past max + ulp/2.
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16(-FLT_MAX)), 0xff80u);
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(std::ldexp(1.f, -134))), 0x0000u);  // Tie.
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(3 * std::ldexp(1.f, -134))), 0x0002u);
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(-0.f)), 0x8000u);
  EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(-std::numeric_limits<float>::quiet_NaN())),
            0x7fffu);
  // bf16 → fp32 is CUDA's plain shift: a NaN keeps its sign and payload.
  EXPECT_EQ(std::bit_cast<uint32_t>(__bfloat162float(__ushort_as_bfloat16(0xff81u))), 0xff810000u);
  const __nv_bfloat16 b = 0.1f;
  EXPECT_EQ(__bfloat16_as_ushort(b), __bfloat16_as_ushort(__float2bfloat16_rn(0.1f)));
}

TEST(Bf16Header, EveryValueAndEveryTie) {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const auto h = static_cast<unsigned short>(bits);
    const float f = __bfloat162float(__ushort_as_bfloat16(h));
    EXPECT_EQ(std::bit_cast<uint32_t>(f), bits << 16) << bits;
    if ((h & 0x7fffu) > 0x7f80u) continue;  // NaN.
    EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(f)), h) << bits;
    if ((h & 0x7fffu) >= 0x7f7fu) continue;                          // No finite neighbour above.
    const float tie = std::bit_cast<float>((bits << 16) | 0x8000u);  // Halfway to h + 1.
    EXPECT_EQ(__bfloat16_as_ushort(__float2bfloat16_rn(tie)), (h & 1) ? h + 1 : h) << bits;
    EXPECT_EQ(
        __bfloat16_as_ushort(__float2bfloat16_rn(std::bit_cast<float>((bits << 16) | 0x8001u))),
        h + 1)
        << bits;
    EXPECT_EQ(
        __bfloat16_as_ushort(__float2bfloat16_rn(std::bit_cast<float>((bits << 16) | 0x7fffu))), h)
        << bits;
  }
}

}  // namespace
