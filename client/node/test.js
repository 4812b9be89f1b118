'use strict';
// The Node client against a running attnd (tests/node_client_test.sh starts it): all four RPCs,
// KV caches (create, append, a batched decode and tiled over a cache against float64, a stale
// expectedLength, NOT_FOUND after delete),
// fp8 caches (dtype 'fp8': float32 and bf16 tokens quantized per row, Decode and Tiled against
// float64 over the unquantized tokens and, tightly, over the stored rows, the export's rows of
// codes, padding and scale read by toFloat32Array, an import decoding bit for bit, fp8 refused as
// a tensor's dtype by tensor() and as a query's or output's by attnd),
// the seed example's out[0] and a random grouped-query causal problem against a float64
// reference computed here, the trace's final estimate against Tiled's row, fp16/bf16 tensors,
// error paths (INVALID_ARGUMENT naming the field, for a unary call and for a stream),
// positions (a causal problem split by keys, each slice at its keyPosition with the whole's
// queryPosition, merged by mergeStates against float64 and the unsplit Tiled; Trace's resolved
// positions; Decode's per-item positions over one sequence held in two caches; bad positions
// → INVALID_ARGUMENT naming options.key_position / options.query_position), sliding windows
// (windowLeft / windowRight through Tiled, Naive and Cache.decode against float64, Trace's start
// repeating the window and each row's steps starting at the first tile it sees, a bad window →
// INVALID_ARGUMENT naming options.window_left / options.window_right), softcaps (softcap through
// Tiled, Naive and Cache.decode on queries × 32 against float64, Trace's start repeating it and
// each step's scaledScores and capped scores, a bad softcap → INVALID_ARGUMENT naming
// options.softcap), ALiBi (alibiSlopes through Tiled, Naive and Cache.decode against float64,
// GQA, causal, odd sizes, bottom-right and at positions, with a softcap and a window;
// standardAlibiSlopes' values; Trace's start repeating the slopes and each step's biases
// −slope·|p − t| and scaledScores before softcap and bias; a wrong slope count → INVALID_ARGUMENT
// naming options.alibi_slopes, a non-finite slope one naming options.alibi_slopes[h]), ragged
// batches (cuSeqlensQ / cuSeqlensK from cumulativeLengths through Tiled and Naive against the
// float64 reference run per sequence, causal, GQA, odd sizes, with a window, ALiBi and a softcap,
// empty sequences; Trace's start repeating them and HIDDEN_SEQUENCE for other sequences' keys;
// bad cumulative lengths → INVALID_ARGUMENT naming cu_seqlens_q[i] / cu_seqlens_k[i], client-side
// TypeErrors for non-integers), attention sinks (sinks through Tiled and Naive with lse against
// float64, GQA, causal, odd sizes, rows that see no key (zeros, lse = the sink), with a scale,
// softcap, ALiBi and windows that leave the sink alone; key slices with the sinks on the first
// only, merged by mergeStates, equal to the unsplit answer (and not when every slice carries them);
// Trace's start repeating them fp32-rounded, rowDone.sinkShare = e^(sink − lse), steps without the
// sink; Cache.decode, a batched decode and Tiled over a cache against float64; ragged batches per
// sequence; a wrong count → INVALID_ARGUMENT naming options.sinks, a non-finite sink one naming
// options.sinks[h]), mergeStates alone, persistent caches (crc32c's check values and chaining;
// export / import of a multi-chunk fp16 cache to another server and through a file: chunks, starts,
// the CRC32C, ALREADY_EXISTS and newIdIfTaken, Tiled over both the same bytes; damaged, cut and
// foreign exports and files → DATA_LOSS with nothing imported; a client-side DATA_LOSS for an
// export stream that does not add up (a grpc-js stand-in server); the replay tail: attnd A with
// --cache-dir, its files copied once durableLength covers some tokens, more tokens appended, attnd
// B started on the copy, and refresh() of the old Cache's state on B re-sends the lost tail in one
// append so B's export equals A's; the straddling entry sliced (rank 3 and rank 2, and cut at a
// small byte limit); DATA_LOSS when no tail reaches back (a server without --cache-dir keeps none,
// or everything was durable), the Cache unchanged; moved_to followed once with the same options
// through grpc-js stand-ins, never twice in a row), speculative decoding (truncate and
// truncateTo: a cut cache equal bit for bit (export, bytes, the next Decode's output and lse) to
// one that never had the cut tokens, fp32 and bf16, inside a page, at a page boundary, to 0 and to
// its own length; four rounds of two sequences verifying k drafts with k + 1 causal query rows and
// cutting the rejected ones with truncateTo in the next call (decodeBatch, then Cache.decode),
// equal to caches built directly; OUT_OF_RANGE, FAILED_PRECONDITION naming the actual length,
// INVALID_ARGUMENT naming length / expected_length / items[0].truncate_to, client-side TypeError
// and RangeError naming the field, each leaving the cache as it was; failed 2-item Decodes with
// truncateTo leaving both caches as they were; with --cache-dir, cuts then SIGKILL, a restart and
// refresh() re-sending the tail without a cut token, a cut whose answer is lost not undone by
// refresh(), a refused cut keeping the tail), token trees (treeParents: a 7-token tree over a
// cached prefix, GQA, causal, fp32 through Cache.decode and bf16 through decodeBatch beside a
// plain item, each row against float64 over the prefix and its branch and against a plain causal
// decode over a cache holding just that branch; a tree step then truncateTo keeping the branch
// t0 → t1 in place, a cut and a tree in one call, and the branch t0 → t2 → t5 cut and sent again,
// each bit-equal (outputs, lse, export) to caches built from the kept tokens; INVALID_ARGUMENT
// naming items[i].tree_parents, items[i].tree_parents[j] and items[i].query, client-side TypeError
// and RangeError naming items[i].treeParents[j], each leaving the cache as it was), latent
// caches (valuesFromKeys: fp32 and bf16 caches of odd shapes, keys appended alone, Cache.decode
// and decodeBatch against float64 whose values are the keys' first valueDim columns, pages of
// keys alone, half a cache storing both; keys-only exports imported bit-exact and still latent; a
// value refused by the client before any call (TypeError naming value / items[i].value) and by the
// server (INVALID_ARGUMENT naming value and items[0].value), valueDim > headDim naming value_dim;
// with --cache-dir a restart keeping the cache latent and refresh() re-sending a SIGKILL's lost
// tail as keys alone), forks (fork and forkCache: a fork of all tokens, of a prefix inside a page
// and of none, fp32 and bf16, equal bit for bit (export, the next Decode's output and lse) to a
// copy built by appending the same tokens, before and after both get the same tokens, the
// source's Decode unchanged by the fork's append and the fork by the source's append and
// delete; sharedBytes all of the fork's bytes right after forking, the source sharing as many,
// 0 once the source is gone; length 0 sent as such; OUT_OF_RANGE naming length,
// FAILED_PRECONDITION naming expected_length (checked first), INVALID_ARGUMENT naming the field,
// NOT_FOUND naming cache_id, client-side TypeError and RangeError naming the field, none making
// a cache), and, when given a TLS server with a token, TLS + bearer token.
// Usage: node test.js --target HOST:PORT [--attnd ATTND] [--secure-target HOST:PORT
//                                         --tls-ca CA.pem --token-file FILE]
// --attnd: the binary the persistent-cache tests start servers of (skipped without it).
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const attnd = require('./client');
const {Client, AttndError, tensor, toFloat32Array, status} = attnd;

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '').replace(/-(.)/g, (_, c) => c.toUpperCase());
    args[key] = argv[i + 1];
  }
  if (!args.target) throw new Error('usage: node test.js --target HOST:PORT');
  return args;
}
const args = parseArgs(process.argv.slice(2));
const client = new Client(args.target, {deadlineMs: 60000});
test.after(() => client.close());

// --- inputs and the float64 reference ---------------------------------------------------------
function mulberry32(seed) {  // Small seeded PRNG: the same problem on every run.
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = seed;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
function randomNormal(count, random) {
  const out = new Float32Array(count);
  for (let i = 0; i < count; ++i) {
    const u = 1 - random(), w = random();
    out[i] = Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * w);
  }
  return out;
}

function seedInputs(n = 8, d = 4) {
  const {q, k, v} = attnd.seedExample(n, d);
  const dims = {batch: 1, heads: 1, kvHeads: 1, queryLen: n, keyLen: n, headDim: d, valueDim: d};
  return {q, k, v, dims};
}

// softmax(cap(scale · Q Kᵀ) + mask) V in float64, with grouped-query heads and the mask over
// positions: key j at keyPosition + j, query row i at queryPosition + i (default bottom-right,
// keyPosition + keyLen − queryLen), a query at p seeing a key at t iff t ≤ p when causal and
// p − windowLeft ≤ t ≤ p + windowRight (an absent side unbounded), decided key by key; a row that
// sees no key gives zeros and lse −inf. cap(s) = softcap · tanh(s / softcap), none when softcap
// is 0 or absent, then query head h's ALiBi bias −alibiSlopes[h] · |p − t| (none when absent or
// empty); both are elementwise, so transforming only the seen keys' scores is the contract's
// scale, then softcap, then bias, then mask. sinks (none when absent or empty): query head h's
// sink s = sinks[h] is one more logit in each of its rows, itself not scaled, capped, biased or
// masked, that takes weight but adds no value (attention.proto, AttentionOptions.sinks):
//   out = Σ_j e^(x_j − m) v_j / (Σ_j e^(x_j − m) + e^(s − m)),  m = max(max_j x_j, s)
//   lse = m + log(Σ_j e^(x_j − m) + e^(s − m))
// and a row that sees no key gives zeros and lse = s. Also returns scoreMax, the largest |score|
// the softmax takes.
function referenceAttention({q, k, v, dims}, scale, causal,
                            {keyPosition = 0, queryPosition, windowLeft, windowRight,
                             softcap = 0, alibiSlopes = [], sinks = []} = {}) {
  const {batch, heads, kvHeads, queryLen, keyLen, headDim, valueDim} = dims;
  const firstQuery = queryPosition ?? keyPosition + keyLen - queryLen;
  const out = new Float64Array(batch * heads * queryLen * valueDim);
  const lse = new Float64Array(batch * heads * queryLen).fill(-Infinity);
  const scores = new Float64Array(keyLen);
  let scoreMax = 0;
  for (let b = 0; b < batch; ++b) {
    for (let h = 0; h < heads; ++h) {
      const kh = Math.floor(h / (heads / kvHeads));
      const kBase = (b * kvHeads + kh) * keyLen;
      const slope = alibiSlopes.length ? alibiSlopes[h] : 0;
      const sink = sinks.length ? sinks[h] : -Infinity;  // e^−inf = 0: no sink.
      for (let i = 0; i < queryLen; ++i) {
        const row = (b * heads + h) * queryLen + i;
        const p = firstQuery + i;
        const seen = [];
        for (let j = 0; j < keyLen; ++j) {
          const t = keyPosition + j;
          if ((causal && t > p) || (windowLeft != null && t < p - windowLeft) ||
              (windowRight != null && t > p + windowRight)) continue;
          seen.push(j);
        }
        if (seen.length === 0) {
          lse[row] = sink;  // −inf without one.
          continue;
        }
        let max = sink;
        for (const j of seen) {
          let s = 0;
          for (let c = 0; c < headDim; ++c) {
            s += q[row * headDim + c] * k[(kBase + j) * headDim + c];
          }
          scores[j] = softcap ? softcap * Math.tanh(s * scale / softcap) : s * scale;
          scores[j] -= slope * Math.abs(p - (keyPosition + j));
          max = Math.max(max, scores[j]);
          scoreMax = Math.max(scoreMax, Math.abs(scores[j]));
        }
        let sum = Math.exp(sink - max);  // The sink's weight; its value adds nothing.
        for (const j of seen) {
          const w = Math.exp(scores[j] - max);
          sum += w;
          for (let c = 0; c < valueDim; ++c) {
            out[row * valueDim + c] += w * v[(kBase + j) * valueDim + c];
          }
        }
        for (let c = 0; c < valueDim; ++c) out[row * valueDim + c] /= sum;
        lse[row] = max + Math.log(sum);
      }
    }
  }
  return {out, lse, scoreMax};
}

// |got − want| ≤ tol · (1 + |want|) everywhere; NaN never passes; −inf only where wanted.
function assertClose(got, want, tol, what) {
  assert.equal(got.length, want.length, `${what}: length`);
  let worst = 0, worstAt = -1;
  for (let i = 0; i < want.length; ++i) {
    if (want[i] === -Infinity) {
      assert.equal(got[i], -Infinity, `${what}[${i}]: ${got[i]}, wanted -inf`);
      continue;
    }
    assert.ok(Number.isFinite(got[i]), `${what}[${i}] is ${got[i]}`);
    const err = Math.abs(got[i] - want[i]) / (1 + Math.abs(want[i]));
    if (err > worst) [worst, worstAt] = [err, i];
  }
  assert.ok(worst <= tol, `${what}: error ${worst} at ${worstAt} (got ${got[worstAt]}, ` +
                          `wanted ${want[worstAt]}) over ${tol}`);
}

function request({q, k, v, dims}, options, dtype = 'float32') {
  const {batch, heads, kvHeads, queryLen, keyLen, headDim, valueDim} = dims;
  return {
    query: tensor(q, [batch, heads, queryLen, headDim], dtype),
    key: tensor(k, [batch, kvHeads, keyLen, headDim], dtype),
    value: tensor(v, [batch, kvHeads, keyLen, valueDim], dtype),
    options,
  };
}

async function collect(iterable) {
  const events = [];
  for await (const event of iterable) events.push(event);
  return events;
}

const SEED_OUT0 = [-0.593223, 0.406777, -1.332858, -0.371937];  // README, attn CLI.
const seed = seedInputs();
const seedRef = referenceAttention(seed, 0.5, false);

// --- the tests --------------------------------------------------------------------------------
test('info: version, backend and limits, int64 as Numbers', async () => {
  const info = await client.info();
  assert.match(info.version, /^\d+\.\d+/);
  assert.ok(['cpu', 'cuda'].includes(info.backend), info.backend);
  assert.ok(info.device.length > 0);
  assert.ok(info.dtypes.includes('DTYPE_FLOAT32'), `dtypes ${info.dtypes}`);
  for (const field of ['deviceMemoryBytes', 'maxMessageBytes', 'maxNaiveBytes', 'maxTraceRows',
                       'maxTraceSteps', 'defaultBlockK']) {
    assert.equal(typeof info[field], 'number', field);
    assert.ok(info[field] > 0, `${field} = ${info[field]}`);
  }
});

test('seed example: tiled and naive out[0] against the float64 reference', async () => {
  for (const method of ['tiled', 'naive']) {
    const res = await client[method](request(seed, {scale: 0.5, blockK: 3}));
    assert.deepEqual(res.output.shape, [1, 1, 8, 4]);
    assert.equal(res.output.dtype, 'DTYPE_FLOAT32');
    const out = toFloat32Array(res.output);
    assertClose(out, seedRef.out, 1e-5, `${method} out`);
    assertClose(out.subarray(0, 4), SEED_OUT0, 1e-6, `${method} out[0] vs README`);
    assert.equal(res.stats.intermediateBytes, method === 'naive' ? 1024 : 0);
    assert.equal(res.stats.blockK, method === 'naive' ? 0 : 3);
    assert.equal(typeof res.stats.computeNs, 'number');
  }
  // An explicit scale is sent (proto3 optional), not replaced by the default 1/sqrt(d).
  const scaled = await client.naive(request(seed, {scale: 1}));
  assertClose(toFloat32Array(scaled.output), referenceAttention(seed, 1, false).out, 1e-5,
              'scale 1');
  // Rank 2 inputs come back rank 2.
  const n = 8, d = 4;
  const res = await client.tiled({
    query: tensor(seed.q, [n, d]), key: tensor(seed.k, [n, d]), value: tensor(seed.v, [n, d]),
    options: {scale: 0.5, blockK: 2},
  });
  assert.deepEqual(res.output.shape, [8, 4]);
  assertClose(toFloat32Array(res.output).subarray(0, 4), SEED_OUT0, 1e-6, 'rank-2 out[0]');
});

// 2 batches × 4 query heads over 2 key/value heads, 41 queries over 29 keys (so causal rows
// 0..11 see no key), head_dim 16, value_dim 12, default scale 1/4, block_k 7.
const random = mulberry32(20240611);
const dims = {batch: 2, heads: 4, kvHeads: 2, queryLen: 41, keyLen: 29, headDim: 16,
              valueDim: 12};
const problem = {
  q: randomNormal(dims.batch * dims.heads * dims.queryLen * dims.headDim, random),
  k: randomNormal(dims.batch * dims.kvHeads * dims.keyLen * dims.headDim, random),
  v: randomNormal(dims.batch * dims.kvHeads * dims.keyLen * dims.valueDim, random),
  dims,
};
const problemRef = referenceAttention(problem, 1 / Math.sqrt(dims.headDim), true);
let tiledRandom;  // Tiled's answer, reused by the trace test.

test('random GQA causal problem: naive and tiled (with lse) against float64', async () => {
  for (const method of ['naive', 'tiled']) {
    const res = await client[method](request(problem, {causal: true, blockK: 7, returnLse: true}));
    assert.deepEqual(res.output.shape, [2, 4, 41, 12]);
    assert.deepEqual(res.lse.shape, [2, 4, 41]);
    assertClose(toFloat32Array(res.output), problemRef.out, 1e-5, `${method} output`);
    assertClose(toFloat32Array(res.lse), problemRef.lse, 1e-5, `${method} lse`);
    if (method === 'tiled') tiledRandom = toFloat32Array(res.output);
  }
});

test('fp16 and bf16 tensors: rounded inputs, fp32 and fp16 outputs', async () => {
  for (const dtype of ['float16', 'bfloat16']) {
    const req = request(problem, {causal: true, blockK: 5, outputDtype: 'DTYPE_FLOAT32'}, dtype);
    // The reference sees exactly the rounded inputs the server gets.
    const rounded = {q: toFloat32Array(req.query), k: toFloat32Array(req.key),
                     v: toFloat32Array(req.value), dims};
    const ref = referenceAttention(rounded, 0.25, true);
    const res = await client.tiled(req);
    assert.equal(res.output.dtype, 'DTYPE_FLOAT32');
    assertClose(toFloat32Array(res.output), ref.out, 1e-5, `${dtype} in, fp32 out`);
    req.options.outputDtype = 0;  // The query's dtype.
    const low = await client.naive(req);
    assert.equal(low.output.dtype, req.query.dtype);
    assertClose(toFloat32Array(low.output), ref.out, dtype === 'float16' ? 2e-3 : 1e-2,
                `${dtype} in and out`);
  }
  assert.equal(attnd.float32ToFloat16Bits(1), 0x3c00);
  assert.equal(attnd.float32ToFloat16Bits(65504), 0x7bff);
  assert.equal(attnd.float32ToFloat16Bits(65520), 0x7c00);  // Halfway to inf rounds to inf.
  assert.equal(attnd.float32ToFloat16Bits(2 ** -24), 0x0001);
  assert.equal(attnd.float32ToFloat16Bits(1 + 2 ** -11), 0x3c00);  // Tie to even.
  assert.equal(attnd.float32ToFloat16Bits(1 + 3 * 2 ** -11), 0x3c02);
  assert.equal(attnd.float16BitsToFloat32(0xc000), -2);
  assert.equal(attnd.float32ToBfloat16Bits(1), 0x3f80);
  assert.equal(attnd.float32ToBfloat16Bits(1 + 2 ** -8), 0x3f80);  // Tie to even.
  assert.equal(attnd.float32ToBfloat16Bits(1 + 3 * 2 ** -8), 0x3f82);
  assert.equal(attnd.bfloat16BitsToFloat32(0xbf80), -1);
});

test('trace of the seed with block_k 2: four steps converging to tiled out[0]', async () => {
  const req = request(seed, {scale: 0.5, blockK: 2});
  const tiled = toFloat32Array((await client.tiled(req)).output);
  const events = await collect(client.trace({attention: req, rows: [{batch: 0, head: 0, row: 0}]}));
  assert.deepEqual(events.map((e) => e.event),
                   ['start', 'step', 'step', 'step', 'step', 'rowDone', 'end']);
  const {start} = events[0];
  assert.equal(start.queryLen, 8);
  assert.equal(start.blockK, 2);
  assert.equal(start.scale, 0.5);
  assert.equal(start.tilesPerRow, 4);
  assert.equal(start.naiveIntermediateBytes, 1024);
  const steps = events.slice(1, 5).map((e) => e.step);
  assert.deepEqual(steps.map((s) => [s.tile, s.keyBegin, s.keyEnd]),
                   [[0, 0, 2], [1, 2, 4], [2, 4, 6], [3, 6, 8]]);
  assert.equal(steps[0].maxBefore, -Infinity);
  assert.equal(steps[0].rescale, 0);
  assert.deepEqual(steps[3].scores.map((s) => Math.fround(s)), [-2.25, 2]);  // The tie at 2.
  for (const s of steps) {
    const sum = s.weights.reduce((a, b) => a + b, 0);
    assert.ok(s.denominator >= sum - 1e-6, `denominator ${s.denominator} < Σ weights ${sum}`);
  }
  const last = steps[3].estimate;
  assert.deepEqual(Float32Array.from(last), tiled.subarray(0, 4), 'last estimate vs tiled row 0');
  assert.deepEqual(Float32Array.from(events[5].rowDone.output), tiled.subarray(0, 4));
  assertClose(events[5].rowDone.reference, seedRef.out.subarray(0, 4), 1e-5, 'row reference');
  assert.ok(events[5].rowDone.maxAbsError < 1e-5);
  assert.equal(events[6].end.rows, 1);
  assert.equal(events[6].end.steps, 4);
});

test('trace of random rows: each final estimate equals tiled row', async () => {
  assert.ok(tiledRandom, 'the random-problem test ran first');
  const rows = [{batch: 1, head: 3, row: 40}, {batch: 0, head: 1, row: 20},
                {batch: 1, head: 0, row: 3}];  // Row 3 sees no key.
  const req = request(problem, {causal: true, blockK: 7});
  const events = await collect(client.trace({attention: req, rows}));
  assert.equal(events[0].event, 'start');
  assert.equal(events.at(-1).event, 'end');
  const done = events.filter((e) => e.event === 'rowDone').map((e) => e.rowDone);
  assert.equal(done.length, rows.length);
  const {valueDim} = dims;
  for (const [index, ref] of rows.entries()) {
    const at = ((ref.batch * dims.heads + ref.head) * dims.queryLen + ref.row) * valueDim;
    const want = tiledRandom.subarray(at, at + valueDim);
    const rowSteps = events.filter((e) => e.event === 'step' &&
                                          e.step.row.batch === ref.batch &&
                                          e.step.row.head === ref.head &&
                                          e.step.row.row === ref.row);
    if (rowSteps.length > 0) {
      assert.deepEqual(Float32Array.from(rowSteps.at(-1).step.estimate), want,
                       `row ${JSON.stringify(ref)}: last estimate vs tiled`);
    }
    assert.deepEqual(Float32Array.from(done[index].output), want, `row ${index} output`);
    assertClose(done[index].output, problemRef.out.subarray(at, at + valueDim), 1e-5,
                `row ${index} vs float64`);
  }
  assert.equal(done[2].lse, -Infinity);
  assert.deepEqual(done[2].output, new Array(valueDim).fill(0));
  // Leaving the loop early cancels the stream; the client still works after.
  for await (const event of client.trace({attention: req, rows})) {
    assert.equal(event.event, 'start');
    break;
  }
  assert.equal((await client.info()).backend.length > 0, true);
});

test('errors: bad shape and bad trace row are INVALID_ARGUMENT naming the field', async () => {
  const bad = request(seed, {scale: 0.5});
  bad.query = {shape: [32], dtype: 'DTYPE_FLOAT32', data: bad.query.data};
  await assert.rejects(client.tiled(bad), (err) => {
    assert.ok(err instanceof AttndError);
    assert.ok(err instanceof Error);
    assert.equal(err.code, status.INVALID_ARGUMENT);
    assert.equal(err.codeName, 'INVALID_ARGUMENT');
    assert.match(err.details, /^query\.shape: has rank 1/);
    assert.match(err.message, /^INVALID_ARGUMENT: query\.shape/);
    return true;
  });
  await assert.rejects(client.naive({...request(seed, {}), value: undefined}), (err) => {
    assert.equal(err.code, status.INVALID_ARGUMENT);
    assert.match(err.details, /^value/);
    return true;
  });
  const trace = client.trace({attention: request(seed, {blockK: 2}),
                              rows: [{batch: 0, head: 0, row: 99}]});
  await assert.rejects(collect(trace), (err) => {
    assert.equal(err.code, status.INVALID_ARGUMENT);
    assert.match(err.details, /rows\[0\]\.row/);
    return true;
  });
});

// A cache's tokens kept client-side, per kv head, as the server stores them (fp32 here).
class HeldTokens {
  constructor(kvHeads, headDim, valueDim) {
    Object.assign(this, {kvHeads, headDim, valueDim, keys: [], values: []});
    for (let h = 0; h < kvHeads; ++h) this.keys.push([]), this.values.push([]);
  }
  // n random tokens as [key, value] Tensors [kvHeads, n, dim], added to the held copy.
  tokens(n, random) {
    const {kvHeads, headDim, valueDim} = this;
    const k = randomNormal(kvHeads * n * headDim, random);
    const v = randomNormal(kvHeads * n * valueDim, random);
    for (let h = 0; h < kvHeads; ++h) {
      this.keys[h].push(...k.subarray(h * n * headDim, (h + 1) * n * headDim));
      this.values[h].push(...v.subarray(h * n * valueDim, (h + 1) * n * valueDim));
    }
    return [tensor(k, [kvHeads, n, headDim]), tensor(v, [kvHeads, n, valueDim])];
  }
  get length() { return this.keys[0].length / this.headDim; }
  // The float64 reference for q [heads, nq, headDim] over every held token.
  reference(q, heads, nq, causal) {
    const {kvHeads, headDim, valueDim} = this;
    const dims = {batch: 1, heads, kvHeads, queryLen: nq, keyLen: this.length, headDim, valueDim};
    return referenceAttention({q, k: Float32Array.from(this.keys.flat()),
                               v: Float32Array.from(this.values.flat()), dims},
                              1 / Math.sqrt(headDim), causal);
  }
}

test('KV caches: create, append, batched decode and tiled over a cache vs float64', async () => {
  const rnd = mulberry32(77);
  const specs = [{kvHeads: 2, headDim: 16, valueDim: 12, heads: 4, nq: 1, fill: 45},
                 {kvHeads: 1, headDim: 8, valueDim: 8, heads: 3, nq: 2, fill: 19}];
  const caches = [], held = [];
  for (const spec of specs) {
    const cache = await client.openCache({kvHeads: spec.kvHeads, headDim: spec.headDim,
                                          valueDim: spec.valueDim, dtype: 'f32'});
    assert.match(cache.id, /^[0-9a-f]{32}$/);
    assert.equal(cache.length, 0);
    assert.equal(cache.info.dtype, 'DTYPE_FLOAT32');
    const tokens = new HeldTokens(spec.kvHeads, spec.headDim, spec.valueDim);
    const info = await cache.append(...tokens.tokens(spec.fill, rnd));
    assert.equal(info.length, spec.fill);
    assert.equal(cache.length, spec.fill);
    assert.ok(info.bytes > 0 && info.pageTokens > 0);
    caches.push(cache);
    held.push(tokens);
  }
  const listed = (await client.listCaches()).caches.map((c) => c.cacheId);
  for (const cache of caches) assert.ok(listed.includes(cache.id), `${cache.id} listed`);
  assert.equal((await client.getCacheInfo(caches[1].id)).length, 19);

  // One Decode over both: cache 0 gets one new token, cache 1 none; causal, with lse.
  const queries = specs.map((s) => randomNormal(s.heads * s.nq * s.headDim, rnd));
  const [k0, v0] = held[0].tokens(1, rnd);
  const response = await client.decodeBatch(
      [{cache: caches[0], query: tensor(queries[0], [4, 1, 16]), key: k0, value: v0},
       {cache: caches[1], query: tensor(queries[1], [3, 2, 8])}],
      {causal: true, returnLse: true});
  assert.deepEqual(response.caches.map((c) => c.length), [46, 19]);
  assert.deepEqual(caches.map((c) => c.length), [46, 19]);
  for (const [i, spec] of specs.entries()) {
    const ref = held[i].reference(queries[i], spec.heads, spec.nq, true);
    assert.deepEqual(response.outputs[i].shape, [spec.heads, spec.nq, spec.valueDim]);
    assertClose(toFloat32Array(response.outputs[i]), ref.out, 1e-5, `decode item ${i}`);
    assertClose(toFloat32Array(response.lse[i]), ref.lse, 1e-5, `decode item ${i} lse`);
    // Tiled over the cache's keys gives the same answer.
    const tiled = await client.tiled({query: tensor(queries[i], [spec.heads, spec.nq,
                                                                 spec.headDim]),
                                      cacheId: caches[i].id, options: {causal: true, blockK: 5}});
    assertClose(toFloat32Array(tiled.output), ref.out, 1e-5, `tiled over cache ${i}`);
  }

  // Cache.decode: a single step.
  const q = randomNormal(4 * 16, rnd);
  const [k1, v1] = held[0].tokens(1, rnd);
  const step = await caches[0].decode(tensor(q, [4, 1, 16]), {key: k1, value: v1});
  assert.equal(caches[0].length, 47);
  assertClose(toFloat32Array(step.output), held[0].reference(q, 4, 1, false).out, 1e-5,
              'Cache.decode');

  // A stale expectedLength (a retried append) is FAILED_PRECONDITION naming the length.
  const [k2, v2] = new HeldTokens(1, 8, 8).tokens(2, rnd);
  await assert.rejects(
      client.appendCache({cacheId: caches[1].id, key: k2, value: v2, expectedLength: 3}),
      (err) => err.code === status.FAILED_PRECONDITION && /19/.test(err.details));
  assert.equal((await caches[1].refresh()).length, 19);

  // Delete: NOT_FOUND afterwards, for info, append and decode.
  for (const cache of caches) await cache.delete();
  await assert.rejects(client.getCacheInfo(caches[0].id), (e) => e.code === status.NOT_FOUND);
  await assert.rejects(caches[1].append(k2, v2), (e) => e.code === status.NOT_FOUND);
  await assert.rejects(caches[0].decode(tensor(q, [4, 1, 16])),
                       (e) => e.code === status.NOT_FOUND);
  const after = (await client.listCaches()).caches.map((c) => c.cacheId);
  for (const cache of caches) assert.ok(!after.includes(cache.id), `${cache.id} gone`);
});

test('fp8 caches: tokens quantized per row, Decode and Tiled vs float64, stored rows, export ' +
     'and import, fp8 no tensor dtype', async () => {
  const rnd = mulberry32(88);
  const [kvHeads, headDim, valueDim, heads] = [2, 21, 13, 4];  // Rows padded: 21 → 24, 13 → 16.
  const cache = await client.openCache({kvHeads, headDim, valueDim, dtype: 'fp8'});
  assert.equal(cache.info.dtype, 'DTYPE_FLOAT8_E4M3');
  assert.equal(cache.tokenDtype, 'DTYPE_FLOAT32');
  const held = new HeldTokens(kvHeads, headDim, valueDim);
  await cache.append(...held.tokens(40, rnd));  // float32, tensor()'s default
  // Any tensor dtype: bf16 tokens (the held copy keeps their float32 values).
  await cache.append(...held.tokens(3, rnd).map((t) => tensor(toFloat32Array(t), t.shape, 'bf16')));
  const q = randomNormal(heads * headDim, rnd);
  const [k1, v1] = held.tokens(1, rnd);
  const step = await cache.decode(tensor(q, [heads, 1, headDim]), {key: k1, value: v1});
  assert.equal(cache.length, 44);
  const out = toFloat32Array(step.output);
  assertClose(out, held.reference(q, heads, 1, false).out, 0.05, 'fp8 Decode vs the tokens sent');

  // The stored rows: codes, zero bytes to a multiple of 4, a float32 scale; each element within
  // half an E4M3 step (2^-4 relative, 2^-10 · scale below 2^-6) of the token sent.
  const chunks = [];
  for await (const chunk of client.exportCache(cache.id)) chunks.push(chunk);
  const stored = {key: [[], []], value: [[], []]};
  for (const chunk of chunks.filter((c) => c.key)) {
    for (const [name, dim] of [['key', headDim], ['value', valueDim]]) {
      const t = chunk[name], n = t.shape[1];
      assert.equal(t.dtype, 'DTYPE_FLOAT8_E4M3');
      assert.equal(t.data.length, kvHeads * n * (Math.ceil(dim / 4) * 4 + 4), `${name} bytes`);
      const x = toFloat32Array(t);
      for (let h = 0; h < kvHeads; ++h) {
        stored[name][h].push(...x.subarray(h * n * dim, (h + 1) * n * dim));
      }
    }
  }
  for (const [name, dim, sent] of [['key', headDim, held.keys], ['value', valueDim, held.values]]) {
    for (let h = 0; h < kvHeads; ++h) {
      assert.equal(stored[name][h].length, sent[h].length, `${name} head ${h}`);
      for (let r = 0; r * dim < sent[h].length; ++r) {
        const row = sent[h].slice(r * dim, (r + 1) * dim);
        const scale = Math.max(...row.map(Math.abs)) / 448;
        row.forEach((x, i) => {
          const got = stored[name][h][r * dim + i];
          assert.ok(Math.abs(got - x) <= Math.abs(x) * (2 ** -4 + 2 ** -8) + scale * 2 ** -10,
                    `${name}[${h}][${r}][${i}]: stored ${got}, sent ${x}`);
        });
      }
    }
  }
  // Decode and Tiled over the cache: float64 over the stored rows.
  const dims = {batch: 1, heads, kvHeads, queryLen: 1, keyLen: 44, headDim, valueDim};
  const exact = referenceAttention({q, k: Float32Array.from(stored.key.flat()),
                                    v: Float32Array.from(stored.value.flat()), dims},
                                   1 / Math.sqrt(headDim), false);
  assertClose(out, exact.out, 1e-5, 'fp8 Decode vs its stored rows');
  const tiled = await client.tiled({query: tensor(q, [heads, 1, headDim]), cacheId: cache.id});
  assertClose(toFloat32Array(tiled.output), exact.out, 1e-5, 'Tiled over an fp8 cache');

  // Imported, it decodes bit for bit as the original.
  const copy = await client.importCache(chunks, {newIdIfTaken: true});
  assert.equal(copy.info.dtype, 'DTYPE_FLOAT8_E4M3');
  assert.equal(copy.length, 44);
  const q2 = tensor(randomNormal(heads * headDim, rnd), [heads, 1, headDim]);
  const [k2, v2] = held.tokens(1, rnd);
  const [a, b] = [await cache.decode(q2, {key: k2, value: v2}),
                  await copy.decode(q2, {key: k2, value: v2})];
  assert.ok(a.output.data.equals(b.output.data), 'the imported fp8 cache decodes differently');

  // fp8 is a cache's dtype only: tensor() throws; attnd refuses a query or an output in it.
  assert.throws(() => tensor(q, [heads, 1, headDim], 'fp8'), /a KV cache's dtype only/);
  await assert.rejects(client.openCache({kvHeads, headDim, dtype: 5}), /unknown cache dtype 5/);
  const fp8Query = {shape: [heads, 1, headDim], dtype: 'DTYPE_FLOAT8_E4M3',
                    data: Buffer.alloc(heads * headDim)};
  await assert.rejects(client.tiled({query: fp8Query, cacheId: cache.id}),
                       (e) => e.code === status.INVALID_ARGUMENT && /query\.dtype/.test(e.details));
  await assert.rejects(
      client.tiled({query: q2, cacheId: cache.id, options: {outputDtype: 'DTYPE_FLOAT8_E4M3'}}),
      (e) => e.code === status.INVALID_ARGUMENT && /output_dtype/.test(e.details));
  await cache.delete();
  await copy.delete();
});

// --- positions and mergeStates ------------------------------------------------------------------
// Fresh inputs on every run (ATTN_TEST_SEED repeats one); the seed is printed.
const positionsSeed = Number(process.env.ATTN_TEST_SEED ?? Math.floor(Math.random() * 2 ** 31));
console.log(`# positions and mergeStates tests: ATTN_TEST_SEED=${positionsSeed}`);
const MERGE_TOL = 3e-6;  // assertClose's |got − want| / (1 + |want|), fp32 outputs.
const LSE_TOL = 1e-4;

function randomProblem(dims, random) {
  return {
    q: randomNormal(dims.batch * dims.heads * dims.queryLen * dims.headDim, random),
    k: randomNormal(dims.batch * dims.kvHeads * dims.keyLen * dims.headDim, random),
    v: randomNormal(dims.batch * dims.kvHeads * dims.keyLen * dims.valueDim, random),
    dims,
  };
}

// The problem's keys and values [a, b) (every batch and kv head), as a problem of b − a keys.
function sliceKeys({q, k, v, dims}, a, b) {
  const {batch, kvHeads, keyLen, headDim, valueDim} = dims;
  const n = b - a;
  const ks = new Float32Array(batch * kvHeads * n * headDim);
  const vs = new Float32Array(batch * kvHeads * n * valueDim);
  for (let bh = 0; bh < batch * kvHeads; ++bh) {
    ks.set(k.subarray((bh * keyLen + a) * headDim, (bh * keyLen + b) * headDim), bh * n * headDim);
    vs.set(v.subarray((bh * keyLen + a) * valueDim, (bh * keyLen + b) * valueDim),
           bh * n * valueDim);
  }
  return {q, k: ks, v: vs, dims: {...dims, keyLen: n}};
}

// Splits `problem` at `bounds` (0 … keyLen), calls `method` per slice with keyPosition = its
// first key's position and the whole's queryPosition, checks each part against its float64
// reference and the merge against the whole's and the unsplit Tiled's. dtype: the inputs'.
async function checkSplit(problem, bounds, {keyPosition = 0, queryPosition, dtype = 'float32',
                                             blockK = 0} = {}) {
  const {dims} = problem;
  const wholeQuery = queryPosition ?? keyPosition + dims.keyLen - dims.queryLen;
  const scale = 1 / Math.sqrt(dims.headDim);
  const options = {causal: true, returnLse: true, outputDtype: 'DTYPE_FLOAT32', blockK};
  // The reference sees exactly the rounded inputs the server gets.
  const sent = request(problem, {}, dtype);
  const seen = {q: toFloat32Array(sent.query), k: toFloat32Array(sent.key),
                v: toFloat32Array(sent.value), dims};
  const whole = referenceAttention(seen, scale, true, {keyPosition, queryPosition: wholeQuery});
  const unsplit = await client.tiled(request(problem, {...options, keyPosition, queryPosition},
                                             dtype));
  assertClose(toFloat32Array(unsplit.output), whole.out, MERGE_TOL, 'unsplit tiled');
  assertClose(toFloat32Array(unsplit.lse), whole.lse, LSE_TOL, 'unsplit tiled lse');
  const partLse = [];
  for (const method of ['tiled', 'naive']) {
    const responses = [];
    partLse.length = 0;
    for (let s = 0; s + 1 < bounds.length; ++s) {
      const [a, b] = [bounds[s], bounds[s + 1]];
      const what = `${method} ${dtype} slice [${a}, ${b})`;
      const res = await client[method](request(
          sliceKeys(problem, a, b),
          {...options, keyPosition: keyPosition + a, queryPosition: wholeQuery}, dtype));
      assert.equal(res.output.dtype, 'DTYPE_FLOAT32', what);
      const ref = referenceAttention(sliceKeys(seen, a, b), scale, true,
                                     {keyPosition: keyPosition + a, queryPosition: wholeQuery});
      assertClose(toFloat32Array(res.output), ref.out, MERGE_TOL, what);
      assertClose(toFloat32Array(res.lse), ref.lse, LSE_TOL, `${what} lse`);
      responses.push(res);
      partLse.push(toFloat32Array(res.lse));
    }
    // Responses (Tensors) and Float32Array pairs merge alike.
    const merged = attnd.mergeStates(responses);
    assert.deepEqual(merged.shape, unsplit.output.shape);
    assertClose(merged.output, whole.out, MERGE_TOL, `merged ${method} ${dtype}`);
    assertClose(merged.lse, whole.lse, LSE_TOL, `merged ${method} ${dtype} lse`);
    assertClose(merged.output, toFloat32Array(unsplit.output), MERGE_TOL,
                `merged ${method} vs unsplit tiled`);
    const fromArrays = attnd.mergeStates(
        responses.map((r) => [toFloat32Array(r.output), toFloat32Array(r.lse)]));
    assert.deepEqual(fromArrays.output, merged.output);
    assert.deepEqual(fromArrays.lse, merged.lse);
  }
  return partLse;
}

test('positions: key slices at their keyPosition, merged, equal the whole causal problem',
     async () => {
  const random = mulberry32(positionsSeed);
  // GQA, valueDim ≠ headDim, 11 query rows at positions 20..30 over 37 keys: [25, 31) is hidden
  // from rows 20..24, [31, 37) from every row (lse −inf, zeros); a one-key slice; unequal sizes.
  const dims = {batch: 2, heads: 4, kvHeads: 2, queryLen: 11, keyLen: 37, headDim: 10,
                valueDim: 7};
  const problem = randomProblem(dims, random);
  const bounds = [0, 1, 14, 25, 31, 37];
  const partLse = await checkSplit(problem, bounds, {queryPosition: 20, blockK: 4});
  const rows = dims.batch * dims.heads * dims.queryLen;
  for (let r = 0; r < rows; ++r) {
    const position = 20 + (r % dims.queryLen);
    assert.equal(partLse[3][r] === -Infinity, position < 25, `slice [25, 31) row ${r}`);
    assert.equal(partLse[4][r], -Infinity, `slice [31, 37) row ${r}`);
  }
  // Bottom-right (the default queryPosition, sent explicitly to the parts), fp16 and bf16
  // inputs with fp32 outputs, and a whole sequence starting at 2^40 + 1.
  const small = randomProblem({batch: 1, heads: 3, kvHeads: 1, queryLen: 6, keyLen: 19,
                               headDim: 9, valueDim: 5}, random);
  await checkSplit(small, [0, 7, 8, 19]);
  for (const dtype of ['float16', 'bfloat16']) await checkSplit(small, [0, 10, 19], {dtype});
  await checkSplit(small, [0, 3, 19], {keyPosition: 2 ** 40 + 1, queryPosition: 2 ** 40 + 9});
});

test('positions: Trace repeats the resolved positions and masks by them', async () => {
  const random = mulberry32(positionsSeed + 1);
  const dims = {batch: 1, heads: 2, kvHeads: 1, queryLen: 5, keyLen: 9, headDim: 6, valueDim: 4};
  const problem = randomProblem(dims, random);
  const options = {causal: true, blockK: 4, keyPosition: 40, queryPosition: 43};
  const tiled = toFloat32Array((await client.tiled(request(problem, options))).output);
  const rows = [{batch: 0, head: 1, row: 4}, {batch: 0, head: 0, row: 1}];
  const events = await collect(client.trace({attention: request(problem, options), rows}));
  assert.equal(events[0].start.keyPosition, 40);
  assert.equal(events[0].start.queryPosition, 43);
  for (const e of events.filter((x) => x.event === 'step')) {
    e.step.scores.forEach((score, j) => {
      const hidden = 40 + e.step.keyBegin + j > 43 + e.step.row.row;
      assert.equal(score === -Infinity, hidden, `row ${e.step.row.row} key ${e.step.keyBegin + j}`);
    });
  }
  const done = events.filter((e) => e.event === 'rowDone').map((e) => e.rowDone);
  for (const [i, ref] of rows.entries()) {
    const at = (ref.head * dims.queryLen + ref.row) * dims.valueDim;
    assertClose(done[i].output, tiled.subarray(at, at + dims.valueDim), 1e-6, `row ${i}`);
  }
  const plain = await collect(client.trace({attention: request(problem, {causal: true,
                                                                         keyPosition: 7})}));
  assert.equal(plain[0].start.queryPosition, 7 + 9 - 5, 'default queryPosition, resolved');
});

test('positions: Decode per item over one sequence held in two caches, merged', async () => {
  const random = mulberry32(positionsSeed + 2);
  const [kvHeads, heads, headDim, valueDim, nq] = [2, 4, 8, 5, 2];
  // Keys [0, 17) in cache A, [17, 40) in cache B, and B gets 1 new token (key 40) in the call.
  const all = new HeldTokens(kvHeads, headDim, valueDim);
  const a = new HeldTokens(kvHeads, headDim, valueDim), b = new HeldTokens(kvHeads, headDim,
                                                                           valueDim);
  const cacheA = await client.openCache({kvHeads, headDim, valueDim});
  const cacheB = await client.openCache({kvHeads, headDim, valueDim});
  const [ka, va] = a.tokens(17, random);
  const [kb, vb] = b.tokens(23, random);
  const [k1, v1] = b.tokens(1, random);
  for (let h = 0; h < kvHeads; ++h) {
    all.keys[h].push(...a.keys[h], ...b.keys[h]);
    all.values[h].push(...a.values[h], ...b.values[h]);
  }
  await cacheA.append(ka, va);
  await cacheB.append(kb, vb);
  const q = randomNormal(heads * nq * headDim, random);
  const query = tensor(q, [heads, nq, headDim]);
  // Queries at 39, 40 (the whole's bottom-right). Item B's default queryPosition
  // (17 + 24 − 2 = 39) is the whole's; item A needs it given.
  const response = await client.decodeBatch(
      [{cache: cacheA, query, keyPosition: 0, queryPosition: 39},
       {cache: cacheB, query, key: k1, value: v1, keyPosition: 17}],
      {causal: true, returnLse: true});
  assert.deepEqual([cacheA.length, cacheB.length], [17, 24]);
  const scale = 1 / Math.sqrt(headDim);
  const dimsOf = (held) => ({batch: 1, heads, kvHeads, queryLen: nq, keyLen: held.length, headDim,
                             valueDim});
  const problemOf = (held) => ({q, k: Float32Array.from(held.keys.flat()),
                                v: Float32Array.from(held.values.flat()), dims: dimsOf(held)});
  for (const [i, [held, keyPosition]] of [[a, 0], [b, 17]].entries()) {
    const ref = referenceAttention(problemOf(held), scale, true, {keyPosition, queryPosition: 39});
    assertClose(toFloat32Array(response.outputs[i]), ref.out, MERGE_TOL, `item ${i}`);
    assertClose(toFloat32Array(response.lse[i]), ref.lse, LSE_TOL, `item ${i} lse`);
  }
  const merged = attnd.mergeStates(response.outputs.map((o, i) => ({output: o,
                                                                    lse: response.lse[i]})));
  const whole = referenceAttention(problemOf(all), scale, true);
  assertClose(merged.output, whole.out, MERGE_TOL, 'merged decode');
  assertClose(merged.lse, whole.lse, LSE_TOL, 'merged decode lse');
  // Cache.decode with positions: B's keys at 17..40, queries at 20, 21.
  const step = await cacheB.decode(query, {keyPosition: 17, queryPosition: 20,
                                           options: {causal: true, returnLse: true}});
  const ref = referenceAttention(problemOf(b), scale, true, {keyPosition: 17, queryPosition: 20});
  assertClose(toFloat32Array(step.output), ref.out, MERGE_TOL, 'Cache.decode');
  assertClose(toFloat32Array(step.lse), ref.lse, LSE_TOL, 'Cache.decode lse');
  // Positions in the options: refused here, and by the server for a raw DecodeRequest.
  await assert.rejects(cacheB.decode(query, {options: {keyPosition: 17}}),
                       (err) => err instanceof TypeError && /per item/.test(err.message));
  await assert.rejects(
      client.decode({items: [cacheB.item(query)], options: {queryPosition: 3}}),
      (err) => err.code === status.INVALID_ARGUMENT &&
               /options\.query_position/.test(err.details));
  await assert.rejects(
      client.decode({items: [cacheB.item(query, null, null, {keyPosition: -2})]}),
      (err) => err.code === status.INVALID_ARGUMENT &&
               /items\[0\]\.key_position/.test(err.details));
  assert.equal((await cacheB.refresh()).length, 24);
  await cacheA.delete();
  await cacheB.delete();
});

test('positions: negative or past 2^62 is INVALID_ARGUMENT naming the field', async () => {
  for (const [field, value] of [['keyPosition', -1], ['queryPosition', -5],
                                ['keyPosition', 2 ** 62 + 2 ** 12]]) {
    const name = field === 'keyPosition' ? 'key_position' : 'query_position';
    const req = request(seed, {causal: true, [field]: value});
    for (const call of [() => client.tiled(req), () => client.naive(req),
                        () => collect(client.trace({attention: req}))]) {
      await assert.rejects(call(), (err) => {
        assert.equal(err.code, status.INVALID_ARGUMENT, err.message);
        assert.match(err.details, new RegExp(`options\\.${name}`));
        return true;
      });
    }
  }
});

// --- sliding windows ----------------------------------------------------------------------------
test('window: windowed tiled and naive against float64, passed through as options', async () => {
  const random = mulberry32(positionsSeed + 3);
  // 13 queries over 13 keys, GQA, valueDim ≠ headDim, block_k 4 (tiles [0,4) … [12,13)).
  const dims = {batch: 1, heads: 4, kvHeads: 2, queryLen: 13, keyLen: 13, headDim: 8, valueDim: 5};
  const problem = randomProblem(dims, random);
  const scale = 1 / Math.sqrt(dims.headDim);
  for (const [window, positions] of [
    // Causal with a left window: row r sees keys r − 3 … r.
    [{causal: true, windowLeft: 3}, {}],
    // Both sides, not causal, at positions: the query at 45 + i sees 43 + i … 46 + i of the keys
    // at 40 … 52 (rows 10 … 12 see none: zeros, lse −inf).
    [{causal: false, windowLeft: 2, windowRight: 1}, {keyPosition: 40, queryPosition: 45}],
  ]) {
    const what = JSON.stringify({...window, ...positions});
    const ref = referenceAttention(problem, scale, window.causal, {...positions, ...window});
    const unwindowed = referenceAttention(problem, scale, window.causal, positions);
    assert.ok(ref.out.some((x, i) => Math.abs(x - unwindowed.out[i]) > 1e-3), `${what} matters`);
    for (const method of ['tiled', 'naive']) {
      const res = await client[method](request(problem, {...window, ...positions, blockK: 4,
                                                         returnLse: true}));
      assertClose(toFloat32Array(res.output), ref.out, 1e-5, `${method} ${what}`);
      assertClose(toFloat32Array(res.lse), ref.lse, 1e-5, `${method} ${what} lse`);
    }
  }
  // null and undefined sides are unbounded: the plain causal answer.
  const plain = toFloat32Array((await client.tiled(request(problem, {causal: true}))).output);
  const open = await client.tiled(request(problem, {causal: true, windowLeft: null,
                                                    windowRight: undefined}));
  assert.deepEqual(toFloat32Array(open.output), plain);
});

test('window: Trace repeats it, each row starting at the first tile it sees', async () => {
  const random = mulberry32(positionsSeed + 4);
  const dims = {batch: 1, heads: 4, kvHeads: 2, queryLen: 13, keyLen: 13, headDim: 8, valueDim: 5};
  const problem = randomProblem(dims, random);
  const options = {causal: true, windowLeft: 3, blockK: 4};
  const tiled = toFloat32Array((await client.tiled(request(problem, options))).output);
  const rows = [{batch: 0, head: 1, row: 12}, {batch: 0, head: 2, row: 2},
                {batch: 0, head: 3, row: 7}];
  const events = await collect(client.trace({attention: request(problem, options), rows}));
  const {start} = events[0];
  assert.equal(start.windowLeft, 3);
  assert.equal(start.windowRight, undefined, 'absent: unbounded');
  for (const [i, ref] of rows.entries()) {
    const steps = events.filter((e) => e.event === 'step' && e.step.row.head === ref.head &&
                                       e.step.row.row === ref.row).map((e) => e.step);
    const first = Math.floor(Math.max(0, ref.row - 3) / 4), last = Math.floor(ref.row / 4);
    assert.deepEqual(steps.map((s) => s.tile),
                     Array.from({length: last - first + 1}, (_, t) => first + t), `row ${ref.row}`);
    for (const s of steps) {
      s.scores.forEach((score, j) => {
        const t = s.keyBegin + j;
        assert.equal(score === -Infinity, t < ref.row - 3 || t > ref.row,
                     `row ${ref.row} key ${t}`);
      });
    }
    const at = (ref.head * dims.queryLen + ref.row) * dims.valueDim;
    const done = events.filter((e) => e.event === 'rowDone')[i].rowDone;
    assertClose(done.output, tiled.subarray(at, at + dims.valueDim), 1e-6, `row ${ref.row}`);
  }
  const plain = await collect(client.trace({attention: request(problem, {causal: true})}));
  assert.equal(plain[0].start.windowLeft, undefined);
  assert.equal(plain[0].start.windowRight, undefined);
});

test('window: Cache.decode against float64; bad windows are INVALID_ARGUMENT naming them',
     async () => {
  const random = mulberry32(positionsSeed + 5);
  const [kvHeads, heads, headDim, valueDim, nq] = [2, 4, 8, 5, 2];
  const held = new HeldTokens(kvHeads, headDim, valueDim);
  const cache = await client.openCache({kvHeads, headDim, valueDim});
  try {
    await cache.append(...held.tokens(11, random));
    const q = randomNormal(heads * nq * headDim, random);
    const query = tensor(q, [heads, nq, headDim]);
    const [k1, v1] = held.tokens(1, random);
    // Keys at 30 … 41 after the append, queries at 40, 41 (bottom-right): the one at p sees
    // the keys at p − 4 … p.
    const step = await cache.decode(query, {key: k1, value: v1, keyPosition: 30,
                                            options: {causal: true, windowLeft: 4,
                                                      returnLse: true}});
    assert.equal(cache.length, 12);
    const dims = {batch: 1, heads, kvHeads, queryLen: nq, keyLen: 12, headDim, valueDim};
    const ref = referenceAttention({q, k: Float32Array.from(held.keys.flat()),
                                    v: Float32Array.from(held.values.flat()), dims},
                                   1 / Math.sqrt(headDim), true, {keyPosition: 30, windowLeft: 4});
    assertClose(toFloat32Array(step.output), ref.out, MERGE_TOL, 'windowed Cache.decode');
    assertClose(toFloat32Array(step.lse), ref.lse, LSE_TOL, 'windowed Cache.decode lse');
    await assert.rejects(cache.decode(query, {options: {windowLeft: -1}}), (err) => {
      assert.equal(err.code, status.INVALID_ARGUMENT, err.message);
      assert.match(err.details, /options\.window_left/);
      return true;
    });
    assert.equal((await cache.refresh()).length, 12);
  } finally {
    await cache.delete();
  }
  for (const [field, value] of [['windowLeft', -1], ['windowRight', -1],
                                ['windowLeft', 2 ** 62 + 2 ** 12]]) {
    const name = field === 'windowLeft' ? 'window_left' : 'window_right';
    const req = request(seed, {causal: true, [field]: value});
    for (const call of [() => client.tiled(req), () => client.naive(req),
                        () => collect(client.trace({attention: req}))]) {
      await assert.rejects(call(), (err) => {
        assert.equal(err.code, status.INVALID_ARGUMENT, err.message);
        assert.match(err.details, new RegExp(`options\\.${name}`));
        return true;
      });
    }
  }
});

// --- softcap ------------------------------------------------------------------------------------
// A problem whose scores pass the caps: normal inputs, the queries × 32.
function softcapProblem(dims, random) {
  const problem = randomProblem(dims, random);
  problem.q = problem.q.map((x) => 32 * x);
  return problem;
}
// The fp32 tolerance at capped scores up to softcap (attnd_harness.fp32_rtol's rule: 1e-5
// while |score| ≤ 8, beyond that ∝ the largest score the softmax takes, here ≤ softcap).
const softcapTol = (softcap) => 1e-5 * Math.max(1, softcap / 8);
// One float32 ulp at |x| (normal numbers; the smallest subnormal below).
const f32Ulp = (x) => 2 ** Math.max(Math.floor(Math.log2(Math.abs(x))) - 23, -149);

test('softcap: tiled and naive against float64, passed through as options', async () => {
  const random = mulberry32(positionsSeed + 6);
  // Odd sizes, GQA, valueDim ≠ headDim, keyLen ≠ queryLen, block_k 4.
  const dims = {batch: 1, heads: 4, kvHeads: 2, queryLen: 11, keyLen: 15, headDim: 7, valueDim: 5};
  const problem = softcapProblem(dims, random);
  const scale = 1 / Math.sqrt(dims.headDim);
  for (const options of [{causal: true, softcap: 5}, {causal: false, softcap: 30},
                         {causal: true, softcap: 30}, {causal: false, softcap: 5}]) {
    const what = JSON.stringify(options);
    const ref = referenceAttention(problem, scale, options.causal, options);
    const uncapped = referenceAttention(problem, scale, options.causal);
    assert.ok(ref.out.some((x, i) => Math.abs(x - uncapped.out[i]) > 1e-2), `${what} matters`);
    for (const method of ['tiled', 'naive']) {
      const res = await client[method](request(problem, {...options, blockK: 4, returnLse: true}));
      assertClose(toFloat32Array(res.output), ref.out, softcapTol(options.softcap),
                  `${method} ${what}`);
      assertClose(toFloat32Array(res.lse), ref.lse, softcapTol(options.softcap),
                  `${method} ${what} lse`);
    }
  }
  // softcap 0 is none: the plain answer, exactly.
  const plain = toFloat32Array((await client.tiled(request(problem, {causal: true}))).output);
  const zero = await client.tiled(request(problem, {causal: true, softcap: 0}));
  assert.deepEqual(toFloat32Array(zero.output), plain);
});

test('softcap: Trace repeats it; steps carry scaledScores and the capped scores', async () => {
  const random = mulberry32(positionsSeed + 7);
  const dims = {batch: 1, heads: 4, kvHeads: 2, queryLen: 13, keyLen: 13, headDim: 7, valueDim: 5};
  const problem = softcapProblem(dims, random);
  const softcap = 5;
  const options = {causal: true, softcap, blockK: 4};
  const scale = 1 / Math.sqrt(dims.headDim);
  const tiled = toFloat32Array((await client.tiled(request(problem, options))).output);
  const rows = [{batch: 0, head: 1, row: 12}, {batch: 0, head: 2, row: 2},
                {batch: 0, head: 3, row: 7}];
  const events = await collect(client.trace({attention: request(problem, options), rows}));
  assert.equal(events[0].start.softcap, softcap);
  let largest = 0;
  for (const [i, ref] of rows.entries()) {
    const steps = events.filter((e) => e.event === 'step' && e.step.row.head === ref.head &&
                                       e.step.row.row === ref.row).map((e) => e.step);
    assert.equal(steps.length, Math.floor(ref.row / 4) + 1, `row ${ref.row} steps`);
    const kh = Math.floor(ref.head / (dims.heads / dims.kvHeads));
    for (const s of steps) {
      assert.equal(s.scaledScores.length, s.keyEnd - s.keyBegin, `row ${ref.row} scaledScores`);
      assert.equal(s.scores.length, s.keyEnd - s.keyBegin);
      s.scaledScores.forEach((scaled, j) => {
        const t = s.keyBegin + j, what = `row ${ref.row} key ${t}`;
        // scale · q·k (masked keys included) within fp32 dot-product rounding.
        let dot = 0, magnitude = 0;
        for (let c = 0; c < dims.headDim; ++c) {
          const product = problem.q[(ref.head * dims.queryLen + ref.row) * dims.headDim + c] *
                          problem.k[(kh * dims.keyLen + t) * dims.headDim + c];
          dot += product;
          magnitude += Math.abs(product);
        }
        assert.ok(Number.isFinite(scaled), `${what}: scaled ${scaled}`);
        assert.ok(Math.abs(scaled - scale * dot) <= (dims.headDim + 2) * 2 ** -24 * scale *
                  magnitude, `${what}: scaled ${scaled}, wanted ${scale * dot}`);
        largest = Math.max(largest, Math.abs(scaled));
        // The score: −inf where the mask hides the key, else the cap of the scaled score
        // within float32 rounding.
        const score = s.scores[j];
        if (t > ref.row) {
          assert.equal(score, -Infinity, `${what}: masked`);
          return;
        }
        const capped = softcap * Math.tanh(scaled / softcap);
        assert.ok(Math.abs(score - capped) <= 4 * f32Ulp(capped),
                  `${what}: score ${score}, wanted ${capped}`);
        assert.ok(Math.abs(score) <= softcap, `${what}: |${score}| > the cap`);
      });
    }
    const at = (ref.head * dims.queryLen + ref.row) * dims.valueDim;
    const done = events.filter((e) => e.event === 'rowDone')[i].rowDone;
    assertClose(done.output, tiled.subarray(at, at + dims.valueDim), 1e-6, `row ${ref.row}`);
  }
  assert.ok(largest > 2 * softcap, `the cap bites: largest scaled score ${largest}`);
  // Without one: start.softcap 0 and no scaledScores.
  const plain = await collect(client.trace({attention: request(problem, {causal: true}), rows}));
  assert.equal(plain[0].start.softcap, 0);
  for (const e of plain.filter((e) => e.event === 'step')) {
    assert.deepEqual(e.step.scaledScores, []);
  }
});

test('softcap: Cache.decode against float64; bad softcaps are INVALID_ARGUMENT naming it',
     async () => {
  const random = mulberry32(positionsSeed + 8);
  const [kvHeads, heads, headDim, valueDim, nq] = [2, 4, 7, 5, 3];
  const held = new HeldTokens(kvHeads, headDim, valueDim);
  const cache = await client.openCache({kvHeads, headDim, valueDim});
  try {
    await cache.append(...held.tokens(16, random));
    const q = randomNormal(heads * nq * headDim, random).map((x) => 32 * x);
    const query = tensor(q, [heads, nq, headDim]);
    const [k1, v1] = held.tokens(1, random);
    const step = await cache.decode(query, {key: k1, value: v1,
                                            options: {causal: true, softcap: 5, returnLse: true}});
    assert.equal(cache.length, 17);
    const dims = {batch: 1, heads, kvHeads, queryLen: nq, keyLen: 17, headDim, valueDim};
    const ref = referenceAttention({q, k: Float32Array.from(held.keys.flat()),
                                    v: Float32Array.from(held.values.flat()), dims},
                                   1 / Math.sqrt(headDim), true, {softcap: 5});
    assertClose(toFloat32Array(step.output), ref.out, softcapTol(5), 'softcapped Cache.decode');
    assertClose(toFloat32Array(step.lse), ref.lse, softcapTol(5), 'softcapped Cache.decode lse');
    await assert.rejects(cache.decode(query, {key: k1, value: v1, options: {softcap: -1}}),
                         (err) => {
      assert.equal(err.code, status.INVALID_ARGUMENT, err.message);
      assert.match(err.details, /options\.softcap/);
      return true;
    });
    assert.equal((await cache.refresh()).length, 17, 'a refused decode appends nothing');
  } finally {
    await cache.delete();
  }
  for (const softcap of [-1, NaN, Infinity]) {
    const req = request(seed, {causal: true, softcap});
    for (const call of [() => client.tiled(req), () => client.naive(req),
                        () => collect(client.trace({attention: req}))]) {
      await assert.rejects(call(), (err) => {
        assert.equal(err.code, status.INVALID_ARGUMENT, `softcap ${softcap}: ${err.message}`);
        assert.match(err.details, /options\.softcap/);
        return true;
      });
    }
  }
});

// --- ALiBi --------------------------------------------------------------------------------------
// The fp32 tolerance at scores up to scoreMax (attnd_harness.fp32_rtol's rule, as softcapTol).
const alibiTol = (scoreMax) => 1e-5 * Math.max(1, scoreMax / 8);
// n random slopes in [0.05, 1), as the float32 values the server gets.
const randomSlopes = (n, random) =>
  Array.from({length: n}, () => Math.fround(0.05 + 0.95 * random()));

test('alibi: tiled and naive against float64, passed through as options', async () => {
  const random = mulberry32(positionsSeed + 9);
  // Odd sizes, GQA, valueDim ≠ headDim, queryLen < keyLen (bottom-right: query row i at
  // 6 + i), block_k 4.
  const dims = {batch: 2, heads: 4, kvHeads: 2, queryLen: 11, keyLen: 17, headDim: 7, valueDim: 5};
  const problem = randomProblem(dims, random);
  const scale = 1 / Math.sqrt(dims.headDim);
  const cases = [
    {causal: true, alibiSlopes: attnd.standardAlibiSlopes(4)},
    {causal: true, alibiSlopes: randomSlopes(4, random)},
    {causal: false, alibiSlopes: [0.5, 0, 0.9, Math.fround(0.3)]},  // A zero slope: no bias.
    // At positions, not causal: keys at 90 … 106 on both sides of the queries' 100 … 110.
    {causal: false, keyPosition: 90, queryPosition: 100, alibiSlopes: randomSlopes(4, random)},
    // With a softcap and a causal window: cap, then bias, then mask.
    {causal: true, softcap: 2, windowLeft: 6, alibiSlopes: randomSlopes(4, random)},
  ];
  for (const options of cases) {
    const what = JSON.stringify(options);
    const ref = referenceAttention(problem, scale, options.causal, options);
    const plain = referenceAttention(problem, scale, options.causal, {...options, alibiSlopes: []});
    assert.ok(ref.out.some((x, i) => Math.abs(x - plain.out[i]) > 1e-2), `${what} matters`);
    for (const method of ['tiled', 'naive']) {
      const res = await client[method](request(problem, {...options, blockK: 4, returnLse: true}));
      const tol = alibiTol(ref.scoreMax);
      assertClose(toFloat32Array(res.output), ref.out, tol, `${method} ${what}`);
      assertClose(toFloat32Array(res.lse), ref.lse, tol, `${method} ${what} lse`);
    }
  }
  // Empty slopes are no bias: the plain answer, exactly.
  const plain = toFloat32Array((await client.tiled(request(problem, {causal: true}))).output);
  const empty = await client.tiled(request(problem, {causal: true, alibiSlopes: []}));
  assert.deepEqual(toFloat32Array(empty.output), plain);
});

test('alibi: standardAlibiSlopes values; Trace\'s start repeats them', async () => {
  const {standardAlibiSlopes} = attnd;
  const eight = standardAlibiSlopes(8);
  assert.ok(Array.isArray(eight));
  assert.equal(eight.length, 8);
  assert.equal(eight[0], 0.5);
  assert.equal(eight.at(-1), 2 ** -8);
  assert.deepEqual(eight, Array.from({length: 8}, (_, h) => 2 ** -(h + 1)));
  assert.deepEqual(standardAlibiSlopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]);
  assert.deepEqual(standardAlibiSlopes(1), [2 ** -8]);
  assert.deepEqual(standardAlibiSlopes(2), [2 ** -4, 2 ** -8]);
  assert.deepEqual(standardAlibiSlopes(0), []);
  // 12 heads: the 8 of n = 8, then 2^(−8(2i+1)/16) for i = 0 … 3, as float32 values.
  const twelve = standardAlibiSlopes(12);
  assert.deepEqual(twelve.slice(0, 8), eight);
  assert.deepEqual(twelve.slice(8), [0, 1, 2, 3].map((i) => Math.fround(2 ** (-(2 * i + 1) / 2))));
  // 16 heads: 2^(−(h+1)/2), float32 values.
  assert.deepEqual(standardAlibiSlopes(16),
                   Array.from({length: 16}, (_, h) => Math.fround(2 ** (-(h + 1) / 2))));
  assert.throws(() => standardAlibiSlopes(2.5), TypeError);
  assert.throws(() => standardAlibiSlopes('8'), TypeError);
  assert.throws(() => standardAlibiSlopes(-1), RangeError);
  // What is sent comes back unchanged (they are float32 values already).
  const random = mulberry32(positionsSeed + 10);
  const dims = {batch: 1, heads: 6, kvHeads: 3, queryLen: 5, keyLen: 7, headDim: 4, valueDim: 4};
  const alibiSlopes = standardAlibiSlopes(6);
  const events = await collect(client.trace({
    attention: request(randomProblem(dims, random), {alibiSlopes}), rows: [{head: 5, row: 4}]}));
  assert.equal(events[0].event, 'start');
  assert.deepEqual(events[0].start.alibiSlopes, alibiSlopes);
});

test('alibi: Trace\'s steps carry biases −slope·|p − t| and scaledScores before them', async () => {
  const random = mulberry32(positionsSeed + 11);
  // queryLen 11 < keyLen 17: bottom-right, query row r is at p = 6 + r.
  const dims = {batch: 1, heads: 4, kvHeads: 2, queryLen: 11, keyLen: 17, headDim: 7, valueDim: 5};
  const problem = randomProblem(dims, random);
  const [blockK, offset] = [5, dims.keyLen - dims.queryLen];
  const alibiSlopes = [0.5, 0.25, 1, Math.fround(0.3)];
  const scale = 1 / Math.sqrt(dims.headDim);
  const rows = [{batch: 0, head: 0, row: 10}, {batch: 0, head: 3, row: 2},
                {batch: 0, head: 1, row: 5}, {batch: 0, head: 2, row: 0}];
  for (const softcap of [0, 2]) {
    const options = {causal: true, softcap, alibiSlopes, blockK};
    const tiled = toFloat32Array((await client.tiled(request(problem, options))).output);
    const events = await collect(client.trace({attention: request(problem, options), rows}));
    assert.deepEqual(events[0].start.alibiSlopes, alibiSlopes);
    assert.equal(events[0].start.softcap, softcap);
    for (const [i, ref] of rows.entries()) {
      const p = offset + ref.row, slope = alibiSlopes[ref.head];
      const steps = events.filter((e) => e.event === 'step' && e.step.row.head === ref.head &&
                                         e.step.row.row === ref.row).map((e) => e.step);
      assert.deepEqual(steps.map((s) => s.tile),
                       Array.from({length: Math.floor(p / blockK) + 1}, (_, t) => t),
                       `softcap ${softcap} row ${ref.row} tiles`);
      const kh = Math.floor(ref.head / (dims.heads / dims.kvHeads));
      for (const s of steps) {
        const n = s.keyEnd - s.keyBegin;
        assert.equal(s.biases.length, n, `row ${ref.row} biases`);
        assert.equal(s.scaledScores.length, n, `row ${ref.row} scaledScores`);
        assert.equal(s.scores.length, n);
        for (let j = 0; j < n; ++j) {
          const t = s.keyBegin + j, what = `softcap ${softcap} row ${ref.row} key ${t}`;
          // The bias, masked keys included: −slope · |p − t| in fp32 (one rounding of the
          // product of the fp32 slope and an exact distance).
          const bias = s.biases[j];
          assert.equal(bias, Math.fround(-slope * Math.abs(p - t)), `${what}: bias`);
          // scaledScores: scale · q·k, before softcap and bias, within fp32 dot rounding.
          let dot = 0, magnitude = 0;
          for (let c = 0; c < dims.headDim; ++c) {
            const product = problem.q[(ref.head * dims.queryLen + ref.row) * dims.headDim + c] *
                            problem.k[(kh * dims.keyLen + t) * dims.headDim + c];
            dot += product;
            magnitude += Math.abs(product);
          }
          const scaled = s.scaledScores[j];
          assert.ok(Math.abs(scaled - scale * dot) <= (dims.headDim + 2) * 2 ** -24 * scale *
                    magnitude + 1e-30, `${what}: scaled ${scaled}, wanted ${scale * dot}`);
          // scores: softcap(scaled) + bias, −inf where the causal mask hides the key.
          const score = s.scores[j];
          if (t > p) {
            assert.equal(score, -Infinity, `${what}: masked`);
            continue;
          }
          const capped = softcap ? softcap * Math.tanh(scaled / softcap) : scaled;
          const size = Math.abs(capped) + Math.abs(bias);
          assert.ok(Math.abs(score - (capped + bias)) <= 4 * f32Ulp(size) + 1e-30,
                    `${what}: score ${score}, wanted ${capped + bias}`);
        }
      }
      const at = (ref.head * dims.queryLen + ref.row) * dims.valueDim;
      const done = events.filter((e) => e.event === 'rowDone')[i].rowDone;
      assertClose(done.output, tiled.subarray(at, at + dims.valueDim), 1e-6, `row ${ref.row}`);
    }
  }
  // Without slopes: start.alibiSlopes [] and no biases (nor scaledScores).
  const plain = await collect(client.trace({attention: request(problem, {causal: true}), rows}));
  assert.deepEqual(plain[0].start.alibiSlopes, []);
  for (const e of plain.filter((e) => e.event === 'step')) {
    assert.deepEqual(e.step.biases, []);
    assert.deepEqual(e.step.scaledScores, []);
  }
});

test('alibi: Cache.decode against float64; bad slopes are INVALID_ARGUMENT naming them',
     async () => {
  const random = mulberry32(positionsSeed + 12);
  const [kvHeads, heads, headDim, valueDim, nq] = [2, 4, 7, 5, 3];
  const held = new HeldTokens(kvHeads, headDim, valueDim);
  const alibiSlopes = randomSlopes(heads, random);
  const cache = await client.openCache({kvHeads, headDim, valueDim});
  try {
    await cache.append(...held.tokens(16, random));
    const q = randomNormal(heads * nq * headDim, random);
    const query = tensor(q, [heads, nq, headDim]);
    const [k1, v1] = held.tokens(1, random);
    const step = await cache.decode(query, {key: k1, value: v1,
                                            options: {causal: true, alibiSlopes, returnLse: true}});
    assert.equal(cache.length, 17);
    const dims = {batch: 1, heads, kvHeads, queryLen: nq, keyLen: 17, headDim, valueDim};
    const ref = referenceAttention({q, k: Float32Array.from(held.keys.flat()),
                                    v: Float32Array.from(held.values.flat()), dims},
                                   1 / Math.sqrt(headDim), true, {alibiSlopes});
    assertClose(toFloat32Array(step.output), ref.out, alibiTol(ref.scoreMax), 'ALiBi Cache.decode');
    assertClose(toFloat32Array(step.lse), ref.lse, alibiTol(ref.scoreMax),
                'ALiBi Cache.decode lse');
    await assert.rejects(cache.decode(query, {key: k1, value: v1,
                                              options: {alibiSlopes: alibiSlopes.slice(1)}}),
                         (err) => {
      assert.equal(err.code, status.INVALID_ARGUMENT, err.message);
      assert.match(err.details, /options\.alibi_slopes\b(?!\[)/);
      return true;
    });
    assert.equal((await cache.refresh()).length, 17, 'a refused decode appends nothing');
  } finally {
    await cache.delete();
  }
  // The seed has one query head: two slopes (or none but a NaN) are refused; a 4-head problem
  // with a non-finite second slope names it.
  const four = randomProblem({batch: 1, heads: 4, kvHeads: 2, queryLen: 3, keyLen: 5, headDim: 4,
                              valueDim: 4}, random);
  for (const [problem, alibiSlopes, pattern] of [
    [seed, [0.5, 0.25], /options\.alibi_slopes\b(?!\[)/],
    [four, [0.5, 0.25, 0.125], /options\.alibi_slopes\b(?!\[)/],
    [four, [0.5, 0.25, 0.125, 0.0625, 0.03125], /options\.alibi_slopes\b(?!\[)/],
    [seed, [NaN], /options\.alibi_slopes\[0\]/],
    [four, [0.5, Infinity, 0.125, 0.0625], /options\.alibi_slopes\[1\]/],
    [four, [0.5, 0.25, 0.125, -Infinity], /options\.alibi_slopes\[3\]/],
  ]) {
    const req = request(problem, {causal: true, alibiSlopes});
    for (const call of [() => client.tiled(req), () => client.naive(req),
                        () => collect(client.trace({attention: req}))]) {
      await assert.rejects(call(), (err) => {
        assert.equal(err.code, status.INVALID_ARGUMENT, `slopes ${alibiSlopes}: ${err.message}`);
        assert.match(err.details, pattern);
        return true;
      });
    }
  }
});

// --- ragged batches -----------------------------------------------------------------------------
// The float64 reference of a ragged batch: problem (batch 1, queryLen totalQ, keyLen totalK)
// split by cumulative lengths cuQ and cuK, each sequence its own referenceAttention problem
// (its keys at 0 …, its queries bottom-right: the default positions; options as there), the
// answers put back in the packed rows. Rows of an empty sequence do not exist; a sequence with
// queries but no key it sees gives zeros and lse −inf, as referenceAttention does.
function raggedReference(problem, cuQ, cuK, scale, causal, options = {}) {
  const {heads, queryLen, headDim, valueDim} = problem.dims;
  const out = new Float64Array(heads * queryLen * valueDim);
  const lse = new Float64Array(heads * queryLen).fill(-Infinity);
  let scoreMax = 0;
  for (let s = 0; s + 1 < cuQ.length; ++s) {
    const [a, b] = [cuQ[s], cuQ[s + 1]], n = b - a;
    const keys = sliceKeys(problem, cuK[s], cuK[s + 1]);
    const q = new Float32Array(heads * n * headDim);
    for (let h = 0; h < heads; ++h) {
      q.set(problem.q.subarray((h * queryLen + a) * headDim, (h * queryLen + b) * headDim),
            h * n * headDim);
    }
    const ref = referenceAttention({...keys, q, dims: {...keys.dims, queryLen: n}}, scale, causal,
                                   options);
    for (let h = 0; h < heads; ++h) {
      out.set(ref.out.subarray(h * n * valueDim, (h + 1) * n * valueDim),
              (h * queryLen + a) * valueDim);
      lse.set(ref.lse.subarray(h * n, (h + 1) * n), h * queryLen + a);
    }
    scoreMax = Math.max(scoreMax, ref.scoreMax);
  }
  return {out, lse, scoreMax};
}

// A packed problem of the given sequence lengths: {problem (batch 1), cuQ, cuK, and req(options),
// the rank-3 AttentionRequest with cuSeqlensQ / cuSeqlensK}.
function raggedProblem(queryLengths, keyLengths, {heads, kvHeads, headDim, valueDim}, random) {
  const cuQ = attnd.cumulativeLengths(queryLengths), cuK = attnd.cumulativeLengths(keyLengths);
  const dims = {batch: 1, heads, kvHeads, queryLen: cuQ.at(-1), keyLen: cuK.at(-1), headDim,
                valueDim};
  const problem = randomProblem(dims, random);
  const req = (options) => ({
    query: tensor(problem.q, [heads, dims.queryLen, headDim]),
    key: tensor(problem.k, [kvHeads, dims.keyLen, headDim]),
    value: tensor(problem.v, [kvHeads, dims.keyLen, valueDim]),
    cuSeqlensQ: cuQ, cuSeqlensK: cuK, options,
  });
  return {problem, cuQ, cuK, req};
}

test('ragged: tiled and naive against float64 run per sequence, causal, GQA, odd sizes',
     async () => {
  const random = mulberry32(positionsSeed + 13);
  // q lengths [5, 1, 40] over k lengths [7, 1, 33]: 46 rows over 41 keys; sequence 2's rows
  // 0 … 6 (packed 6 … 12) see no key when causal (40 queries bottom-right over 33 keys).
  const sizes = {heads: 4, kvHeads: 2, headDim: 7, valueDim: 5};
  const {problem, cuQ, cuK, req} = raggedProblem([5, 1, 40], [7, 1, 33], sizes, random);
  assert.deepEqual([cuQ, cuK], [[0, 5, 6, 46], [0, 7, 8, 41]]);
  const scale = 1 / Math.sqrt(sizes.headDim);
  const cases = [
    {causal: true},
    // Per-sequence positions: ALiBi's |p − t| and the window are each sequence's own.
    {causal: true, windowLeft: 3, alibiSlopes: randomSlopes(4, random)},
    {causal: false, softcap: 2, alibiSlopes: attnd.standardAlibiSlopes(4)},
  ];
  for (const options of cases) {
    const what = JSON.stringify(options);
    const ref = raggedReference(problem, cuQ, cuK, scale, options.causal, options);
    const packed = referenceAttention(problem, scale, options.causal, options);
    assert.ok(ref.out.some((x, i) => Math.abs(x - packed.out[i]) > 1e-2),
              `${what}: the sequences matter`);
    if (options.causal && !options.windowLeft) {
      for (let h = 0; h < sizes.heads; ++h) {
        for (let r = 0; r < 46; ++r) {
          assert.equal(ref.lse[h * 46 + r] === -Infinity, r >= 6 && r < 13, `${what} row ${r}`);
        }
      }
    }
    for (const method of ['tiled', 'naive']) {
      const res = await client[method](req({...options, blockK: 4, returnLse: true}));
      assert.deepEqual(res.output.shape, [4, 46, 5], `${method} ${what} output shape`);
      assert.deepEqual(res.lse.shape, [4, 46], `${method} ${what} lse shape`);
      const tol = alibiTol(ref.scoreMax);
      assertClose(toFloat32Array(res.output), ref.out, tol, `${method} ${what}`);
      assertClose(toFloat32Array(res.lse), ref.lse, tol, `${method} ${what} lse`);
    }
  }
  // Empty sequences: one with queries but no keys (zeros, lse −inf), one with keys but no
  // queries, and a one-sequence batch equal to the plain request.
  const empty = raggedProblem([3, 0, 4], [0, 6, 5], sizes, random);
  const emptyRef = raggedReference(empty.problem, empty.cuQ, empty.cuK, scale, true);
  for (const method of ['tiled', 'naive']) {
    const res = await client[method](empty.req({causal: true, blockK: 4, returnLse: true}));
    assertClose(toFloat32Array(res.output), emptyRef.out, 1e-5, `${method} empty sequences`);
    assertClose(toFloat32Array(res.lse), emptyRef.lse, 1e-5, `${method} empty sequences lse`);
  }
  const one = raggedProblem([6], [9], sizes, random);
  const plainReq = {...one.req({causal: true}), cuSeqlensQ: undefined, cuSeqlensK: null};
  assertClose(toFloat32Array((await client.tiled(one.req({causal: true}))).output),
              toFloat32Array((await client.tiled(plainReq)).output), 1e-6, 'one sequence');
});

test('ragged: Trace\'s start repeats the lengths; other sequences\' keys are HIDDEN_SEQUENCE',
     async () => {
  const random = mulberry32(positionsSeed + 14);
  const sizes = {heads: 4, kvHeads: 2, headDim: 7, valueDim: 5};
  const {problem, cuQ, cuK, req} = raggedProblem([5, 1, 40], [7, 1, 33], sizes, random);
  // block_k 5: tile [5, 10) holds keys of all three sequences.
  const options = {causal: true, blockK: 5};
  const tiled = toFloat32Array((await client.tiled(req(options))).output);
  const ref = raggedReference(problem, cuQ, cuK, 1 / Math.sqrt(sizes.headDim), true);
  // Sequence 0's last row, sequence 1's only row, sequence 2's last row and its row 3 (no key).
  const rows = [{head: 0, row: 4}, {head: 1, row: 5}, {head: 3, row: 45}, {head: 2, row: 9}];
  const events = await collect(client.trace({attention: req(options), rows}));
  const {start} = events[0];
  assert.equal(events[0].event, 'start');
  assert.deepEqual(start.cuSeqlensQ, [0, 5, 6, 46]);
  assert.deepEqual(start.cuSeqlensK, [0, 7, 8, 41]);
  for (const lengths of [start.cuSeqlensQ, start.cuSeqlensK]) {
    assert.ok(Array.isArray(lengths) && lengths.every((x) => typeof x === 'number'), 'Numbers');
  }
  assert.deepEqual([start.queryLen, start.keyLen, start.keyPosition, start.queryPosition],
                   [46, 41, 0, 0]);
  const done = events.filter((e) => e.event === 'rowDone').map((e) => e.rowDone);
  let others = 0;
  for (const [i, {head, row}] of rows.entries()) {
    const s = cuQ.findLastIndex((c, j) => j < cuQ.length - 1 && c <= row);
    const [kBegin, kEnd] = [cuK[s], cuK[s + 1]];
    const steps = events.filter((e) => e.event === 'step' && e.step.row.head === head &&
                                       e.step.row.row === row).map((e) => e.step);
    for (const st of steps) {
      st.scores.forEach((score, j) => {
        const t = st.keyBegin + j, what = `row ${row} key ${t}`;
        if (t < kBegin || t >= kEnd) {
          assert.equal(st.hidden[j], 'HIDDEN_SEQUENCE', `${what}: hidden`);
          assert.equal(score, -Infinity, `${what}: score`);
          ++others;
        } else {
          assert.notEqual(st.hidden[j], 'HIDDEN_SEQUENCE', `${what}: own key`);
        }
      });
    }
    const at = (head * 46 + row) * sizes.valueDim;
    assertClose(done[i].output, tiled.subarray(at, at + sizes.valueDim), 1e-6, `row ${row}`);
    assertClose(done[i].output, ref.out.subarray(at, at + sizes.valueDim), 1e-5,
                `row ${row} vs float64`);
  }
  assert.ok(others > 0, 'some traced tile holds another sequence\'s keys');
  assert.equal(done[3].lse, -Infinity, 'sequence 2 row 3 sees no key');
  // One sequence: [] for both.
  const plain = await collect(client.trace({attention: request(seed, {blockK: 2})}));
  assert.deepEqual([plain[0].start.cuSeqlensQ, plain[0].start.cuSeqlensK], [[], []]);
});

test('ragged: bad cumulative lengths are INVALID_ARGUMENT naming cu_seqlens_q[i] and others',
     async () => {
  // The seed: 8 query rows over 8 keys, batch 1.
  for (const [cuSeqlensQ, cuSeqlensK, pattern, extra = {}] of [
    [[0, 5, 4, 8], [0, 2, 6, 8], /cu_seqlens_q\[2\]/],  // Decreasing.
    [[1, 5, 8], [0, 2, 8], /cu_seqlens_q\[0\]/],        // Not starting at 0.
    [[0, 5, 7], [0, 2, 8], /cu_seqlens_q\[2\]/],        // Not ending at query_len (8).
    [[0, 5, 8], [0, 2, 9], /cu_seqlens_k\[2\]/],        // Not ending at key_len (8).
    [[0, 5, 8], [0, 8], /cu_seqlens_k(?!\[)/],           // Counts differ.
    [[0, 5, 8], [], /cu_seqlens_k(?!\[)/],               // One without the other.
    [[0, 5, 8], [0, 2, 8], /options\.key_position/, {keyPosition: 3}],
  ]) {
    const what = JSON.stringify({cuSeqlensQ, cuSeqlensK, ...extra});
    const req = {...request(seed, {causal: true, ...extra}), cuSeqlensQ, cuSeqlensK};
    for (const call of [() => client.tiled(req), () => client.naive(req),
                        () => collect(client.trace({attention: req}))]) {
      await assert.rejects(call(), (err) => {
        assert.equal(err.code, status.INVALID_ARGUMENT, `${what}: ${err.message}`);
        assert.match(err.details, pattern, what);
        return true;
      });
    }
  }
  // Batch 2 (rank 4): query.shape[0].
  const batched = {...request(problem, {causal: true}), cuSeqlensQ: [0, 41], cuSeqlensK: [0, 29]};
  await assert.rejects(client.tiled(batched), (err) => err.code === status.INVALID_ARGUMENT &&
                                                       /query\.shape\[0\]/.test(err.details));
});

test('ragged: cumulativeLengths; non-integer lengths are TypeErrors before any call', async () => {
  const {cumulativeLengths} = attnd;
  assert.deepEqual(cumulativeLengths([5, 1, 40]), [0, 5, 6, 46]);
  assert.deepEqual(cumulativeLengths([0, 3, 0]), [0, 0, 3, 3]);
  assert.deepEqual(cumulativeLengths(Int32Array.from([2, 2])), [0, 2, 4]);
  assert.deepEqual(cumulativeLengths([]), [0]);
  assert.throws(() => cumulativeLengths([1, 2.5]), TypeError);
  assert.throws(() => cumulativeLengths(['3']), TypeError);
  assert.throws(() => cumulativeLengths(5), TypeError);
  assert.throws(() => cumulativeLengths([4, -1]), RangeError);
  const good = {...request(seed, {}), cuSeqlensQ: [0, 8], cuSeqlensK: [0, 8]};
  for (const [field, value, pattern] of [['cuSeqlensQ', [0, 1.5, 8], /cuSeqlensQ\[1\]/],
                                         ['cuSeqlensK', [0, '8'], /cuSeqlensK\[1\]/],
                                         ['cuSeqlensK', Int32Array.from([0, 8]), /cuSeqlensK/]]) {
    const bad = {...good, [field]: value};
    for (const call of [() => client.tiled(bad), () => client.naive(bad),
                        () => collect(client.trace({attention: bad}))]) {
      await assert.rejects(call(), (err) => err instanceof TypeError && pattern.test(err.message));
    }
  }
});

// --- attention sinks ----------------------------------------------------------------------------
// n random sinks in [lo, hi), as the float32 values the server gets. The default range keeps
// each sink's share of a row of a few dozen keys large enough for `differs` to see it.
const randomSinks = (n, random, lo = -1, hi = 3) =>
  Array.from({length: n}, () => Math.fround(lo + (hi - lo) * random()));
// Whether a and b differ by more than `by` somewhere (an option changes the answer; 100 times
// the tolerance of the comparisons it guards).
const differs = (a, b, by = 1e-3) => a.some((x, i) => Math.abs(x - b[i]) > by);

test('sinks: tiled and naive (with lse) against float64, GQA, causal, odd sizes', async () => {
  const random = mulberry32(positionsSeed + 15);
  // 5 query rows over 37 keys (block_k 4: a last tile of one key), headDim 7, valueDim 5; 3 query
  // heads over 1 kv head, and 2 batches of 6 query heads over 3 kv heads.
  for (const [heads, kvHeads, batch] of [[3, 1, 1], [6, 3, 2]]) {
    const dims = {batch, heads, kvHeads, queryLen: 5, keyLen: 37, headDim: 7, valueDim: 5};
    const problem = randomProblem(dims, random);
    const scale = 1 / Math.sqrt(dims.headDim);
    const rows = batch * heads * dims.queryLen;
    const cases = [
      {causal: true, sinks: randomSinks(heads, random)},
      // A sink far above the scores (it takes nearly all the weight), one far below (none).
      {causal: true, sinks: [6, -30, 0, 3.5, -1, 2].slice(0, heads)},
      // At positions: query rows at 8 … 12 over keys at 10 … 46, so rows 0 and 1 see no key:
      // zeros and lse = the sink.
      {causal: true, keyPosition: 10, queryPosition: 8, sinks: randomSinks(heads, random)},
      // The sink is not scaled, capped, biased or masked: a scale, a softcap below the sinks,
      // ALiBi and a window around it.
      {causal: true, scale: 0.3, softcap: 2, windowLeft: 6,
       alibiSlopes: randomSlopes(heads, random), sinks: randomSinks(heads, random, 2.5, 5)},
      // Not causal, a window on both sides.
      {causal: false, windowLeft: 3, windowRight: 4, sinks: randomSinks(heads, random)},
    ];
    for (const options of cases) {
      const what = `${heads}/${kvHeads} heads ${JSON.stringify(options)}`;
      const ref = referenceAttention(problem, options.scale ?? scale, options.causal, options);
      const plain = referenceAttention(problem, options.scale ?? scale, options.causal,
                                       {...options, sinks: []});
      assert.ok(differs(ref.out, plain.out), `${what}: the sinks matter`);
      for (const method of ['tiled', 'naive']) {
        const res = await client[method](request(problem, {...options, blockK: 4,
                                                           returnLse: true}));
        assert.deepEqual(res.lse.shape, [batch, heads, dims.queryLen]);
        const out = toFloat32Array(res.output), lse = toFloat32Array(res.lse);
        assertClose(out, ref.out, 1e-5, `${method} ${what}`);
        assertClose(lse, ref.lse, 1e-5, `${method} ${what} lse`);
        if (options.keyPosition !== 10) continue;
        for (let r = 0; r < rows; ++r) {  // Rows 0 and 1 of every head see no key.
          if (r % dims.queryLen >= 2) continue;
          const h = Math.floor(r / dims.queryLen) % heads;
          assert.equal(lse[r], options.sinks[h], `${method} ${what}: row ${r} lse = its sink`);
          assert.deepEqual(Array.from(out.subarray(r * 5, r * 5 + 5)), [0, 0, 0, 0, 0],
                           `${method} ${what}: row ${r} zeros`);
        }
      }
    }
    // Empty sinks are none: the plain answer, exactly.
    const none = toFloat32Array((await client.tiled(request(problem, {causal: true}))).output);
    const empty = await client.tiled(request(problem, {causal: true, sinks: []}));
    assert.deepEqual(toFloat32Array(empty.output), none);
  }
});

test('sinks: key slices, the first with the sinks, merged by mergeStates equal the unsplit answer',
     async () => {
  const random = mulberry32(positionsSeed + 16);
  const dims = {batch: 1, heads: 3, kvHeads: 1, queryLen: 5, keyLen: 37, headDim: 7, valueDim: 5};
  const problem = randomProblem(dims, random);
  const scale = 1 / Math.sqrt(dims.headDim);
  const sinks = randomSinks(dims.heads, random, 0, 2);
  const rows = dims.heads * dims.queryLen;
  // Queries at 32 … 36 over keys [0, 16) and [16, 37). With windowLeft 10 no row sees a key of
  // the first slice: its part is zeros with lse = the sink, which still weighs in the merge.
  for (const extra of [{}, {windowLeft: 10}]) {
    const options = {causal: true, returnLse: true, outputDtype: 'DTYPE_FLOAT32', blockK: 4,
                     ...extra};
    const what = JSON.stringify(extra);
    const whole = referenceAttention(problem, scale, true, {...options, sinks});
    const unsplit = await client.tiled(request(problem, {...options, sinks}));
    assertClose(toFloat32Array(unsplit.output), whole.out, 1e-5, `unsplit ${what}`);
    assertClose(toFloat32Array(unsplit.lse), whole.lse, 1e-5, `unsplit ${what} lse`);
    for (const method of ['tiled', 'naive']) {
      const parts = [], doubled = [];
      for (const [a, b] of [[0, 16], [16, 37]]) {
        const slice = sliceKeys(problem, a, b);
        const at = {...options, keyPosition: a, queryPosition: 32};
        parts.push(await client[method](request(slice, a === 0 ? {...at, sinks} : at)));
        doubled.push(await client[method](request(slice, {...at, sinks})));
      }
      if (extra.windowLeft) {
        const [out, lse] = [toFloat32Array(parts[0].output), toFloat32Array(parts[0].lse)];
        for (let r = 0; r < rows; ++r) {
          assert.equal(lse[r], sinks[Math.floor(r / dims.queryLen)], `${method} part 0 row ${r}`);
        }
        assert.ok(out.every((x) => x === 0), `${method} part 0: zeros`);
      }
      const merged = attnd.mergeStates(parts);
      assert.deepEqual(merged.shape, unsplit.output.shape);
      assertClose(merged.output, whole.out, 1e-5, `merged ${method} ${what}`);
      assertClose(merged.lse, whole.lse, 1e-5, `merged ${method} ${what} lse`);
      assertClose(merged.output, toFloat32Array(unsplit.output), 1e-5,
                  `merged ${method} ${what} vs unsplit tiled`);
      // Both slices with the sinks count each sink twice: not the answer.
      assert.ok(differs(attnd.mergeStates(doubled).output, whole.out, 1e-3),
                `${method} ${what}: sinks on every slice count twice`);
    }
  }
});

test('sinks: a wrong count is INVALID_ARGUMENT naming options.sinks, a non-finite sink ' +
     'options.sinks[h]', async () => {
  const random = mulberry32(positionsSeed + 17);
  const four = randomProblem({batch: 1, heads: 4, kvHeads: 2, queryLen: 3, keyLen: 5, headDim: 4,
                              valueDim: 4}, random);
  for (const [problem, sinks, pattern] of [
    [seed, [0.5, 0.25], /options\.sinks\b(?!\[)/],
    [four, [0.5, 0.25, 0.125], /options\.sinks\b(?!\[)/],
    [four, [0, 0, 0, 0, 0], /options\.sinks\b(?!\[)/],
    [seed, [NaN], /options\.sinks\[0\]/],
    [four, [0.5, Infinity, 0.125, 0.0625], /options\.sinks\[1\]/],
    [four, [0.5, 0.25, 0.125, -Infinity], /options\.sinks\[3\]/],
    [four, [0, 0, 1e39, 0], /options\.sinks\[2\]/],  // Finite, but not in float32.
  ]) {
    const req = request(problem, {causal: true, sinks});
    for (const call of [() => client.tiled(req), () => client.naive(req),
                        () => collect(client.trace({attention: req}))]) {
      await assert.rejects(call(), (err) => {
        assert.equal(err.code, status.INVALID_ARGUMENT, `sinks ${sinks}: ${err.message}`);
        assert.match(err.details, pattern, `sinks ${sinks}`);
        return true;
      });
    }
  }
});

test('sinks: Trace\'s start repeats them (fp32); rowDone.sinkShare is e^(sink − lse)', async () => {
  const random = mulberry32(positionsSeed + 18);
  const dims = {batch: 1, heads: 3, kvHeads: 1, queryLen: 5, keyLen: 37, headDim: 7, valueDim: 5};
  const problem = randomProblem(dims, random);
  const scale = 1 / Math.sqrt(dims.headDim);
  const sinks = [0.1, -1.7, 2.3];  // Not float32 values: they travel rounded.
  const sent = sinks.map(Math.fround);
  assert.notDeepEqual(sent, sinks);
  const rows = [{head: 0, row: 4}, {head: 1, row: 0}, {head: 2, row: 2}, {head: 2, row: 1}];
  // Bottom-right (every row sees 33 … 37 keys), and query rows at 1 … 5 over keys at 3 … 39
  // (rows 0 and 1 see none, rows 2 … 4 one to three keys).
  for (const positions of [{}, {keyPosition: 3, queryPosition: 1}]) {
    const options = {causal: true, blockK: 8, ...positions};
    const what = JSON.stringify(positions);
    const ref = referenceAttention(problem, scale, true, {...options, sinks: sent});
    const keysOnly = referenceAttention(problem, scale, true, options);
    const tiled = toFloat32Array((await client.tiled(request(problem, {...options, sinks})))
                                     .output);
    const events = await collect(client.trace({attention: request(problem, {...options, sinks}),
                                               rows}));
    assert.equal(events[0].event, 'start');
    assert.deepEqual(events[0].start.sinks, sent, `${what}: start.sinks`);
    const done = events.filter((e) => e.event === 'rowDone').map((e) => e.rowDone);
    assert.equal(done.length, rows.length);
    for (const [i, {head, row}] of rows.entries()) {
      const at = head * dims.queryLen + row, span = [at * 5, at * 5 + 5];
      const rowWhat = `${what} head ${head} row ${row}`;
      const d = done[i];
      assertClose([d.lse], [ref.lse[at]], 1e-5, `${rowWhat}: lse`);
      assertClose(d.output, ref.out.subarray(...span), 1e-5, `${rowWhat}: output`);
      assertClose(d.reference, ref.out.subarray(...span), 1e-5, `${rowWhat}: reference`);
      assertClose(d.output, tiled.subarray(...span), 1e-6, `${rowWhat}: output vs tiled`);
      const share = Math.exp(sent[head] - ref.lse[at]);
      assertClose([d.sinkShare], [share], 1e-5, `${rowWhat}: sinkShare vs float64`);
      assertClose([d.sinkShare], [Math.exp(sent[head] - d.lse)], 1e-5,
                  `${rowWhat}: sinkShare vs its lse`);
      const steps = events.filter((e) => e.event === 'step' && e.step.row.head === head &&
                                         e.step.row.row === row).map((e) => e.step);
      if (keysOnly.lse[at] === -Infinity) {  // No key: the sink takes everything.
        assert.equal(d.lse, sent[head], `${rowWhat}: lse = the sink`);
        assert.deepEqual(d.output, [0, 0, 0, 0, 0], `${rowWhat}: zeros`);
        assert.equal(d.sinkShare, 1, `${rowWhat}: sinkShare`);
        continue;
      }
      assert.ok(d.sinkShare > 0 && d.sinkShare < 1, `${rowWhat}: sinkShare ${d.sinkShare}`);
      // Steps never include the sink: the last estimate is of the keys alone, and the row's
      // output is that estimate times the keys' share, 1 − sinkShare.
      const estimate = steps.at(-1).estimate;
      assertClose(estimate, keysOnly.out.subarray(...span), 1e-5, `${rowWhat}: last estimate`);
      assertClose(d.output, estimate.map((x) => x * (1 - d.sinkShare)), 1e-5,
                  `${rowWhat}: output = estimate · (1 − sinkShare)`);
    }
  }
  // Without sinks: start.sinks [] and every sinkShare 0.
  const plain = await collect(client.trace({attention: request(problem, {causal: true}), rows}));
  assert.deepEqual(plain[0].start.sinks, []);
  for (const e of plain.filter((x) => x.event === 'rowDone')) assert.equal(e.rowDone.sinkShare, 0);
});

test('sinks: Cache.decode, a batched decode and tiled over a cache against float64; bad sinks ' +
     'are INVALID_ARGUMENT naming them', async () => {
  const random = mulberry32(positionsSeed + 19);
  const [kvHeads, heads, headDim, valueDim, nq] = [1, 3, 7, 5, 2];
  const scale = 1 / Math.sqrt(headDim);
  const sinks = randomSinks(heads, random);
  const held = [new HeldTokens(kvHeads, headDim, valueDim), new HeldTokens(kvHeads, headDim,
                                                                           valueDim)];
  const caches = [await client.openCache({kvHeads, headDim, valueDim}),
                  await client.openCache({kvHeads, headDim, valueDim})];
  // The float64 reference for q [heads, nq, headDim] over cache i's held tokens.
  const reference = (i, q, options) => referenceAttention(
      {q, k: Float32Array.from(held[i].keys.flat()), v: Float32Array.from(held[i].values.flat()),
       dims: {batch: 1, heads, kvHeads, queryLen: nq, keyLen: held[i].length, headDim, valueDim}},
      scale, options.causal, options);
  try {
    await caches[0].append(...held[0].tokens(16, random));
    await caches[1].append(...held[1].tokens(9, random));
    const q = randomNormal(heads * nq * headDim, random);
    const query = tensor(q, [heads, nq, headDim]);
    // Cache.decode: one new token, then the query over all 17.
    const options = {causal: true, returnLse: true, sinks};
    const [k1, v1] = held[0].tokens(1, random);
    const step = await caches[0].decode(query, {key: k1, value: v1, options});
    assert.equal(caches[0].length, 17);
    const ref = reference(0, q, options);
    assert.ok(differs(ref.out, reference(0, q, {causal: true}).out), 'the sinks matter');
    assertClose(toFloat32Array(step.output), ref.out, 1e-5, 'Cache.decode');
    assertClose(toFloat32Array(step.lse), ref.lse, 1e-5, 'Cache.decode lse');
    // Tiled over the cache: the same answer.
    const tiled = await client.tiled({query, cacheId: caches[0].id,
                                      options: {...options, blockK: 4}});
    assertClose(toFloat32Array(tiled.output), ref.out, 1e-5, 'tiled over the cache');
    // A batch: the sinks are the batch's, each item's rows taking them once. Cache 1 gets a new
    // token; its query is another.
    const q2 = randomNormal(heads * nq * headDim, random);
    const [k2, v2] = held[1].tokens(1, random);
    const response = await client.decodeBatch(
        [{cache: caches[0], query}, {cache: caches[1], query: tensor(q2, [heads, nq, headDim]),
                                     key: k2, value: v2}], options);
    assert.deepEqual(caches.map((c) => c.length), [17, 10]);
    for (const [i, qi] of [q, q2].entries()) {
      const want = reference(i, qi, options);
      assertClose(toFloat32Array(response.outputs[i]), want.out, 1e-5, `batch item ${i}`);
      assertClose(toFloat32Array(response.lse[i]), want.lse, 1e-5, `batch item ${i} lse`);
    }
    // Bad sinks: refused, nothing appended.
    const [k3, v3] = new HeldTokens(kvHeads, headDim, valueDim).tokens(1, random);
    for (const [bad, pattern] of [[sinks.slice(1), /options\.sinks\b(?!\[)/],
                                  [[0, NaN, 0], /options\.sinks\[1\]/]]) {
      await assert.rejects(caches[0].decode(query, {key: k3, value: v3, options: {sinks: bad}}),
                           (err) => {
        assert.equal(err.code, status.INVALID_ARGUMENT, err.message);
        assert.match(err.details, pattern);
        return true;
      });
    }
    assert.equal((await caches[0].refresh()).length, 17, 'a refused decode appends nothing');
  } finally {
    for (const cache of caches) await cache.delete();
  }
});

test('sinks: ragged batches take them per sequence (an empty key sequence: lse = the sink)',
     async () => {
  const random = mulberry32(positionsSeed + 20);
  const sizes = {heads: 4, kvHeads: 2, headDim: 7, valueDim: 5};
  const scale = 1 / Math.sqrt(sizes.headDim);
  const sinks = randomSinks(sizes.heads, random);
  // Causal: sequence 2's rows 0 … 6 (packed 6 … 12) see no key; in the second batch
  // sequence 1 (packed rows 3 … 4) has no key at all.
  for (const [qLens, kLens, noKey] of [[[5, 1, 40], [7, 1, 33], [6, 13]],
                                       [[3, 2, 4], [4, 0, 6], [3, 5]]]) {
    const {problem, cuQ, cuK, req} = raggedProblem(qLens, kLens, sizes, random);
    const totalQ = cuQ.at(-1);
    for (const extra of [{}, {windowLeft: 3, alibiSlopes: randomSlopes(4, random)}]) {
      const options = {causal: true, sinks, ...extra};
      const what = `${JSON.stringify(qLens)} ${JSON.stringify(extra)}`;
      const ref = raggedReference(problem, cuQ, cuK, scale, true, options);
      assert.ok(differs(ref.out, raggedReference(problem, cuQ, cuK, scale, true,
                                                 {...options, sinks: []}).out),
                `${what}: the sinks matter`);
      for (const method of ['tiled', 'naive']) {
        const res = await client[method](req({...options, blockK: 4, returnLse: true}));
        const lse = toFloat32Array(res.lse);
        assertClose(toFloat32Array(res.output), ref.out, 1e-5, `${method} ${what}`);
        assertClose(lse, ref.lse, 1e-5, `${method} ${what} lse`);
        for (let h = 0; h < sizes.heads; ++h) {
          for (let r = noKey[0]; r < noKey[1]; ++r) {
            assert.equal(lse[h * totalQ + r], sinks[h], `${method} ${what} head ${h} row ${r}`);
          }
        }
      }
    }
  }
});

test('mergeStates alone: one part, unseen rows, stability, errors', () => {
  const output = Float32Array.from([1.5, -2, 0.25, 4, 0, 0]);
  const lse = Float32Array.from([0.5, 3, -Infinity]);
  const one = attnd.mergeStates([{output, lse}]);
  assert.deepEqual(one.output, output);
  assert.deepEqual(one.lse, lse);
  assert.deepEqual(one.shape, [3, 2]);
  // Row 2 no part saw (garbage outputs there): zeros and −inf. Row 1: only part 1 saw it.
  const merged = attnd.mergeStates([
    [Float32Array.from([1, 2, NaN, NaN, NaN, Infinity]), [1000, -Infinity, -Infinity]],
    [Float32Array.from([3, 6, 7, 8, 5, 5]), [1000 + Math.log(3), 2, -Infinity]]]);
  assertClose(merged.output, [2.5, 5, 7, 8, 0, 0], 1e-6, 'merged');
  assertClose(merged.lse, [1000 + Math.log(4), 2, -Infinity], 1e-7, 'merged lse');
  assert.ok(merged.output.every((x) => !Number.isNaN(x)));
  const tensors = attnd.mergeStates([{output: tensor(output, [1, 3, 2]),
                                      lse: tensor(lse, [1, 3])}]);
  assert.deepEqual(tensors.shape, [1, 3, 2]);
  assert.deepEqual(tensors.output, output);
  for (const [parts, pattern] of [
    [[], /at least one/],
    [[{output, lse}, {output: output.subarray(0, 4), lse: lse.subarray(0, 2)}], /parts\[1\]/],
    [[{output: output.subarray(0, 5), lse}], /parts\[0\] has 5 output values for 3 lse rows/],
    [[{output: tensor(output, [2, 3]), lse: tensor(lse, [3])}], /parts\[0\] output shape/],
    [[{output, lse: null}], /parts\[0\]\.lse is missing.*returnLse/],
    [[{output, lse: [0, NaN, 0]}], /parts\[0\]\.lse\[1\] is NaN/],
  ]) {
    assert.throws(() => attnd.mergeStates(parts), pattern);
  }
});

// --- persistent caches: crc32c, export / import, the replay tail, moved_to -------------------------
// These start attnd servers of their own (--attnd PATH; skipped without it): a plain one to
// import into, and for recovery A with --cache-dir and B on a copy of A's files.
const os = require('node:os');
const path = require('node:path');
const {spawn} = require('node:child_process');
const grpc = require('@grpc/grpc-js');
const {Cache, crc32c} = attnd;
const noAttnd = !args.attnd && 'no --attnd (the attnd binary these tests start)';
const scratch = fs.mkdtempSync(path.join(os.tmpdir(), 'attn-node-test-'));
const spawned = [];
process.on('exit', () => {  // Never leave one running (a failed or interrupted run).
  for (const server of spawned) server.kill();
});
test.after(async () => {
  if (peerServer) (await peerServer.catch(() => ({client: {close() {}}}))).client.close();
  for (const server of spawned) await server.stop();
  fs.rmSync(scratch, {recursive: true, force: true});
});

// Starts args.attnd on a free port with flags → {target, log(), waitFor(re), stop()}.
function startAttnd(name, flags = []) {
  const proc = spawn(args.attnd, ['--listen', '127.0.0.1:0', '--http-listen=', '--threads', '2',
                                  ...flags], {stdio: ['ignore', 'pipe', 'pipe']});
  let log = '';
  const waiters = [];
  const exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve({code, signal})));
  const server = {
    name, log: () => log,
    waitFor(re, ms = 15000) {
      return new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`attnd ${name}: no /${re.source}/ in ` +
                                                        `${ms} ms:\n${log}`)), ms);
        waiters.push({re, resolve: (m) => { clearTimeout(timer); resolve(m); }, reject});
        onData('');
      });
    },
    async stop() {
      if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGTERM');
      return exited;
    },
    kill() {
      if (proc.exitCode === null && proc.signalCode === null) proc.kill('SIGKILL');
    },
  };
  function onData(data) {
    log += data;
    for (const w of [...waiters]) {
      const match = w.re.exec(log);
      if (match) waiters.splice(waiters.indexOf(w), 1), w.resolve(match);
    }
  }
  proc.stdout.on('data', onData);
  proc.stderr.on('data', onData);
  exited.then(({code, signal}) => {
    for (const w of waiters.splice(0)) w.reject(new Error(`attnd ${name} exited (${code ?? signal}):\n${log}`));
  });
  spawned.push(server);
  return server.waitFor(/\(port (\d+)\)/).then((match) => {
    server.target = `127.0.0.1:${match[1]}`;
    return server;
  });
}

// One plain attnd (no --cache-dir) beside args.target, started on first use.
let peerServer = null;
async function peer() {
  peerServer ??= startAttnd('peer').then((server) => {
    server.client = new Client(server.target, {deadlineMs: 60000});
    return server;
  });
  return peerServer;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// n random tokens [key, value] in dtype: [kvHeads, n, dim], or [n, dim] when rank2.
function randomTokens(random, {kvHeads, headDim, valueDim, dtype = 'float32', rank2 = false}, n) {
  const shape = (dim) => (rank2 ? [n, dim] : [kvHeads, n, dim]);
  return [tensor(randomNormal(kvHeads * n * headDim, random), shape(headDim), dtype),
          tensor(randomNormal(kvHeads * n * valueDim, random), shape(valueDim), dtype)];
}

async function exportAll(someClient, cacheId) {
  const chunks = [];
  for await (const chunk of someClient.exportCache(cacheId)) chunks.push(chunk);
  return chunks;
}

// An export's tokens as bytes: every chunk's key.data, then every value.data (none for a latent
// cache), and its crc32c.
function exportBytes(chunks) {
  const withTokens = chunks.filter((c) => c.key);
  return {key: Buffer.concat(withTokens.map((c) => c.key.data)),
          value: Buffer.concat(withTokens.map((c) => c.value?.data ?? Buffer.alloc(0))),
          crc32c: chunks.at(-1).crc32c};
}

// Tokens [from, to) of a [kvHeads, n, dim] Tensor (written here apart from the client's own).
function sliceTokens(t, from, to) {
  const [heads, n, dim] = t.shape;
  const row = t.data.length / (heads * n);
  const parts = [];
  for (let h = 0; h < heads; ++h) parts.push(t.data.subarray((h * n + from) * row, (h * n + to) * row));
  return {shape: [heads, to - from, dim], dtype: t.dtype, data: Buffer.concat(parts)};
}

// The export of its first `length` tokens only (same id), its crc32c computed here.
function truncateExport(chunks, length) {
  const out = [];
  let crc = 0;
  for (const chunk of chunks) {
    const start = Number(chunk.start);
    const n = chunk.key ? chunk.key.shape[1] : 0;
    const take = Math.max(0, Math.min(n, length - start));
    const piece = {start, info: out.length === 0 ? {...chunk.info, length} : null};
    if (take > 0) {
      piece.key = sliceTokens(chunk.key, 0, take);
      piece.value = sliceTokens(chunk.value, 0, take);
      crc = crc32c(piece.value.data, crc32c(piece.key.data, crc));
    }
    if (out.length === 0 || take > 0) out.push(piece);
  }
  out.at(-1).crc32c = crc;
  return out;
}

// A Client that records each AppendCache it sends ({expectedLength, keyShape, valueShape}).
function countingClient(target) {
  const counting = new Client(target, {deadlineMs: 60000});
  counting.appends = [];
  const append = counting.appendCache.bind(counting);
  counting.appendCache = (request, options) => {
    counting.appends.push({expectedLength: request.expectedLength, keyShape: request.key.shape,
                           valueShape: request.value?.shape});
    return append(request, options);
  };
  return counting;
}

test('crc32c: Castagnoli check value, chaining, any bytes', () => {
  assert.equal(crc32c('123456789'), 0xe3069283);
  assert.equal(crc32c(Buffer.from('123456789')), 0xe3069283);
  assert.equal(crc32c(''), 0);
  assert.equal(crc32c(Buffer.alloc(32)), 0x8a9136aa);  // RFC 3720 B.4: 32 bytes of zeros.
  assert.equal(crc32c(Buffer.alloc(32, 0xff)), 0x62a8ab43);  // ... of ones.
  const bytes = Uint8Array.from({length: 1001}, (_, i) => (i * 131 + 7) & 0xff);
  let chained = 0;
  for (let i = 0; i < bytes.length; i += 13) chained = crc32c(bytes.subarray(i, i + 13), chained);
  assert.equal(chained, crc32c(bytes));
  assert.equal(crc32c(new Float32Array(bytes.buffer, 0, 250)), crc32c(bytes.subarray(0, 1000)));
  assert.throws(() => crc32c(42), TypeError);
});

test('export/import: a round trip between two servers keeps every byte (Tiled outputs equal)',
     {skip: noAttnd}, async () => {
  const other = (await peer()).client;
  const random = mulberry32(2929);
  const layout = {kvHeads: 4, headDim: 64, valueDim: 128, dtype: 'fp16'};  // 1536 B a token.
  const cache = await client.openCache(layout);
  for (const n of [1000, 1700, 300]) await cache.append(...randomTokens(random, layout, n));
  assert.equal(cache.length, 3000);
  assert.equal(cache.info.durableLength, undefined, 'args.target has no --cache-dir');
  assert.deepEqual(cache.tail, [], 'no tail without durableLength');

  const chunks = await exportAll(client, cache.id);
  assert.ok(chunks.length >= 2, `${chunks.length} chunks for 4.6 MB`);
  const {info} = chunks[0];
  assert.deepEqual([info.cacheId, info.kvHeads, info.headDim, info.valueDim, info.dtype,
                    info.length], [cache.id, 4, 64, 128, 'DTYPE_FLOAT16', 3000]);
  let tokens = 0, crc = 0;
  for (const [i, chunk] of chunks.entries()) {
    assert.equal(i === 0, chunk.info !== null, `only chunk 0 has info (chunk ${i})`);
    assert.equal(chunk.start, tokens);
    assert.ok(chunk.key.data.length + chunk.value.data.length <= 4 * 1024 * 1024 - 16 * 1024);
    assert.deepEqual(chunk.key.shape, [4, chunk.key.shape[1], 64]);
    assert.deepEqual(chunk.value.shape, [4, chunk.key.shape[1], 128]);
    assert.equal(chunk.crc32c !== undefined, i === chunks.length - 1, `crc32c on the last only`);
    tokens += chunk.key.shape[1];
    crc = crc32c(chunk.value.data, crc32c(chunk.key.data, crc));
  }
  assert.equal(tokens, 3000);
  assert.equal(chunks.at(-1).crc32c, crc);

  // Import on another server: the same id, the CRC of what it stored, the same bytes.
  const imported = await other.importCache(chunks);
  assert.ok(imported instanceof Cache);
  assert.equal(imported.id, cache.id);
  assert.equal(imported.length, 3000);
  assert.equal(imported.info.crc32c, crc);
  const query = tensor(randomNormal(8 * 2 * 64, random), [8, 2, 64], 'fp16');
  const tiled = {query, cacheId: cache.id, options: {causal: true, returnLse: true}};
  const [here, there] = await Promise.all([client.tiled(tiled), other.tiled(tiled)]);
  assert.ok(here.output.data.equals(there.output.data), 'Tiled outputs are the same bytes');
  assert.ok(here.lse.data.equals(there.lse.data), 'and the same lse');
  assert.deepEqual(exportBytes(await exportAll(other, cache.id)), exportBytes(chunks));

  // The id is taken there now: ALREADY_EXISTS, or a new id with newIdIfTaken.
  await assert.rejects(other.importCache(chunks), (err) => err.code === status.ALREADY_EXISTS);
  const renamed = await other.importCache(chunks, {newIdIfTaken: true});
  assert.notEqual(renamed.id, cache.id);
  assert.equal(renamed.info.crc32c, crc);

  // Through a file: ATTNEXP1, then u32 LE length + CacheChunk each.
  const file = path.join(scratch, 'round-trip.attnexp');
  const written = await client.exportCacheToFile(cache.id, file);
  assert.deepEqual([written.tokens, written.crc32c, written.chunks, written.info.cacheId],
                   [3000, crc, chunks.length, cache.id]);
  const bytes = fs.readFileSync(file);
  assert.equal(bytes.length, written.bytes);
  assert.equal(bytes.subarray(0, 8).toString('latin1'), 'ATTNEXP1');
  let frames = 0;
  for (let at = 8; at < bytes.length; at += 4 + bytes.readUInt32LE(at)) ++frames;
  assert.equal(frames, chunks.length);
  const read = [];
  for await (const chunk of attnd.readExportFile(file)) read.push(chunk);
  assert.deepEqual(exportBytes(read), exportBytes(chunks));
  assert.equal(read[0].info.cacheId, cache.id);
  const fromFile = await other.importCacheFromFile(file, {newIdIfTaken: true});
  assert.notEqual(fromFile.id, cache.id);
  assert.equal(fromFile.info.crc32c, crc);
  const again = await other.tiled({...tiled, cacheId: fromFile.id});
  assert.ok(again.output.data.equals(here.output.data), 'Tiled over the file import');
  await assert.rejects(other.importCacheFromFile(file), (e) => e.code === status.ALREADY_EXISTS);

  // An empty cache: one chunk with info and crc32c 0.
  const empty = await client.openCache({kvHeads: 2, headDim: 8, dtype: 'bf16'});
  const emptyChunks = await exportAll(client, empty.id);
  assert.equal(emptyChunks.length, 1);
  assert.equal(emptyChunks[0].info.length, 0);
  assert.equal(emptyChunks[0].crc32c, 0);
  assert.equal(emptyChunks[0].key, null);
  const emptyFile = path.join(scratch, 'empty.attnexp');
  await client.exportCacheToFile(empty.id, emptyFile);
  const emptyThere = await other.importCacheFromFile(emptyFile);
  assert.deepEqual([emptyThere.id, emptyThere.length, emptyThere.info.dtype],
                   [empty.id, 0, 'DTYPE_BFLOAT16']);
  for (const c of [cache, empty]) await c.delete();
  for (const c of [imported, renamed, fromFile, emptyThere]) await c.delete();
});

test('export/import: damaged, cut or foreign exports are DATA_LOSS and import nothing',
     {skip: noAttnd}, async () => {
  const other = (await peer()).client;
  const random = mulberry32(3030);
  const layout = {kvHeads: 8, headDim: 128, valueDim: 128};  // fp32: 8 KiB a token.
  const cache = await client.openCache(layout);
  await cache.append(...randomTokens(random, layout, 600));
  const chunks = await exportAll(client, cache.id);
  assert.ok(chunks.length >= 2);
  const isDataLoss = (pattern) => (err) => err instanceof AttndError &&
      err.code === status.DATA_LOSS && err.codeName === 'DATA_LOSS' && pattern.test(err.details);
  const nothingImported = () => assert.rejects(other.getCacheInfo(cache.id),
                                               (err) => err.code === status.NOT_FOUND);

  const flipped = chunks.map((c) => ({...c}));
  const data = Buffer.from(flipped[1].value.data);
  data[data.length >> 1] ^= 0x10;
  flipped[1].value = {...flipped[1].value, data};
  await assert.rejects(other.importCache(flipped), isDataLoss(/CRC32C/));
  await nothingImported();
  await assert.rejects(other.importCache(chunks.slice(0, -1)), isDataLoss(/cut short/));
  await nothingImported();
  const wrongCrc = chunks.map((c, i) => (i === chunks.length - 1 ? {...c, crc32c: c.crc32c ^ 1} : c));
  await assert.rejects(other.importCache(wrongCrc), isDataLoss(/CRC32C/));
  await nothingImported();

  // Files: a damaged chunk (the server's DATA_LOSS), a file cut inside a chunk or not an
  // export at all (the client's, before anything is committed).
  const damaged = path.join(scratch, 'damaged.attnexp');
  await attnd.writeExportFile(damaged, flipped);
  await assert.rejects(other.importCacheFromFile(damaged), isDataLoss(/CRC32C/));
  await nothingImported();
  const good = path.join(scratch, 'good.attnexp');
  await client.exportCacheToFile(cache.id, good);
  const bytes = fs.readFileSync(good);
  const cut = path.join(scratch, 'cut.attnexp');
  fs.writeFileSync(cut, bytes.subarray(0, bytes.length - 1000));
  await assert.rejects(other.importCacheFromFile(cut), isDataLoss(/ends inside chunk 1/));
  await nothingImported();
  const foreign = path.join(scratch, 'foreign.attnexp');
  fs.writeFileSync(foreign, Buffer.concat([Buffer.from('ATTNEXP2'), bytes.subarray(8)]));
  await assert.rejects(other.importCacheFromFile(foreign), isDataLoss(/not a cache export/));
  await nothingImported();
  // A missing cache exports nothing: NOT_FOUND, and no file is left.
  await cache.delete();
  const gone = path.join(scratch, 'gone.attnexp');
  await assert.rejects(client.exportCacheToFile(cache.id, gone), (e) => e.code === status.NOT_FOUND);
  assert.ok(!fs.existsSync(gone));
  await assert.rejects(exportAll(client, cache.id), (e) => e.code === status.NOT_FOUND);
});

test('recovery: refresh re-sends the tail a restarted server lost; the bytes equal the first ' +
     'server\'s', {skip: noAttnd}, async (t) => {
  const dirA = path.join(scratch, 'cache-dir-a'), dirB = path.join(scratch, 'cache-dir-b');
  fs.mkdirSync(dirB, {recursive: true});
  // Syncs every second at most (write passes half that apart): the tokens appended right
  // after a pass stay off the disk a while.
  const a = await startAttnd('recover-a', ['--cache-dir', dirA, '--cache-sync-seconds', '2']);
  await a.waitFor(/caches: persistent in --cache-dir=\S+ \(cache-sync-seconds=2\)/);
  const clientA = new Client(a.target, {deadlineMs: 60000});
  let onB = null;
  try {
    const serverInfo = await clientA.info();
    assert.deepEqual([serverInfo.cachePersistent, serverInfo.cacheSyncSeconds], [true, 2]);
    const random = mulberry32(4242);
    const layout = {kvHeads: 2, headDim: 16, valueDim: 8, dtype: 'bf16'};
    const cache = await clientA.openCache(layout);
    assert.equal(cache.info.durableLength, 0);
    for (const n of [5, 7, 3]) await cache.append(...randomTokens(random, layout, n));
    assert.equal(cache.length, 15);
    const tailEnds = cache.tail.map((e) => e.start + e.key.shape[1]);
    assert.equal(tailEnds.at(-1), 15, 'the last append is in the tail');
    assert.ok(cache.tail.every((e) => e.key.dtype === 'DTYPE_BFLOAT16'));

    // Wait for A to report some tokens durable, then copy its files: B starts from them.
    let durable = 0;
    for (const until = Date.now() + 20000; durable === 0 && Date.now() < until;) {
      await sleep(40);
      durable = Number((await cache.refresh()).durableLength);
    }
    assert.ok(durable > 0, 'durableLength grew within 20 s');
    for (const name of fs.readdirSync(dirA).filter((n) => n.endsWith('.kv'))) {
      fs.copyFileSync(path.join(dirA, name), path.join(dirB, name));
    }
    assert.ok(cache.tail.every((e) => e.start + e.key.shape[1] > durable),
              'entries ending at or before durableLength are dropped');

    // More tokens A has and the copy lacks: an append and a decode with new tokens.
    await cache.append(...randomTokens(random, layout, 4));
    const [k1, v1] = randomTokens(random, layout, 6);
    await cache.decode(tensor(randomNormal(4 * 16, random), [4, 1, 16], 'bf16'),
                       {key: k1, value: v1});
    assert.equal(cache.length, 25);
    assert.equal(cache.tail.at(-1).start, 19);
    assert.ok(cache.tail[0].start <= durable);
    const fromA = await exportAll(clientA, cache.id);

    const b = await startAttnd('recover-b', ['--cache-dir', dirB]);
    const [, restored] = await b.waitFor(/restored 1 caches \((\d+) tokens/);
    onB = countingClient(b.target);
    const heldByB = await onB.getCacheInfo(cache.id);
    const lost = Number(heldByB.length);
    assert.equal(lost, Number(restored));
    assert.ok(lost >= durable && lost < 25, `B restored ${lost} tokens`);
    assert.equal(heldByB.durableLength, lost);
    t.diagnostic(`A reported ${durable} of 15 tokens durable before the copy; B restored ${lost} ` +
                 `of 25; the tail re-sent from ${cache.tail[0].start}`);

    // The old Cache's state on B: refresh() re-sends [lost, 25) in one append.
    const moved = new Cache(onB, cache.info, {tail: cache.tail});
    assert.equal(moved.length, 25);
    const info = await moved.refresh();
    assert.equal(info.length, 25);
    assert.equal(moved.length, 25);
    assert.equal(onB.appends.length, 1, 'the lost tail in one append');
    assert.equal(onB.appends[0].expectedLength, lost);
    assert.deepEqual(onB.appends[0].keyShape, [2, 25 - lost, 16]);
    assert.deepEqual(exportBytes(await exportAll(onB, cache.id)), exportBytes(fromA));
    assert.equal((await moved.refresh()).length, 25, 'a second refresh has nothing to send');
    assert.equal(onB.appends.length, 1);

    // Once A has made everything durable the tail is empty: a server holding fewer tokens
    // cannot be caught up, DATA_LOSS, and the Cache keeps its state.
    for (const until = Date.now() + 20000; cache.tail.length > 0 && Date.now() < until;) {
      await sleep(100);
      await cache.refresh();
    }
    assert.equal(Number(cache.info.durableLength), 25);
    assert.deepEqual(cache.tail, []);
    await client.importCache(truncateExport(fromA, 10));  // Same id, 10 tokens, on args.target.
    const behind = new Cache(client, cache.info, {tail: cache.tail});
    const before = behind.info;
    await assert.rejects(behind.refresh(), (err) => err.code === status.DATA_LOSS &&
        /holds 10 tokens/.test(err.details) && /only from 25 on/.test(err.details) &&
        /prefilled again/.test(err.details));
    assert.equal(behind.info, before);
    assert.equal(behind.length, 25);
    await client.deleteCache(cache.id);
  } finally {
    clientA.close();
    onB?.close();
  }
});

test('recovery: the entry straddling the server\'s length is sliced along the token axis',
     {skip: noAttnd}, async () => {
  const a = await startAttnd('slice-a', ['--cache-dir', path.join(scratch, 'cache-dir-slice'),
                                         '--cache-sync-seconds', '30']);
  const clientA = new Client(a.target, {deadlineMs: 60000});
  try {
    const random = mulberry32(5151);
    for (const [layout, limitTokens] of [
      [{kvHeads: 3, headDim: 8, valueDim: 5}, null],
      [{kvHeads: 1, headDim: 6, valueDim: 4, dtype: 'fp16', rank2: true}, null],
      [{kvHeads: 2, headDim: 4, valueDim: 4, dtype: 'bf16'}, 3],  // Appends of ≤ 3 tokens.
    ]) {
      const cache = await clientA.openCache(layout);
      for (const n of [6, 7, 7]) await cache.append(...randomTokens(random, layout, n));
      // Nothing durable yet (a pass 15 s away): the whole sequence is in the tail.
      assert.deepEqual(cache.tail.map((e) => e.start), [0, 6, 13]);
      assert.equal(cache.tail[1].key.shape.length, layout.rank2 ? 2 : 3);
      const fromA = await exportAll(clientA, cache.id);
      // args.target holds this cache's first 9 tokens: [9, 20) goes again, [9, 13) out of the
      // second entry.
      await client.importCache(truncateExport(fromA, 9));
      const target = countingClient(args.target);
      const tokenBytes = layout.kvHeads * (layout.headDim + layout.valueDim) *
                         (layout.dtype ? 2 : 4);
      if (limitTokens) target.appendLimit_ = Promise.resolve(limitTokens * tokenBytes);
      const behind = new Cache(target, cache.info, {tail: cache.tail});
      assert.equal((await behind.refresh()).length, 20);
      const sizes = target.appends.map((x) => x.keyShape.at(-2));
      if (limitTokens) {
        assert.deepEqual(sizes, [3, 3, 3, 2], 'cut at the limit, entries joined within it');
      } else {
        assert.deepEqual(sizes, [11], 'one append for the whole lost tail');
        assert.deepEqual(target.appends[0].keyShape,
                         layout.rank2 ? [11, 6] : [layout.kvHeads, 11, layout.headDim]);
      }
      let expected = 9;
      for (const [i, x] of target.appends.entries()) {
        assert.equal(x.expectedLength, expected, `append ${i}`);
        expected += x.keyShape.at(-2);
      }
      assert.deepEqual(exportBytes(await exportAll(client, cache.id)), exportBytes(fromA));
      await client.deleteCache(cache.id);
      await cache.delete();
      target.close();
    }
  } finally {
    clientA.close();
  }
});

test('recovery: without durableLength no tail is kept, so a shorter server is DATA_LOSS',
     {skip: noAttnd}, async () => {
  const other = (await peer()).client;
  const random = mulberry32(6161);
  const layout = {kvHeads: 2, headDim: 8, valueDim: 8};
  const cache = await client.openCache(layout);
  assert.equal(cache.info.durableLength, undefined);
  for (const n of [5, 6, 9]) await cache.append(...randomTokens(random, layout, n));
  const [k1, v1] = randomTokens(random, layout, 1);
  await cache.decode(tensor(randomNormal(2 * 8, random), [2, 1, 8]), {key: k1, value: v1});
  assert.equal(cache.length, 21);
  assert.deepEqual(cache.tail, []);
  // Another server holds this cache's first 6 tokens only.
  await other.importCache(truncateExport(await exportAll(client, cache.id), 6));
  const behind = new Cache(other, cache.info, {tail: cache.tail});
  const before = behind.info;
  await assert.rejects(behind.refresh(), (err) => err instanceof AttndError &&
      err.code === status.DATA_LOSS && /holds 6 tokens and this client 21/.test(err.details) &&
      /only from 21 on/.test(err.details) && /prefilled again/.test(err.details));
  assert.equal(behind.info, before, 'the Cache keeps its state');
  assert.equal(behind.length, 21);
  // A server holding more than the client believes: its info is taken, as before.
  const stale = new Cache(client, {...cache.info, length: 3});
  assert.equal((await stale.refresh()).length, 21);
  await other.deleteCache(cache.id);
  await cache.delete();
});

// A grpc-js server standing in for attnd: the cache calls (AppendCache, GetCacheInfo, Decode)
// answer NOT_FOUND ending moved_to=movedTo(); ExportCache streams exportChunks. Records
// {method, authorization} per call.
async function fakeAttnd({movedTo = () => null, exportChunks = []} = {}) {
  const calls = [];
  const moved = (method, id) => (call, callback) => {
    calls.push({method, authorization: call.metadata.get('authorization')[0]});
    const to = movedTo();
    callback({code: grpc.status.NOT_FOUND,
              details: `cache_id: cache ${id(call.request)} ` +
                       (to ? `was handed to another server while this one drained; moved_to=${to}`
                           : 'not found')});
  };
  const server = new grpc.Server();
  server.addService(attnd.proto.AttentionService.service, {
    AppendCache: moved('AppendCache', (r) => r.cacheId),
    GetCacheInfo: moved('GetCacheInfo', (r) => r.cacheId),
    Decode: moved('Decode', (r) => r.items[0].cacheId),
    ExportCache: (call) => {
      calls.push({method: 'ExportCache'});
      for (const chunk of exportChunks) call.write(chunk);
      call.end();
    },
  });
  const port = await new Promise((resolve, reject) => server.bindAsync(
      '127.0.0.1:0', grpc.ServerCredentials.createInsecure(),
      (err, bound) => (err ? reject(err) : resolve(bound))));
  return {target: `127.0.0.1:${port}`, calls, stop: () => server.forceShutdown()};
}

test('moved_to: a Cache follows NOT_FOUND moved_to=HOST:PORT once, with the same options',
     async () => {
  const random = mulberry32(7171);
  const layout = {kvHeads: 1, headDim: 4, valueDim: 4};
  const real = await client.openCache(layout);  // The cache, on args.target.
  const drained = await fakeAttnd({movedTo: () => args.target});
  const via = new Client(drained.target, {deadlineMs: 23456, token: 'moved-token'});
  try {
    const cache = new Cache(via, real.info);
    await cache.append(...randomTokens(random, layout, 3));
    assert.equal(cache.length, 3);
    assert.notEqual(cache.client, via);
    assert.equal(cache.client, via.peer_(args.target));
    assert.deepEqual([cache.client.target, cache.client.token, cache.client.deadlineMs],
                     [args.target, 'moved-token', 23456]);
    assert.equal((await client.getCacheInfo(real.id)).length, 3, 'appended on the real server');
    // refresh and decode follow too.
    const refreshed = new Cache(via, {...real.info, length: 0});
    assert.equal((await refreshed.refresh()).length, 3);
    const decoding = new Cache(via, refreshed.info);
    const [k, v] = randomTokens(random, layout, 1);
    const step = await decoding.decode(tensor(randomNormal(2 * 4, random), [2, 1, 4]),
                                       {key: k, value: v});
    assert.deepEqual(step.output.shape, [2, 1, 4]);
    assert.equal(decoding.length, 4);
    assert.deepEqual(drained.calls.map((c) => [c.method, c.authorization]),
                     [['AppendCache', 'Bearer moved-token'], ['GetCacheInfo', 'Bearer moved-token'],
                      ['Decode', 'Bearer moved-token']]);
    // A plain NOT_FOUND is not followed.
    const lost = await fakeAttnd();
    const nowhere = new Client(lost.target);
    const stays = new Cache(nowhere, real.info);
    await assert.rejects(stays.refresh(), (e) => e.code === status.NOT_FOUND);
    assert.equal(stays.client, nowhere);
    nowhere.close();
    lost.stop();
    // Moved twice in a row (ping → pong → ping): followed once, then the error.
    let pong = null;
    const ping = await fakeAttnd({movedTo: () => pong.target});
    pong = await fakeAttnd({movedTo: () => ping.target});
    const start = new Client(ping.target, {token: 'loop'});
    const looped = new Cache(start, decoding.info);
    await assert.rejects(looped.append(k, v), (err) => err.code === status.NOT_FOUND &&
        err.details.endsWith(`moved_to=${ping.target}`));
    assert.deepEqual([ping.calls.length, pong.calls.length], [1, 1]);
    assert.equal(pong.calls[0].authorization, 'Bearer loop');
    assert.equal(looped.client.target, pong.target);
    assert.equal(looped.length, 4, 'nothing appended');
    start.close();
    ping.stop();
    pong.stop();
  } finally {
    via.close();
    drained.stop();
    await real.delete();
  }
});

test('export: a stream whose tokens or CRC32C do not add up is DATA_LOSS here', async () => {
  const random = mulberry32(8181);
  const layout = {kvHeads: 2, headDim: 4, valueDim: 4};
  const cache = await client.openCache(layout);
  await cache.append(...randomTokens(random, layout, 5));
  const good = await exportAll(client, cache.id);
  await cache.delete();
  const last = good.length - 1;
  for (const [what, chunks, pattern] of [
    ['a wrong crc32c', good.map((c, i) => (i === last ? {...c, crc32c: c.crc32c ^ 4} : c)), /CRC32C/],
    ['no last chunk', good.map((c) => ({...c, crc32c: undefined})), /cut short/],
    ['a chunk at the wrong start', good.map((c) => ({...c, start: 1})), /starts at token 1/],
  ]) {
    const fake = await fakeAttnd({exportChunks: chunks});
    const from = new Client(fake.target);
    try {
      await assert.rejects(exportAll(from, cache.id),
                           (e) => e.code === status.DATA_LOSS && pattern.test(e.details), what);
      const file = path.join(scratch, 'checked.attnexp');
      await assert.rejects(from.exportCacheToFile(cache.id, file),
                           (e) => e.code === status.DATA_LOSS && pattern.test(e.details), what);
      assert.ok(!fs.existsSync(file), `no file after ${what}`);
      assert.deepEqual(fs.readdirSync(scratch).filter((n) => n.includes('partial')), []);
    } finally {
      from.close();
      fake.stop();
    }
  }
});

test('TLS with a bearer token', {skip: !args.secureTarget && 'no --secure-target'}, async () => {
  const token = fs.readFileSync(args.tokenFile, 'utf8').trim();
  const secure = new Client(args.secureTarget, {token, tlsCa: args.tlsCa});
  const anonymous = new Client(args.secureTarget, {tlsCa: args.tlsCa});
  try {
    const res = await secure.tiled(request(seed, {scale: 0.5, blockK: 2}));
    assertClose(toFloat32Array(res.output).subarray(0, 4), SEED_OUT0, 1e-6, 'TLS out[0]');
    const events = await collect(secure.trace({attention: request(seed, {blockK: 2})}));
    assert.equal(events.at(-1).event, 'end');
    await assert.rejects(anonymous.info(), (err) => err.code === status.UNAUTHENTICATED);
  } finally {
    secure.close();
    anonymous.close();
  }
});

// --- speculative decoding: TruncateCache and DecodeItem.truncateTo ------------------------------
// Tensors [kvHeads, n_i, dim] of one dtype joined along the token axis (written here apart from
// the client's own joinTokens).
function concatTokens(...parts) {
  const [heads, , dim] = parts[0].shape;
  const pieces = [];
  for (let h = 0; h < heads; ++h) {
    for (const t of parts) {
      const row = t.data.length / heads;
      pieces.push(t.data.subarray(h * row, (h + 1) * row));
    }
  }
  return {shape: [heads, parts.reduce((n, t) => n + t.shape[1], 0), dim], dtype: parts[0].dtype,
          data: Buffer.concat(pieces)};
}

// A cache's tokens and a Decode over it (no new tokens: it changes nothing) on someClient, to
// compare before and after a failed call: {length, bytes, key, value, output, lse}.
async function cacheSnapshot(someClient, cacheId, query) {
  const info = await someClient.getCacheInfo(cacheId);
  const {key, value} = exportBytes(await exportAll(someClient, cacheId));
  const step = await someClient.decode({
    items: [{cacheId, query, expectedLength: info.length}],
    options: {causal: true, returnLse: true}});
  return {length: Number(info.length), bytes: Number(info.bytes), key: key.toString('base64'),
          value: value.toString('base64'), output: step.outputs[0].data.toString('base64'),
          lse: step.lse[0].data.toString('base64')};
}

const tailRanges = (cache) => cache.tail.map((e) => [e.start, e.key.shape.at(-2)]);
const sameBits = (a, b) => a.output.data.equals(b.output.data) && a.lse.data.equals(b.lse.data);

test('truncate: a cut cache equals one that never had the tokens, bit for bit; truncateTo too',
     async () => {
  const random = mulberry32(3131);
  const page = Number((await client.info()).cachePageTokens);
  for (const layout of [{kvHeads: 2, headDim: 16, valueDim: 12, dtype: 'float32', heads: 4},
                        {kvHeads: 1, headDim: 8, valueDim: 8, dtype: 'bf16', heads: 3}]) {
    // Inside a page, at a page boundary, nothing cut, everything cut.
    for (const [total, kept] of [[page + 7, page - 3], [page + 2, page], [40, 40], [23, 0]]) {
      const what = `${layout.dtype}: ${total} tokens cut to ${kept}`;
      const [key, value] = randomTokens(random, layout, total);
      const cut = await client.openCache(layout);
      const split = Math.floor(total / 3) + 1;
      await cut.append(sliceTokens(key, 0, split), sliceTokens(value, 0, split));
      await cut.append(sliceTokens(key, split, total), sliceTokens(value, split, total));
      const direct = await client.openCache(layout);
      if (kept > 0) await direct.append(sliceTokens(key, 0, kept), sliceTokens(value, 0, kept));
      const info = await cut.truncate(kept);
      assert.deepEqual([info.length, cut.length], [kept, kept], what);
      assert.equal(info.durableLength, undefined, what);
      assert.deepEqual(cut.tail, [], what);
      const directInfo = await client.getCacheInfo(direct.id);
      assert.deepEqual([info.length, info.bytes], [directInfo.length, directInfo.bytes], what);
      assert.deepEqual(exportBytes(await exportAll(client, cut.id)),
                       exportBytes(await exportAll(client, direct.id)), what);
      // The next step: two new tokens, three causal query rows, with lse: the same bits.
      const q = tensor(randomNormal(layout.heads * 3 * layout.headDim, random),
                       [layout.heads, 3, layout.headDim]);
      const [k1, v1] = randomTokens(random, layout, 2);
      const step = {key: k1, value: v1, options: {causal: true, returnLse: true}};
      const got = await cut.decode(q, step), want = await direct.decode(q, step);
      assert.ok(sameBits(got, want), `${what}: the next Decode's bits`);
      assert.equal(cut.length, kept + 2, what);
      await cut.delete();
      await direct.delete();
    }
  }

  // Speculative steps over two sequences in one batch: each step appends k + 1 tokens (the
  // last accepted one and k drafts) under k + 1 causal query rows; the next cuts the rejected
  // drafts with truncateTo and appends again, equal to caches built directly.
  const drafts = 3;
  const layouts = [{kvHeads: 2, headDim: 8, valueDim: 8, dtype: 'bf16', heads: 4},
                   {kvHeads: 1, headDim: 12, valueDim: 6, dtype: 'float32', heads: 2}];
  const seqs = [];
  for (const [i, layout] of layouts.entries()) {
    const [key, value] = randomTokens(random, layout, 30 + 11 * i);
    const cache = await client.openCache(layout);
    await cache.append(key, value);
    seqs.push({layout, cache, key, value});
  }
  for (let round = 0; round < 4; ++round) {
    const steps = seqs.map(({layout}) => {
      const [key, value] = randomTokens(random, layout, drafts + 1);
      const query = tensor(randomNormal(layout.heads * (drafts + 1) * layout.headDim, random),
                           [layout.heads, drafts + 1, layout.headDim]);
      return {query, key, value};
    });
    const items = seqs.map((seq, i) => ({cache: seq.cache, ...steps[i],
                                         truncateTo: round > 0 ? seq.key.shape[1] : undefined}));
    let got;
    if (round === 3) {  // The last round through Cache.decode, one sequence at a time.
      got = [];
      for (const item of items) {
        got.push(await item.cache.decode(item.query, {...item, options: {causal: true,
                                                                         returnLse: true}}));
      }
    } else {
      const response = await client.decodeBatch(items, {causal: true, returnLse: true});
      got = response.outputs.map((output, i) => ({output, lse: response.lse[i]}));
    }
    const direct = [];
    for (const seq of seqs) {
      const cache = await client.openCache(seq.layout);
      await cache.append(seq.key, seq.value);
      direct.push(cache);
    }
    const want = [];
    if (round === 3) {
      for (const [i, cache] of direct.entries()) {
        want.push(await cache.decode(steps[i].query, {...steps[i], options: {causal: true,
                                                                            returnLse: true}}));
      }
    } else {
      const response = await client.decodeBatch(direct.map((cache, i) => ({cache, ...steps[i]})),
                                                {causal: true, returnLse: true});
      want.push(...response.outputs.map((output, i) => ({output, lse: response.lse[i]})));
    }
    for (const [i, seq] of seqs.entries()) {
      const what = `round ${round}, sequence ${i}`;
      assert.ok(sameBits(got[i], want[i]), `${what}: outputs and lse`);
      assert.equal(seq.cache.length, seq.key.shape[1] + drafts + 1, what);
      assert.deepEqual(exportBytes(await exportAll(client, seq.cache.id)),
                       exportBytes(await exportAll(client, direct[i].id)), what);
      const accepted = (round + 2 * i) % (drafts + 1);  // None to all over the rounds.
      seq.key = concatTokens(seq.key, sliceTokens(steps[i].key, 0, 1 + accepted));
      seq.value = concatTokens(seq.value, sliceTokens(steps[i].value, 0, 1 + accepted));
      await direct[i].delete();
    }
  }
  for (const seq of seqs) await seq.cache.delete();
});

test('truncate: errors name the field and leave the cache as it was', async () => {
  const random = mulberry32(3232);
  const layout = {kvHeads: 1, headDim: 8, valueDim: 8};
  const cache = await client.openCache(layout);
  await cache.append(...randomTokens(random, layout, 10));
  const q = tensor(randomNormal(2 * 2 * 8, random), [2, 2, 8]);
  const before = await cacheSnapshot(client, cache.id, q);
  const unchanged = async (what) => {
    assert.deepEqual(await cacheSnapshot(client, cache.id, q), before, what);
    assert.equal(cache.length, 10, what);
  };
  const fails = (code, pattern) => (err) => err instanceof AttndError && err.code === code &&
                                            pattern.test(err.details);
  await assert.rejects(cache.truncate(11), fails(status.OUT_OF_RANGE, /length.*11.*holds 10/));
  await unchanged('length 11');
  await assert.rejects(cache.truncate(4, {expectedLength: 9}),
                       fails(status.FAILED_PRECONDITION, /expected_length.*holds 10/));
  await unchanged('expectedLength 9');
  await assert.rejects(client.truncateCache({cacheId: cache.id, length: 4, expectedLength: 11}),
                       fails(status.FAILED_PRECONDITION, /holds 10/));
  await unchanged('expectedLength 11');
  // Negative values past the client's checks: INVALID_ARGUMENT naming the field.
  await assert.rejects(client.unary_('TruncateCache', {cacheId: cache.id, length: -1}),
                       fails(status.INVALID_ARGUMENT, /^length/));
  await assert.rejects(client.unary_('TruncateCache',
                                     {cacheId: cache.id, length: 3, expectedLength: -10}),
                       fails(status.INVALID_ARGUMENT, /expected_length/));
  await assert.rejects(client.decode({items: [{cacheId: cache.id, query: q, expectedLength: 10,
                                               truncateTo: -1}]}),
                       fails(status.INVALID_ARGUMENT, /items\[0\]\.truncate_to/));
  await unchanged('negative values');
  const [k1, v1] = randomTokens(random, layout, 1);
  await assert.rejects(cache.decode(q, {key: k1, value: v1, truncateTo: 11}),
                       fails(status.OUT_OF_RANGE, /items\[0\]\.truncate_to/));
  await assert.rejects(
      client.decode({items: [{...cache.item(q, k1, v1, {truncateTo: 5}), expectedLength: 5}]}),
      fails(status.FAILED_PRECONDITION, /expected_length/));
  await unchanged('Decode cuts refused');
  // The client's own checks, before any call: TypeError / RangeError naming the field.
  const other = await client.openCache(layout);
  for (const [call, kind, pattern] of [
    [() => cache.truncate(-1), RangeError, /length is -1/],
    [() => cache.truncate(true), TypeError, /length is true/],
    [() => cache.truncate(2.5), TypeError, /length is 2.5/],
    [() => cache.truncate(4, {expectedLength: -1}), RangeError, /expectedLength is -1/],
    [() => client.truncateCache({cacheId: cache.id, length: '4'}), TypeError, /length is '4'/],
    [() => client.truncateCache({cacheId: cache.id, length: 4, expectedLength: 4n}), TypeError,
     /expectedLength/],
    [() => cache.decode(q, {truncateTo: -2}), RangeError, /items\[0\]\.truncateTo/],
    [() => cache.decode(q, {truncateTo: false}), TypeError, /items\[0\]\.truncateTo/],
    [() => client.decodeBatch([{cache, query: q}, {cache: other, query: q, truncateTo: 0.5}]),
     TypeError, /items\[1\]\.truncateTo/],
  ]) {
    await assert.rejects(call(), (err) => err instanceof kind && pattern.test(err.message));
  }
  assert.throws(() => cache.item(q, undefined, undefined, {truncateTo: -3}), RangeError);
  await unchanged('client-side errors');
  // By id without expectedLength: not checked. The Cache was not told, so its next cut is
  // refused until it takes the server's info.
  assert.equal((await client.truncateCache({cacheId: cache.id, length: 6})).length, 6);
  assert.equal(cache.length, 10);
  await assert.rejects(cache.truncate(3), fails(status.FAILED_PRECONDITION, /holds 6/));
  cache.update(await client.getCacheInfo(cache.id));
  assert.equal((await cache.truncate(3)).length, 3);
  assert.equal(cache.length, 3);
  await cache.delete();
  await other.delete();
  await assert.rejects(cache.truncate(0), (e) => e.code === status.NOT_FOUND);
});

test('truncateTo: a failed Decode leaves every cache as it was', async () => {
  const random = mulberry32(3333);
  const layoutA = {kvHeads: 2, headDim: 8, valueDim: 8};
  const layoutB = {kvHeads: 1, headDim: 16, valueDim: 12, dtype: 'fp16'};
  const a = await client.openCache(layoutA), b = await client.openCache(layoutB);
  await a.append(...randomTokens(random, layoutA, 21));
  await b.append(...randomTokens(random, layoutB, 13));
  const qa = tensor(randomNormal(4 * 2 * 8, random), [4, 2, 8]);
  const qb = tensor(randomNormal(2 * 16, random), [2, 1, 16]);
  const before = [await cacheSnapshot(client, a.id, qa), await cacheSnapshot(client, b.id, qb)];
  const [ka, va] = randomTokens(random, layoutA, 2);
  const [kb, vb] = randomTokens(random, layoutB, 1);
  const cutA = a.item(qa, ka, va, {truncateTo: 15}), cutB = b.item(qb, kb, vb, {truncateTo: 10});
  for (const [what, code, pattern, items] of [
    ['a\'s query head_dim', status.INVALID_ARGUMENT, /query/,
     [cutB, {...cutA, query: tensor(randomNormal(4 * 2 * 16, random), [4, 2, 16])}]],
    ['a\'s query heads', status.INVALID_ARGUMENT, /query/,
     [cutB, {...cutA, query: tensor(randomNormal(3 * 2 * 8, random), [3, 2, 8])}]],
    ['b\'s stale expectedLength', status.FAILED_PRECONDITION, /expected_length/,
     [cutA, {...cutB, expectedLength: 12}]],
    ['b\'s cut past its length', status.OUT_OF_RANGE, /items\[1\]\.truncate_to/,
     [cutA, {...cutB, truncateTo: 14}]],
  ]) {
    await assert.rejects(client.decode({items, options: {causal: true}}),
                         (err) => err.code === code && pattern.test(err.details), what);
    assert.deepEqual([await cacheSnapshot(client, a.id, qa), await cacheSnapshot(client, b.id, qb)],
                     before, what);
  }
  // Through decodeBatch: the Caches keep their lengths too.
  await assert.rejects(
      client.decodeBatch([{cache: a, query: qa, key: ka, value: va, truncateTo: 15},
                          {cache: b, query: qb, key: kb, value: vb, truncateTo: 14}]),
      (err) => err.code === status.OUT_OF_RANGE);
  assert.deepEqual([a.length, b.length], [21, 13]);
  assert.deepEqual([await cacheSnapshot(client, a.id, qa), await cacheSnapshot(client, b.id, qb)],
                   before, 'decodeBatch');
  const response = await client.decodeBatch(
      [{cache: a, query: qa, key: ka, value: va, truncateTo: 15},
       {cache: b, query: qb, key: kb, value: vb, truncateTo: 10}]);
  assert.deepEqual(response.caches.map((c) => c.length), [17, 11]);
  assert.deepEqual([a.length, b.length], [17, 11]);
  await a.delete();
  await b.delete();
});

// --- forks: ForkCache ---------------------------------------------------------------------------
test('fork: a fork equals a copy bit for bit and changes alone; sharedBytes', async () => {
  const random = mulberry32(3434);
  const page = Number((await client.info()).cachePageTokens);
  const causal = {options: {causal: true, returnLse: true}};
  const sharedOf = async (id) => Number((await client.getCacheInfo(id)).sharedBytes);
  for (const layout of [{kvHeads: 2, headDim: 16, valueDim: 12, dtype: 'float32', heads: 4},
                        {kvHeads: 1, headDim: 8, valueDim: 8, dtype: 'bf16', heads: 3}]) {
    // All the tokens, a prefix inside a page (the second page not shared), none.
    for (const [total, length] of [[page + 7, undefined], [page + 7, page - 3], [40, 0]]) {
      const kept = length ?? total;
      const what = `${layout.dtype}: a fork of ${kept} of ${total} tokens`;
      const [key, value] = randomTokens(random, layout, total);
      const source = await client.openCache(layout);
      const split = Math.floor(total / 3) + 1;
      await source.append(sliceTokens(key, 0, split), sliceTokens(value, 0, split));
      await source.append(sliceTokens(key, split, total), sliceTokens(value, split, total));
      const q = tensor(randomNormal(layout.heads * 3 * layout.headDim, random),
                       [layout.heads, 3, layout.headDim]);
      const sourceBefore = await source.decode(q, causal);
      const fork = await source.fork(length === undefined ? {} : {length});
      assert.ok(fork instanceof Cache, what);
      assert.notEqual(fork.id, source.id, what);
      assert.deepEqual([fork.length, source.length], [kept, total], what);
      assert.equal(fork.info.durableLength, undefined, what);
      assert.deepEqual(fork.tail, [], what);
      // Right after forking every page of the fork is its source's: sharedBytes is all its
      // bytes, and the source shares as many.
      const bytes = Number(fork.info.bytes);
      assert.equal(Number(fork.info.sharedBytes), bytes, what);
      assert.equal(await sharedOf(source.id), bytes, what);
      assert.equal(bytes > 0, kept > 0, what);
      const copy = await client.openCache(layout);
      if (kept > 0) await copy.append(sliceTokens(key, 0, kept), sliceTokens(value, 0, kept));
      assert.equal(bytes, Number((await client.getCacheInfo(copy.id)).bytes), what);
      assert.deepEqual(exportBytes(await exportAll(client, fork.id)),
                       exportBytes(await exportAll(client, copy.id)), what);
      if (kept > 0) {  // (A cache without tokens cannot be attended: FAILED_PRECONDITION.)
        assert.ok(sameBits(await fork.decode(q, causal), await copy.decode(q, causal)), what);
      }
      // The same two tokens appended to the fork and to the copy (the fork copies a shared,
      // partly filled page before writing into it): the same bits; the source's unchanged.
      const [k1, v1] = randomTokens(random, layout, 2);
      assert.ok(sameBits(await fork.decode(q, {key: k1, value: v1, ...causal}),
                         await copy.decode(q, {key: k1, value: v1, ...causal})),
                `${what}: appending to the fork`);
      assert.equal(fork.length, kept + 2, what);
      assert.ok(sameBits(await source.decode(q, causal), sourceBefore), `${what}: the source`);
      // Tokens of the source's own: the fork does not see them.
      const [k2, v2] = randomTokens(random, layout, 3);
      await source.append(k2, v2);
      assert.ok(sameBits(await fork.decode(q, causal), await copy.decode(q, causal)),
                `${what}: after the source's append`);
      // Deleting the source keeps what the fork uses; it shares nothing any more.
      await source.delete();
      assert.equal(await sharedOf(fork.id), 0, what);
      const [k3, v3] = randomTokens(random, layout, 1);
      assert.ok(sameBits(await fork.decode(q, {key: k3, value: v3, ...causal}),
                         await copy.decode(q, {key: k3, value: v3, ...causal})),
                `${what}: after the source's delete`);
      assert.deepEqual(exportBytes(await exportAll(client, fork.id)),
                       exportBytes(await exportAll(client, copy.id)), what);
      await fork.delete();
      await copy.delete();
    }
  }
  // By id: all of it, or a prefix (0 is sent: an empty fork, not all of it).
  const layout = {kvHeads: 1, headDim: 8, valueDim: 8};
  const source = await client.openCache(layout);
  await source.append(...randomTokens(random, layout, 9));
  const whole = await client.forkCache({cacheId: source.id});
  const empty = await client.forkCache({cacheId: source.id, length: 0, expectedLength: 9});
  assert.deepEqual([whole.length, whole.sharedBytes, empty.length, empty.bytes],
                   [9, whole.bytes, 0, 0]);
  const child = await new Cache(client, whole).fork({length: 4});
  assert.equal(child.length, 4);
  for (const id of [whole.cacheId, empty.cacheId, child.id, source.id]) {
    await client.deleteCache(id);
  }
});

test('fork: errors name the field and create nothing', async () => {
  const random = mulberry32(3535);
  const layout = {kvHeads: 1, headDim: 8, valueDim: 8};
  const cache = await client.openCache(layout);
  await cache.append(...randomTokens(random, layout, 10));
  const q = tensor(randomNormal(2 * 2 * 8, random), [2, 2, 8]);
  const before = await cacheSnapshot(client, cache.id, q);
  const count = (await client.listCaches()).caches.length;
  const unchanged = async (what) => {
    assert.deepEqual(await cacheSnapshot(client, cache.id, q), before, what);
    assert.equal(cache.length, 10, what);
    assert.equal((await client.listCaches()).caches.length, count, `${what}: a cache was made`);
  };
  const fails = (code, pattern) => (err) => err instanceof AttndError && err.code === code &&
                                            pattern.test(err.details);
  // A length past the source's: OUT_OF_RANGE naming it.
  await assert.rejects(cache.fork({length: 11}),
                       fails(status.OUT_OF_RANGE, /^length.*11.*holds 10/));
  await assert.rejects(client.forkCache({cacheId: cache.id, length: 11}),
                       fails(status.OUT_OF_RANGE, /^length/));
  await unchanged('length 11');
  // A stale expectedLength: FAILED_PRECONDITION naming it and the actual length, checked first.
  await assert.rejects(cache.fork({length: 4, expectedLength: 9}),
                       fails(status.FAILED_PRECONDITION, /^expected_length.*holds 10/));
  await assert.rejects(cache.fork({length: 11, expectedLength: 9}),
                       fails(status.FAILED_PRECONDITION, /^expected_length/));
  await assert.rejects(new Cache(client, {...cache.info, length: 12}).fork(),
                       fails(status.FAILED_PRECONDITION, /holds 10/));
  await unchanged('a stale expectedLength');
  // Negative values past the client's checks: INVALID_ARGUMENT naming the field.
  await assert.rejects(client.unary_('ForkCache', {cacheId: cache.id, length: -1}),
                       fails(status.INVALID_ARGUMENT, /^length/));
  await assert.rejects(client.unary_('ForkCache', {cacheId: cache.id, expectedLength: -10}),
                       fails(status.INVALID_ARGUMENT, /^expected_length/));
  // An unknown cache: NOT_FOUND naming cache_id.
  await assert.rejects(client.forkCache({cacheId: '0'.repeat(32)}),
                       fails(status.NOT_FOUND, /^cache_id/));
  await unchanged('refused by the server');
  // The client's own checks, before any call: TypeError / RangeError naming the field.
  for (const [call, kind, pattern] of [
    [() => cache.fork({length: -1}), RangeError, /length is -1/],
    [() => cache.fork({length: true}), TypeError, /length is true/],
    [() => cache.fork({length: 2.5}), TypeError, /length is 2.5/],
    [() => cache.fork({expectedLength: -1}), RangeError, /expectedLength is -1/],
    [() => client.forkCache({cacheId: cache.id, length: '4'}), TypeError, /length is '4'/],
    [() => client.forkCache({cacheId: cache.id, expectedLength: 4n}), TypeError,
     /expectedLength/],
  ]) {
    await assert.rejects(call(), (err) => err instanceof kind && pattern.test(err.message));
  }
  await unchanged('client-side errors');
  await cache.delete();
  await assert.rejects(cache.fork(), (e) => e.code === status.NOT_FOUND);
});

// --- token trees: DecodeItem.treeParents -------------------------------------------------------
// t0 → {t1, t2}, t1 → {t3, t4}, t2 → {t5}, and t6 a second child of the cached prefix (depth
// first, so t0 → t1 is a prefix of the new tokens).
const TREE = [-1, 0, 0, 1, 1, 2, -1];
// The new tokens on the path from the cached prefix to new token i, root first.
function branchOf(parents, i) {
  const path = [];
  for (; i >= 0; i = parents[i]) path.unshift(i);
  return path;
}
// Tokens from + j for each j of `indices`, joined, of a [kvHeads, n, dim] Tensor.
const pickTokens = (t, from, indices) =>
  concatTokens(...indices.map((j) => sliceTokens(t, from + j, from + j + 1)));
// Row i of each head of a [heads, n, width] Float32Array → [heads, 1, width].
function rowOf(values, heads, n, width, i) {
  const out = new Float32Array(heads * width);
  for (let h = 0; h < heads; ++h) {
    out.set(values.subarray((h * n + i) * width, (h * n + i + 1) * width), h * width);
  }
  return out;
}
// Two fp32 paths to the same attention: max |got − want| ≤ tol · max |want|.
function assertNear(got, want, tol, what) {
  assert.equal(got.length, want.length, `${what}: length`);
  let miss = 0, top = 0;
  for (let i = 0; i < want.length; ++i) {
    assert.ok(Number.isFinite(got[i]), `${what}[${i}] is ${got[i]}`);
    miss = Math.max(miss, Math.abs(got[i] - want[i]));
    top = Math.max(top, Math.abs(want[i]));
  }
  assert.ok(miss <= tol * top, `${what}: misses by ${miss}, over ${tol} × ${top}`);
}

test('tree: each row equals a causal decode over its branch and float64 (fp32, bf16, GQA)',
     async () => {
  const random = mulberry32(4141);
  for (const [layout, prefix] of [
    [{kvHeads: 2, headDim: 24, valueDim: 20, dtype: 'float32', heads: 6}, 37],
    [{kvHeads: 2, headDim: 16, valueDim: 16, dtype: 'bf16', heads: 8}, 53]]) {
    const {heads, kvHeads, headDim, valueDim, dtype} = layout;
    const n = TREE.length;
    const [key, value] = randomTokens(random, layout, prefix + n);
    const newKey = sliceTokens(key, prefix, prefix + n);
    const newValue = sliceTokens(value, prefix, prefix + n);
    const cache = await client.openCache(layout);
    await cache.append(sliceTokens(key, 0, prefix), sliceTokens(value, 0, prefix));
    const qValues = randomNormal(heads * n * headDim, random);
    const q = tensor(qValues, [heads, n, headDim]);
    let output, lse;
    if (dtype === 'float32') {  // Cache.decode, the parents an Array.
      ({output, lse} = await cache.decode(q, {key: newKey, value: newValue, treeParents: TREE,
                                              options: {causal: true, returnLse: true}}));
    } else {  // decodeBatch: the tree (parents an Int32Array) beside a plain causal item.
      const plainLayout = {kvHeads: 1, headDim: 8, valueDim: 8};
      const [pk, pv] = randomTokens(random, plainLayout, 12);
      const plain = await client.openCache(plainLayout);
      await plain.append(sliceTokens(pk, 0, 10), sliceTokens(pv, 0, 10));
      const pq = randomNormal(2 * 3 * 8, random);
      const response = await client.decodeBatch(
          [{cache, query: q, key: newKey, value: newValue, treeParents: Int32Array.from(TREE)},
           {cache: plain, query: tensor(pq, [2, 3, 8]), key: sliceTokens(pk, 10, 12),
            value: sliceTokens(pv, 10, 12)}],
          {causal: true, returnLse: true});
      [output, lse] = [response.outputs[0], response.lse[0]];
      const ref = referenceAttention(
          {q: pq, k: toFloat32Array(pk), v: toFloat32Array(pv),
           dims: {batch: 1, heads: 2, kvHeads: 1, queryLen: 3, keyLen: 12, headDim: 8,
                  valueDim: 8}},
          1 / Math.sqrt(8), true);
      assertClose(toFloat32Array(response.outputs[1]), ref.out, 1e-5, 'the plain item');
      assert.equal(plain.length, 12);
      await plain.delete();
    }
    assert.deepEqual(output.shape.map(Number), [heads, n, valueDim], dtype);
    assert.equal(cache.length, prefix + n, dtype);
    const got = toFloat32Array(output), gotLse = toFloat32Array(lse);
    for (let i = 0; i < n; ++i) {
      const what = `${dtype}: row ${i}`;
      const path = branchOf(TREE, i);
      const branchKey = concatTokens(sliceTokens(key, 0, prefix), pickTokens(key, prefix, path));
      const branchValue = concatTokens(sliceTokens(value, 0, prefix),
                                       pickTokens(value, prefix, path));
      const qRow = rowOf(qValues, heads, n, headDim, i);
      const rowOut = rowOf(got, heads, n, valueDim, i), rowLse = rowOf(gotLse, heads, n, 1, i);
      // float64 over the prefix and the row's branch alone.
      const ref = referenceAttention(
          {q: qRow, k: toFloat32Array(branchKey), v: toFloat32Array(branchValue),
           dims: {batch: 1, heads, kvHeads, queryLen: 1, keyLen: prefix + path.length, headDim,
                  valueDim}},
          1 / Math.sqrt(headDim), true);
      assertClose(rowOut, ref.out, 1e-5, `${what} vs float64`);
      assertClose(rowLse, ref.lse, 1e-5, `${what}'s lse vs float64`);
      // A plain causal decode over a cache holding the prefix and the branch (another path
      // through the kernels: near, not equal).
      const alone = await client.openCache(layout);
      await alone.append(branchKey, branchValue);
      const want = await alone.decode(tensor(qRow, [heads, 1, headDim]),
                                      {options: {causal: true, returnLse: true}});
      assertNear(rowOut, toFloat32Array(want.output), 1e-5, `${what} vs its branch`);
      assertClose(rowLse, toFloat32Array(want.lse), 1e-5, `${what}'s lse vs its branch`);
      await alone.delete();
    }
    await cache.delete();
  }
});

test('tree: a cut keeping one branch equals a cache built from it, bit for bit', async () => {
  const random = mulberry32(4242);
  for (const [layout, prefix] of [
    [{kvHeads: 2, headDim: 16, valueDim: 12, dtype: 'float32', heads: 4}, 29],
    [{kvHeads: 1, headDim: 32, valueDim: 32, dtype: 'bf16', heads: 3}, 41]]) {
    const n = TREE.length;
    const query = (rows) => tensor(randomNormal(layout.heads * rows * layout.headDim, random),
                                   [layout.heads, rows, layout.headDim]);
    const options = {causal: true, returnLse: true};
    const built = [];  // Caches made from the kept tokens, deleted at the end.
    const direct = async (key, value) => {
      const made = await client.openCache(layout);
      await made.append(key, value);
      built.push(made);
      return made;
    };
    const same = async (got, want, cut, made, what) => {
      assert.ok(sameBits(got, want), `${layout.dtype}: ${what}: outputs and lse`);
      assert.deepEqual(exportBytes(await exportAll(client, cut.id)),
                       exportBytes(await exportAll(client, made.id)), `${layout.dtype}: ${what}`);
    };
    let [keptKey, keptValue] = randomTokens(random, layout, prefix);
    const cache = await client.openCache(layout);
    await cache.append(keptKey, keptValue);
    // A tree step, then t0 → t1 accepted: a prefix of the tree, cut in place by truncateTo.
    let [treeKey, treeValue] = randomTokens(random, layout, n);
    await cache.decode(query(n), {key: treeKey, value: treeValue, treeParents: TREE,
                                  options: {causal: true}});
    keptKey = concatTokens(keptKey, sliceTokens(treeKey, 0, 2));
    keptValue = concatTokens(keptValue, sliceTokens(treeValue, 0, 2));
    const q1 = query(3), [k1, v1] = randomTokens(random, layout, 2);
    let got = await cache.decode(q1, {key: k1, value: v1, truncateTo: prefix + 2, options});
    let made = await direct(keptKey, keptValue);
    await same(got, await made.decode(q1, {key: k1, value: v1, options}), cache, made,
               'the branch t0 → t1');
    assert.equal(cache.length, prefix + 4);
    keptKey = concatTokens(keptKey, k1);
    keptValue = concatTokens(keptValue, v1);
    // A cut and a tree in one call: the same bits as the tree over the kept tokens.
    const base = cache.length - 1;
    keptKey = sliceTokens(keptKey, 0, base);
    keptValue = sliceTokens(keptValue, 0, base);
    [treeKey, treeValue] = randomTokens(random, layout, n);
    const q2 = query(n);
    got = await cache.decode(q2, {key: treeKey, value: treeValue, truncateTo: base,
                                  treeParents: TREE, options});
    made = await direct(keptKey, keptValue);
    await same(got, await made.decode(q2, {key: treeKey, value: treeValue, treeParents: TREE,
                                           options}),
               cache, made, 'a cut and a tree');
    // t0 → t2 → t5 accepted: not a prefix, so the whole tree is cut and the branch sent again.
    const path = branchOf(TREE, 5);
    assert.deepEqual(path, [0, 2, 5]);
    const q3 = query(1), [k3, v3] = randomTokens(random, layout, 1);
    got = await cache.decode(q3, {key: concatTokens(pickTokens(treeKey, 0, path), k3),
                                  value: concatTokens(pickTokens(treeValue, 0, path), v3),
                                  truncateTo: base, options});
    keptKey = concatTokens(keptKey, pickTokens(treeKey, 0, path));
    keptValue = concatTokens(keptValue, pickTokens(treeValue, 0, path));
    made = await direct(keptKey, keptValue);
    await same(got, await made.decode(q3, {key: k3, value: v3, options}), cache, made,
               'the branch t0 → t2 → t5');
    assert.equal(cache.length, base + 4);
    for (const c of [cache, ...built]) await c.delete();
  }
});

test('tree: errors name the field (server and client) and leave the cache as it was',
     async () => {
  const random = mulberry32(4343);
  const layout = {kvHeads: 1, headDim: 8, valueDim: 8};
  const cache = await client.openCache(layout), other = await client.openCache(layout);
  await cache.append(...randomTokens(random, layout, 10));
  await other.append(...randomTokens(random, layout, 4));
  const snapshotQuery = tensor(randomNormal(2 * 2 * 8, random), [2, 2, 8]);
  const before = await cacheSnapshot(client, cache.id, snapshotQuery);
  const unchanged = async (what) => {
    assert.deepEqual(await cacheSnapshot(client, cache.id, snapshotQuery), before, what);
    assert.equal(cache.length, 10, what);
  };
  const q = (rows) => tensor(randomNormal(2 * rows * 8, random), [2, rows, 8]);
  const [k7, v7] = randomTokens(random, layout, 7);
  const [k1025, v1025] = randomTokens(random, layout, 1025);
  const q7 = q(7), q1 = q(1);
  const invalid = (pattern) => (err) => err instanceof AttndError &&
      err.code === status.INVALID_ARGUMENT && pattern.test(err.details);
  // The server's checks: counts, rows, a tree without new tokens, more than 1024 new tokens.
  for (const [what, call, pattern] of [
    ['6 parents for 7 tokens',
     () => cache.decode(q7, {key: k7, value: v7, treeParents: TREE.slice(0, 6)}),
     /^items\[0\]\.tree_parents\b/],
    ['5 query rows for 7 tokens',
     () => cache.decode(q(5), {key: k7, value: v7, treeParents: TREE}), /^items\[0\]\.query/],
    ['no new tokens', () => cache.decode(q1, {treeParents: [-1]}), /^items\[0\]\.tree_parents/],
    ['1025 new tokens',
     () => cache.decode(q(1025), {key: k1025, value: v1025, treeParents: Array(1025).fill(-1)}),
     /^items\[0\]\.tree_parents/],
    ['item 1 of a batch',
     () => client.decodeBatch([{cache: other, query: q1},
                               {cache, query: q7, key: k7, value: v7, treeParents: [-1, 0]}]),
     /^items\[1\]\.tree_parents/],
    // Parents that are not earlier, past the client's checks: the server names the entry.
    ['a later parent',
     () => client.decode({items: [{cacheId: cache.id, query: q7, key: k7, value: v7,
                                   expectedLength: 10, treeParents: [-1, 0, 2, 1, 1, 2, -1]}]}),
     /^items\[0\]\.tree_parents\[2\]/],
    ['a parent below −1',
     () => client.decode({items: [{cacheId: cache.id, query: q7, key: k7, value: v7,
                                   expectedLength: 10, treeParents: [-1, 0, 0, -2, 1, 2, -1]}]}),
     /^items\[0\]\.tree_parents\[3\]/],
  ]) {
    await assert.rejects(call(), invalid(pattern), what);
    await unchanged(what);
  }
  assert.equal(other.length, 4);
  // The client's own checks, before any call: TypeError / RangeError naming the entry.
  for (const [parents, kind, pattern] of [
    [[-1, 0.5], TypeError, /treeParents\[1\] is 0\.5/],
    [[-1, true], TypeError, /treeParents\[1\] is true/],
    [['-1'], TypeError, /treeParents\[0\] is '-1'/],
    [Float32Array.from([-1, 0]), TypeError, /treeParents must be/],
    ['-1', TypeError, /treeParents must be/],
    [3, TypeError, /treeParents must be/],
    [[-2], RangeError, /treeParents\[0\] is -2/],
    [[0], RangeError, /treeParents\[0\] is 0/],
    [[-1, 0, 2], RangeError, /treeParents\[2\] is 2/],
    [Int32Array.from([-1, 0, 0, 7]), RangeError, /treeParents\[3\] is 7/],
  ]) {
    const what = `treeParents ${String(parents)}`;
    await assert.rejects(cache.decode(q7, {key: k7, value: v7, treeParents: parents}),
                         (err) => err instanceof kind && pattern.test(err.message) &&
                                  /items\[0\]\./.test(err.message), what);
    await assert.rejects(
        client.decodeBatch([{cache: other, query: q1},
                            {cache, query: q7, key: k7, value: v7, treeParents: parents}]),
        (err) => err instanceof kind && /items\[1\]\.treeParents/.test(err.message), what);
    assert.throws(() => cache.item(q7, k7, v7, {treeParents: parents}), kind, what);
  }
  await unchanged('client-side errors');
  // null and [] are no tree; the tree with a BigInt64Array's parents goes through.
  assert.equal(cache.item(q1, undefined, undefined, {treeParents: []}).treeParents, undefined);
  const [k3, v3] = randomTokens(random, layout, 3);
  await cache.decode(q(2), {key: k3, value: v3, treeParents: null, options: {causal: true}});
  assert.equal(cache.length, 13);
  const step = await cache.decode(q7, {key: k7, value: v7,
                                       treeParents: BigInt64Array.from(TREE.map(BigInt)),
                                       options: {causal: true}});
  assert.deepEqual(step.output.shape.map(Number), [2, 7, 8]);
  assert.equal(cache.length, 20);
  await cache.delete();
  await other.delete();
});

test('recovery: after cuts refresh() never re-sends a cut token (SIGKILL, restart, lost answers)',
     {skip: noAttnd}, async () => {
  const dir = path.join(scratch, 'cache-dir-cut');
  // No write-behind pass runs during the test: tokens are durable only where a cut made them so.
  const flags = ['--cache-dir', dir, '--cache-sync-seconds', '86400'];
  const a = await startAttnd('cut-a', flags);
  const clientA = new Client(a.target, {deadlineMs: 60000});
  let clientB = null;
  try {
    const random = mulberry32(3434);
    const layout = {kvHeads: 2, headDim: 16, valueDim: 8, dtype: 'bf16'};
    const cache = await clientA.openCache(layout);
    const sent = [5, 7, 3].map((n) => randomTokens(random, layout, n));
    for (const [k, v] of sent) await cache.append(k, v);
    const durable = () => Number(cache.info.durableLength);
    const expectTail = (ranges) => assert.deepEqual(
        tailRanges(cache), ranges.filter(([s, n]) => s + n > durable()));
    expectTail([[0, 5], [5, 7], [12, 3]]);
    assert.equal((await cache.truncate(9)).length, 9);
    expectTail([[0, 5], [5, 4]]);
    const [k1, v1] = randomTokens(random, layout, 3);
    const step = await cache.decode(tensor(randomNormal(4 * 16, random), [4, 1, 16], 'bf16'),
                                    {key: k1, value: v1, truncateTo: 7});
    assert.equal(step.cache.length, 10);
    expectTail([[0, 5], [5, 2], [7, 3]]);
    // What the cache must hold: the same tokens appended directly, on args.target.
    const direct = await client.openCache(layout);
    await direct.append(concatTokens(sent[0][0], sliceTokens(sent[1][0], 0, 2), k1),
                        concatTokens(sent[0][1], sliceTokens(sent[1][1], 0, 2), v1));
    const want = exportBytes(await exportAll(client, direct.id));
    assert.deepEqual(exportBytes(await exportAll(clientA, cache.id)), want);

    a.kill();
    await a.stop();  // Its exit: the directory is free for the next attnd.
    const b = await startAttnd('cut-b', flags);
    clientB = countingClient(b.target);
    const held = Number((await clientB.getCacheInfo(cache.id)).length);
    assert.ok(held >= durable() && held <= 10, `B restored ${held} tokens`);
    const moved = new Cache(clientB, cache.info, {tail: cache.tail});
    assert.equal((await moved.refresh()).length, 10);
    assert.deepEqual(exportBytes(await exportAll(clientB, cache.id)), want, 'refreshed');

    // A cut applied whose answer is lost: the Cache still believes 10, its tail is cut at 6,
    // and refresh() takes the server's 6 without re-sending anything.
    const truncateCache = clientB.truncateCache.bind(clientB);
    clientB.truncateCache = async (request, options) => {
      clientB.truncateCache = truncateCache;
      await truncateCache(request, options);
      throw new AttndError({code: status.UNAVAILABLE, details: 'connection lost (a test)'});
    };
    const appends = clientB.appends.length;
    await assert.rejects(moved.truncate(6), (err) => err.code === status.UNAVAILABLE);
    assert.equal(moved.length, 10);
    assert.ok(moved.tail.every((e) => e.start + e.key.shape.at(-2) <= 6), 'the tail cut at 6');
    assert.equal((await moved.refresh()).length, 6);
    assert.equal(clientB.appends.length, appends, 'nothing re-sent');
    await direct.truncate(6);
    assert.deepEqual(exportBytes(await exportAll(clientB, cache.id)),
                     exportBytes(await exportAll(client, direct.id)), 'after the lost answer');
    // A refused cut keeps the tail.
    const tail = tailRanges(moved);
    await assert.rejects(moved.truncate(2, {expectedLength: 9}),
                         (err) => err.code === status.FAILED_PRECONDITION);
    assert.deepEqual([tailRanges(moved), moved.length], [tail, 6]);
    await direct.delete();
    await moved.delete();
  } finally {
    clientA.close();
    clientB?.close();
  }
});

// --- latent caches (CreateCacheRequest.valuesFromKeys: MLA) ----------------------------------------
// Keys [kvHeads, n, headDim] as stored (rounded to dtype) kept per kv head; each token's value is
// its key's first valueDim columns.
class LatentKeys {
  constructor({kvHeads, headDim, valueDim, dtype = 'float32'}) {
    Object.assign(this, {kvHeads, headDim, valueDim, dtype, keys: []});
    for (let h = 0; h < kvHeads; ++h) this.keys.push([]);
  }
  // n random keys as a Tensor in dtype, added to the held copy as the server stores them.
  tokens(n, random) {
    const {kvHeads, headDim, dtype} = this;
    const t = tensor(randomNormal(kvHeads * n * headDim, random), [kvHeads, n, headDim], dtype);
    const stored = toFloat32Array(t);
    for (let h = 0; h < kvHeads; ++h) {
      this.keys[h].push(...stored.subarray(h * n * headDim, (h + 1) * n * headDim));
    }
    return t;
  }
  get length() { return this.keys[0].length / this.headDim; }
  // The float64 reference for q [heads, nq, headDim] over every held key, values from the keys.
  reference(q, heads, nq, causal) {
    const {kvHeads, headDim, valueDim, length} = this;
    const values = this.keys.map((k) => Array.from({length},
        (_, j) => k.slice(j * headDim, j * headDim + valueDim)).flat());
    const dims = {batch: 1, heads, kvHeads, queryLen: nq, keyLen: length, headDim, valueDim};
    return referenceAttention({q, k: Float32Array.from(this.keys.flat()),
                               v: Float32Array.from(values.flat()), dims},
                              1 / Math.sqrt(headDim), causal);
  }
}

const latentSeed = Number(process.env.ATTN_TEST_SEED ?? Math.floor(Math.random() * 2 ** 31));

test('latent caches: keys alone, decode against float64 with values from the keys; bytes',
     async (t) => {
  t.diagnostic(`seed ${latentSeed} (ATTN_TEST_SEED)`);
  const random = mulberry32(latentSeed);
  const page = Number((await client.info()).cachePageTokens);
  for (const layout of [{kvHeads: 1, headDim: 72, valueDim: 40, heads: 13, dtype: 'float32'},
                        {kvHeads: 3, headDim: 37, valueDim: 29, heads: 9, dtype: 'bf16'}]) {
    const {kvHeads, headDim, valueDim, heads, dtype} = layout;
    const what = `${dtype} [${kvHeads}, n, ${headDim}] → ${valueDim}`;
    const cache = await client.openCache({kvHeads, headDim, valueDim, dtype,
                                          valuesFromKeys: true});
    assert.equal(cache.valuesFromKeys, true, what);
    assert.equal(cache.info.valuesFromKeys, true);
    assert.equal(Number(cache.info.valueDim), valueDim);
    const held = new LatentKeys(layout);
    await cache.append(held.tokens(page + 5, random));
    await cache.append(held.tokens(6, random), null);  // A null value is none.
    assert.equal(cache.length, page + 11);
    // Pages of keys alone.
    const element = dtype === 'bf16' ? 2 : 4;
    assert.equal(Number(cache.info.bytes), 2 * page * kvHeads * headDim * element, what);
    // One step through Cache.decode: the key alone.
    const q = randomNormal(heads * headDim, random);
    const step = await cache.decode(tensor(q, [heads, 1, headDim]),
                                    {key: held.tokens(1, random), options: {returnLse: true}});
    assert.equal(step.cache.length, page + 12);
    assert.deepEqual(step.output.shape, [heads, 1, valueDim]);
    const ref = held.reference(q, heads, 1, false);
    assertClose(toFloat32Array(step.output), ref.out, 1e-5, `${what}: Cache.decode`);
    assertClose(toFloat32Array(step.lse), ref.lse, 1e-5, `${what}: Cache.decode lse`);
    // A batch: three causal rows over three new keys.
    const q3 = randomNormal(heads * 3 * headDim, random);
    const response = await client.decodeBatch(
        [{cache, query: tensor(q3, [heads, 3, headDim]), key: held.tokens(3, random)}],
        {causal: true});
    assert.equal(cache.length, page + 15);
    assertClose(toFloat32Array(response.outputs[0]), held.reference(q3, heads, 3, true).out,
                1e-5, `${what}: decodeBatch`);
    // Exports carry keys alone; an import keeps the cache latent, every byte the same.
    const chunks = await exportAll(client, cache.id);
    assert.equal(chunks[0].info.valuesFromKeys, true);
    assert.ok(chunks.every((c) => !c.value), 'no chunk carries a value');
    const copy = await client.importCache(chunks, {newIdIfTaken: true});
    assert.notEqual(copy.id, cache.id);
    assert.equal(copy.valuesFromKeys, true);
    assert.deepEqual(exportBytes(await exportAll(client, copy.id)), exportBytes(chunks));
    const query = tensor(q, [heads, 1, headDim]);
    const [a, b] = [await cache.decode(query), await copy.decode(query)];
    assert.deepEqual(b.output.data, a.output.data, `${what}: the copy decodes the same bits`);
    await copy.delete();
    await cache.delete();
  }

  // With valueDim = headDim a latent cache takes half the memory of one storing both.
  const layout = {kvHeads: 2, headDim: 24, valueDim: 24, dtype: 'bf16'};
  const latent = await client.openCache({...layout, valuesFromKeys: true});
  const both = await client.openCache(layout);
  const keys = new LatentKeys(layout).tokens(2 * page + 3, random);
  await latent.append(keys);
  await both.append(keys, keys);
  assert.equal(2 * Number(latent.info.bytes), Number(both.info.bytes));
  await latent.delete();
  await both.delete();
});

test('latent caches: a value is refused by the client before any call and by the server; ' +
     'valueDim > headDim is INVALID_ARGUMENT naming value_dim', async () => {
  const random = mulberry32(latentSeed ^ 0x5bd1e995);
  const layout = {kvHeads: 1, headDim: 72, valueDim: 40};
  const cache = await client.openCache({...layout, valuesFromKeys: true});
  const held = new LatentKeys(layout);
  await cache.append(held.tokens(9, random));
  const key = held.tokens(2, random);
  const value = tensor(randomNormal(2 * 40, random), [1, 2, 40]);
  const query = tensor(randomNormal(13 * 72, random), [13, 1, 72]);
  // A Cache on a client that reaches no server: a TypeError, not UNAVAILABLE, so no call.
  const nowhere = new Client('127.0.0.1:1', {deadlineMs: 2000});
  try {
    const offline = new Cache(nowhere, cache.info);
    const latent = (name) => (err) => err instanceof TypeError &&
        new RegExp(`^${name.replace(/[[\].]/g, '\\$&')}: .*latent`).test(err.message);
    await assert.rejects(offline.append(key, value), latent('value'));
    await assert.rejects(offline.decode(query, {key, value}), latent('items[0].value'));
    await assert.rejects(nowhere.decodeBatch([{cache: offline, query, key, value}]),
                         latent('items[0].value'));
    assert.throws(() => offline.item(query, key, value, {}, 'items[3].'), latent('items[3].value'));
    // A cache storing values needs one with each key.
    const ordinary = new Cache(nowhere, {...cache.info, valuesFromKeys: false});
    await assert.rejects(ordinary.append(key), (err) => err instanceof TypeError &&
                         /^value is missing/.test(err.message));
    assert.throws(() => ordinary.item(query, key), /^TypeError: value is missing/);
  } finally {
    nowhere.close();
  }
  // The server refuses one sent anyway, naming the field; the cache keeps its 9 tokens.
  await assert.rejects(
      client.appendCache({cacheId: cache.id, key, value, expectedLength: 9}),
      (err) => err.code === status.INVALID_ARGUMENT && /^value\b.*latent/.test(err.details));
  await assert.rejects(
      client.decode({items: [{cacheId: cache.id, query, key, value, expectedLength: 9}]}),
      (err) => err.code === status.INVALID_ARGUMENT &&
               /^items\[0\]\.value\b.*latent/.test(err.details));
  assert.equal((await cache.refresh()).length, 9);
  assert.equal((await cache.append(key)).length, 11);
  await cache.delete();
  // value_dim past head_dim.
  await assert.rejects(
      client.createCache({kvHeads: 1, headDim: 72, valueDim: 73, valuesFromKeys: true}),
      (err) => err.code === status.INVALID_ARGUMENT && /^value_dim\b.*73/.test(err.details));
  await assert.rejects(client.createCache({kvHeads: 1, headDim: 8, valuesFromKeys: 1}),
                       TypeError);
});

test('latent caches: a restart keeps them latent; refresh() re-sends the lost tail as keys alone',
     {skip: noAttnd}, async () => {
  const dir = path.join(scratch, 'cache-dir-latent');
  // No write-behind pass runs during the test: a SIGTERM's flush makes tokens durable.
  const flags = ['--cache-dir', dir, '--cache-sync-seconds', '86400'];
  const random = mulberry32(latentSeed ^ 0x1b873593);
  const layout = {kvHeads: 1, headDim: 72, valueDim: 40, dtype: 'fp16'};
  const held = new LatentKeys(layout);
  const a = await startAttnd('latent-a', flags);
  let clientA = new Client(a.target, {deadlineMs: 60000});
  const cache = await clientA.openCache({...layout, valuesFromKeys: true});
  const first = held.tokens(20, random);
  await cache.append(first);
  clientA.close();
  await a.stop();  // SIGTERM: the 20 tokens flushed.

  const b = await startAttnd('latent-b', flags);
  const clientB = new Client(b.target, {deadlineMs: 60000});
  let clientC = null;
  try {
    const reopened = await clientB.openCache(cache.id);
    assert.equal(reopened.valuesFromKeys, true);
    assert.deepEqual([reopened.length, Number(reopened.info.durableLength),
                      Number(reopened.info.valueDim)], [20, 20, 40]);
    // Tokens a SIGKILL loses, kept in the tail as keys alone.
    const more = held.tokens(9, random), step = held.tokens(2, random);
    await reopened.append(more);
    await reopened.decode(tensor(randomNormal(5 * 72, random), [5, 1, 72]), {key: step});
    assert.deepEqual(tailRanges(reopened), [[20, 9], [29, 2]]);
    assert.ok(reopened.tail.every((e) => e.value === null), 'the tail keeps keys alone');
    b.kill();
    await b.stop();

    const c = await startAttnd('latent-c', flags);
    clientC = countingClient(c.target);
    const restored = await clientC.getCacheInfo(cache.id);
    assert.equal(restored.valuesFromKeys, true);
    const lost = Number(restored.length);
    assert.ok(lost >= 20 && lost < 31, `the restart holds ${lost} tokens`);
    const moved = new Cache(clientC, reopened.info, {tail: reopened.tail});
    assert.equal((await moved.refresh()).length, 31);
    assert.ok(clientC.appends.length > 0);
    assert.ok(clientC.appends.every((append) => append.valueShape === undefined));
    assert.equal(clientC.appends.reduce((n, append) => n + append.keyShape[1], 0), 31 - lost);
    const {key, value} = exportBytes(await exportAll(clientC, cache.id));
    assert.deepEqual(key, concatTokens(first, more, step).data);
    assert.equal(value.length, 0);
    const q = randomNormal(5 * 72, random);
    const out = await moved.decode(tensor(q, [5, 1, 72]));
    assertClose(toFloat32Array(out.output), held.reference(q, 5, 1, false).out, 1e-5,
                'decode after refresh');
    await moved.delete();
  } finally {
    clientB.close();
    clientC?.close();
  }
});
