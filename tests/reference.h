// Test support: problems with fresh random inputs, the seed's example, and a float64
// reference to compare every kernel against.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/problem.h"

namespace attn::testing {

// A problem that owns its inputs: bytes in the storage dtype, and the same (already rounded)
// values as fp32 for the reference.
struct HostProblem {
  Shape shape;
  DType dtype = DType::kFloat32;         // Storage dtype of query, key and value.
  DType output_dtype = DType::kFloat32;  // Dtype the kernel writes.
  float scale = 1.f;
  float softcap = 0.f;  // AttentionOptions.softcap: s → softcap · tanh(s / softcap); 0 = none.
  // AttentionOptions.alibi_slopes: head h adds −alibi_slopes[h] · |p − t|; empty = none.
  std::vector<float> alibi_slopes;
  // AttentionOptions.sinks: one more logit of weight e^sink and no value in each row of head h;
  // empty = none.
  std::vector<float> sinks;
  bool causal = false;
  // Positions (kernels/geometry.h): key j at key_position + j, query row i at query_position + i
  // (bottom-right when unset).
  int64_t key_position = 0;
  std::optional<int64_t> query_position;
  // The window (AttentionOptions.window_left/right); unset = unbounded.
  std::optional<int64_t> window_left, window_right;
  // A ragged batch (AttentionRequest.cu_seqlens_q/k): cumulative lengths splitting the rows and
  // keys into sequences, each with its own positions (keys from 0, queries bottom-right); empty =
  // one sequence.
  std::vector<int64_t> cu_seqlens_q, cu_seqlens_k;
  // A token tree (DecodeItem.tree_parents): query row i is new token i, the key at key_len −
  // query_len + i, and among the new tokens sees only its ancestors and itself; tree_parents[i]
  // is its parent among them (−1: a child of the keys before). Empty = none. Set with SetTree,
  // which also fills tree_ancestors, the bitmasks the kernels read (View).
  std::vector<int32_t> tree_parents;
  std::vector<uint64_t> tree_ancestors;
  // A latent cache (KvLayout::values_from_keys, MLA): the value of key j is the first
  // value_dim columns of key j, and the reference reads it there. Set with SetValuesFromKeys,
  // which also rewrites value to match (for the kernels that read dense tensors); MakePaged then
  // makes a latent store.
  bool values_from_keys = false;
  int block_k = 64;
  bool return_lse = true;
  std::vector<uint8_t> query_bytes, key_bytes, value_bytes;
  std::vector<float> query, key, value;

  // A Problem viewing this object's bytes (valid while it lives, unmoved).
  Problem View() const;
  // Sets the token tree (query_len parents, each −1 or earlier than its token).
  void SetTree(std::vector<int32_t> parents);
  // Makes the values the keys' first value_dim columns (value_dim ≤ head_dim).
  void SetValuesFromKeys();
};

// A Shape from its seven dimensions, in Shape's field order.
Shape MakeShape(int64_t batch, int64_t heads, int64_t kv_heads, int64_t query_len, int64_t key_len,
                int64_t head_dim, int64_t value_dim);

// Sequence lengths → the cumulative lengths cu_seqlens take: {5, 1, 40} → {0, 5, 6, 46}.
std::vector<int64_t> CumulativeLengths(const std::vector<int64_t>& lengths);

// Fresh uniform(-1, 1) inputs (never zeros) rounded to `dtype`; scale = 1/sqrt(head_dim).
HostProblem RandomProblem(const Shape& shape, DType dtype, bool causal, int block_k, uint64_t seed);

// The problem over the first `length` of `full`'s keys and values (every kv head's first
// `length` rows), with the same query and options.
HostProblem KeyPrefix(const HostProblem& full, int64_t length);

// The explainer's 8×4 example: q[i][j] = ((i + j) % 5 − 2) · multiplier,
// k[i][j] = ((2i + j) % 7 − 3) / 2, v[i][j] = (i + j) % 9 − 4, scale 1/2.
HostProblem SeedExample(float query_multiplier = 1.f, int block_k = 64);

struct Reference {
  std::vector<double> output;  // [batch, heads, query_len, value_dim]
  std::vector<double> lse;     // [batch, heads, query_len]; −inf for rows that see no key
};

// Whether query row i sees key j, from the positions and the window as the contract states them
// (a query at position p sees a key at position t iff t ≤ p when causal, t ≥ p − window_left
// and t ≤ p + window_right when set; in a ragged batch, only keys of row i's own sequence),
// independent of kernels/geometry.h.
bool ReferenceSees(const HostProblem& problem, int64_t i, int64_t j);

// p − t for query row i and key j, from the positions as the contract states them (in a ragged
// batch, those of row i's sequence, whichever sequence key j lies in).
int64_t ReferenceDistance(const HostProblem& problem, int64_t i, int64_t j);

// Head h's ALiBi bias for query row i and key j, in float64 (0 without slopes).
double ReferenceBias(const HostProblem& problem, int64_t h, int64_t i, int64_t j);

// The key tiles of block_k keys holding a key row i sees, [first, end) ({0, 0} for none): the
// tiles a trace of the row steps through, found key by key with ReferenceSees.
std::pair<int64_t, int64_t> ReferenceTiles(const HostProblem& problem, int64_t i, int64_t block_k);

// Attention in float64 on the problem's (rounded) inputs, the softcap, the ALiBi bias and the
// sinks by their formulas (a sink adds e^sink to the row's sum and nothing to its values; a row
// that sees no key has output 0 and lse = sink): the ground truth.
Reference ReferenceAttention(const HostProblem& problem);

// A same-precision naive baseline, as an eager framework computes in fp16/bf16: scores,
// weights and output each rounded to `dtype` (fp32 accumulation inside the products).
std::vector<float> LowPrecisionBaseline(const HostProblem& problem, DType dtype);

// Output buffers for a kernel, poisoned with NaN so unwritten elements fail any comparison.
struct PoisonedOutputs {
  explicit PoisonedOutputs(const HostProblem& problem);
  Outputs outputs();
  std::vector<float> Output() const;  // Decoded to fp32.

  DType dtype;
  std::vector<uint8_t> output_bytes;
  std::vector<float> lse;
};

// Decodes `count` elements of a buffer in `dtype` to fp32.
std::vector<float> Decode(const void* data, DType dtype, int64_t count);

// max_i |actual_i − expected_i|; infinity if any actual value is NaN or they differ in size.
double MaxAbsError(const std::vector<float>& actual, const std::vector<double>& expected);
double MaxAbs(const std::vector<double>& values);

}  // namespace attn::testing
