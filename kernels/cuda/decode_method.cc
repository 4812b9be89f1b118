// CudaBackend::Decode (backend_impl.h): one decode step of a batch of sequences over their KV
// caches, the whole batch in one launch of the split-KV kernels (decode.cu).
//
// The host's part: group the problems by the kernel instance they need (the pages' dtype and
// the padded width, PaddedDecodeDim: up to 576), split every cache into chunks of one size
// chosen so that the batch fills the device (about kBlocksPerMultiprocessor blocks per SM,
// chunks of at least kMinChunkKeys, a multiple of the instance's keys per tile), list the units
// (item, kv head, row group of the instance's rows, chunk: DecodeTileOf in launch.h, as the
// kernel takes them), stage the queries (as fp32), the items and the units in one upload,
// launch, and bring every output and lse back in one download. Forks of one prompt in the batch
// (caches sharing their first pages, kernels/cascade.h) run the chunks of those pages in cascade
// units (DecodeUnit), every fork's rows in the same blocks, so each such chunk is read once per
// row group of all of them rather than once per fork; their other chunks in units of their own.
// Problems the kernels do not take (not over a cache, batch > 1, wider than kMaxDecodeDim, or a
// device whose shared memory is too small) run as Tiled, one by one (which refuses widths over
// kMaxHeadDim); one with a token tree is refused, UNIMPLEMENTED, since Tiled takes no tree.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cascade.h"
#include "kernels/cuda/backend_impl.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.h"

namespace attn::cuda {
namespace {

constexpr int64_t kBlocksPerMultiprocessor = 4;
constexpr int64_t kMinChunkKeys = 128;
// Rows of one kv head a cascade stacks at most (each of its blocks finds its rows' items by
// walking its members).
constexpr int64_t kCascadeMaxRows = 256;
constexpr int kMaxItemsPerLaunch = 65535;  // The merge kernel's grid.y.

int64_t RoundUp(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }
int64_t Align(int64_t bytes) { return RoundUp(bytes, 16); }

}  // namespace

absl::StatusOr<Stats> CudaBackend::Decode(const std::vector<Problem>& problems,
                                          const std::vector<Outputs>& outputs) {
  if (problems.size() != outputs.size()) {
    return absl::InternalError(
        absl::StrCat("Decode: ", problems.size(), " problems but ", outputs.size(), " outputs"));
  }
  for (const Outputs& out : outputs) ATTN_RETURN_IF_ERROR(out.CheckInterrupt());
  // (dtype, pitch) → the problems the split kernel takes at that instance.
  std::map<std::pair<int, int>, std::pair<std::vector<const Problem*>, std::vector<const Outputs*>>>
      groups;
  Stats total;
  // Keys per tile of the first item's kernel (a batch of several widths reports that one).
  total.block_k = problems.empty() ? DecodeTileOf(kMaxHeadDim).keys
                                   : DecodeTileOf(PaddedDecodeDim(problems[0].shape)).keys;
  for (size_t i = 0; i < problems.size(); ++i) {
    const Problem& problem = problems[i];
    const int pitch = PaddedDecodeDim(problem.shape);
    const bool split =
        problem.pages != nullptr && problem.shape.batch == 1 && pitch != 0 &&
        DecodeSharedBytes(pitch) + DecodeStaticSharedBytes(pitch) <= options_.max_shared_bytes;
    if (!split) {
      if (problem.tree_count > 0) {  // Tiled's kernels take no token tree.
        return absl::UnimplementedError(absl::StrCat(
            "Decode with tree_parents on CUDA runs only in the decode kernel (head_dim and "
            "value_dim ≤ ",
            kMaxDecodeDim, ", within the device's shared memory); this item's are ",
            problem.shape.head_dim, " and ", problem.shape.value_dim));
      }
      ATTN_ASSIGN_OR_RETURN(const Stats stats, Tiled(problem, outputs[i]));
      total.Add(stats);
      continue;
    }
    auto& group = groups[{static_cast<int>(problem.pages->dtype), pitch}];
    group.first.push_back(&problem);
    group.second.push_back(&outputs[i]);
  }
  for (const auto& [key, group] : groups) {
    for (size_t begin = 0; begin < group.first.size(); begin += kMaxItemsPerLaunch) {
      const size_t end = std::min(group.first.size(), begin + kMaxItemsPerLaunch);
      ATTN_ASSIGN_OR_RETURN(
          const Stats stats,
          DecodeGroup({group.first.begin() + begin, group.first.begin() + end},
                      {group.second.begin() + begin, group.second.begin() + end}, key.second));
      total.Add(stats);
    }
  }
  return total;
}

absl::StatusOr<Stats> CudaBackend::DecodeGroup(const std::vector<const Problem*>& group_problems,
                                               const std::vector<const Outputs*>& group_outputs,
                                               int pitch) {
  const int64_t count = static_cast<int64_t>(group_problems.size());
  const DecodeTile tile = DecodeTileOf(pitch);  // The kernel's, at this pitch.
  // The chunk size: the batch's (kv head, row group) pairs, each cache cut so that the units
  // come to about kBlocksPerMultiprocessor per SM.
  int64_t chunk_keys = options_.decode_chunk_keys;
  if (chunk_keys <= 0) {
    double key_work = 0;  // Σ pairs · key_len
    for (const Problem* p : group_problems) {
      const Shape& s = p->shape;
      const int64_t row_groups =
          (QueryHeadsPerKvHead(s.heads, s.kv_heads) * s.query_len + tile.rows - 1) / tile.rows;
      key_work += static_cast<double>(s.kv_heads * row_groups) * static_cast<double>(s.key_len);
    }
    const double target = static_cast<double>(kBlocksPerMultiprocessor * multiprocessors_);
    chunk_keys = std::max<int64_t>(kMinChunkKeys, static_cast<int64_t>(key_work / target));
  }
  chunk_keys = RoundUp(chunk_keys, tile.keys);

  // Cascades (kernels/cascade.h): forks of one prompt whose rows all see its first chunks run
  // those chunks in units of their own, every member's rows together. The batch is laid out
  // with each cascade's members first, side by side; then the rest in order.
  std::vector<int64_t> cascadable(count), chunk_tokens(count, chunk_keys), group_rows(count);
  for (int64_t i = 0; i < count; ++i) {
    const Shape& s = group_problems[i]->shape;
    group_rows[i] = QueryHeadsPerKvHead(s.heads, s.kv_heads) * s.query_len;
    cascadable[i] = KeysEveryRowSees(*group_problems[i]) / chunk_keys;
  }
  const std::vector<CascadeGroup> cascades =
      PlanCascades(group_problems, cascadable, chunk_tokens, group_rows, kCascadeMaxRows);
  std::vector<const Problem*> problems;
  std::vector<const Outputs*> outputs;
  std::vector<int64_t> shared_chunks;  // Of each item: its first chunks, run by its cascade.
  std::vector<bool> placed(count);
  for (const CascadeGroup& cascade : cascades) {
    for (size_t m : cascade.members) {
      problems.push_back(group_problems[m]);
      outputs.push_back(group_outputs[m]);
      shared_chunks.push_back(cascade.chunks);
      placed[m] = true;
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    if (placed[i]) continue;
    problems.push_back(group_problems[i]);
    outputs.push_back(group_outputs[i]);
    shared_chunks.push_back(0);
  }

  // Layout of the upload (queries and slopes, items, units), the download (outputs, lse) and the
  // scratch.
  std::vector<DecodeItem> items(count);
  std::vector<DecodeUnit> units;
  std::vector<int64_t> query_offset(count), slopes_offset(count), sinks_offset(count),
      tree_offset(count), output_offset(count), lse_offset(count);
  int64_t query_bytes = 0, result_bytes = 0, partial_acc = 0, partial_state = 0, max_rows = 0;
  double flops = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Problem& p = *problems[i];
    const Shape& s = p.shape;
    DecodeItem& item = items[i];
    item.pages = *p.pages;
    item.output_dtype = p.output_dtype;
    item.heads = s.heads;
    item.kv_heads = s.kv_heads;
    item.query_len = s.query_len;
    item.key_len = s.key_len;
    item.head_dim = s.head_dim;
    item.value_dim = s.value_dim;
    item.scale = p.scale;
    item.transforms = p.transforms();  // Its slopes and sinks, if any, uploaded below.
    item.geometry = p.geometry();
    item.chunk_keys = chunk_keys;
    item.chunks = (s.key_len + chunk_keys - 1) / chunk_keys;
    const int64_t rows = s.heads * s.query_len;
    item.partial_acc = partial_acc;
    item.partial_state = partial_state;
    partial_acc += rows * item.chunks * s.value_dim;
    partial_state += rows * item.chunks * 2;
    max_rows = std::max(max_rows, rows);
    query_offset[i] = query_bytes;
    query_bytes += Align(rows * s.head_dim * 4);
    slopes_offset[i] = sinks_offset[i] = -1;
    if (p.alibi_slopes != nullptr) {
      slopes_offset[i] = query_bytes;
      query_bytes += Align(s.heads * 4);
    }
    if (p.sinks != nullptr) {
      sinks_offset[i] = query_bytes;
      query_bytes += Align(s.heads * 4);
    }
    tree_offset[i] = -1;
    if (p.tree_count > 0) {
      tree_offset[i] = query_bytes;
      query_bytes += Align(s.query_len * item.geometry.tree_words * 8);
    }
    output_offset[i] = result_bytes;
    result_bytes += Align(p.OutputElements() * ElementSize(p.output_dtype));
    lse_offset[i] = -1;
    if (outputs[i]->lse != nullptr) {
      lse_offset[i] = result_bytes;
      result_bytes += Align(p.LseElements() * 4);
    }
    const int64_t row_groups =
        (QueryHeadsPerKvHead(s.heads, s.kv_heads) * s.query_len + tile.rows - 1) / tile.rows;
    for (int64_t kv_head = 0; kv_head < s.kv_heads; ++kv_head) {
      for (int64_t group = 0; group < row_groups; ++group) {
        for (int64_t chunk = shared_chunks[i]; chunk < item.chunks; ++chunk) {
          units.push_back(DecodeUnit{static_cast<int32_t>(i), static_cast<int32_t>(kv_head),
                                     static_cast<int32_t>(group), static_cast<int32_t>(chunk), 1});
        }
      }
    }
    flops += p.Flops();
  }
  // Each cascade's units: its members' rows (consecutive items from `first`) over its chunks.
  for (int64_t c = 0, first = 0; c < static_cast<int64_t>(cascades.size()); ++c) {
    const CascadeGroup& cascade = cascades[c];
    const int64_t members = static_cast<int64_t>(cascade.members.size());
    const int64_t row_groups = (cascade.rows + tile.rows - 1) / tile.rows;
    for (int64_t kv_head = 0; kv_head < problems[first]->shape.kv_heads; ++kv_head) {
      for (int64_t group = 0; group < row_groups; ++group) {
        for (int64_t chunk = 0; chunk < cascade.chunks; ++chunk) {
          units.push_back(DecodeUnit{static_cast<int32_t>(first), static_cast<int32_t>(kv_head),
                                     static_cast<int32_t>(group), static_cast<int32_t>(chunk),
                                     static_cast<int32_t>(members)});
        }
      }
    }
    first += members;
  }
  if (units.size() > static_cast<size_t>(INT32_MAX) || max_rows > INT32_MAX) {
    return absl::InvalidArgumentError(
        "Decode on CUDA: the batch is too large for one launch; send fewer items");
  }
  const int64_t items_offset = query_bytes;
  const int64_t units_offset = items_offset + Align(count * sizeof(DecodeItem));
  const int64_t upload_bytes =
      units_offset + static_cast<int64_t>(units.size() * sizeof(DecodeUnit));

  ATTN_RETURN_IF_ERROR(device_->Start());
  SlotPool::Lease lease(device_->slots());
  Slot& slot = lease.slot();
  Allocations memory(device_->budget(), slot.stream);
  ATTN_RETURN_IF_ERROR(slot.ReserveStaging(upload_bytes + result_bytes));
  ATTN_ASSIGN_OR_RETURN(char* upload, memory.Allocate<char>(upload_bytes));
  ATTN_ASSIGN_OR_RETURN(char* results, memory.Allocate<char>(result_bytes));
  ATTN_ASSIGN_OR_RETURN(float* acc_scratch, memory.Allocate<float>(partial_acc * 4));
  ATTN_ASSIGN_OR_RETURN(float* state_scratch, memory.Allocate<float>(partial_state * 4));

  char* staged = slot.staging;
  for (int64_t i = 0; i < count; ++i) {
    const Problem& p = *problems[i];
    const int64_t elements = p.shape.heads * p.shape.query_len * p.shape.head_dim;
    float* query = reinterpret_cast<float*>(staged + query_offset[i]);
    if (p.query.dtype == DType::kFloat32) {
      std::memcpy(query, p.query.data, elements * 4);
    } else {
      for (int64_t e = 0; e < elements; ++e) query[e] = p.query[e];
    }
    items[i].query = reinterpret_cast<const float*>(upload + query_offset[i]);
    if (slopes_offset[i] >= 0) {
      std::memcpy(staged + slopes_offset[i], p.alibi_slopes, p.shape.heads * 4);
      items[i].transforms.alibi_slopes = reinterpret_cast<const float*>(upload + slopes_offset[i]);
    }
    if (sinks_offset[i] >= 0) {
      std::memcpy(staged + sinks_offset[i], p.sinks, p.shape.heads * 4);
      items[i].transforms.sinks = reinterpret_cast<const float*>(upload + sinks_offset[i]);
    }
    if (tree_offset[i] >= 0) {
      std::memcpy(staged + tree_offset[i], p.tree_ancestors,
                  p.shape.query_len * items[i].geometry.tree_words * 8);
      items[i].geometry.tree_ancestors = reinterpret_cast<const uint64_t*>(upload + tree_offset[i]);
    }
    items[i].output = results + output_offset[i];
    items[i].lse = lse_offset[i] >= 0 ? reinterpret_cast<float*>(results + lse_offset[i]) : nullptr;
  }
  std::memcpy(staged + items_offset, items.data(), count * sizeof(DecodeItem));
  std::memcpy(staged + units_offset, units.data(), units.size() * sizeof(DecodeUnit));
  ATTN_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(upload, staged, upload_bytes, cudaMemcpyHostToDevice, slot.stream),
            "cudaMemcpyAsync (decode inputs)"));

  DecodeBatch batch;
  batch.dtype = problems[0]->pages->dtype;
  batch.pitch = pitch;
  batch.items = reinterpret_cast<const DecodeItem*>(upload + items_offset);
  batch.items_count = static_cast<int>(count);
  batch.units = reinterpret_cast<const DecodeUnit*>(upload + units_offset);
  batch.units_count = static_cast<int64_t>(units.size());
  batch.max_rows = max_rows;
  batch.partial_acc = acc_scratch;
  batch.partial_state = state_scratch;
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.start, slot.stream), "cudaEventRecord"));
  if (const cudaError_t error = LaunchDecode(batch, slot.stream); error == cudaErrorInvalidValue) {
    return absl::InternalError(absl::StrCat("CUDA Decode: no kernel for ", DTypeName(batch.dtype),
                                            " rows padded to ", pitch));
  } else {
    ATTN_RETURN_IF_ERROR(Check(error, "LaunchDecode"));
  }
  ATTN_RETURN_IF_ERROR(Check(cudaEventRecord(slot.stop, slot.stream), "cudaEventRecord"));
  char* staged_results = staged + upload_bytes;
  ATTN_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(staged_results, results, result_bytes, cudaMemcpyDeviceToHost, slot.stream),
      "cudaMemcpyAsync (decode outputs)"));
  ATTN_RETURN_IF_ERROR(Check(cudaStreamSynchronize(slot.stream), "Decode on the device"));
  for (int64_t i = 0; i < count; ++i) {
    const Problem& p = *problems[i];
    std::memcpy(outputs[i]->output.data, staged_results + output_offset[i],
                p.OutputElements() * ElementSize(p.output_dtype));
    if (lse_offset[i] >= 0) {
      std::memcpy(outputs[i]->lse, staged_results + lse_offset[i], p.LseElements() * 4);
    }
  }

  Stats stats;
  ATTN_ASSIGN_OR_RETURN(stats.compute_ns, ElapsedNs(slot));
  stats.block_k = tile.keys;
  stats.flops = flops;
  stats.scratch_bytes = (partial_acc + partial_state) * 4;
  stats.peak_memory_bytes = stats.scratch_bytes + result_bytes;
  return stats;
}

}  // namespace attn::cuda
