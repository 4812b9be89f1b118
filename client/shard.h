// Sharding: one Naive or Tiled request split into parts for several attnd servers, by heads, by
// keys or both, and the parts' responses merged back into the request's answer. Pure functions
// over the request and response protos: nothing here talks to a server
// (client/multi_server_client.h sends the parts, retries them and owns the endpoints).
//
// By heads (SplitRequest). Every (batch, query head) of attention is computed on its own, and
// under grouped-query attention the query heads h·G … h·G+G−1 (G = heads / kv_heads) all read
// key/value head h. A request [B, H, N, D] × [B, K, M, D] therefore splits into B·K independent
// units, one per (batch, kv head): that kv head's key and value rows with the G query heads that
// read them. In row-major order each unit is a contiguous run of elements of every tensor, so a
// part — a contiguous range of u units — is sent as query [u, G, N, D], key [u, 1, M, D] and
// value [u, 1, M, Dv] (byte slices of the original data, no re-encoding), and the parts' outputs
// (and lse) concatenate back into the original [.., H, N, Dv] in order. Since each server
// computes each head on its own, the reassembled answer equals a single server's bit for bit
// (with the same backend and options).
//
// By keys (SplitKeys). The keys and values split along the sequence into slices [a, b), each
// sent with the whole query, key_position = the slice's first key's position (the request's
// key_position + a) and the whole problem's query_position (the request's, or its bottom-right
// default computed from the whole key_len), so each server's causal mask is its share of the
// whole one (attention.proto, AttentionOptions positions). Attention sinks go with the first
// slice only (a row's sink is one more logit of the whole row, counted once). Each slice asks for
// return_lse and an fp32 output; the finished states merge exactly (client/merge.h) and are then
// written in the request's output dtype, with lse only when it asked. The answer equals one
// server's to within fp32 rounding (a few ulps: the sum runs in another order), not bit for bit.
// Slices are balanced by visible work: every slice holds about the same number of (query row, key)
// pairs the causal mask lets through (without the mask: the same number of keys), and keys no query
// row sees are not sent. A key slice of a rank-4 key [B, K, M, D] is B·K runs of rows, one per
// (batch, kv head), again byte slices of the original data.
//
// By both (MultiServerClient's Sharding::kHeadsAndKeys): each head part's keys split as above — a
// grid of parts.
//
// A ragged batch (cu_seqlens) splits by heads only, each part [1, u·G, N, D] with the whole
// cu_seqlens; its keys are never split (each sequence's positions are its own, which one
// key_position per slice cannot give), so SplitKeys sends it whole.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/v1/attention.pb.h"

namespace attn::client {

// One part of a split request: units [first_unit, first_unit + units) of the request's
// B·kv_heads (batch, kv head) units, and keys [key_begin, key_end) of its key_len.
struct ShardPart {
  int64_t first_unit = 0;
  int64_t units = 0;
  int64_t key_begin = 0;
  int64_t key_end = 0;
  // True for a key slice of SplitKeys: `request` then carries positions, return_lse and an fp32
  // output, and its response is a partial state for MergeKeySlices. False: `request` is answered
  // as the original would be.
  bool key_slice = false;
  attention::v1::AttentionRequest request;
};

// Splits `request` into at most `max_parts` parts of whole (batch, kv head) units, as even as
// possible (with ALiBi slopes or sinks, a part crossing from one batch entry to the next is cut in
// two there, and each piece carries its query heads' slopes and sinks). A request that cannot be
// split — a single unit, shapes that do not agree, data of the wrong length — comes back as one
// part holding it unchanged (the server then answers it, or reports what is wrong with it). Each
// part holds all the keys (key_end = key_len; 0 for a request whose shapes do not agree).
std::vector<ShardPart> SplitRequest(const attention::v1::AttentionRequest& request, int max_parts);

// Adds a part's cost to `stats`, the merged response's (`first`: the first part's, copied
// whole): the largest block_k (a short key slice resolves the server's default block_k to its
// length), compute_ns and server_ns (the parts run concurrently); flops, intermediate, scratch and
// peak bytes summed.
void AddPartStats(attention::v1::ExecutionStats& stats, const attention::v1::ExecutionStats& part,
                  bool first);

// Reassembles the parts' responses (in the order SplitRequest gave the parts) into the response
// to `request`: output and lse concatenated and reshaped to the request's leading dimensions,
// stats added by AddPartStats. INTERNAL when a part's output does not have the size its shape
// needs.
absl::StatusOr<attention::v1::AttentionResponse> MergeResponses(
    const attention::v1::AttentionRequest& request, const std::vector<ShardPart>& parts,
    const std::vector<attention::v1::AttentionResponse>& responses);

// Splits `request`'s keys into at most `max_parts` key slices (key_slice true, all units each),
// balanced by visible work as above. Slice boundaries: with W(x) the visible (query row, key)
// pairs of one (batch, head) among keys [0, x) (Σᵢ |Visible(i) ∩ [0, x)|, the ranges
// kernels/geometry.h's Geometry::Visible defines for the causal mask and the window; N·x without
// either), the keys some row sees [F, S) (the rest are not sent) and P = min(max_parts, S − F),
// the s-th boundary is the smallest x with W(x) ≥ ⌈s·W(S)/P⌉; empty slices are dropped. When the
// default query_position (key_position + key_len − query_len) is negative (more query rows than
// keys), both positions are shifted up by as much: only their difference matters to the mask. A
// request that cannot be split — one key, max_parts < 2, a cache_id, shapes that do not agree or
// data of the wrong length, positions or windows outside [0, 2^62], no key any row sees — comes
// back as one part holding it unchanged (key_slice false; the server then answers it, or reports
// what is wrong with it).
std::vector<ShardPart> SplitKeys(const attention::v1::AttentionRequest& request, int max_parts);

// The response to `request` from the responses to its SplitKeys parts (in their order): a
// single part that is not a key slice answered it already; key slices' states (StateOf) are
// merged (MergeStates), the output written in the request's output dtype (unspecified: the
// query's; rounded to nearest even), lse only with return_lse. Stats by AddPartStats.
// INTERNAL when a response is not a state of the request's rows (a server's fault).
absl::StatusOr<attention::v1::AttentionResponse> MergeKeySlices(
    const attention::v1::AttentionRequest& request, const std::vector<ShardPart>& parts,
    const std::vector<attention::v1::AttentionResponse>& responses);

}  // namespace attn::client
