#!/usr/bin/python3
"""Tests of the Python client module client/python/attn_client.py against a live attnd.

Starts attnd (tests/python/attnd_harness.py: a free loopback port, no HTTP side port) and goes
through the module only: GetServerInfo and health; the seed example's out[0] from Naive and
Tiled against a float64 NumPy reference; a random odd-sized GQA problem (rank 4 causal and rank
3 with key_len ≠ query_len) in fp32, fp16 and bf16 against the reference with the project's
tolerances (attnd_harness.output_error); the seed trace with block_k 2 (every step's running
state, the final estimate equal to Tiled's row), a multi-row trace and example.py; sliding
windows (window_left / window_right through Naive, Tiled and Decode against a float64 reference
that applies the window key by key, Trace's start repeating the window and each row's steps
beginning at the first tile it sees); softcaps (softcap through Naive, Tiled and Decode on
problems whose scores pass the cap, against a float64 reference that scales, caps and then
masks; Trace's start repeating it, each step's scaled_scores and capped scores); ALiBi
(alibi_slopes through Naive, Tiled and Decode, GQA, causal, windowed, softcapped and at
positions, against a float64 reference that adds −slope·|p − t| after the cap and before the
mask; "standard" equal to standard_alibi_slopes and its known values; Trace's start repeating
the slopes, each step's biases −slope·|p − t| and scores softcap(scaled) + bias; a wrong count
→ INVALID_ARGUMENT naming options.alibi_slopes); attention sinks (sinks through Naive, Tiled,
Decode, Cache.decode and Tiled over a cache, against a float64 reference of the contract's
formula: GQA with different sinks on the heads of one kv head, causal, windowed on one or both
sides, with softcap and ALiBi, at positions, ragged, sinks near, far above (50) and far below
(−50) the scores, each head checked at its own scale; rows that see no key → zeros and lse =
the sink; Trace's start repeating them, steps without the sink, row_done's output, reference,
lse and sink_share = e^(sink − lse); a wrong count → INVALID_ARGUMENT naming options.sinks, a
non-finite sink sent past the client → naming options.sinks[2]); errors (a bad shape → AttnError
INVALID_ARGUMENT naming key.shape, on every RPC; local argument errors, bad windows, softcaps,
ALiBi slopes and sinks among them, raise ValueError/TypeError naming the argument (sinks[h])
without any RPC);
a second attnd with --auth-token-file (no token or a wrong one → UNAUTHENTICATED, the
token → OK, health without one); and, when openssl is present, a third attnd with TLS reached
through tls_ca. Run by CTest as

  /usr/bin/python3 tests/python/test_client_module.py --attnd <attnd> --stubs <stubs dir>

Needs the Debian python3-grpcio and python3-numpy (hence /usr/bin/python3); stdlib unittest.
"""

import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import attnd_harness as harness  # tests/python is sys.path[0] for a script.

ARGS = harness.parse_args(__doc__, unittest=True)
REPO_ROOT = harness.REPO_ROOT

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import attn_client  # noqa: E402
from attn_client import AttnError, Client  # noqa: E402
from attnd_harness import DTYPE_NUMBER, SEED_OUT_ROW0, as4  # noqa: E402

RPC_TIMEOUT_S = 60.0


def stored(array, dtype):
    """(what to pass the client, the float64 values the server will see) for a float32 array
    stored as `dtype`."""
    if dtype == "fp32":
        return array, array.astype(np.float64)
    if dtype == "fp16":
        half = array.astype(np.float16)
        return half, half.astype(np.float64)
    bits = attn_client.float32_to_bf16(array)
    return bits, attn_client.bf16_to_float32(bits).astype(np.float64)


def window_reference(q, k, v, causal, window_left=None, window_right=None, key_position=0,
                     query_position=None):
    """float64 attention over [B, H, Nq, d] / [B, Hkv, Nk, d] / [B, Hkv, Nk, dv], each row
    over the keys it sees, decided key by key: key j at t = key_position + j is seen by the
    query at p = query_position + i (None: key_position + Nk − Nq) iff p − window_left ≤ t ≤
    p + window_right (a None side unbounded) and, when causal, t ≤ p. → (out, lse); a row that
    sees no key gives zeros and lse −inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, heads, query_len, head_dim = q.shape
    kv_heads, key_len = k.shape[1], k.shape[2]
    if query_position is None:
        query_position = key_position + key_len - query_len
    scale = 1.0 / math.sqrt(head_dim)
    out = np.zeros((batch, heads, query_len, v.shape[3]))
    lse = np.full((batch, heads, query_len), -math.inf)
    for b in range(batch):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            for i in range(query_len):
                p = query_position + i
                seen = [j for j in range(key_len)
                        if not (causal and key_position + j > p)
                        and not (window_left is not None and key_position + j < p - window_left)
                        and not (window_right is not None
                                 and key_position + j > p + window_right)]
                if not seen:
                    continue
                scores = np.array([scale * (q[b, h, i] @ k[b, kv, j]) for j in seen])
                row_max = scores.max()
                weights = np.exp(scores - row_max)
                out[b, h, i] = weights @ v[b, kv, seen] / weights.sum()
                lse[b, h, i] = row_max + math.log(weights.sum())
    return out, lse


def softcap_reference(q, k, v, causal, softcap, window_left=None, key_position=0,
                      query_position=None, alibi_slopes=None):
    """float64 attention over [B, H, Nq, d] / [B, Hkv, Nk, d] / [B, Hkv, Nk, dv] in the
    contract's order: the scores scale · q·k (scale 1/sqrt(d)), then softcap · tanh(s /
    softcap) (softcap 0: none), then the ALiBi bias −alibi_slopes[h] · |p − t| (None: none),
    then the mask (causal and window_left over positions, as in window_reference) →
    (out, lse, score_max), score_max the largest |capped score| + |bias| the softmax takes (of
    the keys seen; without a bias the largest |score|, ≤ softcap when capped), which bounds the
    fp32 error of a score, for harness.output_error; a row that sees no key gives zeros and lse
    −inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    heads, query_len, head_dim = q.shape[1:]
    kv_heads, key_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    if query_position is None:
        query_position = key_position + key_len - query_len
    scaled = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(head_dim)       # [B, H, Nq, Nk]
    scores = softcap * np.tanh(scaled / softcap) if softcap else scaled.copy()
    p = query_position + np.arange(query_len)[:, None]
    t = key_position + np.arange(key_len)[None, :]
    magnitude = np.abs(scores)
    if alibi_slopes is not None and len(alibi_slopes):
        slopes = np.asarray(alibi_slopes, dtype=np.float64).reshape(1, heads, 1, 1)
        bias = -slopes * np.abs(p - t)                                  # [1, H, Nq, Nk]
        scores = scores + bias
        magnitude = magnitude + np.abs(bias)
    hidden = np.zeros((query_len, key_len), dtype=bool)
    if causal:
        hidden |= t > p
    if window_left is not None:
        hidden |= t < p - window_left
    scores[..., hidden] = -math.inf
    row_max = scores.max(axis=-1, keepdims=True)
    seen = np.isfinite(row_max)
    weights = np.where(seen, np.exp(scores - np.where(seen, row_max, 0.0)), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    out = np.where(seen, weights @ v / np.where(seen, total, 1.0), 0.0)
    lse = np.where(seen, row_max + np.log(np.where(seen, total, 1.0)), -math.inf)[..., 0]
    visible = np.isfinite(scores)
    return out, lse, float(np.max(magnitude[visible])) if visible.any() else 0.0


def sink_reference(q, k, v, causal, sinks=None, softcap=0.0, window_left=None,
                   window_right=None, key_position=0, query_position=None, alibi_slopes=None):
    """float64 attention with attention sinks, from the contract's formula (attention.proto,
    AttentionOptions.sinks), over [B, H, Nq, d] / [B, Hkv, Nk, d] / [B, Hkv, Nk, dv]: the
    scores x_j = scale · q·k (scale 1/sqrt(d)), softcapped (softcap 0: none), biased by
    −alibi_slopes[h] · |p − t| (None: none) and masked (causal, window_left, window_right over
    positions, as in window_reference); then per row of head h, with s = sinks[h] (None or
    empty: no sink, s = −inf):

        m = max(max_j x_j, s)
        out = Σ_j e^(x_j − m) v_j / (Σ_j e^(x_j − m) + e^(s − m))
        lse = m + log(Σ_j e^(x_j − m) + e^(s − m))
        sink_share = e^(s − lse)

    → (out, lse, score_max, sink_share): out [B, H, Nq, dv], lse and sink_share [B, H, Nq],
    score_max [H], per head the largest |capped score| + |bias| of a key seen and |s|, which
    bounds the fp32 error of an exponent (harness.output_error). A row that sees no key gives
    zeros and lse = s (−inf without sinks), sink_share 1 (0 without)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, heads, query_len, head_dim = q.shape
    kv_heads, key_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    if query_position is None:
        query_position = key_position + key_len - query_len
    scores = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(head_dim)       # [B, H, Nq, Nk]
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    p = query_position + np.arange(query_len)[:, None]
    t = key_position + np.arange(key_len)[None, :]
    magnitude = np.abs(scores)
    if alibi_slopes is not None and len(alibi_slopes):
        slopes = np.asarray(alibi_slopes, dtype=np.float64).reshape(1, heads, 1, 1)
        bias = -slopes * np.abs(p - t)
        scores = scores + bias
        magnitude = magnitude + np.abs(bias)
    hidden = np.zeros((query_len, key_len), dtype=bool)
    if causal:
        hidden |= t > p
    if window_left is not None:
        hidden |= t < p - window_left
    if window_right is not None:
        hidden |= t > p + window_right
    scores[..., hidden] = -math.inf
    if sinks is None or len(sinks) == 0:
        sink = np.full((1, heads, 1, 1), -math.inf)
    else:
        sink = np.asarray(sinks, dtype=np.float64).reshape(1, heads, 1, 1)
    # m is −inf only for a row that sees no key without a sink.
    m = np.maximum(scores.max(axis=-1, keepdims=True, initial=-math.inf), sink)
    finite = np.isfinite(m)
    safe_m = np.where(finite, m, 0.0)                                # never −inf − (−inf)
    weights = np.exp(scores - safe_m)                                # 0 where hidden
    denominator = weights.sum(axis=-1, keepdims=True) + np.exp(sink - safe_m)
    positive = denominator > 0
    out = np.where(positive, (weights @ v) / np.where(positive, denominator, 1.0), 0.0)
    lse = np.where(positive, safe_m + np.log(np.where(positive, denominator, 1.0)),
                   -math.inf)
    share = np.where(np.isfinite(lse), np.exp(sink - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    seen = np.broadcast_to(~hidden, magnitude.shape)
    score_max = np.where(seen, magnitude, 0.0).max(axis=(0, 2, 3), initial=0.0)
    score_max = np.maximum(score_max, np.where(np.isfinite(sink), np.abs(sink), 0.0).reshape(-1))
    return out, lse[..., 0], score_max, share[..., 0]


def fill_caches(rng, caches, lengths):
    """Appends uniform(-1, 1) fp32 keys and values of each length to each cache (its kv_heads,
    head_dim and value_dim) → [(k, v)], what each now holds."""
    held = []
    for cache, length in zip(caches, lengths):
        k = rng.uniform(-1, 1, size=(cache.kv_heads, length, cache.head_dim)).astype(np.float32)
        v = rng.uniform(-1, 1, size=(cache.kv_heads, length, cache.value_dim)).astype(np.float32)
        cache.append(k, v)
        held.append((k, v))
    return held


class ServerCase(unittest.TestCase):
    """Base: one attnd for the class (started with `server_args`), its stderr shown on failure."""

    server_args = ()
    server = None
    client = None
    _failed = False

    @classmethod
    def start_server(cls):
        return harness.AttndProcess(ARGS.attnd, ("--threads", "2") + tuple(cls.server_args))

    @classmethod
    def setUpClass(cls):
        cls._failed = False
        cls.server = cls.start_server()

    @classmethod
    def tearDownClass(cls):
        if cls.client is not None:
            cls.client.close()
            cls.client = None
        if cls.server is not None:
            cls.server.stop()
            if cls._failed:
                sys.stderr.write("\n--- attnd stderr (%s) ---\n%s--- end attnd stderr ---\n"
                                 % (cls.__name__, cls.server.stderr()))
            cls.server.close()
            cls.server = None

    def run(self, result=None):
        result = super().run(result)
        if result is not None and not result.wasSuccessful():
            type(self)._failed = True
        return result


class ClientModuleTest(ServerCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.client = Client(cls.server.address, timeout=RPC_TIMEOUT_S)

    # GetServerInfo and health.

    def test_info(self):
        info = self.client.info()
        self.assertTrue(info["version"])
        self.assertIn(info["backend"], ("cpu", "cuda"))
        self.assertEqual(sorted(info["dtypes"]), ["bf16", "fp16", "fp32"])
        self.assertGreater(info["default_block_k"], 0)
        self.assertGreater(info["max_message_bytes"], 0)
        self.assertGreater(info["max_naive_bytes"], 0)
        self.assertGreater(info["max_trace_rows"], 0)

    def test_health(self):
        self.assertEqual(self.client.health(), "SERVING")

    # The seed example.

    def test_seed_example(self):
        q, k, v = attn_client.seed_example()
        ref, ref_lse, _ = harness.reference_attention(as4(q), as4(k), as4(v), scale=0.5)
        for name in ("naive", "tiled"):
            with self.subTest(rpc=name):
                result = getattr(self.client, name)(q, k, v, scale=0.5, block_k=3,
                                                    return_lse=True)
                self.assertEqual(result.output.dtype, np.float32)
                self.assertEqual(result.output_dtype, "fp32")
                self.assertEqual(result.output.shape, (8, 4))
                np.testing.assert_allclose(result.output[0], ref[0, 0, 0], rtol=0, atol=1e-6)
                np.testing.assert_allclose(result.output[0], SEED_OUT_ROW0, rtol=0, atol=1e-6)
                self.assertEqual(harness.output_error(result.output.astype(np.float64),
                                                      ref[0, 0], 1), "")
                self.assertEqual(result.lse.dtype, np.float32)
                self.assertEqual(result.lse.shape, (8,))
                self.assertEqual(harness.lse_error(result.lse.astype(np.float64),
                                                   ref_lse[0, 0]), "")
                stats = result.stats
                self.assertIsInstance(stats, dict)
                self.assertEqual(stats["backend"], self.client.info()["backend"])
                self.assertEqual(stats["flops"], 4 * 8 * 8 * 4)
                self.assertEqual(stats["intermediate_bytes"], 1024 if name == "naive" else 0)
                self.assertEqual(stats["block_k"], 0 if name == "naive" else 3)
                # Where server_ns went, a dict of its own (ExecutionStats.stages).
                stages = stats["stages"]
                self.assertEqual(sorted(stages),
                                 ["finish_ns", "handler_ns", "prepare_ns", "queue_ns"])
                self.assertGreater(stages["handler_ns"], 0)
                self.assertLessEqual(sum(stages.values()) + stats["compute_ns"],
                                     stats["server_ns"])
        # The default scale is 1/sqrt(head_dim) = 1/2 here too; no lse unless asked.
        result = self.client.tiled(q, k, v)
        self.assertIsNone(result.lse)
        np.testing.assert_allclose(result.output[0], SEED_OUT_ROW0, rtol=0, atol=1e-6)

    # Random odd-sized problems in every dtype.

    def check_random(self, q_shape, k_shape, v_shape, causal, block_k):
        rng = np.random.default_rng()
        q32 = rng.uniform(-1, 1, size=q_shape).astype(np.float32)
        k32 = rng.uniform(-1, 1, size=k_shape).astype(np.float32)
        v32 = rng.uniform(-1, 1, size=v_shape).astype(np.float32)
        for dtype in ("fp32", "fp16", "bf16"):
            (q, q_seen), (k, k_seen), (v, v_seen) = (stored(x, dtype) for x in (q32, k32, v32))
            ref, ref_lse, score_max = harness.reference_attention(
                as4(q_seen), as4(k_seen), as4(v_seen), causal=causal)
            ref = ref.reshape(q_shape[:-1] + v_shape[-1:])
            ref_lse = ref_lse.reshape(q_shape[:-1])
            passed_dtype = "bf16" if dtype == "bf16" else None  # fp32/fp16 inferred
            for name in ("naive", "tiled"):
                with self.subTest(dtype=dtype, rpc=name, shape=q_shape):
                    result = getattr(self.client, name)(q, k, v, causal=causal,
                                                        block_k=block_k, return_lse=True,
                                                        dtype=passed_dtype)
                    self.assertEqual(result.output_dtype, dtype)
                    self.assertEqual(result.output.dtype,
                                     {"fp32": np.float32, "fp16": np.float16,
                                      "bf16": np.uint16}[dtype])
                    out = result.output_float32().astype(np.float64)
                    self.assertEqual(out.shape, ref.shape)
                    self.assertEqual(
                        harness.output_error(out, ref, DTYPE_NUMBER[dtype], score_max), "")
                    self.assertEqual(harness.lse_error(result.lse.astype(np.float64), ref_lse),
                                     "")
                    if name == "tiled":
                        self.assertEqual(result.stats["block_k"], block_k)
            # Low-precision input, fp32 output: only the fp32 accumulation error remains.
            if dtype != "fp32":
                with self.subTest(dtype=dtype, output_dtype="fp32"):
                    result = self.client.tiled(q, k, v, causal=causal, block_k=block_k,
                                               dtype=passed_dtype, output_dtype="fp32")
                    self.assertEqual(result.output.dtype, np.float32)
                    self.assertEqual(harness.output_error(result.output.astype(np.float64), ref,
                                                          1, score_max), "")

    def test_random_gqa_causal_rank4(self):
        self.check_random((2, 4, 37, 33), (2, 2, 53, 33), (2, 2, 53, 20), causal=True, block_k=7)

    def test_random_gqa_rank3(self):
        self.check_random((6, 29, 17), (3, 41, 17), (3, 41, 11), causal=False, block_k=5)

    def test_float32_to_bf16_rounds_to_nearest_even_from_the_definition(self):
        # Against the rule written out per value: the nearest bfloat16 (ties to the even one),
        # NaNs quiet with their sign and top payload bits, ±inf and values rounding past the
        # largest finite one to ±inf. Every 65521st bit pattern, ties, and the edges.
        def nearest(bits):
            if (bits & 0x7FFFFFFF) > 0x7F800000:
                return (bits >> 16) | 0x40
            low, high = bits & 0xFFFF, bits >> 16
            if low > 0x8000 or (low == 0x8000 and high & 1):
                high += 1
            return high
        patterns = list(range(0, 2**32, 65521))
        patterns += [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x7F800000,
                     0xFF800000, 0x7F800001, 0xFFC00000, 0x80000000, 0x00008000, 0x00018000]
        bits = np.array(patterns, dtype=np.uint32)
        got = attn_client.float32_to_bf16(bits.view(np.float32))
        self.assertEqual(got.dtype, np.uint16)
        np.testing.assert_array_equal(got,
                                      np.array([nearest(b) for b in patterns], dtype=np.uint16))

    def test_response_tensors_decode_to_writable_arrays_and_bad_ones_raise(self):
        # Answers are read as one writable copy of their bytes, in their shape; a tensor whose
        # bytes do not fill its shape, or with a negative dimension or an unknown dtype, is an
        # INTERNAL AttnError (a broken server), never a NumPy error or a wrong array.
        pb = attn_client.pb
        rng = np.random.default_rng()
        values = rng.standard_normal((3, 1, 5)).astype(np.float32)
        for dtype, data, expected in (
                (pb.DTYPE_FLOAT32, values.tobytes(), values),
                (pb.DTYPE_FLOAT16, values.astype(np.float16).tobytes(), values.astype(np.float16)),
                (pb.DTYPE_BFLOAT16, attn_client.float32_to_bf16(values).tobytes(),
                 attn_client.float32_to_bf16(values))):
            got = attn_client._decode(pb.Tensor(shape=[3, 1, 5], dtype=dtype, data=data))
            np.testing.assert_array_equal(got, expected)
            self.assertEqual(got.dtype, expected.dtype)
            got[0, 0, 0] = 0  # Writable, and not a view of the message's bytes.
        data = values.tobytes()
        bad = (pb.Tensor(shape=[3, 1, 5], dtype=pb.DTYPE_FLOAT32, data=data[:-4]),
               pb.Tensor(shape=[3, 1, 5], dtype=pb.DTYPE_FLOAT32, data=data + b"\0" * 4),
               pb.Tensor(shape=[-3, -5], dtype=pb.DTYPE_FLOAT32, data=data),
               pb.Tensor(shape=[15], dtype=9, data=data))
        for tensor in bad:
            with self.assertRaises(AttnError) as raised:
                attn_client._decode(tensor)
            self.assertEqual(raised.exception.code, grpc.StatusCode.INTERNAL)

    def test_bf16_from_float_arrays(self):
        # dtype="bf16" on float32 arrays rounds them the same way float32_to_bf16 does.
        q, k, v = attn_client.seed_example()
        from_floats = self.client.tiled(q, k, v, dtype="bf16")
        from_bits = self.client.tiled(*(attn_client.float32_to_bf16(x) for x in (q, k, v)),
                                      dtype="bf16")
        np.testing.assert_array_equal(from_floats.output, from_bits.output)
        self.assertEqual(from_floats.output_dtype, "bf16")
        np.testing.assert_allclose(from_floats.output_float32()[0], SEED_OUT_ROW0, atol=2e-2)

    # Trace.

    def test_trace_seed_example(self):
        q, k, v = attn_client.seed_example()
        events = list(self.client.trace(q, k, v, rows=[(0, 0, 0)], block_k=2, scale=0.5))
        kinds = [event["kind"] for event in events]
        self.assertEqual(kinds, ["start"] + ["step"] * 4 + ["row_done", "end"])
        start = events[0]
        self.assertEqual((start["query_len"], start["key_len"], start["head_dim"],
                          start["value_dim"], start["block_k"], start["tiles_per_row"]),
                         (8, 8, 4, 4, 2, 4))
        self.assertEqual(start["naive_intermediate_bytes"], 1024)
        self.assertEqual(start["tiled_scratch_floats_per_row"], 2 + 4 + 2)
        self.assertEqual(start["scale"], 0.5)

        scores_all = 0.5 * (q[0].astype(np.float64) @ k.astype(np.float64).T)
        running_max, denominator, accumulator = -math.inf, 0.0, np.zeros(4)
        for tile, step in enumerate(events[1:5]):
            with self.subTest(tile=tile):
                self.assertEqual(step["row"], (0, 0, 0))
                self.assertEqual(step["tile"], tile)
                self.assertEqual((step["key_begin"], step["key_end"]), (2 * tile, 2 * tile + 2))
                self.assertIsInstance(step["scores"], np.ndarray)
                np.testing.assert_allclose(step["scores"], scores_all[2 * tile:2 * tile + 2],
                                           rtol=0, atol=1e-6)
                self.assertEqual(step["max_before"], running_max)
                running_max = max(running_max, float(np.max(scores_all[2 * tile:2 * tile + 2])))
                self.assertAlmostEqual(step["max_after"], running_max, delta=1e-6)
                rescale = 0.0 if tile == 0 else math.exp(step["max_before"] - step["max_after"])
                self.assertAlmostEqual(step["rescale"], rescale, delta=1e-6)
                weights = np.exp(scores_all[2 * tile:2 * tile + 2] - running_max)
                denominator = denominator * rescale + weights.sum()
                accumulator = accumulator * rescale + weights @ v[2 * tile:2 * tile + 2]
                self.assertAlmostEqual(step["denominator"], denominator, delta=1e-5 * denominator)
                np.testing.assert_allclose(step["estimate"], accumulator / denominator,
                                           rtol=1e-5, atol=1e-5)

        done = events[5]
        final_estimate = events[4]["estimate"]
        np.testing.assert_allclose(done["output"], SEED_OUT_ROW0, rtol=0, atol=1e-6)
        np.testing.assert_allclose(done["reference"], SEED_OUT_ROW0, rtol=0, atol=1e-6)
        self.assertLess(done["max_abs_error"], 1e-6)
        tiled = self.client.tiled(q, k, v, scale=0.5, block_k=2)
        np.testing.assert_allclose(final_estimate, tiled.output[0], rtol=0, atol=1e-6)
        if tiled.stats["backend"] == "cpu":  # the same code on one row (README)
            np.testing.assert_array_equal(final_estimate, tiled.output[0])
        end = events[6]
        self.assertEqual((end["rows"], end["steps"]), (1, 4))
        self.assertEqual(end["stats"]["backend"], tiled.stats["backend"])
        self.assertIsNotNone(end["message"])

    def test_trace_rows_match_tiled(self):
        rng = np.random.default_rng()
        q = rng.uniform(-1, 1, size=(2, 4, 13, 9)).astype(np.float32)
        k = rng.uniform(-1, 1, size=(2, 2, 19, 9)).astype(np.float32)
        v = rng.uniform(-1, 1, size=(2, 2, 19, 6)).astype(np.float32)
        rows = [(0, 0, 0), (1, 3, 12), (0, 2, 5)]
        tiled = self.client.tiled(q, k, v, causal=True, block_k=4)
        done = [e for e in self.client.trace(q, k, v, rows=rows, block_k=4, causal=True)
                if e["kind"] == "row_done"]
        self.assertEqual([e["row"] for e in done], rows)
        for event in done:
            b, h, r = event["row"]
            with self.subTest(row=event["row"]):
                np.testing.assert_allclose(event["output"], tiled.output[b, h, r], rtol=0,
                                           atol=1e-6)
        # An int row means (0, 0, row); closing the iterator early cancels the stream.
        events = self.client.trace(q, k, v, rows=[3], block_k=4)
        first = next(events)
        self.assertEqual(first["kind"], "start")
        self.assertEqual(next(events)["row"], (0, 0, 3))
        events.close()
        self.assertEqual(self.client.health(), "SERVING")

    def test_example_script(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(ARGS.stubs), os.path.join(REPO_ROOT, "client", "python")])
        run = subprocess.run(
            [sys.executable, os.path.join(REPO_ROOT, "client", "python", "example.py"),
             "--target", self.server.address], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, timeout=RPC_TIMEOUT_S, check=False)
        text = run.stdout.decode("utf-8", "replace")
        self.assertEqual(run.returncode, 0, text)
        row0 = "[-0.593223  0.406777 -1.332858 -0.371937]"
        self.assertIn("naive out[0] = " + row0, text)
        self.assertIn("tiled out[0] = " + row0, text)
        self.assertEqual(text.count("    estimate "), 4, text)  # 8 keys in tiles of 2
        self.assertIn("estimate " + row0, text)

    # Sliding windows.

    def test_window_matches_reference(self):
        rng = np.random.default_rng()
        q = rng.uniform(-1, 1, size=(1, 4, 37, 8)).astype(np.float32)
        k = rng.uniform(-1, 1, size=(1, 2, 37, 8)).astype(np.float32)
        v = rng.uniform(-1, 1, size=(1, 2, 37, 5)).astype(np.float32)
        cases = [
            # A causal left window: row r sees keys r − 6 … r.
            (dict(causal=True, window_left=6), {}),
            # Both sides, not causal, at positions: the query at 100 + i sees 97 + i … 102 + i,
            # the keys being at 90 … 126 (so the last rows see fewer).
            (dict(causal=False, window_left=3, window_right=2),
             dict(key_position=90, query_position=100)),
            # window_left 0 with causal: each row sees only the key at its own position.
            (dict(causal=True, window_left=0), {}),
        ]
        for window, positions in cases:
            ref, ref_lse = window_reference(q, k, v, **window, **positions)
            unwindowed, _ = window_reference(q, k, v, window["causal"], **positions)
            self.assertGreater(float(np.max(np.abs(ref - unwindowed))), 1e-3)  # it matters
            for name in ("naive", "tiled"):
                with self.subTest(rpc=name, **window, **positions):
                    result = getattr(self.client, name)(q, k, v, block_k=5, return_lse=True,
                                                        **window, **positions)
                    self.assertEqual(harness.output_error(result.output.astype(np.float64),
                                                          ref, 1), "")
                    self.assertEqual(harness.lse_error(result.lse.astype(np.float64), ref_lse),
                                     "")
        # 2^62 is a window that hides nothing here: the plain causal answer.
        plain = self.client.tiled(q, k, v, causal=True, block_k=5)
        wide = self.client.tiled(q, k, v, causal=True, block_k=5, window_left=2 ** 62,
                                 window_right=2 ** 62)
        np.testing.assert_array_equal(wide.output, plain.output)

    def test_window_trace(self):
        rng = np.random.default_rng()
        q = rng.uniform(-1, 1, size=(1, 4, 37, 8)).astype(np.float32)
        k = rng.uniform(-1, 1, size=(1, 2, 37, 8)).astype(np.float32)
        v = rng.uniform(-1, 1, size=(1, 2, 37, 8)).astype(np.float32)
        rows = [(0, 1, 36), (0, 3, 4), (0, 0, 20), (0, 2, 6)]
        block_k = 5
        tiled = self.client.tiled(q, k, v, causal=True, block_k=block_k, window_left=6)
        events = list(self.client.trace(q, k, v, rows=rows, block_k=block_k, causal=True,
                                        window_left=6))
        start = events[0]
        self.assertEqual(start["kind"], "start")
        self.assertEqual(start["window_left"], 6)
        self.assertIsNone(start["window_right"])
        self.assertTrue(start["message"].HasField("window_left"))
        self.assertFalse(start["message"].HasField("window_right"))
        for b, h, r in rows:
            with self.subTest(row=(b, h, r)):
                steps = [e for e in events if e["kind"] == "step" and e["row"] == (b, h, r)]
                # Row r sees keys max(0, r − 6) … r: the tiles holding them, from the first.
                first, last = max(0, r - 6) // block_k, r // block_k
                self.assertEqual([e["tile"] for e in steps], list(range(first, last + 1)))
                self.assertEqual(steps[0]["key_begin"], first * block_k)
                self.assertEqual(steps[0]["max_before"], -math.inf)
                for step in steps:
                    keys = np.arange(step["key_begin"], step["key_end"])
                    hidden = (keys < r - 6) | (keys > r)
                    np.testing.assert_array_equal(np.isneginf(step["scores"]), hidden)
                    self.assertEqual(step["hidden"], ["HIDDEN_WINDOW" if key < r - 6 else
                                                      "HIDDEN_CAUSAL" if key > r else
                                                      "HIDDEN_NONE" for key in keys])
                done = [e for e in events if e["kind"] == "row_done" and e["row"] == (b, h, r)]
                np.testing.assert_allclose(done[0]["output"], tiled.output[b, h, r], rtol=0,
                                           atol=1e-6)
                np.testing.assert_allclose(steps[-1]["estimate"], tiled.output[b, h, r],
                                           rtol=0, atol=1e-6)
        self.assertEqual(events[-1]["steps"], sum(e["kind"] == "step" for e in events))
        # Without a window the start event says so: None, not 0.
        plain = next(iter(self.client.trace(q, k, v, block_k=block_k, causal=True)))
        self.assertIsNone(plain["window_left"])
        self.assertIsNone(plain["window_right"])

    def test_window_decode(self):
        rng = np.random.default_rng()
        heads, kv_heads, head_dim, value_dim = 4, 2, 8, 5
        caches = [self.client.create_cache(kv_heads, head_dim, value_dim) for _ in range(2)]
        try:
            held = fill_caches(rng, caches, (37, 23))
            queries = [rng.uniform(-1, 1, size=(heads, nq, head_dim)).astype(np.float32)
                       for nq in (2, 3)]
            # Item 0 bottom-right at positions 0 …; item 1's keys at 50 … 72, queries at 60 ….
            result = self.client.decode(
                [(caches[0], queries[0]),
                 {"cache": caches[1], "query": queries[1], "key_position": 50,
                  "query_position": 60}],
                causal=True, window_left=6, return_lse=True)
            for index, positions in enumerate(({}, dict(key_position=50, query_position=60))):
                with self.subTest(item=index):
                    k, v = held[index]
                    ref, ref_lse = window_reference(queries[index][None], k[None], v[None], True,
                                                    window_left=6, **positions)
                    self.assertEqual(harness.output_error(
                        result.outputs[index].astype(np.float64), ref[0], 1), "")
                    self.assertEqual(harness.lse_error(result.lse[index].astype(np.float64),
                                                       ref_lse[0]), "")
            # Cache.decode passes the window on too (a two-sided one, not causal).
            step = caches[1].decode(queries[1], key_position=50, query_position=60,
                                    window_left=2, window_right=1)
            k, v = held[1]
            ref, _ = window_reference(queries[1][None], k[None], v[None], False, window_left=2,
                                      window_right=1, key_position=50, query_position=60)
            self.assertEqual(harness.output_error(step.output.astype(np.float64), ref[0], 1), "")
        finally:
            for cache in caches:
                cache.delete()

    # Softcap.

    def softcap_problem(self, q_shape, k_shape, v_shape):
        """Random float32 q, k, v in [-1, 1], the queries × 32 so the scores pass the caps."""
        rng = np.random.default_rng()
        q = (32 * rng.uniform(-1, 1, size=q_shape)).astype(np.float32)
        k = rng.uniform(-1, 1, size=k_shape).astype(np.float32)
        v = rng.uniform(-1, 1, size=v_shape).astype(np.float32)
        return q, k, v

    def test_softcap_matches_reference(self):
        cases = [
            # Rank 4, GQA, causal, value_dim ≠ head_dim, odd sizes.
            ((2, 4, 37, 9), (2, 2, 53, 9), (2, 2, 53, 6), dict(causal=True, softcap=5.0)),
            ((2, 4, 37, 9), (2, 2, 53, 9), (2, 2, 53, 6), dict(causal=True, softcap=30)),
            # Rank 3, not causal, key_len ≠ query_len.
            ((6, 29, 17), (3, 41, 17), (3, 41, 11), dict(causal=False, softcap=5)),
            ((6, 29, 17), (3, 41, 17), (3, 41, 11), dict(causal=False, softcap=30.0)),
            # With a causal window too: the cap before the mask either way.
            ((1, 2, 31, 9), (1, 1, 31, 9), (1, 1, 31, 7),
             dict(causal=True, softcap=5.0, window_left=6)),
        ]
        for q_shape, k_shape, v_shape, options in cases:
            q, k, v = self.softcap_problem(q_shape, k_shape, v_shape)
            out_shape, lse_shape = q_shape[:-1] + v_shape[-1:], q_shape[:-1]
            ref, ref_lse, score_max = softcap_reference(as4(q), as4(k), as4(v), **options)
            plain, _, _ = softcap_reference(as4(q), as4(k), as4(v), **dict(options, softcap=0))
            self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)  # and it matters
            ref, ref_lse = ref.reshape(out_shape), ref_lse.reshape(lse_shape)
            for name in ("naive", "tiled"):
                with self.subTest(rpc=name, shape=q_shape, **options):
                    result = getattr(self.client, name)(q, k, v, block_k=7, return_lse=True,
                                                        **options)
                    # score_max ≤ softcap: the cap's slope sech² shrinks the fp32 error of a
                    # scaled score s to about |s|·sech²(s/softcap)·ε ≤ softcap·ε.
                    self.assertEqual(harness.output_error(result.output.astype(np.float64),
                                                          ref, 1, score_max), "")
                    self.assertEqual(harness.lse_error(result.lse.astype(np.float64), ref_lse),
                                     "")
        # softcap=0 (and the default) is no cap at all.
        q, k, v = self.softcap_problem((3, 11, 5), (3, 13, 5), (3, 13, 4))
        np.testing.assert_array_equal(self.client.tiled(q, k, v, softcap=0).output,
                                      self.client.tiled(q, k, v).output)

    def test_softcap_trace(self):
        q, k, v = self.softcap_problem((1, 4, 23, 9), (1, 2, 23, 9), (1, 2, 23, 6))
        block_k, softcap = 5, 5.0
        rows = [(0, 0, 22), (0, 3, 4), (0, 1, 11)]
        tiled = self.client.tiled(q, k, v, causal=True, block_k=block_k, softcap=softcap)
        events = list(self.client.trace(q, k, v, rows=rows, block_k=block_k, causal=True,
                                        softcap=softcap))
        start = events[0]
        self.assertEqual(start["kind"], "start")
        self.assertEqual(start["softcap"], softcap)
        scale = 1.0 / math.sqrt(9)
        q64, k64 = q.astype(np.float64), k.astype(np.float64)
        for b, h, r in rows:
            with self.subTest(row=(b, h, r)):
                steps = [e for e in events if e["kind"] == "step" and e["row"] == (b, h, r)]
                self.assertEqual([e["tile"] for e in steps], list(range(r // block_k + 1)))
                for step in steps:
                    keys = np.arange(step["key_begin"], step["key_end"])
                    products = q64[b, h, r] * k64[b, h // 2, keys]       # [keys, d]
                    scaled = step["scaled_scores"]
                    self.assertIsInstance(scaled, np.ndarray)
                    self.assertEqual(scaled.dtype, np.float32)
                    self.assertEqual(scaled.shape, keys.shape)
                    # Every key's scaled score, masked ones included: scale · q·k to within
                    # fp32 dot-product rounding (γ_(d+2) · scale · Σ|q_i k_i|).
                    self.assertTrue(np.isfinite(scaled).all())
                    bound = 11 * 2.0 ** -24 * scale * np.abs(products).sum(axis=1) + 1e-30
                    np.testing.assert_array_less(np.abs(scaled - scale * products.sum(axis=1)),
                                                 bound)
                    # The scores: the cap of those scaled scores, −inf where the mask hides a
                    # key; within a few float32 ulps of softcap · tanh(scaled / softcap).
                    hidden = keys > r
                    scores = step["scores"]
                    np.testing.assert_array_equal(np.isneginf(scores), hidden)
                    capped = softcap * np.tanh(scaled.astype(np.float64) / softcap)
                    visible = ~hidden
                    ulps = np.abs(scores[visible] - capped[visible]) / np.spacing(
                        np.abs(capped[visible]).astype(np.float32)).astype(np.float64)
                    self.assertTrue((ulps <= 4).all(), ulps)
                    self.assertTrue((np.abs(scores[visible]) <= softcap).all())
                done = [e for e in events if e["kind"] == "row_done" and e["row"] == (b, h, r)]
                np.testing.assert_allclose(done[0]["output"], tiled.output[b, h, r], rtol=0,
                                           atol=1e-6)
                np.testing.assert_allclose(done[0]["reference"], tiled.output[b, h, r], rtol=0,
                                           atol=1e-5)
        # The cap bit: some traced score was past it.
        self.assertGreater(max(float(np.max(np.abs(e["scaled_scores"]))) for e in events
                               if e["kind"] == "step"), 2 * softcap)
        # Without a softcap the start says 0.0 and no step has scaled_scores.
        plain = list(self.client.trace(q, k, v, rows=rows, block_k=block_k, causal=True))
        self.assertEqual(plain[0]["softcap"], 0.0)
        for step in (e for e in plain if e["kind"] == "step"):
            self.assertEqual(step["scaled_scores"].shape, (0,))

    def test_softcap_decode(self):
        rng = np.random.default_rng()
        heads, kv_heads, head_dim, value_dim = 4, 2, 9, 5
        caches = [self.client.create_cache(kv_heads, head_dim, value_dim) for _ in range(2)]
        try:
            held = fill_caches(rng, caches, (37, 23))
            queries = [(32 * rng.uniform(-1, 1, size=(heads, nq, head_dim))).astype(np.float32)
                       for nq in (3, 1)]
            for softcap in (5.0, 30):
                result = self.client.decode([(caches[0], queries[0]), (caches[1], queries[1])],
                                            causal=True, softcap=softcap, return_lse=True)
                for index in range(2):
                    with self.subTest(softcap=softcap, item=index):
                        k, v = held[index]
                        ref, ref_lse, score_max = softcap_reference(
                            queries[index][None], k[None], v[None], True, softcap)
                        if softcap == 5.0:  # the cap matters
                            plain, _, _ = softcap_reference(queries[index][None], k[None],
                                                            v[None], True, 0)
                            self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)
                        self.assertEqual(harness.output_error(
                            result.outputs[index].astype(np.float64), ref[0], 1, score_max), "")
                        self.assertEqual(harness.lse_error(
                            result.lse[index].astype(np.float64), ref_lse[0]), "")
            # Cache.decode passes it on too (not causal, appending a token first).
            k1 = rng.uniform(-1, 1, size=(kv_heads, 1, head_dim)).astype(np.float32)
            v1 = rng.uniform(-1, 1, size=(kv_heads, 1, value_dim)).astype(np.float32)
            step = caches[1].decode(queries[0], k1, v1, softcap=5.0)
            k, v = (np.concatenate([a, b], axis=1) for a, b in zip(held[1], (k1, v1)))
            ref, _, score_max = softcap_reference(queries[0][None], k[None], v[None], False, 5.0)
            self.assertEqual(caches[1].length, 24)
            self.assertEqual(harness.output_error(step.output.astype(np.float64), ref[0], 1,
                                                  score_max), "")
        finally:
            for cache in caches:
                cache.delete()

    # ALiBi.

    def alibi_problem(self, q_shape, k_shape, v_shape):
        """Random float32 q, k, v in [-1, 1]."""
        rng = np.random.default_rng()
        return tuple(rng.uniform(-1, 1, size=shape).astype(np.float32)
                     for shape in (q_shape, k_shape, v_shape))

    def test_alibi_matches_reference(self):
        rng = np.random.default_rng()
        random4 = rng.uniform(0.05, 1.0, size=4).astype(np.float32)   # a NumPy array
        cases = [
            # Rank 4, GQA, causal, value_dim ≠ head_dim, odd sizes, key_len ≠ query_len.
            ((2, 4, 37, 9), (2, 2, 53, 9), (2, 2, 53, 6), dict(causal=True),
             "standard"),
            ((2, 4, 37, 9), (2, 2, 53, 9), (2, 2, 53, 6), dict(causal=True), random4),
            # Rank 3 (H = 6, not a power of two), not causal: keys on both sides of p.
            ((6, 29, 17), (3, 41, 17), (3, 41, 11), dict(causal=False), "standard"),
            ((6, 29, 17), (3, 41, 17), (3, 41, 11), dict(causal=False),
             [0.5, 0.3, 1, 0.0, 0.125, 0.75]),
            # At positions (the bias is of p − t, not of the indices), not causal.
            ((6, 29, 17), (3, 41, 17), (3, 41, 11),
             dict(causal=False, key_position=90, query_position=100), "standard"),
            # With a softcap and a causal window: cap, then bias, then mask.
            ((1, 2, 31, 9), (1, 1, 31, 9), (1, 1, 31, 7),
             dict(causal=True, softcap=2.0, window_left=6), [0.7, 0.25]),
            # Rank 2: one head.
            ((19, 8), (27, 8), (27, 5), dict(causal=True), [0.6]),
        ]
        for q_shape, k_shape, v_shape, options, slopes in cases:
            q, k, v = self.alibi_problem(q_shape, k_shape, v_shape)
            heads = 1 if len(q_shape) == 2 else q_shape[-3]
            sent = attn_client.standard_alibi_slopes(heads) if isinstance(slopes, str) else \
                np.asarray(slopes, dtype=np.float32).astype(np.float64)  # the server's fp32
            out_shape, lse_shape = q_shape[:-1] + v_shape[-1:], q_shape[:-1]
            reference_options = dict(options)
            softcap = reference_options.pop("softcap", 0.0)
            ref, ref_lse, score_max = softcap_reference(as4(q), as4(k), as4(v),
                                                        softcap=softcap, alibi_slopes=sent,
                                                        **reference_options)
            plain, _, _ = softcap_reference(as4(q), as4(k), as4(v), softcap=softcap,
                                            **reference_options)
            self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)  # and it matters
            ref, ref_lse = ref.reshape(out_shape), ref_lse.reshape(lse_shape)
            for name in ("naive", "tiled"):
                with self.subTest(rpc=name, shape=q_shape, slopes=str(slopes), **options):
                    result = getattr(self.client, name)(q, k, v, block_k=7, return_lse=True,
                                                        alibi_slopes=slopes, **options)
                    self.assertEqual(harness.output_error(result.output.astype(np.float64),
                                                          ref, 1, score_max), "")
                    self.assertEqual(harness.lse_error(result.lse.astype(np.float64), ref_lse),
                                     "")
        # None, [] and an empty array are no bias at all; "standard" is standard_alibi_slopes.
        q, k, v = self.alibi_problem((3, 11, 5), (3, 13, 5), (3, 13, 4))
        plain = self.client.tiled(q, k, v, causal=True).output
        for empty in (None, [], (), np.zeros(0, dtype=np.float32)):
            np.testing.assert_array_equal(
                self.client.tiled(q, k, v, causal=True, alibi_slopes=empty).output, plain)
        np.testing.assert_array_equal(
            self.client.tiled(q, k, v, causal=True, alibi_slopes="standard").output,
            self.client.tiled(q, k, v, causal=True,
                              alibi_slopes=attn_client.standard_alibi_slopes(3)).output)

    def test_standard_alibi_slopes(self):
        slopes = attn_client.standard_alibi_slopes(8)
        self.assertIsInstance(slopes, list)
        self.assertEqual(len(slopes), 8)
        self.assertEqual(slopes[0], 0.5)
        self.assertEqual(slopes[-1], 2.0 ** -8)
        self.assertEqual(slopes, [2.0 ** (-(h + 1)) for h in range(8)])
        self.assertEqual(attn_client.standard_alibi_slopes(6),
                         [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3])
        self.assertEqual(attn_client.standard_alibi_slopes(1), [2.0 ** -8])
        self.assertEqual(attn_client.standard_alibi_slopes(0), [])
        # 12 heads: the 8 of n = 8, then 2^(−8(2i+1)/16) for i = 0 … 3 (float32 values).
        twelve = attn_client.standard_alibi_slopes(12)
        self.assertEqual(twelve[:8], slopes)
        self.assertEqual(twelve[8:], [float(np.float32(2.0 ** (-(2 * i + 1) / 2)))
                                      for i in range(4)])
        # 16 heads: 2^(−(h+1)/2), rounded to float32 (what is sent).
        self.assertEqual(attn_client.standard_alibi_slopes(16),
                         [float(np.float32(2.0 ** (-(h + 1) / 2))) for h in range(16)])
        self.assertRaises(TypeError, attn_client.standard_alibi_slopes, 2.0)
        self.assertRaises(ValueError, attn_client.standard_alibi_slopes, -1)
        # "standard" counts the query's heads at every rank; the trace's start repeats them.
        for q_shape, k_shape, heads in (((1, 6, 5, 4), (1, 3, 7, 4), 6), ((5, 5, 4), (1, 7, 4), 5),
                                        ((5, 4), (7, 4), 1)):
            q, k, v = self.alibi_problem(q_shape, k_shape, k_shape)
            with self.subTest(shape=q_shape):
                start = next(iter(self.client.trace(q, k, v, alibi_slopes="standard")))
                self.assertEqual(start["kind"], "start")
                self.assertEqual(start["alibi_slopes"].dtype, np.float32)
                self.assertEqual(start["alibi_slopes"].tolist(),
                                 attn_client.standard_alibi_slopes(heads))

    def test_alibi_trace(self):
        # query_len 17 < key_len 23: bottom-right, query row r is at p = 6 + r.
        q, k, v = self.alibi_problem((1, 4, 17, 9), (1, 2, 23, 9), (1, 2, 23, 6))
        block_k, offset = 5, 23 - 17
        slopes = np.float32([0.5, 0.25, 1.0, 0.125])
        rows = [(0, 0, 16), (0, 3, 2), (0, 1, 9), (0, 2, 0)]
        scale = 1.0 / math.sqrt(9)
        q64, k64 = q.astype(np.float64), k.astype(np.float64)
        for softcap in (0.0, 2.0):
            tiled = self.client.tiled(q, k, v, causal=True, block_k=block_k, softcap=softcap,
                                      alibi_slopes=slopes)
            events = list(self.client.trace(q, k, v, rows=rows, block_k=block_k, causal=True,
                                            softcap=softcap, alibi_slopes=slopes))
            start = events[0]
            self.assertEqual(start["kind"], "start")
            np.testing.assert_array_equal(start["alibi_slopes"], slopes)
            self.assertEqual(start["softcap"], softcap)
            for b, h, r in rows:
                with self.subTest(softcap=softcap, row=(b, h, r)):
                    p = offset + r
                    steps = [e for e in events if e["kind"] == "step" and e["row"] == (b, h, r)]
                    self.assertEqual([e["tile"] for e in steps], list(range(p // block_k + 1)))
                    for step in steps:
                        keys = np.arange(step["key_begin"], step["key_end"])
                        # Each key's bias, masked keys included: −slope · |p − t| in fp32 (one
                        # rounding of the product of the fp32 slope and an exact distance).
                        biases = step["biases"]
                        self.assertIsInstance(biases, np.ndarray)
                        self.assertEqual(biases.dtype, np.float32)
                        self.assertEqual(biases.shape, keys.shape)
                        expected = (-slopes[h].astype(np.float64) * np.abs(p - keys)).astype(
                            np.float32)
                        np.testing.assert_array_equal(biases, expected)
                        # scaled_scores: scale · q·k, before softcap and bias.
                        products = q64[b, h, r] * k64[b, h // 2, keys]
                        scaled = step["scaled_scores"]
                        self.assertEqual(scaled.shape, keys.shape)
                        bound = 11 * 2.0 ** -24 * scale * np.abs(products).sum(axis=1) + 1e-30
                        np.testing.assert_array_less(
                            np.abs(scaled - scale * products.sum(axis=1)), bound)
                        # scores: softcap(scaled) + bias, −inf where the causal mask hides.
                        hidden = keys > p
                        scores = step["scores"]
                        np.testing.assert_array_equal(np.isneginf(scores), hidden)
                        scaled64 = scaled.astype(np.float64)
                        capped = softcap * np.tanh(scaled64 / softcap) if softcap else scaled64
                        want = capped + biases
                        visible = ~hidden
                        size = (np.abs(capped) + np.abs(biases))[visible].astype(np.float32)
                        miss = np.abs(scores[visible] - want[visible])
                        np.testing.assert_array_less(miss, 4 * np.spacing(size) + 1e-30)
                    done = [e for e in events
                            if e["kind"] == "row_done" and e["row"] == (b, h, r)]
                    np.testing.assert_allclose(done[0]["output"], tiled.output[b, h, r],
                                               rtol=0, atol=1e-6)
                    np.testing.assert_allclose(done[0]["reference"], tiled.output[b, h, r],
                                               rtol=0, atol=1e-5)
        # Without ALiBi the start has no slopes and no step has biases.
        plain = list(self.client.trace(q, k, v, rows=rows, block_k=block_k, causal=True))
        self.assertEqual(plain[0]["alibi_slopes"].shape, (0,))
        for step in (e for e in plain if e["kind"] == "step"):
            self.assertEqual(step["biases"].shape, (0,))

    def test_alibi_decode(self):
        rng = np.random.default_rng()
        heads, kv_heads, head_dim, value_dim = 4, 2, 9, 5
        caches = [self.client.create_cache(kv_heads, head_dim, value_dim) for _ in range(2)]
        try:
            held = fill_caches(rng, caches, (37, 23))
            queries = [rng.uniform(-1, 1, size=(heads, nq, head_dim)).astype(np.float32)
                       for nq in (3, 1)]
            slopes = [0.5, 0.2, 0.9, 0.05]
            # Item 0 bottom-right at positions 0 …; item 1's keys at 50 … 72, its query at 80
            # (not causal: every key, biased by its distance from 80).
            for causal in (True, False):
                result = self.client.decode(
                    [(caches[0], queries[0]),
                     {"cache": caches[1], "query": queries[1], "key_position": 50,
                      "query_position": 80}],
                    causal=causal, alibi_slopes=slopes, return_lse=True)
                for index, positions in enumerate(({}, dict(key_position=50,
                                                            query_position=80))):
                    with self.subTest(causal=causal, item=index):
                        k, v = held[index]
                        ref, ref_lse, score_max = softcap_reference(
                            queries[index][None], k[None], v[None], causal, 0,
                            alibi_slopes=np.float32(slopes), **positions)
                        plain, _, _ = softcap_reference(queries[index][None], k[None], v[None],
                                                        causal, 0, **positions)
                        self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)
                        self.assertEqual(harness.output_error(
                            result.outputs[index].astype(np.float64), ref[0], 1, score_max), "")
                        self.assertEqual(harness.lse_error(
                            result.lse[index].astype(np.float64), ref_lse[0]), "")
            # Cache.decode passes it on too: "standard" from the query's 4 heads, appending a
            # token first (causal: the query is the last token).
            k1 = rng.uniform(-1, 1, size=(kv_heads, 1, head_dim)).astype(np.float32)
            v1 = rng.uniform(-1, 1, size=(kv_heads, 1, value_dim)).astype(np.float32)
            step = caches[0].decode(queries[1], k1, v1, causal=True, alibi_slopes="standard")
            k, v = (np.concatenate([a, b], axis=1) for a, b in zip(held[0], (k1, v1)))
            ref, _, score_max = softcap_reference(
                queries[1][None], k[None], v[None], True, 0,
                alibi_slopes=attn_client.standard_alibi_slopes(heads))
            self.assertEqual(caches[0].length, 38)
            self.assertEqual(harness.output_error(step.output.astype(np.float64), ref[0], 1,
                                                  score_max), "")
        finally:
            for cache in caches:
                cache.delete()

    def test_alibi_wrong_count_is_invalid_argument(self):
        q, k, v = self.alibi_problem((1, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8))
        calls = {"naive": lambda s: self.client.naive(q, k, v, alibi_slopes=s),
                 "tiled": lambda s: self.client.tiled(q, k, v, alibi_slopes=s),
                 "trace": lambda s: list(self.client.trace(q, k, v, alibi_slopes=s))}
        cache = self.client.create_cache(2, 8)
        try:
            cache.append(k[0], v[0])
            calls["decode"] = lambda s: self.client.decode([(cache, q[0])], alibi_slopes=s)
            for slopes in ([0.5, 0.25, 0.125], [0.5] * 5):
                for name, call in calls.items():
                    with self.subTest(rpc=name, count=len(slopes)):
                        with self.assertRaises(AttnError) as caught:
                            call(slopes)
                        self.assertEqual(caught.exception.code,
                                         grpc.StatusCode.INVALID_ARGUMENT,
                                         caught.exception.message)
                        self.assertIn("options.alibi_slopes", caught.exception.message)
            self.assertEqual(cache.length, 7)  # the refused decode kept nothing
            # A non-finite slope never leaves the client; sent anyway, the server names it.
            request = Client._request(q, k, v, False, None, 0, False, None, None,
                                      alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
            request.options.alibi_slopes[2] = math.nan
            with self.assertRaises(AttnError) as caught:
                self.client._call("Tiled", self.client._stub.Tiled, request)
            self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("options.alibi_slopes[2]", caught.exception.message)
        finally:
            cache.delete()

    # Attention sinks.

    def assertPerHead(self, out, ref, score_max, what):
        """out, ref [..., H, Nq, dv] (float64): each head's output_error against its own max
        |ref| and score_max[h], so a head whose sink takes nearly every weight (outputs near
        e^−47) is held to fp32's relative error too, not hidden by the other heads' size."""
        for h in range(ref.shape[-3]):
            self.assertEqual(harness.output_error(out[..., h, :, :], ref[..., h, :, :], 1,
                                                  float(score_max[h])), "",
                             "%s, head %d" % (what, h))

    def test_sinks_match_reference(self):
        rng = np.random.default_rng()
        cases = [
            # Rank 4, GQA (query heads 0 and 1 share a kv head, their sinks differ), causal,
            # value_dim ≠ head_dim, odd sizes, key_len ≠ query_len; sinks near the scores, far
            # above them (the sink takes nearly all the weight) and far below (none).
            ((2, 4, 37, 9), (2, 2, 53, 9), (2, 2, 53, 6), dict(causal=True),
             [0.5, 3.0, 50.0, -50.0]),
            # Rank 3 (6 heads over 3), not causal, a NumPy float32 array: random sinks in
            # random heads, one near 4 (so that they matter whatever the draw).
            ((6, 29, 17), (3, 41, 17), (3, 41, 11), dict(causal=False),
             (rng.permutation([-2.0, -0.5, 0.0, 1.0, 2.5, 4.0])
              + rng.uniform(-0.25, 0.25, size=6)).astype(np.float32)),
            # Causal with a window, a softcap and ALiBi: the sink is none of them.
            ((1, 2, 31, 9), (1, 1, 31, 9), (1, 1, 31, 7),
             dict(causal=True, window_left=6, softcap=2.0, alibi_slopes=[0.7, 0.25]),
             [1.5, -0.5]),
            # Rows that see no key: keys at 20 …, query rows at 12 … 24, causal: rows 0 … 7
            # (positions 12 … 19) see none → zeros and lse = the sink; with a window of 4 the
            # others see at most 5 keys.
            ((3, 13, 8), (1, 19, 8), (1, 19, 5),
             dict(causal=True, window_left=4, key_position=20, query_position=12),
             [2.0, 50.0, -3.0]),
            # Not causal, a window on both sides at positions: row i at 100 + i sees the keys
            # at 100 + i − 3 … 100 + i + 1 of those at 90 … 109; rows 13 … 18 see none.
            ((2, 19, 8), (2, 20, 8), (2, 20, 8),
             dict(causal=False, window_left=3, window_right=1, key_position=90,
                  query_position=100),
             [0.25, 4.0]),
            # Rank 2: one head.
            ((19, 8), (27, 8), (27, 5), dict(causal=True), [0.8]),
        ]
        for q_shape, k_shape, v_shape, options, sinks in cases:
            q, k, v = self.alibi_problem(q_shape, k_shape, v_shape)
            sent = np.asarray(sinks, dtype=np.float32).astype(np.float64)  # the server's fp32
            out_shape, lse_shape = q_shape[:-1] + v_shape[-1:], q_shape[:-1]
            ref, ref_lse, score_max, _ = sink_reference(as4(q), as4(k), as4(v), sinks=sent,
                                                        **options)
            plain, _, _, _ = sink_reference(as4(q), as4(k), as4(v), **options)
            self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)  # and it matters
            ref, ref_lse = ref.reshape(out_shape), ref_lse.reshape(lse_shape)
            # Where a row sees no key: zeros and lse = its head's sink, exactly.
            unseen = np.isneginf(sink_reference(as4(q), as4(k), as4(v), **options)[1])
            unseen = unseen.reshape(lse_shape)
            self.assertEqual(unseen.any(), "key_position" in options)  # the cases that have some
            for name in ("naive", "tiled"):
                with self.subTest(rpc=name, shape=q_shape, sinks=str(sinks),
                                  **{key: str(value) for key, value in options.items()}):
                    result = getattr(self.client, name)(q, k, v, block_k=7, return_lse=True,
                                                        sinks=sinks, **options)
                    out = result.output.astype(np.float64)
                    self.assertEqual(harness.output_error(out, ref, 1, float(score_max.max())),
                                     "")
                    self.assertPerHead(out.reshape(as4(ref).shape), as4(ref), score_max, name)
                    self.assertEqual(harness.lse_error(result.lse.astype(np.float64), ref_lse),
                                     "")
                    if unseen.any():  # the reference's lse is the sink there, exactly
                        np.testing.assert_array_equal(result.lse[unseen],
                                                      ref_lse[unseen].astype(np.float32))
                        self.assertTrue((result.output[unseen] == 0).all())
        # None, [] and an empty array are no sinks at all.
        q, k, v = self.alibi_problem((3, 11, 5), (3, 13, 5), (3, 13, 4))
        plain = self.client.tiled(q, k, v, causal=True, return_lse=True)
        for empty in (None, [], (), np.zeros(0, dtype=np.float32)):
            with self.subTest(empty=repr(empty)):
                result = self.client.tiled(q, k, v, causal=True, return_lse=True, sinks=empty)
                np.testing.assert_array_equal(result.output, plain.output)
                np.testing.assert_array_equal(result.lse, plain.lse)

    def test_sinks_ragged(self):
        # A ragged batch: each sequence's rows take their head's sink once; a sequence with
        # queries and no keys gives zeros and lse = the sink.
        q_lens, k_lens = [5, 3, 0, 7], [9, 0, 4, 12]
        cu_q = attn_client.cumulative_lengths(q_lens)
        cu_k = attn_client.cumulative_lengths(k_lens)
        q, k, v = self.alibi_problem((4, cu_q[-1], 8), (2, cu_k[-1], 8), (2, cu_k[-1], 6))
        sinks = np.float32([1.0, 50.0, -2.0, 3.5])
        for name in ("naive", "tiled"):
            with self.subTest(rpc=name):
                result = getattr(self.client, name)(q, k, v, causal=True, block_k=5,
                                                    return_lse=True, sinks=sinks,
                                                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
                for s in range(len(q_lens)):
                    rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
                    ref, ref_lse, score_max, _ = sink_reference(
                        q[None, :, rows], k[None, :, keys], v[None, :, keys], True,
                        sinks=sinks)
                    out = result.output[None, :, rows].astype(np.float64)
                    self.assertPerHead(out, ref, score_max, "sequence %d" % s)
                    self.assertEqual(harness.lse_error(
                        result.lse[None, :, rows].astype(np.float64), ref_lse), "")
                    if k_lens[s] == 0:
                        self.assertTrue((result.output[:, rows] == 0).all())
                        np.testing.assert_array_equal(
                            result.lse[:, rows], np.repeat(sinks[:, None], q_lens[s], axis=1))

    def test_sinks_trace(self):
        # Keys at 6 … 28, query rows at 0 … 16 (positions given): rows 0 … 5 see no key.
        q, k, v = self.alibi_problem((1, 4, 17, 9), (1, 2, 23, 9), (1, 2, 23, 6))
        block_k, key_position, query_position = 5, 6, 0
        sinks = np.float32([0.5, 3.0, 50.0, -50.0])
        rows = [(0, 0, 16), (0, 3, 2), (0, 1, 9), (0, 2, 0), (0, 2, 12), (0, 1, 3), (0, 3, 11)]
        positions = dict(key_position=key_position, query_position=query_position)
        ref, ref_lse, score_max, ref_share = sink_reference(q, k, v, True, sinks=sinks,
                                                            **positions)
        plain, plain_lse, _, _ = sink_reference(q, k, v, True, **positions)
        tiled = self.client.tiled(q, k, v, causal=True, block_k=block_k, sinks=sinks,
                                  return_lse=True, **positions)
        events = list(self.client.trace(q, k, v, rows=rows, block_k=block_k, causal=True,
                                        sinks=sinks, **positions))
        start = events[0]
        self.assertEqual(start["kind"], "start")
        self.assertIsInstance(start["sinks"], np.ndarray)
        self.assertEqual(start["sinks"].dtype, np.float32)
        np.testing.assert_array_equal(start["sinks"], sinks)
        for b, h, r in rows:
            with self.subTest(row=(b, h, r)):
                sees_keys = query_position + r >= key_position
                steps = [e for e in events if e["kind"] == "step" and e["row"] == (b, h, r)]
                self.assertEqual(bool(steps), sees_keys)
                if steps:
                    # Steps never include the sink: the last one's estimate is the keys-only
                    # output and its max and denominator the keys-only lse.
                    last = steps[-1]
                    self.assertEqual(harness.output_error(
                        last["estimate"].astype(np.float64), plain[b, h, r], 1), "")
                    keys_lse = last["max_after"] + math.log(last["denominator"])
                    self.assertAlmostEqual(keys_lse, plain_lse[b, h, r],
                                           delta=1e-5 * max(1.0, abs(plain_lse[b, h, r])))
                done = [e for e in events if e["kind"] == "row_done" and e["row"] == (b, h, r)]
                self.assertEqual(len(done), 1)
                done = done[0]
                magnitude = max(float(np.max(np.abs(ref[b, h, r]))), 1e-30)
                for field in ("output", "reference"):
                    self.assertEqual(harness.output_error(
                        done[field].astype(np.float64), ref[b, h, r], 1, float(score_max[h]),
                        magnitude), "", field)
                np.testing.assert_allclose(done["output"], tiled.output[b, h, r], rtol=1e-5,
                                           atol=1e-6 * magnitude)
                self.assertIsInstance(done["lse"], float)
                self.assertIsInstance(done["sink_share"], float)
                self.assertEqual(harness.lse_error(np.float64([done["lse"]]),
                                                   ref_lse[b, h, r:r + 1]), "")
                self.assertAlmostEqual(done["lse"], float(tiled.lse[b, h, r]),
                                       delta=1e-5 * max(1.0, abs(ref_lse[b, h, r])))
                self.assertAlmostEqual(done["sink_share"], ref_share[b, h, r],
                                       delta=1e-5 * max(1e-3, ref_share[b, h, r]))
                if not sees_keys:  # zeros, lse = the sink, and the sink took all the weight
                    self.assertTrue((done["output"] == 0).all())
                    self.assertEqual(done["lse"], float(sinks[h]))
                    self.assertEqual(done["sink_share"], 1.0)
        # Without sinks the start has none and every row_done's sink_share is 0.
        plain_events = list(self.client.trace(q, k, v, rows=rows, block_k=block_k, causal=True,
                                              **positions))
        self.assertEqual(plain_events[0]["sinks"].shape, (0,))
        done = [e for e in plain_events if e["kind"] == "row_done"]
        self.assertEqual(len(done), len(rows))
        for event in done:
            self.assertEqual(event["sink_share"], 0.0)

    def test_sinks_decode(self):
        rng = np.random.default_rng()
        heads, kv_heads, head_dim, value_dim = 4, 2, 9, 5
        caches = [self.client.create_cache(kv_heads, head_dim, value_dim) for _ in range(3)]
        try:
            held = fill_caches(rng, caches, (37, 23, 11))
            queries = [rng.uniform(-1, 1, size=(heads, nq, head_dim)).astype(np.float32)
                       for nq in (3, 1, 2)]
            sinks = [0.5, 3.0, 50.0, -50.0]
            # Item 0 bottom-right at positions 0 …; item 1's keys at 50 … 72, its query at 80;
            # item 2's keys at 60 … 70, its queries at 40, 41: causal, they see no key.
            item_positions = ({}, dict(key_position=50, query_position=80),
                              dict(key_position=60, query_position=40))
            for causal in (True, False):
                result = self.client.decode(
                    [(caches[0], queries[0])] +
                    [dict(cache=caches[i], query=queries[i], **item_positions[i])
                     for i in (1, 2)],
                    causal=causal, sinks=sinks, return_lse=True)
                for index, positions in enumerate(item_positions):
                    with self.subTest(causal=causal, item=index):
                        k, v = held[index]
                        ref, ref_lse, score_max, _ = sink_reference(
                            queries[index][None], k[None], v[None], causal,
                            sinks=np.float32(sinks), **positions)
                        plain, _, _, _ = sink_reference(queries[index][None], k[None],
                                                        v[None], causal, **positions)
                        if not (causal and index == 2):
                            self.assertGreater(float(np.max(np.abs(ref - plain))), 1e-2)
                        out = result.outputs[index].astype(np.float64)[None]
                        self.assertPerHead(out, ref, score_max, "item %d" % index)
                        self.assertEqual(harness.lse_error(
                            result.lse[index].astype(np.float64), ref_lse[0]), "")
                        if causal and index == 2:
                            self.assertTrue((result.outputs[2] == 0).all())
                            np.testing.assert_array_equal(
                                result.lse[2], np.repeat(np.float32(sinks)[:, None], 2, 1))
            # Cache.decode passes them on too (a float32 array), appending a token first.
            k1 = rng.uniform(-1, 1, size=(kv_heads, 1, head_dim)).astype(np.float32)
            v1 = rng.uniform(-1, 1, size=(kv_heads, 1, value_dim)).astype(np.float32)
            step = caches[0].decode(queries[1], k1, v1, causal=True, sinks=np.float32(sinks),
                                    return_lse=True)
            k, v = (np.concatenate([a, b], axis=1) for a, b in zip(held[0], (k1, v1)))
            ref, ref_lse, score_max, _ = sink_reference(queries[1][None], k[None], v[None],
                                                        True, sinks=np.float32(sinks))
            self.assertEqual(caches[0].length, 38)
            self.assertPerHead(step.output.astype(np.float64)[None], ref, score_max,
                               "Cache.decode")
            self.assertEqual(harness.lse_error(step.lse.astype(np.float64), ref_lse[0]), "")
            # And Tiled over a cache: the same rows again.
            over = self.client.tiled(queries[1], cache=caches[0], causal=True, sinks=sinks,
                                     return_lse=True, block_k=4)
            self.assertPerHead(over.output.astype(np.float64)[None], ref, score_max,
                               "tiled(cache=)")
            self.assertEqual(harness.lse_error(over.lse.astype(np.float64), ref_lse[0]), "")
        finally:
            for cache in caches:
                cache.delete()

    def test_sinks_wrong_count_is_invalid_argument(self):
        q, k, v = self.alibi_problem((1, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8))
        calls = {"naive": lambda s: self.client.naive(q, k, v, sinks=s),
                 "tiled": lambda s: self.client.tiled(q, k, v, sinks=s),
                 "trace": lambda s: list(self.client.trace(q, k, v, sinks=s))}
        cache = self.client.create_cache(2, 8)
        try:
            cache.append(k[0], v[0])
            # Decode appending a token: refused whole, the token not kept.
            calls["decode"] = lambda s: self.client.decode(
                [(cache, q[0], k[0, :, :1], v[0, :, :1])], sinks=s)
            for sinks in ([0.5, 0.25, 0.125], [0.5] * 5, [1.0]):
                for name, call in calls.items():
                    with self.subTest(rpc=name, count=len(sinks)):
                        with self.assertRaises(AttnError) as caught:
                            call(sinks)
                        self.assertEqual(caught.exception.code,
                                         grpc.StatusCode.INVALID_ARGUMENT,
                                         caught.exception.message)
                        self.assertIn("options.sinks", caught.exception.message)
            self.assertEqual(cache.length, 7)
            self.assertEqual(cache.refresh()["length"], 7)  # the refused decodes kept nothing
            # A non-finite sink never leaves the client; sent anyway, the server names it.
            for bad in (math.nan, math.inf, -math.inf):
                request = Client._request(q, k, v, False, None, 0, False, None, None,
                                          sinks=[0.5, 0.25, 0.125, 0.0625])
                request.options.sinks[2] = bad
                options = Client._options(False, None, 0, False, None,
                                          sinks=[0.5, 0.25, 0.125, 0.0625])
                options.sinks[2] = bad
                decode = attn_client.pb.DecodeRequest(options=options)
                decode.items.add(cache_id=cache.id, expected_length=7,
                                 query=attn_client._encode("query", q[0], None))
                raw = {"Naive": lambda: self.client._call("Naive", self.client._stub.Naive,
                                                          request),
                       "Tiled": lambda: self.client._call("Tiled", self.client._stub.Tiled,
                                                          request),
                       "Trace": lambda: list(self.client._trace_events(
                           attn_client.pb.TraceRequest(attention=request))),
                       "Decode": lambda: self.client._call("Decode", self.client._stub.Decode,
                                                           decode)}
                for name, call in raw.items():
                    with self.subTest(rpc=name, value=bad):
                        with self.assertRaises(AttnError) as caught:
                            call()
                        self.assertEqual(caught.exception.code,
                                         grpc.StatusCode.INVALID_ARGUMENT,
                                         caught.exception.message)
                        self.assertIn("options.sinks[2]", caught.exception.message)
        finally:
            cache.delete()

    # Errors.

    def test_bad_shape_is_invalid_argument(self):
        q, k, v = attn_client.seed_example()
        calls = {"naive": lambda: self.client.naive(q, k[:, :3], v),
                 "tiled": lambda: self.client.tiled(q, k[:, :3], v),
                 "trace": lambda: list(self.client.trace(q, k[:, :3], v))}
        for name, call in calls.items():
            with self.subTest(rpc=name):
                with self.assertRaises(AttnError) as caught:
                    call()
                self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT,
                                 caught.exception.message)
                self.assertIn("key.shape", caught.exception.message)
                self.assertIn("INVALID_ARGUMENT", str(caught.exception))
        with self.assertRaises(AttnError) as caught:
            list(self.client.trace(q, k, v, rows=[(0, 0, 8)]))
        self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("rows[0]", caught.exception.message)

    def test_local_errors_need_no_server(self):
        # A client to a port nothing listens on: a local check must fail before any RPC
        # (an RPC would give AttnError UNAVAILABLE instead).
        offline = Client("127.0.0.1:1", timeout=5)
        try:
            q, k, v = attn_client.seed_example()
            cases = [
                (ValueError, lambda: offline.naive(q[0], k, v)),                  # rank 1
                (ValueError, lambda: offline.tiled(q[None, None, None], k, v)),   # rank 5
                (TypeError, lambda: offline.tiled(q.astype(np.uint16), k, v)),    # bf16 unsaid
                (TypeError, lambda: offline.tiled(q.astype(np.complex64), k, v)),
                (TypeError, lambda: offline.tiled("q", k, v)),
                (ValueError, lambda: offline.tiled(q, k, v, dtype="fp8")),
                (ValueError, lambda: offline.tiled(q, k, v, output_dtype=np.float64)),
                (ValueError, lambda: offline.tiled(q, k, v, block_k=-1)),
                (TypeError, lambda: offline.tiled(q, k, v, block_k=2.5)),
                (ValueError, lambda: offline.tiled(q, k, v, scale=math.inf)),
                (TypeError, lambda: offline.tiled(q, k, v, causal="yes")),
                (TypeError, lambda: offline.trace(q, k, v, rows=[(0, 0)])),
                (ValueError, lambda: offline.trace(q, k, v, rows=[(0, 0, -1)])),
                (ValueError, lambda: Client("")),
                (ValueError, lambda: Client("127.0.0.1:1", timeout=0)),
            ]
            for index, (error, call) in enumerate(cases):
                with self.subTest(case=index):
                    self.assertRaises(error, call)
            # Bad windows, on every call that takes one: the error names the argument.
            calls = {
                "naive": lambda **w: offline.naive(q, k, v, causal=True, **w),
                "tiled": lambda **w: offline.tiled(q, k, v, **w),
                "trace": lambda **w: offline.trace(q, k, v, **w),
                "decode": lambda **w: offline.decode(
                    [{"cache": "0123", "query": q[None], "expected_length": 8}], **w),
            }
            for name in ("window_left", "window_right"):
                for value, error in ((-1, ValueError), (2 ** 62 + 1, ValueError),
                                     (True, TypeError), (1.5, TypeError), ("3", TypeError)):
                    for rpc, call in calls.items():
                        with self.subTest(rpc=rpc, argument=name, value=value):
                            with self.assertRaises(error) as caught:
                                call(**{name: value})
                            self.assertIn(name, str(caught.exception))
            # Bad softcaps likewise (Cache.decode too): negative, not finite, not a number.
            cache = attn_client.Cache(offline, attn_client.pb.CacheInfo(
                cache_id="0123", kv_heads=1, head_dim=4, value_dim=4, length=8))
            calls["cache.decode"] = lambda **w: cache.decode(q[None], **w)
            for value, error in ((-1.0, ValueError), (float("nan"), ValueError),
                                 (float("inf"), ValueError), (-math.inf, ValueError),
                                 (1e39, ValueError), (True, TypeError), ("3", TypeError),
                                 (None, TypeError)):
                for rpc, call in calls.items():
                    with self.subTest(rpc=rpc, argument="softcap", value=value):
                        with self.assertRaises(error) as caught:
                            call(softcap=value)
                        self.assertIn("softcap", str(caught.exception))
            # Bad ALiBi slopes likewise: not finite (in float32 too), not numbers, not 1-D, an
            # unknown name.
            for value, error in (([float("nan")], ValueError), ([1.0, math.inf], ValueError),
                                 ([-math.inf], ValueError), ([0.5, 1e39], ValueError),
                                 (np.float32([0.5, np.nan]), ValueError),
                                 (np.float64([[0.5]]), ValueError), ("geometric", ValueError),
                                 ("", ValueError), ([True], TypeError), (["0.5"], TypeError),
                                 ([None], TypeError), (0.5, TypeError), (b"standard", TypeError),
                                 (np.array(["a"]), TypeError), ([1j], TypeError)):
                for rpc, call in calls.items():
                    with self.subTest(rpc=rpc, argument="alibi_slopes", value=repr(value)):
                        with self.assertRaises(error) as caught:
                            call(alibi_slopes=value)
                        self.assertIn("alibi_slopes", str(caught.exception))
            # Bad sinks likewise, the error naming the entry: not finite (in float32 too),
            # not numbers, not 1-D; no "standard" (sinks are learned).
            for value, error, name in (
                    ([float("nan")], ValueError, "sinks[0]"),
                    ([1.0, math.inf], ValueError, "sinks[1]"),
                    ([-math.inf], ValueError, "sinks[0]"),
                    ([0.5, 1e39], ValueError, "sinks[1]"),
                    ([0.5, -1e39], ValueError, "sinks[1]"),
                    (np.float32([0.5, np.nan]), ValueError, "sinks[1]"),
                    (np.float64([[0.5]]), ValueError, "sinks"),
                    ("standard", TypeError, "sinks"), ("", TypeError, "sinks"),
                    ([True], TypeError, "sinks[0]"), ([0.5, "0.5"], TypeError, "sinks[1]"),
                    ([None], TypeError, "sinks[0]"), (0.5, TypeError, "sinks"),
                    (b"\x01", TypeError, "sinks"), ({0: 0.5}, TypeError, "sinks"),
                    (np.array(["a"]), TypeError, "sinks"), ([1j], TypeError, "sinks[0]")):
                for rpc, call in calls.items():
                    with self.subTest(rpc=rpc, argument="sinks", value=repr(value)):
                        with self.assertRaises(error) as caught:
                            call(sinks=value)
                        self.assertIn(name, str(caught.exception))
            # "standard" needs a query to count: decode of no items says so.
            with self.assertRaises(ValueError) as caught:
                offline.decode([], alibi_slopes="standard")
            self.assertIn("alibi_slopes", str(caught.exception))
            with self.assertRaises(AttnError) as caught:
                offline.info()
            self.assertIn(caught.exception.code, (grpc.StatusCode.UNAVAILABLE,
                                                  grpc.StatusCode.DEADLINE_EXCEEDED))
        finally:
            offline.close()


class TokenTest(ServerCase):
    """attnd --auth-token-file: every RPC but health needs "authorization: Bearer <token>"."""

    token = "py-client-%d-%d" % (os.getpid(), int(time.time()))
    _dir = None

    @classmethod
    def start_server(cls):
        cls._dir = tempfile.mkdtemp(prefix="attn_client_token_")
        path = os.path.join(cls._dir, "token")
        with open(path, "w") as f:
            f.write(cls.token + "\n")
        os.chmod(path, 0o600)
        cls.server_args = ("--auth-token-file", path)
        return super().start_server()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        if cls._dir:
            shutil.rmtree(cls._dir, ignore_errors=True)

    def test_token(self):
        q, k, v = attn_client.seed_example()
        address = self.server.address
        for label, token in (("none", None), ("wrong", "not-" + self.token)):
            with Client(address, token=token, timeout=RPC_TIMEOUT_S) as client:
                for name, call in (("info", client.info),
                                   ("naive", lambda: client.naive(q, k, v)),
                                   ("tiled", lambda: client.tiled(q, k, v)),
                                   ("trace", lambda: list(client.trace(q, k, v)))):
                    with self.subTest(token=label, rpc=name):
                        with self.assertRaises(AttnError) as caught:
                            call()
                        self.assertEqual(caught.exception.code,
                                         grpc.StatusCode.UNAUTHENTICATED,
                                         caught.exception.message)
                self.assertEqual(client.health(), "SERVING")  # health needs no token
        with Client(address, token=self.token, timeout=RPC_TIMEOUT_S) as client:
            self.assertTrue(client.info()["version"])
            np.testing.assert_allclose(client.naive(q, k, v).output[0], SEED_OUT_ROW0, atol=1e-6)
            np.testing.assert_allclose(client.tiled(q, k, v).output[0], SEED_OUT_ROW0, atol=1e-6)
            kinds = [e["kind"] for e in client.trace(q, k, v, block_k=4)]
            self.assertEqual(kinds, ["start", "step", "step", "row_done", "end"])
            self.assertEqual(client.health(), "SERVING")


@unittest.skipUnless(shutil.which("openssl"), "openssl not installed: TLS path not tested")
class TlsTest(ServerCase):
    """attnd --tls-cert/--tls-key; the client trusts the test CA through tls_ca."""

    _dir = None

    @classmethod
    def start_server(cls):
        cls._dir = tempfile.mkdtemp(prefix="attn_client_tls_")
        d = cls._dir

        def ssl(*args):
            subprocess.run(["openssl"] + list(args), check=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)

        ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-days", "1", "-subj", "/CN=attn py test ca", "-keyout", d + "/ca.key",
            "-out", d + "/ca.pem")
        ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-subj", "/CN=attn py test server", "-keyout", d + "/server.key",
            "-out", d + "/server.csr")
        with open(d + "/server.ext", "w") as f:
            f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
        ssl("x509", "-req", "-in", d + "/server.csr", "-CA", d + "/ca.pem", "-CAkey",
            d + "/ca.key", "-set_serial", "7", "-days", "1", "-extfile", d + "/server.ext",
            "-out", d + "/server.pem")
        cls.server_args = ("--tls-cert", d + "/server.pem", "--tls-key", d + "/server.key")
        return super().start_server()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        if cls._dir:
            shutil.rmtree(cls._dir, ignore_errors=True)

    def test_tls(self):
        q, k, v = attn_client.seed_example()
        with Client(self.server.address, tls_ca=self._dir + "/ca.pem",
                    timeout=RPC_TIMEOUT_S) as client:
            self.assertEqual(client.health(), "SERVING")
            np.testing.assert_allclose(client.tiled(q, k, v).output[0], SEED_OUT_ROW0, atol=1e-6)
        with Client(self.server.address, timeout=10) as plaintext:  # no TLS: refused
            with self.assertRaises(AttnError):
                plaintext.info()


if __name__ == "__main__":
    unittest.main(argv=ARGS.unittest_argv, exit=True)
