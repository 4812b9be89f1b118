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
// (createCache, appendCache, getCacheInfo, deleteCache, listCaches, decode), and a Cache that
// tracks the length it believes the cache has and sends it as expectedLength on every append
// and decode (a retried call is then refused with FAILED_PRECONDITION, never stored twice):
//   const cache = await client.openCache({kvHeads: 8, headDim: 128, dtype: 'bf16'});
//   await cache.append(tensor(k, [8, n, 128], 'bf16'), tensor(v, [8, n, 128], 'bf16'));
//   const step = await cache.decode(tensor(q, [32, 1, 128]), {key: k1, value: v1});
//   toFloat32Array(step.output); cache.length;           // n + 1
//   await client.decode({items: [cacheA.item(qa, ka, va), cacheB.item(qb)]});  // a batch
//   await client.tiled({query, cacheId: cache.id});      // naive / tiled / trace over a cache
//   await cache.delete();
//   client.close();
//
// Positions (attention.proto, AttentionOptions): options.keyPosition (key j is at
// keyPosition + j; default 0) and options.queryPosition (query row i at queryPosition + i;
// absent: bottom-right), which the causal mask compares. In Decode they are per item
// (DecodeItem.keyPosition, queryPosition: Cache.item's, decodeBatch's and Cache.decode's
// keyPosition / queryPosition), never in the options. With them one causal problem splits by
// keys over calls or servers, and mergeStates() joins the parts:
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
// them), so causal, a window, a softcap and ALiBi apply per sequence as if each were a request
// of its own; a row whose sequence has no key it sees gives zeros and lse −inf. A sequence may
// be empty. options.keyPosition and queryPosition must then be unset, and cacheId empty. They
// go in the requests of naive, tiled and trace (request.attention) as they are; the client
// checks only that each is an Array of integer Numbers (a plain Array: Array.from a typed
// array), else a TypeError (naive and tiled reject with it, trace throws it from the loop), and
// the server answers bad values with INVALID_ARGUMENT naming the field: cu_seqlens_q[i] /
// cu_seqlens_k[i] for a first entry other than 0, a decrease or a last entry other than the
// packed length (query.shape / key.shape's length dim), cu_seqlens_q / cu_seqlens_k for one
// given without the other, counts that differ or fewer than 2 entries, query.shape[0] for a
// batch other than 1, options.key_position / options.query_position when set. Trace's start
// repeats them (start.cuSeqlensQ, cuSeqlensK: Arrays of Numbers, [] for one sequence; its
// keyPosition and queryPosition are then 0, each sequence having its own), and where a mask
// applies a step's hidden is HIDDEN_SEQUENCE for a key of its tile in another sequence.
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

const DTYPES = {
  float32: 'DTYPE_FLOAT32', f32: 'DTYPE_FLOAT32', fp32: 'DTYPE_FLOAT32',
  float16: 'DTYPE_FLOAT16', f16: 'DTYPE_FLOAT16', fp16: 'DTYPE_FLOAT16',
  bfloat16: 'DTYPE_BFLOAT16', bf16: 'DTYPE_BFLOAT16',
};
const DTYPE_NUMBERS = {1: 'DTYPE_FLOAT32', 2: 'DTYPE_FLOAT16', 3: 'DTYPE_BFLOAT16'};

// Canonical enum name for 'f32', 'float16', 'DTYPE_BFLOAT16', 2, ...; throws on anything else.
function dtypeName(dtype) {
  if (typeof dtype === 'number' && DTYPE_NUMBERS[dtype]) return DTYPE_NUMBERS[dtype];
  if (typeof dtype === 'string') {
    if (Object.values(DTYPES).includes(dtype)) return dtype;
    if (DTYPES[dtype.toLowerCase()]) return DTYPES[dtype.toLowerCase()];
  }
  throw new TypeError(`unknown dtype ${String(dtype)}; expected float32, float16 or bfloat16`);
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
// dtype: 'float32' (default), 'float16' or 'bfloat16' (or the DTYPE_* names); values are
// rounded to it. Throws a TypeError when the shape's product is not the number of values.
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

// A Tensor message's elements as a Float32Array (row-major), whatever its dtype.
// Throws a TypeError on an unknown dtype or data whose length does not match the shape.
function toFloat32Array(message) {
  const name = dtypeName(message.dtype);
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
    this.token = token;
    this.deadlineMs = deadlineMs;
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
  // CreateCacheRequest ({kvHeads, headDim, valueDim, dtype}) → CacheInfo.
  createCache(request, options) {
    return this.unary_('CreateCache', {...request, dtype: dtypeName(request.dtype ?? 'float32')},
                       options);
  }

  // AppendCacheRequest ({cacheId, key, value, expectedLength}) → CacheInfo.
  appendCache(request, options) { return this.unary_('AppendCache', request, options); }

  // cacheId → CacheInfo ({cacheId, kvHeads, headDim, valueDim, dtype, length, bytes, pageTokens}).
  getCacheInfo(cacheId, options) { return this.unary_('GetCacheInfo', {cacheId}, options); }

  // cacheId → {} (later calls naming it reject with NOT_FOUND).
  deleteCache(cacheId, options) { return this.unary_('DeleteCache', {cacheId}, options); }

  // → ListCachesResponse ({caches: [CacheInfo, ...]}), the caller's, oldest first.
  listCaches(options) { return this.unary_('ListCaches', {}, options); }

  // DecodeRequest ({items: [{cacheId, query, key?, value?, expectedLength}], options}) →
  // DecodeResponse ({outputs, lse, stats, caches}), outputs[i] item i's [heads, nq, valueDim].
  // Atomic: if any item fails, no item's tokens are kept. Cache.item() builds an item; after the
  // call resolves, Cache.update(response.caches[i]) takes its new length (decodeBatch does both).
  decode(request, options) { return this.unary_('Decode', request, options); }

  // decode() over Cache objects: items [{cache, query, key?, value?, keyPosition?,
  // queryPosition?}] → DecodeResponse, each Cache's length updated from the answer. Positions
  // are per item (see Cache.item); attentionOptions.keyPosition / queryPosition are refused
  // here with a TypeError (the server would refuse them too: INVALID_ARGUMENT). A window
  // (attentionOptions.windowLeft, windowRight) is the batch's, against each item's positions;
  // a softcap (attentionOptions.softcap) and ALiBi slopes (attentionOptions.alibiSlopes) the
  // batch's too, applied to every item (each item's query head count must be the slopes').
  async decodeBatch(items, attentionOptions = {}, options) {
    for (const field of ['keyPosition', 'queryPosition']) {
      if (attentionOptions[field] !== undefined && attentionOptions[field] !== null) {
        throw new TypeError(`decode: options.${field} is set; Decode takes positions per item ` +
                            `({cache, query, keyPosition, queryPosition})`);
      }
    }
    const response = await this.decode(
        {items: items.map(({cache, query, key, value, keyPosition, queryPosition}) =>
                              cache.item(query, key, value, {keyPosition, queryPosition})),
         options: attentionOptions},
        options);
    if (response.caches.length !== items.length) {
      throw new Error(`Decode answered ${response.caches.length} caches for ${items.length} items`);
    }
    items.forEach(({cache}, i) => cache.update(response.caches[i]));
    return response;
  }

  // A new cache (CreateCacheRequest) as a Cache; or, given a cache id string, the existing
  // cache with its length read now (GetCacheInfo).
  async openCache(requestOrId, options) {
    const info = typeof requestOrId === 'string' ? await this.getCacheInfo(requestOrId, options)
                                                 : await this.createCache(requestOrId, options);
    return new Cache(this, info);
  }

  close() { this.stub.close(); }
}

// One server-resident cache as the client believes it: id, length (sent as expectedLength) and
// info, the last CacheInfo the server sent. One sequence, one writer: do not share a Cache
// between concurrent calls.
class Cache {
  constructor(client, info) {
    this.client = client;
    this.info = info;
  }

  get id() { return this.info.cacheId; }
  get length() { return Number(this.info.length); }

  // Takes a CacheInfo the server sent for this cache.
  update(info) { this.info = info; }

  // Appends key [kvHeads, n, headDim] and value [kvHeads, n, valueDim] (Tensors) at length.
  async append(key, value, options) {
    this.info = await this.client.appendCache(
        {cacheId: this.id, key, value, expectedLength: this.length}, options);
    return this.info;
  }

  // The DecodeItem for this cache with expectedLength = length; key/value optional new tokens.
  // keyPosition: the position of the cache's first token (default 0); queryPosition: that of
  // the item's first query row (absent: keyPosition + the length after the append − nq).
  item(query, key, value, {keyPosition, queryPosition} = {}) {
    const item = {cacheId: this.id, query, expectedLength: this.length};
    if (key !== undefined && key !== null) item.key = key;
    if (value !== undefined && value !== null) item.value = value;
    if (keyPosition !== undefined && keyPosition !== null) item.keyPosition = keyPosition;
    if (queryPosition !== undefined && queryPosition !== null) item.queryPosition = queryPosition;
    return item;
  }

  // One Decode of this cache alone → {output, lse, stats, cache}. keyPosition, queryPosition:
  // this item's positions (item()); options: the AttentionOptions (a window, a softcap and ALiBi
  // slopes included), without positions.
  async decode(query, {key, value, keyPosition, queryPosition, options: attentionOptions = {}} = {},
               options) {
    const response = await this.client.decodeBatch(
        [{cache: this, query, key, value, keyPosition, queryPosition}], attentionOptions, options);
    return {output: response.outputs[0], lse: response.lse[0] ?? null, stats: response.stats,
            cache: response.caches[0]};
  }

  // Re-reads the info (and so the length) from the server.
  async refresh(options) {
    this.info = await this.client.getCacheInfo(this.id, options);
    return this.info;
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
  mergeStates,
  seedExample,
  standardAlibiSlopes,
  cumulativeLengths,
  AttndError,
  tensor,
  toFloat32Array,
  dtypeName,
  float32ToFloat16Bits,
  float16BitsToFloat32,
  float32ToBfloat16Bits,
  bfloat16BitsToFloat32,
  status: grpc.status,
  proto,
};
