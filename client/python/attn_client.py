"""attn_client: call attnd (attention.v1) from Python with NumPy arrays.

A small layer over grpcio and the stubs the build generates from proto/attention/v1/
attention.proto. It needs Debian's python3-grpcio and python3-numpy (i.e. /usr/bin/python3) and
finds the generated `attention.v1` package through PYTHONPATH:

    PYTHONPATH=build/release/python:client/python /usr/bin/python3 client/python/example.py

    import numpy as np
    from attn_client import Client

    client = Client("127.0.0.1:50051")              # token=..., tls_ca="ca.pem", timeout=30
    q = np.random.rand(4, 128, 64).astype(np.float32)  # [heads, seq, dim]
    result = client.tiled(q, q, q, causal=True, return_lse=True)
    result.output, result.lse, result.stats["compute_ns"]
    for event in client.trace(q, q, q, rows=[(0, 0, 5)], block_k=16):
        if event["kind"] == "step":
            print(event["tile"], event["max_after"], event["denominator"], event["estimate"])

Tensors: `q`, `k`, `v` are NumPy arrays of rank 2 [seq, dim], 3 [heads, seq, dim] or 4 [batch,
heads, seq, dim] (key/value heads may divide query heads: grouped-query attention). Element types:

    float32            sent as DTYPE_FLOAT32
    float16            sent as DTYPE_FLOAT16
    uint16             bfloat16 *bit patterns* (the upper half of each float32); NumPy has no
                       bfloat16, so pass dtype="bf16" to say so (a uint16 array without it is a
                       TypeError: it could be anything)

`dtype=` ("fp32", "fp16", "bf16", or np.float32 / np.float16) converts all three inputs to that
storage type instead: float arrays are rounded (to nearest even for bf16, like the server), so
`client.naive(q, k, v, dtype="bf16")` on float32 arrays works too. Without `dtype=`, float64 and
integer arrays are sent as float32. An attention_pb2.Tensor is passed through as it is. fp8
("fp8", DTYPE_FLOAT8_E4M3) is a KV cache's dtype only: as a tensor's dtype= or output_dtype= it
is a ValueError before any RPC (attnd answers a tensor sent in it INVALID_ARGUMENT naming the
field).
Arithmetic on the server is always fp32.

Results (`Result`): `.output` is float32 for fp32 output, float16 for fp16, and uint16 bfloat16
bits for bf16 (`.output_float32()` or `bf16_to_float32()` widens them); `.lse` a float32 array
[.., heads, query_len] when `return_lse=True`, else None; `.stats` a dict of ExecutionStats
(backend, device, block_k, compute_ns, server_ns, flops, intermediate_bytes, scratch_bytes,
peak_memory_bytes); `.response` the AttentionResponse itself.

Trace events are plain dicts, one per TraceEvent, with "kind" set to "start", "step",
"row_done" or "end" and the message's fields by their proto names; repeated floats (scores,
scaled_scores, biases, weights, accumulator, estimate, output, reference, and the "start"
event's alibi_slopes and sinks) are float32 NumPy arrays, single floats (a "row_done"'s lse,
max_abs_error and sink_share, ...) Python floats, repeated integers (the "start" event's
cu_seqlens_q and cu_seqlens_k) lists of ints, a step's "hidden" (why each key is hidden:
"HIDDEN_NONE", "HIDDEN_CAUSAL", "HIDDEN_WINDOW" or "HIDDEN_SEQUENCE"; empty without a mask) a
list of names, a RowRef is a (batch, head, row) tuple, ExecutionStats a dict and an unset
optional field None
(the "start" event's window_left / window_right when unbounded). `event["message"]` keeps the
protobuf message for anything else.

Server-resident KV caches keep one sequence's keys and values on attnd, so a decode step sends
only the new token's q, k and v:

    cache = client.create_cache(kv_heads=8, head_dim=128, dtype="bf16")   # a Cache
    cache.append(k, v)                     # k [8, n, 128], v [8, n, 128]; cache.length += n
    step = cache.decode(q, k1, v1)         # append one token, attend q [32, 1, 128] over all
    step.output                            # [32, 1, 128]
    batch = client.decode([(cache_a, qa, ka, va), (cache_b, qb, kb, vb)])   # one call, a batch
    batch.outputs[1], batch.caches[1]["length"]
    client.tiled(q, cache=cache)           # naive / tiled / trace over the cache's keys
    client.list_caches(); client.cache_info(cache); client.delete_cache(cache)

A `Cache` tracks the length it believes the cache has and sends it as expected_length on every
append, decode, truncate and fork (a retried call is then refused with FAILED_PRECONDITION
instead of storing tokens twice; `refresh()` re-reads the length). Cache ids (str) work
everywhere a Cache does, with expected_length passed explicitly. Keys and values for a Cache
are sent in its dtype (an fp8 Cache's as float32) unless `dtype=` says otherwise. Cache infos are
dicts of CacheInfo's fields (cache_id, kv_heads, head_dim, value_dim, dtype as a name ("fp32",
"fp16", "bf16", "fp8_e4m3"), length, bytes, page_tokens, durable_length, crc32c,
values_from_keys, shared_bytes; durable_length and crc32c None when the server did not send
them).

Latent caches (MLA, as DeepSeek-V3/R1 and Kimi K2 decode): create_cache(...,
values_from_keys=True) makes a cache that stores keys only; a token's value is the first
value_dim columns of its key (value_dim ≤ head_dim; None: head_dim), so the cache takes the
memory of its keys alone. Appends and decode steps then send the key alone:

    cache = client.create_cache(kv_heads=1, head_dim=576, value_dim=512, dtype="bf16",
                                values_from_keys=True)
    cache.append(c_kv)                     # [1, n, 576]: the compressed latent and rope key
    step = cache.decode(q, c_kv1)          # q [128, 1, 576] → output [128, 1, 512]
    client.decode([(cache, q, c_kv1)])     # a batch item: (cache, query, key)

A value given for a latent Cache is a ValueError naming it ("value", "items[i].value") before
any RPC (the server's answer for one sent anyway, e.g. with a cache id, is INVALID_ARGUMENT
naming the field); value_dim > head_dim is INVALID_ARGUMENT naming value_dim.
`cache.values_from_keys` (and the info dict's "values_from_keys") says which kind a cache is;
its replay tail keeps keys only, and its exports carry keys only.

fp8 caches: create_cache(..., dtype="fp8") ("fp8_e4m3", "float8_e4m3" or DTYPE_FLOAT8_E4M3
too) stores keys and values as fp8 E4M3 (OCP e4m3fn: bias 7, largest ±448, no infinities), each
row (one token of one kv head, a key or a value) with its own float32 scale, max |x| / 448, the
codes x / scale rounded to nearest even: about half a bf16 cache's bytes. attnd quantizes the
tokens it is sent, in any tensor dtype; a Cache sends its arrays as float32 (dtype="fp16" or
"bf16" sends them so; SharedTensors go in their own dtype), and its replay tail keeps them as
sent, so a refresh() re-quantizes the same values into the same bytes. `cache.dtype` is
"fp8_e4m3"; queries and outputs stay fp32, fp16 or bf16:

    cache = client.create_cache(kv_heads=8, head_dim=128, dtype="fp8")
    cache.append(k, v)                     # float32 [8, n, 128]: quantized by attnd
    step = cache.decode(q, k1, v1)         # q [32, 1, 128] → float32 output

Its exports carry the stored rows: chunk Tensors [kv_heads, n, width] of DTYPE_FLOAT8_E4M3 whose
data is, per row, the width codes, zero bytes up to a multiple of 4, then the row's
little-endian float32 scale ((width + 3) // 4 * 4 + 4 bytes a row).

Persistence and recovery: without attnd --cache-dir caches live in the server's memory only
(NOT_FOUND after a restart, a delete, or --cache-idle-seconds unused). With it they are written
behind to disk at most --cache-sync-seconds late and a restart restores them up to
`durable_length`, the tokens already fsynced, which every answer reports. A Cache keeps a
*replay tail*: every token it sent (append, and decode items with key/value), exactly as sent,
from the last durable_length it saw on (whole entries ending at or before it are dropped; none is
kept when the server does not persist). After a crash or restart, `refresh()` re-reads the
length L; when L is short of the Cache's length it re-sends tokens [L, length) from the tail
(appends with expected_length = L, the entry straddling L sliced along the token axis), so the
sequence continues where it was:

    try:
        step = cache.decode(q, k1, v1)
    except AttnError as error:             # UNAVAILABLE while attnd restarts, ...
        cache.refresh()                     # re-sends what the restart lost, then retry
    cache.replay_tail                       # [(start, n), ...]: what it could re-send

When the tail does not reach back to L (tokens sent before a durable_length that the server
then lost, e.g. a damaged file), refresh() raises AttnError DATA_LOSS saying so: the sequence
must be prefilled again; the Cache is left as it was. A draining attnd --drain-to PEER hands its
caches over and then answers NOT_FOUND ending "moved_to=HOST:PORT": a Cache's append, decode
and refresh follow that once (a Client to HOST:PORT with the same token, TLS, timeout and
message size, shared by the Client's Caches, closed with it) and retry the call; `cache.client`
is then that Client.

Speculative decoding: a cache can be cut back to its first `length` tokens (TruncateCache),
dropping the draft tokens the target model rejected; it is then exactly a cache that never had
them (the next decode gives the same bits), and with attnd --cache-dir the cut is on disk before
the answer. A step verifies k drafts at once, and the next step cuts and appends in one Decode:

    n = cache.length
    step = cache.decode(q, k_new, v_new, causal=True)  # k + 1 new tokens (the last accepted
                                                        # one and k drafts), q [heads, k + 1, d]
    kept = n + 1 + accepted                             # accepted: the drafts the model kept
    step = cache.decode(q1, k1, v1, truncate_to=kept, causal=True)   # cut, append, attend
    # or in two calls: cache.truncate(kept); cache.decode(q1, k1, v1, causal=True)

Cache.truncate(length) and Client.truncate_cache(cache, length, expected_length=None) → the
CacheInfo dict. expected_length is the length before the cut (a Cache's `length` by default; not
checked for an id given without one): FAILED_PRECONDITION naming the actual length when it is
stale; a length past the cache's is OUT_OF_RANGE; either way the cache is left as it was. In
decode a dict item's "truncate_to" (Cache.decode's truncate_to=) cuts the item's cache to that
length before its key/value are appended, atomically with the batch (if any item fails, every
cache keeps the tokens it had); the item's expected_length is still the length before the cut.
A length, truncate_to or expected_length that is not an int (a bool included) is a TypeError,
a negative one a ValueError, each naming the argument, before any RPC. A Cache's cut cuts its
replay tail too (entries past the cut dropped, the one straddling it sliced), so refresh() never
re-sends a cut token. A call carrying a cut that fails without the server refusing it
(UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...: it may have been applied) cuts the tail all the
same, and the next refresh() re-sends tokens only up to the cut, taking the server's info when it
holds at least that many; any other failure (INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE,
NOT_FOUND, ...) leaves the Cache as it was.

Forks (ForkCache; parallel sampling, beam search, a shared system prompt): a new cache whose
tokens are the first `length` tokens of another (None: all of them), sharing its pages instead
of copying them. Neither ever writes into a page the other holds (an append into a shared, partly
filled page copies that page first), so the two change independently from then on, and a Decode
over the fork gives the bits one over a copy would. Shared pages count once against attnd
--cache-bytes (info "shared_bytes": of "bytes", those in pages another cache holds too), and
deleting the source keeps what its forks use. Sampling n continuations of one prompt:

    prompt = client.create_cache(kv_heads=8, head_dim=128, dtype="bf16")
    prompt.append(k, v)                                  # the prompt, sent and stored once
    samples = [prompt.fork() for _ in range(n)]          # n Caches, no token copied
    batch = client.decode([(s, q[i], k1[i], v1[i]) for i, s in enumerate(samples)])
    head = prompt.fork(length=system_tokens)             # a prefix: the system prompt alone

Cache.fork(length=None) → a Cache for the fork, and Client.fork_cache(cache, length=None,
expected_length=None) → the fork's CacheInfo dict. expected_length is the source's length (a
Cache's `length` by default; not checked for an id given without one): FAILED_PRECONDITION naming
the actual length when it is stale; a length past the source's is OUT_OF_RANGE, and at attnd
--max-caches the fork is RESOURCE_EXHAUSTED; a refused fork creates nothing and leaves the
source as it was. length and expected_length are checked as truncate's are (TypeError /
ValueError naming the argument, before any RPC). With attnd --cache-dir the fork's tokens are on
disk before the answer (durable_length = length), so its Cache starts with an empty replay tail.
A fork whose answer was lost (UNAVAILABLE, DEADLINE_EXCEEDED, ...) may exist all the same:
list_caches() shows it.

Token trees (EAGLE, Medusa, SpecInfer): a step can verify a tree of drafts instead of one chain.
tree_parents= (Cache.decode; a dict item's "tree_parents" in decode) gives each new token the
index of its parent among the item's new tokens (−1: a child of the cached prefix; otherwise an
earlier token, 0 ≤ parent < i). The query then has one row per new token (nq = the new tokens),
and row i attends over the cached prefix, token i's ancestors and token i itself, never over the
other branches: its output is what a plain causal decode over the prefix and that one branch
gives (the target model's next-token input at node i). New token i sits at position n + i (its
index, not its depth) for the causal mask, windows and ALiBi; rotate q and k by depth yourself
(RoPE) before sending. Lay the tree out depth first, the likeliest child first, so the path the
model usually accepts is a prefix of the new tokens and truncate_to keeps it in place:

    n = cache.length
    # t0 (the last accepted token) → {a, b}; a → {c, d}; b → {e}; plus f, a second root.
    parents = [-1, 0, 0, 1, 1, 2, -1]                   # t0 a b c d e f, depth first
    step = cache.decode(q, k_new, v_new, tree_parents=parents, causal=True)  # q [heads, 7, d]
    path = [0, 1, 3]                                    # t0 → a → c, accepted by the model
    if path == list(range(len(path))):                  # a prefix: cut the rest of the tree
        step = cache.decode(q1, k1, v1, truncate_to=n + len(path), causal=True)
    else:                                               # cut the tree, send the path again
        k1 = np.concatenate([k_new[:, path], k1], axis=1)   # and v1 likewise
        step = cache.decode(q1, k1, v1, truncate_to=n, causal=True)

The client checks tree_parents before any RPC: a sequence or 1-D array of ints (TypeError naming
tree_parents[j] for anything else, a bool included), each −1 or earlier than its index
(ValueError naming tree_parents[j]); the server checks the counts: INVALID_ARGUMENT naming
items[i].tree_parents (not one entry per new token, or more than 1024) or items[i].query (not
one row per new token). An empty tree_parents (or None) is no tree.

Export and import (bit-exact, in the cache's dtype):

    chunks = client.export_cache(cache)                 # [CacheChunk, ...]
    client.export_cache(cache, "seq.attnexp")           # a file → the export's info dict
    copy = other.import_cache("seq.attnexp")            # a Cache, the same id when free there
    copy = other.import_cache(chunks, new_id_if_taken=True)

The file is `attn cache export`'s: 8 bytes "ATTNEXP1", then per CacheChunk a u32 little-endian
length and the serialized chunk. The last chunk's crc32c is the CRC32C of every chunk's key
bytes then value bytes; `crc32c(data, crc=0)` computes it (pure Python; zlib.crc32 is another
polynomial), and export_cache(..., verify=True) checks it. The target refuses a cut or damaged
stream whole (DATA_LOSS) and an id it already has (ALREADY_EXISTS, unless new_id_if_taken).

Positions: naive, tiled and trace take key_position (key j is at key_position + j; default 0)
and query_position (query row i at query_position + i; None: bottom-right), which the causal
mask compares; in decode they are per item. They let one causal problem be split by keys over
several calls or servers, the parts merged with `merge_states`:

    parts = [client.tiled(q, k[..., a:b, :], v[..., a:b, :], causal=True, key_position=a,
                          query_position=key_len - query_len, return_lse=True,
                          output_dtype="fp32") for a, b in ((0, 100), (100, key_len))]
    output, lse = merge_states([(p.output, p.lse) for p in parts])

(With sinks, only the first slice, at the sequence's first key, is sent with them; see
"Attention sinks" below.)

Sliding window: naive, tiled, trace and decode also take window_left and window_right
(FlashAttention's window_size; None, the default: unbounded on that side). A query at position
p then sees only the keys at positions t with

    p − window_left ≤ t ≤ p + window_right        (and t ≤ p when causal)

so `client.tiled(q, k, v, causal=True, window_left=4095)` gives the query at p the keys at
p − 4095 … p. Both are ints in [0, 2^62]. The window is over the positions above, so a slice of
a windowed problem's keys sent at its key_position computes exactly its part of the whole, to
merge as before. In decode the window is the batch's and applies to every item against that
item's own positions; the trace's "start" event repeats it.

Softcap: naive, tiled, trace and decode also take softcap (Gemma 2, Grok; 0.0, the default:
off). Each scaled score s = scale · q·k then becomes

    softcap · tanh(s / softcap)

after the scale and before the mask (FlashAttention's order), so every score lies within
±softcap (fp32's tanh reaches ±1); the lse is of the capped scores. softcap is a real number
≥ 0, finite in float32 (it is sent as a float): `client.tiled(q, k, v, causal=True,
softcap=50.0)`. In decode it is the batch's and applies to every item; the trace's "start"
event repeats it (0.0: none), and with a softcap each "step" has "scaled_scores", the tile's
scores before the cap (masked keys included), next to "scores", the capped and masked ones;
without one it is empty.

ALiBi: naive, tiled, trace and decode also take alibi_slopes (BLOOM, MPT; None, the default:
no bias), one slope per query head. Query head h adds

    −alibi_slopes[h] · |p − t|

to the score of the key at position t for the query at position p (the positions above), after
the softcap and before the mask: score = softcap(scale · q·k) − slope · |p − t|; the lse is of
the biased scores. alibi_slopes is a sequence or 1-D array of finite numbers (sent as floats, so
finite in float32 too), or "standard": `standard_alibi_slopes(heads)` for the query's head
count, the geometric slopes 2^(−8(h+1)/H) of BLOOM for a power of two H:
`client.tiled(q, k, v, causal=True, alibi_slopes="standard")`. The server checks the count
(INVALID_ARGUMENT naming options.alibi_slopes). A key slice sent at its key_position is biased
as in the whole problem, so split problems still merge. In decode the slopes are the batch's
(every item's query must have that many heads; "standard" counts the first item's). The trace's
"start" event repeats them as "alibi_slopes" (empty: none), and with them each "step" has
"biases", each key's −slope · |p − t| (masked keys included), and "scaled_scores", the scores
before softcap and bias, next to "scores" = softcap(scaled_scores) + biases (−inf where
masked); without ALiBi "biases" is empty.

Attention sinks: naive, tiled, trace and decode also take sinks (gpt-oss, StreamingLLM; None,
the default: none), one logit per query head. sinks[h] joins every softmax row of query head
h as one more score that takes weight but contributes no value:

    out = Σ_j e^(x_j − m) v_j / (Σ_j e^(x_j − m) + e^(sink − m)),  m = max(max_j x_j, sink)
    lse = log(Σ_j e^(x_j) + e^(sink))

where x_j are the row's scores after the scale, softcap, ALiBi bias and mask; the sink itself
is not scaled, capped, biased or masked. The output's weights then sum to 1 − e^(sink − lse),
and a row that sees no key gives zeros and lse = sink. sinks is a sequence or 1-D array of
finite numbers (sent as floats, so finite in float32 too; the client raises ValueError naming
sinks[h] otherwise): `client.tiled(q, k, v, causal=True, sinks=[0.5] * heads)`. The server
checks the count (INVALID_ARGUMENT naming options.sinks). The sink belongs to a row once, not
to each key slice: a problem split by keys sends the sinks only with the slice that starts the
sequence (the first, at the whole problem's first key_position) and the other slices without;
merge_states then gives exactly the unsplit answer (the first part's lse already holds
e^sink). In decode the sinks are the batch's (every item's query must have that many heads),
each item's rows taking them once. The trace's "start" event repeats them as "sinks" (empty:
none); a "step" never includes the sink (its estimate is of the keys so far): it joins the row
once, after the row's last tile, so "row_done"'s output, reference and lse include it and its
"sink_share" is the weight the sink took, e^(sink − lse) (0.0 without sinks).

Ragged batches: naive, tiled and trace (with inline keys, not cache=) also take cu_seqlens_q
and cu_seqlens_k (FlashAttention's varlen; None, the default: one sequence), S sequences of
different lengths packed along the rows: both sequences or 1-D arrays of ints, S + 1 each,
cumulative lengths from 0 to the packed length (`cumulative_lengths([5, 1, 40])` = [0, 5, 6,
46]). q is then [heads, total_q, head_dim] (rank 2 or 3, or rank 4 with batch 1), k and v
[kv_heads, total_k, ·]; the output is [heads, total_q, value_dim] and the lse [heads, total_q].
Sequence s is query rows and keys

    [cu_seqlens_q[s], cu_seqlens_q[s+1])  and  [cu_seqlens_k[s], cu_seqlens_k[s+1])

and its rows see only its keys, at its own positions: its keys at 0 …, its queries bottom-right
against them (its last row at its last key), so causal, the window, softcap, ALiBi and sinks
apply to each sequence exactly as if it were a request of its own:

    cu_q, cu_k = cumulative_lengths(q_lens), cumulative_lengths(k_lens)
    client.tiled(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

A sequence may be empty; a row that sees no key gives zeros and lse −inf. key_position and
query_position must be left unset (each sequence has its own), and the server checks the values
(INVALID_ARGUMENT naming the field: "cu_seqlens_q[0]" not 0, "cu_seqlens_k[2]" decreasing,
"cu_seqlens_q[3]" not ending at the packed length, "cu_seqlens_k" with a different count,
"query.shape[0]" for a batch > 1, "options.key_position"); the client raises ValueError only
for what cannot be sent (a non-integer, or one of the two without the other). The trace's
"start" event repeats them as "cu_seqlens_q" and "cu_seqlens_k" (empty: one sequence; its
key_position and query_position are then 0), rows are (0, head, packed row), and a step's
"hidden" marks the keys of other sequences "HIDDEN_SEQUENCE".

Shared memory (attnd --allow-shared-memory; client.info()["shared_memory"] says whether it is
on): a caller on attnd's machine can leave a tensor's bytes in a file in /dev/shm it registered
instead of sending them, and have an output written there instead of into the answer:

    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    region = client.register_shared_memory("io", shm)        # a SharedRegion, key "/" + shm.name
    region.array(0, (8, 64, 128), "fp16")[:] = q             # a NumPy view: write in place
    qs = region.tensor(0, (8, 64, 128), "fp16")              # a SharedTensor naming those bytes
    out = region.tensor(qs.nbytes, (8, 64, 128), "fp16")
    result = client.tiled(qs, qs, qs, causal=True, output_to=out)
    result.output                                            # a view of out's bytes (no copy)
    del result; client.unregister_shared_memory("io"); shm.close(); shm.unlink()

A SharedTensor(region, offset, shape, dtype) (region: a SharedRegion or a region's name) is
accepted wherever an input array is: naive() and tiled() q, k, v, decode items' query, key and
value, append() and Cache.decode(); its bytes are sent as they are (a dtype= or Cache dtype
asking for another is a ValueError). output_to= (naive, tiled, Cache.decode; a decode item's
"output_to") must have the output's dtype (ValueError) and byte size (INVALID_ARGUMENT naming
output_to.byte_size); the output is then a view of that range when this client knows the
region's memory (registered here from a SharedMemory), else None, `.response` naming the range;
the lse stays in the answer. Regions belong to the caller's identity (its client certificate
under mutual TLS): another gets NOT_FOUND. attnd's errors: FAILED_PRECONDITION naming
--allow-shared-memory when off, NOT_FOUND naming the field ("query.shared_memory.region") for a
region the caller has not registered, INVALID_ARGUMENT for a byte_size other than the shape's,
OUT_OF_RANGE for a range past the region, FAILED_PRECONDITION naming the tensor for a file
truncated under the call. trace() takes inline tensors only. A Cache's replay tail
keeps a copy of tokens sent in shared memory when it must keep them (read from the
SharedRegion's memory as the call returns); tokens in a region it cannot read (given by name,
or registered by key) cannot be re-sent, and refresh() answers DATA_LOSS for a loss reaching
them. Views hold the SharedMemory's buffer: drop them before shm.close() (BufferError).

Errors: every failed RPC raises `AttnError` (`.code`, a grpc.StatusCode; `.message`, the
server's text, which names the offending field for INVALID_ARGUMENT). Arguments the client can
check itself (rank, element type, option types) raise ValueError or TypeError before any RPC.

A Client is safe to share between threads (the grpc channel is). Use it as a context manager,
or call close(), to release the channel.
"""

import math
import numbers
import os
import re
import struct
import threading
from multiprocessing import shared_memory as _shared_memory

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from attention.v1 import attention_pb2 as pb
from attention.v1 import attention_pb2_grpc as pb_grpc

__all__ = ["Client", "Result", "Cache", "DecodeResult", "AttnError", "bf16_to_float32",
           "float32_to_bf16", "merge_states", "seed_example", "standard_alibi_slopes",
           "cumulative_lengths", "crc32c", "SharedRegion", "SharedTensor", "EXPORT_FILE_MAGIC",
           "MAX_MESSAGE_BYTES", "MAX_POSITION"]

# Like the C++ client (client/client.h) and attnd's default --max-message-bytes.
MAX_MESSAGE_BYTES = 1 << 30

# A tensor's dtypes (inputs, outputs, and the tokens sent to any cache).
_DTYPES = {
    "fp32": pb.DTYPE_FLOAT32, "float32": pb.DTYPE_FLOAT32,
    "fp16": pb.DTYPE_FLOAT16, "float16": pb.DTYPE_FLOAT16,
    "bf16": pb.DTYPE_BFLOAT16, "bfloat16": pb.DTYPE_BFLOAT16,
}
# fp8 E4M3 (OCP e4m3fn): a KV cache's storage dtype only, never a tensor's (stubs generated
# before it lack the name; it is 4 on the wire).
_FLOAT8 = getattr(pb, "DTYPE_FLOAT8_E4M3", 4)
_FP8_NAMES = frozenset(("fp8", "fp8_e4m3", "float8_e4m3", "float8_e4m3fn"))
_DTYPE_NAMES = {pb.DTYPE_FLOAT32: "fp32", pb.DTYPE_FLOAT16: "fp16", pb.DTYPE_BFLOAT16: "bf16",
                _FLOAT8: "fp8_e4m3"}
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class AttnError(Exception):
    """A failed RPC: `code` is the grpc.StatusCode, `message` the server's details."""

    def __init__(self, rpc, code, message):
        self.rpc = rpc
        self.code = code
        self.message = message or ""
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        super().__init__("%s failed: %s: %s" % (rpc, name, self.message))

    @classmethod
    def from_rpc_error(cls, rpc, error):
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(rpc, code, details)


# --- bfloat16 -----------------------------------------------------------------------------------

def seed_example():
    """The explainer's 8×4 example as float32 arrays q, k, v (rank 2; its scale is 1/2 = 1/√4):
    q[i][j] = (i + j) % 5 − 2, k[i][j] = ((2i + j) % 7 − 3) / 2, v[i][j] = (i + j) % 9 − 4."""
    i, j = np.meshgrid(np.arange(8), np.arange(4), indexing="ij")
    q = ((i + j) % 5 - 2).astype(np.float32)
    k = (((2 * i + j) % 7 - 3) / 2).astype(np.float32)
    v = ((i + j) % 9 - 4).astype(np.float32)
    return q, k, v


def bf16_to_float32(bits):
    """bfloat16 bit patterns (a uint16 array) → float32 values, exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError("bf16_to_float32 takes a uint16 array of bfloat16 bits, not %s"
                        % bits.dtype)
    return (bits.astype("<u4") << 16).view("<f4")


def float32_to_bf16(values):
    """float values → bfloat16 bit patterns (uint16), rounded to nearest even as attnd does.
    NaNs stay NaN (quiet)."""
    values = np.ascontiguousarray(values, dtype="<f4")
    bits = values.view("<u4")
    # In place from here: one temporary, 32-bit (8× faster than 64-bit on large arrays), the
    # ufuncs called with NumPy scalars (a Python int costs each call a type resolution: on a
    # decode step's few thousand elements the calls, not the elements, are the cost).
    rounded = np.right_shift(bits, _U32_16)
    np.bitwise_and(rounded, _U32_1, out=rounded)
    np.add(rounded, bits, out=rounded)
    # Below 2^32 for every non-NaN: at most 0xFF800000 + 0x8000.
    np.add(rounded, _U32_ROUNDING, out=rounded)
    # The rounded high halves: the odd uint16s of little-endian uint32s.
    result = rounded.view("<u2")[..., 1::2].copy()
    nan = np.isnan(values)
    if np.logical_or.reduce(nan, axis=None):
        result[nan] = (bits[nan] >> 16) | 0x40
    return result


_U32_1, _U32_16, _U32_ROUNDING = np.uint32(1), np.uint32(16), np.uint32(0x7FFF)


# --- CRC32C -------------------------------------------------------------------------------------

def _crc32c_tables():
    """Slicing-by-8 tables of CRC32C: table 0 is the byte-at-a-time one (reflected polynomial
    0x82F63B78), table k advances a byte's contribution by k more zero bytes."""
    first = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        first.append(crc)
    tables = [first]
    for _ in range(7):
        tables.append([(crc >> 8) ^ first[crc & 0xFF] for crc in tables[-1]])
    return tuple(tuple(table) for table in tables)


_CRC32C_TABLES = _crc32c_tables()


def crc32c(data, crc=0):
    """CRC32C (Castagnoli, reflected polynomial 0x82F63B78, as iSCSI, ext4 and attnd use it) of
    `data` (bytes-like), extending `crc`, the checksum of what came before, as attn::Crc32c
    does: crc32c(b, crc32c(a)) == crc32c(a + b); crc32c(b"123456789") == 0xE3069283. Pure
    Python with tables (8 bytes a step, some 8 MB/s); zlib.crc32 is a different polynomial."""
    if isinstance(crc, bool) or not isinstance(crc, numbers.Integral) or not 0 <= crc < 1 << 32:
        raise ValueError("crc must be a CRC32C value, an int in [0, 2^32), not %r" % (crc,))
    data = memoryview(data).cast("B")
    t0, t1, t2, t3, t4, t5, t6, t7 = _CRC32C_TABLES
    crc = int(crc) ^ 0xFFFFFFFF
    whole = len(data) - len(data) % 8
    for low, high in struct.iter_unpack("<II", data[:whole]):
        low ^= crc
        crc = (t7[low & 0xFF] ^ t6[(low >> 8) & 0xFF] ^ t5[(low >> 16) & 0xFF] ^ t4[low >> 24]
               ^ t3[high & 0xFF] ^ t2[(high >> 8) & 0xFF] ^ t1[(high >> 16) & 0xFF]
               ^ t0[high >> 24])
    for byte in data[whole:]:
        crc = t0[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# --- Merging the parts of a split problem ------------------------------------------------------

def merge_states(parts):
    """Merges attention over disjoint key ranges of the same queries → (output, lse).

    parts: a sequence of (output, lse) pairs (or Results) from calls with return_lse=True and
    an fp32 output (output_dtype="fp32"), each over a slice of the keys: output
    [..., heads, nq, value_dim] and lse [..., heads, nq], the same shapes in every part. For a
    causal problem, send each slice [a, b) with key_position=a and the whole problem's
    query_position (see naive()). Returns float32 arrays of the same shapes, what one call over
    all the keys would give (up to fp32 rounding), by DESIGN.md's merge of finished rows
    (natural log):

        lse    = log Σᵢ exp(lseᵢ)
        output = Σᵢ exp(lseᵢ − lse) · outputᵢ

    computed stably as m = maxᵢ lseᵢ, wᵢ = exp(lseᵢ − m), lse = m + log Σᵢ wᵢ, output =
    Σᵢ wᵢ · outputᵢ / Σᵢ wᵢ, in float64. A part whose row saw no key (lse −inf) contributes
    nothing to it, whatever its output row holds; a row that no part saw gives zeros and lse
    −inf, never NaN. ValueError for an empty list, mismatched shapes, or an lse that is NaN
    or +inf; TypeError for parts that are not pairs of number arrays (uint16 bf16 bits
    included: pass output_dtype="fp32").

    Attention sinks (sinks=) need nothing here, provided the sink is counted once: send the
    sinks only with the part whose slice starts the sequence (key_position of the whole
    problem's first key) and the other parts without. That part's lse already includes
    e^sink, and its output the sink's share of the denominator, so the parts merge exactly to
    the unsplit answer with sinks (a row that saw none of that slice's keys has lse = sink
    and output 0 there, and still gives the sink its weight in the merge). Parts that each
    carried the sinks would count the sink once per part."""
    if isinstance(parts, (str, bytes)) or not hasattr(parts, "__iter__"):
        raise TypeError("parts must be a sequence of (output, lse) pairs, not %s"
                        % type(parts).__name__)
    parts = list(parts)
    if not parts:
        raise ValueError("merge_states needs at least one (output, lse) part, got none")
    outputs, lses = [], []
    for index, part in enumerate(parts):
        if hasattr(part, "output") and hasattr(part, "lse"):
            output, lse = part.output, part.lse
        elif isinstance(part, (tuple, list)) and len(part) == 2:
            output, lse = part
        else:
            raise TypeError("parts[%d] must be an (output, lse) pair or a Result, not %s"
                            % (index, type(part).__name__))
        if lse is None:
            raise ValueError("parts[%d] has no lse: call with return_lse=True" % index)
        for name, array in (("output", output), ("lse", lse)):
            array = np.asarray(array)
            if array.dtype.kind not in "fi":  # uint16 would be bf16 bits, not values.
                raise TypeError("parts[%d] %s has element type %s; expected float values (an "
                                "fp32 output: output_dtype='fp32')" % (index, name, array.dtype))
        output = np.asarray(output, dtype=np.float64)
        lse = np.asarray(lse, dtype=np.float64)
        if output.ndim < 2 or lse.shape != output.shape[:-1]:
            raise ValueError("parts[%d]: output shape %s and lse shape %s do not match; expected "
                             "output [..., heads, nq, value_dim] and lse [..., heads, nq]"
                             % (index, output.shape, lse.shape))
        if index > 0 and output.shape != outputs[0].shape:
            raise ValueError("parts[%d] output shape %s differs from parts[0]'s %s: every part "
                             "must hold the same queries" % (index, output.shape,
                                                             outputs[0].shape))
        if np.isnan(lse).any() or np.isposinf(lse).any():
            raise ValueError("parts[%d] lse holds NaN or +inf" % index)
        outputs.append(output)
        lses.append(lse)
    lse = np.stack(lses)                                  # [parts, ..., heads, nq]
    output = np.stack(outputs)                            # [parts, ..., heads, nq, value_dim]
    row_max = lse.max(axis=0)
    seen = np.isfinite(row_max)                           # Rows some part saw.
    safe_max = np.where(seen, row_max, 0.0)               # Never −inf − (−inf).
    weights = np.exp(lse - safe_max)                      # 0 where a part's lse is −inf.
    total = np.where(seen, weights.sum(axis=0), 1.0)      # ≥ 1 on a seen row (the max's part).
    with np.errstate(invalid="ignore"):                   # 0 · inf in an unseen part's row.
        weighted = np.where(weights[..., None] > 0, weights[..., None] * output, 0.0)
    merged = np.where(seen[..., None], weighted.sum(axis=0) / total[..., None], 0.0)
    merged_lse = np.where(seen, safe_max + np.log(total), -np.inf)
    return merged.astype(np.float32), merged_lse.astype(np.float32)


# --- Shared memory ------------------------------------------------------------------------------

# How each DType's elements sit in memory (bf16: its bit patterns).
_STORAGE = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_FLOAT16: np.dtype("<f2"),
            pb.DTYPE_BFLOAT16: np.dtype("<u2")}
# A region's name (RegisterSharedMemoryRequest.name).
_REGION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}\Z")


def _region_name(name, what="name"):
    """A region name → itself; TypeError / ValueError naming `what` for anything but 1 to 128
    characters of [A-Za-z0-9_.-]."""
    if not isinstance(name, str):
        raise TypeError("%s must be a region name (str), not %s" % (what, type(name).__name__))
    if not _REGION_NAME.match(name):
        raise ValueError("%s %r: a region name is 1 to 128 characters of [A-Za-z0-9_.-]"
                         % (what, name))
    return name


def _byte_count(name, value):
    """An offset or byte size → the int to send; TypeError / ValueError naming it for a non-int
    (a bool included) or one outside [0, 2^63)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError("%s must be an int (bytes), not %s" % (name, type(value).__name__))
    if not 0 <= value <= _INT64_MAX:
        raise ValueError("%s must be in [0, 2^63), got %d" % (name, value))
    return int(value)


def _shape(name, shape):
    """A tensor shape → a tuple of ints ≥ 0; TypeError / ValueError naming it or name[i]."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, (bool, np.bool_)):
        shape = (shape,)
    if isinstance(shape, (str, bytes, dict, set)) or not hasattr(shape, "__iter__"):
        raise TypeError("%s must be a sequence of ints, not %s" % (name, type(shape).__name__))
    result = []
    for index, n in enumerate(shape):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise TypeError("%s[%d] must be an int, not %s" % (name, index, type(n).__name__))
        if n < 0:
            raise ValueError("%s[%d] is %d; dimensions are ≥ 0" % (name, index, n))
        result.append(int(n))
    return tuple(result)


def _storage_dtype(dtype, what="dtype"):
    """A tensor's dtype, required: 'fp32', 'fp16', 'bf16', np.float32, np.float16 or a DType
    number → the DType number."""
    if dtype is None:
        raise TypeError("%s is required: 'fp32', 'fp16' or 'bf16'" % what)
    return _dtype_enum(dtype, what)


class SharedRegion:
    """A shared-memory region registered with attnd (Client.register_shared_memory): the file
    `key`'s bytes [offset, offset + byte_size) under `name`.

    name, key, offset, byte_size: as the server registered them; writable: whether attnd opened
    the file read-write (only then can it take outputs, output_to); memory: the
    multiprocessing.shared_memory.SharedMemory it was registered from, or None for one
    registered by key. Offsets given to array() and tensor() count from the region's start (not
    the file's), as a SharedMemoryRef's do.

    With memory, array() views the region's bytes and an output written into it comes back as
    a view (Result.output). Views hold the SharedMemory's buffer: drop them (and the Results
    holding them) before memory.close(), which otherwise raises BufferError; memory.unlink()
    works regardless."""

    __slots__ = ("name", "key", "offset", "byte_size", "writable", "memory")

    def __init__(self, name, key, offset, byte_size, writable=False, memory=None):
        self.name = _region_name(name)
        self.key = key
        self.offset = _byte_count("offset", offset)
        self.byte_size = _byte_count("byte_size", byte_size)
        self.writable = bool(writable)
        self.memory = memory

    def _check_range(self, offset, byte_size, what):
        """ValueError naming `what` unless [offset, offset + byte_size) is inside the region."""
        if offset + byte_size > self.byte_size:
            raise ValueError("%s: offset %d + %d bytes is outside region %r (%d bytes)"
                             % (what, offset, byte_size, self.name, self.byte_size))

    def array(self, offset, shape, dtype):
        """A NumPy array of `shape` viewing the region's bytes from `offset` (from the region's
        start), no copy: writes to it are writes to the shared memory, and what attnd writes
        there (output_to) shows in it. dtype "fp32" → float32, "fp16" → float16, "bf16" → uint16
        bfloat16 bits (np.float32 and np.float16 work too). ValueError for a range outside the
        region, and for a region without memory (registered by key: map the file yourself);
        TypeError / ValueError naming offset, shape or dtype for ones that are not valid."""
        offset = _byte_count("offset", offset)
        shape = _shape("shape", shape)
        storage = _STORAGE[_storage_dtype(dtype)]
        count = math.prod(shape)
        self._check_range(offset, count * storage.itemsize, "array")
        if self.memory is None:
            raise ValueError("region %r was registered by key (%s), not from a SharedMemory: "
                             "this client has no buffer to view" % (self.name, self.key))
        return np.frombuffer(self.memory.buf, dtype=storage, count=count,
                             offset=self.offset + offset).reshape(shape)

    def tensor(self, offset, shape, dtype):
        """SharedTensor(self, offset, shape, dtype): the tensor of `shape` and `dtype` at
        `offset` of this region, to pass as an input or as output_to."""
        return SharedTensor(self, offset, shape, dtype)

    def __repr__(self):
        return "SharedRegion(%r, key=%r, offset=%d, byte_size=%d%s%s)" % (
            self.name, self.key, self.offset, self.byte_size,
            ", writable" if self.writable else "", "" if self.memory is not None else ", no memory")


class SharedTensor:
    """A tensor whose bytes are in a registered shared-memory region instead of in the message
    (Tensor.shared_memory): `shape` and `dtype` ("fp32", "fp16", "bf16") at byte `offset` from
    the start of `region` (a SharedRegion, or a region's name: one registered by this caller's
    identity, maybe by another process). Its bytes are product(shape) × the element's size,
    row-major, little-endian, bf16 as bit patterns: what SharedRegion.array() views.

    Accepted wherever an input array is: naive() and tiled() q, k, v; decode() items' query,
    key and value; Cache.decode(); append(). attnd reads the bytes during the call (the
    caller must not change them until it returns) and checks them as an inline tensor's; trace()
    takes inline tensors only (attnd's INVALID_ARGUMENT naming the tensor's shared_memory). As
    output_to (naive(), tiled(), a decode item's "output_to", Cache.decode()) it is where attnd
    writes the output: its byte size must be the output's (attnd's INVALID_ARGUMENT naming
    output_to.byte_size otherwise), its dtype the output's (the client's ValueError naming
    output_to otherwise).

    The bytes are sent as they are: `dtype=` of a call cannot convert them, and one asking for
    another dtype (a Cache's dtype included, for its keys and values) is a ValueError naming the
    tensor, before any RPC. TypeError / ValueError naming region, offset, shape or dtype here
    for ones that are not valid, and ValueError for a range outside a SharedRegion given (with a
    name, attnd checks: OUT_OF_RANGE naming the tensor's shared_memory)."""

    __slots__ = ("region", "offset", "shape", "_dtype")

    def __init__(self, region, offset, shape, dtype):
        if isinstance(region, str):
            _region_name(region, "region")
        elif not isinstance(region, SharedRegion):
            raise TypeError("region must be a SharedRegion or a region name, not %s"
                            % type(region).__name__)
        self.region = region
        self.offset = _byte_count("offset", offset)
        self.shape = _shape("shape", shape)
        self._dtype = _storage_dtype(dtype)
        if isinstance(region, SharedRegion):
            region._check_range(self.offset, self.nbytes, "SharedTensor")

    dtype = property(lambda self: _DTYPE_NAMES[self._dtype], doc="'fp32', 'fp16' or 'bf16'.")
    ndim = property(lambda self: len(self.shape))
    region_name = property(lambda self: self.region.name if isinstance(self.region, SharedRegion)
                           else self.region)

    @property
    def nbytes(self):
        """product(shape) × the element's size: the byte_size sent."""
        return math.prod(self.shape) * _ELEMENT_BYTES[self._dtype]

    def ref(self):
        """The SharedMemoryRef naming its bytes."""
        return pb.SharedMemoryRef(region=self.region_name, offset=self.offset,
                                  byte_size=self.nbytes)

    def array(self):
        """Its bytes as a NumPy array, a view (SharedRegion.array); ValueError when its region is
        a name or has no memory."""
        if not isinstance(self.region, SharedRegion):
            raise ValueError("this SharedTensor names region %r only: pass the SharedRegion to "
                             "view its bytes" % self.region)
        return self.region.array(self.offset, self.shape, self._dtype)

    def _bytes(self):
        """A copy of its bytes now, or None when this client cannot read them (a region given
        by name, or one without memory)."""
        if not isinstance(self.region, SharedRegion) or self.region.memory is None:
            return None
        start = self.region.offset + self.offset
        return bytes(self.region.memory.buf[start:start + self.nbytes])

    def __repr__(self):
        return "SharedTensor(%r, offset=%d, shape=%s, %s)" % (
            self.region_name, self.offset, self.shape, self.dtype)


def _shared_ref(name, target):
    """An output_to (a SharedTensor or a SharedMemoryRef, passed as it is) → the
    SharedMemoryRef to send; TypeError naming it otherwise."""
    if isinstance(target, SharedTensor):
        return target.ref()
    if isinstance(target, pb.SharedMemoryRef):
        return target
    raise TypeError("%s must be a SharedTensor (or a SharedMemoryRef), not %s"
                    % (name, type(target).__name__))


def _check_output_to(name, target, options, query):
    """ValueError naming `name` when the SharedTensor `target` has another dtype than the
    output will (options.output_dtype, else the encoded query's dtype)."""
    if not isinstance(target, SharedTensor):
        return
    output_dtype = options.output_dtype or query.dtype
    if output_dtype != target._dtype:
        raise ValueError("%s is %s but the output will be %s (%s): pass output_dtype=%r or an "
                         "output_to of that dtype"
                         % (name, target.dtype, _DTYPE_NAMES.get(output_dtype, output_dtype),
                            "output_dtype" if options.output_dtype else "the query's dtype",
                            target.dtype))


def _shared_output(tensor, regions):
    """An answer's Tensor written into shared memory (its shared_memory set) → a NumPy view of
    that range when `regions` (name → SharedRegion) holds its region with memory, else None.
    AttnError INTERNAL when the range does not fit its shape, dtype or region."""
    ref = tensor.shared_memory
    region = regions.get(ref.region) if regions else None
    if region is None or region.memory is None:
        return None
    storage = _STORAGE.get(tensor.dtype)
    shape = tuple(int(n) for n in tensor.shape)
    if storage is None or math.prod(shape) * storage.itemsize != ref.byte_size:
        raise AttnError("decode", grpc.StatusCode.INTERNAL,
                        "response tensor of shape %s, dtype %d names %d bytes of region %r"
                        % (shape, tensor.dtype, ref.byte_size, ref.region))
    try:
        return region.array(ref.offset, shape, tensor.dtype)
    except ValueError as error:
        raise AttnError("decode", grpc.StatusCode.INTERNAL,
                        "response tensor names a range outside its region: %s" % error) from None


def _resident(tensor, source):
    """A Tensor sent (`source`: the input it was encoded from) → one holding its bytes: itself
    when inline, else a copy of the shared memory it names read now from source's SharedRegion
    (None when this client cannot read it)."""
    if tensor is None or not tensor.HasField("shared_memory"):
        return tensor
    data = source._bytes() if isinstance(source, SharedTensor) else None
    if data is None:
        return None
    return pb.Tensor(shape=tensor.shape, dtype=tensor.dtype, data=data)


# --- Encoding -----------------------------------------------------------------------------------

def _dtype_enum(dtype, what, cache=False):
    """None, a name, a NumPy float type or a DType number → a DType number (None stays None).
    fp8 ('fp8', 'fp8_e4m3', 'float8_e4m3', 'float8_e4m3fn' or DTYPE_FLOAT8_E4M3) only with
    cache=True (a cache's storage type); for a tensor or an output it is a ValueError saying
    so."""
    if dtype is None:
        return None
    integral = isinstance(dtype, numbers.Integral) and not isinstance(dtype, bool)
    if (isinstance(dtype, str) and dtype.lower() in _FP8_NAMES) or \
            (integral and int(dtype) == _FLOAT8):
        if cache:
            return _FLOAT8
        raise ValueError("%s %r: fp8 (DTYPE_FLOAT8_E4M3) is a KV cache's dtype only "
                         "(create_cache(..., dtype='fp8')), never a tensor's or an output's; "
                         "use 'fp32', 'fp16' or 'bf16' (an fp8 cache quantizes them)"
                         % (what, dtype))
    names = "'fp32', 'fp16', 'bf16' or 'fp8'" if cache else "'fp32', 'fp16' or 'bf16'"
    if isinstance(dtype, str):
        key = dtype.lower()
        if key in _DTYPES:
            return _DTYPES[key]
        raise ValueError("%s %r: expected %s" % (what, dtype, names))
    if integral:
        if int(dtype) in _DTYPES.values():
            return int(dtype)
        raise ValueError("%s %r is not DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16%s"
                         % (what, dtype, " (or DTYPE_FLOAT8_E4M3)" if cache else ""))
    try:
        numpy_type = np.dtype(dtype)
    except TypeError:
        raise TypeError("%s must be %s or a NumPy float type, not %r"
                        % (what, names, dtype)) from None
    if numpy_type == np.float32:
        return pb.DTYPE_FLOAT32
    if numpy_type == np.float16:
        return pb.DTYPE_FLOAT16
    raise ValueError("%s %s: NumPy has no bfloat16; use %s" % (what, numpy_type, names))


def _encode(name, array, dtype, into=None):
    """One input as a Tensor, `dtype` being a DType number or None (infer from the array): a
    new Tensor, or `into` (an empty Tensor field of a request being built) filled in place,
    which spares a decode step a copy of each tensor. A SharedTensor becomes a Tensor naming its
    shared memory (data empty): its dtype is what it is, so another `dtype` is a ValueError
    naming it."""
    if isinstance(array, pb.Tensor):
        if into is None:
            return array
        into.CopyFrom(array)
        return into
    if isinstance(array, SharedTensor):
        if not 2 <= array.ndim <= 4:
            raise ValueError("%s has rank %d (shape %s); expected rank 2 [seq, dim], 3 [heads, "
                             "seq, dim] or 4 [batch, heads, seq, dim]"
                             % (name, array.ndim, array.shape))
        if dtype is not None and dtype != array._dtype:
            raise ValueError("%s is a SharedTensor of %s, not %s (the call's dtype=, or a "
                             "Cache's dtype): shared memory is sent as it is, not converted"
                             % (name, array.dtype, _DTYPE_NAMES.get(dtype, dtype)))
        return _tensor(into, array.shape, array._dtype, shared_memory=array.ref())
    if not isinstance(array, np.ndarray):
        if isinstance(array, (list, tuple)):
            array = np.asarray(array)
        else:
            raise TypeError("%s must be a NumPy array, not %s" % (name, type(array).__name__))
    if not 2 <= array.ndim <= 4:
        raise ValueError("%s has rank %d (shape %s); expected rank 2 [seq, dim], 3 [heads, seq, "
                         "dim] or 4 [batch, heads, seq, dim]" % (name, array.ndim, array.shape))
    kind = array.dtype.kind
    if kind not in "fiu" or (kind == "f" and array.dtype.itemsize > 8):
        raise TypeError("%s has element type %s; expected float32, float16 or uint16 bf16 bits"
                        % (name, array.dtype))
    if dtype is None:
        if array.dtype == np.float16:
            dtype = pb.DTYPE_FLOAT16
        elif array.dtype == np.uint16:
            raise TypeError("%s is uint16: pass dtype='bf16' if it holds bfloat16 bits" % name)
        else:
            dtype = pb.DTYPE_FLOAT32
    if dtype == pb.DTYPE_FLOAT32:
        data = np.ascontiguousarray(array, dtype="<f4")
    elif dtype == pb.DTYPE_FLOAT16:
        if array.dtype == np.uint16:
            raise TypeError("%s is uint16 but dtype is fp16; pass float16 values" % name)
        data = np.ascontiguousarray(array, dtype="<f2")
    else:  # bf16: uint16 arrays are bits already, floats are rounded
        if array.dtype == np.uint16:
            data = np.ascontiguousarray(array, dtype="<u2")
        else:
            data = float32_to_bf16(array)
    return _tensor(into, array.shape, dtype, data=data.tobytes())


def _tensor(into, shape, dtype, data=None, shared_memory=None):
    """A Tensor of these fields: a new one when `into` is None, else `into` (empty) set."""
    if into is None:
        into = pb.Tensor()
    into.shape.extend(shape)
    into.dtype = dtype
    if data is not None:
        into.data = data
    if shared_memory is not None:
        into.shared_memory.CopyFrom(shared_memory)
    return into


def _decode(tensor, regions=None):
    """A response Tensor → a NumPy array of its shape (uint16 bits for bf16). One written into
    shared memory (shared_memory set, data empty) → a view of that range when `regions` (name →
    SharedRegion) holds its region with memory, else None (_shared_output)."""
    if tensor.HasField("shared_memory"):
        return _shared_output(tensor, regions)
    shape = tuple(tensor.shape)
    wire, native = _WIRE_TYPES.get(tensor.dtype, (None, None))
    if wire is None:
        raise AttnError("decode", grpc.StatusCode.INTERNAL,
                        "response tensor has unknown dtype %d" % tensor.dtype)
    # One copy of the bytes, writable (protobuf hands out immutable bytes), viewed in place.
    data = bytearray(tensor.data)
    count = math.prod(shape) if shape else 0
    if len(data) != count * wire.itemsize or min(shape, default=0) < 0:
        raise AttnError("decode", grpc.StatusCode.INTERNAL,
                        "response tensor has %d bytes for shape %s of %d-byte elements"
                        % (len(data), shape, wire.itemsize))
    values = np.ndarray(shape if shape else (0,), dtype=wire, buffer=data)
    return values if wire == native else values.astype(native)


# A response tensor's element type → (its little-endian wire type, the same in native order).
_WIRE_TYPES = {dtype: (np.dtype(wire), np.dtype(wire).newbyteorder("="))
               for dtype, wire in ((pb.DTYPE_FLOAT32, "<f4"), (pb.DTYPE_FLOAT16, "<f2"),
                                   (pb.DTYPE_BFLOAT16, "<u2"))}


def _message_dict(message):
    """A protobuf message (ExecutionStats, ServerInfo) → {field name: value}, a message field
    (ExecutionStats.stages) as a dict of its own."""
    result = {}
    for name, nested in _dict_fields(message.DESCRIPTOR):
        value = getattr(message, name)
        result[name] = _message_dict(value) if nested else value
    return result


_DICT_FIELDS = {}


def _dict_fields(descriptor):
    """(name, whether it is a single message) of each field of a message type, in order: read
    from the descriptor once per type (every answer's stats and CacheInfo go through here)."""
    fields = _DICT_FIELDS.get(descriptor)
    if fields is None:
        fields = tuple((field.name, field.message_type is not None and
                        field.label != field.LABEL_REPEATED) for field in descriptor.fields)
        _DICT_FIELDS[descriptor] = fields
    return fields


def _row_tuple(row):
    return (int(row.batch), int(row.head), int(row.row))


_INTEGER_CPP_TYPES = frozenset((FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64,
                                FieldDescriptor.CPPTYPE_UINT32, FieldDescriptor.CPPTYPE_UINT64))


def _event_dict(event):
    kind = event.WhichOneof("event")
    message = getattr(event, kind) if kind else None
    result = {"kind": kind, "message": message}
    if message is None:
        return result
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.name == "row":
            value = _row_tuple(value)
        elif field.name == "stats":
            value = _message_dict(value)
        elif field.label == field.LABEL_REPEATED and field.type == field.TYPE_ENUM:
            value = [field.enum_type.values_by_number[int(x)].name for x in value]
        elif field.label == field.LABEL_REPEATED and field.cpp_type in _INTEGER_CPP_TYPES:
            value = [int(x) for x in value]  # cu_seqlens_q / cu_seqlens_k of "start"
        elif field.label == field.LABEL_REPEATED:
            value = np.array(value, dtype=np.float32)
        elif field.containing_oneof is not None and not message.HasField(field.name):
            value = None  # An unset proto3 optional (its oneof is synthetic): not 0.
        result[field.name] = value
    return result


class Result:
    """The answer of naive() or tiled(). With output_to, the output is in shared memory (the
    response's output names the range, data empty): `output` is then a NumPy view of that range
    when this client knows the region's memory (registered through this Client from a
    SharedMemory, or output_to a SharedTensor of such a SharedRegion), else None."""

    __slots__ = ("output", "lse", "stats", "output_dtype", "response")

    def __init__(self, response, regions=None):
        self.response = response
        self.output = _decode(response.output, regions)
        self.output_dtype = _DTYPE_NAMES.get(response.output.dtype, str(response.output.dtype))
        self.lse = _decode(response.lse) if response.HasField("lse") else None
        self.stats = _message_dict(response.stats)

    def output_float32(self):
        """The output as float32 values whatever its dtype (bf16 bits widened exactly); None
        when `output` is None (in shared memory this client cannot view)."""
        return None if self.output is None else _widen(self.output, self.output_dtype)

    def __repr__(self):
        return "Result(output=%s %s, lse=%s, backend=%r)" % (
            self.output_dtype,
            "(in shared memory)" if self.output is None else self.output.shape,
            None if self.lse is None else self.lse.shape, self.stats.get("backend"))


def _widen(array, dtype_name):
    """A decoded output as float32 values whatever its dtype (bf16 bits widened exactly)."""
    if dtype_name == "bf16":
        return bf16_to_float32(array)
    return array.astype(np.float32)


def _cache_dict(info):
    """A CacheInfo → {field name: value}, the dtype as a name ("fp32", ...), an unset optional
    field (durable_length without --cache-dir, crc32c but from ImportCache) None."""
    result = _message_dict(info)
    result["dtype"] = _DTYPE_NAMES.get(result["dtype"], str(result["dtype"]))
    for name in _CACHE_OPTIONAL_FIELDS:
        if not info.HasField(name):
            result[name] = None
    return result


# CacheInfo's optional fields (their oneofs are synthetic): None in a dict when unset.
_CACHE_OPTIONAL_FIELDS = tuple(field.name for field in pb.CacheInfo.DESCRIPTOR.fields
                               if field.containing_oneof is not None)


class DecodeResult:
    """The answer of decode(): per item, in the order of the items,

    outputs: arrays [heads, nq, value_dim] (the query's rank), dtypes as in Result.output; an
             item's output written into shared memory (its "output_to") is a view of that
             range, or None, as Result.output;
    lse:     float32 arrays [heads, nq] when return_lse=True, else None;
    caches:  CacheInfo dicts of each item's cache after its append;
    and stats (ExecutionStats of the whole batch, a dict), output_dtype, response."""

    __slots__ = ("outputs", "lse", "caches", "stats", "output_dtype", "response")

    def __init__(self, response, regions=None):
        self.response = response
        self.outputs = [_decode(t, regions) for t in response.outputs]
        dtypes = {t.dtype for t in response.outputs}
        self.output_dtype = _DTYPE_NAMES.get(dtypes.pop(), "?") if len(dtypes) == 1 else None
        self.lse = [_decode(t) for t in response.lse] if len(response.lse) else None
        self.caches = [_cache_dict(c) for c in response.caches]
        self.stats = _message_dict(response.stats)

    def outputs_float32(self):
        """The outputs as float32 values whatever their dtype (None for an output None)."""
        return [None if o is None else _widen(o, _DTYPE_NAMES.get(t.dtype))
                for o, t in zip(self.outputs, self.response.outputs)]

    def __repr__(self):
        return "DecodeResult(%d outputs %s, backend=%r)" % (
            len(self.outputs), [tuple(int(n) for n in t.shape) for t in self.response.outputs],
            self.stats.get("backend"))


# The codes of a call the server refused, nothing of it applied (a cut included); any other
# failure of a call carrying a cut (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...) may have been
# applied (Cache._cut_failed).
_REFUSED_CODES = frozenset((
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED))

_ELEMENT_BYTES = {pb.DTYPE_FLOAT32: 4, pb.DTYPE_FLOAT16: 2, pb.DTYPE_BFLOAT16: 2}

# The most bytes of keys and values refresh() re-sends in one AppendCache.
_REPLAY_APPEND_BYTES = 64 << 20


def _row_bytes(dtype, width):
    """Bytes of one row of `width` elements (one token of one kv head) in `dtype`: width × the
    element's size; an fp8 cache's stored row (export chunks, cache files) is its codes, zero
    bytes up to a multiple of 4, then its little-endian float32 scale."""
    if dtype == _FLOAT8:
        return (width + 3) // 4 * 4 + 4
    return width * _ELEMENT_BYTES.get(dtype, 1)


def _tokens_view(tensor):
    """A cache-token Tensor ([kv_heads, n, dim], or [n, dim]; tokens as sent, or an fp8
    cache's stored rows) as a uint8 array [outer, n, bytes per token and head], a view of its
    data."""
    shape = [int(x) for x in tensor.shape]
    if len(shape) not in (2, 3):
        raise ValueError("cache tokens must be [kv_heads, n, dim] or [n, dim], not shape %s"
                         % (shape,))
    outer, n, dim = ([1] + shape) if len(shape) == 2 else shape
    raw = np.frombuffer(tensor.data, dtype=np.uint8)
    return raw.reshape(outer, n, _row_bytes(tensor.dtype, dim))


def _token_count(tensor):
    """n of a cache-token Tensor [kv_heads, n, dim] or [n, dim]."""
    return int(tensor.shape[1] if len(tensor.shape) == 3 else tensor.shape[0])


def _join_tokens(tensors, ranges):
    """Tokens [a, b) of each Tensor (`ranges`, one (a, b) per tensor, all of one dtype and
    rank) joined along the token axis → one Tensor."""
    first = tensors[0]
    parts = [_tokens_view(t)[:, a:b, :] for t, (a, b) in zip(tensors, ranges)]
    joined = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    shape = [int(x) for x in first.shape]
    shape[len(shape) - 2] = joined.shape[1]
    return pb.Tensor(shape=shape, dtype=first.dtype,
                     data=np.ascontiguousarray(joined).tobytes())


class _Sent:
    """One entry of a Cache's replay tail: tokens [start, start + n) as key and value Tensors,
    exactly as they were sent (value None: a latent cache's keys alone)."""

    __slots__ = ("start", "n", "key", "value")

    def __init__(self, start, key, value):
        self.start, self.n, self.key, self.value = int(start), _token_count(key), key, value

    @property
    def end(self):
        return self.start + self.n

    def kind(self):
        """What tokens joined into one append must share: dtype and ranks."""
        if self.value is None:
            return (self.key.dtype, None, len(self.key.shape), None)
        return (self.key.dtype, self.value.dtype, len(self.key.shape), len(self.value.shape))

    def bytes(self):
        """Bytes of key and value data it holds."""
        return len(self.key.data) + (len(self.value.data) if self.value is not None else 0)

    def head(self, end):
        """This entry cut back to the tokens before `end` (start < end < self.end)."""
        cut = [(0, end - self.start)]
        return _Sent(self.start, _join_tokens([self.key], cut),
                     _join_tokens([self.value], cut) if self.value is not None else None)


def _moved_to(error):
    """HOST:PORT of an AttnError NOT_FOUND whose message names where a draining server handed
    the cache ("... moved_to=HOST:PORT"), else None."""
    if not isinstance(error, AttnError) or error.code != grpc.StatusCode.NOT_FOUND:
        return None
    found = re.findall(r"moved_to=([^\s;,]+)", error.message)
    return found[-1] if found else None


class Cache:
    """A server-resident KV cache as this client believes it (made by Client.create_cache,
    Client.open_cache for an existing id, Client.import_cache or Cache.fork). Not thread-safe:
    one sequence, one writer.

    id, length, kv_heads, head_dim, value_dim, dtype ("fp32", "fp16", "bf16", "fp8_e4m3"),
    values_from_keys (a latent cache: keys only, each value the first value_dim columns of its
    key), durable_length (tokens on the server's disk, None when it does not persist),
    shared_bytes (of its bytes, those in pages a fork or the cache it was forked from holds too,
    as of the last answer for it: a fork made since shows after cache_info() or refresh()), info
    (the last CacheInfo dict the server sent). `length` is what append(), decode(), truncate()
    and fork() send as expected_length; each successful call on this cache sets it from the
    server's answer. replay_tail: [(start, n), ...], the tokens kept to re-send (see refresh());
    a cut (truncate(), decode's truncate_to) cuts it too. `client` is the Client it calls
    (another one once it followed a moved_to)."""

    def __init__(self, client, info):
        self.client = client
        self._tail = []  # _Sent entries, by start, not overlapping.
        # The lowest cut a failed call may have applied (see _cut_failed); None: none pending.
        self._unsure_cut = None
        # Tokens before this were sent in shared memory this client could not read (_record):
        # the tail cannot re-send them. None: no such tokens past the durable length.
        self._unreadable = None
        self._set(info)

    def _set(self, info):
        """Takes a CacheInfo (dict or message) the server answered for this cache: drops the
        replay tail's entries that end at or before its durable_length, or all of them when it
        has none (the server does not persist). The server's length is known again: no cut is
        pending."""
        self.info = info if isinstance(info, dict) else _cache_dict(info)
        self._unsure_cut = None
        durable = self.info.get("durable_length")
        if durable is None:
            self._tail = []
        else:
            self._tail = [sent for sent in self._tail if sent.end > durable]
        if durable is None or (self._unreadable is not None and self._unreadable <= durable):
            self._unreadable = None

    def _record(self, start, key, value, info, sources=(None, None)):
        """Tokens [start, start + n) sent and stored (key, value: the Tensors sent; sources: the
        key and value given, which they were encoded from); `info`, the answer's CacheInfo dict,
        is _set next. Entries at or past `start` (re-sent over) give way. The entry is kept only
        past info's durable_length (so never when the server does not persist). Tokens sent in
        shared memory (SharedTensors) are kept as a copy of their bytes read now from their
        SharedRegion's memory; when this client cannot read them (a region given by name, or
        one registered by key) no token before their end can be re-sent, so the tail is
        emptied and refresh() raises DATA_LOSS for a loss that reaches back before their end."""
        kept = []
        for sent in self._tail:
            if sent.start >= start:
                continue
            kept.append(sent.head(start) if sent.end > start else sent)
        end = start + _token_count(key)
        durable = info.get("durable_length")
        if durable is not None and end > durable:
            key_kept, value_kept = _resident(key, sources[0]), _resident(value, sources[1])
            if key_kept is None or (value is not None and value_kept is None):
                kept = []
                self._unreadable = end
            else:
                kept.append(_Sent(start, key_kept, value_kept))
        self._tail = kept

    def _cut(self, length):
        """The replay tail after the cache was cut to `length` tokens: entries at or past it
        dropped, the one straddling it sliced, so refresh() never re-sends a cut token."""
        self._tail = [sent if sent.end <= length else sent.head(length)
                      for sent in self._tail if sent.start < length]
        if self._unreadable is not None and self._unreadable > length:
            self._unreadable = length

    def _cut_failed(self, length, error):
        """A call that cut the cache to `length` failed with `error`. When the server refused it
        (nothing applied) the Cache stays as it was; otherwise the cut may have been applied, so
        the tail is cut all the same and refresh() will re-send tokens only up to `length`."""
        if isinstance(error, AttnError) and error.code in _REFUSED_CODES:
            return
        self._cut(length)
        if self._unsure_cut is None or length < self._unsure_cut:
            self._unsure_cut = length

    def _follow(self, call):
        """call() (which reads self.client); once more on a Client to HOST:PORT when it fails
        NOT_FOUND with moved_to=HOST:PORT. Not followed twice in a row."""
        try:
            return call()
        except AttnError as error:
            target = _moved_to(error)
            if target is None:
                raise
        self.client = self.client._moved_client(target)
        return call()

    id = property(lambda self: self.info["cache_id"])
    length = property(lambda self: self.info["length"])
    kv_heads = property(lambda self: self.info["kv_heads"])
    head_dim = property(lambda self: self.info["head_dim"])
    value_dim = property(lambda self: self.info["value_dim"])
    dtype = property(lambda self: self.info["dtype"])
    values_from_keys = property(lambda self: bool(self.info.get("values_from_keys", False)))
    durable_length = property(lambda self: self.info.get("durable_length"))
    shared_bytes = property(lambda self: self.info.get("shared_bytes", 0))
    replay_tail = property(lambda self: [(sent.start, sent.n) for sent in self._tail])

    def append(self, key, value=None, *, dtype=None):
        """Appends key [kv_heads, n, head_dim] and value [kv_heads, n, value_dim] (rank 2 when
        kv_heads is 1) at `length` → the new CacheInfo dict; a latent cache (values_from_keys)
        takes the key alone: cache.append(key). ValueError naming value, before any RPC, for a
        value given to a latent cache or none to one that stores values. dtype None: the
        cache's (float32 for an fp8 cache, which quantizes them). Follows a moved_to once (see
        the module docstring)."""
        return self._follow(lambda: self.client.append(self, key, value, dtype=dtype))

    def truncate(self, length, *, expected_length=None):
        """Cuts the cache to its first `length` tokens (TruncateCache) → the new CacheInfo
        dict; `length` follows it and the replay tail is cut too. expected_length: the length
        before the cut (None: this Cache's `length`), FAILED_PRECONDITION naming the actual one
        when stale; a length past the cache's is OUT_OF_RANGE. TypeError / ValueError naming
        the argument for a non-int or negative value. Follows a moved_to once."""
        length = _token_length("length", length)
        return self._follow(lambda: self.client.truncate_cache(
            self, length, expected_length=expected_length))

    def fork(self, length=None, *, expected_length=None):
        """A new cache whose tokens are this one's first `length` (None: all of them), sharing
        its pages (ForkCache) → a Cache for it, on the same Client, its length the fork's and its
        replay tail empty (with attnd --cache-dir the fork's tokens are durable at once). This
        Cache is unchanged. expected_length: this cache's length (None: this Cache's `length`),
        FAILED_PRECONDITION naming the actual one when stale; a length past it is OUT_OF_RANGE.
        TypeError / ValueError naming the argument for a non-int or negative value. Follows a
        moved_to once (the fork is then made there)."""
        if length is not None:
            length = _token_length("length", length)
        info = self._follow(lambda: self.client.fork_cache(
            self, length, expected_length=expected_length))
        return Cache(self.client, info)

    def decode(self, query, key=None, value=None, *, key_position=0, query_position=None,
               truncate_to=None, tree_parents=None, output_to=None, **options):
        """One decode step of this cache alone: cuts the cache to its first truncate_to tokens
        when given (speculative decoding: the drafts the last step rejected), appends key/value
        when given (a latent cache: the key alone, a value being a ValueError naming it before
        any RPC), then attends query [heads, nq, head_dim] over the whole cache → Result
        (output [heads, nq, value_dim]). The cut, the append and the attention are one atomic
        step; expected_length (this Cache's `length`) is the length before the cut.
        tree_parents: the new tokens as a token tree (EAGLE-style drafts; see the module
        docstring), one parent index per new token (−1: a child of the cached prefix, else an
        earlier new token); nq must then be the new tokens, and row i sees the prefix, token
        i's ancestors and itself. TypeError / ValueError naming tree_parents[j] before any RPC:

            # t0 → {a, b}, a → {c}: rows see [t0], [t0 a], [t0 b], [t0 a c]
            step = cache.decode(q, k4, v4, tree_parents=[-1, 0, 0, 1], causal=True)

        key_position, query_position: this item's positions (Client.decode). output_to: a
        SharedTensor the output is written into (Client.decode's "output_to"); query, key and
        value may be SharedTensors. options: causal, scale, block_k, return_lse, dtype,
        output_dtype, window_left, window_right, softcap, alibi_slopes, sinks. Follows a
        moved_to once (shared-memory regions are per server: the new one answers NOT_FOUND for
        a region not registered there)."""
        item = {"cache": self, "query": query, "key_position": key_position,
                "query_position": query_position}
        if truncate_to is not None:
            item["truncate_to"] = _token_length("truncate_to", truncate_to)
        if tree_parents is not None:
            item["tree_parents"] = _tree_parents("tree_parents", tree_parents)
        if key is not None:
            item["key"] = key
        if value is not None:
            item["value"] = value
        if output_to is not None:
            item["output_to"] = output_to
        result = self._follow(lambda: self.client.decode([item], **options))
        return _ItemResult(result)

    def refresh(self):
        """Re-reads the cache's info from the server → the CacheInfo dict, and recovers what a
        restart lost: when the server holds L tokens, fewer than `length`, tokens [L, length)
        are re-sent from the replay tail (AppendCache with expected_length = L, an entry
        straddling L sliced, as few appends as practical) and the final answer adopted. When the
        tail does not reach back to L: AttnError DATA_LOSS (the sequence must be prefilled
        again), the Cache left as it was. L ≥ length: the server's info is adopted as it is.
        After a call carrying a cut to C failed without a refusal (it may have been applied),
        `length` above reads min(length, C): nothing past the cut is re-sent. Follows a
        moved_to once."""
        return self._follow(self._refresh)

    def _refresh(self):
        client = self.client
        info = _cache_dict(client._cache_info(self.id))
        held, length = info["length"], self.length
        if self._unsure_cut is not None:
            length = min(length, self._unsure_cut)
        if held >= length:
            self._set(info)
            return self.info
        for key, value, start in self._replay(held, length):
            request = pb.AppendCacheRequest(cache_id=self.id, key=key, expected_length=start)
            if value is not None:  # None: a latent cache's keys alone.
                request.value.CopyFrom(value)
            self._set(client._call("AppendCache", client._stub.AppendCache, request))
        return self.info

    def _replay(self, held, length):
        """The appends that re-send tokens [held, length) from the tail → [(key, value,
        start)], value None for a latent cache; AttnError DATA_LOSS when the tail does not
        cover them."""
        pieces, position = [], held  # (sent, a, b): tokens [a, b) of `sent`, relative.
        for sent in self._tail:
            if sent.end <= position:
                continue
            if sent.start > position or position >= length:
                break
            end = min(sent.end, length)
            pieces.append((sent, position - sent.start, end - sent.start))
            position = end
        if position < length:
            if not self._tail:
                kept = ("kept none to re-send (only tokens past the last durable_length it saw "
                        "are kept; none when the server does not persist)")
            else:
                kept = ("kept tokens only from %d on (those past the last durable_length it "
                        "saw)" % self._tail[0].start)
                if self._tail[0].start <= held:
                    kept += " and none at %d" % position
            if self._unreadable is not None and self._unreadable > held:
                kept += ("; tokens before %d were sent in shared memory it could not read (a "
                         "SharedTensor naming its region by name, or a region registered by key)"
                         % self._unreadable)
            raise AttnError("Refresh", grpc.StatusCode.DATA_LOSS,
                            "cache %s: the server holds %d tokens, this Cache had %d; it %s, "
                            "so it cannot re-send tokens [%d, %d): the sequence must be "
                            "prefilled again" % (self.id, held, length, kept, held, length))
        appends, group, group_bytes, start = [], [], 0, held
        for sent, a, b in pieces:
            size = sent.bytes() * (b - a) // max(sent.n, 1)
            if group and (group[0][0].kind() != sent.kind()
                          or group_bytes + size > _REPLAY_APPEND_BYTES):
                appends.append(group)
                group, group_bytes = [], 0
            group.append((sent, a, b))
            group_bytes += size
        if group:
            appends.append(group)
        result = []
        for group in appends:
            ranges = [(a, b) for _, a, b in group]
            values = None
            if group[0][0].value is not None:
                values = _join_tokens([sent.value for sent, _, _ in group], ranges)
            result.append((_join_tokens([sent.key for sent, _, _ in group], ranges), values,
                           start))
            start += sum(b - a for a, b in ranges)
        return result

    def delete(self):
        """Deletes the cache on the server; later calls naming it get NOT_FOUND."""
        self.client.delete_cache(self)

    def __repr__(self):
        return "Cache(%s, length=%d, kv_heads=%d, head_dim=%d, value_dim=%d, %s%s)" % (
            self.id, self.length, self.kv_heads, self.head_dim, self.value_dim, self.dtype,
            ", values_from_keys" if self.values_from_keys else "")


class _ItemResult(Result):
    """Result of a one-item decode: output, lse, stats and output_dtype as Result's, plus
    `cache`, the item's CacheInfo dict."""

    __slots__ = ("cache",)

    def __init__(self, decoded):
        self.response = decoded.response
        self.output = decoded.outputs[0]
        self.output_dtype = decoded.output_dtype
        self.lse = decoded.lse[0] if decoded.lse is not None else None
        self.stats = decoded.stats
        self.cache = decoded.caches[0]


# --- The client ---------------------------------------------------------------------------------

class Client:
    """A connection to attnd at `target` ("host:port"); dials lazily on the first call.

    token:   sent as "authorization: Bearer <token>" on every call (attnd --auth-token-file).
    tls_ca:  path of a PEM CA bundle; TLS when given, plaintext otherwise. tls_cert/tls_key
             (paths, both or neither) add a client certificate for attnd --tls-client-ca.
    timeout: per-call deadline in seconds (None: no deadline); for trace(), the whole stream's.
    """

    def __init__(self, target, token=None, tls_ca=None, timeout=None, *, tls_cert=None,
                 tls_key=None, max_message_bytes=MAX_MESSAGE_BYTES):
        if not isinstance(target, str) or not target:
            raise ValueError("target must be a non-empty 'host:port' string")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty string or None")
        if timeout is not None and not (isinstance(timeout, numbers.Real) and timeout > 0):
            raise ValueError("timeout must be a positive number of seconds or None")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if tls_cert is not None and tls_ca is None:
            raise ValueError("a client certificate needs TLS: pass tls_ca too")
        self.target = target
        self.timeout = timeout
        # What a Client for another server (a cache's moved_to) is made with.
        self._settings = dict(token=token, tls_ca=tls_ca, timeout=timeout, tls_cert=tls_cert,
                              tls_key=tls_key, max_message_bytes=max_message_bytes)
        self._moved_clients = {}
        self._moved_lock = threading.Lock()
        # Shared-memory regions registered through this Client, by name (SharedRegion).
        self._regions = {}
        self._regions_lock = threading.Lock()
        self._metadata = (("authorization", "Bearer " + token),) if token else None
        options = [("grpc.max_send_message_length", int(max_message_bytes)),
                   ("grpc.max_receive_message_length", int(max_message_bytes))]
        if tls_ca is not None:
            with open(tls_ca, "rb") as f:
                root = f.read()
            chain = key = None
            if tls_cert is not None:
                with open(tls_cert, "rb") as f:
                    chain = f.read()
                with open(tls_key, "rb") as f:
                    key = f.read()
            credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                                       certificate_chain=chain)
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw)

    def close(self):
        """Closes the channel, and those of the Clients made for moved caches."""
        with self._moved_lock:
            moved, self._moved_clients = list(self._moved_clients.values()), {}
        for client in moved:
            client.close()
        self._channel.close()

    def _moved_client(self, target):
        """The Client for `target` (a moved_to) with this one's settings, made once."""
        if target == self.target:
            return self
        with self._moved_lock:
            client = self._moved_clients.get(target)
            if client is None:
                client = Client(target, **self._settings)
                self._moved_clients[target] = client
        return client

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, name, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise AttnError.from_rpc_error(name, error) from None

    # Requests.

    @staticmethod
    def _options(causal, scale, block_k, return_lse, output_dtype, key_position=0,
                 query_position=None, window_left=None, window_right=None, softcap=0.0,
                 alibi_slopes=None, query=None, sinks=None, into=None):
        """The AttentionOptions of a call, new or `into` (the empty options of a request being
        built) set in place; `query` (the call's query, for decode its first item's) gives the
        head count for alibi_slopes="standard". Fields at their defaults are left unset (the
        same message, fewer calls into protobuf)."""
        out_dtype = _dtype_enum(output_dtype, "output_dtype")
        if not isinstance(causal, (bool, np.bool_)):
            raise TypeError("causal must be a bool, not %s" % type(causal).__name__)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError("return_lse must be a bool, not %s" % type(return_lse).__name__)
        if isinstance(block_k, bool) or not isinstance(block_k, numbers.Integral):
            raise TypeError("block_k must be an int, not %s" % type(block_k).__name__)
        if block_k < 0 or block_k > 2 ** 31 - 1:
            raise ValueError("block_k must be ≥ 0 (0: the server's default), got %d" % block_k)
        options = pb.AttentionOptions() if into is None else into
        if causal:
            options.causal = True
        if block_k:
            options.block_k = int(block_k)
        if return_lse:
            options.return_lse = True
        if scale is not None:
            if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
                raise TypeError("scale must be a number or None, not %s" % type(scale).__name__)
            if not math.isfinite(scale):
                raise ValueError("scale must be finite, got %r" % scale)
            options.scale = float(scale)
        if out_dtype is not None:
            options.output_dtype = out_dtype
        key_position = _position("key_position", key_position)
        if key_position:
            options.key_position = key_position
        if query_position is not None:
            options.query_position = _position("query_position", query_position)
        if window_left is not None:
            options.window_left = _position("window_left", window_left)
        if window_right is not None:
            options.window_right = _position("window_right", window_right)
        softcap = _softcap(softcap)
        if softcap:
            options.softcap = softcap
        if alibi_slopes is not None:
            options.alibi_slopes.extend(_alibi_slopes(alibi_slopes, query))
        if sinks is not None:
            options.sinks.extend(_sinks(sinks))
        return options

    @classmethod
    def _request(cls, q, k, v, causal, scale, block_k, return_lse, dtype, output_dtype,
                 cache=None, key_position=0, query_position=None, window_left=None,
                 window_right=None, softcap=0.0, alibi_slopes=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, sinks=None, output_to=None):
        request = cls._request_of(q, k, v, causal, scale, block_k, return_lse, dtype,
                                  output_dtype, cache, key_position, query_position, window_left,
                                  window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                  sinks)
        if output_to is not None:
            target = _shared_ref("output_to", output_to)
            _check_output_to("output_to", output_to, request.options, request.query)
            request.output_to.CopyFrom(target)
        return request

    @classmethod
    def _request_of(cls, q, k, v, causal, scale, block_k, return_lse, dtype, output_dtype,
                    cache, key_position, query_position, window_left, window_right, softcap,
                    alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks):
        input_dtype = _dtype_enum(dtype, "dtype")
        options = cls._options(causal, scale, block_k, return_lse, output_dtype, key_position,
                               query_position, window_left, window_right, softcap, alibi_slopes,
                               q, sinks)
        if (cu_seqlens_q is None) != (cu_seqlens_k is None):
            raise ValueError("a ragged batch gives cu_seqlens_q and cu_seqlens_k together "
                             "(S + 1 cumulative lengths each), or neither; got only %s"
                             % ("cu_seqlens_q" if cu_seqlens_k is None else "cu_seqlens_k"))
        # Sent as they are, with cache= too: the ranges (and cache= with them) are the server's
        # to refuse, naming the field.
        sequences = dict(cu_seqlens_q=_cu_seqlens("cu_seqlens_q", cu_seqlens_q),
                         cu_seqlens_k=_cu_seqlens("cu_seqlens_k", cu_seqlens_k))
        if cache is not None:
            if k is not None or v is not None:
                raise ValueError("give key and value, or cache=, not both")
            return pb.AttentionRequest(query=_encode("query", q, input_dtype),
                                       cache_id=_cache_id(cache), options=options, **sequences)
        if k is None or v is None:
            raise ValueError("key and value are needed (or cache= to attend over a KV cache)")
        return pb.AttentionRequest(query=_encode("query", q, input_dtype),
                                   key=_encode("key", k, input_dtype),
                                   value=_encode("value", v, input_dtype), options=options,
                                   **sequences)

    # RPCs.

    def naive(self, q, k=None, v=None, *, cache=None, causal=False, scale=None, block_k=0,
              return_lse=False, dtype=None, output_dtype=None, key_position=0,
              query_position=None, window_left=None, window_right=None, softcap=0.0,
              alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, sinks=None,
              output_to=None):
        """Full-matrix attention (score and weight matrices materialized) → Result.
        cache: a Cache or cache id to attend over instead of k and v (q is then [heads,
        query_len, head_dim]; causal is bottom-right against the cache's length).
        scale None: 1/sqrt(head_dim). output_dtype None: the query's dtype. block_k is ignored.
        key_position: the position of the first key (key j is at key_position + j);
        query_position: that of the first query row, None = key_position + key_len −
        query_len (bottom-right). The causal mask compares them: a query at position p sees a
        key at t iff t ≤ p. Both ints in [0, 2^62]. To split a causal problem's keys, send
        keys [a, b) with key_position=a and the whole problem's query_position, return_lse=True
        and an fp32 output, and combine the parts with merge_states().
        window_left, window_right: a sliding window over the same positions, None = unbounded
        on that side: a query at p sees a key at t only if p − window_left ≤ t ≤ p +
        window_right (and t ≤ p when causal). Ints in [0, 2^62].
        softcap: 0.0 = off, else each scaled score s becomes softcap · tanh(s / softcap), after
        the scale and before the mask (the lse is of the capped scores). A real number ≥ 0,
        finite in float32.
        alibi_slopes: None or empty = no bias, else one slope per query head: head h adds
        −alibi_slopes[h] · |p − t| to the score of the key at t for the query at p (the
        positions above), after the softcap and before the mask. A sequence or 1-D array of
        numbers finite in float32, or "standard": standard_alibi_slopes(the query's heads).
        sinks: None or empty = no sinks, else one logit per query head: sinks[h] joins every
        softmax row of head h, taking weight but adding no value (out = Σ_j e^(x_j) v_j /
        (Σ_j e^(x_j) + e^sinks[h]), lse = log(Σ_j e^(x_j) + e^sinks[h]), x_j the row's scores
        after scale, softcap, ALiBi and mask; the sink itself is none of them); a row that sees
        no key gives zeros and lse = sinks[h]. A sequence or 1-D array of numbers finite in
        float32. To split keys, send the sinks only with the slice that starts the sequence
        (see merge_states()).
        cu_seqlens_q, cu_seqlens_k: None = one sequence, else a ragged batch (both, S + 1
        cumulative lengths each, ints; see cumulative_lengths() and the module docstring): q
        [heads, total_q, head_dim], k and v [kv_heads, total_k, ·], and sequence s's rows
        [cu_seqlens_q[s], cu_seqlens_q[s+1]) see only its keys [cu_seqlens_k[s],
        cu_seqlens_k[s+1]), at its own positions (keys at 0 …, queries bottom-right), the
        mask, window, softcap, ALiBi and sinks applied per sequence. key_position and
        query_position must then be unset, and cache= is refused (the server's
        INVALID_ARGUMENT).
        q, k, v may be SharedTensors (bytes in shared memory, see SharedTensor; attnd
        --allow-shared-memory). output_to: a SharedTensor attnd writes the output into instead
        of the answer (its byte size the output's: INVALID_ARGUMENT naming output_to.byte_size
        otherwise; its dtype the output's, output_dtype or the query's: a ValueError naming
        output_to otherwise); Result.output is then a view of it (None when this client does
        not know the region's memory), the lse still in the answer."""
        request = self._request(q, k, v, causal, scale, block_k, return_lse, dtype,
                                output_dtype, cache, key_position, query_position, window_left,
                                window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                sinks, output_to)
        return Result(self._call("Naive", self._stub.Naive, request),
                      self._known_regions([output_to]))

    def tiled(self, q, k=None, v=None, *, cache=None, causal=False, scale=None, block_k=0,
              return_lse=False, dtype=None, output_dtype=None, key_position=0,
              query_position=None, window_left=None, window_right=None, softcap=0.0,
              alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None, sinks=None,
              output_to=None):
        """Online-softmax attention over tiles of block_k keys (0: the server's default)
        → Result; key tiles a window hides from a whole block of rows are skipped, and a
        ragged batch's work is split at sequence starts. Other arguments (cache=,
        key_position, query_position, window_left, window_right, softcap, alibi_slopes, sinks,
        cu_seqlens_q, cu_seqlens_k, SharedTensor inputs and output_to too) as for naive()."""
        request = self._request(q, k, v, causal, scale, block_k, return_lse, dtype,
                                output_dtype, cache, key_position, query_position, window_left,
                                window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                sinks, output_to)
        return Result(self._call("Tiled", self._stub.Tiled, request),
                      self._known_regions([output_to]))

    def trace(self, q, k=None, v=None, rows=None, *, cache=None, block_k=0, causal=False,
              scale=None, dtype=None, key_position=0, query_position=None, window_left=None,
              window_right=None, softcap=0.0, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, sinks=None):
        """Streams the online softmax of `rows` → an iterator of event dicts (see the module
        docstring): one "start", then per row one "step" per key tile and a "row_done", then
        "end". rows: (batch, head, row) tuples, or ints meaning (0, 0, row); None: row 0.
        cache: a Cache or cache id to trace over instead of k and v; key_position,
        query_position, window_left and window_right as for naive() (the "start" event repeats
        them, positions resolved, a window None when unbounded); a row's first "step" is the
        first tile holding a key it sees, tiles its window hides are not traced.
        softcap as for naive(): the "start" event repeats it (0.0: none), and with one each
        "step" has "scaled_scores", the tile's scores before the cap (masked keys included),
        while "scores" are capped (and −inf where masked); without one scaled_scores is empty.
        alibi_slopes as for naive(): the "start" event repeats them as "alibi_slopes" (empty:
        none), and with them each "step" has "biases", each key's −slope · |p − t| (masked keys
        included), and "scaled_scores" (before softcap and bias), with "scores" =
        softcap(scaled_scores) + biases where visible; without ALiBi biases is empty.
        sinks as for naive(): the "start" event repeats them as "sinks" (empty: none); a
        "step" never includes the sink (its estimate is of the keys so far), which joins the
        row once after its last tile: "row_done"'s output, reference and lse include it, and
        its "sink_share" is the weight the sink took, e^(sink − lse) (0.0 without sinks).
        cu_seqlens_q, cu_seqlens_k as for naive(): the "start" event repeats them as lists of
        ints (empty: one sequence; its key_position and query_position are then 0), a row is
        (0, head, its packed row), and each "step"'s "hidden" marks the keys of the other
        sequences "HIDDEN_SEQUENCE".
        Arguments are checked now; the RPC starts on the first next(). Closing the iterator
        early (break, close()) cancels the stream. A failure mid-stream raises AttnError."""
        request = pb.TraceRequest(
            attention=self._request(q, k, v, causal, scale, block_k, False, dtype, None, cache,
                                    key_position, query_position, window_left, window_right,
                                    softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks))
        for index, row in enumerate([] if rows is None else rows):
            if isinstance(row, numbers.Integral) and not isinstance(row, bool):
                row = (0, 0, row)
            if (not isinstance(row, (tuple, list)) or len(row) != 3
                    or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                               for x in row)):
                raise TypeError("rows[%d] must be a (batch, head, row) tuple of ints, not %r"
                                % (index, row))
            if min(row) < 0:
                raise ValueError("rows[%d] = %r has a negative index" % (index, tuple(row)))
            request.rows.add(batch=int(row[0]), head=int(row[1]), row=int(row[2]))
        return self._trace_events(request)

    def _trace_events(self, request):
        call = None
        try:
            call = self._stub.Trace(request, timeout=self.timeout, metadata=self._metadata)
            for event in call:
                yield _event_dict(event)
        except grpc.RpcError as error:
            raise AttnError.from_rpc_error("Trace", error) from None
        finally:
            if call is not None:
                call.cancel()  # no-op once the stream has finished

    def info(self):
        """GetServerInfo → a dict of ServerInfo's fields, dtypes and cache_dtypes as names
        ("fp32", ..., "fp8_e4m3": cache_dtypes lists it where the server keeps fp8 caches)."""
        info = _message_dict(self._call("GetServerInfo", self._stub.GetServerInfo,
                                        pb.GetServerInfoRequest()))
        for field in ("dtypes", "cache_dtypes"):
            info[field] = [_DTYPE_NAMES.get(d, str(d)) for d in info.get(field, [])]
        return info

    def health(self, service=""):
        """grpc.health.v1 Check → "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN".
        service "": the whole server. (Health needs no token on attnd.)"""
        encoded = service.encode("utf-8")
        if len(encoded) > 127:
            raise ValueError("service name too long")
        request = (b"\x0a" + bytes([len(encoded)]) + encoded) if encoded else b""
        response = self._call("Health", self._health, request)
        # HealthCheckResponse{ServingStatus status = 1}: empty (UNKNOWN) or 0x08 <varint>.
        status, shift, position = 0, 0, 1
        if response:
            if response[0] != 0x08:
                raise AttnError("Health", grpc.StatusCode.INTERNAL,
                                "unexpected HealthCheckResponse bytes %r" % response)
            while position < len(response):
                byte = response[position]
                status |= (byte & 0x7F) << shift
                shift += 7
                position += 1
                if not byte & 0x80:
                    break
        return _HEALTH_STATUS.get(status, str(status))

    # Shared memory.

    def register_shared_memory(self, name, memory, byte_size=None, offset=0):
        """RegisterSharedMemory → a SharedRegion: attnd (on this machine, started with
        --allow-shared-memory) opens a file in /dev/shm and serves its bytes [offset, offset +
        byte_size) under `name`, to this caller's identity alone (its client certificate; one
        identity for all the callers of a server without mutual TLS).

        memory: a multiprocessing.shared_memory.SharedMemory (the key sent is "/" + its name;
        byte_size None: memory.size − offset), whose SharedRegion can then view its bytes
        (array()) and whose outputs come back as views (Result.output); or a key string, a
        POSIX shared-memory name ("/attn-0", as shm_open takes it) or a path under /dev/shm
        ("/dev/shm/attn-0"), byte_size then required and the SharedRegion without memory.
        name: 1 to 128 characters of [A-Za-z0-9_.-]. TypeError / ValueError naming the argument
        before any RPC for one that is not valid, a byte_size missing, or a range past a
        SharedMemory's end. attnd answers FAILED_PRECONDITION naming --allow-shared-memory when
        it runs without it, ALREADY_EXISTS for a name the caller has registered, NOT_FOUND for a
        file that does not exist, OUT_OF_RANGE for a range past the file's end, INVALID_ARGUMENT
        naming the field for a bad key or range, RESOURCE_EXHAUSTED past 64 regions. attnd holds
        the file open (not its name) until unregister_shared_memory(): unlinking the name does
        not end the registration; truncating the file fails the calls that read or write past
        its new end (FAILED_PRECONDITION), never the server."""
        name = _region_name(name)
        offset = _byte_count("offset", offset)
        if isinstance(memory, _shared_memory.SharedMemory):
            if byte_size is None:
                byte_size = memory.size - offset
                if byte_size < 0:
                    raise ValueError("offset %d is past the SharedMemory's %d bytes"
                                     % (offset, memory.size))
            byte_size = _byte_count("byte_size", byte_size)
            if offset + byte_size > memory.size:
                raise ValueError("offset %d + byte_size %d is past the SharedMemory's %d bytes"
                                 % (offset, byte_size, memory.size))
            key = memory.name if memory.name.startswith("/") else "/" + memory.name
        elif isinstance(memory, str):
            if not memory:
                raise ValueError("memory: a key must not be empty (\"/attn-0\" or "
                                 "\"/dev/shm/attn-0\")")
            if byte_size is None:
                raise ValueError("byte_size is required with a key (%r); a SharedMemory gives "
                                 "its size" % memory)
            byte_size = _byte_count("byte_size", byte_size)
            key, memory = memory, None
        else:
            raise TypeError("memory must be a multiprocessing.shared_memory.SharedMemory or a "
                            "key string (\"/attn-0\", \"/dev/shm/attn-0\"), not %s"
                            % type(memory).__name__)
        answer = self._call("RegisterSharedMemory", self._stub.RegisterSharedMemory,
                            pb.RegisterSharedMemoryRequest(name=name, key=key, offset=offset,
                                                           byte_size=byte_size))
        region = SharedRegion(answer.name, answer.key, answer.offset, answer.byte_size,
                              answer.writable, memory)
        with self._regions_lock:
            self._regions[region.name] = region
        return region

    def unregister_shared_memory(self, name=""):
        """UnregisterSharedMemory of one region by name (a SharedRegion works too; NOT_FOUND
        when the caller has none of that name) or, for "", of every region of the caller (its
        identity's, registered through any Client) → the names unregistered, a list. A call
        already reading a region finishes with it; later calls naming it get NOT_FOUND. The
        SharedMemory objects are the caller's to close and unlink."""
        if isinstance(name, SharedRegion):
            name = name.name
        elif name != "":
            _region_name(name)
        response = self._call("UnregisterSharedMemory", self._stub.UnregisterSharedMemory,
                              pb.UnregisterSharedMemoryRequest(name=name))
        names = list(response.names)
        with self._regions_lock:
            for gone in names:
                self._regions.pop(gone, None)
        return names

    def shared_memory_status(self, name=""):
        """SharedMemoryStatus → the caller's regions as dicts (name, key, offset, byte_size,
        writable), by name: one by name (NOT_FOUND when the caller has none of that name), or
        all of them for ""."""
        if isinstance(name, SharedRegion):
            name = name.name
        elif name != "":
            _region_name(name)
        response = self._call("SharedMemoryStatus", self._stub.SharedMemoryStatus,
                              pb.SharedMemoryStatusRequest(name=name))
        return [_message_dict(region) for region in response.regions]

    def _known_regions(self, targets=()):
        """name → SharedRegion for the answer's shared-memory outputs: the regions registered
        through this Client, and those of the SharedTensors given (output_to) that have memory."""
        if not targets and not self._regions:
            return {}  # Nothing registered (read without the lock: the request is built).
        with self._regions_lock:
            regions = dict(self._regions)
        for target in targets:
            if isinstance(target, SharedTensor) and isinstance(target.region, SharedRegion) \
                    and target.region.memory is not None:
                regions[target.region.name] = target.region
        return regions

    # KV caches.

    def create_cache(self, kv_heads, head_dim, value_dim=None, dtype="fp32", *,
                     values_from_keys=False):
        """CreateCache → a new, empty Cache. value_dim None: head_dim. dtype: the storage type
        of its keys and values ("fp32", "fp16", "bf16"; appended tokens are converted to it,
        or "fp8" / "fp8_e4m3" / "float8_e4m3" / DTYPE_FLOAT8_E4M3: fp8 E4M3 rows with a float32
        scale each, quantized by attnd from tokens sent as float32; see the module docstring).
        values_from_keys=True: a latent cache (MLA, as DeepSeek-V3 decodes) that stores keys
        only, a token's value being the first value_dim columns of its key (value_dim ≤
        head_dim: INVALID_ARGUMENT naming value_dim otherwise); its appends and decode items
        send the key alone (see the module docstring). RESOURCE_EXHAUSTED when the server's
        --cache-bytes cannot hold its first page."""
        for name, number in (("kv_heads", kv_heads), ("head_dim", head_dim),
                             ("value_dim", head_dim if value_dim is None else value_dim)):
            if isinstance(number, bool) or not isinstance(number, numbers.Integral):
                raise TypeError("%s must be an int, not %s" % (name, type(number).__name__))
        if not isinstance(values_from_keys, (bool, np.bool_)):
            raise TypeError("values_from_keys must be a bool, not %s"
                            % type(values_from_keys).__name__)
        request = pb.CreateCacheRequest(
            kv_heads=int(kv_heads), head_dim=int(head_dim),
            value_dim=int(head_dim if value_dim is None else value_dim),
            dtype=_dtype_enum(dtype, "dtype", cache=True),
            values_from_keys=bool(values_from_keys))
        return Cache(self, self._call("CreateCache", self._stub.CreateCache, request))

    def open_cache(self, cache_id):
        """A Cache for an existing cache id (GetCacheInfo: its length is read now)."""
        return Cache(self, self._cache_info(_cache_id(cache_id)))

    def append(self, cache, key, value=None, *, expected_length=None, dtype=None):
        """AppendCache: key [kv_heads, n, head_dim] and value [kv_heads, n, value_dim] at the end
        of `cache` (a Cache, or an id with expected_length) → the new CacheInfo dict; a latent
        cache (values_from_keys) takes the key alone (value None), and a value given for a
        latent Cache is a ValueError naming value (none given for a Cache that stores values,
        too), before any RPC. expected_length: the length the cache has before these tokens;
        None: a Cache's `length` (an id needs it given). FAILED_PRECONDITION, naming the actual
        length, when it is wrong; the cache is then unchanged. dtype None: a Cache's dtype,
        float32 for an fp8 Cache (an id's arrays are sent as they are, see the module
        docstring); "fp8" is a ValueError (a cache's dtype only). key and value may be
        SharedTensors (in the cache's dtype, any for an fp8 cache: ValueError naming them
        otherwise); a Cache keeps a copy of their bytes for its replay tail when it needs one
        (see Cache._record)."""
        cache_id = _cache_id(cache)
        _check_value(cache, "", key, value)
        expected = _expected_length(cache, expected_length)
        token_dtype, shared_as_is = _token_dtype(cache, _dtype_enum(dtype, "dtype"))
        request = pb.AppendCacheRequest(
            cache_id=cache_id, key=_encode_tokens("key", key, token_dtype, shared_as_is),
            expected_length=expected)
        if value is not None:
            request.value.CopyFrom(_encode_tokens("value", value, token_dtype, shared_as_is))
        info = _cache_dict(self._call("AppendCache", self._stub.AppendCache, request))
        if isinstance(cache, Cache):
            cache._record(expected, request.key,
                          request.value if request.HasField("value") else None, info,
                          (key, value))
            cache._set(info)
        return info

    def truncate_cache(self, cache, length, expected_length=None):
        """TruncateCache: cuts `cache` (a Cache or an id) to its first `length` tokens → the
        new CacheInfo dict; the tokens from `length` on are dropped, so the cache is exactly one
        that never had them (speculative decoding's rollback of rejected drafts). With attnd
        --cache-dir the cut is on disk before the answer. expected_length: the length before the
        cut; None: a Cache's `length`, or not checked for an id. FAILED_PRECONDITION naming the
        actual length when it is stale, OUT_OF_RANGE for a length past the cache's; the cache is
        then unchanged. TypeError / ValueError naming `length` or `expected_length` for a
        non-int (a bool included) or a negative value, before any RPC. A Cache takes the answer
        (its length, and its replay tail cut at `length`)."""
        cache_id = _cache_id(cache)
        length = _token_length("length", length)
        request = pb.TruncateCacheRequest(cache_id=cache_id, length=length)
        if expected_length is not None or isinstance(cache, Cache):
            request.expected_length = _expected_length(cache, expected_length)
        try:
            info = _cache_dict(self._call("TruncateCache", self._stub.TruncateCache, request))
        except BaseException as error:
            if isinstance(cache, Cache):
                cache._cut_failed(length, error)
            raise
        if isinstance(cache, Cache):
            cache._cut(length)
            cache._set(info)
        return info

    def fork_cache(self, cache, length=None, expected_length=None):
        """ForkCache: a new cache whose tokens are the first `length` of `cache` (a Cache or an
        id; None: all of them), sharing its pages (copy on write) → the fork's CacheInfo dict
        (Cache.fork gives a Cache instead). Its shared_bytes says how many of its bytes it
        shares; with attnd --cache-dir its durable_length is its length. expected_length: the
        source's length; None: a Cache's `length`, or not checked for an id. FAILED_PRECONDITION
        naming the actual length when it is stale, OUT_OF_RANGE for a length past the source's,
        RESOURCE_EXHAUSTED at attnd --max-caches (or when the fork's page table does not fit
        --cache-bytes); a refused fork creates nothing. TypeError / ValueError naming `length`
        or `expected_length` for a non-int (a bool included) or a negative value, before any
        RPC. The source (and a Cache given for it) is unchanged."""
        cache_id = _cache_id(cache)
        request = pb.ForkCacheRequest(cache_id=cache_id)
        if length is not None:
            request.length = _token_length("length", length)
        if expected_length is not None or isinstance(cache, Cache):
            request.expected_length = _expected_length(cache, expected_length)
        return _cache_dict(self._call("ForkCache", self._stub.ForkCache, request))

    def _cache_info(self, cache_id):
        return self._call("GetCacheInfo", self._stub.GetCacheInfo,
                          pb.GetCacheInfoRequest(cache_id=cache_id))

    def cache_info(self, cache):
        """GetCacheInfo of a Cache or id → its CacheInfo dict (a Cache takes it as it is, its
        length too, even a shorter one; Cache.refresh() is what re-sends tokens a restart
        lost)."""
        info = _cache_dict(self._cache_info(_cache_id(cache)))
        if isinstance(cache, Cache):
            cache._set(info)
        return info

    def list_caches(self):
        """ListCaches → the caller's caches as CacheInfo dicts, oldest first."""
        response = self._call("ListCaches", self._stub.ListCaches, pb.ListCachesRequest())
        return [_cache_dict(info) for info in response.caches]

    def delete_cache(self, cache):
        """DeleteCache of a Cache or id: frees its memory; later calls naming it get
        NOT_FOUND (and so does deleting it again)."""
        self._call("DeleteCache", self._stub.DeleteCache,
                   pb.DeleteCacheRequest(cache_id=_cache_id(cache)))

    def _export_chunks(self, cache):
        """ExportCache's stream → its CacheChunk messages, AttnError on a failure (the stream
        cancelled when the caller stops early)."""
        call = None
        try:
            call = self._stub.ExportCache(pb.ExportCacheRequest(cache_id=_cache_id(cache)),
                                          timeout=self.timeout, metadata=self._metadata)
            for chunk in call:
                yield chunk
        except grpc.RpcError as error:
            raise AttnError.from_rpc_error("ExportCache", error) from None
        finally:
            if call is not None:
                call.cancel()

    def export_cache(self, cache, path=None, *, verify=False):
        """ExportCache of a Cache or id: its layout and tokens, bit-exact in its dtype (an fp8
        cache's as its stored rows: codes, padding to 4 bytes, float32 scale; see the module
        docstring).

        path None → the list of CacheChunk messages: the first carries info (CacheInfo: id,
        layout, length = the tokens exported), each tokens [start, start + n) as key [kv_heads,
        n, head_dim] and value [kv_heads, n, value_dim] Tensors, the last crc32c (of every
        chunk's key.data then value.data). With path: the chunks written to that file as
        `attn cache export` writes them (EXPORT_FILE_MAGIC, then per chunk a u32 little-endian
        length and the serialized chunk; written to path + ".tmp", renamed when whole) → the
        export's info dict, its crc32c the last chunk's. verify: check that CRC32C here too
        (crc32c(); pure Python, some 8 MB/s). AttnError DATA_LOSS when the stream ends without
        its crc32c or verify finds another."""
        check = _ExportCheck(verify)
        if path is None:
            chunks = []
            for chunk in self._export_chunks(cache):
                check.add(chunk)
                chunks.append(chunk)
            check.finish()
            return chunks
        path = os.fspath(path)
        partial = path + ".tmp"
        try:
            with open(partial, "wb") as out:
                out.write(EXPORT_FILE_MAGIC)
                for chunk in self._export_chunks(cache):
                    check.add(chunk)
                    data = chunk.SerializeToString()
                    out.write(struct.pack("<I", len(data)))
                    out.write(data)
                out.flush()
                os.fsync(out.fileno())
            info = check.finish()
            os.replace(partial, path)
        except BaseException:
            try:
                os.unlink(partial)
            except OSError:
                pass
            raise
        return info

    def import_cache(self, chunks, new_id_if_taken=False):
        """ImportCache → a Cache for the imported copy, under this server's budget and the
        caller's identity. chunks: export_cache's list (or any iterable of CacheChunk
        messages), or the path of an export file. The copy keeps the export's cache id when it
        is free here; else ALREADY_EXISTS, or a new id with new_id_if_taken=True. A stream cut
        short or damaged (a token missing, a CRC32C that does not match) is refused whole,
        DATA_LOSS, and nothing is imported; so is a file cut inside a chunk (the message names
        the file). The answer's crc32c (the Cache's info) is that of the tokens stored. The
        imported tokens are not in the Cache's replay tail: keep the export until
        durable_length reaches them."""
        problem = []  # What stopped the stream early: (exception class, message).
        if isinstance(chunks, (str, bytes, os.PathLike)):
            path = os.fsdecode(chunks)
            source = open(path, "rb")
            try:
                magic = source.read(len(EXPORT_FILE_MAGIC))
                if magic != EXPORT_FILE_MAGIC:
                    raise ValueError("%s is not a cache export file: it starts %r, not %r"
                                     % (path, magic, EXPORT_FILE_MAGIC))
            except BaseException:
                source.close()
                raise
            messages = _read_export_file(source, path, problem)
        elif isinstance(chunks, pb.CacheChunk) or not hasattr(chunks, "__iter__"):
            raise TypeError("chunks must be an iterable of CacheChunk messages (export_cache's "
                            "list) or a file path, not %s" % type(chunks).__name__)
        else:
            source, messages = None, _checked_chunks(chunks, problem)

        def stream():
            for index, chunk in enumerate(messages):
                if index == 0 and chunk.new_id_if_taken != bool(new_id_if_taken):
                    first = pb.CacheChunk()
                    first.CopyFrom(chunk)
                    first.new_id_if_taken = bool(new_id_if_taken)
                    chunk = first
                yield chunk

        try:
            info = self._call("ImportCache", self._stub.ImportCache, stream())
        except AttnError as error:
            if problem:
                kind, message = problem[0]
                if kind is AttnError:
                    raise AttnError("ImportCache", grpc.StatusCode.DATA_LOSS,
                                    "%s; nothing imported (the server said: %s)"
                                    % (message, error.message)) from None
                raise kind(message) from None
            raise
        finally:
            if source is not None:
                source.close()
        # Even with a `problem`: the server had every chunk (their CRC32C verified) before it.
        return Cache(self, info)

    def decode(self, items, *, causal=False, scale=None, block_k=0, return_lse=False,
               dtype=None, output_dtype=None, key_position=None, query_position=None,
               window_left=None, window_right=None, softcap=0.0, alibi_slopes=None,
               sinks=None):
        """Decode: one step of a batch of sequences in one call → DecodeResult.

        items: a list, one per sequence (at most one per cache), each a tuple
        (cache, query), (cache, query, key, value) or, for a latent cache, (cache, query, key),
        or a dict with "cache", "query" and optionally "key", "value", "expected_length",
        "key_position", "query_position", "truncate_to", "tree_parents" and "output_to".
        cache: a Cache or an id; query [heads, nq, head_dim] with heads a multiple of the
        cache's kv_heads; key/value (both or neither; a latent cache's key alone, a value for a
        latent Cache being a ValueError naming items[i].value before any RPC) new tokens
        appended first, as for append(); expected_length as for append(). query, key and value
        may be SharedTensors (as for naive() and append()). "output_to": a SharedTensor attnd
        writes the item's output into (as naive()'s output_to: INVALID_ARGUMENT naming
        items[i].output_to.byte_size for another byte size, ValueError naming items[i].output_to
        for another dtype than the output's); outputs[i] is then a view of it or None.
        "truncate_to" (None: no cut):
        the cache is first cut to its first truncate_to tokens, as by truncate_cache(), then
        the item's key/value appended (speculative decoding: drop the drafts the last step
        rejected and append the next ones in one call); expected_length is still the length
        before the cut; a cut past the cache's length is OUT_OF_RANGE naming
        items[i].truncate_to. "tree_parents" (None or empty: no tree): the item's new tokens as
        a token tree (EAGLE, Medusa; see the module docstring), a sequence or 1-D array of ints,
        one per new token: the index of its parent among them, or −1 for a child of the cached
        prefix; the item's query then has one row per new token, and row i sees the prefix,
        token i's ancestors and itself (e.g. [-1, 0, 0, 1]: t0 → {t1, t2}, t1 → {t3}). The
        client raises TypeError naming items[i].tree_parents[j] for an entry that is not an int
        (a bool included) and ValueError for one below −1 or not earlier than j, before any RPC;
        the server answers INVALID_ARGUMENT naming items[i].tree_parents for a count other than
        the new tokens' (or over 1024) and items[i].query for a row count other than theirs.
        The cuts, the appends and the attention are one atomic step: if
        any item fails, every cache keeps the tokens it had (and no Cache's length moves; see
        the module docstring for a failure that does not say whether it was applied). Item i's
        output is [heads, nq, value_dim]; causal is bottom-right against each cache's length
        after its cut and append. Positions are per item: "key_position" (default 0)
        is that of the cache's first token and "query_position" (default None: key_position +
        the cache's length after the append − nq) that of the item's first query row, as for
        naive(); key_position= and query_position= here, for the whole batch, are a ValueError.
        window_left, window_right (as for naive()): one window for the whole batch, applied to
        each item against that item's own positions. softcap (as for naive()): the batch's,
        applied to every item. alibi_slopes (as for naive()): the batch's, one per query head
        of every item (all items' queries must then have the same head count), each item biased
        by its own positions; "standard" takes the head count of the first item's query.
        sinks (as for naive()): the batch's, one per query head of every item (all items'
        queries must then have that many heads; the server checks, INVALID_ARGUMENT naming
        options.sinks), each item's rows taking its sink once. A sequence whose keys are split
        over several caches must send the sinks only with the part holding its first key, so
        its parts cannot share one batch with sinks: decode the first part with them and the
        others in a call without (then merge_states()).
        dtype converts every query, key and value (None: queries as they are, keys and values
        of a Cache in its dtype, float32 for an fp8 Cache); other options as for naive()."""
        if key_position is not None or query_position is not None:
            raise ValueError("decode takes positions per item, not for the batch: give each "
                             "item dict its own 'key_position' / 'query_position' (or "
                             "Cache.decode(..., key_position=, query_position=))")
        if isinstance(items, (dict, tuple)) or not hasattr(items, "__iter__"):
            raise TypeError("items must be a list of (cache, query[, key, value]) tuples or dicts")
        items = list(items)
        input_dtype = _dtype_enum(dtype, "dtype")
        request = pb.DecodeRequest()
        self._options(causal, scale, block_k, return_lse, output_dtype,
                      window_left=window_left, window_right=window_right, softcap=softcap,
                      alibi_slopes=alibi_slopes, query=_item_query(items[0]) if items else None,
                      sinks=sinks, into=request.options)
        caches, sent, sources, targets = [], [], [], []
        for index, item in enumerate(items):
            item_key_position, item_query_position = 0, None
            if isinstance(item, dict):
                unknown = item.keys() - _DECODE_ITEM_KEYS
                if unknown or "cache" not in item or "query" not in item:
                    raise TypeError("items[%d]: a dict with 'cache' and 'query' (and optionally "
                                    "'key', 'value', 'expected_length', 'key_position', "
                                    "'query_position', 'truncate_to', 'tree_parents', "
                                    "'output_to'), got keys %s" % (index, sorted(item)))
                cache, query = item["cache"], item["query"]
                key, value = item.get("key"), item.get("value")
                expected = item.get("expected_length")
                item_key_position = item.get("key_position", 0)
                item_query_position = item.get("query_position")
                truncate_to = item.get("truncate_to")
                tree_parents = item.get("tree_parents")
                output_to = item.get("output_to")
            elif isinstance(item, (tuple, list)) and len(item) in (2, 3, 4):
                cache, query = item[0], item[1]
                key = item[2] if len(item) > 2 else None
                value = item[3] if len(item) > 3 else None
                expected = truncate_to = tree_parents = output_to = None
            else:
                raise TypeError("items[%d] must be (cache, query), (cache, query, key, value), "
                                "(cache, query, key) for a latent cache, or a dict, not %r"
                                % (index, type(item).__name__))
            name = "items[%d]." % index
            _check_value(cache, name, key, value)
            message = request.items.add()
            message.cache_id = _cache_id(cache)
            message.expected_length = _expected_length(cache, expected)
            _encode(name + "query", query, input_dtype, into=message.query)
            item_key_position = _position(name + "key_position", item_key_position)
            if item_key_position:
                message.key_position = item_key_position
            if item_query_position is not None:
                message.query_position = _position(name + "query_position", item_query_position)
            if truncate_to is not None:
                message.truncate_to = _token_length(name + "truncate_to", truncate_to)
            if tree_parents is not None:
                message.tree_parents.extend(_tree_parents(name + "tree_parents", tree_parents))
            if key is not None:
                token_dtype, shared_as_is = _token_dtype(cache, input_dtype)
                _encode_tokens(name + "key", key, token_dtype, shared_as_is, into=message.key)
            if value is not None:
                _encode_tokens(name + "value", value, token_dtype, shared_as_is,
                               into=message.value)
            if output_to is not None:
                message.output_to.CopyFrom(_shared_ref(name + "output_to", output_to))
                _check_output_to(name + "output_to", output_to, request.options, message.query)
                targets.append(output_to)
            caches.append(cache)
            sent.append(message)
            sources.append((key, value))
        try:
            result = DecodeResult(self._call("Decode", self._stub.Decode, request),
                                  self._known_regions(targets))
        except BaseException as error:
            for cache, message in zip(caches, sent):
                if isinstance(cache, Cache) and message.HasField("truncate_to"):
                    cache._cut_failed(message.truncate_to, error)
            raise
        if len(result.caches) != len(caches) or len(result.outputs) != len(caches):
            raise AttnError("Decode", grpc.StatusCode.INTERNAL,
                            "%d outputs and %d cache infos for %d items"
                            % (len(result.outputs), len(result.caches), len(caches)))
        for cache, message, source, info in zip(caches, sent, sources, result.caches):
            if isinstance(cache, Cache):
                start = message.expected_length
                if message.HasField("truncate_to"):
                    cache._cut(message.truncate_to)
                    start = message.truncate_to
                if message.HasField("key"):
                    cache._record(start, message.key,
                                  message.value if message.HasField("value") else None, info,
                                  source)
                cache._set(info)
        return result


# The keys a Client.decode item dict may have.
_DECODE_ITEM_KEYS = frozenset(("cache", "query", "key", "value", "expected_length", "key_position",
                               "query_position", "truncate_to", "tree_parents", "output_to"))


# The first bytes of a cache export file (`attn cache export ID --to FILE`, export_cache(.., path)).
EXPORT_FILE_MAGIC = b"ATTNEXP1"


class _ExportCheck:
    """Follows an export stream chunk by chunk: its first chunk's info, its tokens, the crc32c
    of its last chunk and, with verify, the CRC32C of the tokens seen."""

    def __init__(self, verify):
        self.verify = verify
        self.info = None
        self.chunks = self.tokens = 0
        self.crc = 0
        self.sent_crc = None

    def add(self, chunk):
        if self.chunks == 0:
            if not chunk.HasField("info"):
                raise AttnError("ExportCache", grpc.StatusCode.DATA_LOSS,
                                "the export's first chunk carries no info")
            self.info = _cache_dict(chunk.info)
        self.chunks += 1
        if chunk.HasField("key"):
            self.tokens += _token_count(chunk.key)
            if self.verify:
                self.crc = crc32c(chunk.value.data, crc32c(chunk.key.data, self.crc))
        if chunk.HasField("crc32c"):
            self.sent_crc = chunk.crc32c

    def finish(self):
        """→ the export's info dict (crc32c: the last chunk's); AttnError DATA_LOSS when the
        stream is not whole or, with verify, its CRC32C is not the tokens'."""
        if self.info is None:
            raise AttnError("ExportCache", grpc.StatusCode.DATA_LOSS, "the export held no chunk")
        if self.sent_crc is None or self.tokens != self.info["length"]:
            raise AttnError("ExportCache", grpc.StatusCode.DATA_LOSS,
                            "the export of cache %s ended after %d of its %d tokens%s"
                            % (self.info["cache_id"], self.tokens, self.info["length"],
                               "" if self.sent_crc is not None else " without its crc32c"))
        if self.verify and self.crc != self.sent_crc:
            raise AttnError("ExportCache", grpc.StatusCode.DATA_LOSS,
                            "the export of cache %s says CRC32C %d, its tokens have %d"
                            % (self.info["cache_id"], self.sent_crc, self.crc))
        info = dict(self.info)
        info["crc32c"] = self.sent_crc
        return info


def _read_export_file(source, path, problem):
    """The CacheChunk messages of an export file open past its magic; stops at its end, or at
    a chunk cut short or unreadable (noted in `problem` as (AttnError, what))."""
    size = os.fstat(source.fileno()).st_size
    index = 0
    while True:
        at = source.tell()
        prefix = source.read(4)
        if not prefix:
            return
        length = struct.unpack("<I", prefix)[0] if len(prefix) == 4 else -1
        if length < 0 or length > size - at - 4:
            problem.append((AttnError, "%s is cut inside chunk %d (at byte %d of %d)"
                            % (path, index, at, size)))
            return
        chunk = pb.CacheChunk()
        try:
            chunk.ParseFromString(source.read(length))
        except Exception as error:  # google.protobuf.message.DecodeError
            problem.append((AttnError, "%s: chunk %d (at byte %d) does not parse: %s"
                            % (path, index, at, error)))
            return
        yield chunk
        index += 1


def _checked_chunks(chunks, problem):
    """The CacheChunk messages of `chunks`; stops at anything else (noted in `problem` as
    (TypeError, what))."""
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, pb.CacheChunk):
            problem.append((TypeError, "chunks[%d] is a %s, not a CacheChunk"
                            % (index, type(chunk).__name__)))
            return
        yield chunk


def _cache_id(cache):
    """A Cache or a cache id → the id."""
    if isinstance(cache, Cache):
        return cache.id
    if isinstance(cache, str) and cache:
        return cache
    raise TypeError("a cache must be a Cache or a non-empty cache id string, not %r"
                    % type(cache).__name__)


# Positions and windows are in [0, 2^62] (attention.proto, AttentionOptions).
MAX_POSITION = 1 << 62


def _position(name, position):
    """A key_position, query_position, window_left or window_right → the int to send;
    TypeError / ValueError naming it."""
    if isinstance(position, bool) or not isinstance(position, numbers.Integral):
        raise TypeError("%s must be an int, not %s" % (name, type(position).__name__))
    if not 0 <= position <= MAX_POSITION:
        raise ValueError("%s must be in [0, 2^62], got %d" % (name, position))
    return int(position)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _cu_seqlens(name, values):
    """cu_seqlens_q or cu_seqlens_k → the list of ints to send ([]: None, one sequence);
    ValueError naming it for what cannot be sent: not a sequence or 1-D array of integers, or
    a value beyond int64. Ranges (starting at 0, never decreasing, the packed length last, the
    two counts equal) are the server's check, which names the offending entry."""
    if values is None:
        return []
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError("%s must be 1-D (S + 1 cumulative lengths), got shape %s"
                             % (name, values.shape))
        if values.dtype.kind not in "iu":
            raise ValueError("%s has element type %s; expected integers" % (name, values.dtype))
        values = values.tolist()
    elif isinstance(values, (str, bytes, dict, set)) or not hasattr(values, "__iter__"):
        raise ValueError("%s must be a sequence or 1-D array of ints (S + 1 cumulative "
                         "lengths) or None, not %s" % (name, type(values).__name__))
    lengths = []
    for index, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise ValueError("%s[%d] must be an int, not %s"
                             % (name, index, type(value).__name__))
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError("%s[%d] = %d is beyond int64" % (name, index, value))
        lengths.append(int(value))
    return lengths


def cumulative_lengths(lengths):
    """Sequence lengths → the S + 1 cumulative lengths a ragged batch sends as cu_seqlens_q or
    cu_seqlens_k (a list of ints, from 0 to the packed length): [5, 1, 40] → [0, 5, 6, 46];
    [] → [0]. lengths: a sequence or 1-D array of ints ≥ 0 (0: an empty sequence); ValueError
    otherwise."""
    counted = _cu_seqlens("lengths", lengths)
    total, result = 0, [0]
    for index, length in enumerate(counted):
        if length < 0:
            raise ValueError("lengths[%d] = %d is negative" % (index, length))
        total += length
        result.append(total)
    return result


def _softcap(softcap):
    """A softcap → the float to send (0.0: off); TypeError / ValueError naming it. It travels
    as a proto float, so it must be finite in float32 too, and a positive one must not round
    to 0 there (which would turn the cap off)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError("softcap must be a real number (0.0: off), not %s"
                        % type(softcap).__name__)
    value = float(softcap)
    if value == 0:
        return 0.0  # Off (the usual case, spared the float32 checks); -0.0 → 0.0.
    if not math.isfinite(value):
        raise ValueError("softcap must be finite, got %r" % value)
    if value < 0:
        raise ValueError("softcap must be ≥ 0 (0.0: off), got %r" % value)
    with np.errstate(over="ignore", under="ignore"):
        as_float32 = np.float32(value)
    if not np.isfinite(as_float32):
        raise ValueError("softcap %r is beyond float32's range" % value)
    if value > 0 and as_float32 == 0:
        raise ValueError("softcap %r rounds to 0 (off) in float32" % value)
    return value


def standard_alibi_slopes(heads):
    """The standard ALiBi slopes for `heads` query heads (Press et al.; BLOOM's), as
    attn::client::StandardAlibiSlopes computes them → a list of floats (float32 values, as they
    are sent). For a power of two n, head h's slope is 2^(−8(h+1)/n); otherwise the n =
    2^⌊log₂ heads⌋ slopes, then every other one of the 2n slopes, 2^(−8(2i+1)/(2n)) for
    i = 0, 1, …, for the heads past n. 0 heads: []."""
    if isinstance(heads, (bool, np.bool_)) or not isinstance(heads, numbers.Integral):
        raise TypeError("heads must be an int, not %s" % type(heads).__name__)
    if heads < 0:
        raise ValueError("heads must be ≥ 0, got %d" % heads)
    heads = int(heads)
    if heads == 0:
        return []
    n = 1
    while n * 2 <= heads:
        n *= 2
    exponents = [-8.0 * (h + 1) / n for h in range(n)]
    exponents += [-8.0 * (2 * i + 1) / (2 * n) for i in range(heads - n)]
    exp2 = getattr(math, "exp2", lambda x: 2.0 ** x)  # math.exp2: Python ≥ 3.11, C's exp2.
    return [float(np.float32(exp2(x))) for x in exponents]


def _query_heads(query):
    """The query head count of a query (a NumPy array, a list, a SharedTensor or a Tensor):
    rank 4 [B, H, N, D] → H, rank 3 [H, N, D] → H, rank 2 → 1; the rank errors _encode gives."""
    if isinstance(query, pb.Tensor):
        shape = tuple(int(n) for n in query.shape)
    elif isinstance(query, (np.ndarray, SharedTensor)):
        shape = query.shape
    elif isinstance(query, (list, tuple)):
        shape = np.asarray(query).shape
    else:
        raise TypeError("query must be a NumPy array, not %s" % type(query).__name__)
    if not 2 <= len(shape) <= 4:
        raise ValueError("query has rank %d (shape %s); expected rank 2 [seq, dim], 3 [heads, "
                         "seq, dim] or 4 [batch, heads, seq, dim]" % (len(shape), shape))
    return 1 if len(shape) == 2 else int(shape[-3])


def _item_query(item):
    """A decode item's query, or None when the item is malformed (the items loop says how)."""
    if isinstance(item, dict):
        return item.get("query")
    if isinstance(item, (tuple, list)) and len(item) in (2, 4):
        return item[1]
    return None


def _per_head_values(name, values, what, also=""):
    """alibi_slopes or sinks (`name`; `what`: "slope", "sink"; `also`: the other forms its
    TypeError lists) → the list of floats to send ([]: None, none); TypeError / ValueError
    naming it, or the offending entry name[h]. A sequence or 1-D array of real numbers, each
    finite and finite in float32 too (each travels as a proto float); the count (one per query
    head) is the server's check."""
    if values is None:
        return []
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError("%s must be 1-D (one %s per query head), got shape %s"
                             % (name, what, values.shape))
        if values.dtype.kind not in "fiu":
            raise TypeError("%s has element type %s; expected real numbers"
                            % (name, values.dtype))
        values = values.tolist()
    elif isinstance(values, (str, bytes, dict, set)) or not hasattr(values, "__iter__"):
        raise TypeError("%s must be a sequence of numbers (one %s per query head)%s or None, "
                        "not %s" % (name, what, also, type(values).__name__))
    result = []
    for h, value in enumerate(values):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError("%s[%d] must be a real number, not %s"
                            % (name, h, type(value).__name__))
        value = float(value)
        if not math.isfinite(value):
            raise ValueError("%s[%d] must be finite, got %r" % (name, h, value))
        with np.errstate(over="ignore", under="ignore"):
            as_float32 = np.float32(value)
        if not np.isfinite(as_float32):
            raise ValueError("%s[%d] = %r is beyond float32's range" % (name, h, value))
        result.append(value)
    return result


def _alibi_slopes(alibi_slopes, query):
    """alibi_slopes → the list of floats to send ([]: no bias); TypeError / ValueError naming
    it (_per_head_values). "standard" needs `query` for its head count."""
    if isinstance(alibi_slopes, str):
        if alibi_slopes != "standard":
            raise ValueError("alibi_slopes must be None, one slope per query head or "
                             "\"standard\", not %r" % alibi_slopes)
        if query is None:
            raise ValueError("alibi_slopes=\"standard\" needs a query to count its heads")
        return standard_alibi_slopes(_query_heads(query))
    return _per_head_values("alibi_slopes", alibi_slopes, "slope", also=", \"standard\"")


def _sinks(sinks):
    """sinks → the list of floats to send ([]: no sinks); TypeError / ValueError naming it or
    sinks[h] (_per_head_values). There is no "standard": sinks are learned, one per query
    head."""
    return _per_head_values("sinks", sinks, "sink")


def _token_length(name, length):
    """A cache length to send (TruncateCache's length, a DecodeItem's truncate_to) → the int;
    TypeError / ValueError naming it (`name`) for a non-int, a bool, or one outside
    [0, 2^63)."""
    if isinstance(length, bool) or not isinstance(length, numbers.Integral):
        raise TypeError("%s must be an int, not %s" % (name, type(length).__name__))
    if length < 0:
        raise ValueError("%s must be ≥ 0 (a token count), got %d" % (name, length))
    if length > _INT64_MAX:
        raise ValueError("%s must be < 2^63, got %d" % (name, length))
    return int(length)


def _tree_parents(name, parents):
    """A token tree's parents (DecodeItem.tree_parents) → the list of ints to send ([]: no
    tree). A sequence or 1-D array of ints, entry j being −1 (a child of the cached prefix) or
    an earlier index, 0 ≤ parent < j; TypeError / ValueError naming `name` or name[j]
    otherwise. The count (one per new token, at most 1024) is the server's check."""
    if isinstance(parents, np.ndarray):
        if parents.ndim != 1:
            raise ValueError("%s must be 1-D (one parent per new token), got shape %s"
                             % (name, parents.shape))
        if parents.dtype.kind not in "iu":
            raise TypeError("%s has element type %s; expected ints" % (name, parents.dtype))
        parents = parents.tolist()
    elif isinstance(parents, (str, bytes, dict, set)) or not hasattr(parents, "__iter__"):
        raise TypeError("%s must be a sequence or 1-D array of ints (one parent per new token), "
                        "not %s" % (name, type(parents).__name__))
    result = []
    for j, parent in enumerate(parents):
        if isinstance(parent, (bool, np.bool_)) or not isinstance(parent, numbers.Integral):
            raise TypeError("%s[%d] must be an int, not %s" % (name, j, type(parent).__name__))
        if not -1 <= parent < j:
            earlier = ("or an earlier new token's index, 0 … %d" % (j - 1) if j > 0
                       else "(no new token comes before the first)")
            raise ValueError("%s[%d] is %d; expected −1 (a child of the cached prefix) %s"
                             % (name, j, parent, earlier))
        result.append(int(parent))
    return result


def _check_value(cache, prefix, key, value):
    """New tokens' key and value for `cache` (a Cache or an id): ValueError naming
    prefix + "value" for a value given to a latent Cache (values_from_keys: its values are its
    keys' first value_dim columns) or none given with a key to a Cache that stores values, and
    for a value without a key. With an id the server judges a key alone."""
    if key is None:
        if value is not None:
            raise ValueError("%svalue is given without a key: new tokens need their key"
                             % prefix)
        return
    if not isinstance(cache, Cache):
        return
    if cache.values_from_keys and value is not None:
        raise ValueError("%svalue: cache %s is latent (values_from_keys): each token's value is "
                         "the first value_dim columns of its key; send the key alone"
                         % (prefix, cache.id))
    if not cache.values_from_keys and value is None:
        raise ValueError("%svalue is missing: cache %s stores values (it is not latent, "
                         "values_from_keys); give key and value together" % (prefix, cache.id))


def _expected_length(cache, expected_length):
    """The expected_length to send: the one given, else a Cache's believed length."""
    if expected_length is None:
        if isinstance(cache, Cache):
            return int(cache.length)
        raise ValueError("expected_length is needed with a cache id (a Cache object tracks it)")
    if isinstance(expected_length, bool) or not isinstance(expected_length, numbers.Integral):
        raise TypeError("expected_length must be an int, not %s" % type(expected_length).__name__)
    if expected_length < 0:
        raise ValueError("expected_length must be ≥ 0, got %d" % expected_length)
    return int(expected_length)


def _token_dtype(cache, dtype):
    """How new tokens for `cache` are sent, given the call's dtype (a DType number or None) →
    (the dtype for _encode_tokens, whether a SharedTensor goes in its own dtype): the call's
    dtype when given; else a Cache's dtype, or float32 for an fp8 Cache (the server quantizes
    tokens of any tensor dtype, so a SharedTensor goes as it is); else (an id) as the arrays
    are."""
    if dtype is not None or not isinstance(cache, Cache):
        return dtype, False
    stored = _dtype_enum(cache.dtype, "dtype", cache=True)
    if stored == _FLOAT8:
        return pb.DTYPE_FLOAT32, True
    return stored, False


def _encode_tokens(name, array, dtype, shared_as_is=False, into=None):
    """Cache tokens [kv_heads, n, dim] (rank 2 [n, dim] when kv_heads is 1) as a Tensor (a
    SharedTensor's naming its shared memory, in its own dtype when shared_as_is); `into` as for
    _encode."""
    if isinstance(array, (np.ndarray, SharedTensor)) and array.ndim == 4:
        raise ValueError("%s has rank 4 (shape %s); cache tokens are [kv_heads, n, dim] or "
                         "[n, dim]" % (name, array.shape))
    if shared_as_is and isinstance(array, SharedTensor):
        dtype = None
    return _encode(name, array, dtype, into)
