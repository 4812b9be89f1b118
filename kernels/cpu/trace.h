// Trace on the CPU: the explainer's idea 3 watched step by step. For each requested row the
// cursor runs Tiled's own tile step — KvTile::Scores, VisitKeyTileRows, KvTile::Accumulate — for
// a block of one row, one tile per Next() call, and records what it computed; after a row's
// last tile it reports the final output beside the full-matrix row computed by NaiveRows.
#pragma once

#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/problem.h"

namespace attn {

// A cursor over the trace of `rows` (validated: in range). The Problem's tensors must outlive
// the cursor.
std::unique_ptr<TraceCursor> MakeCpuTraceCursor(const Problem& problem, std::vector<RowRef> rows);

}  // namespace attn
