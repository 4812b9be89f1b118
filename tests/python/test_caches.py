#!/usr/bin/python3
"""Server-resident KV caches through the Python client (client/python/attn_client.py).

Starts attnd (tests/python/attnd_harness.py) and keeps, client-side, every token it sends to a
cache, as the server stores it (rounded to the cache's dtype), so each answer is checked against
a float64 reference over exactly those keys and values:

  - create_cache / append / cache_info / list_caches / delete_cache, a Cache tracking its length;
  - one decode call over a batch of three caches (fp32, bf16, fp16; odd lengths, GQA, one item
    with nq = 3 and causal, one without new tokens) against the reference, and each item against
    a stateless tiled call on the same keys;
  - naive, tiled and trace with cache= against the reference (trace: the last RowDone);
  - a stale expected_length → FAILED_PRECONDITION naming the actual length, the cache unchanged,
    for append and for decode (where no item of the batch keeps its tokens);
  - NOT_FOUND for every call after delete; INVALID_ARGUMENT naming the field for wrong shapes;
  - a second attnd with a small --cache-bytes: RESOURCE_EXHAUSTED naming the flag, the cache
    keeping what it had.

Run by CTest as
  /usr/bin/python3 tests/python/test_caches.py --attnd <attnd> --stubs <stubs dir>
"""

import sys
import unittest

import attnd_harness as harness  # tests/python is sys.path[0] for a script.

ARGS = harness.parse_args(__doc__, unittest=True)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import attn_client  # noqa: E402
from attn_client import AttnError, Cache, Client  # noqa: E402
from attnd_harness import DTYPE_NUMBER  # noqa: E402

RPC_TIMEOUT_S = 60.0


def as_stored(array, dtype):
    """(what to send, the float64 values the cache will hold) for float32 `array` in `dtype`."""
    if dtype == "fp32":
        return array, array.astype(np.float64)
    if dtype == "fp16":
        half = array.astype(np.float16)
        return half, half.astype(np.float64)
    bits = attn_client.float32_to_bf16(array)
    return bits, attn_client.bf16_to_float32(bits).astype(np.float64)


class Sequence:
    """A Cache plus the keys and values it holds, kept client-side as float64 [kv, n, d]."""

    def __init__(self, client, kv_heads, head_dim, value_dim, dtype, rng):
        self.cache = client.create_cache(kv_heads, head_dim, value_dim, dtype=dtype)
        self.dtype = dtype
        self.rng = rng
        self.keys = np.zeros((kv_heads, 0, head_dim))
        self.values = np.zeros((kv_heads, 0, value_dim))

    def tokens(self, n):
        """n random tokens: (key, value) to send, already added to the client-side copy."""
        kv, _, d = self.keys.shape
        k, k_seen = as_stored(self.rng.uniform(-1, 1, (kv, n, d)).astype(np.float32), self.dtype)
        v, v_seen = as_stored(self.rng.uniform(-1, 1, (kv, n, self.values.shape[2]))
                              .astype(np.float32), self.dtype)
        self.keys = np.concatenate([self.keys, k_seen], axis=1)
        self.values = np.concatenate([self.values, v_seen], axis=1)
        return k, v

    def append(self, n):
        k, v = self.tokens(n)
        return self.cache.append(k, v, dtype=self.dtype)

    def reference(self, q_seen, causal=False):
        """float64 attention of q [heads, nq, d] over the held tokens → (out, lse, score_max)."""
        out, lse, score_max = harness.reference_attention(
            q_seen[None], self.keys[None], self.values[None], causal=causal)
        return out[0], lse[0], score_max


class ServerCase(unittest.TestCase):
    server_args = ()
    server = None
    client = None
    _failed = False

    @classmethod
    def setUpClass(cls):
        cls._failed = False
        cls.server = harness.AttndProcess(ARGS.attnd, ("--threads", "2") + tuple(cls.server_args))
        cls.client = Client(cls.server.address, timeout=RPC_TIMEOUT_S)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()
        if cls._failed:
            sys.stderr.write("\n--- attnd stderr (%s) ---\n%s--- end attnd stderr ---\n"
                             % (cls.__name__, cls.server.stderr()))
        cls.server.close()

    def run(self, result=None):
        before = len(result.failures) + len(result.errors) if result is not None else 0
        result = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > before:
            type(self)._failed = True
        return result

    def assertCode(self, code, call, *args, **kwargs):
        with self.assertRaises(AttnError) as raised:
            call(*args, **kwargs)
        self.assertEqual(raised.exception.code, code, raised.exception.message)
        return raised.exception.message

    def assertMatches(self, out, ref, dtype, score_max, what):
        self.assertEqual(harness.output_error(out.astype(np.float64), ref, DTYPE_NUMBER[dtype],
                                              score_max), "", what)


class CacheTest(ServerCase):

    def setUp(self):
        self.rng = np.random.default_rng()

    def query(self, heads, nq, head_dim, dtype):
        return as_stored(self.rng.uniform(-1, 1, (heads, nq, head_dim)).astype(np.float32), dtype)

    def test_info_reports_cache_limits(self):
        info = self.client.info()
        self.assertGreater(info["cache_bytes"], 0)
        self.assertGreater(info["cache_page_tokens"], 0)
        self.assertGreaterEqual(info["cache_idle_seconds"], 0)

    def test_create_append_info_list_delete(self):
        seq = Sequence(self.client, 2, 24, 20, "fp32", self.rng)
        cache = seq.cache
        self.assertIsInstance(cache, Cache)
        self.assertRegex(cache.id, r"^[0-9a-f]{32}$")
        self.assertEqual((cache.length, cache.kv_heads, cache.head_dim, cache.value_dim,
                          cache.dtype), (0, 2, 24, 20, "fp32"))
        info = seq.append(37)
        self.assertEqual(info["length"], 37)
        self.assertEqual(cache.length, 37)
        self.assertGreater(info["bytes"], 0)
        self.assertGreater(info["page_tokens"], 0)
        # Pages are whole: bytes is a whole number of pages of 2·(24 + 20)·4 bytes per token.
        pages = -(-37 // info["page_tokens"])
        self.assertEqual(info["bytes"], pages * info["page_tokens"] * 2 * (24 + 20) * 4)
        info = seq.append(5)
        self.assertEqual(cache.length, 42)
        self.assertEqual(self.client.cache_info(cache.id), info)
        self.assertEqual(cache.refresh(), info)
        listed = {c["cache_id"]: c for c in self.client.list_caches()}
        self.assertEqual(listed.get(cache.id), info)
        # An existing id reopened: the length is read from the server.
        reopened = self.client.open_cache(cache.id)
        self.assertEqual(reopened.length, 42)
        # The tokens are the ones sent: tiled over the cache equals the reference.
        q, q_seen = self.query(4, 3, 24, "fp32")
        ref, _, score_max = seq.reference(q_seen)
        self.assertMatches(self.client.tiled(q, cache=cache, block_k=5).output, ref, "fp32",
                           score_max, "tiled over the cache")
        cache.delete()
        self.assertNotIn(cache.id, [c["cache_id"] for c in self.client.list_caches()])

    def test_decode_batch(self):
        # Three sequences of different dtypes, lengths and shapes in one Decode call.
        seqs = [Sequence(self.client, 2, 16, 12, "fp32", self.rng),
                Sequence(self.client, 1, 16, 16, "bf16", self.rng),
                Sequence(self.client, 3, 8, 5, "fp16", self.rng)]
        for seq, n in zip(seqs, (101, 7, 53)):
            seq.append(n)
        shapes = [(4, 1, 16), (3, 3, 16), (6, 1, 8)]  # heads, nq, head_dim
        queries, items = [], []
        for index, (seq, (heads, nq, d)) in enumerate(zip(seqs, shapes)):
            q, q_seen = self.query(heads, nq, d, seq.dtype)
            queries.append((q, q_seen))
            if index == 2:  # No new tokens for this one.
                items.append({"cache": seq.cache, "query": q})
            else:
                k, v = seq.tokens(1 if index == 0 else 2)
                items.append((seq.cache, q, k, v))
        lengths_before = [s.cache.length for s in seqs]
        # Item 1's bf16 query goes as float32 holding its bf16 values exactly (one dtype= would
        # convert every item's inputs); its key and value go in the cache's dtype, bf16.
        result = self.client.decode(
            [items[0], (seqs[1].cache, attn_client.bf16_to_float32(queries[1][0]),
                        *items[1][2:]), items[2]],
            causal=True, return_lse=True)
        self.assertEqual(len(result.outputs), 3)
        self.assertEqual([c["length"] for c in result.caches], [102, 9, 53])
        self.assertEqual([s.cache.length for s in seqs], [102, 9, 53])
        self.assertEqual(lengths_before, [101, 7, 53])
        self.assertGreater(result.stats["flops"], 0)
        for index, (seq, (heads, nq, d)) in enumerate(zip(seqs, shapes)):
            with self.subTest(item=index, dtype=seq.dtype):
                q_seen = queries[index][1]
                ref, ref_lse, score_max = seq.reference(q_seen, causal=True)
                out = result.outputs_float32()[index]
                self.assertEqual(out.shape, (heads, nq, seq.values.shape[2]))
                # Item 1's query went as float32 (its bf16 values exactly): fp32 output.
                out_dtype = "fp32" if index != 2 else "fp16"
                self.assertMatches(out, ref, out_dtype, score_max, "decode vs float64")
                self.assertEqual(harness.lse_error(result.lse[index].astype(np.float64),
                                                   ref_lse), "")
                # The same step as a stateless tiled call on the same keys.
                k_all, v_all = (x.astype(np.float32) for x in (seq.keys, seq.values))
                stateless = self.client.tiled(q_seen.astype(np.float32), k_all, v_all,
                                              causal=True, output_dtype=out_dtype)
                self.assertMatches(stateless.output_float32(), ref, out_dtype, score_max,
                                   "stateless tiled vs float64")
                if out_dtype == "fp32":
                    np.testing.assert_allclose(out, stateless.output, rtol=0,
                                               atol=2e-5 * float(np.max(np.abs(ref))))

    def test_single_decode_steps(self):
        # A decode loop on one cache through Cache.decode: each step one new token.
        seq = Sequence(self.client, 2, 32, 32, "bf16", self.rng)
        seq.append(300)
        for step in range(4):
            q, q_seen = self.query(8, 1, 32, "bf16")
            k, v = seq.tokens(1)
            result = seq.cache.decode(q, k, v, dtype="bf16", output_dtype="fp32")
            self.assertEqual(seq.cache.length, 301 + step)
            self.assertEqual(result.cache["length"], 301 + step)
            ref, _, score_max = seq.reference(q_seen)
            self.assertMatches(result.output, ref, "fp32", score_max, "step %d" % step)
        seq.cache.delete()

    def test_naive_tiled_trace_over_cache(self):
        seq = Sequence(self.client, 2, 12, 9, "fp32", self.rng)
        seq.append(29)
        q, q_seen = self.query(4, 6, 12, "fp32")
        ref, ref_lse, score_max = seq.reference(q_seen, causal=True)
        for name in ("naive", "tiled"):
            with self.subTest(rpc=name):
                result = getattr(self.client, name)(q, cache=seq.cache, causal=True, block_k=4,
                                                    return_lse=True)
                self.assertMatches(result.output, ref, "fp32", score_max, name)
                self.assertEqual(harness.lse_error(result.lse.astype(np.float64), ref_lse), "")
        events = list(self.client.trace(q, cache=seq.cache.id, rows=[(0, 3, 5)], block_k=4,
                                        causal=True))
        self.assertEqual(events[0]["kind"], "start")
        self.assertEqual(events[0]["key_len"], 29)
        done = [e for e in events if e["kind"] == "row_done"]
        self.assertEqual(len(done), 1)
        self.assertEqual(harness.output_error(done[0]["output"].astype(np.float64), ref[3, 5],
                                              1, score_max, float(np.max(np.abs(ref)))), "")
        with self.assertRaises(ValueError):
            self.client.tiled(q, q, q, cache=seq.cache)
        with self.assertRaises(ValueError):
            self.client.tiled(q)

    def test_stale_expected_length(self):
        seq = Sequence(self.client, 1, 8, 8, "fp32", self.rng)
        seq.append(10)
        k, v = seq.rng.uniform(-1, 1, (2, 1, 3, 8)).astype(np.float32)
        # A retried append: the client believes 0 but the cache holds 10.
        message = self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.append,
                                  seq.cache.id, k, v, expected_length=0)
        self.assertIn("10", message)
        self.assertEqual(self.client.cache_info(seq.cache)["length"], 10)
        # Decode: the stale item makes the whole batch fail; the good item keeps nothing.
        other = Sequence(self.client, 1, 8, 8, "fp32", self.rng)
        other.append(4)
        q = seq.rng.uniform(-1, 1, (2, 1, 8)).astype(np.float32)
        message = self.assertCode(
            grpc.StatusCode.FAILED_PRECONDITION, self.client.decode,
            [(other.cache, q, k, v),
             {"cache": seq.cache.id, "query": q, "key": k, "value": v, "expected_length": 9}])
        self.assertIn("10", message)
        self.assertEqual(self.client.cache_info(other.cache.id)["length"], 4)
        self.assertEqual(other.cache.length, 4)  # The Cache did not move either.
        self.assertEqual(self.client.cache_info(seq.cache.id)["length"], 10)
        # The right length works, and the reference still holds (nothing was stored twice).
        self.client.append(seq.cache.id, k, v, expected_length=10)
        seq.keys = np.concatenate([seq.keys, k.astype(np.float64)], axis=1)
        seq.values = np.concatenate([seq.values, v.astype(np.float64)], axis=1)
        ref, _, score_max = seq.reference(q.astype(np.float64))
        self.assertMatches(self.client.tiled(q, cache=seq.cache.id).output, ref, "fp32",
                           score_max, "after the refused appends")
        # Client-side: an id without expected_length is refused before any RPC.
        with self.assertRaises(ValueError):
            self.client.append(seq.cache.id, k, v)

    def test_not_found_after_delete(self):
        seq = Sequence(self.client, 1, 4, 4, "fp32", self.rng)
        seq.append(3)
        cache = seq.cache
        self.client.delete_cache(cache)
        q = np.ones((1, 1, 4), np.float32)
        k = np.ones((1, 1, 4), np.float32)
        not_found = grpc.StatusCode.NOT_FOUND
        self.assertCode(not_found, self.client.cache_info, cache.id)
        self.assertCode(not_found, cache.append, k, k)
        self.assertCode(not_found, cache.decode, q, k, k)
        self.assertCode(not_found, self.client.tiled, q, cache=cache)
        self.assertCode(not_found, self.client.naive, q, cache=cache)
        self.assertCode(not_found, lambda: list(self.client.trace(q, cache=cache)))
        self.assertCode(not_found, self.client.delete_cache, cache)
        self.assertCode(not_found, self.client.cache_info, "0" * 32)
        self.assertNotIn(cache.id, [c["cache_id"] for c in self.client.list_caches()])

    def test_invalid_arguments_leave_the_cache(self):
        seq = Sequence(self.client, 2, 8, 6, "fp32", self.rng)
        seq.append(5)
        cache = seq.cache
        bad = self.rng.uniform(-1, 1, (2, 1, 7)).astype(np.float32)    # head_dim 7, not 8
        good_v = self.rng.uniform(-1, 1, (2, 1, 6)).astype(np.float32)
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, cache.append, bad, good_v)
        self.assertIn("key", message)
        # Keys and values of different lengths.
        k2 = self.rng.uniform(-1, 1, (2, 2, 8)).astype(np.float32)
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, cache.append, k2, good_v)
        self.assertIn("value", message)
        # Query heads not a multiple of kv_heads.
        q3 = self.rng.uniform(-1, 1, (3, 1, 8)).astype(np.float32)
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, cache.decode, q3)
        self.assertIn("query", message)
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.tiled, q3, cache=cache)
        self.assertEqual(self.client.cache_info(cache)["length"], 5)
        # Bad create.
        self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.create_cache, 0, 8)


class BudgetTest(ServerCase):
    # 64 KiB of cache memory: a few pages of a 1 × 16 fp32 cache, far from 20 000 tokens.
    server_args = ("--cache-bytes", "65536")

    def test_over_budget(self):
        self.assertEqual(self.client.info()["cache_bytes"], 65536)
        cache = self.client.create_cache(1, 16, dtype="fp32")
        k = np.ones((1, 3, 16), np.float32)
        cache.append(k, k)
        big = np.ones((1, 20000, 16), np.float32)
        message = self.assertCode(grpc.StatusCode.RESOURCE_EXHAUSTED, cache.append, big, big)
        self.assertIn("cache-bytes", message)
        self.assertEqual(self.client.cache_info(cache)["length"], 3)
        self.assertEqual(cache.length, 3)
        cache.delete()


if __name__ == "__main__":
    unittest.main(argv=ARGS.unittest_argv, exit=True)
