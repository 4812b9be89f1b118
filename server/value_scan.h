// ScanValues: the one pass over a request's tensor elements that validation needs, at memory
// speed.
//
// For IEEE formats the magnitude bits of x (all bits but the sign), read as an unsigned integer,
// order like |x|, and every inf and NaN has larger magnitude bits than any finite value. So one
// integer max over the magnitude bits gives both answers validation asks for: the largest |x|,
// and whether any element is not finite. The loop is integer loads, masks and maxes only, on
// vector registers (AVX2 where the CPU has it, chosen at run time; SSE2 otherwise); only a
// tensor that holds a non-finite element is read a second time, to find the first one for the
// message. A tensor of 8 MiB or more is split over up to four threads started for the call (one
// core alone reads at a fraction of the memory bandwidth). Thread-safe; reads `elements`
// elements of `dtype` from `data` (any alignment).
#pragma once

#include <cstdint>

#include "kernels/dtype.h"

namespace attn {

struct ValueScan {
  double max_abs = 0;             // Largest |element|; meaningless when one is not finite.
  int64_t first_non_finite = -1;  // Index of the first inf or NaN; −1 when every one is finite.
  float non_finite_value = 0;     // That element's value.
};

// `elements` elements of a tensor dtype (not fp8).
ValueScan ScanValues(const void* data, DType dtype, int64_t elements);

// `rows` stored fp8 rows of `width` elements (Fp8RowBytes each, as a file or an export brings
// them): element values code · scale. A NaN code, or a scale that is not finite or is negative,
// counts as a non-finite element (the first of its row for a bad scale). Scalar; for tokens
// that come stored, not for requests.
ValueScan ScanFp8Rows(const void* data, int64_t rows, int64_t width);

}  // namespace attn
