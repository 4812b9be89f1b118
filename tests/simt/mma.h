// The SIMT emulator's tensor cores: one warp's mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}
// computed on the CPU from the 32 lanes' registers, as the backend's Mma<T> (kernels/cuda/tiled.cu)
// issues it.
//
// Registers are laid out as the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point
// type" (§9.7.14.5.8) says; tests/simt/fragment_layout_test.cc checks that against its own
// transcription of those tables. With groupID = lane / 4 and tig = lane % 4:
//   a[lane][r] (16-bit pairs)  A[groupID + 8·(r & 1)][2·tig + 8·(r >> 1) + h]
//   b[lane][r] (16-bit pairs)  B[2·tig + 8·r + h][groupID]
//   c, d[lane][e] (fp32)       C/D[groupID + 8·(e >> 1)][2·tig + (e & 1)]
// where h = 0 is a register's low 16 bits and h = 1 its high 16 bits.
//
// Numerics: every product is exact and the 16 products of an output are summed in float64
// (k = 0, 1, …, 15), C added last, then rounded once to fp32, nearest even. The hardware adds
// the same exact products but with its own alignment, truncation and grouping, so its results
// may differ from these in the last bits of fp32: a few ulps of the largest term, which is many
// ulps of the result when terms cancel. Comparisons with a GPU's results need that tolerance;
// the emulator's own are deterministic. NaN results are the canonical 0x7fffffff; ±inf and
// subnormals (in and out) follow IEEE 754.
// Thread-safe: a pure function of its arguments.
#pragma once

#include <cstdint>

namespace simt::mma {

enum class Type { kF16, kBF16 };

// D = A·B + C for one warp's m16n8k16 .row.col .f32 MMA: a[lane][0..3], b[lane][0..1] packed
// 16-bit pairs (first element in the low half), c/d[lane][0..3] fp32 (d may alias c). Each
// array has 32 rows, one per lane.
void M16n8k16(Type type, const uint32_t (*a)[4], const uint32_t (*b)[2], const float (*c)[4],
              float (*d)[4]);

}  // namespace simt::mma
