// The client-side merge of partial attention states: the answers of several servers (or calls)
// that each attended the same query rows over a disjoint range of the keys, combined into the
// answer over all of them — `attn --shard-keys` (client/shard.h) and caches split over several
// servers (client/sharded_cache.h).
//
// A finished row of one part is its output O (already divided by its denominator) and its
// log-sum-exp lse. Read as an online-softmax state (kernels/online_softmax.h) it is
// {max = lse, denominator = 1, accumulator = O}: Σ exp(s − lse) = 1 over its keys and
// Σ exp(s − lse)·v = O. Merging such states with OnlineSoftmax::MergeInto — the same rule that
// combines key tiles inside a kernel — gives, for every row,
//   lse = log Σᵢ exp(lseᵢ),   O = Σᵢ exp(lseᵢ − lse) · Oᵢ,
// with every exponent taken against the running max, so nothing overflows. A part whose row saw
// no key (lse −inf: the causal mask hid its whole slice) adds nothing, whatever its output holds;
// a row no part saw comes out zeros with lse −inf, as a server answers it.
//
// Exactness: each part's output and lse must be fp32 (ask with return_lse and an fp32
// output_dtype); the merge itself works in fp32, adding a few ulps to the parts' own error, and
// sums in part order (so the result is deterministic but not bit-equal to one server's, whose
// sum runs in its own tile order).
//
// Thread-safe: pure functions.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"
#include "client/client.h"

namespace attn::client {

// Finished online-softmax states of the same query rows over disjoint key ranges:
// output [.., heads, nq, value_dim] fp32 values, lse [.., heads, nq] (natural log).
struct AttentionState {
  Array output;
  Array lse;
};

// Merges parts row by row: lse = log Σ exp(lseᵢ), output = Σ exp(lseᵢ − lse)·outputᵢ;
// a part whose row saw no key (lse −inf) adds nothing; a row no part saw is zeros, lse −inf.
// INVALID_ARGUMENT when parts is empty or their shapes disagree (with each other, or an lse
// shape that is not the output's without its last dimension, or values that do not fill a shape).
absl::StatusOr<AttentionState> MergeStates(const std::vector<AttentionState>& parts);

// Decodes one response made with return_lse (fp32 output) into a state (INVALID_ARGUMENT when
// lse is missing, a tensor does not decode, or the shapes disagree as above). An fp16/bf16
// output decodes too, but then carries that format's rounding into the merge.
absl::StatusOr<AttentionState> StateOf(const attention::v1::AttentionResponse& response);

}  // namespace attn::client
