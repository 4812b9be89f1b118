#include "server/response.h"

#include <string>
#include <variant>
#include <vector>

#include "proto/dtype_mapping.h"

namespace attn {

namespace v1 = attention::v1;

Outputs PrepareOutputs(const Problem& problem, const v1::AttentionRequest& request,
                       v1::AttentionResponse* response) {
  return PrepareOutputs(problem, request.query(), response->mutable_output(),
                        problem.return_lse ? response->mutable_lse() : nullptr);
}

Outputs PrepareOutputs(const Problem& problem, const v1::Tensor& query, v1::Tensor* output,
                       v1::Tensor* lse) {
  Outputs outputs;
  *output->mutable_shape() = query.shape();
  output->set_shape(output->shape_size() - 1, problem.shape.value_dim);
  output->set_dtype(ToProtoDType(problem.output_dtype));
  std::string* data = output->mutable_data();
  data->resize(problem.OutputElements() * ElementSize(problem.output_dtype));
  outputs.output = MutableTensorView{data->data(), problem.output_dtype};
  if (problem.return_lse && lse != nullptr) {
    *lse->mutable_shape() = query.shape();
    lse->mutable_shape()->RemoveLast();
    lse->set_dtype(v1::DTYPE_FLOAT32);
    std::string* lse_data = lse->mutable_data();
    lse_data->resize(problem.LseElements() * sizeof(float));
    outputs.lse = reinterpret_cast<float*>(lse_data->data());
  }
  return outputs;
}

void EncodeCacheInfo(const CacheDescription& cache, v1::CacheInfo* message) {
  message->set_cache_id(cache.id);
  message->set_kv_heads(cache.layout.kv_heads);
  message->set_head_dim(cache.layout.head_dim);
  message->set_value_dim(cache.layout.value_dim);
  message->set_dtype(ToProtoDType(cache.layout.dtype));
  message->set_values_from_keys(cache.layout.values_from_keys);
  message->set_length(cache.length);
  message->set_bytes(cache.bytes);
  message->set_shared_bytes(cache.shared_bytes);
  message->set_page_tokens(cache.page_tokens);
  if (cache.durable_length) message->set_durable_length(*cache.durable_length);
  if (cache.crc32c) message->set_crc32c(*cache.crc32c);
}

void EncodeStats(const Stats& stats, v1::ExecutionStats* message) {
  message->set_block_k(stats.block_k);
  message->set_compute_ns(stats.compute_ns);
  message->set_flops(stats.flops);
  message->set_intermediate_bytes(stats.intermediate_bytes);
  message->set_scratch_bytes(stats.scratch_bytes);
  message->set_peak_memory_bytes(stats.peak_memory_bytes);
}

v1::TraceStart EncodeTraceStart(const Problem& problem) {
  const Shape& s = problem.shape;
  v1::TraceStart start;
  start.set_batch(s.batch);
  start.set_heads(s.heads);
  start.set_kv_heads(s.kv_heads);
  start.set_query_len(s.query_len);
  start.set_key_len(s.key_len);
  start.set_head_dim(s.head_dim);
  start.set_value_dim(s.value_dim);
  start.set_block_k(problem.block_k);
  start.set_scale(problem.scale);
  start.set_causal(problem.causal);
  const Geometry geometry = problem.geometry();
  if (problem.sequences == 0) {  // Else each sequence's own, from cu_seqlens.
    start.set_key_position(geometry.key_position);
    start.set_query_position(geometry.query_position);
  }
  if (problem.sequences > 0) {
    start.mutable_cu_seqlens_q()->Assign(problem.cu_seqlens_q,
                                         problem.cu_seqlens_q + problem.sequences + 1);
    start.mutable_cu_seqlens_k()->Assign(problem.cu_seqlens_k,
                                         problem.cu_seqlens_k + problem.sequences + 1);
  }
  if (geometry.window_left != kUnbounded) start.set_window_left(geometry.window_left);
  if (geometry.window_right != kUnbounded) start.set_window_right(geometry.window_right);
  start.set_softcap(problem.softcap);
  if (problem.alibi_slopes != nullptr) {
    start.mutable_alibi_slopes()->Assign(problem.alibi_slopes, problem.alibi_slopes + s.heads);
  }
  if (problem.sinks != nullptr) {
    start.mutable_sinks()->Assign(problem.sinks, problem.sinks + s.heads);
  }
  start.set_naive_intermediate_bytes(problem.NaiveIntermediateBytes());
  start.set_tiled_scratch_floats_per_row(problem.TiledScratchFloatsPerRow());
  start.set_tiles_per_row(static_cast<int32_t>(problem.TilesPerRow()));
  return start;
}

namespace {

void EncodeRow(const RowRef& row, v1::RowRef* message) {
  message->set_batch(row.batch);
  message->set_head(row.head);
  message->set_row(row.row);
}

void EncodeFloats(const std::vector<float>& values,
                  google::protobuf::RepeatedField<float>* message) {
  message->Assign(values.begin(), values.end());
}

}  // namespace

static_assert(static_cast<int>(Hidden::kNone) == v1::HIDDEN_NONE &&
                  static_cast<int>(Hidden::kCausal) == v1::HIDDEN_CAUSAL &&
                  static_cast<int>(Hidden::kWindow) == v1::HIDDEN_WINDOW &&
                  static_cast<int>(Hidden::kSequence) == v1::HIDDEN_SEQUENCE,
              "kernels/geometry.h's Hidden must number its reasons as the proto does");

void EncodeTraceItem(const TraceItem& item, v1::TraceEvent* event) {
  if (const TraceStep* step = std::get_if<TraceStep>(&item)) {
    v1::TileStep* message = event->mutable_step();
    EncodeRow(step->row, message->mutable_row());
    message->set_tile(step->tile);
    message->set_key_begin(step->key_begin);
    message->set_key_end(step->key_end);
    EncodeFloats(step->scores, message->mutable_scores());
    message->set_max_before(step->max_before);
    message->set_max_after(step->max_after);
    message->set_rescale(step->rescale);
    EncodeFloats(step->weights, message->mutable_weights());
    message->set_denominator(step->denominator);
    EncodeFloats(step->accumulator, message->mutable_accumulator());
    EncodeFloats(step->estimate, message->mutable_estimate());
    EncodeFloats(step->scaled_scores, message->mutable_scaled_scores());
    EncodeFloats(step->biases, message->mutable_biases());
    for (const Hidden hidden : step->hidden) message->add_hidden(static_cast<v1::Hidden>(hidden));
    return;
  }
  const TraceRowDone& done = std::get<TraceRowDone>(item);
  v1::RowDone* message = event->mutable_row_done();
  EncodeRow(done.row, message->mutable_row());
  EncodeFloats(done.output, message->mutable_output());
  EncodeFloats(done.reference, message->mutable_reference());
  message->set_max_abs_error(done.max_abs_error);
  message->set_lse(done.lse);
  message->set_sink_share(done.sink_share);
}

}  // namespace attn
