'use strict';
// A small Node client for attnd's attention.v1 service (proto/attention/v1/attention.proto).
//
// The proto is loaded at run time with @grpc/proto-loader; no generated code. Choices, fixed
// for every message this module hands out or accepts:
//   - Field names are lowerCamelCase (keepCase: false): options.blockK, step.maxAfter,
//     stats.computeNs, start.naiveIntermediateBytes. Requests use the same names.
//   - int64 fields are JS Numbers (longs: Number): shape dims, stats and limits all fit in
//     2^53. Enums are their names as strings (DTYPE_FLOAT32), and requests may use either
//     the name or the number.
//   - bytes are Buffers; unset scalar fields read as their defaults (defaults: true; an empty
//     repeated field, like TileStep.scaledScores without a softcap or ALiBi, is []), but an
//     unset proto3 optional field (TraceStart.windowLeft, windowRight) is absent, and a
//     TraceEvent carries `event`, the name of the oneof member it holds ('start', 'step',
//     'rowDone' or 'end').
//   - fp32 tensors travel as little-endian bytes; tensor() and toFloat32Array() convert
//     between Float32Array and a Tensor (fp16 and bf16 too, rounded to nearest even).
//
// Errors: every RPC rejects (or, for trace, throws from the iterator) an AttndError, an Error
// with .code (the numeric gRPC status), .codeName ('INVALID_ARGUMENT'), .details (the
// server's message, which names the offending field) and .metadata.
//
//   const {Client, tensor, toFloat32Array} = require('./client');
//   const client = new Client('127.0.0.1:50051', {token: 's3cret', tlsCa: 'ca.pem'});
//   const res = await client.tiled({query: tensor(q, [8, 4]), key: ..., value: ...,
//                                   options: {blockK: 2}});
//   const out = toFloat32Array(res.output);           // Float32Array, row-major
//   for await (const ev of client.trace({attention: req, rows: [{row: 0}]})) { ... }
//
// Server-resident KV caches: one method per RPC, taking and returning the messages
// (createCache, appendCache, truncateCache, forkCache, getCacheInfo, deleteCache, listCaches,
// decode), and a Cache that tracks the length it believes the cache has and sends it as
// expectedLength on every append, decode, truncate and fork (a retried call is then refused
// with FAILED_PRECONDITION, never stored twice):
//   const cache = await client.openCache({kvHeads: 8, headDim: 128, dtype: 'bf16'});
//   await cache.append(tensor(k, [8, n, 128], 'bf16'), tensor(v, [8, n, 128], 'bf16'));
//   const step = await cache.decode(tensor(q, [32, 1, 128]), {key: k1, value: v1});
//   toFloat32Array(step.output); cache.length;           // n + 1
//   await client.decode({items: [cacheA.item(qa, ka, va), cacheB.item(qb)]});  // a batch
//   await client.tiled({query, cacheId: cache.id});      // naive / tiled / trace over a cache
//   await cache.delete();
//   client.close();
//
// Latent caches (attention.proto, CreateCacheRequest.valuesFromKeys; MLA, as DeepSeek-V3/R1 and
// Kimi K2 decode): createCache / openCache with valuesFromKeys: true make a cache that stores
// keys only, a token's value being the first valueDim columns of its key (valueDim ≤ headDim;
// 0 or absent: headDim), so it takes the memory of its keys alone. Appends and decode items then
// send the key alone; a value given for a latent Cache is a TypeError naming it ('value',
// 'items[i].value': append and decodeBatch reject with it, Cache.item throws it) before any
// call, and so is none given with a key to a Cache that stores values. The server answers a
// value sent anyway (client.appendCache, client.decode) with INVALID_ARGUMENT naming the field,
// and valueDim > headDim with INVALID_ARGUMENT naming value_dim. cache.valuesFromKeys (and
// CacheInfo.valuesFromKeys) says which kind a cache is; its replay tail and exports hold keys only.
//   const mla = await client.openCache({kvHeads: 1, headDim: 576, valueDim: 512, dtype: 'bf16',
//                                       valuesFromKeys: true});
//   await mla.append(tensor(cKv, [1, n, 576], 'bf16'));          // the key alone
//   const step = await mla.decode(tensor(q, [128, 1, 576]), {key: cKv1});   // output [128, 1, 512]
//
// fp8 caches (attention.proto, DTYPE_FLOAT8_E4M3): createCache / openCache with dtype 'fp8'
// ('fp8_e4m3', 'float8_e4m3', 'DTYPE_FLOAT8_E4M3' or 4 too; cacheDtypeName) store keys and
// values as fp8 E4M3 (OCP e4m3fn: bias 7, largest ±448, no infinities), each row (one token of
// one kv head, a key or a value) with its own float32 scale, max |x| / 448, the codes x / scale
// rounded to nearest even: about half a bf16 cache's bytes. attnd quantizes the tokens it is
// sent, in any tensor dtype: build them as float32 (cache.tokenDtype says which dtype to use for
// any cache). fp8 is never a tensor's dtype: tensor(..., 'fp8') throws a TypeError saying so, and
// attnd answers a Tensor or an outputDtype in it with INVALID_ARGUMENT naming the field. Export
// chunks carry the stored rows, [kvHeads, n, width] of DTYPE_FLOAT8_E4M3: per row the width
// codes, zero bytes up to a multiple of 4, then the row's little-endian float32 scale;
// toFloat32Array() reads them as code · scale.
//   const fp8 = await client.openCache({kvHeads: 8, headDim: 128, dtype: 'fp8'});
//   const dtype = fp8.tokenDtype;                       // 'DTYPE_FLOAT32'
//   await fp8.append(tensor(k, [8, n, 128], dtype), tensor(v, [8, n, 128], dtype));
//   const step = await fp8.decode(tensor(q, [32, 1, 128]), {key: k1, value: v1});  // fp32 out
//
// Persistent caches (attnd --cache-dir; attention.proto, CacheInfo.durableLength): a Cache keeps
// a replay tail, a copy of every token it sent (append, and decode / decodeBatch items with key
// and value) past the last durableLength an answer reported, and drops the entries that end at
// or before it (keeping none when answers have no durableLength: a server without
// --cache-dir). refresh() then catches up a server that holds fewer tokens than the Cache (a
// restart lost what was not yet durable): it re-sends [server length, length) from the tail,
// slicing the entry that straddles the server's length along the token axis, in as few appends
// as the server's max message allows, or rejects with an AttndError whose code is DATA_LOSS
// when the tail does not reach back that far (prefill the sequence again; the Cache is left as
// it was). new Cache(client, info, {tail}) points the state of one Cache (info, tail) at another
// client. A call on a Cache (append, decode, refresh) that fails NOT_FOUND with
// "moved_to=HOST:PORT" (a server drained with --drain-to) is retried once on a Client for
// HOST:PORT made with the same options (token, TLS, deadline; client.peer_), which the Cache
// keeps using; a second moved_to in a row is thrown.
//   const cache = await client.openCache({kvHeads: 8, headDim: 128, dtype: 'bf16'});
//   await cache.append(k, v);              // cache.info.durableLength: tokens on disk there
//   ... attnd restarts ...
//   await cache.refresh();                 // re-sends what it lost (or DATA_LOSS)
//   const there = new Cache(otherClient, cache.info, {tail: cache.tail});
//
// Speculative decoding (attention.proto, TruncateCache and DecodeItem.truncateTo): a cache cut
// to its first `length` tokens is exactly one that never had the rest (the next decode gives
// the same bits), and with attnd --cache-dir the cut is on disk before the answer.
// client.truncateCache({cacheId, length, expectedLength}) → CacheInfo (expectedLength, the
// length before the cut, checked when given); cache.truncate(length, {expectedLength}) sends
// the Cache's length unless told otherwise. A stale expectedLength is FAILED_PRECONDITION naming
// the actual length, a length past the cache's OUT_OF_RANGE; the cache is then unchanged. In
// Decode an item's truncateTo (Cache.item's, decodeBatch's and Cache.decode's truncateTo) cuts
// its cache before the item's key/value are appended, atomically with the batch (if any item
// fails every cache keeps the tokens it had); its expectedLength is still the length before the
// cut. length, truncateTo and expectedLength that are not integer Numbers are a TypeError, and
// negative ones a RangeError, naming the field (truncateCache and decodeBatch reject with them,
// Cache.item throws them). A Cache's cut cuts its replay tail too (entries past the cut
// dropped, the one straddling it sliced), so refresh() never re-sends a cut token. When a call
// carrying a cut fails without the server refusing it (UNAVAILABLE, DEADLINE_EXCEEDED,
// INTERNAL, ...: it may have been applied), the tail is cut all the same and the next refresh()
// re-sends tokens only up to the cut, taking the server's info when it holds at least that many;
// a refusal (INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE, NOT_FOUND, ...) leaves the
// Cache as it was. One step verifies k drafts (k + 1 new tokens: the last accepted one and the
// drafts; k + 1 query rows, causal), the next cuts the rejected ones and appends in one call:
//   const n = cache.length;
//   await cache.decode(tensor(q, [heads, k + 1, d]), {key, value, options: {causal: true}});
//   const kept = n + 1 + accepted;                      // accepted: the drafts the model kept
//   await cache.decode(q1, {key: k1, value: v1, truncateTo: kept, options: {causal: true}});
//   // or in two calls: await cache.truncate(kept); await cache.decode(q1, {key: k1, ...});
//
// Forks (attention.proto, ForkCache; parallel sampling, beam search, a shared system prompt): a
// new cache whose tokens are the first `length` tokens of another (absent: all of them), sharing
// its pages instead of copying them. Neither ever writes into a page the other holds (an append
// into a shared, partly filled page copies that page first), so the two change independently
// from then on, and a decode over the fork gives the bits one over a copy would. Shared pages
// count once against attnd --cache-bytes (CacheInfo.sharedBytes: of bytes, those in pages
// another cache holds too), and deleting the source keeps what its forks use.
// client.forkCache({cacheId, length, expectedLength}) → the fork's CacheInfo (expectedLength,
// the source's length, checked when given); cache.fork({length, expectedLength}) → a Cache for
// the fork on the same client, sending the Cache's length unless told otherwise. A stale
// expectedLength is FAILED_PRECONDITION naming the actual length, a length past the source's
// OUT_OF_RANGE, a fork at attnd --max-caches RESOURCE_EXHAUSTED; a refused fork creates nothing
// and leaves the source as it was. length and expectedLength are checked as truncate's are (a
// TypeError / RangeError naming the field, before any call). With attnd --cache-dir the fork's
// tokens are on disk before the answer (durableLength = length), so its Cache starts with an
// empty replay tail. A fork whose answer was lost (UNAVAILABLE, DEADLINE_EXCEEDED, ...) may exist
// all the same: listCaches() shows it. Sampling n continuations of one prompt:
//   const prompt = await client.openCache({kvHeads: 8, headDim: 128, dtype: 'bf16'});
//   await prompt.append(k, v);                             // the prompt, sent and stored once
//   const samples = [];
//   for (let i = 0; i < n; ++i) samples.push(await prompt.fork());   // no token copied
//   await client.decodeBatch(samples.map((cache, i) => ({cache, query: q[i], key: k1[i],
//                                                        value: v1[i]})));
//   const head = await prompt.fork({length: systemTokens});   // a prefix: the system prompt
//
// Token trees (attention.proto, DecodeItem.treeParents; EAGLE, Medusa, SpecInfer): a step can
// verify a tree of drafts instead of one chain. treeParents (Cache.decode's, Cache.item's and
// decodeBatch items') gives each new token the index of its parent among the item's new tokens
// (−1: a child of the cached prefix; otherwise an earlier token, 0 ≤ parent < i). The query then
// has one row per new token (nq = the new tokens), and row i attends over the cached prefix,
// token i's ancestors and itself, never the other branches: its output is what a plain causal
// decode over the prefix and that one branch gives. New token i sits at position n + i (its
// index, not its depth) for the causal mask, windows and ALiBi; rotate q and k by depth yourself
// (RoPE) before sending. Lay the tree out depth first, likeliest child first, so the path the
// model usually accepts is a prefix of the new tokens and truncateTo keeps it in place:
//   const n = cache.length;
//   // t0 (the last accepted token) → {a, b}; a → {c, d}; b → {e}; f, a second root.
//   const treeParents = [-1, 0, 0, 1, 1, 2, -1];        // t0 a b c d e f, depth first
//   await cache.decode(tensor(q, [heads, 7, d]), {key, value, treeParents,
//                                                 options: {causal: true}});
//   const path = [0, 1, 3];                              // t0 → a → c, accepted
//   if (path.every((node, i) => node === i)) {           // a prefix: cut the rest of the tree
//     await cache.decode(q1, {key: k1, value: v1, truncateTo: n + path.length, options});
//   } else {                                             // cut the tree, send the path again
//     await cache.decode(q1, {key: pathThenK1, value: pathThenV1, truncateTo: n, options});
//   }
// treeParents is checked before any call: an Array (or integer typed array) of integer Numbers
// (a TypeError naming treeParents[j] otherwise), each −1 or earlier than its index (a RangeError
// naming treeParents[j]); decodeBatch rejects and Cache.item throws with them (after the item's
// 'items[i].'). The server checks the counts: INVALID_ARGUMENT naming items[i].tree_parents (not
// one entry per new token, or more than 1024) or items[i].query (not one row per new token).
// Absent, null or empty: no tree.
//
// Export and import (ExportCache, ImportCache): client.exportCache(id) yields the CacheChunks
// (an async iterator: info, tokens bit-exact in the cache's dtype, the last chunk's crc32c,
// checked here: DATA_LOSS when they do not add up); client.importCache(chunks, {newIdIfTaken})
// streams chunks (an array or any (async) iterable) into a new cache → a Cache (the same id, or
// ALREADY_EXISTS unless newIdIfTaken; DATA_LOSS from the server for a damaged or cut export,
// nothing imported). The file of `attn cache export ID --to FILE` is "ATTNEXP1" then per chunk
// a u32 little-endian length and the serialized CacheChunk: client.exportCacheToFile(id, file)
// writes one (aside, renamed once checked), client.importCacheFromFile(file, {newIdIfTaken})
// imports one, readExportFile(file) / writeExportFile(file, chunks) read and write chunks.
// crc32c(bytes, crc = 0) is CRC32C (Castagnoli), chained as attn::Crc32c: crc32c(b, crc32c(a)).
//   for await (const chunk of client.exportCache(cache.id)) chunks.push(chunk);
//   const copy = await otherClient.importCache(chunks);       // copy.id === cache.id
//   await client.exportCacheToFile(cache.id, 'seq.attnexp');
//   const again = await otherClient.importCacheFromFile('seq.attnexp', {newIdIfTaken: true});
//
// Positions (attention.proto, AttentionOptions): options.keyPosition (key j is at
// keyPosition + j; default 0) and options.queryPosition (query row i at queryPosition + i;
// absent: bottom-right), which the causal mask compares. In Decode they are per item
// (DecodeItem.keyPosition, queryPosition: Cache.item's, decodeBatch's and Cache.decode's
// keyPosition / queryPosition), never in the options. With them one causal problem splits by
// keys over calls or servers, and mergeStates() joins the parts (with sinks, only the first
// slice, at the sequence's first key, is sent with them; see Sinks below):
//   const parts = await Promise.all([[0, 100], [100, keyLen]].map(([a, b]) => client.tiled({
//     query, key: keysFrom(a, b), value: valuesFrom(a, b),
//     options: {causal: true, keyPosition: a, queryPosition: keyLen - queryLen, returnLse: true,
//               outputDtype: 'DTYPE_FLOAT32'}})));
//   const {output, lse, shape} = mergeStates(parts);     // Float32Arrays, output's shape
//
// Sliding window (attention.proto, AttentionOptions; FlashAttention's window_size):
// options.windowLeft and options.windowRight, integers in [0, 2^62], absent (undefined or
// null) = unbounded on that side. A query at position p then sees only the keys at positions t
// with
//   p − windowLeft ≤ t ≤ p + windowRight        (and t ≤ p when causal)
// by the positions above (so a key slice of a windowed problem splits and merges as before).
// They go in the options of naive, tiled, trace and decode as they are; in Decode the window
// is the batch's and applies to every item against that item's own positions. The client sends
// them unchecked (pass integer Numbers: protobufjs truncates 1.5 to 1 and sends true as 0); the
// server answers a value outside [0, 2^62] with INVALID_ARGUMENT naming options.window_left /
// options.window_right. Trace's start repeats them (absent when unbounded):
//   await client.tiled({query, key, value, options: {causal: true, windowLeft: 4095}});
//   await cache.decode(q1, {key: k1, value: v1, options: {causal: true, windowLeft: 4095}});
//
// Softcap (attention.proto, AttentionOptions; Gemma 2, Grok): options.softcap, a Number, 0 or
// absent = off. Each scaled score s = scale · q·k then becomes
//   softcap · tanh(s / softcap)
// after the scale and before the mask (FlashAttention's order), so every score lies within
// ±softcap (fp32's tanh reaches ±1); the lse is of the capped scores. It goes in the options of
// naive, tiled, trace and decode as it is (in Decode it applies to every item); the client
// sends it unchecked (it travels as a proto float), and the server answers a negative or
// non-finite one with INVALID_ARGUMENT naming options.softcap. Trace's start repeats it
// (start.softcap, 0: none), and with one each TileStep has scaledScores, the tile's scores
// before the cap (masked keys included), next to scores, the capped and masked ones; without
// one scaledScores is [].
//   await client.tiled({query, key, value, options: {causal: true, softcap: 50}});
//
// ALiBi (attention.proto, AttentionOptions; BLOOM, MPT; FlashAttention's alibi_slopes):
// options.alibiSlopes, an Array of Numbers (a plain Array: protobufjs refuses a Float32Array;
// Array.from one), one per query head; empty or absent = no bias. Query head h adds
//   −alibiSlopes[h] · |p − t|
// to the score of the key at position t for the query at position p (the positions above), after
// the softcap and before the mask: score = softcap(scale · q·k) − slope · |p − t|; the lse is of
// the biased scores. standardAlibiSlopes(heads) gives the standard slopes (2^(−8(h+1)/H) for H a
// power of two). They go in the options of naive, tiled, trace and decode as they are (in Decode
// every item's query head count must match); the client sends them unchecked (each travels as a
// proto float, so is rounded to fp32), and the server answers a count other than the query's
// head count with INVALID_ARGUMENT naming options.alibi_slopes, and a slope that is not finite
// with one naming options.alibi_slopes[h]. Trace's start repeats them (start.alibiSlopes, []:
// none), and with them each TileStep has biases, each key's −slope · |p − t| (masked keys
// included), and scaledScores, the scores before the softcap and the bias; scores are then
// softcap(scaledScores) + biases where the mask shows the key. Without them biases is [].
//   const alibiSlopes = standardAlibiSlopes(32);
//   await client.tiled({query, key, value, options: {causal: true, alibiSlopes}});
//
// Sinks (attention.proto, AttentionOptions; gpt-oss, StreamingLLM's sink as a learned logit):
// options.sinks, an Array of Numbers (a plain Array, as alibiSlopes), one per query head; empty
// or absent = no sinks. sinks[h] joins every softmax row of query head h as one more logit that
// takes weight but contributes no value:
//   out = Σ_j e^(x_j − m) v_j / (Σ_j e^(x_j − m) + e^(sink − m)),  m = max(max_j x_j, sink)
//   lse = log(Σ_j e^(x_j) + e^(sink))
// where x_j are the row's scores after the scale, softcap, ALiBi bias and mask; the sink itself
// is not scaled, capped, biased or masked. The keys' weights then sum to 1 − e^(sink − lse), and
// a row that sees no key gives zeros and lse = sink. They go in the options of naive, tiled,
// trace and decode as they are (in Decode they are the batch's: every item's query head count
// must match, each item's rows taking them once); the client sends them unchecked (each travels
// as a proto float, so is rounded to fp32), and the server answers a count other than the
// query's head count with INVALID_ARGUMENT naming options.sinks, and a sink that is not finite
// (in fp32) with one naming options.sinks[h]. Trace's start repeats them (start.sinks, []:
// none); a step never includes the sink (its estimate is of the keys so far): it joins the row
// once, after the row's last tile, so rowDone's output, reference and lse include it, and
// rowDone.sinkShare is the weight the sink took, e^(sink − lse) (0 without sinks). A sink
// belongs to a row once, not to each key slice: a problem split by keys sends options.sinks only
// with the slice that starts the sequence (the first, at the whole problem's first keyPosition)
// and the other slices without; mergeStates() then gives exactly the unsplit answer.
//   await client.tiled({query, key, value, options: {causal: true, sinks: [0.5, -1, 2, 0]}});
//
// Ragged batches (attention.proto, AttentionRequest; FlashAttention's varlen cu_seqlens):
// request.cuSeqlensQ and request.cuSeqlensK, Arrays of integer Numbers at the request's top
// level (they are AttentionRequest fields, not options); absent (undefined or null) or empty =
// one sequence. For S sequences packed along the rows both hold S + 1 cumulative lengths:
// starting at 0, never decreasing, ending at the packed length (totalQ, totalK);
// cumulativeLengths([5, 1, 40]) gives [0, 5, 6, 46]. Query is then [heads, totalQ, headDim]
// (rank 2 or 3, or rank 4 with batch 1), key and value [kvHeads, totalK, ·], output
// [heads, totalQ, valueDim] and lse [heads, totalQ]. Sequence s is query rows
// [cuSeqlensQ[s], cuSeqlensQ[s+1]) over keys [cuSeqlensK[s], cuSeqlensK[s+1]): its rows see
// only its keys, with its own positions (its keys at 0 …, its queries bottom-right against
// them), so causal, a window, a softcap, ALiBi and sinks apply per sequence as if each were a
// request of its own; a row whose sequence has no key it sees gives zeros and lse −inf (with
// sinks: zeros and lse = its head's sink). A sequence may be empty. options.keyPosition and
// queryPosition must then be unset, and cacheId empty. They go in the requests of naive, tiled
// and trace (request.attention) as they are; the client checks only that each is an Array of
// integer Numbers (a plain Array: Array.from a typed array), else a TypeError (naive and tiled
// reject with it, trace throws it from the loop), and the server answers bad values with
// INVALID_ARGUMENT naming the field: cu_seqlens_q[i] / cu_seqlens_k[i] for a first entry other
// than 0, a decrease or a last entry other than the packed length (query.shape / key.shape's
// length dim), cu_seqlens_q / cu_seqlens_k for one given without the other, counts that differ
// or fewer than 2 entries, query.shape[0] for a batch other than 1, options.key_position /
// options.query_position when set. Trace's start repeats them (start.cuSeqlensQ, cuSeqlensK:
// Arrays of Numbers, [] for one sequence; its keyPosition and queryPosition are then 0, each
// sequence having its own), and where a mask applies a step's hidden is HIDDEN_SEQUENCE for a
// key of its tile in another sequence.
//   const [qLens, kLens] = [[5, 1, 40], [7, 1, 33]];      // 46 query rows, 41 keys
//   await client.tiled({query: tensor(q, [heads, 46, d]), key: tensor(k, [kvHeads, 41, d]),
//                       value: tensor(v, [kvHeads, 41, d]), cuSeqlensQ: cumulativeLengths(qLens),
//                       cuSeqlensK: cumulativeLengths(kLens), options: {causal: true}});

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.join(__dirname, '..', '..', 'proto');
const PROTO_FILE = 'attention/v1/attention.proto';
const MAX_MESSAGE_BYTES = 1024 * 1024 * 1024;  // 1 GiB, attnd's largest --max-message-bytes.

const packageDefinition = protoLoader.loadSync(PROTO_FILE, {
  includeDirs: [PROTO_ROOT],
  keepCase: false,
  longs: Number,
  enums: String,
  bytes: Buffer,
  defaults: true,
  oneofs: true,
});
const proto = grpc.loadPackageDefinition(packageDefinition).attention.v1;
// The service's methods: path and (de)serializers, for the export file's raw CacheChunk bytes.
const SERVICE = packageDefinition['attention.v1.AttentionService'];

const DTYPES = {
  float32: 'DTYPE_FLOAT32', f32: 'DTYPE_FLOAT32', fp32: 'DTYPE_FLOAT32',
  float16: 'DTYPE_FLOAT16', f16: 'DTYPE_FLOAT16', fp16: 'DTYPE_FLOAT16',
  bfloat16: 'DTYPE_BFLOAT16', bf16: 'DTYPE_BFLOAT16',
};
const DTYPE_NUMBERS = {1: 'DTYPE_FLOAT32', 2: 'DTYPE_FLOAT16', 3: 'DTYPE_BFLOAT16'};
// fp8 E4M3 (OCP e4m3fn, 4 on the wire): a KV cache's dtype only, never a tensor's or an output's.
const FP8 = 'DTYPE_FLOAT8_E4M3';
const FP8_NAMES = ['fp8', 'fp8_e4m3', 'float8_e4m3', 'float8_e4m3fn', 'dtype_float8_e4m3'];
const isFp8 = (dtype) => dtype === 4 ||
                         (typeof dtype === 'string' && FP8_NAMES.includes(dtype.toLowerCase()));

// Canonical enum name of a tensor's dtype for 'f32', 'float16', 'DTYPE_BFLOAT16', 2, ...;
// throws a TypeError on anything else (fp8 included: a cache's dtype only, cacheDtypeName).
function dtypeName(dtype) {
  if (typeof dtype === 'number' && DTYPE_NUMBERS[dtype]) return DTYPE_NUMBERS[dtype];
  if (typeof dtype === 'string') {
    if (Object.values(DTYPES).includes(dtype)) return dtype;
    if (DTYPES[dtype.toLowerCase()]) return DTYPES[dtype.toLowerCase()];
  }
  if (isFp8(dtype)) {
    throw new TypeError(`dtype ${String(dtype)}: fp8 (DTYPE_FLOAT8_E4M3) is a KV cache's dtype ` +
                        "only (createCache({dtype: 'fp8'})), never a tensor's or an output's; " +
                        'use float32, float16 or bfloat16 (an fp8 cache quantizes them)');
  }
  throw new TypeError(`unknown dtype ${String(dtype)}; expected float32, float16 or bfloat16`);
}

// Canonical enum name of a KV cache's dtype: a tensor's (dtypeName), or 'DTYPE_FLOAT8_E4M3' for
// 'fp8', 'fp8_e4m3', 'float8_e4m3', 'DTYPE_FLOAT8_E4M3' or 4; throws a TypeError on anything else.
function cacheDtypeName(dtype) {
  if (isFp8(dtype)) return FP8;
  try {
    return dtypeName(dtype);
  } catch {
    throw new TypeError(`unknown cache dtype ${String(dtype)}; expected float32, float16, ` +
                        'bfloat16 or fp8');
  }
}

// The dtype a cache's new tokens are sent in (tensor()'s), for the cache's dtype: its own, or
// float32 for an fp8 cache (attnd quantizes tokens of any tensor dtype).
function tokenDtypeName(cacheDtype) {
  const name = cacheDtypeName(cacheDtype);
  return name === FP8 ? 'DTYPE_FLOAT32' : name;
}

// --- fp16 / bf16 conversions (storage formats; arithmetic is fp32) ---------------------------
const scratchF32 = new Float32Array(1);
const scratchU32 = new Uint32Array(scratchF32.buffer);

// binary32 → binary16 bits, round to nearest even; overflow → ±inf, NaN stays NaN.
function float32ToFloat16Bits(x) {
  scratchF32[0] = x;
  const bits = scratchU32[0];
  const sign = (bits >>> 16) & 0x8000;
  const exponent = (bits >>> 23) & 0xff;
  let mantissa = bits & 0x7fffff;
  if (exponent === 0xff) return sign | 0x7c00 | (mantissa ? 0x200 : 0);
  const e = exponent - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {  // Subnormal half (or zero): value = half · 2^-24.
    if (e < -10) return sign;
    mantissa |= 0x800000;
    const shift = 14 - e;
    let half = mantissa >>> shift;
    const rest = mantissa & ((1 << shift) - 1);
    const halfway = 1 << (shift - 1);
    if (rest > halfway || (rest === halfway && (half & 1))) half += 1;
    return sign | half;
  }
  let half = (e << 10) | (mantissa >>> 13);
  const rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half += 1;  // May carry into inf: right.
  return sign | half;
}

function float16BitsToFloat32(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >>> 10) & 0x1f;
  const mantissa = h & 0x3ff;
  if (exponent === 0) return sign * mantissa * 2 ** -24;
  if (exponent === 0x1f) return mantissa ? NaN : sign * Infinity;
  return sign * (1 + mantissa / 1024) * 2 ** (exponent - 15);
}

// binary32 → bfloat16 bits (the upper half), round to nearest even; NaN stays NaN.
function float32ToBfloat16Bits(x) {
  scratchF32[0] = x;
  const bits = scratchU32[0];
  if (Number.isNaN(x)) return (bits >>> 16) | 0x40;
  return Math.floor((bits + 0x7fff + ((bits >>> 16) & 1)) / 65536) & 0xffff;
}

function bfloat16BitsToFloat32(h) {
  scratchU32[0] = (h & 0xffff) << 16;
  return scratchF32[0];
}

const LITTLE_ENDIAN = os.endianness() === 'LE';

// A Tensor message from values (Float32Array, or any array-like of numbers) and a shape.
// dtype: 'float32' (default), 'float16' or 'bfloat16' (or the DTYPE_* names; fp8 is a cache's
// dtype only, a TypeError); values are rounded to it. Throws a TypeError when the shape's
// product is not the number of values.
function tensor(values, shape, dtype = 'float32') {
  const dims = Array.from(shape, Number);
  const count = dims.reduce((a, b) => a * b, 1);
  if (values.length !== count) {
    throw new TypeError(`tensor: ${values.length} values for shape [${dims.join(', ')}] ` +
                        `(${count} elements)`);
  }
  const name = dtypeName(dtype);
  let data;
  if (name === 'DTYPE_FLOAT32') {
    const f32 = values instanceof Float32Array ? values : Float32Array.from(values);
    if (LITTLE_ENDIAN) {
      data = Buffer.from(f32.buffer, f32.byteOffset, f32.byteLength);
    } else {
      data = Buffer.alloc(count * 4);
      for (let i = 0; i < count; ++i) data.writeFloatLE(f32[i], i * 4);
    }
  } else {
    const toBits = name === 'DTYPE_FLOAT16' ? float32ToFloat16Bits : float32ToBfloat16Bits;
    data = Buffer.alloc(count * 2);
    for (let i = 0; i < count; ++i) data.writeUInt16LE(toBits(values[i]), i * 2);
  }
  return {shape: dims, dtype: name, data};
}

// A Tensor message's elements as a Float32Array (row-major), whatever its dtype: an fp8 cache's
// stored rows (an export chunk's key or value) as code · scale (fp8RowsToFloat32).
// Throws a TypeError on an unknown dtype or data whose length does not match the shape.
function toFloat32Array(message) {
  const name = cacheDtypeName(message.dtype);
  if (name === FP8) return fp8RowsToFloat32(message);
  const count = message.shape.reduce((a, b) => a * Number(b), 1);
  const data = message.data;
  const size = name === 'DTYPE_FLOAT32' ? 4 : 2;
  if (data.length !== count * size) {
    throw new TypeError(`tensor: ${data.length} bytes for shape [${message.shape.join(', ')}] ` +
                        `of ${name}; expected ${count * size}`);
  }
  const out = new Float32Array(count);
  if (name === 'DTYPE_FLOAT32') {
    if (LITTLE_ENDIAN) {
      new Uint8Array(out.buffer).set(data);  // Copy: data's offset may not be 4-aligned.
    } else {
      for (let i = 0; i < count; ++i) out[i] = data.readFloatLE(i * 4);
    }
  } else {
    const fromBits = name === 'DTYPE_FLOAT16' ? float16BitsToFloat32 : bfloat16BitsToFloat32;
    for (let i = 0; i < count; ++i) out[i] = fromBits(data.readUInt16LE(i * 2));
  }
  return out;
}

// The 256 E4M3 codes' values (bias 7, 3 mantissa bits, subnormals at exponent 0, S.1111.111 NaN).
const FP8_VALUES = Float32Array.from({length: 256}, (_, code) => {
  const exponent = (code >> 3) & 0xf, mantissa = code & 7;
  let value = exponent === 0 ? mantissa * 2 ** -9 : (1 + mantissa / 8) * 2 ** (exponent - 7);
  if (exponent === 15 && mantissa === 7) value = NaN;
  return code & 0x80 ? -value : value;
});

// An fp8 cache's stored rows ([..., width] of DTYPE_FLOAT8_E4M3: per row the codes, zero bytes up
// to a multiple of 4, a little-endian float32 scale) as a Float32Array of code · scale.
function fp8RowsToFloat32(message) {
  const shape = Array.from(message.shape, Number);
  const width = shape.at(-1) ?? 1;
  const rows = width === 0 ? 0 : shape.reduce((a, b) => a * b, 1) / width;
  const rowBytes = rowBytesOf(FP8, width);
  const data = message.data;
  if (data.length !== rows * rowBytes) {
    throw new TypeError(`tensor: ${data.length} bytes for shape [${shape.join(', ')}] of ${FP8}; ` +
                        `expected ${rows * rowBytes} (rows of ${rowBytes} bytes)`);
  }
  const out = new Float32Array(rows * width);
  for (let r = 0; r < rows; ++r) {
    const scale = data.readFloatLE(r * rowBytes + rowBytes - 4);
    for (let i = 0; i < width; ++i) {
      out[r * width + i] = Math.fround(FP8_VALUES[data[r * rowBytes + i]] * scale);
    }
  }
  return out;
}

// --- CRC32C (Castagnoli) -----------------------------------------------------------------------
// Reflected polynomial 0x82F63B78, initial and final XOR 0xFFFFFFFF (iSCSI, ext4, attnd's
// common/crc32c.h): crc32c('123456789') is 0xE3069283. Slicing by four bytes.
const CRC32C_TABLES = (() => {
  const tables = [0, 1, 2, 3].map(() => new Uint32Array(256));
  for (let i = 0; i < 256; ++i) {
    let c = i;
    for (let k = 0; k < 8; ++k) c = c & 1 ? (c >>> 1) ^ 0x82f63b78 : c >>> 1;
    tables[0][i] = c >>> 0;
  }
  for (let t = 1; t < 4; ++t) {
    for (let i = 0; i < 256; ++i) {
      const previous = tables[t - 1][i];
      tables[t][i] = (previous >>> 8) ^ tables[0][previous & 0xff];
    }
  }
  return tables;
})();

// Bytes of a Buffer, any ArrayBufferView (its bytes, not its elements), an ArrayBuffer or a
// string (UTF-8), as a Uint8Array view (no copy). Throws a TypeError for anything else.
function bytesOf(data, what = 'data') {
  if (data instanceof Uint8Array) return data;
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (typeof data === 'string') return Buffer.from(data, 'utf8');
  throw new TypeError(`${what} must be bytes (a Buffer, a typed array, an ArrayBuffer or a ` +
                      `string), not ${Object.prototype.toString.call(data)}`);
}

// CRC32C of data (see bytesOf) continuing from crc (the CRC of the bytes before, 0 to start):
// crc32c(b, crc32c(a)) is crc32c of a then b, as attn::Crc32c(data, n, crc). → an unsigned
// 32-bit Number.
function crc32c(data, crc = 0) {
  const bytes = bytesOf(data);
  const [t0, t1, t2, t3] = CRC32C_TABLES;
  let c = ~crc;
  let i = 0;
  const end4 = bytes.length - (bytes.length % 4);
  for (; i < end4; i += 4) {
    c ^= bytes[i] | (bytes[i + 1] << 8) | (bytes[i + 2] << 16) | (bytes[i + 3] << 24);
    c = t3[c & 0xff] ^ t2[(c >>> 8) & 0xff] ^ t1[(c >>> 16) & 0xff] ^ t0[c >>> 24];
  }
  for (; i < bytes.length; ++i) c = t0[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return ~c >>> 0;
}

// --- tokens of a cache's key / value Tensors ------------------------------------------------------
const ELEMENT_BYTES = {DTYPE_FLOAT32: 4, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2};

// Bytes of one row of `dim` elements (one token of one kv head) in dtype (a canonical name):
// dim × the element's size, or for an fp8 cache's stored row (export chunks) its codes, zero
// bytes up to a multiple of 4, then its little-endian float32 scale.
function rowBytesOf(dtype, dim) {
  return dtype === FP8 ? Math.ceil(dim / 4) * 4 + 4 : dim * ELEMENT_BYTES[dtype];
}

// A key or value Tensor of an append or an export chunk, [kvHeads, n, dim] or [n, dim] (one
// head), along its token axis (axis 1, or 0 for rank 2): {heads, n, dim, rank, rowBytes (one
// token of one head), bytes}. Throws a TypeError for another rank or data that does not match
// the shape.
function tokenLayout(t, what) {
  const shape = Array.from(t?.shape ?? [], Number);
  if (shape.length !== 2 && shape.length !== 3) {
    throw new TypeError(`${what}: shape [${shape}] is not [kvHeads, n, dim] or [n, dim]`);
  }
  const dtype = cacheDtypeName(t.dtype);
  const heads = shape.length === 3 ? shape[0] : 1;
  const [n, dim] = shape.slice(-2);
  const rowBytes = rowBytesOf(dtype, dim);
  const bytes = bytesOf(t.data, `${what}.data`);
  if (bytes.length !== heads * n * rowBytes) {
    throw new TypeError(`${what}: ${bytes.length} bytes for shape [${shape}] of ${dtype}; ` +
                        `expected ${heads * n * rowBytes}`);
  }
  return {heads, n, dim, dtype, rank: shape.length, rowBytes, bytes};
}

// The tokens [from, to) of each piece {tensor, from, to} (token offsets within its tensor),
// joined in order along the token axis into one Tensor of the pieces' dtype: rank 2 when every
// piece is, else [kvHeads, n, dim]. A piece that is one whole tensor alone is returned as it is.
function joinTokens(pieces, what) {
  const layouts = pieces.map((p) => tokenLayout(p.tensor, what));
  if (pieces.length === 1 && pieces[0].from === 0 && pieces[0].to === layouts[0].n) {
    return pieces[0].tensor;
  }
  const {heads, dim, dtype, rowBytes} = layouts[0];
  for (const l of layouts) {
    if (l.heads !== heads || l.dim !== dim || l.dtype !== dtype) {
      throw new TypeError(`${what}: the tokens to join differ in layout ([${l.heads}, n, ` +
                          `${l.dim}] ${l.dtype} against [${heads}, n, ${dim}] ${dtype})`);
    }
  }
  const total = pieces.reduce((sum, p) => sum + (p.to - p.from), 0);
  const data = Buffer.alloc(heads * total * rowBytes);
  let at = 0;
  pieces.forEach((p, i) => {
    const {n, bytes} = layouts[i];
    for (let h = 0; h < heads; ++h) {
      data.set(bytes.subarray((h * n + p.from) * rowBytes, (h * n + p.to) * rowBytes),
               (h * total + at) * rowBytes);
    }
    at += p.to - p.from;
  });
  const rank2 = layouts.every((l) => l.rank === 2);
  return {shape: rank2 ? [total, dim] : [heads, total, dim], dtype, data};
}

// A copy of a Tensor message (shape, dtype, data): what a replay tail keeps (null stays null: a
// latent cache's value).
function copyTensor(t) {
  if (t === undefined || t === null) return null;
  return {shape: Array.from(t.shape, Number), dtype: cacheDtypeName(t.dtype),
          data: Buffer.from(bytesOf(t.data))};
}

const given = (x) => x !== undefined && x !== null;

// New tokens' key and value for `cache`: throws a TypeError naming `${what}value` for a value
// given to a latent cache (valuesFromKeys: its values are its keys' first valueDim columns), for
// none given with a key to a cache that stores values, and for a value without a key.
function checkValue(cache, key, value, what) {
  if (!given(key)) {
    if (given(value)) throw new TypeError(`${what}value is given without a key`);
    return;
  }
  if (cache.valuesFromKeys && given(value)) {
    throw new TypeError(`${what}value: cache ${cache.id} is latent (valuesFromKeys): each ` +
                        "token's value is the first valueDim columns of its key; send the key " +
                        'alone');
  }
  if (!cache.valuesFromKeys && !given(value)) {
    throw new TypeError(`${what}value is missing: cache ${cache.id} stores values (it is not ` +
                        'latent, valuesFromKeys); give key and value together');
  }
}

// --- export streams and files ---------------------------------------------------------------------
// The file `attn cache export ID --to FILE` writes: these 8 bytes, then per CacheChunk a u32
// little-endian length and the serialized chunk.
const EXPORT_MAGIC = Buffer.from('ATTNEXP1', 'latin1');
const encodeChunk = (chunk) => SERVICE.ImportCache.requestSerialize(chunk);
const decodeChunk = (bytes) => SERVICE.ExportCache.responseDeserialize(bytes);

// Follows an export's chunks (ExportCache's stream, a file): the first carries info, starts are
// consecutive, the tokens add up to info.length and the last chunk's crc32c is that of every
// key.data then value.data. add() and finish() throw an AttndError with code DATA_LOSS.
class ExportCheck {
  constructor(what) {
    Object.assign(this, {what, info: null, chunks: 0, tokens: 0, crc: 0, sentCrc: undefined});
  }

  add(chunk) {
    const at = `${this.what}: chunk ${this.chunks}`;
    if (this.chunks === 0) {
      if (!chunk.info) throw dataLoss(`${at} has no info (the first chunk carries it)`);
      this.info = chunk.info;
    }
    if (this.sentCrc !== undefined) throw dataLoss(`${at} follows the last chunk (crc32c)`);
    if (chunk.key || chunk.value) {
      if (Number(chunk.start) !== this.tokens) {
        throw dataLoss(`${at} starts at token ${chunk.start}; the chunks before it brought ` +
                       `${this.tokens}`);
      }
      // A latent cache's chunks carry keys alone (its values are within them).
      const keysOnly = !!this.info.valuesFromKeys;
      let n;
      try {
        n = tokenLayout(chunk.key, `${at} key`).n;
        if (keysOnly ? !!chunk.value : tokenLayout(chunk.value, `${at} value`).n !== n) {
          throw new TypeError(keysOnly ? `${at} carries a value, but the cache is latent ` +
                                         '(valuesFromKeys): its chunks carry keys alone'
                                       : `${at}: key and value hold different token counts`);
        }
      } catch (err) {
        throw dataLoss(err.message);
      }
      this.tokens += n;
      this.crc = crc32c(keysOnly ? Buffer.alloc(0) : chunk.value.data,
                        crc32c(chunk.key.data, this.crc));
    }
    if (chunk.crc32c !== undefined && chunk.crc32c !== null) this.sentCrc = chunk.crc32c >>> 0;
    ++this.chunks;
  }

  finish() {
    if (this.chunks === 0) throw dataLoss(`${this.what}: no chunk`);
    const length = Number(this.info.length);
    if (this.tokens !== length || this.sentCrc === undefined) {
      throw dataLoss(`${this.what}: ${this.tokens} of the export's ${length} tokens` +
                     `${this.sentCrc === undefined ? ' and no last chunk (crc32c)' : ''}; ` +
                     'the export was cut short');
    }
    if (this.sentCrc !== this.crc) {
      throw dataLoss(`${this.what}: the tokens' CRC32C is ${this.crc}, the export's ` +
                     `${this.sentCrc}: the data was damaged`);
    }
    return {info: this.info, chunks: this.chunks, tokens: this.tokens, crc32c: this.crc};
  }
}

// The raw serialized CacheChunks of an export file, in order (Buffers). Throws an AttndError
// with code DATA_LOSS for a file that is not one (no ATTNEXP1) or ends inside a chunk.
async function* readExportFrames(file) {
  const handle = await fs.promises.open(file, 'r');
  try {
    const readExactly = async (n, what) => {
      const buffer = Buffer.alloc(n);
      let got = 0;
      while (got < n) {
        const {bytesRead} = await handle.read(buffer, got, n - got, null);
        if (bytesRead === 0) break;
        got += bytesRead;
      }
      if (got !== 0 && got !== n) throw dataLoss(`${file}: ends inside ${what}`);
      return got === 0 ? null : buffer;
    };
    const magic = await readExactly(EXPORT_MAGIC.length, 'its first 8 bytes');
    if (magic === null || !magic.equals(EXPORT_MAGIC)) {
      throw dataLoss(`${file}: not a cache export (it does not start with ATTNEXP1)`);
    }
    for (let i = 0; ; ++i) {
      const header = await readExactly(4, `chunk ${i}'s length`);
      if (header === null) return;
      const length = header.readUInt32LE(0);
      if (length > MAX_MESSAGE_BYTES) {
        throw dataLoss(`${file}: chunk ${i} claims ${length} bytes, more than any message`);
      }
      yield length === 0 ? Buffer.alloc(0) : await readExactly(length, `chunk ${i}`);
    }
  } finally {
    await handle.close();
  }
}

// The CacheChunks of an export file (the format above), decoded, as an async iterator; their
// consistency is not checked (importCache's server checks it; ExportCheck does client-side).
async function* readExportFile(file) {
  for await (const frame of readExportFrames(file)) yield decodeChunk(frame);
}

// Writes CacheChunks (an array or any (async) iterable; messages as exportCache yields them) to
// file in the export format, replacing it (written aside and renamed once complete).
// → {chunks, bytes}.
async function writeExportFile(file, chunks) {
  return writeFrames(file, (async function* () {
    for await (const chunk of chunks) yield encodeChunk(chunk);
  })());
}

// Writes serialized chunks (an async iterable of Buffers) to file in the export format, aside
// then renamed; onFrame(frame) sees each first and complete() runs before the rename (either
// throwing leaves no file) → {chunks, bytes, ...complete()'s answer}.
async function writeFrames(file, frames, onFrame = () => {}, complete = () => ({})) {
  const aside = `${file}.partial-${process.pid}`;
  const handle = await fs.promises.open(aside, 'w');
  let count = 0, bytes = EXPORT_MAGIC.length;
  try {
    await handle.write(EXPORT_MAGIC);
    for await (const frame of frames) {
      onFrame(frame);
      const header = Buffer.alloc(4);
      header.writeUInt32LE(frame.length, 0);
      await handle.write(header);
      await handle.write(frame);
      ++count;
      bytes += 4 + frame.length;
    }
    const summary = complete();
    await handle.sync();
    await handle.close();
    await fs.promises.rename(aside, file);
    return {chunks: count, ...summary, bytes};
  } catch (err) {
    await handle.close().catch(() => {});
    await fs.promises.rm(aside, {force: true});
    throw err;
  }
}

// --- errors ----------------------------------------------------------------------------------
const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([k, v]) => [v, k]));

class AttndError extends Error {
  constructor(err) {
    const codeName = CODE_NAMES[err.code] ?? 'UNKNOWN';
    const details = err.details ?? err.message;
    super(`${codeName}: ${details}`);
    this.name = 'AttndError';
    this.code = err.code;
    this.codeName = codeName;
    this.details = details;
    this.metadata = err.metadata;
    this.cause = err;
  }
}

function wrapError(err) {
  return err instanceof AttndError || err.code === undefined ? err : new AttndError(err);
}

// An AttndError with code DATA_LOSS raised here (a damaged export, a tail that cannot replay).
function dataLoss(details) { return new AttndError({code: grpc.status.DATA_LOSS, details}); }

// The codes of a call the server refused, nothing of it applied (a cut included); any other
// failure of a call carrying a cut (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...) may have been
// applied (Cache.cutFailed_).
const REFUSED_CODES = new Set([
  grpc.status.INVALID_ARGUMENT, grpc.status.FAILED_PRECONDITION, grpc.status.OUT_OF_RANGE,
  grpc.status.NOT_FOUND, grpc.status.ALREADY_EXISTS, grpc.status.PERMISSION_DENIED,
  grpc.status.UNAUTHENTICATED, grpc.status.UNIMPLEMENTED]);

// A DecodeItem's treeParents → the Array to send: an Array or integer typed array whose entry j
// is an integer Number, −1 (a child of the cached prefix) or an earlier index (0 ≤ parent < j).
// A TypeError naming `what` or `what[j]` for a wrong type, a RangeError for a parent out of
// range. The count (one per new token, at most 1024) is the server's check.
function treeParentsOf(parents, what) {
  const typed = ArrayBuffer.isView(parents) && !(parents instanceof DataView) &&
                !(parents instanceof Float32Array) && !(parents instanceof Float64Array);
  if (!Array.isArray(parents) && !typed) {
    const kind = Object.prototype.toString.call(parents);
    throw new TypeError(`${what} must be an Array of integers (one parent per new token), ` +
                        `not ${kind}`);
  }
  return Array.from(parents, (parent, j) => {
    if (typeof parent === 'bigint') parent = Number(parent);
    if (typeof parent !== 'number' || !Number.isInteger(parent)) {
      const shown = typeof parent === 'string' ? `'${parent}'` : String(parent);
      throw new TypeError(`${what}[${j}] is ${shown} (${typeof parent}); expected an integer ` +
                          'Number');
    }
    if (parent < -1 || parent >= j) {
      const earlier = j > 0 ? `or an earlier new token's index, 0 … ${j - 1}`
                            : '(no new token comes before the first)';
      throw new RangeError(`${what}[${j}] is ${parent}; expected −1 (a child of the cached ` +
                           `prefix) ${earlier}`);
    }
    return parent;
  });
}

// A token count to send (TruncateCache's length and expectedLength, a DecodeItem's truncateTo)
// → the Number: a TypeError naming it (`what`) when it is not an integer Number, a RangeError
// when it is negative or past 2^53.
function tokenCount(value, what) {
  if (typeof value !== 'number' || !Number.isInteger(value)) {
    const shown = typeof value === 'string' ? `'${value}'` : String(value);
    throw new TypeError(`${what} is ${shown} (${typeof value}); expected an integer Number`);
  }
  if (value < 0) throw new RangeError(`${what} is ${value}; expected ≥ 0 (a token count)`);
  if (!Number.isSafeInteger(value)) throw new RangeError(`${what} is ${value}; expected < 2^53`);
  return value;
}

// 'HOST:PORT' when err is the NOT_FOUND of a cache a draining server handed over (its message
// ends "moved_to=HOST:PORT"), else null.
function movedTo(err) {
  if (err?.code !== grpc.status.NOT_FOUND) return null;
  const match = /moved_to=([^\s;,]+)/.exec(err.details ?? err.message ?? '');
  return match ? match[1].replace(/\.$/, '') : null;
}

// A server-streaming call's messages as an async iterator that ends only once the call's
// status is known: it throws the call's error (an AttndError) when it failed, even when the
// stream ended first (a plain `for await` over the call can finish before grpc-js emits the
// error). Buffers at most a few messages (the call is paused meanwhile). It listens from the
// start, so the iterator may be consumed later (no event is missed, no error goes unhandled).
function callMessages(call) {
  const queue = [];
  let error = null, ended = false, statusSeen = false, wake = null;
  const notify = () => {
    if (wake) wake();
    wake = null;
  };
  call.on('data', (message) => {
    queue.push(message);
    if (queue.length >= 4) call.pause();
    notify();
  });
  call.on('error', (err) => { error = err; notify(); });
  call.on('status', () => { statusSeen = true; notify(); });
  call.on('end', () => { ended = true; notify(); });
  return (async function* () {
    while (true) {
      if (error) throw wrapError(error);
      if (queue.length > 0) {
        const message = queue.shift();
        if (queue.length === 0) call.resume();
        yield message;
      } else if (ended && statusSeen) {
        return;
      } else {
        await new Promise((resolve) => { wake = resolve; });
      }
    }
  })();
}

// --- the client ------------------------------------------------------------------------------
class Client {
  // target: 'host:port'. Options:
  //   token:       sent as 'authorization: Bearer <token>' on every call (attnd --auth-token).
  //   tlsCa:       path of a PEM CA bundle; when given the channel uses TLS.
  //   tlsCert, tlsKey: PEM paths of a client certificate and key for mutual TLS.
  //   serverName:  the name to verify the server's certificate against, when not the target's.
  //   deadlineMs:  default per-call deadline (none when absent).
  //   channelOptions: extra grpc-js channel options.
  constructor(target, options = {}) {
    const {token, tlsCa, tlsCert, tlsKey, serverName, deadlineMs, channelOptions} = options;
    let credentials;
    if (tlsCa || tlsCert) {
      credentials = grpc.credentials.createSsl(
          tlsCa ? fs.readFileSync(tlsCa) : null, tlsKey ? fs.readFileSync(tlsKey) : null,
          tlsCert ? fs.readFileSync(tlsCert) : null);
    } else {
      credentials = grpc.credentials.createInsecure();
    }
    const channel = {
      'grpc.max_send_message_length': MAX_MESSAGE_BYTES,
      'grpc.max_receive_message_length': MAX_MESSAGE_BYTES,
      ...(serverName ? {'grpc.ssl_target_name_override': serverName,
                        'grpc.default_authority': serverName} : {}),
      ...channelOptions,
    };
    this.stub = new proto.AttentionService(target, credentials, channel);
    this.target = target;
    this.token = token;
    this.deadlineMs = deadlineMs;
    this.options_ = {...options};
    this.peers_ = new Map();  // 'HOST:PORT' → the Client a Cache moved there uses (peer_).
  }

  metadata_() {
    const metadata = new grpc.Metadata();
    if (this.token) metadata.set('authorization', `Bearer ${this.token}`);
    return metadata;
  }

  callOptions_(options = {}) {
    const deadlineMs = options.deadlineMs ?? this.deadlineMs;
    return deadlineMs === undefined ? {} : {deadline: Date.now() + deadlineMs};
  }

  unary_(method, request, options) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata_(), this.callOptions_(options),
                        (err, response) => (err ? reject(wrapError(err)) : resolve(response)));
    });
  }

  // naive / tiled: a TypeError for ragged-batch fields that are not Arrays of integers, as a
  // rejection (like the call's own errors), else the call.
  attention_(method, request, options) {
    try {
      checkSequences(request, method.toLowerCase());
    } catch (err) {
      return Promise.reject(err);
    }
    return this.unary_(method, request, options);
  }

  // Full-matrix attention. request: an AttentionRequest ({query, key, value, options}, and for a
  // ragged batch cuSeqlensQ, cuSeqlensK). Resolves to the AttentionResponse ({output, lse,
  // stats}); rejects with an AttndError (a TypeError for cuSeqlensQ / cuSeqlensK that are not
  // Arrays of integers).
  naive(request, options) { return this.attention_('Naive', request, options); }

  // Online-softmax attention over key tiles; same request and answer as naive().
  tiled(request, options) { return this.attention_('Tiled', request, options); }

  // The server's ServerInfo: version, backend, device and limits.
  info(options) { return this.unary_('GetServerInfo', {}, options); }

  // Streams a TraceRequest's events ({attention, rows}) as an async iterator of TraceEvents,
  // each with `event` naming its member: 'start', then per row one 'step' per key tile and a
  // 'rowDone', then 'end'. Throws an AttndError from the loop when the call fails; leaving the
  // loop early (break, return, throw) cancels the call. request.attention's cuSeqlensQ and
  // cuSeqlensK are checked as naive()'s (a TypeError from the loop, before any call).
  async* trace(request, options) {
    checkSequences(request?.attention, 'trace: attention');
    const call = this.stub.Trace(request, this.metadata_(), this.callOptions_(options));
    let finished = false;
    try {
      for await (const event of call) yield event;
      finished = true;
    } catch (err) {
      finished = true;
      throw wrapError(err);
    } finally {
      if (!finished) call.cancel();
    }
  }

  // --- KV caches (attention.proto documents each RPC's errors) ---
  // CreateCacheRequest ({kvHeads, headDim, valueDim, dtype, valuesFromKeys}) → CacheInfo.
  // dtype: float32 (default), float16, bfloat16 or fp8 (cacheDtypeName; see the header).
  // valuesFromKeys: true makes a latent cache (keys only; see the header). Rejects with a
  // TypeError naming valuesFromKeys when it is given and not a boolean, before any call.
  createCache(request, options) {
    if (given(request.valuesFromKeys) && typeof request.valuesFromKeys !== 'boolean') {
      return Promise.reject(new TypeError(
          `createCache: valuesFromKeys must be a boolean, not ${typeof request.valuesFromKeys}`));
    }
    return this.unary_('CreateCache',
                       {...request, dtype: cacheDtypeName(request.dtype ?? 'float32')}, options);
  }

  // AppendCacheRequest ({cacheId, key, value, expectedLength}) → CacheInfo; a latent cache's
  // append has no value.
  appendCache(request, options) { return this.unary_('AppendCache', request, options); }

  // TruncateCacheRequest ({cacheId, length, expectedLength}) → CacheInfo: the cache cut to its
  // first length tokens. expectedLength (the length before the cut) is checked when given
  // (absent, undefined or null: not sent). Rejects with a TypeError / RangeError naming length
  // or expectedLength when one is not a non-negative integer Number, before any call; the
  // server's FAILED_PRECONDITION (stale expectedLength) and OUT_OF_RANGE (a length past the
  // cache's) leave the cache unchanged.
  truncateCache({cacheId, length, expectedLength} = {}, options) {
    const request = {cacheId};
    try {
      request.length = tokenCount(length, 'truncateCache: length');
      if (expectedLength !== undefined && expectedLength !== null) {
        request.expectedLength = tokenCount(expectedLength, 'truncateCache: expectedLength');
      }
    } catch (err) {
      return Promise.reject(err);
    }
    return this.unary_('TruncateCache', request, options);
  }

  // ForkCacheRequest ({cacheId, length, expectedLength}) → the fork's CacheInfo: a new cache
  // whose tokens are the first length of cacheId's (absent, undefined or null: all of them),
  // sharing its pages (see the header); its sharedBytes says how many of its bytes it shares,
  // and with attnd --cache-dir its durableLength is its length. expectedLength (the source's
  // length) is checked when given (absent, undefined or null: not sent). Rejects with a
  // TypeError / RangeError naming length or expectedLength when one is not a non-negative
  // integer Number, before any call; the server's FAILED_PRECONDITION (stale expectedLength),
  // OUT_OF_RANGE (a length past the source's) and RESOURCE_EXHAUSTED (--max-caches) create
  // nothing.
  forkCache({cacheId, length, expectedLength} = {}, options) {
    const request = {cacheId};
    try {
      if (given(length)) request.length = tokenCount(length, 'forkCache: length');
      if (given(expectedLength)) {
        request.expectedLength = tokenCount(expectedLength, 'forkCache: expectedLength');
      }
    } catch (err) {
      return Promise.reject(err);
    }
    return this.unary_('ForkCache', request, options);
  }

  // cacheId → CacheInfo ({cacheId, kvHeads, headDim, valueDim, dtype, length, bytes, pageTokens,
  // sharedBytes, ...}).
  getCacheInfo(cacheId, options) { return this.unary_('GetCacheInfo', {cacheId}, options); }

  // cacheId → {} (later calls naming it reject with NOT_FOUND).
  deleteCache(cacheId, options) { return this.unary_('DeleteCache', {cacheId}, options); }

  // → ListCachesResponse ({caches: [CacheInfo, ...]}), the caller's, oldest first.
  listCaches(options) { return this.unary_('ListCaches', {}, options); }

  // DecodeRequest ({items: [{cacheId, query, key?, value?, expectedLength, truncateTo?,
  // treeParents?}], options}) → DecodeResponse ({outputs, lse, stats, caches}), outputs[i] item
  // i's [heads, nq, valueDim]; an item of a latent cache sends its key without a value. An
  // item's truncateTo cuts its cache to that length before its key/value are appended
  // (expectedLength is the length before the cut); its treeParents make its new tokens a token
  // tree (see the header; sent unchecked here, Cache.item checks).
  // Atomic: if any item fails, every cache keeps the tokens it had. Cache.item() builds an item;
  // after the call resolves, Cache.update(response.caches[i]) takes its new length (decodeBatch
  // does both, and keeps the replay tail).
  decode(request, options) { return this.unary_('Decode', request, options); }

  // decode() over Cache objects: items [{cache, query, key?, value?, keyPosition?,
  // queryPosition?, truncateTo?, treeParents?}] → DecodeResponse, each Cache's length updated
  // from the answer (and its replay tail cut at truncateTo). Positions are per item (see
  // Cache.item); attentionOptions.keyPosition / queryPosition are refused here with a TypeError
  // (the server would refuse them too: INVALID_ARGUMENT). A window (attentionOptions.windowLeft,
  // windowRight) is the batch's, against each item's positions; a softcap
  // (attentionOptions.softcap) and ALiBi slopes (attentionOptions.alibiSlopes) the batch's too,
  // applied to every item (each item's query head count must be the slopes').
  // Sinks (attentionOptions.sinks) are the batch's as well: one per query head of every item
  // (each item's query must have that many heads; the server checks, INVALID_ARGUMENT naming
  // options.sinks), each item's rows taking its sink once. A sequence whose keys are split over
  // several caches sends the sinks only with the part holding its first key, so its parts
  // cannot share one batch with sinks: decode the first part with them and the others in a call
  // without, then mergeStates().
  async decodeBatch(items, attentionOptions = {}, options) {
    for (const field of ['keyPosition', 'queryPosition']) {
      if (attentionOptions[field] !== undefined && attentionOptions[field] !== null) {
        throw new TypeError(`decode: options.${field} is set; Decode takes positions per item ` +
                            `({cache, query, keyPosition, queryPosition})`);
      }
    }
    const messages = items.map(({cache, query, key, value, keyPosition, queryPosition,
                                 truncateTo, treeParents}, i) =>
      cache.item(query, key, value, {keyPosition, queryPosition, truncateTo, treeParents},
                 `items[${i}].`));
    const sent = items.map(({cache, key, value}, i) =>
      cache.sending_(key, value, messages[i].truncateTo));
    let response;
    try {
      response = await this.decode({items: messages, options: attentionOptions}, options);
    } catch (err) {
      items.forEach(({cache}, i) => {
        if (messages[i].truncateTo !== undefined) cache.cutFailed_(messages[i].truncateTo, err);
      });
      throw err;
    }
    if (response.caches.length !== items.length) {
      throw new Error(`Decode answered ${response.caches.length} caches for ${items.length} items`);
    }
    items.forEach(({cache}, i) => cache.sent_(sent[i], response.caches[i], messages[i].truncateTo));
    return response;
  }

  // A new cache (CreateCacheRequest) as a Cache; or, given a cache id string, the existing
  // cache with its length read now (GetCacheInfo).
  async openCache(requestOrId, options) {
    const info = typeof requestOrId === 'string' ? await this.getCacheInfo(requestOrId, options)
                                                 : await this.createCache(requestOrId, options);
    return new Cache(this, info);
  }

  // --- export and import (attention.proto: ExportCache, ImportCache) ---
  // A cache's tokens as its CacheChunks, an async iterator: the first with info (id, layout and
  // length, the tokens the stream carries), then consecutive tokens [start, start + n) as key
  // [kvHeads, n, headDim] and value [kvHeads, n, valueDim] Tensors in the cache's dtype
  // (bit-exact, at most 4 MiB a chunk), the last with crc32c. The chunks are checked as they
  // come: the loop throws an AttndError with code DATA_LOSS when their tokens or CRC32C do not
  // add up (after yielding the chunks; the server's errors as AttndErrors, as trace's).
  //   const chunks = [];
  //   for await (const chunk of client.exportCache(cache.id)) chunks.push(chunk);
  async* exportCache(cacheId, options) {
    const call = this.stub.ExportCache({cacheId}, this.metadata_(), this.callOptions_(options));
    const check = new ExportCheck(`export of cache ${cacheId}`);
    let finished = false;
    try {
      for await (const chunk of callMessages(call)) {
        check.add(chunk);
        yield chunk;
      }
      finished = true;
    } finally {
      if (!finished) call.cancel();
    }
    check.finish();
  }

  // Exports a cache to file in the format of `attn cache export ID --to FILE`: "ATTNEXP1", then
  // per CacheChunk its u32 little-endian length and its bytes as the server sent them. Written
  // aside and renamed when complete and checked (DATA_LOSS as exportCache; no file then).
  // → {info, chunks, tokens, crc32c, bytes}.
  async exportCacheToFile(cacheId, file, options) {
    const method = SERVICE.ExportCache;
    const call = this.stub.makeServerStreamRequest(
        method.path, method.requestSerialize, (bytes) => bytes, {cacheId}, this.metadata_(),
        this.callOptions_(options));
    const check = new ExportCheck(`export of cache ${cacheId}`);
    try {
      return await writeFrames(file, callMessages(call), (frame) => check.add(decodeChunk(frame)),
                               () => check.finish());
    } catch (err) {
      call.cancel();
      throw err;
    }
  }

  // A new cache on this server from an export's CacheChunks (an array, or any iterable or async
  // iterable, e.g. another client's exportCache(id) or readExportFile(file)), streamed in order
  // → a Cache. It keeps info.cacheId when free here; otherwise the call rejects with
  // ALREADY_EXISTS, unless newIdIfTaken (true: the server picks a new id; the Cache's id is the
  // one taken). DATA_LOSS when tokens are missing or their CRC32C does not match (nothing is
  // imported). The Cache's info carries crc32c, that of the tokens stored.
  async importCache(chunks, {newIdIfTaken} = {}, options) {
    const first = (chunk) => (newIdIfTaken === undefined ? chunk
                                                         : {...chunk, newIdIfTaken: !!newIdIfTaken});
    const info = await this.streamIn_(
        (done) => this.stub.ImportCache(this.metadata_(), this.callOptions_(options), done),
        (async function* () {
          let i = 0;
          for await (const chunk of chunks) yield i++ === 0 ? first(chunk) : chunk;
        })());
    return new Cache(this, info);
  }

  // importCache from a file exportCacheToFile (or `attn cache export`) wrote; its chunks go as
  // they are in the file (the first re-encoded only to set newIdIfTaken). A file that is not an
  // export or ends inside a chunk rejects with DATA_LOSS (before the server commits anything).
  async importCacheFromFile(file, {newIdIfTaken} = {}, options) {
    const method = SERVICE.ImportCache;
    const frames = (async function* () {
      let i = 0;
      for await (const frame of readExportFrames(file)) {
        yield i++ === 0 && newIdIfTaken !== undefined
            ? encodeChunk({...decodeChunk(frame), newIdIfTaken: !!newIdIfTaken}) : frame;
      }
    })();
    const info = await this.streamIn_(
        (done) => this.stub.makeClientStreamRequest(
            method.path, (bytes) => bytes, method.responseDeserialize, this.metadata_(),
            this.callOptions_(options), done),
        frames);
    return new Cache(this, info);
  }

  // A client-streaming call: makeCall(done) starts it; source's messages are written with
  // backpressure, then the call ends → its answer. When the server answers early (an error)
  // writing stops; when the source throws the call is cancelled and that error rethrown.
  async streamIn_(makeCall, source) {
    let settled = false;
    let call;
    const answer = new Promise((resolve, reject) => {
      call = makeCall((err, response) => {
        settled = true;
        if (err) reject(wrapError(err)); else resolve(response);
      });
    });
    const answered = answer.then(() => {}, () => {});
    try {
      for await (const message of source) {
        if (settled) break;
        if (!call.write(message)) {
          await Promise.race([new Promise((resolve) => call.once('drain', resolve)), answered]);
        }
      }
    } catch (err) {
      call.cancel();
      await answered;
      throw err;
    }
    if (!settled) call.end();
    return answer;
  }

  // The Client for another server with this one's options (token, TLS, deadline, channel
  // options), made once per target and closed with this one: where a moved cache went.
  peer_(target) {
    if (!this.peers_.has(target)) this.peers_.set(target, new Client(target, this.options_));
    return this.peers_.get(target);
  }

  // The most key + value bytes one AppendCache of a replayed tail carries: the server's
  // max_message_bytes less 64 KiB for the rest of the message (asked once; 4 MiB if it fails).
  appendBytesLimit_() {
    this.appendLimit_ ??= this.info().then(
        (info) => Math.max(64 * 1024, Number(info.maxMessageBytes) - 64 * 1024),
        () => 4 * 1024 * 1024);
    return this.appendLimit_;
  }

  close() {
    this.stub.close();
    for (const peer of this.peers_.values()) peer.close();
    this.peers_.clear();
  }
}

// Whether a CacheInfo says the server persists the cache (durableLength is set).
const hasDurable = (info) => info?.durableLength !== undefined && info?.durableLength !== null;

// One server-resident cache as the client believes it: id, length (sent as expectedLength) and
// info, the last CacheInfo the server sent. One sequence, one writer: do not share a Cache
// between concurrent calls.
//
// Replay tail (attnd --cache-dir): the tokens this Cache sent (append, and decode or
// decodeBatch items with key and value) that the server has not yet reported durable, each
// entry {start, key, value} a copy of the Tensors as sent. Every answer for the cache prunes
// it: whole entries ending at or before its durableLength go; an answer without durableLength
// (a server that does not persist) empties it. refresh() re-sends from it what a restarted
// server lost; a cut (truncate(), a decode item's truncateTo) cuts the tail too, so refresh()
// never re-sends a cut token. A call that fails NOT_FOUND with "moved_to=HOST:PORT" (the server
// drained) is retried once on a Client for HOST:PORT with the same options (client.peer_), which
// the Cache then keeps as its client.
//   new Cache(client, info, {tail})  the cache `info` describes (its id and the length the caller
//                                    believes) on client, e.g. another server holding a copy,
//                                    with a tail to replay (another Cache's .tail).
class Cache {
  constructor(client, info, {tail = []} = {}) {
    this.client = client;
    this.info = info;
    this.tail_ = tail.map(({start, key, value}) => ({
      start: Number(start), end: Number(start) + tokenLayout(key, 'tail key').n,
      key: copyTensor(key), value: copyTensor(value)}));  // value null: a latent cache's.
    this.unsureCut_ = null;  // The lowest cut a failed call may have applied (cutFailed_).
    if (hasDurable(info)) this.prune_(Number(info.durableLength));
  }

  get id() { return this.info.cacheId; }
  get length() { return Number(this.info.length); }
  // A latent cache (CacheInfo.valuesFromKeys): keys only, each value the first valueDim columns
  // of its key.
  get valuesFromKeys() { return !!this.info.valuesFromKeys; }
  // The dtype to build its new tokens in (tensor(values, shape, cache.tokenDtype)): the cache's,
  // or DTYPE_FLOAT32 for an fp8 cache.
  get tokenDtype() { return tokenDtypeName(this.info.dtype); }

  // The replay tail, oldest first: [{start, key, value}] (its Tensors, value null for a latent
  // cache; do not modify them).
  get tail() { return this.tail_.map(({start, key, value}) => ({start, key, value})); }

  // Takes a CacheInfo the server sent for this cache (and prunes the tail by it). After a raw
  // client.decode() of item()s, pass it the item's answer; tokens sent that way are not in the
  // tail (decodeBatch records them).
  update(info) {
    this.info = info;
    this.unsureCut_ = null;  // The server said its length.
    if (hasDurable(info)) this.prune_(Number(info.durableLength)); else this.tail_ = [];
  }

  prune_(durable) { this.tail_ = this.tail_.filter((entry) => entry.end > durable); }

  // The tail after the cache was cut to `length` tokens: entries at or past it dropped, the one
  // straddling it sliced (so refresh() never re-sends a cut token).
  cut_(length) {
    this.tail_ = this.tail_.filter((e) => e.start < length).map((e) => {
      if (e.end <= length) return e;
      const to = length - e.start;
      return {start: e.start, end: length,
              key: joinTokens([{tensor: e.key, from: 0, to}], 'tail key'),
              value: e.value && joinTokens([{tensor: e.value, from: 0, to}], 'tail value')};
    });
  }

  // A call that cut the cache to `length` failed with err. A refusal (REFUSED_CODES: nothing
  // applied) leaves the Cache as it was; otherwise the cut may have been applied: the tail is
  // cut all the same, and refresh() re-sends tokens only up to `length`.
  cutFailed_(length, err) {
    if (REFUSED_CODES.has(err?.code)) return;
    this.cut_(length);
    if (this.unsureCut_ === null || length < this.unsureCut_) this.unsureCut_ = length;
  }

  // Before a call that appends key/value at `start` (length, or the item's truncateTo; value
  // null for a latent cache): the entry the tail will keep, copied now when the server is known
  // to persist (null: no tokens, or tensors this client cannot read, which the server judges; a
  // tail missing them restarts at the next entry). For decodeBatch.
  sending_(key, value, start = this.length) {
    const keysOnly = this.valuesFromKeys;
    if (!given(key) || (!keysOnly && !given(value))) return null;
    let n;
    try {
      n = tokenLayout(key, 'key').n;
      if (!keysOnly && tokenLayout(value, 'value').n !== n) return null;
    } catch {
      return null;
    }
    if (n === 0) return null;
    const persistent = hasDurable(this.info);
    const kept = keysOnly ? null : value;
    return {start, end: start + n, key: persistent ? copyTensor(key) : key,
            value: persistent ? copyTensor(kept) : kept, copied: persistent};
  }

  // After that call succeeded with info: cuts the tail at `cut` (the item's truncateTo, when
  // set), keeps the entry when the answer says the server persists (a tail that would not be
  // contiguous starts again), then update(info).
  sent_(entry, info, cut) {
    if (cut !== undefined && cut !== null) this.cut_(cut);
    if (entry !== null && hasDurable(info)) {
      const {start, end, copied} = entry;
      const key = copied ? entry.key : copyTensor(entry.key);
      const value = copied ? entry.value : copyTensor(entry.value);
      if (this.tail_.length > 0 && this.tail_.at(-1).end !== start) this.tail_ = [];
      this.tail_.push({start, end, key, value});
    }
    this.update(info);
  }

  // call() once; when it fails NOT_FOUND with moved_to=HOST:PORT, switch to that server's Client
  // (same options) and call() again, once: a second moved_to in a row is thrown.
  async followMove_(call) {
    try {
      return await call();
    } catch (err) {
      const target = movedTo(err);
      if (target === null) throw err;
      this.client = this.client.peer_(target);
      return call();
    }
  }

  // Appends key [kvHeads, n, headDim] and value [kvHeads, n, valueDim] (Tensors) at length; a
  // latent cache takes the key alone (cache.append(key), or value null). Rejects with a
  // TypeError naming value, before any call, for a value given to a latent cache or none to one
  // that stores values.
  append(key, value, options) {
    return this.followMove_(async () => {
      checkValue(this, key, value, '');
      const entry = this.sending_(key, value);
      const request = {cacheId: this.id, key, expectedLength: this.length};
      if (given(value)) request.value = value;
      const info = await this.client.appendCache(request, options);
      this.sent_(entry, info);
      return this.info;
    });
  }

  // Cuts the cache to its first `length` tokens (TruncateCache) → the CacheInfo now held; the
  // length follows the answer and the replay tail is cut too. expectedLength: the length before
  // the cut (default: this Cache's length). Rejects with a TypeError / RangeError naming length
  // or expectedLength for one that is not a non-negative integer Number; FAILED_PRECONDITION
  // (stale) and OUT_OF_RANGE (past the cache's length) from the server leave everything as it
  // was. Follows a moved_to once.
  truncate(length, {expectedLength} = {}, options) {
    return this.followMove_(async () => {
      let info;
      try {
        info = await this.client.truncateCache(
            {cacheId: this.id, length, expectedLength: expectedLength ?? this.length}, options);
      } catch (err) {
        if (typeof length === 'number' && Number.isSafeInteger(length) && length >= 0) {
          this.cutFailed_(length, err);
        }
        throw err;
      }
      this.sent_(null, info, length);
      return this.info;
    });
  }

  // A new cache whose tokens are this one's first `length` (absent: all of them), sharing its
  // pages (ForkCache) → a Cache for it on the same client, its length the fork's and its replay
  // tail empty (with attnd --cache-dir the fork's tokens are durable at once). This Cache is
  // unchanged (its info.sharedBytes as of its last answer: getCacheInfo reads it anew).
  // expectedLength: this cache's length (default: this Cache's length). Rejects with a
  // TypeError / RangeError naming length or expectedLength for one that is not a non-negative
  // integer Number; FAILED_PRECONDITION (stale) and OUT_OF_RANGE (past the length) from the
  // server create nothing. Follows a moved_to once (the fork is then made there).
  fork({length, expectedLength} = {}, options) {
    return this.followMove_(async () => {
      const info = await this.client.forkCache(
          {cacheId: this.id, length, expectedLength: expectedLength ?? this.length}, options);
      return new Cache(this.client, info);
    });
  }

  // The DecodeItem for this cache with expectedLength = length; key/value optional new tokens.
  // keyPosition: the position of the cache's first token (default 0); queryPosition: that of
  // the item's first query row (absent: keyPosition + the length after the append − nq).
  // truncateTo: the cache is first cut to that many tokens (absent: no cut); expectedLength
  // stays the length before the cut. Throws a TypeError / RangeError naming truncateTo (after
  // `what`, e.g. 'items[1].') when it is not a non-negative integer Number. treeParents: the new
  // tokens as a token tree (see the header: one parent index per new token, −1 for a child of
  // the cached prefix; the query then has one row per new token); absent, null or empty: none.
  // Throws a TypeError / RangeError naming treeParents[j] (after `what`) for an entry that is not
  // an integer, or not −1 or an earlier index. key, value: new tokens (both or neither; a latent
  // cache's key alone): throws a TypeError naming value (after `what`) for a value given to a
  // latent cache or none given with a key to a cache that stores values.
  item(query, key, value, {keyPosition, queryPosition, truncateTo, treeParents} = {}, what = '') {
    checkValue(this, key, value, what);
    const item = {cacheId: this.id, query, expectedLength: this.length};
    if (key !== undefined && key !== null) item.key = key;
    if (value !== undefined && value !== null) item.value = value;
    if (keyPosition !== undefined && keyPosition !== null) item.keyPosition = keyPosition;
    if (queryPosition !== undefined && queryPosition !== null) item.queryPosition = queryPosition;
    if (truncateTo !== undefined && truncateTo !== null) {
      item.truncateTo = tokenCount(truncateTo, `${what}truncateTo`);
    }
    if (treeParents !== undefined && treeParents !== null) {
      const parents = treeParentsOf(treeParents, `${what}treeParents`);
      if (parents.length > 0) item.treeParents = parents;
    }
    return item;
  }

  // One Decode of this cache alone → {output, lse, stats, cache}. key, value: new tokens (a
  // latent cache's key alone; item()). keyPosition, queryPosition:
  // this item's positions (item()); truncateTo: cut the cache to that many tokens first (the
  // drafts the last step rejected), atomically with the append and the attention; treeParents:
  // the new tokens as a token tree, one query row each (item(); e.g. [-1, 0, 0, 1]: t0 → {t1,
  // t2}, t1 → {t3}); options: the AttentionOptions (a window, a softcap, ALiBi slopes and sinks
  // included), without positions.
  decode(query, {key, value, keyPosition, queryPosition, truncateTo, treeParents,
                 options: attentionOptions = {}} = {},
         options) {
    return this.followMove_(async () => {
      const response = await this.client.decodeBatch(
          [{cache: this, query, key, value, keyPosition, queryPosition, truncateTo, treeParents}],
          attentionOptions, options);
      return {output: response.outputs[0], lse: response.lse[0] ?? null, stats: response.stats,
              cache: response.caches[0]};
    });
  }

  // Re-reads the info from the server (GetCacheInfo, length L) → the CacheInfo now held.
  //  - L ≥ length: takes the server's info.
  //  - L < length (a restarted server lost the tokens it had not made durable): when the tail
  //    holds every token in [L, length), re-sends them (AppendCache with expectedLength L, the
  //    entry straddling L sliced along the token axis, entries joined into as few appends as the
  //    server's max_message_bytes allows) and takes the last answer; otherwise rejects with an
  //    AttndError, code DATA_LOSS, saying what the server holds and the tail, and keeps its
  //    state: the sequence must be prefilled again (a new cache).
  // After a call carrying a cut to C failed without a refusal (it may have been applied; see
  // cutFailed_), `length` above reads min(length, C): nothing past the cut is re-sent.
  refresh(options) {
    return this.followMove_(async () => {
      const server = await this.client.getCacheInfo(this.id, options);
      const held = Number(server.length);
      const length = this.unsureCut_ === null ? this.length
                                              : Math.min(this.length, this.unsureCut_);
      if (held >= length) {
        this.update(server);
        return this.info;
      }
      this.update(await this.replay_(held, length, options));
      return this.info;
    });
  }

  // Re-sends the tail's tokens [from, length) → the last append's CacheInfo.
  async replay_(from, length, options) {
    const first = this.tail_.findIndex((entry) => entry.end > from);
    const entries = first < 0 ? [] : this.tail_.slice(first);
    const contiguous = entries.every((e, i) => i === 0 || e.start === entries[i - 1].end);
    if (entries.length === 0 || entries[0].start > from || !contiguous ||
        entries.at(-1).end !== length) {
      const kept = this.tail_.length > 0 ? this.tail_[0].start : length;
      throw dataLoss(`cache ${this.id}: the server holds ${from} tokens and this client ` +
                     `${length}, but it kept the tokens it sent only from ${kept} on` +
                     `${contiguous ? '' : ' (with gaps)'}: they cannot be sent again; the ` +
                     'sequence must be prefilled again (in a new cache)');
    }
    const limit = await this.client.appendBytesLimit_();
    const tokenBytes = (e) => {
      const key = tokenLayout(e.key, 'tail key');
      const value = e.value ? tokenLayout(e.value, 'tail value') : {heads: 0, rowBytes: 0};
      return key.heads * key.rowBytes + value.heads * value.rowBytes;
    };
    let at = from, info = null;
    let index = 0;
    while (at < length) {
      // One append: tokens from `at`, whole or sliced entries, within the byte limit (at least
      // one token).
      const pieces = [];
      let bytes = 0, end = at;
      while (index < entries.length) {
        const e = entries[index];
        const perToken = tokenBytes(e);
        const room = Math.max(pieces.length ? 0 : 1, Math.floor((limit - bytes) / perToken));
        const to = Math.min(e.end, end + room);
        if (to <= end) break;
        pieces.push({e, from: end - e.start, to: to - e.start});
        bytes += (to - end) * perToken;
        end = to;
        if (to < e.end) break;  // The rest of this entry goes in the next append.
        ++index;
      }
      const key = joinTokens(pieces.map((p) => ({tensor: p.e.key, from: p.from, to: p.to})),
                             'tail key');
      const request = {cacheId: this.id, key, expectedLength: at};
      if (entries[0].value) {  // A latent cache's tail holds keys alone.
        request.value = joinTokens(
            pieces.map((p) => ({tensor: p.e.value, from: p.from, to: p.to})), 'tail value');
      }
      info = await this.client.appendCache(request, options);
      at = end;
    }
    return info;
  }

  delete(options) { return this.client.deleteCache(this.id, options); }
}

// The explainer's 8×4 example (n × d in general): q[i][j] = (i + j) % 5 − 2,
// k[i][j] = ((2i + j) % 7 − 3) / 2, v[i][j] = (i + j) % 9 − 4, as Float32Arrays (row-major n × d);
// its scale is 1/2 = 1/√4.
function seedExample(n = 8, d = 4) {
  const q = new Float32Array(n * d), k = new Float32Array(n * d), v = new Float32Array(n * d);
  for (let i = 0; i < n; ++i) {
    for (let j = 0; j < d; ++j) {
      q[i * d + j] = ((i + j) % 5) - 2;
      k[i * d + j] = (((2 * i + j) % 7) - 3) / 2;
      v[i * d + j] = ((i + j) % 9) - 4;
    }
  }
  return {q, k, v};
}

// The standard ALiBi slopes (Press et al.; BLOOM's) for `heads` query heads, as
// attn::client::StandardAlibiSlopes computes them → an Array of Numbers (float32 values, as they
// are sent). For a power of two n, head h's slope is 2^(−8(h+1)/n); otherwise the
// n = 2^⌊log₂ heads⌋ slopes, then every other one of the 2n slopes, 2^(−8(2i+1)/(2n)) for
// i = 0, 1, …, for the heads past n. 0 heads: []. Throws a TypeError unless heads is an integer
// Number, a RangeError when it is negative.
function standardAlibiSlopes(heads) {
  if (typeof heads !== 'number' || !Number.isInteger(heads)) {
    throw new TypeError(`standardAlibiSlopes: heads must be an integer, not ${String(heads)}`);
  }
  if (heads < 0) throw new RangeError(`standardAlibiSlopes: heads must be ≥ 0, got ${heads}`);
  const slopes = [];
  if (heads === 0) return slopes;
  let n = 1;
  while (n * 2 <= heads) n *= 2;
  for (let h = 0; h < n; ++h) slopes.push(Math.fround(2 ** (-8 * (h + 1) / n)));
  for (let i = 0; n + i < heads; ++i) {  // The odd-numbered slopes of 2n heads.
    slopes.push(Math.fround(2 ** (-8 * (2 * i + 1) / (2 * n))));
  }
  return slopes;
}

// --- ragged batches ------------------------------------------------------------------------------
// Sequence lengths → the cumulative lengths AttentionRequest.cuSeqlensQ / cuSeqlensK take, an
// Array of Numbers one longer: cumulativeLengths([5, 1, 40]) is [0, 5, 6, 46], and
// cumulativeLengths([]) is [0] (no sequence; the server wants at least one). lengths: any
// iterable of integer Numbers (an Array, an Int32Array, ...). Throws a TypeError for a length
// that is not an integer Number (or lengths that are not iterable), a RangeError for a negative
// one.
function cumulativeLengths(lengths) {
  if (lengths === null || lengths === undefined || typeof lengths === 'string' ||
      typeof lengths[Symbol.iterator] !== 'function') {
    throw new TypeError(`cumulativeLengths: lengths must be an array of integers, not ` +
                        `${String(lengths)}`);
  }
  const out = [0];
  let i = 0;
  for (const n of lengths) {
    if (typeof n !== 'number' || !Number.isInteger(n)) {
      throw new TypeError(`cumulativeLengths: lengths[${i}] is ${String(n)}; expected an integer`);
    }
    if (n < 0) throw new RangeError(`cumulativeLengths: lengths[${i}] is ${n}; expected ≥ 0`);
    out.push(out[out.length - 1] + n);
    ++i;
  }
  return out;
}

// An AttentionRequest's cuSeqlensQ / cuSeqlensK, checked for type only (the server checks the
// values): each absent (undefined, null) or an Array of integer Numbers. Throws a TypeError
// naming the field (`what`: the call, for the message).
function checkSequences(request, what) {
  if (request === null || request === undefined || typeof request !== 'object') return;
  for (const field of ['cuSeqlensQ', 'cuSeqlensK']) {
    const values = request[field];
    if (values === undefined || values === null) continue;
    if (!Array.isArray(values)) {
      const kind = Object.prototype.toString.call(values);
      throw new TypeError(`${what}: ${field} must be an Array of integers (cumulative lengths; ` +
                          `Array.from a typed array), not ${kind}`);
    }
    values.forEach((x, i) => {
      if (typeof x !== 'number' || !Number.isInteger(x)) {
        const shown = typeof x === 'string' ? `'${x}'` : String(x);
        throw new TypeError(`${what}: ${field}[${i}] is ${shown}; expected an integer Number`);
      }
    });
  }
}

// --- merging the parts of a split problem ---------------------------------------------------
// One part's output or lse as {values, shape}: a Tensor message (shape known) or an array-like
// of numbers (Float32Array, Float64Array, Array; shape unknown, null).
function stateValues(value, what) {
  if (value === undefined || value === null) {
    throw new TypeError(`mergeStates: ${what} is missing` +
                        (what.endsWith('lse') ? ' (ask for options.returnLse)' : ''));
  }
  if (value.data !== undefined && value.shape !== undefined) {
    return {values: toFloat32Array(value), shape: Array.from(value.shape, Number)};
  }
  if (typeof value.length !== 'number' || typeof value === 'string') {
    throw new TypeError(`mergeStates: ${what} must be a Tensor or an array of numbers`);
  }
  return {values: value, shape: null};
}

// Merges attention over disjoint key ranges of the same queries → {output, lse, shape}.
// parts: an array, each {output, lse} (an AttentionResponse from a call with returnLse and
// outputDtype DTYPE_FLOAT32, or Float32Arrays) or an [output, lse] pair, every part over the
// same query rows: output [..., heads, nq, valueDim] and lse [..., heads, nq], row-major. For a
// causal problem, send each key slice [a, b) with options.keyPosition = a and the whole
// problem's queryPosition. Returns output and lse as Float32Arrays (what one call over all the
// keys would give, up to fp32 rounding) and shape, the output's (the parts' Tensor shape, or
// [rows, valueDim] for arrays), by DESIGN.md's merge of finished rows (natural log):
//   lse    = log Σᵢ exp(lseᵢ)
//   output = Σᵢ exp(lseᵢ − lse) · outputᵢ
// computed stably in float64: m = maxᵢ lseᵢ, wᵢ = exp(lseᵢ − m), lse = m + log Σᵢ wᵢ,
// output = Σᵢ wᵢ · outputᵢ / Σᵢ wᵢ. A part whose row saw no key (lse −inf) contributes nothing
// to it, whatever its output row holds; a row no part saw gives zeros and lse −inf, never NaN.
// Sinks (options.sinks) need nothing here, provided the sink is counted once: send the sinks
// only with the part whose slice starts the sequence (at the whole problem's first keyPosition)
// and the other parts without. That part's lse already includes e^sink, and its output the
// sink's share of the denominator, so the parts merge exactly to the unsplit answer with sinks
// (a row that saw none of that slice's keys has lse = sink and output 0 there, and still gives
// the sink its weight in the merge); parts that each carried the sinks would count the sink
// once per part.
// Throws a TypeError for no parts or parts whose shapes differ, a RangeError for an lse that
// is NaN or +inf.
function mergeStates(parts) {
  if (parts === null || parts === undefined || typeof parts[Symbol.iterator] !== 'function') {
    throw new TypeError('mergeStates: parts must be an array of {output, lse} parts');
  }
  const states = Array.from(parts, (part, i) => {
    const pair = Array.isArray(part) ? {output: part[0], lse: part[1]} : (part ?? {});
    if (Array.isArray(part) && part.length !== 2) {
      throw new TypeError(`mergeStates: parts[${i}] must be {output, lse} or [output, lse]`);
    }
    const output = stateValues(pair.output, `parts[${i}].output`);
    const lse = stateValues(pair.lse, `parts[${i}].lse`);
    const rows = lse.values.length;
    const valueDim = rows > 0 ? output.values.length / rows : 0;
    if (!Number.isInteger(valueDim) || valueDim < 1) {
      throw new TypeError(`mergeStates: parts[${i}] has ${output.values.length} output values ` +
                          `for ${rows} lse rows; expected rows × valueDim (valueDim ≥ 1)`);
    }
    if (output.shape && lse.shape &&
        output.shape.slice(0, -1).join(',') !== lse.shape.join(',')) {
      throw new TypeError(`mergeStates: parts[${i}] output shape [${output.shape}] and lse ` +
                          `shape [${lse.shape}] do not match; expected [..., heads, nq, ` +
                          `valueDim] and [..., heads, nq]`);
    }
    for (let r = 0; r < rows; ++r) {
      if (Number.isNaN(lse.values[r]) || lse.values[r] === Infinity) {
        throw new RangeError(`mergeStates: parts[${i}].lse[${r}] is ${lse.values[r]}`);
      }
    }
    return {output, lse, rows, valueDim};
  });
  if (states.length === 0) {
    throw new TypeError('mergeStates: needs at least one {output, lse} part, got none');
  }
  const {rows, valueDim} = states[0];
  const shape = states.find((s) => s.output.shape)?.output.shape ?? [rows, valueDim];
  for (const [i, s] of states.entries()) {
    if (s.rows !== rows || s.valueDim !== valueDim ||
        (s.output.shape && s.output.shape.join(',') !== shape.join(','))) {
      throw new TypeError(`mergeStates: parts[${i}] (${s.rows} rows × ${s.valueDim}` +
                          `${s.output.shape ? `, shape [${s.output.shape}]` : ''}) differs from ` +
                          `parts[0] (${rows} rows × ${valueDim}, shape [${shape}]): every ` +
                          `part must hold the same queries`);
    }
  }
  const output = new Float32Array(rows * valueDim);
  const lse = new Float32Array(rows).fill(-Infinity);
  const sum = new Float64Array(valueDim);
  for (let r = 0; r < rows; ++r) {
    let max = -Infinity;
    for (const s of states) max = Math.max(max, s.lse.values[r]);
    if (max === -Infinity) continue;  // No part saw this row: zeros and −inf.
    sum.fill(0);
    let total = 0;
    for (const s of states) {
      const weight = Math.exp(s.lse.values[r] - max);  // 0 for a part that saw no key.
      if (weight === 0) continue;
      total += weight;
      for (let c = 0; c < valueDim; ++c) sum[c] += weight * s.output.values[r * valueDim + c];
    }
    for (let c = 0; c < valueDim; ++c) output[r * valueDim + c] = sum[c] / total;
    lse[r] = max + Math.log(total);
  }
  return {output, lse, shape};
}

module.exports = {
  Client,
  Cache,
  crc32c,
  readExportFile,
  writeExportFile,
  mergeStates,
  seedExample,
  standardAlibiSlopes,
  cumulativeLengths,
  AttndError,
  tensor,
  toFloat32Array,
  dtypeName,
  cacheDtypeName,
  float32ToFloat16Bits,
  float16BitsToFloat32,
  float32ToBfloat16Bits,
  bfloat16BitsToFloat32,
  status: grpc.status,
  proto,
};
