#!/usr/bin/python3
"""Caches that outlive attnd (--cache-dir, --drain-to) through the Python client (issue 29).

Every test starts its own attnd processes (tests/python/attnd_harness.py) with --cache-dir in a
temporary directory, and checks what the server holds by ExportCache, byte for byte against
what the client sent (tokens sent in the cache's dtype are stored bit for bit):

  - restart: a decode session of three caches (fp32 with 1 kv head, bf16 with 2, fp16 GQA with
    8 query heads over 2), SIGTERM (exit 0, "caches flushed"), a restart on the same directory:
    every length the same and the next 8 Decode steps bit-identical to a second attnd that never
    stopped;
  - crash: SIGKILL while 4 threads append to their own caches; after a restart each cache is a
    prefix of what was sent, at least its last durable_length long, and each client's
    Cache.refresh() re-sends the rest from its replay tail (at least one of them must have
    needed it), checked again by export;
  - damage: a flipped payload byte in one cache's second record, a file cut inside its last
    record, an intact one, a damaged header: each kept up to its damage with the startup lines
    naming the bytes dropped, the damaged header NOT_FOUND and its file renamed .kv.damaged;
    appends after a cut file's restore follow on;
  - export / import between two attnd: a two-chunk export (its CRC32C recomputed by
    attn_client.crc32c), the import bit-identical under Tiled, its id kept when free,
    ALREADY_EXISTS when taken, new_id_if_taken, export files, and DATA_LOSS with nothing
    imported for a flipped data byte or a cut file;
  - refresh: a file cut inside a record in the middle of a Cache's one append: refresh()
    re-sends the rest of it, sliced, with the next append's tokens in one AppendCache; and
    DATA_LOSS, the Cache unchanged, when its tail does not reach back to what the server kept;
  - without a server: crc32c's known check values and chaining; moved_to followed once, not
    twice in a row;
  - --drain-to: SIGTERM hands both caches to the peer ("moved 2 caches"), the old server
    answers NOT_FOUND ending moved_to=PEER during its linger, a Cache's next append follows it,
    the peer's Tiled outputs are bit-identical, and a restart of the drained server restores
    nothing;
  - disk full: attnd under a 2 MiB file-size limit (RLIMIT_FSIZE, set on the running process
    with prlimit) refuses appends and creates with RESOURCE_EXHAUSTED naming --cache-dir, stays
    SERVING, the refused append changes nothing; after a restart without the limit the cache is
    a prefix at least its durable_length long and Cache.refresh() makes it whole. One case is an
    expected failure, a server bug: attnd acknowledges appends that the limit never lets it
    write, so the restart alone loses them (see DiskFullTest).

Run by CTest as
  /usr/bin/python3 tests/python/test_persistence.py --attnd <attnd> --stubs <stubs dir>
"""

import os
import re
import resource
import shutil
import signal
import struct
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
from attn_client import AttnError, Client  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402

RPC_TIMEOUT_S = 60.0
WAIT_S = 20.0
NUMPY_DTYPE = {"fp32": "<f4", "fp16": "<f2", "bf16": "<u2"}


# --- Tokens -------------------------------------------------------------------------------------

def tokens(rng, kv_heads, n, dim, dtype, rank2=False):
    """n random tokens [kv_heads, n, dim] in `dtype` as the cache stores them (bf16: uint16
    bits), so what is sent is what the server keeps, bit for bit; rank2: [n, dim] (kv_heads 1)."""
    x = rng.uniform(-1, 1, (kv_heads, n, dim)).astype(np.float32)
    if dtype == "fp16":
        x = x.astype(np.float16)
    elif dtype == "bf16":
        x = attn_client.float32_to_bf16(x)
    return x[0] if rank2 else x


def as3(array):
    return array[None] if array.ndim == 2 else array


def joined(parts, dim, dtype, kv_heads):
    """Token arrays as sent → one [kv_heads, n, dim] array (n 0 for none)."""
    if not parts:
        return np.zeros((kv_heads, 0, dim), dtype=NUMPY_DTYPE[dtype])
    return np.concatenate([as3(p) for p in parts], axis=1)


def exported(client, cache):
    """ExportCache of a cache → (length, key [kv_heads, n, head_dim], value [.., value_dim]) in
    the stored dtype (bf16 as uint16 bits)."""
    chunks = client.export_cache(cache)
    info = chunks[0].info
    dtype = harness.DTYPE_NAMES[info.dtype]
    keys, values = [], []
    for chunk in chunks:
        if chunk.HasField("key"):
            keys.append(np.frombuffer(chunk.key.data, NUMPY_DTYPE[dtype])
                        .reshape(tuple(chunk.key.shape)))
            values.append(np.frombuffer(chunk.value.data, NUMPY_DTYPE[dtype])
                          .reshape(tuple(chunk.value.shape)))
    return (info.length, joined(keys, info.head_dim, dtype, info.kv_heads),
            joined(values, info.value_dim, dtype, info.kv_heads))


def same_bytes(a, b):
    return a.shape == b.shape and a.tobytes() == b.tobytes()


# --- Cache files (server/cache_file.h) ----------------------------------------------------------

RECORD = struct.Struct("<IIqqQII")  # magic, kind, start, n, payload bytes, payload CRC, CRC.


def file_records(path):
    """A cache file → (header bytes, [(offset, start, n, payload bytes)], file size)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"ATTNKV01":
        raise AssertionError("%s does not start with ATTNKV01" % path)
    header = 8 + 4 + struct.unpack_from("<I", data, 8)[0] + 4
    records, offset = [], header
    while offset + RECORD.size <= len(data):
        _, _, start, n, payload, _, _ = RECORD.unpack_from(data, offset)
        records.append((offset, start, n, payload))
        offset += RECORD.size + payload
    return header, records, len(data)


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


# --- The servers --------------------------------------------------------------------------------

class PersistenceCase(harness.CodeAssertions, unittest.TestCase):
    """Starts attnd processes for one test, closes them after it and, when it failed, prints
    their output."""

    def setUp(self):
        self.rng = np.random.default_rng()
        self.temp = tempfile.mkdtemp(prefix="attnd-persist-")
        self.addCleanup(shutil.rmtree, self.temp, True)
        self.logs = []

    def run(self, result=None):
        before = len(result.failures) + len(result.errors) if result is not None else 0
        result = super().run(result)
        if result is not None and len(result.failures) + len(result.errors) > before:
            for log in self.logs:
                sys.stderr.write(log)
        return result

    def cache_dir(self, name):
        return os.path.join(self.temp, name)

    def start(self, cache_dir, *extra, sync_seconds=1):
        """attnd with --cache-dir=cache_dir (None: none) → (process, Client); both closed after
        the test. Returns once the startup lines (the restore's too) are all read."""
        args = ["--threads", "2"]
        if cache_dir is not None:
            args += ["--cache-dir", cache_dir, "--cache-sync-seconds", str(sync_seconds)]
        server = harness.AttndProcess(ARGS.attnd, args + list(extra))
        self.addCleanup(self.close_server, server)
        client = Client(server.address, timeout=RPC_TIMEOUT_S)
        self.addCleanup(client.close)
        self.wait_line(server, r"^  http: ")
        return server, client

    def close_server(self, server):
        server.stop()
        server._reader.join(5)
        self.logs.append("\n--- attnd %s (%s) stdout ---\n%s--- stderr ---\n%s--- end ---\n"
                         % (server.address, " ".join(server.args[1:]),
                            "".join(server.stdout_lines), server.stderr()))
        server.close()

    def wait_line(self, server, pattern, timeout=WAIT_S):
        """The first stdout line of `server` matching `pattern` (a regex) → its match; waits."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            lines = server.stdout_lines
            for line in lines[seen:]:
                match = regex.search(line)
                if match:
                    return match
            seen = len(lines)
            if not server._reader.is_alive() and seen == len(server.stdout_lines):
                self.fail("attnd exited without printing /%s/:\n%s" % (pattern, "".join(lines)))
            if time.monotonic() > deadline:
                self.fail("attnd printed no /%s/ in %.0f s:\n%s" % (pattern, timeout,
                                                                     "".join(lines)))
            time.sleep(0.01)

    def output(self, server):
        return "".join(server.stdout_lines)

    def terminate(self, server):
        """SIGTERM → attnd's exit status, once its output is all read."""
        server.process.send_signal(signal.SIGTERM)
        return self.wait_exit(server)

    def wait_exit(self, server):
        """attnd's exit status (a second signal would exit at once: never sent), once its
        output is all read."""
        status = server.process.wait(WAIT_S + 30)
        server._reader.join(5)
        return status

    def assertFlushedExit(self, server, cache_dir, client=None):
        """SIGTERM: exit 0 with the flush line. `client`, closed first: attnd's shutdown waits
        some 5 s for an idle client connection to go."""
        if client is not None:
            client.close()
        self.assertEqual(self.terminate(server), 0, server.stderr())
        self.assertRegex(self.output(server), r"attnd: caches flushed to --cache-dir=%s \(\d+ "
                         r"bytes\)" % re.escape(cache_dir))

    def wait_durable(self, client, caches, timeout=WAIT_S):
        """Until each cache's durable_length is its length (the write-behind thread's pass)."""
        deadline = time.monotonic() + timeout
        for cache in caches:
            while True:
                info = client.cache_info(cache)
                if info["durable_length"] == info["length"]:
                    break
                self.assertLess(time.monotonic(), deadline, "not durable: %r" % info)
                time.sleep(0.05)

    def assertHolds(self, client, cache, keys, values, length=None, what=""):
        """The server's copy of `cache` is exactly the tokens keys/values (lists as sent; only
        the first `length` of them when given)."""
        n, key, value = exported(client, cache)
        want_key = joined(keys, key.shape[2], self.dtype_of(key), key.shape[0])
        want_value = joined(values, value.shape[2], self.dtype_of(value), value.shape[0])
        if length is not None:
            want_key, want_value = want_key[:, :length], want_value[:, :length]
        self.assertEqual(n, want_key.shape[1], what)
        self.assertTrue(same_bytes(key, want_key), "%s: keys differ" % what)
        self.assertTrue(same_bytes(value, want_value), "%s: values differ" % what)

    @staticmethod
    def dtype_of(array):
        return {np.dtype("<f4"): "fp32", np.dtype("<f2"): "fp16",
                np.dtype("<u2"): "bf16"}[array.dtype]


class Sequence:
    """A Cache and every token sent to it, as sent."""

    def __init__(self, client, dtype, kv_heads, head_dim, value_dim=None, rank2=False):
        self.cache = client.create_cache(kv_heads, head_dim, value_dim, dtype=dtype)
        self.dtype, self.kv_heads, self.head_dim = dtype, kv_heads, head_dim
        self.value_dim = head_dim if value_dim is None else value_dim
        self.rank2 = rank2
        self.keys, self.values = [], []

    def make(self, rng, n):
        key = tokens(rng, self.kv_heads, n, self.head_dim, self.dtype, self.rank2)
        value = tokens(rng, self.kv_heads, n, self.value_dim, self.dtype, self.rank2)
        return key, value

    def append(self, rng, n):
        key, value = self.make(rng, n)
        info = self.cache.append(key, value)
        self.keys.append(key)
        self.values.append(value)
        return info


class Crc32cTest(unittest.TestCase):

    def test_known_values_and_chaining(self):
        crc32c = attn_client.crc32c
        self.assertEqual(crc32c(b"123456789"), 0xE3069283)  # The check value of CRC-32C.
        self.assertEqual(crc32c(b""), 0)
        self.assertEqual(crc32c(bytes(32)), 0x8A9136AA)       # RFC 3720 B.4: 32 zero bytes.
        self.assertEqual(crc32c(b"\xff" * 32), 0x62A8AB43)    # And 32 0xFF bytes.
        data = np.random.default_rng(7).integers(0, 256, 1001, dtype=np.uint8).tobytes()
        for cut in (0, 1, 7, 8, 9, 500, 1001):
            self.assertEqual(crc32c(data[cut:], crc32c(data[:cut])), crc32c(data))
        self.assertEqual(crc32c(bytearray(data)), crc32c(memoryview(data)))
        self.assertNotEqual(crc32c(b"123456789"), __import__("zlib").crc32(b"123456789"))
        with self.assertRaises(ValueError):
            crc32c(b"", -1)


class MovedToTest(unittest.TestCase):
    """moved_to is followed once, not twice in a row (fake Clients: no server)."""

    class Moving:
        def __init__(self, name, moves_to):
            self.target, self.moves_to, self.calls = name, moves_to, 0

        def _moved_client(self, target):
            return MovedToTest.clients[target]

        def append(self, cache, key, value, dtype=None):
            self.calls += 1
            if self.moves_to is None:
                return {"length": 1}
            raise AttnError("AppendCache", grpc.StatusCode.NOT_FOUND,
                            "cache_id: cache %s was handed to another server while this one "
                            "drained; moved_to=%s" % (cache.id, self.moves_to))

    def test_followed_once(self):
        info = {"cache_id": "0" * 32, "length": 0, "durable_length": 0}
        MovedToTest.clients = {name: self.Moving(name, to) for name, to in
                               (("a:1", "b:2"), ("b:2", "c:3"), ("c:3", None))}
        cache = attn_client.Cache(MovedToTest.clients["b:2"], info)
        self.assertEqual(cache.append(None, None), {"length": 1})  # b → c, once.
        self.assertEqual(cache.client.target, "c:3")
        cache = attn_client.Cache(MovedToTest.clients["a:1"], info)
        with self.assertRaises(AttnError) as raised:               # a → b → (c): not followed.
            cache.append(None, None)
        self.assertIn("moved_to=c:3", raised.exception.message)
        self.assertEqual(cache.client.target, "b:2")
        self.assertIsNone(attn_client._moved_to(
            AttnError("x", grpc.StatusCode.UNAVAILABLE, "moved_to=b:2")))


# --- a. Restart ---------------------------------------------------------------------------------

class RestartTest(PersistenceCase):

    LAYOUTS = (("fp32", 1, 1, 16), ("bf16", 2, 2, 32), ("fp16", 2, 8, 32))  # dtype, kv, heads, d

    def step_inputs(self, rng):
        items = []
        for dtype, kv_heads, heads, dim in self.LAYOUTS:
            query = rng.uniform(-1, 1, (heads, 1, dim)).astype(np.float32)
            if dtype == "fp16":
                query = query.astype(np.float16)
            items.append((query, tokens(rng, kv_heads, 1, dim, dtype),
                          tokens(rng, kv_heads, 1, dim, dtype)))
        return items

    @staticmethod
    def decode(client, caches, inputs):
        result = client.decode([(cache, q, k, v) for cache, (q, k, v) in zip(caches, inputs)],
                               causal=True, return_lse=True)
        return ([o.tobytes() for o in result.outputs] + [lse.tobytes() for lse in result.lse],
                result.caches)

    def test_sigterm_restart_continues_bit_identically(self):
        directory = self.cache_dir("x")
        server, client = self.start(directory)
        _, reference = self.start(None)
        rng = np.random.default_rng(29)
        ours = [client.create_cache(kv, d, dtype=dtype) for dtype, kv, _, d in self.LAYOUTS]
        theirs = [reference.create_cache(kv, d, dtype=dtype) for dtype, kv, _, d in self.LAYOUTS]
        for index, (dtype, kv_heads, _, dim) in enumerate(self.LAYOUTS):
            n = 19 + 4 * index
            key, value = tokens(rng, kv_heads, n, dim, dtype), tokens(rng, kv_heads, n, dim, dtype)
            ours[index].append(key, value)
            theirs[index].append(key, value)
        for step in range(5):
            inputs = self.step_inputs(rng)
            self.assertEqual(self.decode(client, ours, inputs)[0],
                             self.decode(reference, theirs, inputs)[0], "step %d" % step)
        lengths = [cache.length for cache in theirs]
        self.assertEqual([cache.length for cache in ours], lengths)

        self.assertFlushedExit(server, directory, client)
        server, client = self.start(directory)
        self.assertRegex(self.output(server), r"restored 3 caches \(%d tokens, \d+ bytes\) from "
                         r"--cache-dir=%s in [0-9.]+ s\n" % (sum(lengths), re.escape(directory)))
        restored = [client.open_cache(cache.id) for cache in ours]
        for cache, before, (dtype, kv_heads, _, dim) in zip(restored, ours, self.LAYOUTS):
            self.assertEqual((cache.length, cache.durable_length, cache.kv_heads, cache.head_dim,
                              cache.dtype), (before.length, before.length, kv_heads, dim, dtype))
        for step in range(8):
            inputs = self.step_inputs(rng)
            got, infos = self.decode(client, restored, inputs)
            want, _ = self.decode(reference, theirs, inputs)
            self.assertEqual(got, want, "step %d after the restart" % step)
            self.assertEqual([info["length"] for info in infos],
                             [n + step + 1 for n in lengths])


# --- b. Crash -----------------------------------------------------------------------------------

class Writer:
    """One thread's cache, appending a few tokens at a time until the server goes."""

    def __init__(self, client, seed, dtype, kv_heads, head_dim, value_dim, rank2):
        self.client = client
        self.sequence = Sequence(client, dtype, kv_heads, head_dim, value_dim, rank2)
        self.rng = np.random.default_rng(seed)
        self.acknowledged = 0  # Tokens the server said it holds.
        self.durable = 0       # The largest durable_length it reported.
        self.error = None

    def run(self, stop):
        seq = self.sequence
        while not stop.is_set():
            key, value = seq.make(self.rng, int(self.rng.integers(1, 4)))
            seq.keys.append(key)  # Sent, whether or not the answer comes back.
            seq.values.append(value)
            try:
                info = seq.cache.append(key, value)
            except AttnError as error:
                self.error = error
                return
            self.acknowledged = info["length"]
            self.durable = max(self.durable, info["durable_length"])


class CrashTest(PersistenceCase):

    LAYOUTS = (("fp32", 1, 8, 8, True), ("bf16", 2, 16, 16, False), ("fp16", 2, 8, 12, False),
               ("fp32", 4, 4, 6, False))

    def test_sigkill_mid_append_then_refresh_recovers(self):
        directory = self.cache_dir("x")
        server, _ = self.start(directory)
        writers = []
        for seed, layout in enumerate(self.LAYOUTS):
            client = Client(server.address, timeout=RPC_TIMEOUT_S)
            self.addCleanup(client.close)
            writers.append(Writer(client, seed, *layout))
        stop = threading.Event()
        threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in writers]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        server.process.kill()
        server.process.wait(WAIT_S)
        stop.set()
        for thread in threads:
            thread.join(RPC_TIMEOUT_S)
            self.assertFalse(thread.is_alive())

        server, client = self.start(directory)
        self.assertRegex(self.output(server), r"restored 4 caches ")
        recovered = 0
        for index, writer in enumerate(writers):
            seq = writer.sequence
            what = "writer %d (%s)" % (index, seq.dtype)
            sent = sum(as3(k).shape[1] for k in seq.keys)
            self.assertGreater(writer.acknowledged, 0, what)
            held = client.cache_info(seq.cache.id)["length"]
            # At most what was sent (the last append may have landed unanswered), at least what
            # the server said was on disk, and exactly those tokens.
            self.assertLessEqual(held, sent, what)
            self.assertGreaterEqual(held, writer.durable, what)
            self.assertHolds(client, seq.cache.id, seq.keys, seq.values, held, what)
            if held < writer.acknowledged:
                recovered += 1
                tail = seq.cache.replay_tail
                self.assertTrue(tail and tail[0][0] <= held, "%s: tail %r" % (what, tail[:3]))
            # The Cache goes on against the restarted server: refresh re-sends what it lost.
            seq.cache.client = client
            info = seq.cache.refresh()
            full = max(held, writer.acknowledged)
            self.assertEqual((info["length"], seq.cache.length), (full, full), what)
            self.assertHolds(client, seq.cache, seq.keys, seq.values, full, what)
            del seq.keys[len(seq.keys) - (sent > full):]  # The unanswered one, if it was lost.
            del seq.values[len(seq.values) - (sent > full):]
            self.assertEqual(seq.append(self.rng, 2)["length"], full + 2, what)
            self.assertHolds(client, seq.cache, seq.keys, seq.values, None, what)
        # The kill came ~0.5 s at most after a write-behind pass, in the middle of the appends:
        # some cache must have lost acknowledged tokens, or refresh was not tested.
        self.assertGreater(recovered, 0, "no cache lost a token to the kill")


# --- c. Damaged files ---------------------------------------------------------------------------

class DamageTest(PersistenceCase):

    def test_damaged_records_and_header(self):
        directory = self.cache_dir("x")
        server, client = self.start(directory)
        a = Sequence(client, "fp32", 2, 8)
        b = Sequence(client, "bf16", 1, 16, rank2=True)
        c = Sequence(client, "fp16", 2, 8, 12)
        d = Sequence(client, "fp32", 1, 4)
        for round_tokens in ((5, 4), (7, 6), (9, 8)):  # One record per round and cache.
            a.append(self.rng, round_tokens[0])
            b.append(self.rng, round_tokens[1])
            self.wait_durable(client, [a.cache, b.cache])
        c.append(self.rng, 10)
        d.append(self.rng, 3)
        self.assertFlushedExit(server, directory, client)

        path = {s: os.path.join(directory, s.cache.id + ".kv") for s in (a, b, c, d)}
        _, records_a, size_a = file_records(path[a])
        _, records_b, size_b = file_records(path[b])
        self.assertEqual([(r[1], r[2]) for r in records_a], [(0, 5), (5, 7), (12, 9)])
        self.assertEqual([(r[1], r[2]) for r in records_b], [(0, 4), (4, 6), (10, 8)])
        offset, _, _, payload = records_a[1]
        self.assertEqual(size_a, records_a[2][0] + RECORD.size + records_a[2][3])
        flip_byte(path[a], offset + RECORD.size + payload // 2)  # Inside the record's payload.
        dropped_a = size_a - offset
        last = records_b[2]
        cut = last[0] + RECORD.size + last[3] // 2
        os.truncate(path[b], cut)
        dropped_b = cut - last[0]
        flip_byte(path[d], 8 + 4 + 4)  # The header's kv_heads: its CRC32C fails.

        server, client = self.start(directory)
        text = self.output(server)
        self.assertRegex(text, r"restored 3 caches \(%d tokens, \d+ bytes\) from --cache-dir=%s "
                         r"in [0-9.]+ s; 1 files refused" % (5 + 10 + 10, re.escape(directory)))
        self.assertIn("cache %s: kept its first 5 tokens; dropped the last %d bytes of its file ("
                      % (a.cache.id, dropped_a), text)
        self.assertIn("cache %s: kept its first 10 tokens; dropped the last %d bytes of its file ("
                      % (b.cache.id, dropped_b), text)
        self.assertIn("cache file %s refused and renamed %s.damaged: " % (path[d], path[d]), text)
        self.assertNotIn("cache %s:" % c.cache.id, text)
        self.assertEqual(sorted(info["cache_id"] for info in client.list_caches()),
                         sorted(s.cache.id for s in (a, b, c)))
        self.assertHolds(client, a.cache.id, a.keys, a.values, 5, "a")
        self.assertHolds(client, b.cache.id, b.keys, b.values, 10, "b")
        self.assertHolds(client, c.cache.id, c.keys, c.values, None, "c")
        self.assertCode(grpc.StatusCode.NOT_FOUND, client.cache_info, d.cache.id)
        self.assertTrue(os.path.exists(path[d] + ".damaged"))
        self.assertFalse(os.path.exists(path[d]))
        self.assertEqual(os.path.getsize(path[a]), size_a - dropped_a)  # Cut back.

        # The cut files go on: new records follow the kept ones and survive another restart.
        del a.keys[1:], a.values[1:]
        a.cache = client.open_cache(a.cache.id)
        a.append(self.rng, 3)
        self.assertFlushedExit(server, directory, client)
        server, client = self.start(directory)
        self.assertNotIn("dropped", self.output(server))
        self.assertHolds(client, a.cache.id, a.keys, a.values, None, "a after more appends")
        self.assertEqual(client.cache_info(a.cache.id)["length"], 8)


# --- d. Export and import -----------------------------------------------------------------------

class TransferTest(PersistenceCase):

    def tiled(self, client, cache, query):
        result = client.tiled(query, cache=cache, causal=True, return_lse=True)
        return result.output.tobytes(), result.lse.tobytes()

    def test_export_import_between_servers(self):
        source_server, source = self.start(self.cache_dir("p"))
        _, target = self.start(self.cache_dir("q"))
        big = Sequence(source, "fp32", 2, 128)  # 2 KiB a token: two chunks of ≤ 4 MiB − 16 KiB.
        big.append(self.rng, 1500)
        big.append(self.rng, 700)
        small = Sequence(source, "bf16", 2, 16, 24)
        small.append(self.rng, 33)
        empty = source.create_cache(1, 8, dtype="fp16")
        query = self.rng.uniform(-1, 1, (4, 3, 128)).astype(np.float32)
        small_query = self.rng.uniform(-1, 1, (4, 2, 16)).astype(np.float32)

        chunks = source.export_cache(big.cache, verify=True)
        self.assertGreaterEqual(len(chunks), 2)
        self.assertTrue(chunks[0].HasField("info"))
        self.assertEqual(chunks[0].info.length, 2200)
        self.assertTrue(all(not chunk.HasField("crc32c") for chunk in chunks[:-1]))
        self.assertTrue(chunks[-1].HasField("crc32c"))
        self.assertTrue(all(len(c.key.data) + len(c.value.data) <= (4 << 20) - (16 << 10)
                            for c in chunks))
        crc = 0
        for chunk in chunks:
            crc = attn_client.crc32c(chunk.value.data, attn_client.crc32c(chunk.key.data, crc))
        self.assertEqual(crc, chunks[-1].crc32c)
        self.assertHolds(source, big.cache, big.keys, big.values, None, "big on the source")

        copy = target.import_cache(chunks)
        self.assertEqual((copy.id, copy.length, copy.info["crc32c"]),
                         (big.cache.id, 2200, chunks[-1].crc32c))
        self.assertEqual(self.tiled(target, copy, query), self.tiled(source, big.cache, query))
        self.assertHolds(target, copy, big.keys, big.values, None, "big on the target")
        message = self.assertCode(grpc.StatusCode.ALREADY_EXISTS, target.import_cache, chunks)
        self.assertIn(big.cache.id, message)
        other = target.import_cache(chunks, new_id_if_taken=True)
        self.assertNotEqual(other.id, big.cache.id)
        self.assertRegex(other.id, r"^[0-9a-f]{32}$")
        self.assertEqual(self.tiled(target, other, query), self.tiled(source, big.cache, query))

        # Files: `attn cache export`'s format, both ways.
        path = os.path.join(self.temp, "small.attnexp")
        info = source.export_cache(small.cache, path, verify=True)
        self.assertEqual((info["cache_id"], info["length"], info["dtype"]),
                         (small.cache.id, 33, "bf16"))
        with open(path, "rb") as f:
            data = f.read()
        self.assertEqual(data[:8], attn_client.EXPORT_FILE_MAGIC)
        offset, parsed = 8, []
        while offset < len(data):
            length = struct.unpack_from("<I", data, offset)[0]
            parsed.append(pb.CacheChunk.FromString(data[offset + 4:offset + 4 + length]))
            offset += 4 + length
        self.assertEqual(offset, len(data))
        self.assertEqual(parsed, source.export_cache(small.cache))
        self.assertEqual(parsed[-1].crc32c, info["crc32c"])
        small_copy = target.import_cache(path)
        self.assertEqual(small_copy.id, small.cache.id)
        self.assertEqual(self.tiled(target, small_copy, small_query),
                         self.tiled(source, small.cache, small_query))

        empty_chunks = source.export_cache(empty, verify=True)
        self.assertEqual(len(empty_chunks), 1)
        self.assertEqual((empty_chunks[0].info.length, empty_chunks[0].crc32c), (0, 0))
        self.assertEqual(target.import_cache(empty_chunks).length, 0)

        # Damage on the way: nothing imported.
        before = sorted(info["cache_id"] for info in target.list_caches())
        damaged = [pb.CacheChunk() for _ in chunks]
        for copy_chunk, chunk in zip(damaged, chunks):
            copy_chunk.CopyFrom(chunk)
        data = bytearray(damaged[1].key.data)
        data[len(data) // 2 & ~3] ^= 0x01  # A float's lowest mantissa bit: still finite.
        damaged[1].key.data = bytes(data)
        message = self.assertCode(grpc.StatusCode.DATA_LOSS, target.import_cache, damaged,
                                  new_id_if_taken=True)
        self.assertIn("CRC32C", message)
        self.assertCode(grpc.StatusCode.DATA_LOSS, target.import_cache, chunks[:-1],
                        new_id_if_taken=True)
        cut = os.path.join(self.temp, "cut.attnexp")
        source.export_cache(big.cache, cut)
        os.truncate(cut, os.path.getsize(cut) - 7)  # Inside the last chunk.
        message = self.assertCode(grpc.StatusCode.DATA_LOSS, target.import_cache, cut,
                                  new_id_if_taken=True)
        self.assertIn(cut, message)
        self.assertEqual(sorted(info["cache_id"] for info in target.list_caches()), before)
        with open(cut, "r+b") as f:
            f.write(b"ATTNEXP0")
        with self.assertRaises(ValueError):
            target.import_cache(cut)
        # The source is unchanged by its exports.
        self.assertEqual(source.cache_info(big.cache)["length"], 2200)
        self.assertTrue(source_server.alive())


class RefreshTest(PersistenceCase):
    """Cache.refresh() after a restart that lost tokens, beyond what a crash gives (there the
    server's length is always where an append ended): a cut file."""

    def test_refresh_slices_the_entry_straddling_the_servers_length(self):
        directory = self.cache_dir("x")
        server, client = self.start(directory)
        seq = Sequence(client, "fp16", 2, 256)  # 2 KiB a token: 2048 tokens a file record.
        seq.append(self.rng, 2500)               # One tail entry, two records.
        seq.append(self.rng, 3)
        self.assertEqual(seq.cache.replay_tail, [(0, 2500), (2500, 3)])
        self.assertFlushedExit(server, directory, client)
        path = os.path.join(directory, seq.cache.id + ".kv")
        _, records, _ = file_records(path)
        # [0, 2048), then the rest in one record or two (as the write-behind passes fell).
        self.assertEqual([(r[1], r[2]) for r in records[:2]], [(0, 2048), (2048, records[1][2])])
        os.truncate(path, records[1][0] + RECORD.size + records[1][3] // 3)
        server, client = self.start(directory)
        self.assertIn("cache %s: kept its first 2048 tokens" % seq.cache.id, self.output(server))
        seq.cache.client = client
        info = seq.cache.refresh()
        self.assertEqual((info["length"], seq.cache.length), (2503, 2503))
        self.assertHolds(client, seq.cache, seq.keys, seq.values, None, "refreshed")
        # Tokens [2048, 2503) went in one append (a slice of the first entry and the second).
        appends = re.findall(r"method=/attention.v1.AttentionService/AppendCache code=OK",
                             server.stderr())
        self.assertEqual(len(appends), 1, server.stderr())
        self.assertEqual(seq.append(self.rng, 1)["length"], 2504)

    def test_refresh_data_loss_when_the_tail_cannot_cover(self):
        directory = self.cache_dir("x")
        server, client = self.start(directory)
        seq = Sequence(client, "fp32", 1, 8)
        seq.append(self.rng, 6)
        self.wait_durable(client, [seq.cache])
        seq.cache.refresh()  # Sees durable_length 6: the tail drops those tokens.
        self.assertEqual(seq.cache.replay_tail, [])
        seq.append(self.rng, 4)
        self.assertEqual(seq.cache.replay_tail, [(6, 4)])
        self.assertFlushedExit(server, directory, client)
        # What the cache's file lost (its last record cut off) is older than the tail.
        path = os.path.join(directory, seq.cache.id + ".kv")
        _, records, _ = file_records(path)
        os.truncate(path, records[0][0] + RECORD.size + 5)
        server, client = self.start(directory)
        seq.cache.client = client
        before = dict(seq.cache.info)
        message = self.assertCode(grpc.StatusCode.DATA_LOSS, seq.cache.refresh)
        self.assertIn("holds 0 tokens", message)
        self.assertIn("from 6 on", message)
        self.assertEqual(seq.cache.info, before)
        self.assertEqual(seq.cache.replay_tail, [(6, 4)])



# --- e. --drain-to ------------------------------------------------------------------------------

class DrainTest(PersistenceCase):

    def test_drain_moves_caches_and_clients_follow(self):
        peer, peer_client = self.start(self.cache_dir("b"))
        directory = self.cache_dir("a")
        server, client = self.start(directory, "--drain-to", peer.address)
        self.assertIn("  drain-to: %s\n" % peer.address, self.output(server))
        first = Sequence(client, "fp32", 2, 16)
        first.append(self.rng, 40)
        second = Sequence(client, "bf16", 1, 8, rank2=True)
        second.append(self.rng, 17)
        query = self.rng.uniform(-1, 1, (4, 2, 16)).astype(np.float32)
        second_query = self.rng.uniform(-1, 1, (2, 3, 8)).astype(np.float32)
        want_first = client.tiled(query, cache=first.cache, return_lse=True)
        want_second = client.tiled(second_query, cache=second.cache, causal=True)

        key, value = first.make(self.rng, 1)
        server.process.send_signal(signal.SIGTERM)
        self.wait_line(server, r"attnd: moved 2 caches \(57 tokens\) to %s in [0-9.]+ s; 0 kept "
                       r"here" % re.escape(peer.address))
        # The drained server lingers 2 s after that line (within --shutdown-grace), answering
        # NOT_FOUND ending moved_to=PEER: a raw call first (it does not follow), the peer's
        # Tiled outputs, then the Cache's append, which follows moved_to to the peer. All come
        # within milliseconds of the line; were the server gone already, they would fail
        # UNAVAILABLE, and the test with them.
        message = self.assertCode(grpc.StatusCode.NOT_FOUND, client.cache_info, second.cache.id)
        self.assertTrue(message.endswith("moved_to=" + peer.address), message)
        got_first = peer_client.tiled(query, cache=first.cache.id, return_lse=True)
        got_second = peer_client.tiled(second_query, cache=second.cache.id, causal=True)
        info = first.cache.append(key, value)
        first.keys.append(key)
        first.values.append(value)
        self.assertEqual(info["length"], 41)
        self.assertEqual(first.cache.client.target, peer.address)
        self.assertIsNot(first.cache.client, client)

        self.assertEqual(sorted(i["cache_id"] for i in peer_client.list_caches()),
                         sorted([first.cache.id, second.cache.id]))
        self.assertEqual(got_first.output.tobytes(), want_first.output.tobytes())
        self.assertEqual(got_first.lse.tobytes(), want_first.lse.tobytes())
        self.assertEqual(got_second.output.tobytes(), want_second.output.tobytes())
        self.assertHolds(peer_client, first.cache.id, first.keys, first.values, None, "first")
        self.assertHolds(peer_client, second.cache.id, second.keys, second.values, None,
                         "second")
        # The moved Cache goes on on the peer; its Client was made with the same settings.
        self.assertEqual(first.cache.client.timeout, RPC_TIMEOUT_S)
        self.assertEqual(first.cache.refresh()["length"], 41)
        step = first.cache.decode(query[:, :1], *first.make(self.rng, 1))
        self.assertEqual(step.cache["length"], 42)
        client.close()  # And the peer's Client made for the moved Cache with it.
        self.assertEqual(self.wait_exit(server), 0, server.stderr())
        self.assertIn("attnd: caches flushed to --cache-dir=%s" % directory, self.output(server))

        # The drained server's directory no longer holds them: a restart restores none.
        server, client = self.start(directory)
        self.assertIn("restored 0 caches", self.output(server))
        self.assertEqual(client.list_caches(), [])


# --- f. Full disk -------------------------------------------------------------------------------

FILE_LIMIT = 2 << 20


class DiskFullTest(PersistenceCase):
    """attnd with a 2 MiB file-size limit (RLIMIT_FSIZE set with prlimit once it listens; the
    harness starts attnd itself, and the limit then applies to its cache files only): appends of
    64 KiB until one is refused. CacheFile::Reserve checks the bytes an append will need against
    RLIMIT_FSIZE when the append is accepted (preallocation with FALLOC_FL_KEEP_SIZE alone would
    not meet the limit), so the refusal comes before any acknowledged token can miss the disk:
    a restart alone keeps every acknowledged append."""

    def fill(self, directory):
        server, client = self.start(directory)
        resource.prlimit(server.pid, resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
        seq = Sequence(client, "fp32", 2, 64)  # 1 KiB a token.
        deadline = time.monotonic() + WAIT_S
        while True:
            key, value = seq.make(self.rng, 64)
            length = seq.cache.length
            try:
                seq.cache.append(key, value)
            except AttnError as error:
                refused = error
                break
            seq.keys.append(key)
            seq.values.append(value)
            self.assertLess(time.monotonic(), deadline, "no append refused")
            time.sleep(0.02)
        self.assertEqual(refused.code, grpc.StatusCode.RESOURCE_EXHAUSTED, refused.message)
        self.assertIn("--cache-dir=%s" % directory, refused.message)
        self.assertEqual(seq.cache.length, length)
        return server, client, seq

    def test_refused_append_changes_nothing_and_refresh_restores(self):
        directory = self.cache_dir("x")
        server, client, seq = self.fill(directory)
        acknowledged = seq.cache.length
        self.assertGreater(acknowledged, 0)
        self.assertTrue(server.alive())
        self.assertEqual(client.health(), "SERVING")
        self.assertEqual(client.cache_info(seq.cache.id)["length"], acknowledged)
        # The limit is per file: a new cache (a small file) is still made, and holds its tokens.
        other = client.create_cache(1, 8)
        other.append(np.ones((1, 4, 8), np.float32), np.ones((1, 4, 8), np.float32))
        self.assertEqual(other.length, 4)
        query = self.rng.uniform(-1, 1, (2, 1, 64)).astype(np.float32)
        self.assertEqual(client.tiled(query, cache=seq.cache).output.shape, (2, 1, 64))
        durable = seq.cache.durable_length
        client.close()
        self.terminate(server)

        server, client = self.start(directory)
        held = client.cache_info(seq.cache.id)["length"]
        self.assertGreaterEqual(held, durable)
        self.assertLessEqual(held, acknowledged)
        self.assertHolds(client, seq.cache.id, seq.keys, seq.values, held, "restored")
        seq.cache.client = client
        self.assertEqual(seq.cache.refresh()["length"], acknowledged)
        self.assertHolds(client, seq.cache, seq.keys, seq.values, None, "refreshed")
        seq.append(self.rng, 64)  # No limit now.
        self.assertHolds(client, seq.cache, seq.keys, seq.values, None, "appended")

    def test_restart_alone_keeps_every_acknowledged_append(self):
        directory = self.cache_dir("x")
        server, client, seq = self.fill(directory)
        acknowledged = seq.cache.length
        client.close()
        self.terminate(server)
        _, client = self.start(directory)
        self.assertEqual(client.cache_info(seq.cache.id)["length"], acknowledged)
        self.assertHolds(client, seq.cache.id, seq.keys, seq.values, None, "restored")


if __name__ == "__main__":
    unittest.main(argv=ARGS.unittest_argv, verbosity=2)
