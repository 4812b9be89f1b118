#!/usr/bin/python3
"""fp8 E4M3 KV caches (CreateCacheRequest.dtype DTYPE_FLOAT8_E4M3) through the Python client
(client/python/attn_client.py: create_cache(..., dtype="fp8")).

Starts attnd (tests/python/attnd_harness.py) and checks, on fresh random tokens each run (the
seed is printed; --seed repeats one):

  - accuracy: an fp8 cache of kv_heads 8, head_dim 128 filled with 4096 standard-normal float32
    tokens (4095 appended, the last by the Decode itself), decoded with 32 query heads (GQA:
    query head h reads kv head h // 4) and one query row: max |out − ref| / max |ref| ≤ 0.05
    against a float64 reference on the unquantized tokens (printed), yet above 0.005 (the
    tokens were really rounded to fp8); the same Decode within the fp32 tolerance of a float64
    reference on the tokens the export says were stored;
  - the stored rows (ExportCache): Tensors [kv_heads, n, width] of DTYPE_FLOAT8_E4M3 holding
    per row its codes, zero bytes up to a multiple of 4 and a little-endian float32 scale; the
    scale max |x| / 448, and every code x / scale rounded to nearest even in E4M3 (bias 7,
    largest 448, no infinities), but that an exact tie may go either way (attnd divides in
    float32, this test in float64);
  - tokens in any tensor dtype: the same tokens sent as bf16 decode within 0.05 too, and store
    the bytes (export, Decode output) that their float32 values store; an odd shape (head_dim
    21, value_dim 13: rows padded) sent as fp16 against float32;
  - memory: CacheInfo.bytes of the fp8 cache ≤ 0.55 × a bf16 cache of the same 4096 tokens;
  - errors: a Naive / Tiled query, an AppendCache key and a Decode item key of
    DTYPE_FLOAT8_E4M3 and options.output_dtype DTYPE_FLOAT8_E4M3 are INVALID_ARGUMENT naming
    "dtype"; CreateCache with dtype 5 is INVALID_ARGUMENT; a bf16 cache still refuses float32
    tokens; the client's ValueError for "fp8" as a tensor's dtype, output_dtype, SharedTensor
    dtype or an unknown cache dtype, before any RPC;
  - export / import: an fp8 cache exported (as chunks, and to a file) and imported is an fp8
    cache of the same bytes whose next Decode equals the original's bit for bit;
  - the replay tail (--cache-dir, write-behind slower than the test): float32 tokens sent to an
    fp8 cache, lost by a SIGKILL, re-sent by refresh() re-quantize into the same stored bytes.

Run as
  /usr/bin/python3 tests/python/test_fp8_cache.py --attnd <attnd> --stubs <stubs dir>
"""

import os
import shutil
import sys
import tempfile
import unittest

import attnd_harness as harness  # tests/python is sys.path[0] for a script.


def _add_arguments(parser):
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed (default: a fresh one, printed)")


ARGS = harness.parse_args(__doc__, _add_arguments, unittest=True)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import attn_client  # noqa: E402
from attn_client import Client  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402
from attention.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

RPC_TIMEOUT_S = 120.0
SEED = ARGS.seed if ARGS.seed is not None else int.from_bytes(os.urandom(4), "little")
FP8 = getattr(pb, "DTYPE_FLOAT8_E4M3", 4)  # Stubs generated before fp8 lack the name.
UNKNOWN_DTYPE = 5

KV_HEADS, HEAD_DIM, HEADS, TOKENS = 8, 128, 32, 4096
ACCURACY_BOUND = 0.05   # max |out − ref| / max |ref| against the unquantized tokens.
QUANTIZED_FLOOR = 0.005  # ... and above this: fp8 rounding shows.
BYTES_BOUND = 0.55      # fp8 cache bytes / bf16 cache bytes.
E4M3_MAX = 448.0


def e4m3_values():
    """The 256 E4M3 (e4m3fn) codes' values, float64: bias 7, 3 mantissa bits, subnormals at
    exponent 0, S.1111.111 NaN (no infinities)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9,
                         (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    magnitude = np.where((exponent == 15) & (mantissa == 7), np.nan, magnitude)
    return sign * magnitude


E4M3 = e4m3_values()


def quantize(x):
    """The contract's quantization of rows x [..., width] (float32): (scale [..., 1] float32 =
    max |x| / 448, the E4M3 values of x / scale rounded to nearest even, float64)."""
    x = np.asarray(x, dtype=np.float32)
    scale = (np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(E4M3_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    y = (x / safe).astype(np.float64)  # fp32 division, exact in float64
    magnitude = np.abs(y)
    exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    spacing = 2.0 ** (np.maximum(exponent, -6.0) - 3.0)  # 3 mantissa bits; subnormals 2^-9
    return scale, np.round(y / spacing) * spacing  # np.round: half to even


def stored_rows(tensors, width):
    """Export chunk Tensors [kv_heads, n, width] of fp8 rows joined along n → (codes' values
    [kv_heads, N, width] float64, scales [kv_heads, N, 1] float32, padding bytes)."""
    padded = (width + 3) // 4 * 4
    values, scales, padding = [], [], []
    for tensor in tensors:
        heads, n, w = (int(d) for d in tensor.shape)
        assert tensor.dtype == FP8, "chunk dtype %d, expected DTYPE_FLOAT8_E4M3" % tensor.dtype
        assert w == width, "chunk width %d, expected %d" % (w, width)
        assert len(tensor.data) == heads * n * (padded + 4), (
            "chunk [%d, %d, %d] holds %d bytes, expected %d (rows of %d code bytes + 4)"
            % (heads, n, w, len(tensor.data), heads * n * (padded + 4), padded))
        raw = np.frombuffer(tensor.data, dtype=np.uint8).reshape(heads, n, padded + 4)
        values.append(E4M3[raw[..., :width]])
        padding.append(raw[..., width:padded])
        scales.append(raw[..., padded:].copy().view("<f4").astype(np.float32))
    return (np.concatenate(values, axis=1), np.concatenate(scales, axis=1),
            np.concatenate(padding, axis=1))


def export_tensors(client, cache):
    """ExportCache → (key Tensors, value Tensors, key bytes, value bytes)."""
    chunks = client.export_cache(cache, verify=True)
    keys = [c.key for c in chunks if c.HasField("key")]
    values = [c.value for c in chunks if c.HasField("value")]
    return (keys, values, b"".join(t.data for t in keys), b"".join(t.data for t in values))


def reference(q, k, v):
    """float64 attention, GQA (query head h reads kv head h // (heads / kv_heads)) → (out
    [heads, nq, dv], max |score|)."""
    out, _, score_max = harness.reference_attention(harness.as4(q), harness.as4(k),
                                                    harness.as4(v))
    return out[0], score_max


def ratio(out, ref):
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def bf16_tensor(x):
    """float32 values as a bf16 Tensor (rounded to nearest even), sent as it is."""
    return pb.Tensor(shape=list(x.shape), dtype=pb.DTYPE_BFLOAT16,
                     data=attn_client.float32_to_bf16(x).tobytes())


def bf16_round(x):
    return attn_client.bf16_to_float32(attn_client.float32_to_bf16(x))


class ServerCase(harness.ServerCase):
    """attnd with `server_args` for the class and a Client to it (harness.ServerCase)."""

    attnd = ARGS.attnd
    server_threads = 4
    rpc_timeout = RPC_TIMEOUT_S

    def setUp(self):
        # Each test its own stream of the run's seed, so --seed repeats any one alone.
        self.rng = np.random.default_rng([SEED, sum(map(ord, self._testMethodName))])

    def check_stored(self, keys, values, k, v, what):
        """The export's rows (key and value Tensors) are k and v [kv_heads, N, ·] (float32, the
        values sent) quantized as the contract says: scale max |x| / 448, each code x / scale
        rounded to nearest even, except that a tie may go either way (attnd divides in float32,
        which can land a hair off a float64 tie of x / scale)."""
        for tensors, x, name in ((keys, k, "key"), (values, v, "value")):
            stored, scales, padding = stored_rows(tensors, x.shape[-1])
            self.assertEqual(stored.shape, x.shape, "%s %s rows" % (what, name))
            self.assertFalse(np.isnan(stored).any(), "%s %s: a NaN code" % (what, name))
            self.assertFalse(padding.any(), "%s %s: padding bytes not zero" % (what, name))
            scale, expected = quantize(x)
            scale_miss = float(np.max(np.abs(scales.astype(np.float64) - scale) / scale))
            self.assertLessEqual(scale_miss, 2.0 ** -22,
                                 "%s %s: scales are not max |x| / 448" % (what, name))
            y = x.astype(np.float64) / scale
            exponent = np.floor(np.log2(np.maximum(np.abs(y), 2.0 ** -6)))
            half_step = 2.0 ** (exponent - 4)
            tie = np.abs(np.abs(y - expected) - half_step) <= np.abs(y) * 2.0 ** -21
            differ = stored != expected
            off_tie = differ & ~(tie & (np.abs(stored - expected) <= 2 * half_step))
            self.assertFalse(off_tie.any(), "%s %s: %d codes are not x / scale rounded to "
                             "nearest, e.g. x / scale = %r stored as %r"
                             % (what, name, int(off_tie.sum()), y[off_tie][:1],
                                stored[off_tie][:1]))
            print("    %s %s rows: %d × (%d codes, %d zero bytes, a scale); codes x / scale "
                  "rounded to nearest even, %d ties the other way"
                  % (what, name, x.shape[0] * x.shape[1], x.shape[2], padding.shape[-1],
                     int(differ.sum())))


class Fp8CacheTest(ServerCase):
    """attnd with default flags (caches in memory)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        rng = np.random.default_rng([SEED, 0])
        cls.k = rng.standard_normal((KV_HEADS, TOKENS, HEAD_DIM)).astype(np.float32)
        cls.v = rng.standard_normal((KV_HEADS, TOKENS, HEAD_DIM)).astype(np.float32)
        # Queries as the other tests': uniform in [-1, 1].
        cls.q = rng.uniform(-1, 1, (HEADS, 1, HEAD_DIM)).astype(np.float32)
        cls.ref, _ = reference(cls.q, cls.k, cls.v)

    def filled(self, dtype="fp8", wire=None):
        """A cache of `dtype` with the first TOKENS − 1 tokens (appended as `wire`: "bf16" for
        bf16, "bf16-values" for their values as float32, None for float32)."""
        cache = self.client.create_cache(KV_HEADS, HEAD_DIM, dtype=dtype)
        k, v = self.k[:, :-1], self.v[:, :-1]
        if wire == "bf16":
            cache.append(k, v, dtype="bf16")
        elif wire == "bf16-values":
            cache.append(bf16_round(k), bf16_round(v))
        else:
            cache.append(k, v)
        self.assertEqual(cache.length, TOKENS - 1)
        return cache

    def step(self, cache, wire=None):
        """The Decode: the last token appended (sent as `filled`'s wire), then q over all →
        the float32 output [HEADS, 1, HEAD_DIM]."""
        k1, v1 = self.k[:, -1:], self.v[:, -1:]
        if wire == "bf16":
            k1, v1 = bf16_tensor(k1), bf16_tensor(v1)
        elif wire == "bf16-values":
            k1, v1 = bf16_round(k1), bf16_round(v1)
        result = cache.decode(self.q, k1, v1)
        self.assertEqual(cache.length, TOKENS)
        self.assertEqual(result.output_dtype, "fp32")
        self.assertEqual(result.output.shape, (HEADS, 1, HEAD_DIM))
        return result.output

    def test_a_accuracy_of_fp32_tokens(self):
        """(a) 4096 float32 tokens in an fp8 cache: within 0.05 of the unquantized answer, and
        within the fp32 tolerance of the stored tokens' answer."""
        cache = self.filled()
        self.assertEqual(cache.dtype, "fp8_e4m3")
        self.assertEqual(self.client.cache_info(cache)["dtype"], "fp8_e4m3")
        out = self.step(cache).astype(np.float64)
        measured = ratio(out, self.ref)
        print("\n    (a) fp8 cache, float32 tokens: max |out − ref| / max |ref| = %.4f (bound "
              "%.2f; seed %d)" % (measured, ACCURACY_BOUND, SEED))
        self.assertLessEqual(measured, ACCURACY_BOUND)
        self.assertGreater(measured, QUANTIZED_FLOOR, "the answer is the unquantized one: were "
                           "the tokens stored as fp8?")
        keys, values, _, _ = export_tensors(self.client, cache)
        self.check_stored(keys, values, self.k, self.v, "(a)")
        stored_k, k_scales, _ = stored_rows(keys, HEAD_DIM)
        stored_v, v_scales, _ = stored_rows(values, HEAD_DIM)
        dequantized, score_max = reference(self.q, stored_k * k_scales, stored_v * v_scales)
        error = harness.output_error(out, dequantized, 1, score_max)
        print("    (a) against the stored tokens: %.3g × the fp32 bound"
              % harness.output_error_ratio(out, dequantized, 1, score_max))
        self.assertEqual(error, "", "against the stored (dequantized) tokens")
        cache.delete()

    def test_b_bf16_tokens(self):
        """(b) The same tokens sent as bf16: within 0.05, and the bytes and output of their
        float32 values; an odd shape sent as fp16 against float32."""
        as_bf16 = self.filled(wire="bf16")
        as_values = self.filled(wire="bf16-values")
        out = self.step(as_bf16, "bf16")
        same = self.step(as_values, "bf16-values")
        measured = ratio(out.astype(np.float64), self.ref)
        print("\n    (b) fp8 cache, bf16 tokens: max |out − ref| / max |ref| = %.4f (bound %.2f)"
              % (measured, ACCURACY_BOUND))
        self.assertLessEqual(measured, ACCURACY_BOUND)
        self.assertEqual(out.tobytes(), same.tobytes(), "bf16 tokens and their float32 values "
                         "decode differently")
        keys, values, key_bytes, value_bytes = export_tensors(self.client, as_bf16)
        self.assertEqual((key_bytes, value_bytes), export_tensors(self.client, as_values)[2:],
                         "bf16 tokens and their float32 values are stored differently")
        self.check_stored(keys, values, bf16_round(self.k), bf16_round(self.v), "(b)")
        for cache in (as_bf16, as_values):
            cache.delete()

        # Rows padded (21 codes + 3 zero bytes, 13 + 3), GQA 3 → 1, tokens sent as fp16.
        k = self.rng.standard_normal((1, 37, 21)).astype(np.float16)
        v = (self.rng.standard_normal((1, 37, 13)) * 100).astype(np.float16)
        q = self.rng.uniform(-1, 1, (3, 2, 21)).astype(np.float32)
        k1, v1 = (harness.encode(x[:, 36:], pb.DTYPE_FLOAT16)[0] for x in (k, v))
        outputs, exports = [], []
        for dtype in ("fp16", None):  # None: the fp8 cache's default, float32
            cache = self.client.create_cache(1, 21, 13, dtype="fp8_e4m3")
            cache.append(k[:, :36], v[:, :36], dtype=dtype)
            if dtype is None:
                k1, v1 = k[:, 36:], v[:, 36:]
            outputs.append(cache.decode(q, k1, v1, causal=True).output)
            exports.append(export_tensors(self.client, cache))
            cache.delete()
        self.assertEqual(exports[0][2:], exports[1][2:], "fp16 tokens stored differently")
        self.assertEqual(outputs[0].tobytes(), outputs[1].tobytes())
        self.check_stored(exports[0][0], exports[0][1], k.astype(np.float32),
                          v.astype(np.float32), "(b) fp16 [1, 37, 21 / 13]")

    def test_c_bytes(self):
        """(c) CacheInfo.bytes: fp8 ≤ 0.55 × bf16 for the same 4096 tokens."""
        fp8, bf16 = self.filled("fp8"), self.filled("bf16", wire="bf16")
        for cache in (fp8, bf16):
            self.step(cache, "bf16" if cache.dtype == "bf16" else None)
        fp8_bytes = self.client.cache_info(fp8)["bytes"]
        bf16_bytes = self.client.cache_info(bf16)["bytes"]
        print("\n    (c) %d tokens: fp8 cache %d bytes, bf16 cache %d bytes: %.3f (bound %.2f)"
              % (TOKENS, fp8_bytes, bf16_bytes, fp8_bytes / bf16_bytes, BYTES_BOUND))
        self.assertGreater(fp8_bytes, 0)
        self.assertLessEqual(fp8_bytes, BYTES_BOUND * bf16_bytes)
        fp8.delete()
        bf16.delete()
        # The server says it keeps fp8 caches, and takes fp8 for no tensor.
        info = self.client.info()
        self.assertIn("fp8_e4m3", info["cache_dtypes"])
        self.assertNotIn("fp8_e4m3", info["dtypes"])

    def test_d_fp8_is_no_tensor_dtype(self):
        """(d) DTYPE_FLOAT8_E4M3 as a tensor's or an output's dtype: INVALID_ARGUMENT naming
        dtype; an unknown cache dtype INVALID_ARGUMENT; the client's own ValueErrors."""
        channel = harness.open_channel(self.server.address)
        self.addCleanup(channel.close)
        stub = pb_grpc.AttentionServiceStub(channel)
        q = self.rng.uniform(-1, 1, (4, 8, 16)).astype(np.float32)
        query, _ = harness.encode(q, pb.DTYPE_FLOAT32)
        fp8_query = pb.Tensor(shape=[4, 8, 16], dtype=FP8, data=bytes(4 * 8 * 16))

        def refused(rpc, request, what):
            with self.assertRaises(grpc.RpcError) as raised:
                rpc(request, timeout=RPC_TIMEOUT_S)
            code, details = raised.exception.code(), raised.exception.details()
            print("    (d) %s: %s: %s" % (what, code.name, details))
            self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, "%s: %s" % (what, details))
            return details

        print()
        for name, rpc in (("Naive", stub.Naive), ("Tiled", stub.Tiled)):
            details = refused(rpc, pb.AttentionRequest(query=fp8_query, key=query, value=query),
                              "%s query DTYPE_FLOAT8_E4M3" % name)
            self.assertIn("dtype", details)
            request = pb.AttentionRequest(query=query, key=query, value=query)
            request.options.output_dtype = FP8
            self.assertIn("dtype", refused(rpc, request, "%s output_dtype DTYPE_FLOAT8_E4M3"
                                           % name))
        details = refused(stub.CreateCache, pb.CreateCacheRequest(
            kv_heads=2, head_dim=16, dtype=UNKNOWN_DTYPE), "CreateCache dtype 5")
        self.assertIn("dtype", details)

        # Tokens for an fp8 cache in fp8 itself, and a bf16 cache sent float32 tokens.
        cache = self.client.create_cache(4, 16, dtype="fp8")
        bf16 = self.client.create_cache(4, 16, dtype="bf16")
        fp8_tokens = pb.Tensor(shape=[4, 1, 16], dtype=FP8, data=bytes(4 * 16))
        self.assertIn("dtype", refused(stub.AppendCache, pb.AppendCacheRequest(
            cache_id=cache.id, key=fp8_tokens, value=fp8_tokens, expected_length=0),
            "AppendCache key DTYPE_FLOAT8_E4M3"))
        decode = pb.DecodeRequest()
        decode.items.add(cache_id=cache.id, query=query, key=fp8_tokens, value=fp8_tokens,
                         expected_length=0)
        self.assertIn("dtype", refused(stub.Decode, decode, "Decode item key DTYPE_FLOAT8_E4M3"))
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, bf16.append, q[:, :1], q[:, :1],
                        dtype="fp32")
        self.assertEqual((cache.refresh()["length"], bf16.refresh()["length"]), (0, 0))

        # Through the client: a Tensor passed as it is reaches attnd; "fp8" anywhere a tensor's
        # dtype goes is the client's ValueError, before any RPC.
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.tiled,
                                  fp8_query, q, q)
        self.assertIn("dtype", message)
        local = [
            lambda: self.client.tiled(q, q, q, dtype="fp8"),
            lambda: self.client.naive(q, q, q, output_dtype=FP8),
            lambda: cache.append(q[:, :1], q[:, :1], dtype="fp8"),
            lambda: cache.decode(q, q[:, :1], q[:, :1], dtype="float8_e4m3"),
            lambda: attn_client.SharedTensor("io", 0, q.shape, "fp8"),
            lambda: self.client.create_cache(4, 16, dtype=UNKNOWN_DTYPE),
        ]
        for index, call in enumerate(local):
            with self.subTest(local=index):
                with self.assertRaises(ValueError) as raised:
                    call()
                if index < 5:
                    self.assertIn("cache's dtype only", str(raised.exception))
        self.assertEqual(cache.length, 0)
        cache.delete()
        bf16.delete()

    def test_e_export_import(self):
        """(e) An fp8 cache exported and imported (chunks, and a file): the same bytes, and the
        next Decode bit-identical."""
        cache = self.filled()
        chunks = self.client.export_cache(cache, verify=True)
        info = chunks[0].info
        self.assertEqual((info.dtype, info.length), (FP8, TOKENS - 1))
        keys = [c.key for c in chunks if c.HasField("key")]
        stored = stored_rows(keys, HEAD_DIM)[0]
        self.assertEqual(stored.shape, (KV_HEADS, TOKENS - 1, HEAD_DIM))
        copy = self.client.import_cache(chunks, new_id_if_taken=True)
        directory = tempfile.mkdtemp(prefix="attn_fp8_")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "fp8.attnexp")
        self.client.export_cache(cache, path)
        from_file = self.client.import_cache(path, new_id_if_taken=True)
        original = export_tensors(self.client, cache)[2:]
        cache_bytes = self.client.cache_info(cache)["bytes"]
        outputs = [self.step(cache).tobytes()]
        for imported in (copy, from_file):
            self.assertNotEqual(imported.id, cache.id)
            self.assertEqual((imported.dtype, imported.length), ("fp8_e4m3", TOKENS - 1))
            self.assertEqual(imported.info["bytes"], cache_bytes)
            self.assertEqual(export_tensors(self.client, imported)[2:], original,
                             "the import's stored rows differ")
            outputs.append(self.step(imported).tobytes())
        self.assertEqual(outputs[1], outputs[0], "the imported cache decodes differently")
        self.assertEqual(outputs[2], outputs[0], "the cache imported from a file decodes "
                         "differently")
        print("\n    (e) %d chunks (%d with tokens), imported twice: Decode bit-identical"
              % (len(chunks), len(keys)))
        for each in (cache, copy, from_file):
            each.delete()


class ReplayTailTest(ServerCase):
    """--cache-dir with a write-behind far slower than the test: the tokens sent stay in the
    replay tail until a SIGKILL loses them."""

    _dir = None

    @classmethod
    def setUpClass(cls):
        cls._dir = tempfile.mkdtemp(prefix="attn_fp8_cache_")
        cls.server_args = ("--cache-dir", cls._dir, "--cache-sync-seconds", "600")
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        shutil.rmtree(cls._dir, ignore_errors=True)

    def test_refresh_requantizes_the_same_bytes(self):
        """float32 tokens kept as sent, re-sent after a SIGKILL: the same stored rows."""
        print()
        cache = self.client.create_cache(2, 21, 13, dtype="fp8")
        k = self.rng.standard_normal((2, 51, 21)).astype(np.float32)
        v = self.rng.standard_normal((2, 51, 13)).astype(np.float32)
        q = self.rng.uniform(-1, 1, (4, 1, 21)).astype(np.float32)
        cache.append(k[:, :50], v[:, :50])
        before = cache.decode(q, k[:, 50:], v[:, 50:]).output
        self.assertEqual(cache.durable_length, 0)
        self.assertEqual(cache.replay_tail, [(0, 50), (50, 1)])
        self.assertTrue(all(sent.key.dtype == pb.DTYPE_FLOAT32 for sent in cache._tail))
        exported = export_tensors(self.client, cache)
        self.check_stored(exported[0], exported[1], k, v, "replay")

        type(self).client.close()
        self.server.stop()
        old = self.server
        type(self).server = harness.AttndProcess(ARGS.attnd,
                                                 ("--threads", "4") + tuple(self.server_args))
        old.close()
        type(self).client = Client(self.server.address, timeout=RPC_TIMEOUT_S)
        cache.client = self.client
        self.assertEqual(self.client.cache_info(cache.id)["length"], 0)
        self.assertEqual(cache.refresh()["length"], 51)
        self.assertEqual(export_tensors(self.client, cache)[2:], exported[2:],
                         "re-sent tokens stored differently")
        self.assertEqual(cache.decode(q).output.tobytes(), before.tobytes())
        print("    replay: 51 tokens lost by a SIGKILL, re-sent by refresh(): same bytes")
        cache.delete()


if __name__ == "__main__":
    print("test_fp8_cache: seed %d (--seed %d repeats it)" % (SEED, SEED))
    sys.stdout.flush()
    unittest.main(argv=ARGS.unittest_argv, exit=True, verbosity=2)
