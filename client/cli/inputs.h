// Inputs for the attn CLI: the explainer's example or a random problem, as an AttentionRequest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"

namespace attn::cli {

struct Inputs {
  client::Array query, key, value;
  attention::v1::DType dtype = attention::v1::DTYPE_FLOAT32;
  // A ragged batch's cumulative lengths (AttentionRequest.cu_seqlens_q/k); empty: one sequence.
  std::vector<int64_t> cu_seqlens_q, cu_seqlens_k;
};

// The explainer's 8×4 example (rank 2): q[i][j] = ((i + j) % 5 − 2) · query_multiplier,
// k[i][j] = ((2i + j) % 7 − 3) / 2, v[i][j] = (i + j) % 9 − 4.
Inputs SeedExample(float query_multiplier);

// Uniform(−1, 1) inputs of shape [B, H, N, D] from a spec "B,H,N,D"; kv_heads (0 = H) must
// divide H. INVALID_ARGUMENT naming --random or --kv-heads when the spec is malformed.
absl::StatusOr<Inputs> RandomInputs(const std::string& spec, int64_t kv_heads, uint64_t seed,
                                    attention::v1::DType dtype);

// Parses "f32", "f16" or "bf16".
absl::StatusOr<attention::v1::DType> ParseDType(const std::string& name);
// ParseDType for tensors (a query, inline keys and values): fp8, a cache's dtype only, is
// INVALID_ARGUMENT saying where it goes.
absl::StatusOr<attention::v1::DType> ParseTensorDType(const std::string& name);

// Parses a --window spec "L,R" into options' window_left and window_right (AttentionOptions:
// a query at p sees keys at p − L … p + R): each side an integer ≥ 0, or empty or −1 for
// unbounded ("256," or "256,-1": left only; ",8": right only; "" sets neither).
// INVALID_ARGUMENT naming --window otherwise.
absl::Status ParseWindow(const std::string& spec, attention::v1::AttentionOptions* options);

// Parses an --alibi spec into options' alibi_slopes for `heads` query heads: "" sets none;
// "standard" the standard geometric slopes (client::StandardAlibiSlopes); else one finite slope
// per head, comma-separated. INVALID_ARGUMENT naming --alibi otherwise.
absl::Status ParseAlibi(const std::string& spec, int64_t heads,
                        attention::v1::AttentionOptions* options);

// Parses a --sinks spec into options' sinks for `heads` query heads: "" sets none; one finite
// value sets it for every head; else one per head, comma-separated. INVALID_ARGUMENT naming
// --sinks otherwise.
absl::Status ParseSinks(const std::string& spec, int64_t heads,
                        attention::v1::AttentionOptions* options);

// Parses a --seqlens spec into cumulative lengths (AttentionRequest.cu_seqlens_q/k): "Q1,Q2,…"
// (the keys' lengths the same) or "Q1,Q2,…/K1,K2,…", each length an integer ≥ 0, as many key
// lengths as query lengths, each side summing to ≥ 1. INVALID_ARGUMENT naming --seqlens
// otherwise.
absl::Status ParseSeqlens(const std::string& spec, std::vector<int64_t>* cu_seqlens_q,
                          std::vector<int64_t>* cu_seqlens_k);

// The request for these inputs with the given options.
attention::v1::AttentionRequest MakeRequest(const Inputs& inputs,
                                            const attention::v1::AttentionOptions& options);

}  // namespace attn::cli
