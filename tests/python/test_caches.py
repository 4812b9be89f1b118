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
    keeping what it had;
  - speculative decoding (TruncateCache, DecodeItem.truncate_to): a cache cut back equals, bit
    for bit (export, bytes, the next Decode's outputs and lse, Tiled over it), one that never had
    the cut tokens, in fp32 / bf16 / fp16, cut inside a page, a page freed, at a page boundary,
    to 0 and to its own length; five rounds of two sequences verifying k drafts (nq = k + 1,
    causal) and cutting the rejected ones with truncate_to in the next call (a batch, then
    Cache.decode), equal to caches built directly from the accepted tokens and to float64;
    a length past the cache → OUT_OF_RANGE, a stale expected_length → FAILED_PRECONDITION naming
    the actual length, negative → INVALID_ARGUMENT naming the field, client-side TypeError /
    ValueError naming the argument, each leaving the cache as it was (info, export, a Decode's
    bits); failed 2-item Decodes with truncate_to (shapes only the cache can refuse, a stale
    expected_length, a cut past a cache, in either order) leave both caches as they were; a
    Decode item's cut of exactly 64 MiB of tokens and of one token more;
  - cuts with --cache-dir (their own attnd processes): SIGKILL after cuts above and below the
    durable length (TruncateCache and truncate_to), a restart and Cache.refresh() never bring a
    cut token back; a cut among tokens not yet written, and one below what the file holds with
    tokens pending, then a SIGTERM's flush: exactly the kept and later tokens on disk; a cut
    whose answer is lost (applied, or never sent) and refresh() re-sending nothing past it;
    refused cuts keeping the replay tail;
  - token trees (DecodeItem.tree_parents): a 7-token tree over a cached prefix (GQA, causal,
    fp32 through Cache.decode, bf16 through a batch beside a plain item), each row against a
    float64 reference over the prefix and its branch and against a plain causal decode over a
    cache holding just that branch (within 1e-5), and the same without the causal mask; a tree
    step then truncate_to keeping the branch t0 → t1 in place, a cut and a tree in one call, and
    the branch t0 → t2 → t5 cut and sent again, each bit-equal (outputs, lse, export) to caches
    built from the kept tokens; INVALID_ARGUMENT naming items[i].tree_parents (count, > 1024, no
    new tokens), items[i].query (rows) and items[i].tree_parents[j] (not earlier), client-side
    TypeError / ValueError naming (items[i].)tree_parents[j], each leaving the cache as it was;
  - latent caches (CreateCacheRequest.values_from_keys, MLA): fp32 / bf16 / fp16 caches of odd
    shapes (kv_heads 1, head_dim 72, value_dim 40 under 13 query heads; GQA; value_dim None =
    head_dim) filled with keys alone, decoded (Cache.decode, a batch beside an ordinary cache,
    causal rows, tiled over the cache) against a float64 reference whose values are
    keys[..., :value_dim]; CacheInfo.bytes exactly the keys' pages (half those of a cache storing
    both when value_dim = head_dim); a value refused by the client before any RPC (ValueError
    naming value / items[i].value) and by the server (INVALID_ARGUMENT naming value and
    items[0].value, through the raw stub and through an id), value_dim > head_dim
    INVALID_ARGUMENT naming value_dim; export (keys-only chunks, CRC32C) and import (chunks and a
    file) bit-exact and still latent, a chunk carrying a value refused naming it; with
    --cache-dir a restart keeps the cache latent, and after a SIGKILL refresh() re-sends the lost
    tail as keys alone;
  - forks (ForkCache): a fork of all tokens and of prefixes (inside a page, at a page boundary,
    0) in fp32 / bf16 / fp16 equal, bit for bit (export, bytes, a Decode's outputs and lse, Tiled
    over it), a copy built by appending the same tokens, before and after both get the same
    tokens of their own; the source's Decode unchanged by the fork's append, the fork unchanged
    by the source's, and by the source's delete; shared_bytes all of a fork's bytes right after
    forking (the source sharing as many), then the pages before the one an append copied; forks
    by id, of forks, in a Decode batch; 8 forks of a cache fitting an attnd --cache-bytes that 8
    copies do not (RESOURCE_EXHAUSTED naming it), a fork at --max-caches RESOURCE_EXHAUSTED
    naming it; a length past the source → OUT_OF_RANGE naming length, a stale expected_length →
    FAILED_PRECONDITION naming it (checked first), negatives → INVALID_ARGUMENT naming the
    field, an unknown id → NOT_FOUND naming cache_id, client-side TypeError / ValueError before
    any RPC, none creating a cache; four threads appending to one source and forking it,
    appending to their forks and forking those, every cache then holding exactly its tokens;
    with --cache-dir a fork durable at once (durable_length = length, an empty replay tail),
    kept by a SIGKILL, refresh() re-sending what came after, and after a restart sharing its
    pages with its source again.

Run by CTest as
  /usr/bin/python3 tests/python/test_caches.py --attnd <attnd> --stubs <stubs dir>
"""

import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import unittest

import attnd_harness as harness  # tests/python is sys.path[0] for a script.

ARGS = harness.parse_args(__doc__, unittest=True)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import attn_client  # noqa: E402
from attn_client import AttnError, Cache, Client  # noqa: E402
from attnd_harness import DTYPE_NUMBER  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402
from attention.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

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


class ServerCase(harness.ServerCase):
    attnd = ARGS.attnd
    rpc_timeout = RPC_TIMEOUT_S


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


# --- Speculative decoding: TruncateCache and DecodeItem.truncate_to -----------------------------

STORED_NUMPY = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}


def stored_tokens(rng, kv_heads, n, dim, dtype):
    """n random tokens [kv_heads, n, dim] as the cache stores them (bf16: uint16 bits), so what
    is sent is what the server keeps, bit for bit."""
    return as_stored(rng.uniform(-1, 1, (kv_heads, n, dim)).astype(np.float32), dtype)[0]


def widened(array, dtype):
    """Stored tokens as float64 values."""
    return (attn_client.bf16_to_float32(array) if dtype == "bf16" else array).astype(np.float64)


def joined(*arrays):
    return np.concatenate(arrays, axis=1)


def exported(client, cache):
    """ExportCache of a Cache or id → (length, keys [kv_heads, n, head_dim], values [kv_heads, n,
    value_dim]) in the stored dtype."""
    chunks = client.export_cache(cache)
    info = chunks[0].info
    dtype = STORED_NUMPY[harness.DTYPE_NAMES[info.dtype]]
    keys = [np.zeros((info.kv_heads, 0, info.head_dim), dtype)]
    values = [np.zeros((info.kv_heads, 0, info.value_dim), dtype)]
    for chunk in chunks:
        if chunk.HasField("key"):
            keys.append(np.frombuffer(chunk.key.data, dtype)
                        .reshape(info.kv_heads, -1, info.head_dim))
            values.append(np.frombuffer(chunk.value.data, dtype)
                          .reshape(info.kv_heads, -1, info.value_dim))
    return info.length, joined(*keys), joined(*values)


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def decode_bits(result):
    """A DecodeResult's (or Result's) outputs and lse as bytes, to compare bit for bit."""
    outputs = result.outputs if hasattr(result, "outputs") else [result.output]
    lse = result.lse if isinstance(result.lse, list) else [result.lse]
    return [o.tobytes() for o in outputs] + [x.tobytes() for x in lse if x is not None]


class TokenCase(ServerCase):
    """Helpers for tests that build caches from known tokens (no tests of its own)."""

    def setUp(self):
        self.rng = np.random.default_rng()

    def kv(self, layout, n):
        """n random tokens (key, value) for a cache of `layout`, in its stored dtype."""
        dtype, kv_heads, head_dim, value_dim, _ = layout
        return (stored_tokens(self.rng, kv_heads, n, head_dim, dtype),
                stored_tokens(self.rng, kv_heads, n, value_dim, dtype))

    def query(self, layout, nq):
        _, _, head_dim, _, heads = layout
        return self.rng.uniform(-1, 1, (heads, nq, head_dim)).astype(np.float32)

    def cache(self, layout, key=None, value=None):
        """A new Cache of `layout` holding key/value (none when None or empty); deleted after
        the test."""
        dtype, kv_heads, head_dim, value_dim, _ = layout
        cache = self.client.create_cache(kv_heads, head_dim, value_dim, dtype=dtype)
        self.addCleanup(self.delete_quietly, cache.id)
        if key is not None and key.shape[1] > 0:
            cache.append(key, value)
        return cache

    def delete_quietly(self, cache_id):
        try:
            self.client.delete_cache(cache_id)
        except AttnError:
            pass

    def snapshot(self, cache, query):
        """What the server holds for `cache` (a Cache or id), to compare before and after a
        failed call: its info, its tokens' bytes and a Decode over it (no new tokens: it
        changes nothing) as bits."""
        cache_id = attn_client._cache_id(cache)
        info = self.client.cache_info(cache_id)
        length, keys, values = exported(self.client, cache_id)
        step = self.client.decode([{"cache": cache_id, "query": query,
                                    "expected_length": info["length"]}],
                                  causal=True, return_lse=True)
        return info, length, keys.tobytes(), values.tobytes(), decode_bits(step)

    def assertSameCache(self, got, want, what):
        """Caches (or ids) `got` and `want` hold the same tokens bit for bit, with the same
        length, layout and page bytes."""
        got_info = self.client.cache_info(attn_client._cache_id(got))
        want_info = self.client.cache_info(attn_client._cache_id(want))
        for field in ("length", "bytes", "kv_heads", "head_dim", "value_dim", "dtype",
                      "page_tokens"):
            self.assertEqual(got_info[field], want_info[field], "%s: %s" % (what, field))
        got_tokens, want_tokens = exported(self.client, got), exported(self.client, want)
        self.assertEqual(got_tokens[0], want_tokens[0], what)
        self.assertTrue(same_bytes(got_tokens[1], want_tokens[1]), "%s: keys differ" % what)
        self.assertTrue(same_bytes(got_tokens[2], want_tokens[2]), "%s: values differ" % what)


class TruncateTest(TokenCase):
    """TruncateCache and DecodeItem.truncate_to against one attnd without --cache-dir."""

    # dtype, kv_heads, head_dim, value_dim, query heads.
    LAYOUTS = (("fp32", 2, 16, 12, 4), ("bf16", 1, 32, 32, 3), ("fp16", 2, 8, 8, 8))

    def test_cut_cache_equals_one_that_never_had_the_tokens(self):
        page = self.client.info()["cache_page_tokens"]
        # (tokens appended, tokens kept): inside a page, a whole page freed, at a page boundary,
        # nothing cut, everything cut, one token cut.
        cuts = ((page + 7, page - 3), (2 * page + 5, page + 1), (2 * page + 1, 2 * page),
                (37, 37), (29, 0), (page + 5, page + 4))
        for layout in self.LAYOUTS:
            for total, kept in cuts:
                with self.subTest(dtype=layout[0], total=total, kept=kept):
                    key, value = self.kv(layout, total)
                    split = total // 3 + 1  # Two appends, the second straddling the cut.
                    cut = self.cache(layout, key[:, :split], value[:, :split])
                    cut.append(key[:, split:], value[:, split:])
                    direct = self.cache(layout, key[:, :kept], value[:, :kept])
                    info = cut.truncate(kept)
                    self.assertEqual((info["length"], cut.length), (kept, kept))
                    self.assertIsNone(info["durable_length"])
                    self.assertEqual(info, self.client.cache_info(cut.id))
                    self.assertEqual(cut.replay_tail, [])
                    self.assertSameCache(cut, direct, "after the cut")
                    # The next step (two new tokens, three query rows, causal, lse) and Tiled
                    # over the cache give the same bits on both.
                    q = self.query(layout, 3)
                    k1, v1 = self.kv(layout, 2)
                    got = cut.decode(q, k1, v1, causal=True, return_lse=True)
                    want = direct.decode(q, k1, v1, causal=True, return_lse=True)
                    self.assertEqual(decode_bits(got), decode_bits(want), "the next Decode")
                    self.assertEqual((got.cache["length"], cut.length), (kept + 2, kept + 2))
                    tiled = [self.client.tiled(q, cache=c, causal=True, block_k=5,
                                               return_lse=True) for c in (cut, direct)]
                    self.assertEqual(decode_bits(tiled[0]), decode_bits(tiled[1]), "Tiled")
                    self.assertSameCache(cut, direct, "after the next Decode")
                    # And both are right: the float64 reference over the kept and new tokens.
                    dtype = layout[0]
                    ref, _, score_max = harness.reference_attention(
                        q[None].astype(np.float64),
                        widened(joined(key[:, :kept], k1), dtype)[None],
                        widened(joined(value[:, :kept], v1), dtype)[None], causal=True)
                    self.assertMatches(got.output, ref[0], "fp32", score_max, "vs float64")

    def test_speculative_steps_verify_drafts_and_cut_the_rejected_ones(self):
        # Two sequences decoded together; each round one Decode appends k + 1 tokens per
        # sequence (the last accepted token and k drafts) and verifies them with k + 1 causal
        # query rows, and from the second round on first cuts (truncate_to) the drafts the
        # previous round rejected. Each round equals the same Decode on caches built directly
        # from the accepted tokens.
        drafts = 4
        layouts = (("bf16", 2, 16, 16, 8), ("fp32", 1, 24, 20, 3))
        seqs = []
        for layout, prefix in zip(layouts, (45, 70)):
            key, value = self.kv(layout, prefix)
            seqs.append({"layout": layout, "cache": self.cache(layout, key, value),
                         "keys": key, "values": value})
        for round_ in range(5):
            items, steps = [], []
            for seq in seqs:
                k_new, v_new = self.kv(seq["layout"], drafts + 1)
                q = self.query(seq["layout"], drafts + 1)
                item = {"cache": seq["cache"], "query": q, "key": k_new, "value": v_new}
                if round_ > 0:
                    item["truncate_to"] = seq["keys"].shape[1]
                items.append(item)
                steps.append((q, k_new, v_new))
            if round_ == 4:  # The last round through Cache.decode, one sequence at a time.
                result = [seq["cache"].decode(q, k, v, truncate_to=item["truncate_to"],
                                              causal=True, return_lse=True)
                          for seq, item, (q, k, v) in zip(seqs, items, steps)]
                got = [bits for r in result for bits in decode_bits(r)]
                infos = [r.cache for r in result]
            else:
                result = self.client.decode(items, causal=True, return_lse=True)
                got, infos = decode_bits(result), result.caches
            direct = [self.cache(seq["layout"], seq["keys"], seq["values"]) for seq in seqs]
            if round_ == 4:
                want = [bits for c, (q, k, v) in zip(direct, steps)
                        for bits in decode_bits(c.decode(q, k, v, causal=True,
                                                         return_lse=True))]
            else:
                want = decode_bits(self.client.decode(
                    [(c, q, k, v) for c, (q, k, v) in zip(direct, steps)], causal=True,
                    return_lse=True))
            self.assertEqual(got, want, "round %d: outputs and lse" % round_)
            for index, (seq, cache, info, (q, k_new, v_new)) in enumerate(
                    zip(seqs, direct, infos, steps)):
                what = "round %d, sequence %d" % (round_, index)
                length = seq["keys"].shape[1] + drafts + 1
                self.assertEqual((info["length"], seq["cache"].length), (length, length), what)
                self.assertSameCache(seq["cache"], cache, what)
                dtype = seq["layout"][0]
                ref, _, score_max = harness.reference_attention(
                    q[None].astype(np.float64), widened(joined(seq["keys"], k_new), dtype)[None],
                    widened(joined(seq["values"], v_new), dtype)[None], causal=True)
                out = result[index].output if round_ == 4 else result.outputs[index]
                self.assertMatches(out, ref[0], "fp32", score_max, what + " vs float64")
                # Accepted drafts: every count from none to all over the rounds.
                accepted = (round_ + 2 * index) % (drafts + 1)
                seq["keys"] = joined(seq["keys"], k_new[:, :1 + accepted])
                seq["values"] = joined(seq["values"], v_new[:, :1 + accepted])
                cache.delete()

    def test_truncate_errors_leave_the_cache_as_it_was(self):
        layout = ("fp32", 1, 8, 8, 2)
        cache = self.cache(layout, *self.kv(layout, 10))
        q = self.query(layout, 2)
        before = self.snapshot(cache, q)

        def unchanged(what):
            self.assertEqual(self.snapshot(cache, q), before, what)
            self.assertEqual(cache.length, 10, what)

        code = grpc.StatusCode
        # A length past the cache's: OUT_OF_RANGE naming it (and the cache's length).
        message = self.assertCode(code.OUT_OF_RANGE, cache.truncate, 11)
        self.assertIn("length", message)
        self.assertIn("10", message)
        unchanged("length 11")
        self.assertCode(code.OUT_OF_RANGE, self.client.truncate_cache, cache.id, 11)
        unchanged("length 11, no expected_length")
        # A stale expected_length: FAILED_PRECONDITION naming the actual length.
        message = self.assertCode(code.FAILED_PRECONDITION, cache.truncate, 4, expected_length=9)
        self.assertIn("expected_length", message)
        self.assertIn("holds 10", message)
        unchanged("expected_length 9")
        self.assertCode(code.FAILED_PRECONDITION, self.client.truncate_cache, cache.id, 4,
                        expected_length=11)
        unchanged("expected_length 11")
        stale = Cache(self.client, dict(cache.info, length=12))  # A Cache that believes 12.
        self.assertCode(code.FAILED_PRECONDITION, stale.truncate, 4)
        self.assertEqual(stale.length, 12)
        unchanged("a stale Cache")
        # Negative values (past the client's own checks): INVALID_ARGUMENT naming the field.
        for request, field in (
                (pb.TruncateCacheRequest(cache_id=cache.id, length=-1), "length"),
                (pb.TruncateCacheRequest(cache_id=cache.id, length=-1, expected_length=10),
                 "length"),
                (pb.TruncateCacheRequest(cache_id=cache.id, length=3, expected_length=-10),
                 "expected_length")):
            message = self.assertCode(code.INVALID_ARGUMENT, self.client._call, "TruncateCache",
                                      self.client._stub.TruncateCache, request)
            self.assertIn(field, message)
            unchanged("negative %s" % field)
        item = pb.DecodeItem(cache_id=cache.id, query=attn_client._encode("query", q, None),
                             expected_length=10, truncate_to=-1)
        message = self.assertCode(code.INVALID_ARGUMENT, self.client._call, "Decode",
                                  self.client._stub.Decode, pb.DecodeRequest(items=[item]))
        self.assertIn("items[0].truncate_to", message)
        unchanged("negative truncate_to")
        # Decode: a cut past the cache, a stale expected_length with a cut.
        k1, v1 = self.kv(layout, 1)
        message = self.assertCode(code.OUT_OF_RANGE, cache.decode, q, k1, v1, truncate_to=11)
        self.assertIn("items[0].truncate_to", message)
        unchanged("truncate_to 11")
        self.assertCode(code.FAILED_PRECONDITION, self.client.decode,
                        [{"cache": cache, "query": q, "key": k1, "value": v1, "truncate_to": 5,
                          "expected_length": 5}])
        unchanged("truncate_to 5 with expected_length 5 (the length after the cut)")
        # The client's own checks, before any RPC: TypeError / ValueError naming the argument.
        for call, error, name in (
                (lambda: cache.truncate(-1), ValueError, "length"),
                (lambda: cache.truncate(True), TypeError, "length"),
                (lambda: cache.truncate(4.0), TypeError, "length"),
                (lambda: cache.truncate(np.float32(4)), TypeError, "length"),
                (lambda: cache.truncate(1 << 63), ValueError, "length"),
                (lambda: cache.truncate(4, expected_length=-1), ValueError, "expected_length"),
                (lambda: cache.truncate(4, expected_length=False), TypeError, "expected_length"),
                (lambda: self.client.truncate_cache(cache.id, "4"), TypeError, "length"),
                (lambda: cache.decode(q, truncate_to=-2), ValueError, "truncate_to"),
                (lambda: cache.decode(q, truncate_to=False), TypeError, "truncate_to"),
                (lambda: self.client.decode([{"cache": cache, "query": q, "truncate_to": 2.5}]),
                 TypeError, "items[0].truncate_to"),
                (lambda: self.client.decode([(cache, q), {"cache": cache.id, "query": q,
                                                          "expected_length": 10,
                                                          "truncate_to": -3}]),
                 ValueError, "items[1].truncate_to")):
            with self.assertRaises(error) as raised:
                call()
            self.assertIn(name, str(raised.exception))
        unchanged("client-side errors")
        # numpy integers are ints; a cut by id without expected_length is not checked.
        self.assertEqual(self.client.truncate_cache(cache.id, np.int64(10))["length"], 10)
        unchanged("a cut to its own length")
        info = self.client.truncate_cache(cache.id, 6)
        self.assertEqual(info["length"], 6)
        self.assertEqual(cache.length, 10)  # This Cache was not told: its next cut is refused.
        message = self.assertCode(code.FAILED_PRECONDITION, cache.truncate, 3)
        self.assertIn("holds 6", message)
        self.assertEqual(self.client.cache_info(cache)["length"], 6)  # Taken as it is.
        self.assertEqual(cache.truncate(3)["length"], 3)
        self.assertEqual(cache.length, 3)
        # A deleted cache: NOT_FOUND.
        cache.delete()
        self.assertCode(code.NOT_FOUND, cache.truncate, 0)
        self.assertCode(code.NOT_FOUND, self.client.truncate_cache, "0" * 32, 0)

    def test_failed_decode_with_truncate_to_leaves_every_cache(self):
        layout_a, layout_b = ("fp32", 2, 8, 8, 4), ("fp16", 1, 16, 12, 2)
        a = self.cache(layout_a, *self.kv(layout_a, 21))
        b = self.cache(layout_b, *self.kv(layout_b, 13))
        qa, qb = self.query(layout_a, 2), self.query(layout_b, 1)
        before = [self.snapshot(a, qa), self.snapshot(b, qb)]
        ka, va = self.kv(layout_a, 2)
        kb, vb = self.kv(layout_b, 1)
        cut_a = {"cache": a, "query": qa, "key": ka, "value": va, "truncate_to": 15}
        cut_b = {"cache": b, "query": qb, "key": kb, "value": vb, "truncate_to": 10}
        code = grpc.StatusCode
        cases = (
            # Shapes only the cache can refuse: the query's head_dim (16 here, the cache's 8),
            # query heads not a multiple of its kv_heads, a key of the wrong head_dim.
            ("a's query head_dim", code.INVALID_ARGUMENT, "query",
             [cut_b, dict(cut_a, query=self.rng.uniform(-1, 1, (4, 2, 16)).astype(np.float32))]),
            ("a's query heads", code.INVALID_ARGUMENT, "query",
             [cut_b, dict(cut_a, query=self.rng.uniform(-1, 1, (3, 2, 8)).astype(np.float32))]),
            ("b's key head_dim", code.INVALID_ARGUMENT, "key",
             [cut_a, dict(cut_b, key=stored_tokens(self.rng, 1, 1, 15, "fp16"))]),
            # A stale expected_length on the other item, or on the cut item itself.
            ("b's stale expected_length", code.FAILED_PRECONDITION, "expected_length",
             [cut_a, dict(cut_b, expected_length=12)]),
            ("a's stale expected_length", code.FAILED_PRECONDITION, "expected_length",
             [cut_b, dict(cut_a, expected_length=20)]),
            # A cut past the other cache's length.
            ("b's cut past its length", code.OUT_OF_RANGE, "items[1].truncate_to",
             [cut_a, dict(cut_b, truncate_to=14)]),
            ("a's cut past its length", code.OUT_OF_RANGE, "items[0].truncate_to",
             [dict(cut_a, truncate_to=22), cut_b]),
        )
        for what, status, field, items in cases:
            with self.subTest(what):
                message = self.assertCode(status, self.client.decode, items, causal=True,
                                          return_lse=True)
                self.assertIn(field, message)
                self.assertEqual([self.snapshot(a, qa), self.snapshot(b, qb)], before, what)
                self.assertEqual((a.length, b.length), (21, 13), what)
        # The same batch, well formed, cuts and appends both.
        result = self.client.decode([cut_a, cut_b], causal=True, return_lse=True)
        self.assertEqual([c["length"] for c in result.caches], [17, 11])
        self.assertEqual((a.length, b.length), (17, 11))

    def test_decode_cut_limit(self):
        # fp32, 16 kv heads of 256 + 256: 32 KiB a token, so a Decode item may drop 2048 tokens
        # (64 MiB) and not 2049; TruncateCache has no such limit.
        layout = ("fp32", 16, 256, 256, 16)
        total, most = 2100, (64 << 20) // (16 * 512 * 4)
        key = self.rng.random((16, total, 256), dtype=np.float32)
        cache = self.cache(layout, key, key)
        q = self.query(layout, 1)
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, cache.decode, q,
                                  truncate_to=total - most - 1)
        self.assertIn("items[0].truncate_to", message)
        self.assertIn(str(most), message)
        self.assertEqual(self.client.cache_info(cache.id)["length"], total)
        step = cache.decode(q, truncate_to=total - most)
        self.assertEqual((step.cache["length"], cache.length), (total - most, total - most))
        self.assertEqual(cache.truncate(0)["length"], 0)


# A token tree for the tests below: t0 → {t1, t2}, t1 → {t3, t4}, t2 → {t5}, and t6 a second
# child of the cached prefix (depth first, so t0 → t1 is a prefix of the new tokens).
TREE = (-1, 0, 0, 1, 1, 2, -1)


def branch(parents, i):
    """The new tokens on the path from the cached prefix to new token i, root first."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tree_reference(q, keys, values, parents):
    """float64 attention of q [heads, n, d] over keys [kv_heads, P + n, d] and values
    [kv_heads, P + n, dv] (float64), the last n tokens a token tree: row i sees the P cached
    tokens, its ancestors and itself, nothing else (written here, apart from the server's
    masks) → (out [heads, n, dv], lse [heads, n], score_max)."""
    heads, n, head_dim = q.shape
    kv_heads, total, _ = keys.shape
    first, group = total - n, heads // kv_heads
    out = np.zeros((heads, n, values.shape[2]))
    lse = np.zeros((heads, n))
    score_max = 0.0
    for i in range(n):
        seen = list(range(first)) + [first + j for j in branch(parents, i)]
        for h in range(heads):
            scores = keys[h // group, seen] @ q[h, i] / np.sqrt(head_dim)
            top = scores.max()
            weights = np.exp(scores - top)
            out[h, i] = weights @ values[h // group, seen] / weights.sum()
            lse[h, i] = top + np.log(weights.sum())
            score_max = max(score_max, float(np.abs(scores).max()))
    return out, lse, score_max


class TreeTest(TokenCase):
    """Token trees (DecodeItem.tree_parents) against one attnd without --cache-dir."""

    def assertNear(self, got, want, what):
        """fp32 outputs of two paths to the same attention: within 1e-5 of max |want|."""
        bound = 1e-5 * float(np.max(np.abs(want)))
        miss = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
        self.assertLessEqual(miss, bound, "%s: misses by %.3g (bound %.3g)" % (what, miss, bound))

    def test_each_tree_row_equals_a_causal_decode_over_its_branch(self):
        # (dtype, kv_heads, head_dim, value_dim, query heads), cached prefix: GQA, odd sizes.
        for layout, prefix in ((("fp32", 2, 24, 20, 6), 37), (("bf16", 2, 16, 16, 8), 53)):
            dtype, n = layout[0], len(TREE)
            with self.subTest(dtype=dtype):
                key, value = self.kv(layout, prefix + n)
                cache = self.cache(layout, key[:, :prefix], value[:, :prefix])
                q = self.query(layout, n)
                if dtype == "fp32":  # Cache.decode, the parents a list.
                    step = cache.decode(q, key[:, prefix:], value[:, prefix:],
                                        tree_parents=list(TREE), causal=True, return_lse=True)
                    output, lse = step.output, step.lse
                else:  # A batch: the tree item (parents an int32 array) and a plain causal one.
                    plain_layout = ("fp32", 1, 8, 8, 2)
                    plain_key, plain_value = self.kv(plain_layout, 12)
                    plain = self.cache(plain_layout, plain_key[:, :10], plain_value[:, :10])
                    plain_q = self.query(plain_layout, 3)
                    result = self.client.decode(
                        [{"cache": cache, "query": q, "key": key[:, prefix:],
                          "value": value[:, prefix:], "tree_parents": np.array(TREE, np.int32)},
                         (plain, plain_q, plain_key[:, 10:], plain_value[:, 10:])],
                        causal=True, return_lse=True)
                    output, lse = result.outputs[0], result.lse[0]
                    ref, _, score_max = harness.reference_attention(
                        plain_q[None].astype(np.float64), plain_key[None].astype(np.float64),
                        plain_value[None].astype(np.float64), causal=True)
                    self.assertMatches(result.outputs[1], ref[0], "fp32", score_max,
                                       "the plain item beside the tree")
                    self.assertEqual(plain.length, 12)
                self.assertEqual(output.shape, (layout[4], n, layout[3]))
                self.assertEqual((cache.length, self.client.cache_info(cache.id)["length"]),
                                 (prefix + n, prefix + n))
                # Against float64 over exactly what each row may see.
                ref, ref_lse, score_max = tree_reference(
                    q.astype(np.float64), widened(key, dtype), widened(value, dtype), TREE)
                self.assertMatches(output, ref, "fp32", score_max, "the tree vs float64")
                self.assertEqual(harness.lse_error(lse.astype(np.float64), ref_lse), "")
                # Row i against a plain causal decode over a cache holding the prefix and
                # token i's branch alone (another path through the kernels: near, not equal).
                for i in range(n):
                    path = prefix + np.array(branch(TREE, i))
                    alone = self.cache(layout, joined(key[:, :prefix], key[:, path]),
                                       joined(value[:, :prefix], value[:, path]))
                    want = alone.decode(q[:, i:i + 1], causal=True, return_lse=True)
                    self.assertNear(output[:, i], want.output[:, 0], "row %d vs its branch" % i)
                    self.assertEqual(harness.lse_error(lse[:, i].astype(np.float64),
                                                       want.lse[:, 0].astype(np.float64)), "",
                                     "row %d's lse vs its branch" % i)
                # The tree hides the other branches without the causal mask too.
                again = self.cache(layout, key[:, :prefix], value[:, :prefix])
                open_step = again.decode(q, key[:, prefix:], value[:, prefix:],
                                         tree_parents=TREE, causal=False)
                self.assertMatches(open_step.output, ref, "fp32", score_max,
                                   "the tree without causal vs float64")

    def test_a_tree_step_then_a_cut_keeping_one_branch_equals_that_branch(self):
        for layout, prefix in ((("fp32", 2, 16, 12, 4), 29), (("bf16", 1, 32, 32, 3), 41)):
            dtype, n = layout[0], len(TREE)
            with self.subTest(dtype=dtype):
                key, value = self.kv(layout, prefix)
                cache = self.cache(layout, key, value)
                kept_key, kept_value = key, value  # The tokens a cache without drafts holds.
                # A tree step, then t0 → t1 accepted: a prefix of the tree, cut in place by the
                # next step's truncate_to.
                tree_key, tree_value = self.kv(layout, n)
                cache.decode(self.query(layout, n), tree_key, tree_value, tree_parents=TREE,
                             causal=True)
                q1, (k1, v1) = self.query(layout, 3), self.kv(layout, 2)
                got = cache.decode(q1, k1, v1, truncate_to=prefix + 2, causal=True,
                                   return_lse=True)
                kept_key = joined(kept_key, tree_key[:, :2], k1)
                kept_value = joined(kept_value, tree_value[:, :2], v1)
                direct = self.cache(layout, kept_key[:, :-2], kept_value[:, :-2])
                want = direct.decode(q1, k1, v1, causal=True, return_lse=True)
                self.assertEqual(decode_bits(got), decode_bits(want), "the branch t0 → t1")
                self.assertEqual(cache.length, prefix + 4)
                self.assertSameCache(cache, direct, "after the branch t0 → t1")
                # A cut and a tree in one call: the same bits as the tree over the kept tokens.
                base = cache.length - 1
                q2, (tree_key, tree_value) = self.query(layout, n), self.kv(layout, n)
                got = cache.decode(q2, tree_key, tree_value, truncate_to=base, tree_parents=TREE,
                                   causal=True, return_lse=True)
                kept_key, kept_value = kept_key[:, :base], kept_value[:, :base]
                direct = self.cache(layout, kept_key, kept_value)
                want = direct.decode(q2, tree_key, tree_value, tree_parents=TREE, causal=True,
                                     return_lse=True)
                self.assertEqual(decode_bits(got), decode_bits(want), "a cut and a tree")
                self.assertSameCache(cache, direct, "after a cut and a tree")
                # t0 → t2 → t5 accepted: not a prefix, so cut the whole tree and send the
                # branch's tokens again with the next one.
                path = branch(TREE, 5)
                self.assertEqual(path, [0, 2, 5])
                q3, (k3, v3) = self.query(layout, 1), self.kv(layout, 1)
                got = cache.decode(q3, joined(tree_key[:, path], k3),
                                   joined(tree_value[:, path], v3), truncate_to=base,
                                   causal=True, return_lse=True)
                kept_key = joined(kept_key, tree_key[:, path], k3)
                kept_value = joined(kept_value, tree_value[:, path], v3)
                direct = self.cache(layout, kept_key[:, :-1], kept_value[:, :-1])
                want = direct.decode(q3, k3, v3, causal=True, return_lse=True)
                self.assertEqual(decode_bits(got), decode_bits(want), "the branch t0 → t2 → t5")
                self.assertSameCache(cache, direct, "after the branch t0 → t2 → t5")
                self.assertEqual(cache.length, base + 4)
                ref, _, score_max = harness.reference_attention(
                    q3[None].astype(np.float64), widened(kept_key, dtype)[None],
                    widened(kept_value, dtype)[None], causal=True)
                self.assertMatches(got.output, ref[0], "fp32", score_max, "vs float64")

    def test_tree_errors_name_the_field_and_leave_the_cache(self):
        layout = ("fp32", 1, 8, 8, 2)
        cache = self.cache(layout, *self.kv(layout, 10))
        other = self.cache(layout, *self.kv(layout, 4))
        snapshot_q = self.query(layout, 2)
        before = self.snapshot(cache, snapshot_q)

        def unchanged(what):
            self.assertEqual(self.snapshot(cache, snapshot_q), before, what)
            self.assertEqual(cache.length, 10, what)

        code = grpc.StatusCode
        k7, v7 = self.kv(layout, 7)
        q7 = self.query(layout, 7)
        # The server's checks: a count other than the new tokens', a query row count other
        # than theirs, a tree without new tokens, more than 1024 new tokens.
        k1025, v1025 = self.kv(layout, 1025)
        for what, call, field in (
                ("6 parents for 7 tokens",
                 lambda: cache.decode(q7, k7, v7, tree_parents=TREE[:6]), "items[0].tree_parents"),
                ("8 parents for 7 tokens",
                 lambda: cache.decode(q7, k7, v7, tree_parents=TREE + (6,)),
                 "items[0].tree_parents"),
                ("5 query rows for 7 tokens",
                 lambda: cache.decode(q7[:, :5], k7, v7, tree_parents=TREE), "items[0].query"),
                ("no new tokens",
                 lambda: cache.decode(q7[:, :1], tree_parents=[-1]), "items[0].tree_parents"),
                ("1025 new tokens",
                 lambda: cache.decode(self.query(layout, 1025), k1025, v1025,
                                      tree_parents=[-1] * 1025),
                 "items[0].tree_parents"),
                ("item 1 of a batch",
                 lambda: self.client.decode(
                     [{"cache": other, "query": q7[:, :1]},
                      {"cache": cache, "query": q7, "key": k7, "value": v7,
                       "tree_parents": TREE[:3]}]), "items[1].tree_parents")):
            with self.subTest(what):
                message = self.assertCode(code.INVALID_ARGUMENT, call)
                self.assertIn(field, message)
                unchanged(what)
        self.assertEqual(other.length, 4)
        # Parents that are not earlier, past the client's own check: the server names the entry.
        for parents, field in (((-1, 0, 2, 1, 1, 2, -1), "items[0].tree_parents[2]"),
                               ((-1, 0, 0, 1, 1, 2, 9), "items[0].tree_parents[6]"),
                               ((-1, 0, 0, -2, 1, 2, -1), "items[0].tree_parents[3]"),
                               ((0, 0, 0, 1, 1, 2, -1), "items[0].tree_parents[0]")):
            with self.subTest(parents=parents):
                item = pb.DecodeItem(cache_id=cache.id, expected_length=10,
                                     query=attn_client._encode("query", q7, None),
                                     key=attn_client._encode("key", k7, None),
                                     value=attn_client._encode("value", v7, None),
                                     tree_parents=parents)
                message = self.assertCode(code.INVALID_ARGUMENT, self.client._call, "Decode",
                                          self.client._stub.Decode, pb.DecodeRequest(items=[item]))
                self.assertIn(field, message)
                unchanged(field)
        # The client's own checks, before any RPC.
        for parents, error, name in (
                ([-1, 0, 1.0], TypeError, "tree_parents[2]"),
                ([-1, True], TypeError, "tree_parents[1]"),
                (["-1"], TypeError, "tree_parents[0]"),
                (np.array([-1.0, 0.0]), TypeError, "tree_parents"),
                (np.array([[-1, 0]]), ValueError, "tree_parents"),
                (3, TypeError, "tree_parents"),
                ("-1", TypeError, "tree_parents"),
                ([-2], ValueError, "tree_parents[0] is -2"),
                ([0], ValueError, "tree_parents[0] is 0"),
                ([-1, 0, 2], ValueError, "tree_parents[2] is 2"),
                ([-1, 0, 0, 5], ValueError, "tree_parents[3] is 5"),
                (np.array([-1, 0, 0, 1, 7], np.int64), ValueError, "tree_parents[4] is 7")):
            with self.subTest(parents=repr(parents)):
                with self.assertRaises(error) as raised:
                    cache.decode(q7, k7, v7, tree_parents=parents)
                self.assertIn(name, str(raised.exception))
                with self.assertRaises(error) as raised:
                    self.client.decode([(other, q7[:, :1]),
                                        {"cache": cache, "query": q7, "key": k7, "value": v7,
                                         "tree_parents": parents}])
                self.assertIn("items[1]." + name, str(raised.exception))
        unchanged("client-side errors")
        # numpy integers are ints; None and [] are no tree.
        parents = [np.int64(-1)] + [np.int32(p) for p in TREE[1:]]
        step = cache.decode(q7, k7, v7, tree_parents=parents, causal=True)
        self.assertEqual(cache.length, 17)
        self.assertEqual(step.output.shape, (2, 7, 8))
        for parents in (None, []):
            step = cache.decode(q7[:, :2], *self.kv(layout, 3), tree_parents=parents, causal=True)
            self.assertEqual(step.output.shape, (2, 2, 8))
        self.assertEqual(cache.length, 23)


class LatentTest(TokenCase):
    """Latent caches (CreateCacheRequest.values_from_keys: MLA, as DeepSeek-V3 decodes): keys
    only, each token's value the first value_dim columns of its key."""

    # dtype, kv_heads, head_dim, value_dim (None: head_dim), query heads.
    LAYOUTS = (("fp32", 1, 72, 40, 13), ("bf16", 3, 37, 29, 9), ("fp16", 2, 24, None, 6))

    def latent(self, layout, keys=None):
        """A new latent Cache of `layout` holding `keys` (none when None); deleted after the
        test."""
        dtype, kv_heads, head_dim, value_dim, _ = layout
        cache = self.client.create_cache(kv_heads, head_dim, value_dim, dtype=dtype,
                                         values_from_keys=True)
        self.addCleanup(self.delete_quietly, cache.id)
        if keys is not None:
            cache.append(keys)
        return cache

    def keys(self, layout, n):
        dtype, kv_heads, head_dim, _, _ = layout
        return stored_tokens(self.rng, kv_heads, n, head_dim, dtype)

    def reference(self, layout, q, keys, causal=False):
        """float64 attention of query q (float32) over stored `keys`, each value its key's first
        value_dim columns → (out, lse, score_max)."""
        dtype, _, head_dim, value_dim, _ = layout
        seen = widened(keys, dtype)
        out, lse, score_max = harness.reference_attention(
            q.astype(np.float64)[None], seen[None], seen[None, ..., :value_dim or head_dim],
            causal=causal)
        return out[0], lse[0], score_max

    def test_create_append_decode_against_float64(self):
        page = self.client.info()["cache_page_tokens"]
        for layout in self.LAYOUTS:
            dtype, kv_heads, head_dim, value_dim, heads = layout
            with self.subTest(dtype=dtype, kv_heads=kv_heads, head_dim=head_dim):
                cache = self.latent(layout)
                self.assertTrue(cache.values_from_keys)
                self.assertEqual((cache.kv_heads, cache.head_dim, cache.value_dim, cache.dtype),
                                 (kv_heads, head_dim, value_dim or head_dim, dtype))
                self.assertTrue(self.client.cache_info(cache.id)["values_from_keys"])
                self.assertIn("values_from_keys", repr(cache))
                # Fill past a page boundary in two appends of keys alone.
                keys = [self.keys(layout, page + 5), self.keys(layout, 7)]
                for k in keys:
                    cache.append(k)
                self.assertEqual(cache.length, page + 12)
                # One step through Cache.decode: one new key, one query row.
                keys.append(self.keys(layout, 1))
                q = self.query(layout, 1)
                step = cache.decode(q, keys[-1], return_lse=True, output_dtype="fp32")
                self.assertEqual(step.cache["length"], page + 13)
                self.assertTrue(step.cache["values_from_keys"])
                held = joined(*keys)
                ref, ref_lse, score_max = self.reference(layout, q, held)
                self.assertEqual(step.output.shape, (heads, 1, value_dim or head_dim))
                self.assertMatches(step.output, ref, "fp32", score_max, "Cache.decode")
                self.assertEqual(harness.lse_error(step.lse.astype(np.float64), ref_lse), "")
                # A batch: three causal rows over three new keys, beside an ordinary cache.
                other = self.cache(("fp32", 1, 8, 5, 2), *self.kv(("fp32", 1, 8, 5, 2), 11))
                keys.append(self.keys(layout, 3))
                q3 = self.query(layout, 3)
                batch = self.client.decode(
                    [(cache, q3, keys[-1]), (other, self.query(("fp32", 1, 8, 5, 2), 1))],
                    causal=True, output_dtype=dtype)
                self.assertEqual([c["length"] for c in batch.caches], [page + 16, 11])
                held = joined(*keys)
                ref, _, score_max = self.reference(layout, q3, held, causal=True)
                self.assertMatches(batch.outputs_float32()[0], ref, dtype, score_max,
                                   "batched causal decode")
                # Tiled over the cache reads the same values.
                tiled = self.client.tiled(q3, cache=cache, block_k=17, output_dtype="fp32")
                ref, _, score_max = self.reference(layout, q3, held)
                self.assertMatches(tiled.output, ref, "fp32", score_max, "tiled over the cache")
                # What the server holds: the keys sent, bit for bit, and no values.
                length, got_keys, got_values = exported(self.client, cache)
                self.assertEqual(length, page + 16)
                self.assertTrue(same_bytes(got_keys, held))
                self.assertEqual(got_values.shape[1], 0)

    def test_bytes_are_the_keys_alone(self):
        page = self.client.info()["cache_page_tokens"]
        n = 2 * page + 3  # Three pages.
        for dtype, element in (("fp32", 4), ("bf16", 2)):
            for kv_heads, head_dim, value_dim in ((1, 72, 72), (3, 72, 40)):
                with self.subTest(dtype=dtype, kv_heads=kv_heads, value_dim=value_dim):
                    layout = (dtype, kv_heads, head_dim, value_dim, kv_heads)
                    keys = self.keys(layout, n)
                    latent = self.latent(layout, keys)
                    both = self.cache(layout, keys, keys[..., :value_dim])
                    latent_bytes = self.client.cache_info(latent.id)["bytes"]
                    both_bytes = self.client.cache_info(both.id)["bytes"]
                    self.assertEqual(latent_bytes, 3 * page * kv_heads * head_dim * element)
                    self.assertEqual(both_bytes,
                                     3 * page * kv_heads * (head_dim + value_dim) * element)
                    if value_dim == head_dim:
                        self.assertEqual(2 * latent_bytes, both_bytes)
                    # The same keys and values: the same answers, within the dtype's rule.
                    q = self.query(layout, 2)
                    ref, _, score_max = self.reference(layout, q, keys)
                    for cache in (latent, both):
                        out = cache.decode(q, output_dtype="fp32").output
                        self.assertMatches(out, ref, "fp32", score_max,
                                           "latent" if cache is latent else "both")

    def test_a_value_is_refused_by_the_client_and_by_the_server(self):
        layout = ("fp32", 1, 72, 40, 13)
        keys = self.keys(layout, 9)
        cache = self.latent(layout, keys)
        k = self.keys(layout, 2)
        v = k[..., :40]
        q = self.query(layout, 1)
        # The client refuses before any RPC (a Client that fails every call would say so).
        refusing = RefusingClient(self.server.address, timeout=RPC_TIMEOUT_S)
        self.addCleanup(refusing.close)
        offline = Cache(refusing, cache.info)
        for call, named in ((lambda: offline.append(k, v), "value"),
                            (lambda: offline.decode(q, k, v), "items[0].value"),
                            (lambda: refusing.append(offline, k, v), "value"),
                            (lambda: refusing.decode([(offline, q, k, v)]), "items[0].value"),
                            (lambda: refusing.decode([{"cache": offline, "query": q, "key": k,
                                                       "value": v}]), "items[0].value")):
            with self.subTest(named=named):
                with self.assertRaises(ValueError) as raised:
                    call()
                self.assertRegex(str(raised.exception), r"^%s\b.*latent" % re.escape(named))
        self.assertEqual(refusing.calls, [])
        # An ordinary cache's key needs its value (the client says so too).
        ordinary = Cache(refusing, dict(cache.info, values_from_keys=False))
        for call in (lambda: ordinary.append(k), lambda: ordinary.decode(q, k)):
            self.assertRaisesRegex(ValueError, r"^(items\[0\]\.)?value is missing", call)
        self.assertEqual(refusing.calls, [])
        # The server refuses one sent anyway, naming the field, and keeps the cache as it was.
        before = self.snapshot(cache, q)
        stub = pb_grpc.AttentionServiceStub(self.channel())
        encode = lambda x: attn_client._encode("x", x, pb.DTYPE_FLOAT32)  # noqa: E731
        with self.assertRaises(grpc.RpcError) as raised:
            stub.AppendCache(pb.AppendCacheRequest(cache_id=cache.id, key=encode(k),
                                                   value=encode(v), expected_length=9),
                             timeout=RPC_TIMEOUT_S)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertRegex(raised.exception.details(), r"^value\b.*latent")
        with self.assertRaises(grpc.RpcError) as raised:
            stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(
                cache_id=cache.id, query=encode(q), key=encode(k), value=encode(v),
                expected_length=9)]), timeout=RPC_TIMEOUT_S)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertRegex(raised.exception.details(), r"^items\[0\]\.value\b.*latent")
        # Through the client with an id (it cannot know the cache is latent).
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.decode,
                                  [{"cache": cache.id, "query": q, "key": k, "value": v,
                                    "expected_length": 9}])
        self.assertRegex(message, r"^items\[0\]\.value\b")
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.append,
                                  cache.id, k, v, expected_length=9)
        self.assertRegex(message, r"^value\b")
        self.assertEqual(self.snapshot(cache, q), before)
        # The key alone through an id is what a latent cache takes.
        self.assertEqual(self.client.append(cache.id, k, expected_length=9)["length"], 11)

    def test_value_dim_past_head_dim_is_invalid_argument_naming_it(self):
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.create_cache,
                                  1, 72, 73, values_from_keys=True)
        self.assertRegex(message, r"^value_dim\b.*73.*72")
        stub = pb_grpc.AttentionServiceStub(self.channel())
        with self.assertRaises(grpc.RpcError) as raised:
            stub.CreateCache(pb.CreateCacheRequest(kv_heads=2, head_dim=40, value_dim=41,
                                                   dtype=pb.DTYPE_BFLOAT16,
                                                   values_from_keys=True),
                             timeout=RPC_TIMEOUT_S)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertRegex(raised.exception.details(), r"^value_dim\b")
        # value_dim 0 is head_dim, and value_dim = head_dim is allowed.
        info = stub.CreateCache(pb.CreateCacheRequest(kv_heads=1, head_dim=40,
                                                      dtype=pb.DTYPE_FLOAT32,
                                                      values_from_keys=True),
                                timeout=RPC_TIMEOUT_S)
        self.addCleanup(self.delete_quietly, info.cache_id)
        self.assertEqual((info.value_dim, info.values_from_keys), (40, True))
        self.assertEqual(self.latent(("fp16", 1, 40, 40, 1)).value_dim, 40)
        self.assertRaises(TypeError, self.client.create_cache, 1, 8, values_from_keys=1)

    def test_export_import_round_trip_keeps_it_latent(self):
        # bf16 [1, n, 576] keys (DeepSeek's latent and rope key): more than one 4 MiB chunk.
        layout = ("bf16", 1, 576, 512, 16)
        keys = self.keys(layout, 4001)
        cache = self.latent(layout, keys)
        chunks = self.client.export_cache(cache, verify=True)
        self.assertGreater(len([c for c in chunks if c.HasField("key")]), 1)
        self.assertTrue(chunks[0].info.values_from_keys)
        self.assertFalse(any(c.HasField("value") for c in chunks))
        copies = [self.client.import_cache(chunks, new_id_if_taken=True)]
        path = tempfile.mktemp(prefix="attn-latent-", suffix=".attnexp")
        self.addCleanup(lambda: os.path.exists(path) and os.unlink(path))
        self.assertEqual(self.client.export_cache(cache, path, verify=True)["length"], 4001)
        copies.append(self.client.import_cache(path, new_id_if_taken=True))
        q = self.query(layout, 1)
        want = decode_bits(cache.decode(q, return_lse=True))
        for copy in copies:
            self.addCleanup(self.delete_quietly, copy.id)
            self.assertNotEqual(copy.id, cache.id)
            self.assertTrue(copy.values_from_keys)
            self.assertSameCache(copy, cache, "imported copy")
            self.assertEqual(decode_bits(copy.decode(q, return_lse=True)), want)
            # It goes on as a latent cache: keys alone.
            self.assertEqual(copy.append(self.keys(layout, 3))["length"], 4004)
        # A chunk of a latent export carrying a value is refused, naming it; nothing imported.
        damaged = list(chunks)
        damaged[1] = pb.CacheChunk()
        damaged[1].CopyFrom(chunks[1])
        damaged[1].value.CopyFrom(chunks[1].key)
        before = len(self.client.list_caches())
        message = self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.import_cache,
                                  damaged, new_id_if_taken=True)
        self.assertRegex(message, r"^chunk 1: value\b")
        self.assertEqual(len(self.client.list_caches()), before)

    def channel(self):
        channel = harness.open_channel(self.server.address)
        self.addCleanup(channel.close)
        return channel


# --- Forks: ForkCache ----------------------------------------------------------------------------

def shared_bytes(client, cache):
    """The shared_bytes the server reports for `cache` (a Cache or id) now (GetCacheInfo)."""
    return client.cache_info(attn_client._cache_id(cache))["shared_bytes"]


class ForkTest(TokenCase):
    """ForkCache against one attnd without --cache-dir: a fork equals, bit for bit, a copy built
    by appending the same tokens, and the two caches change independently afterwards."""

    # dtype, kv_heads, head_dim, value_dim, query heads.
    LAYOUTS = (("fp32", 2, 16, 12, 4), ("bf16", 1, 32, 32, 3), ("fp16", 2, 8, 8, 8))

    def bits(self, cache, q, key=None, value=None):
        """A causal Decode over `cache` (with new tokens when key is given) and Tiled over it
        afterwards, as bits."""
        step = cache.decode(q, key, value, causal=True, return_lse=True)
        tiled = self.client.tiled(q, cache=cache, causal=True, block_k=7, return_lse=True)
        return decode_bits(step) + decode_bits(tiled)

    def test_a_fork_equals_a_copy_bit_for_bit_and_changes_alone(self):
        page = self.client.info()["cache_page_tokens"]
        # (tokens in the source, the fork's length; None: all of them): all, inside a page (a
        # second page not shared), at a page boundary, all of a partly filled page, nothing.
        forks = ((page + 7, None), (page + 7, page - 3), (2 * page + 5, page), (37, None),
                 (37, 20), (29, 0))
        for layout in self.LAYOUTS:
            for total, length in forks:
                with self.subTest(dtype=layout[0], total=total, length=length):
                    self.check_fork(layout, total, length, page)

    def check_fork(self, layout, total, length, page):
        kept = total if length is None else length
        key, value = self.kv(layout, total)
        split = total // 3 + 1  # Two appends.
        source = self.cache(layout, key[:, :split], value[:, :split])
        source.append(key[:, split:], value[:, split:])
        q = self.query(layout, 3)
        source_bits = self.bits(source, q)
        page_bytes = source.info["bytes"] // -(-total // page)
        fork = source.fork() if length is None else source.fork(length)
        self.addCleanup(self.delete_quietly, fork.id)
        self.assertIsInstance(fork, Cache)
        self.assertNotEqual(fork.id, source.id)
        self.assertEqual((fork.length, fork.kv_heads, fork.head_dim, fork.value_dim, fork.dtype),
                         (kept,) + layout[1:4] + (layout[0],))
        self.assertEqual(fork.info, self.client.cache_info(fork.id))
        self.assertIsNone(fork.durable_length)
        self.assertEqual(fork.replay_tail, [])
        self.assertEqual(source.length, total)  # The source's Cache is untouched.
        # Every page of a fork is its source's right after forking: shared_bytes is all of its
        # bytes, and the source shares those pages.
        self.assertEqual(fork.info["bytes"], -(-kept // page) * page_bytes)
        self.assertEqual(fork.shared_bytes, fork.info["bytes"])
        self.assertEqual(shared_bytes(self.client, source), fork.info["bytes"])
        if kept > 0:
            self.assertGreater(fork.shared_bytes, 0)
        if length is None:
            self.assertEqual(shared_bytes(self.client, source),
                             self.client.cache_info(source)["bytes"])
        listed = {c["cache_id"]: c for c in self.client.list_caches()}
        self.assertEqual(listed[fork.id]["shared_bytes"], fork.info["bytes"])
        copy = self.cache(layout, key[:, :kept], value[:, :kept])
        self.assertSameCache(fork, copy, "right after the fork")
        if kept > 0:  # (A cache without tokens cannot be attended: FAILED_PRECONDITION.)
            self.assertEqual(self.bits(fork, q), self.bits(copy, q), "a Decode over the fork")
        # The same two tokens appended to the fork and to the copy: the fork writes into a page
        # its source holds only after copying it.
        k1, v1 = self.kv(layout, 2)
        self.assertEqual(self.bits(fork, q, k1, v1), self.bits(copy, q, k1, v1),
                         "a Decode appending to the fork")
        self.assertEqual(fork.length, kept + 2)
        self.assertSameCache(fork, copy, "after the fork's append")
        self.assertEqual(self.bits(source, q), source_bits, "the source after the fork's append")
        self.assertTrue(same_bytes(exported(self.client, source)[1], key), "the source's keys")
        # The pages before the one the append wrote into are still shared (that one was
        # copied when partly filled, or is new).
        self.assertEqual(shared_bytes(self.client, fork), kept // page * page_bytes)
        # Tokens of the source's own: the fork does not see them.
        k2, v2 = self.kv(layout, 3)
        source.append(k2, v2)
        self.assertEqual(self.bits(fork, q), self.bits(copy, q), "after the source's append")
        self.assertSameCache(fork, copy, "after the source's append")
        # Deleting the source keeps what the fork uses; its pages are shared with nobody now.
        source.delete()
        self.assertEqual(shared_bytes(self.client, fork), 0)
        k3, v3 = self.kv(layout, 1)
        self.assertEqual(self.bits(fork, q, k3, v3), self.bits(copy, q, k3, v3),
                         "after the source's delete")
        self.assertSameCache(fork, copy, "after the source's delete")
        fork.delete()
        copy.delete()

    def test_fork_cache_by_id_and_forks_of_forks(self):
        layout = ("fp32", 1, 8, 8, 2)
        key, value = self.kv(layout, 30)
        source = self.cache(layout, key, value)
        q = self.query(layout, 2)
        # By id: no expected_length unless given; numpy integers are ints.
        info = self.client.fork_cache(source.id)
        self.addCleanup(self.delete_quietly, info["cache_id"])
        self.assertEqual((info["length"], info["shared_bytes"]), (30, info["bytes"]))
        self.assertIsNone(info["durable_length"])
        self.assertEqual(info, self.client.cache_info(info["cache_id"]))
        prefix = self.client.fork_cache(source.id, np.int64(12), expected_length=np.int32(30))
        self.addCleanup(self.delete_quietly, prefix["cache_id"])
        self.assertEqual(prefix["length"], 12)
        # A Cache given to fork_cache sends its length as expected_length; the answer is the
        # fork's info, and the source's Cache is unchanged.
        third = self.client.fork_cache(source, 5)
        self.addCleanup(self.delete_quietly, third["cache_id"])
        self.assertEqual((third["length"], source.length), (5, 30))
        # A fork of a fork of a fork, each a prefix of the one before, equals a copy.
        child = Cache(self.client, prefix).fork(9)
        self.addCleanup(self.delete_quietly, child.id)
        grandchild = child.fork()
        self.addCleanup(self.delete_quietly, grandchild.id)
        copy = self.cache(layout, key[:, :9], value[:, :9])
        for fork in (child, grandchild):
            self.assertSameCache(fork, copy, "fork of a fork")
            self.assertEqual(self.bits(fork, q), self.bits(copy, q))
        self.client.delete_cache(prefix["cache_id"])
        self.client.delete_cache(child)
        k1, v1 = self.kv(layout, 4)
        self.assertEqual(self.bits(grandchild, q, k1, v1), self.bits(copy, q, k1, v1))
        # Decoded in one batch with the source and the whole fork (by id).
        batch = self.client.decode(
            [(source, q), {"cache": info["cache_id"], "query": q, "expected_length": 30},
             (grandchild, q)], causal=True, return_lse=True)
        self.assertEqual(batch.outputs[0].tobytes(), batch.outputs[1].tobytes())
        self.assertEqual(batch.lse[0].tobytes(), batch.lse[1].tobytes())
        self.assertEqual([c["length"] for c in batch.caches], [30, 30, 13])

    def test_fork_errors_name_the_field_and_create_nothing(self):
        layout = ("fp32", 1, 8, 8, 2)
        cache = self.cache(layout, *self.kv(layout, 10))
        q = self.query(layout, 2)
        before = self.snapshot(cache, q)
        count = len(self.client.list_caches())

        def unchanged(what):
            self.assertEqual(self.snapshot(cache, q), before, what)
            self.assertEqual(cache.length, 10, what)
            self.assertEqual(len(self.client.list_caches()), count, what + ": a cache was made")

        code = grpc.StatusCode
        # A length past the source's: OUT_OF_RANGE naming it (and the source's length).
        for call in (lambda: cache.fork(11), lambda: self.client.fork_cache(cache.id, 11)):
            message = self.assertCode(code.OUT_OF_RANGE, call)
            self.assertIn("length", message)
            self.assertIn("holds 10", message)
            unchanged("length 11")
        # A stale expected_length: FAILED_PRECONDITION naming it and the actual length; it is
        # checked before the length.
        for call in (lambda: cache.fork(4, expected_length=9),
                     lambda: cache.fork(11, expected_length=9),
                     lambda: self.client.fork_cache(cache.id, expected_length=11),
                     lambda: Cache(self.client, dict(cache.info, length=12)).fork()):
            message = self.assertCode(code.FAILED_PRECONDITION, call)
            self.assertIn("expected_length", message)
            self.assertIn("holds 10", message)
            unchanged("a stale expected_length")
        # Negative values (past the client's own checks): INVALID_ARGUMENT naming the field.
        for request, field in (
                (pb.ForkCacheRequest(cache_id=cache.id, length=-1), "length"),
                (pb.ForkCacheRequest(cache_id=cache.id, length=-1, expected_length=10),
                 "length"),
                (pb.ForkCacheRequest(cache_id=cache.id, expected_length=-10),
                 "expected_length")):
            message = self.assertCode(code.INVALID_ARGUMENT, self.client._call, "ForkCache",
                                      self.client._stub.ForkCache, request)
            self.assertRegex(message, r"^%s\b" % field)
            unchanged("negative %s" % field)
        # Unknown and deleted ids: NOT_FOUND naming cache_id.
        gone = self.cache(layout, *self.kv(layout, 3))
        gone.delete()
        for call in (lambda: self.client.fork_cache("0" * 32), lambda: gone.fork(),
                     lambda: self.client.fork_cache(gone.id, 1)):
            message = self.assertCode(code.NOT_FOUND, call)
            self.assertIn("cache_id", message)
            unchanged("an unknown cache")
        # The client's own checks, before any RPC: TypeError / ValueError naming the argument.
        refusing = RefusingClient(self.server.address)
        self.addCleanup(refusing.close)
        held = Cache(refusing, cache.info)
        for call, error, name in (
                (lambda: held.fork(-1), ValueError, "length"),
                (lambda: held.fork(True), TypeError, "length"),
                (lambda: held.fork(4.0), TypeError, "length"),
                (lambda: held.fork(np.float32(4)), TypeError, "length"),
                (lambda: held.fork(1 << 63), ValueError, "length"),
                (lambda: held.fork(4, expected_length=-1), ValueError, "expected_length"),
                (lambda: held.fork(expected_length=False), TypeError, "expected_length"),
                (lambda: refusing.fork_cache(cache.id, "4"), TypeError, "length"),
                (lambda: refusing.fork_cache(cache.id, -2), ValueError, "length"),
                (lambda: refusing.fork_cache(cache.id, expected_length=2.0), TypeError,
                 "expected_length"),
                (lambda: refusing.fork_cache(cache.id, 3, expected_length=-4), ValueError,
                 "expected_length")):
            with self.assertRaises(error) as raised:
                call()
            self.assertIn(name, str(raised.exception))
        self.assertRaises(TypeError, refusing.fork_cache, 7)
        self.assertRaises(TypeError, refusing.fork_cache, "")
        self.assertEqual(refusing.calls, [])
        unchanged("client-side errors")

    def test_threads_fork_and_append_at_once(self):
        # Four threads share one source. Each round a thread appends 7 tokens to the source
        # (under a lock, so the record of its tokens is exact), then, while the others append to
        # the source and to their forks, forks it at the length it saw, appends 5 tokens of its
        # own to the fork twice, forks that fork and appends 3 tokens to the grandchild. The
        # source starts 20 tokens short of a page, so for a while its last page is partly filled
        # and shared: appends on either side copy it under the others' feet.
        layout = ("fp16", 2, 8, 8, 4)
        _, kv_heads, head_dim, value_dim, _ = layout
        page = self.client.info()["cache_page_tokens"]
        key, value = self.kv(layout, max(page - 20, 1))
        source = self.cache(layout, key, value)
        record = {"key": key, "value": value}
        lock = threading.Lock()
        made, errors = [], []  # made: (fork id, its keys, its values).

        def tokens(rng, n):
            return (stored_tokens(rng, kv_heads, n, head_dim, "fp16"),
                    stored_tokens(rng, kv_heads, n, value_dim, "fp16"))

        def worker(index):
            rng = np.random.default_rng(index)
            try:
                for _ in range(3):
                    k, v = tokens(rng, 7)
                    with lock:
                        source.append(k, v)
                        record["key"] = joined(record["key"], k)
                        record["value"] = joined(record["value"], v)
                        length, seen = source.length, (record["key"], record["value"])
                    fork = Cache(self.client, self.client.fork_cache(source.id, length))
                    fork_key, fork_value = seen
                    for _ in range(2):
                        k, v = tokens(rng, 5)
                        fork.append(k, v)
                        fork_key, fork_value = joined(fork_key, k), joined(fork_value, v)
                    made.append((fork.id, fork_key, fork_value))
                    child = fork.fork()
                    k, v = tokens(rng, 3)
                    child.append(k, v)
                    made.append((child.id, joined(fork_key, k), joined(fork_value, v)))
            except Exception as error:  # noqa: BLE001 (reported by the main thread)
                errors.append("thread %d: %r" % (index, error))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        self.assertFalse(any(thread.is_alive() for thread in threads), "a thread hangs")
        for cache_id, _, _ in made:
            self.addCleanup(self.delete_quietly, cache_id)
        self.assertEqual(errors, [])
        self.assertEqual(len(made), 24)
        length, keys, values = exported(self.client, source)
        self.assertEqual(length, record["key"].shape[1])
        self.assertTrue(same_bytes(keys, record["key"]) and same_bytes(values, record["value"]),
                        "the source")
        for cache_id, want_key, want_value in made:
            length, keys, values = exported(self.client, cache_id)
            self.assertEqual(length, want_key.shape[1], cache_id)
            self.assertTrue(same_bytes(keys, want_key), "fork %s: keys differ" % cache_id)
            self.assertTrue(same_bytes(values, want_value), "fork %s: values differ" % cache_id)
        # And a Decode over the last fork equals one over a copy.
        cache_id, want_key, want_value = made[-1]
        copy = self.cache(layout, want_key, want_value)
        q = self.query(layout, 2)
        fork = self.client.open_cache(cache_id)
        self.assertEqual(self.bits(fork, q), self.bits(copy, q))


class ForkBudgetTest(TokenCase):
    """Forks against an attnd with 1 MiB of cache memory and at most 12 caches: shared pages count
    once against --cache-bytes."""

    BUDGET = 1 << 20
    server_args = ("--cache-bytes", str(BUDGET), "--max-caches", "12")

    def test_eight_forks_fit_where_eight_copies_do_not(self):
        self.assertEqual(self.client.info()["cache_bytes"], self.BUDGET)
        page = self.client.info()["cache_page_tokens"]
        # fp32, one kv head of 32 + 32: 256 bytes a token. The source takes whole pages, some
        # 30% of the budget, so three copies of it cannot fit.
        layout = ("fp32", 1, 32, 32, 2)
        pages = max(1, self.BUDGET * 3 // 10 // (page * 256))
        key, value = self.kv(layout, pages * page)
        source = self.cache(layout, key, value)
        size = source.info["bytes"]
        self.assertGreater(9 * size, self.BUDGET)
        forks = [source.fork() for _ in range(8)]
        for fork in forks:
            self.addCleanup(self.delete_quietly, fork.id)
            self.assertEqual((fork.length, fork.info["bytes"], fork.shared_bytes),
                             (pages * page, size, size))
        self.assertEqual(shared_bytes(self.client, source), size)
        q = self.query(layout, 1)
        want = decode_bits(source.decode(q, return_lse=True))
        for fork in forks:
            self.assertEqual(decode_bits(fork.decode(q, return_lse=True)), want)
        # Two of them append the same token: a new page each, the source's pages still shared.
        k1, v1 = self.kv(layout, 1)
        steps = [fork.decode(q, k1, v1, return_lse=True) for fork in forks[:2]]
        self.assertEqual(decode_bits(steps[0]), decode_bits(steps[1]))
        page_bytes = size // pages
        for fork in forks[:2]:
            info = self.client.cache_info(fork)
            self.assertEqual((info["length"], info["bytes"], info["shared_bytes"]),
                             (pages * page + 1, size + page_bytes, size))
        for fork in forks:
            fork.delete()
        # Copies: RESOURCE_EXHAUSTED naming --cache-bytes (for a copy's tokens, or its first
        # page) before the eighth.
        copies, refused = [], None
        for _ in range(8):
            try:
                copy = self.cache(layout)
                copy.append(key, value)
            except AttnError as error:
                refused = error
                break
            copies.append(copy)
        self.assertIsNotNone(refused, "eight copies fit in the budget")
        self.assertEqual(refused.code, grpc.StatusCode.RESOURCE_EXHAUSTED, refused.message)
        self.assertIn("cache-bytes", refused.message)
        self.assertLess(len(copies), 8)

    def test_max_caches_refuses_a_fork(self):
        layout = ("fp16", 1, 8, 8, 2)
        source = self.cache(layout, *self.kv(layout, 5))
        forks = []
        while len(self.client.list_caches()) < 12:
            forks.append(source.fork())
            self.addCleanup(self.delete_quietly, forks[-1].id)
        message = self.assertCode(grpc.StatusCode.RESOURCE_EXHAUSTED, source.fork)
        self.assertIn("max-caches", message)
        self.assertEqual(len(self.client.list_caches()), 12)
        forks.pop().delete()
        last = source.fork(2)
        self.addCleanup(self.delete_quietly, last.id)
        self.assertEqual(last.length, 2)


class RefusingClient(Client):
    """A Client that records and refuses every RPC (UNAVAILABLE): what the client checks before
    any RPC raises first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _call(self, name, method, request):
        self.calls.append(name)
        raise AttnError(name, grpc.StatusCode.UNAVAILABLE, "refused (a test)")


class PersistenceCase(harness.CodeAssertions, unittest.TestCase):
    """Helpers for tests with attnd --cache-dir (no tests of its own): each test starts its own
    attnd processes on one directory with --cache-sync-seconds 86400, so no write-behind pass
    runs during a test: tokens are durable only where a SIGTERM's flush or a cut (fsynced before
    its answer) made them so, and a SIGKILL loses the rest."""

    def setUp(self):
        self.rng = np.random.default_rng()
        self.directory = tempfile.mkdtemp(prefix="attnd-truncate-")
        self.addCleanup(shutil.rmtree, self.directory, True)
        self.logs = []

    def run(self, result=None):
        before = len(result.failures) + len(result.errors) if result is not None else 0
        result = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > before:
            for log in self.logs:
                sys.stderr.write(log)
        return result

    def start(self, client_class=None):
        """attnd on self.directory → (process, client); both closed after the test. Returns
        once its startup lines (the restore's too) are all printed."""
        server = harness.AttndProcess(ARGS.attnd, ("--threads", "2", "--cache-dir",
                                                   self.directory, "--cache-sync-seconds",
                                                   "86400"))
        self.addCleanup(self.close_server, server)
        client = (client_class or Client)(server.address, timeout=RPC_TIMEOUT_S)
        self.addCleanup(client.close)
        deadline = time.monotonic() + 20
        while not any(line.startswith("  http: ") for line in server.stdout_lines):
            self.assertLess(time.monotonic(), deadline, "".join(server.stdout_lines))
            time.sleep(0.01)
        return server, client

    def close_server(self, server):
        server.stop()
        server._reader.join(5)
        self.logs.append("\n--- attnd %s stdout ---\n%s--- stderr ---\n%s--- end ---\n"
                         % (server.address, "".join(server.stdout_lines), server.stderr()))
        server.close()

    def kill(self, server):
        server.process.kill()
        server.process.wait(20)

    def terminate(self, server, client):
        """SIGTERM (client closed first: shutdown waits for idle connections): exit 0, caches
        flushed."""
        client.close()
        server.process.send_signal(signal.SIGTERM)
        self.assertEqual(server.process.wait(60), 0, server.stderr())
        server._reader.join(5)
        self.assertIn("caches flushed", "".join(server.stdout_lines))

    def kv(self, n, dtype="fp16", kv_heads=2, head_dim=8):
        return (stored_tokens(self.rng, kv_heads, n, head_dim, dtype),
                stored_tokens(self.rng, kv_heads, n, head_dim, dtype))

    def assertHolds(self, client, cache, keys, values, what, prefix=False):
        """The server holds exactly keys/values for `cache` (prefix: a prefix of them, at least
        as long as the cache's durable_length) → its length."""
        length, got_keys, got_values = exported(client, attn_client._cache_id(cache))
        if prefix:
            keys, values = keys[:, :length], values[:, :length]
        self.assertEqual(length, keys.shape[1], what)
        self.assertTrue(same_bytes(got_keys, keys), "%s: keys differ" % what)
        self.assertTrue(same_bytes(got_values, values), "%s: values differ" % what)
        return length


class TruncatePersistenceTest(PersistenceCase):
    """Cuts with attnd --cache-dir (PersistenceCase)."""

    def test_sigkill_after_cuts_then_refresh_never_brings_cut_tokens_back(self):
        server, client = self.start()
        # Caches 2 and 3 get 16 durable tokens (SIGTERM flushes them); cache 4 is cut among
        # tokens not yet durable, then flushed with the tokens after the cut.
        two, three, four = (client.create_cache(2, 8, dtype="fp16") for _ in range(3))
        a2, a3 = self.kv(16), self.kv(16)
        two.append(*a2)
        three.append(*a3)
        x4, y4, z4 = self.kv(10), self.kv(6), self.kv(3)
        four.append(*x4)
        four.append(*y4)
        self.assertEqual(four.truncate(12)["length"], 12)
        four.append(*z4)
        want4 = [joined(x4[i], y4[i][:, :2], z4[i]) for i in (0, 1)]
        self.terminate(server, client)

        server, client = self.start()
        self.assertHolds(client, four.id, *want4, "cache 4 after SIGTERM")
        two, three = client.open_cache(two.id), client.open_cache(three.id)
        self.assertEqual((two.durable_length, three.durable_length), (16, 16))
        # Cache 1: its tokens never durable, cut inside them, then more tokens.
        one = client.create_cache(2, 8, dtype="fp16")
        a1, b1, c1 = self.kv(12), self.kv(9), self.kv(4)
        one.append(*a1)
        one.append(*b1)
        self.assertEqual(one.replay_tail, [(0, 12), (12, 9)])
        info = one.truncate(15)
        self.assertEqual(info["length"], 15)
        self.assertLessEqual(info["durable_length"], 15)
        self.assertEqual(one.replay_tail, [(s, n) for s, n in ((0, 12), (12, 3))
                                           if s + n > info["durable_length"]])
        one.append(*c1)
        want1 = [joined(a1[i], b1[i][:, :3], c1[i]) for i in (0, 1)]
        # Cache 2: durable tokens cut by a Decode's truncate_to, 3 new tokens after the cut.
        n2 = self.kv(3)
        step = two.decode(self.rng.uniform(-1, 1, (4, 1, 8)).astype(np.float32), *n2,
                          truncate_to=8)
        self.assertEqual((step.cache["length"], two.length), (11, 11))
        self.assertGreaterEqual(two.durable_length, 8)  # The cut is on disk.
        self.assertLessEqual(two.durable_length, 11)
        self.assertEqual(two.replay_tail, [(8, 3)] if two.durable_length < 11 else [])
        want2 = [joined(a2[i][:, :8], n2[i]) for i in (0, 1)]
        # Cache 3: durable tokens cut by TruncateCache.
        info = three.truncate(5)
        self.assertEqual((info["length"], info["durable_length"]), (5, 5))
        want3 = [a3[i][:, :5] for i in (0, 1)]
        for cache, want in ((one, want1), (two, want2), (three, want3)):
            self.assertHolds(client, cache, *want, "before the kill")
        self.kill(server)

        server, client = self.start()
        for name, cache, want in (("one", one, want1), ("two", two, want2),
                                  ("three", three, want3)):
            held = self.assertHolds(client, cache.id, *want, "cache %s restored" % name,
                                    prefix=True)
            self.assertGreaterEqual(held, cache.durable_length, name)
            cache.client = client
            info = cache.refresh()
            self.assertEqual((info["length"], cache.length), (want[0].shape[1],) * 2, name)
            self.assertHolds(client, cache, *want, "cache %s refreshed" % name)
        self.assertEqual(three.durable_length, 5)  # Nothing to re-send there.
        # A Decode over the refreshed cache 1 equals one over a cache built directly.
        direct = client.create_cache(2, 8, dtype="fp16")
        direct.append(*want1)
        q = self.rng.uniform(-1, 1, (4, 2, 8)).astype(np.float32)
        self.assertEqual(decode_bits(one.decode(q, causal=True, return_lse=True)),
                         decode_bits(direct.decode(q, causal=True, return_lse=True)))
        # Cache 3 (5 tokens on disk): 4 tokens not yet written, a cut below what its file holds,
        # 2 tokens more, and a SIGTERM's flush: the pending tokens past the cut never reach the
        # file.
        pending, after = self.kv(4), self.kv(2)
        three.append(*pending)
        info = three.truncate(3)
        self.assertEqual((info["length"], info["durable_length"]), (3, 3))
        three.append(*after)
        want3 = [joined(a3[i][:, :3], after[i]) for i in (0, 1)]
        self.terminate(server, client)
        server, client = self.start()
        self.assertHolds(client, three.id, *want3, "cache 3 after the flush")

    def test_a_cut_whose_answer_is_lost_is_never_undone_by_refresh(self):
        server, client = self.start(LosingClient)
        cache = client.create_cache(1, 4, dtype="fp32")
        kv = lambda n: self.kv(n, "fp32", 1, 4)  # noqa: E731
        a, b = kv(10), kv(6)
        cache.append(*a)
        cache.append(*b)
        self.assertEqual(cache.replay_tail, [(0, 10), (10, 6)])
        # TruncateCache applied, its answer lost: the Cache still believes 16, but its tail is
        # cut at 12 and refresh() takes the server's 12 without re-sending anything.
        client.lose("TruncateCache", applied=True)
        self.assertRaises(AttnError, cache.truncate, 12)
        self.assertEqual(cache.length, 16)
        self.assertEqual(cache.replay_tail, [(0, 10), (10, 2)])
        self.assertEqual(cache.refresh()["length"], 12)
        self.assertEqual(client.appends, 2)  # The two above: nothing re-sent.
        self.assertHolds(client, cache, joined(a[0], b[0][:, :2]), joined(a[1], b[1][:, :2]),
                         "after a lost TruncateCache answer")
        # A Decode cutting to 5 and appending 3, applied, its answer lost: the same.
        n = kv(3)
        tail = cache.replay_tail
        client.lose("Decode", applied=True)
        self.assertRaises(AttnError, cache.decode, np.ones((1, 1, 4), np.float32), *n,
                          truncate_to=5)
        self.assertEqual(cache.replay_tail, [(s, min(s + k, 5) - s) for s, k in tail if s < 5])
        self.assertEqual(cache.refresh()["length"], 8)
        self.assertEqual(client.appends, 2)
        want = [joined(a[i][:, :5], n[i]) for i in (0, 1)]
        self.assertHolds(client, cache, *want, "after a lost Decode answer")
        # A cut that never reached the server: refresh() takes its length as it is (nothing
        # lost, nothing re-sent), and the cut can be sent again.
        client.lose("TruncateCache", applied=False)
        self.assertRaises(AttnError, cache.truncate, 3)
        self.assertEqual(cache.refresh()["length"], 8)
        self.assertEqual(client.appends, 2)
        self.assertHolds(client, cache, *want, "after a cut that was not sent")
        # Refused cuts (the server says nothing was applied) keep the Cache as it was.
        tail = cache.replay_tail
        self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, cache.truncate, 2,
                        expected_length=7)
        self.assertCode(grpc.StatusCode.OUT_OF_RANGE, cache.decode,
                        np.ones((1, 1, 4), np.float32), truncate_to=9)
        self.assertEqual((cache.replay_tail, cache.length), (tail, 8))
        self.assertEqual(cache.truncate(3)["length"], 3)
        e = kv(4)
        cache.append(*e)
        self.assertEqual(cache.replay_tail[-1], (3, 4))
        want = [joined(a[i][:, :3], e[i]) for i in (0, 1)]
        # A SIGKILL loses every token not durable (no write-behind pass ran), and refresh()
        # re-sends them from the tail, cut tokens never among them.
        self.kill(server)
        server, client = self.start()
        held = self.assertHolds(client, cache.id, *want, "restored", prefix=True)
        self.assertGreaterEqual(held, cache.durable_length)
        cache.client = client
        self.assertEqual(cache.refresh()["length"], 7)
        self.assertHolds(client, cache, *want, "refreshed after the kill")


class LatentPersistenceTest(PersistenceCase):
    """A latent cache with --cache-dir (PersistenceCase): a restart keeps it latent, and its
    replay tail holds keys alone."""

    def test_restart_keeps_it_latent_and_refresh_resends_keys_alone(self):
        server, client = self.start()
        cache = client.create_cache(1, 72, 40, dtype="fp16", values_from_keys=True)
        keys = lambda n: stored_tokens(self.rng, 1, n, 72, "fp16")  # noqa: E731
        a = keys(20)
        cache.append(a)
        self.terminate(server, client)  # Flushed: 20 tokens durable.

        server, client = self.start()
        reopened = client.open_cache(cache.id)
        self.assertTrue(reopened.values_from_keys)
        self.assertEqual((reopened.length, reopened.durable_length, reopened.value_dim),
                         (20, 20, 40))
        self.assertEqual(reopened.info["bytes"], cache.info["bytes"])
        self.assertHolds(client, cache.id, a, a[:, :0, :40], "after the restart")
        # Tokens the next SIGKILL loses: an append and a decode's new keys, kept as keys alone.
        b, c = keys(9), keys(2)
        reopened.append(b)
        q = self.rng.uniform(-1, 1, (5, 1, 72)).astype(np.float32)
        reopened.decode(q, c)
        self.assertEqual(reopened.replay_tail, [(20, 9), (29, 2)])
        self.assertTrue(all(sent.value is None for sent in reopened._tail))
        self.kill(server)

        server, client = self.start()
        held = self.assertHolds(client, cache.id, joined(a, b, c), a[:, :0, :40], "restored",
                                prefix=True)
        self.assertGreaterEqual(held, 20)
        self.assertLess(held, 31, "no write-behind pass ran: the kill lost the last tokens")
        reopened.client = client
        appends = []
        original = client._call

        def counting(name, method, request):
            if name == "AppendCache":
                appends.append(request)
            return original(name, method, request)

        client._call = counting
        info = reopened.refresh()
        self.assertEqual(info["length"], 31)
        self.assertTrue(info["values_from_keys"])
        self.assertEqual(sum(attn_client._token_count(r.key) for r in appends), 31 - held)
        self.assertTrue(all(not r.HasField("value") for r in appends))
        self.assertHolds(client, cache.id, joined(a, b, c), a[:, :0, :40], "refreshed")
        # It decodes as a latent cache: values from the keys.
        seen = widened(joined(a, b, c), "fp16")
        ref, _, score_max = harness.reference_attention(q.astype(np.float64)[None], seen[None],
                                                        seen[None, ..., :40])
        out = reopened.decode(q, output_dtype="fp32").output
        self.assertEqual(harness.output_error(out.astype(np.float64), ref[0], 1, score_max), "")


class ForkPersistenceTest(PersistenceCase):
    """Forks with attnd --cache-dir (PersistenceCase): a fork's tokens are on disk before the
    answer (durable_length = length, an empty replay tail), a SIGKILL keeps them, and a restart
    shares its pages with its source again."""

    def test_a_fork_is_durable_at_once_and_shares_its_pages_again_after_a_restart(self):
        server, client = self.start()
        source = client.create_cache(2, 8, dtype="fp16")
        a, b = self.kv(12), self.kv(8)
        source.append(*a)
        source.append(*b)
        self.assertEqual(source.replay_tail, [(0, 12), (12, 8)])  # Nothing durable yet.
        whole, prefix = source.fork(), source.fork(15)
        self.assertEqual((whole.length, whole.durable_length, whole.replay_tail), (20, 20, []))
        self.assertEqual((prefix.length, prefix.durable_length, prefix.replay_tail),
                         (15, 15, []))
        self.assertEqual(source.replay_tail, [(0, 12), (12, 8)])  # Its own, as they were.
        c = self.kv(3)
        prefix.append(*c)
        self.assertEqual(prefix.replay_tail, [(15, 3)])
        want_source = [joined(a[i], b[i]) for i in (0, 1)]
        want_prefix = [joined(want_source[i][:, :15], c[i]) for i in (0, 1)]
        self.kill(server)

        server, client = self.start()
        # The forks' files hold every token they had when forked; what came later, and the
        # source's tokens (no write-behind pass ran), the kill may have lost: refresh() re-sends.
        self.assertHolds(client, whole.id, *want_source, "the whole fork restored")
        held = self.assertHolds(client, prefix.id, *want_prefix, "the prefix fork restored",
                                prefix=True)
        self.assertGreaterEqual(held, 15)
        for name, cache, want in (("source", source, want_source),
                                  ("prefix", prefix, want_prefix)):
            cache.client = client
            self.assertEqual(cache.refresh()["length"], want[0].shape[1], name)
            self.assertHolds(client, cache, *want, name + " refreshed")
        self.terminate(server, client)

        server, client = self.start()
        # Restored from the flushed files: the whole fork's bytes agree with its source's, so
        # it shares all its pages with it again; both decode alike.
        self.assertHolds(client, whole.id, *want_source, "the whole fork after the flush")
        self.assertHolds(client, prefix.id, *want_prefix, "the prefix fork after the flush")
        info = client.cache_info(whole.id)
        self.assertEqual(info["shared_bytes"], info["bytes"])
        self.assertGreater(client.cache_info(source.id)["shared_bytes"], 0)
        q = self.rng.uniform(-1, 1, (4, 2, 8)).astype(np.float32)
        steps = [client.decode([{"cache": cache_id, "query": q, "expected_length": 20}],
                               causal=True, return_lse=True)
                 for cache_id in (source.id, whole.id)]
        self.assertEqual(decode_bits(steps[0]), decode_bits(steps[1]))


class LosingClient(Client):
    """A Client whose next call of one RPC fails UNAVAILABLE, after the server applied it (its
    answer lost) or before it was sent; counts the AppendCache calls it makes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lose = None
        self.appends = 0

    def lose(self, rpc, applied):
        self._lose = (rpc, applied)

    def _call(self, name, method, request):
        if name == "AppendCache":
            self.appends += 1
        if self._lose is not None and self._lose[0] == name:
            applied = self._lose[1]
            self._lose = None
            if applied:
                super()._call(name, method, request)
            raise AttnError(name, grpc.StatusCode.UNAVAILABLE, "connection lost (a test)")
        return super()._call(name, method, request)


if __name__ == "__main__":
    unittest.main(argv=ARGS.unittest_argv, exit=True)
