// Structure-aware mutations for attention_fuzz (libFuzzer's LLVMFuzzerCustomMutator).
//
// Byte-level mutations of a serialized request almost never keep a tensor's shape and its data
// length in step, so validation refuses them and the kernels would only ever see the seeds'
// shapes. Half of the time this mutator instead parses the input, changes one thing the way a
// client could — a dimension of the problem, consistently in every tensor that has it (data
// resized, new elements fresh finite values), a tensor's dtype or magnitude, an option, a traced
// row; for a cache step the cache's layout in step with the Decode item's query and new tokens,
// the item's token tree, cut or positions — and serializes it again. The other half, and whenever
// the input does not parse or the result would not fit, libFuzzer's own mutations run, which keep
// validation under fire.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/v1/attention.pb.h"
#include "kernels/dtype.h"
#include "proto/dtype_mapping.h"
#include "tests/fuzz/fuzz_input.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace attn {
namespace {

namespace v1 = attention::v1;
using Random = std::minstd_rand;

constexpr int64_t kMaxElements = 1 << 14;  // Per tensor; larger shapes are left alone.

// Uniform in [0, n); 0 when n < 1 (a fuzzed shape may hold anything).
int64_t Pick(Random& rng, int64_t n) {
  return n < 1 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
}

// A new size for a dimension: one more or less, small, or now and then long enough for several
// tiles of the default block_k.
int64_t NewDim(Random& rng, int64_t old) {
  switch (Pick(rng, 5)) {
    case 0:
      return std::max<int64_t>(1, old - 1);
    case 1:
      return old + 1;
    case 2:
      return 1 + Pick(rng, 8);
    case 3:
      return 1 + Pick(rng, 40);
    default:
      return 1 + Pick(rng, 600);
  }
}

// Sets the dimension `from_end` places from the end (1: the last) when the tensor has it.
void SetDim(v1::Tensor* tensor, int from_end, int64_t value) {
  if (tensor->shape_size() >= from_end) tensor->set_shape(tensor->shape_size() - from_end, value);
}

std::vector<float> Values(const v1::Tensor& tensor, DType dtype) {
  std::vector<float> values(tensor.data().size() / ElementSize(dtype));
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = LoadElement(tensor.data().data(), dtype, i);
  return values;
}

// Stores `values` as the tensor's data in `dtype`, resized to its shape: elements past the end
// of `values` get uniform(−2, 2). False when the shape is not small and valid.
bool SetData(v1::Tensor* tensor, DType dtype, const std::vector<float>& values, Random& rng) {
  int64_t elements = 1;
  for (int64_t dim : tensor->shape()) {
    if (dim < 1 || dim > kMaxElements) return false;
    elements *= dim;
    if (elements > kMaxElements) return false;
  }
  tensor->set_dtype(ToProtoDType(dtype));
  std::string* data = tensor->mutable_data();
  data->resize(elements * ElementSize(dtype));
  std::uniform_real_distribution<float> fresh(-2.f, 2.f);
  for (int64_t i = 0; i < elements; ++i) {
    const float value = i < static_cast<int64_t>(values.size()) ? values[i] : fresh(rng);
    StoreElement(data->data(), dtype, i, value);
  }
  return true;
}

// Brings the tensor's data in line with its (changed) shape, keeping its dtype and values.
bool Refit(v1::Tensor* tensor, Random& rng) {
  const std::optional<DType> dtype = FromProtoDType(tensor->dtype());
  return dtype && SetData(tensor, *dtype, Values(*tensor, *dtype), rng);
}

DType AnyDType(Random& rng) {
  constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  return kDTypes[Pick(rng, 3)];
}

// One change to the options, for a query of `heads` heads.
void MutateOptions(v1::AttentionOptions* options, int64_t heads, Random& rng) {
  switch (Pick(rng, 11)) {
    case 4: {  // key_position: 0, small, or near (and past) the 2^62 limit
      const int64_t choice = Pick(rng, 4);
      options->set_key_position(choice == 0   ? 0
                                : choice == 3 ? (int64_t{1} << 62) - 2 + Pick(rng, 4)
                                              : Pick(rng, 40));
      break;
    }
    case 5:  // query_position: unset (bottom-right), small, or negative
      if (Pick(rng, 3) == 0) {
        options->clear_query_position();
      } else {
        options->set_query_position(static_cast<int64_t>(Pick(rng, 50)) - 2);
      }
      break;
    case 6:    // window_left: unset, 0, small, or negative (refused)
    case 7: {  // window_right: the same
      const int64_t choice = Pick(rng, 4);
      const int64_t value = choice == 1   ? 0
                            : choice == 2 ? static_cast<int64_t>(Pick(rng, 20))
                                          : static_cast<int64_t>(Pick(rng, 3)) - 3;
      const bool left = Pick(rng, 2) == 0;
      if (choice == 0) {
        left ? options->clear_window_left() : options->clear_window_right();
      } else if (left) {
        options->set_window_left(value);
      } else {
        options->set_window_right(value);
      }
      break;
    }
    case 8: {  // softcap: off, small, large, or refused (negative, infinite)
      const float choices[] = {0.f, 0.5f, 5.f, 50.f, -1.f, INFINITY};
      options->set_softcap(choices[Pick(rng, 6)]);
      break;
    }
    case 9: {  // ALiBi: none, one slope per query head (geometric, or negative), one too
               // many, or a refused (non-finite) one
      const int64_t choice = Pick(rng, 5);
      options->clear_alibi_slopes();
      if (choice == 0 || heads < 1 || heads > 64) break;
      for (int64_t h = 0; h < heads + (choice == 3); ++h) {
        options->add_alibi_slopes((choice == 2 ? -1.f : 1.f) *
                                  std::ldexp(1.f, -static_cast<int>(h % 8) - 1));
      }
      if (choice == 4) options->set_alibi_slopes(Pick(rng, heads), NAN);
      break;
    }
    case 10: {  // Sinks: none, one per query head (small, or far above every score), one
                // too many, or a refused (non-finite) one
      const int64_t choice = Pick(rng, 5);
      options->clear_sinks();
      if (choice == 0 || heads < 1 || heads > 64) break;
      for (int64_t h = 0; h < heads + (choice == 3); ++h) {
        options->add_sinks(choice == 2 ? 1e4f : 0.5f * static_cast<float>(h % 5) - 1.f);
      }
      if (choice == 4) options->set_sinks(Pick(rng, heads), Pick(rng, 2) ? NAN : -INFINITY);
      break;
    }
    case 0:
      options->set_causal(!options->causal());
      break;
    case 1:
      options->set_return_lse(!options->return_lse());
      break;
    case 2:
      options->set_output_dtype(static_cast<v1::DType>(Pick(rng, 4)));
      break;
    default:
      if (options->has_scale()) {
        options->clear_scale();
      } else {
        options->set_scale(std::uniform_real_distribution<float>(-3.f, 3.f)(rng));
      }
  }
}

// One structural change to the request; false when it did not apply.
bool MutateAttention(v1::AttentionRequest* request, Random& rng) {
  v1::Tensor* q = request->mutable_query();
  v1::Tensor* k = request->mutable_key();
  v1::Tensor* v = request->mutable_value();
  v1::Tensor* all[] = {q, k, v};
  v1::AttentionOptions* options = request->mutable_options();
  switch (Pick(rng, 14)) {
    case 0: {  // batch
      const int64_t batch = NewDim(rng, 1);
      for (v1::Tensor* t : all) SetDim(t, 4, batch);
      break;
    }
    case 1: {  // query heads and key/value heads, with the group size kept whole
      const int64_t kv_heads = 1 + Pick(rng, 4);
      const int64_t group = Pick(rng, 4) == 0 ? 1 + Pick(rng, 4) : 1;
      SetDim(q, 3, kv_heads * group);
      SetDim(k, 3, kv_heads);
      SetDim(v, 3, kv_heads);
      break;
    }
    case 2:  // query_len
      SetDim(q, 2, NewDim(rng, q->shape_size() >= 2 ? q->shape(q->shape_size() - 2) : 1));
      break;
    case 3: {  // key_len
      const int64_t key_len = NewDim(rng, k->shape_size() >= 2 ? k->shape(k->shape_size() - 2) : 1);
      SetDim(k, 2, key_len);
      SetDim(v, 2, key_len);
      break;
    }
    case 4: {  // head_dim
      const int64_t head_dim = NewDim(rng, 4) % 80 + 1;
      SetDim(q, 1, head_dim);
      SetDim(k, 1, head_dim);
      break;
    }
    case 5:  // value_dim
      SetDim(v, 1, NewDim(rng, 4) % 80 + 1);
      break;
    case 6: {  // rank: drop the leading dimension or add one
      const bool grow = q->shape_size() <= 2 || (q->shape_size() < 4 && Pick(rng, 2) == 0);
      const int64_t leading = 1 + Pick(rng, 3);
      for (v1::Tensor* t : all) {
        if (grow) {
          t->mutable_shape()->Add(leading);
          std::rotate(t->mutable_shape()->begin(), t->mutable_shape()->end() - 1,
                      t->mutable_shape()->end());
        } else if (t->shape_size() > 2) {
          t->mutable_shape()->erase(t->mutable_shape()->begin());
        }
      }
      break;
    }
    case 7: {  // one tensor's dtype, values kept (rounded)
      v1::Tensor* t = all[Pick(rng, 3)];
      const std::optional<DType> dtype = FromProtoDType(t->dtype());
      return dtype && SetData(t, AnyDType(rng), Values(*t, *dtype), rng);
    }
    case 8: {  // one tensor's magnitude: × 2^e, toward fp32's limits
      v1::Tensor* t = all[Pick(rng, 3)];
      const std::optional<DType> dtype = FromProtoDType(t->dtype());
      if (!dtype) return false;
      const float factor = std::ldexp(1.f, static_cast<int>(Pick(rng, 121)) - 60);
      std::vector<float> values = Values(*t, *dtype);
      for (float& value : values) value *= factor;
      return SetData(t, *dtype, values, rng);
    }
    case 9:  // block_k: the server's default, small, or past key_len
      options->set_block_k(Pick(rng, 3) == 0 ? 0 : 1 + Pick(rng, Pick(rng, 2) ? 8 : 300));
      return true;
    case 10: {
      const int rank = q->shape_size();
      MutateOptions(options, rank >= 3 ? q->shape(rank - 3) : 1, rng);
      return true;
    }
    case 11: {  // a ragged batch: none, the lengths cut in S pieces (some empty), or refused
                // (decreasing, not at the packed length, counts that differ, one side only)
      request->clear_cu_seqlens_q();
      request->clear_cu_seqlens_k();
      const int64_t choice = Pick(rng, 7);
      if (choice == 0) return true;
      const int64_t sequences = 1 + Pick(rng, 5);
      for (auto [cu, t] : {std::pair{request->mutable_cu_seqlens_q(), q},
                           std::pair{request->mutable_cu_seqlens_k(), k}}) {
        const int64_t total = t->shape_size() >= 2 ? t->shape(t->shape_size() - 2) : 1;
        std::vector<int64_t> cuts = {0, total};
        for (int64_t s = 1; s < sequences; ++s) cuts.push_back(Pick(rng, total + 1));
        std::sort(cuts.begin(), cuts.end());
        cu->Assign(cuts.begin(), cuts.end());
      }
      auto* q_cu = request->mutable_cu_seqlens_q();
      if (choice == 3 && q_cu->size() > 2) std::swap((*q_cu)[1], (*q_cu)[q_cu->size() - 2]);
      if (choice == 4) (*q_cu)[q_cu->size() - 1] += 1;
      if (choice == 5) request->add_cu_seqlens_k(request->cu_seqlens_k(sequences));
      if (choice == 6) request->clear_cu_seqlens_k();
      return true;
    }
    case 12: {  // a large answer from a small request: a wide value over one key, or many
                // query rows one element wide, each alone (the reply check's territory)
      const int64_t wide = 1 + Pick(rng, Pick(rng, 2) ? kMaxElements : 2048);
      if (Pick(rng, 2) == 0) {
        SetDim(k, 2, 1);
        SetDim(v, 2, 1);
        SetDim(v, 1, wide);
      } else {
        SetDim(q, 1, 1);
        SetDim(k, 1, 1);
        SetDim(q, 2, wide);
      }
      break;
    }
    default: {  // fresh values for one tensor
      v1::Tensor* t = all[Pick(rng, 3)];
      const std::optional<DType> dtype = FromProtoDType(t->dtype());
      return dtype && SetData(t, *dtype, {}, rng);
    }
  }
  for (v1::Tensor* t : all) {
    if (!Refit(t, rng)) return false;
  }
  return true;
}

// A traced row somewhere in the problem (or just past an edge).
v1::RowRef AnyRow(const v1::AttentionRequest& request, Random& rng) {
  const v1::Tensor& q = request.query();
  auto dim = [&](int from_end) {
    return q.shape_size() >= from_end ? q.shape(q.shape_size() - from_end) : 1;
  };
  v1::RowRef row;
  row.set_batch(Pick(rng, dim(4) + (Pick(rng, 8) == 0)));
  row.set_head(Pick(rng, dim(3) + (Pick(rng, 8) == 0)));
  row.set_row(Pick(rng, dim(2) + (Pick(rng, 8) == 0)));
  return row;
}

bool MutateTrace(v1::TraceRequest* request, Random& rng) {
  switch (Pick(rng, 4)) {
    case 0:
      *request->add_rows() = AnyRow(request->attention(), rng);
      return true;
    case 1:
      if (request->rows_size() == 0) return false;
      *request->mutable_rows(Pick(rng, request->rows_size())) = AnyRow(request->attention(), rng);
      return true;
    case 2:
      request->clear_rows();
      return true;
    default:
      return MutateAttention(request->mutable_attention(), rng);
  }
}

// The last `from_end` dimensions' size, or 1 when the tensor has fewer.
int64_t DimOf(const v1::Tensor& tensor, int from_end) {
  return tensor.shape_size() >= from_end ? tensor.shape(tensor.shape_size() - from_end) : 1;
}

// [heads, len, width] in `dtype`, values kept where they fit; false when not small.
bool Reshape(v1::Tensor* tensor, int64_t heads, int64_t len, int64_t width, DType dtype,
             Random& rng) {
  const std::optional<DType> old = FromProtoDType(tensor->dtype());
  const std::vector<float> values = old ? Values(*tensor, *old) : std::vector<float>();
  tensor->clear_shape();
  for (int64_t dim : {heads, len, width}) tensor->add_shape(dim);
  return SetData(tensor, dtype, values, rng);
}

// A token tree of n new tokens: each parent −1 or earlier, and now and then one refused entry.
void SetTree(v1::DecodeItem* item, int64_t n, Random& rng) {
  item->clear_tree_parents();
  for (int64_t i = 0; i < n; ++i) {
    item->add_tree_parents(static_cast<int32_t>(Pick(rng, i + 1)) - 1);
  }
  if (n > 0 && Pick(rng, 8) == 0) {
    const int64_t i = Pick(rng, n);
    item->set_tree_parents(i, Pick(rng, 2) ? static_cast<int32_t>(i) : -2);
  }
}

// One change to a cache step: the CreateCacheRequest's layout, kept in step with the (first)
// Decode item's query, key and value, or the item's new tokens, rows, tree, cut, positions or
// options. The item's tensors are then [heads, len, width] in the cache's dtype (the query keeps
// its own). False when it did not apply.
bool MutateCacheStep(v1::CreateCacheRequest* create, v1::DecodeRequest* decode, Random& rng) {
  if (decode->items_size() == 0) decode->add_items()->set_cache_id("c");
  v1::DecodeItem* item = decode->mutable_items(0);
  const std::optional<DType> query_dtype = FromProtoDType(item->query().dtype());
  // The tokens' dtype: the cache's, or bf16 for an fp8 cache (which quantizes them).
  std::optional<DType> dtype = FromProtoDType(TokenDTypeFor(create->dtype()));
  if (!dtype) dtype = DType::kFloat32;
  int64_t kv_heads = std::max<int64_t>(1, create->kv_heads());
  int64_t group = std::max<int64_t>(1, DimOf(item->query(), 3) / kv_heads);
  int64_t head_dim = std::max<int64_t>(1, create->head_dim());
  int64_t query_len = DimOf(item->query(), 2);
  int64_t n = item->has_key() ? DimOf(item->key(), 2) : 0;
  bool send_value = item->has_value();
  switch (Pick(rng, 12)) {
    case 0:  // kv_heads, and the query heads over them
      kv_heads = 1 + Pick(rng, 4);
      group = Pick(rng, 2) == 0 ? 1 : 1 + Pick(rng, 8);
      create->set_kv_heads(kv_heads);
      break;
    case 1:  // head_dim
      head_dim = NewDim(rng, head_dim) % 80 + 1;
      create->set_head_dim(head_dim);
      break;
    case 2: {  // value_dim: head_dim (0), smaller, or past head_dim (refused when latent)
      const int64_t choice = Pick(rng, 3);
      create->set_value_dim(choice == 0   ? 0
                            : choice == 1 ? 1 + Pick(rng, head_dim)
                                          : head_dim + 1 + Pick(rng, 8));
      break;
    }
    case 3:  // latent or not, the value sent accordingly (now and then not: refused)
      create->set_values_from_keys(!create->values_from_keys());
      send_value = !create->values_from_keys();
      if (create->values_from_keys() && create->value_dim() > head_dim) {
        create->set_value_dim(1 + Pick(rng, head_dim));
      }
      if (Pick(rng, 8) == 0) send_value = !send_value;
      break;
    case 4:  // the cache's dtype, the tokens' with it (an fp8 cache's: bf16)
      dtype = AnyDType(rng);
      create->set_dtype(Pick(rng, 4) == 0 ? v1::DTYPE_FLOAT8_E4M3 : ToProtoDType(*dtype));
      dtype = FromProtoDType(TokenDTypeFor(create->dtype()));
      break;
    case 5:  // new tokens: none, or a new count (a tree keeps one per token, one row each)
      n = Pick(rng, 6) == 0 ? 0 : NewDim(rng, std::max<int64_t>(n, 1)) % 300;
      if (item->tree_parents_size() > 0) {
        SetTree(item, n, rng);
        query_len = std::max<int64_t>(n, 1);
      }
      if (n > 0) send_value = !create->values_from_keys();
      break;
    case 6:  // query rows
      query_len = NewDim(rng, query_len);
      break;
    case 7:  // a token tree over the new tokens (one query row each), or none
      if (Pick(rng, 3) == 0 || n == 0) {
        item->clear_tree_parents();
      } else {
        SetTree(item, n, rng);
        query_len = n;
      }
      break;
    case 8: {  // the cut: none, within the cache, or past it (refused)
      const int64_t choice = Pick(rng, 4);
      if (choice == 0) {
        item->clear_truncate_to();
      } else {
        item->set_truncate_to(choice == 3 ? n + 1 + Pick(rng, 3) : Pick(rng, n + 1));
      }
      return true;
    }
    case 9:  // positions of the item's keys and query rows
      if (Pick(rng, 2) == 0) {
        item->set_key_position(Pick(rng, 40));
      } else if (Pick(rng, 3) == 0) {
        item->clear_query_position();
      } else {
        item->set_query_position(static_cast<int64_t>(Pick(rng, 50)) - 2);
      }
      return true;
    case 10:
      MutateOptions(decode->mutable_options(), kv_heads * group, rng);
      return true;
    default: {  // fresh values, or a magnitude × 2^e, for the query or the new tokens
      v1::Tensor* t = Pick(rng, 2) == 0 ? item->mutable_query() : item->mutable_key();
      const std::optional<DType> old = FromProtoDType(t->dtype());
      if (!old) return false;
      std::vector<float> values = Values(*t, *old);
      const float factor = std::ldexp(1.f, static_cast<int>(Pick(rng, 121)) - 60);
      for (float& value : values) value = Pick(rng, 2) == 0 ? 0.f : value * factor;
      return SetData(t, *old, Pick(rng, 2) == 0 ? std::vector<float>() : values, rng);
    }
  }
  // Every tensor of the item in step with the layout.
  const int64_t value_dim = create->value_dim() > 0 ? create->value_dim() : head_dim;
  if (!Reshape(item->mutable_query(), kv_heads * group, query_len, head_dim,
               query_dtype.value_or(*dtype), rng)) {
    return false;
  }
  if (n == 0) {
    item->clear_key();
    item->clear_value();
    return true;
  }
  if (!Reshape(item->mutable_key(), kv_heads, n, head_dim, *dtype, rng)) return false;
  if (!send_value) {
    item->clear_value();
    return true;
  }
  return Reshape(item->mutable_value(), kv_heads, n, value_dim, *dtype, rng);
}

}  // namespace
}  // namespace attn

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  attn::Random rng(seed);
  if (size < 1 || attn::Pick(rng, 2) == 0) return LLVMFuzzerMutate(data, size, max_size);
  std::string bytes;
  bool mutated = false;
  switch (attn::KindOf(data[0])) {
    case attn::InputKind::kTrace: {
      attention::v1::TraceRequest request;
      mutated = request.ParseFromArray(data + 1, static_cast<int>(size - 1)) &&
                attn::MutateTrace(&request, rng) && request.SerializeToString(&bytes);
      break;
    }
    case attn::InputKind::kAttention: {
      attention::v1::AttentionRequest request;
      mutated = request.ParseFromArray(data + 1, static_cast<int>(size - 1)) &&
                attn::MutateAttention(&request, rng) && request.SerializeToString(&bytes);
      break;
    }
    case attn::InputKind::kCacheStep: {
      attention::v1::CreateCacheRequest create;
      attention::v1::DecodeRequest decode;
      mutated = attn::ParseCacheStep(data + 1, size - 1, &create, &decode) &&
                attn::MutateCacheStep(&create, &decode, rng);
      if (mutated) bytes = attn::SerializeCacheStep(create, decode);
      break;
    }
  }
  if (!mutated || bytes.size() + 1 > max_size) return LLVMFuzzerMutate(data, size, max_size);
  std::memcpy(data + 1, bytes.data(), bytes.size());
  return bytes.size() + 1;
}
