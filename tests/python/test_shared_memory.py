#!/usr/bin/python3
"""Shared-memory tensors (attnd --allow-shared-memory) through the Python client
(client/python/attn_client.py: register_shared_memory, SharedRegion, SharedTensor, output_to).

Starts attnd (tests/python/attnd_harness.py) and puts inputs and outputs in
multiprocessing.shared_memory.SharedMemory files in /dev/shm:

  - without --allow-shared-memory: ServerInfo.shared_memory false, and RegisterSharedMemory,
    SharedMemoryStatus, UnregisterSharedMemory and a Tiled naming a region FAILED_PRECONDITION
    naming the flag;
  - with it: a SharedMemory registered whole and in part (an offset), SharedMemoryStatus listing
    both; naive and tiled with q, k, v as SharedTensors (fp32 with GQA, causal and lse; bf16
    bits; a region registered at an offset) equal, bit for bit, the same calls with the arrays
    inline; output_to a SharedTensor writes those bits into the region (Result.output a view of
    it, the answer's output naming the range with empty data, the lse inline), and into a region
    registered by key (Result.output None, the bytes read back from the SharedMemory);
  - a decode step with query, key, value and output_to in shared memory (Client.decode with a
    dict item, then Cache.decode, then append) equal, bit for bit, the same steps inline on a
    twin cache, and the caches then holding the same bytes (export);
  - INVALID_ARGUMENT naming query.shared_memory.byte_size (a Tensor whose byte_size is not its
    shape's), output_to.byte_size and items[0].output_to.byte_size (an output_to of another
    shape; the decode's cache keeping its length), query.shared_memory (Trace takes inline
    tensors only), key (a bad key); OUT_OF_RANGE for a range past the region and a registration
    past the file's end; NOT_FOUND naming query.shared_memory.region / output_to.region for an
    unknown region and for a key that does not exist; ALREADY_EXISTS for a name taken; the
    client's TypeError / ValueError before any RPC (a dtype= or cache dtype a SharedTensor does
    not have, an output_to of another dtype than the output's, a range past a SharedRegion or a
    SharedMemory, a bad name, a key without byte_size);
  - unregistering: a region unregistered by name is NOT_FOUND for calls, status and a second
    unregister; unregister_shared_memory() returns every name the caller had;
  - identities (mutual TLS, two client certificates, when openssl is present; a bearer token is
    one identity for all its callers, attnd takes one token): the second identity sees none of
    the first's regions (status empty, a call naming one NOT_FOUND, unregister NOT_FOUND), may
    register the same name on its own, and unregistering all of its regions leaves the first's;
  - a region's file truncated under it: a call reading it and a call writing into it fail
    FAILED_PRECONDITION naming the tensor, and attnd keeps answering (GetServerInfo, Tiled);
  - the replay tail with --cache-dir: tokens appended from a SharedRegion are kept as a copy
    of their bytes (the region overwritten afterwards), so after a SIGKILL lost them refresh()
    re-sends exactly what was appended; tokens appended through a region given by name cannot
    be kept, and refresh() answers DATA_LOSS saying so.

Run as
  /usr/bin/python3 tests/python/test_shared_memory.py --attnd <attnd> --stubs <stubs dir>
"""

import gc
import os
import shutil
import subprocess
import tempfile
import unittest
from multiprocessing import shared_memory

import attnd_harness as harness  # tests/python is sys.path[0] for a script.

ARGS = harness.parse_args(__doc__, unittest=True)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import attn_client  # noqa: E402
from attn_client import AttnError, Client, SharedTensor  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402

RPC_TIMEOUT_S = 60.0
SHM_BYTES = 1 << 16


def random32(rng, *shape):
    return rng.uniform(-1, 1, shape).astype(np.float32)


def bits(array):
    """An array's dtype, shape and bytes, to compare bit for bit."""
    return (str(array.dtype), tuple(array.shape), array.tobytes())


class ServerCase(harness.ServerCase):
    """harness.ServerCase with `server_args`; SharedMemory objects made by new_memory() are
    closed and unlinked after each test, and every region of the class's client unregistered."""

    attnd = ARGS.attnd
    rpc_timeout = RPC_TIMEOUT_S
    server_args = ("--allow-shared-memory",)

    def setUp(self):
        self.rng = np.random.default_rng()
        self.memories = []
        self.addCleanup(self.release_memories)

    def new_memory(self, size=SHM_BYTES):
        memory = shared_memory.SharedMemory(create=True, size=size)
        self.memories.append(memory)
        return memory

    def release_memories(self):
        if "--allow-shared-memory" in self.server_args:
            try:
                self.client.unregister_shared_memory()
            except AttnError:
                pass
        gc.collect()  # Views of the memories (arrays, Results) go first.
        for memory in self.memories:
            try:
                memory.close()
            except BufferError:  # A view is still held (a failed test's traceback).
                pass
            try:
                memory.unlink()
            except FileNotFoundError:
                pass
        self.memories = []

    def put(self, region, offset, array, dtype="fp32"):
        """`array` written into `region` at `offset` → the SharedTensor naming it."""
        region.array(offset, array.shape, dtype)[...] = array
        return region.tensor(offset, array.shape, dtype)


class OffTest(ServerCase):
    """attnd without --allow-shared-memory."""

    server_args = ()

    def test_every_call_names_the_flag(self):
        self.assertFalse(self.client.info()["shared_memory"])
        memory = self.new_memory()
        calls = [("register", lambda: self.client.register_shared_memory("io", memory)),
                 ("status", self.client.shared_memory_status),
                 ("unregister", self.client.unregister_shared_memory)]
        q, k, v = attn_client.seed_example()
        calls.append(("tiled", lambda: self.client.tiled(SharedTensor("io", 0, q.shape, "fp32"),
                                                         k, v)))
        for name, call in calls:
            with self.subTest(call=name):
                message = self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, call)
                self.assertIn("--allow-shared-memory", message)


class SharedMemoryTest(ServerCase):

    def test_info_says_on(self):
        self.assertTrue(self.client.info()["shared_memory"])

    def test_register_and_status(self):
        memory = self.new_memory()
        key = "/" + memory.name
        region = self.client.register_shared_memory("io", memory)
        self.assertEqual((region.name, region.key, region.offset, region.byte_size,
                          region.writable), ("io", key, 0, SHM_BYTES, True))
        self.assertIs(region.memory, memory)
        part = self.client.register_shared_memory("part", memory, byte_size=4096, offset=8192)
        self.assertEqual((part.offset, part.byte_size), (8192, 4096))
        # A key string: the path form, byte_size required; no memory to view.
        by_path = self.client.register_shared_memory("by-path", "/dev/shm/" + memory.name,
                                                     byte_size=100, offset=1)
        self.assertIsNone(by_path.memory)
        with self.assertRaises(ValueError):
            by_path.array(0, (2, 2), "fp32")
        want = [dict(name="by-path", key="/dev/shm/" + memory.name, offset=1, byte_size=100,
                     writable=True),
                dict(name="io", key=key, offset=0, byte_size=SHM_BYTES, writable=True),
                dict(name="part", key=key, offset=8192, byte_size=4096, writable=True)]
        self.assertEqual(sorted(self.client.shared_memory_status(), key=lambda r: r["name"]),
                         want)
        self.assertEqual(self.client.shared_memory_status("part"), [want[2]])
        # A region's array is a view of the SharedMemory's bytes at the region's offset.
        part.array(16, (4,), "fp32")[:] = [1, 2, 3, 4]
        self.assertEqual(np.frombuffer(memory.buf, "<f4", 4, 8192 + 16).tolist(), [1, 2, 3, 4])

    def test_register_errors(self):
        memory = self.new_memory()
        self.client.register_shared_memory("io", memory)
        self.assertIn("io", self.assertCode(grpc.StatusCode.ALREADY_EXISTS,
                                            self.client.register_shared_memory, "io", memory))
        missing = "/attn-test-missing-%d" % os.getpid()
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.register_shared_memory, "gone",
                        missing, byte_size=16)
        self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.client.register_shared_memory,
                        "long", "/" + memory.name, byte_size=SHM_BYTES + 1)
        self.assertIn("key", self.assertCode(grpc.StatusCode.INVALID_ARGUMENT,
                                             self.client.register_shared_memory, "bad",
                                             "/dev/shm/../etc/passwd", byte_size=16))
        # The client's checks, before any RPC.
        with self.assertRaises(ValueError):
            self.client.register_shared_memory("bad name", memory)
        with self.assertRaises(TypeError):
            self.client.register_shared_memory(7, memory)
        with self.assertRaises(ValueError):
            self.client.register_shared_memory("x", "/" + memory.name)  # No byte_size.
        with self.assertRaises(ValueError):
            self.client.register_shared_memory("x", memory, byte_size=SHM_BYTES, offset=1)
        with self.assertRaises(TypeError):
            self.client.register_shared_memory("x", b"not memory", byte_size=16)
        self.assertEqual([r["name"] for r in self.client.shared_memory_status()], ["io"])

    def test_tiled_and_naive_inputs_in_shared_memory(self):
        memory = self.new_memory()
        region = self.client.register_shared_memory("io", memory)
        part = self.client.register_shared_memory("part", memory, byte_size=8192, offset=40000)
        q, k, v = random32(self.rng, 4, 9, 16), random32(self.rng, 2, 13, 16), \
            random32(self.rng, 2, 13, 12)
        qs = self.put(region, 0, q)
        ks = self.put(region, qs.nbytes, k)
        vs = self.put(part, 64, v)  # At 40064 in the file: the region's offset counts.
        self.assertEqual(np.frombuffer(memory.buf, "<f4", v.size, 40064).tobytes(), v.tobytes())
        for method in ("tiled", "naive"):
            call = getattr(self.client, method)
            for options in (dict(), dict(causal=True, return_lse=True, block_k=5)):
                with self.subTest(method=method, **options):
                    shared = call(qs, ks, vs, **options)
                    inline = call(q, k, v, **options)
                    self.assertEqual(bits(shared.output), bits(inline.output))
                    if options:
                        self.assertEqual(bits(shared.lse), bits(inline.lse))
        # bf16 bit patterns in shared memory equal the same bits inline.
        qb, kb, vb = (attn_client.float32_to_bf16(x) for x in (q, k, v))
        offset = 4096
        shared_b = []
        for array in (qb, kb, vb):
            shared_b.append(self.put(region, offset, array, "bf16"))
            offset += array.nbytes
        shared = self.client.tiled(*shared_b, causal=True)
        inline = self.client.tiled(qb, kb, vb, dtype="bf16", causal=True)
        self.assertEqual(shared.output_dtype, "bf16")
        self.assertEqual(bits(shared.output), bits(inline.output))
        # alibi_slopes="standard" counts the heads of a SharedTensor query.
        self.assertEqual(bits(self.client.tiled(qs, ks, vs, alibi_slopes="standard").output),
                         bits(self.client.tiled(q, k, v, alibi_slopes="standard").output))
        # The bytes are sent as they are: a dtype= they do not have is the client's ValueError.
        with self.assertRaises(ValueError):
            self.client.tiled(qs, ks, vs, dtype="bf16")
        with self.assertRaises(ValueError):
            region.tensor(SHM_BYTES - 8, (2, 2), "fp32")  # Past the region.
        with self.assertRaises(ValueError):
            self.client.tiled(region.tensor(0, (16,), "fp32"), k, v)  # Rank 1.

    def test_output_to(self):
        memory = self.new_memory()
        region = self.client.register_shared_memory("io", memory)
        q, k, v = random32(self.rng, 4, 9, 16), random32(self.rng, 2, 13, 16), \
            random32(self.rng, 2, 13, 12)
        inline = self.client.tiled(q, k, v, causal=True, return_lse=True)
        out = region.tensor(1024, (4, 9, 12), "fp32")
        result = self.client.tiled(q, k, v, causal=True, return_lse=True, output_to=out)
        self.assertEqual(bits(result.output), bits(inline.output))
        self.assertEqual(bits(result.lse), bits(inline.lse))
        self.assertTrue(np.shares_memory(result.output, out.array()))
        self.assertEqual(bits(out.array()), bits(inline.output))
        answer = result.response.output
        self.assertEqual((list(answer.shape), answer.dtype, answer.data),
                         ([4, 9, 12], pb.DTYPE_FLOAT32, b""))
        self.assertEqual((answer.shared_memory.region, answer.shared_memory.offset,
                          answer.shared_memory.byte_size), ("io", 1024, out.nbytes))
        self.assertEqual(result.response.lse.data, inline.response.lse.data)
        # Inputs and output all in shared memory, through naive; output_dtype bf16.
        qs, ks = self.put(region, 8192, q), self.put(region, 8192 + q.nbytes, k)
        vs = self.put(region, 8192 + q.nbytes + k.nbytes, v)
        out_b = region.tensor(32768, (4, 9, 12), "bf16")
        result = self.client.naive(qs, ks, vs, output_dtype="bf16", output_to=out_b)
        self.assertEqual(bits(result.output),
                         bits(self.client.naive(q, k, v, output_dtype="bf16").output))
        self.assertEqual(result.output.dtype, np.uint16)
        # Into a region registered by key: the client has no view, the bytes are in the file.
        by_key = self.client.register_shared_memory("by-key", "/" + memory.name,
                                                    byte_size=SHM_BYTES)
        result = self.client.tiled(q, k, v, causal=True, output_to=by_key.tensor(
            16384, (4, 9, 12), "fp32"))
        self.assertIsNone(result.output)
        self.assertIsNone(result.output_float32())
        self.assertEqual(bytes(memory.buf[16384:16384 + out.nbytes]), inline.output.tobytes())
        # The output's dtype is checked by the client, before any RPC.
        with self.assertRaises(ValueError):
            self.client.tiled(q, k, v, output_to=region.tensor(0, (4, 9, 12), "fp16"))
        with self.assertRaises(ValueError):
            self.client.tiled(q, k, v, output_dtype="bf16", output_to=out)
        with self.assertRaises(TypeError):
            self.client.tiled(q, k, v, output_to=np.zeros((4, 9, 12), np.float32))

    def test_decode_in_shared_memory_equals_inline(self):
        memory = self.new_memory()
        region = self.client.register_shared_memory("io", memory)
        caches = [self.client.create_cache(2, 16, 12, dtype="fp32") for _ in range(2)]
        k0, v0 = random32(self.rng, 2, 37, 16), random32(self.rng, 2, 37, 12)
        for cache in caches:
            cache.append(k0, v0)
        shared, twin = caches
        # One step through Client.decode: query, key, value and output_to in shared memory.
        q, k, v = random32(self.rng, 4, 1, 16), random32(self.rng, 2, 1, 16), \
            random32(self.rng, 2, 1, 12)
        qs, ks, vs = self.put(region, 0, q), self.put(region, 256, k), self.put(region, 512, v)
        out = region.tensor(1024, (4, 1, 12), "fp32")
        got = self.client.decode([{"cache": shared, "query": qs, "key": ks, "value": vs,
                                   "output_to": out}], causal=True, return_lse=True)
        want = self.client.decode([(twin, q, k, v)], causal=True, return_lse=True)
        self.assertEqual(bits(got.outputs[0]), bits(want.outputs[0]))
        self.assertEqual(bits(got.lse[0]), bits(want.lse[0]))
        self.assertTrue(np.shares_memory(got.outputs[0], out.array()))
        self.assertEqual(got.response.outputs[0].data, b"")
        self.assertEqual(got.caches[0]["length"], 38)
        self.assertEqual((shared.length, twin.length), (38, 38))
        # Cache.decode with the next token, the region's bytes overwritten in place.
        q, k, v = random32(self.rng, 4, 1, 16), random32(self.rng, 2, 1, 16), \
            random32(self.rng, 2, 1, 12)
        qs, ks, vs = self.put(region, 0, q), self.put(region, 256, k), self.put(region, 512, v)
        got = shared.decode(qs, ks, vs, output_to=out, return_lse=True)
        want = twin.decode(q, k, v, return_lse=True)
        self.assertEqual(bits(got.output), bits(want.output))
        self.assertEqual(bits(got.lse), bits(want.lse))
        # append() from shared memory, then a step without new tokens over both.
        k, v = random32(self.rng, 2, 5, 16), random32(self.rng, 2, 5, 12)
        shared.append(self.put(region, 4096, k), self.put(region, 8192, v))
        twin.append(k, v)
        q = random32(self.rng, 4, 3, 16)
        self.assertEqual(bits(shared.decode(self.put(region, 0, q), causal=True).output),
                         bits(twin.decode(q, causal=True).output))
        # The caches hold the same bytes.
        for chunk_a, chunk_b in zip(self.client.export_cache(shared),
                                    self.client.export_cache(twin)):
            self.assertEqual((chunk_a.key.data, chunk_a.value.data),
                             (chunk_b.key.data, chunk_b.value.data))
        # Tokens in another dtype than the cache's: the client's ValueError, nothing sent.
        with self.assertRaises(ValueError):
            shared.append(region.tensor(0, (2, 1, 16), "fp16"), region.tensor(64, (2, 1, 12),
                                                                               "fp16"))
        with self.assertRaises(ValueError):
            shared.decode(qs, region.tensor(0, (2, 1, 16), "bf16"),
                          region.tensor(64, (2, 1, 12), "bf16"))
        with self.assertRaises(ValueError):  # An output_to of another dtype than the output.
            shared.decode(qs, output_to=region.tensor(1024, (4, 1, 12), "bf16"))
        with self.assertRaises(TypeError):
            self.client.decode([{"cache": shared, "query": qs, "output_to": "io"}])
        self.assertEqual(shared.length, 44)

    def test_wrong_ranges(self):
        memory = self.new_memory()
        region = self.client.register_shared_memory("io", memory)
        q, k, v = random32(self.rng, 4, 9, 16), random32(self.rng, 2, 13, 16), \
            random32(self.rng, 2, 13, 16)
        qs = self.put(region, 0, q)
        # A Tensor whose byte_size is not its shape's.
        wrong = pb.Tensor(shape=[4, 9, 16], dtype=pb.DTYPE_FLOAT32,
                          shared_memory=pb.SharedMemoryRef(region="io", offset=0,
                                                           byte_size=qs.nbytes - 4))
        self.assertIn("query.shared_memory.byte_size",
                      self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.tiled,
                                      wrong, k, v))
        # An output_to of another shape (so another byte size) than the output's.
        self.assertIn("output_to.byte_size",
                      self.assertCode(grpc.StatusCode.INVALID_ARGUMENT, self.client.tiled,
                                      q, k, v, output_to=region.tensor(4096, (4, 9, 8), "fp32")))
        # A range past the region, by name (the client cannot check it).
        past = SharedTensor("io", SHM_BYTES - 64, (4, 9, 16), "fp32")
        self.assertIn("query.shared_memory",
                      self.assertCode(grpc.StatusCode.OUT_OF_RANGE, self.client.tiled,
                                      past, k, v))
        # An unknown region, as input and as output.
        nowhere = SharedTensor("nowhere", 0, (4, 9, 16), "fp32")
        self.assertIn("query.shared_memory.region",
                      self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.tiled,
                                      nowhere, k, v))
        self.assertIn("key.shared_memory.region",
                      self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.tiled, q,
                                      SharedTensor("nowhere", 0, k.shape, "fp32"), v))
        self.assertIn("output_to.region",
                      self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.tiled, q, k, v,
                                      output_to=SharedTensor("nowhere", 0, (4, 9, 16), "fp32")))
        # Trace takes inline tensors only.
        self.assertIn("query.shared_memory",
                      self.assertCode(grpc.StatusCode.INVALID_ARGUMENT,
                                      lambda: list(self.client.trace(qs, k, v))))
        # A decode item's output_to of the wrong size: refused, its cache keeps its length.
        cache = self.client.create_cache(2, 16, 16, dtype="fp32")
        cache.append(k, v)
        before = self.client.cache_info(cache)
        message = self.assertCode(
            grpc.StatusCode.INVALID_ARGUMENT, self.client.decode,
            [{"cache": cache, "query": q[:, :1], "key": k[:, :1], "value": v[:, :1],
              "output_to": region.tensor(4096, (4, 2, 16), "fp32")}])
        self.assertIn("items[0].output_to.byte_size", message)
        self.assertEqual(self.client.cache_info(cache), before)
        self.assertEqual(cache.length, 13)

    def test_unregister(self):
        memory = self.new_memory()
        region = self.client.register_shared_memory("io", memory)
        q, k, v = attn_client.seed_example()
        qs = self.put(region, 0, q)
        self.client.tiled(qs, k, v)
        self.assertEqual(self.client.unregister_shared_memory("io"), ["io"])
        self.assertIn("query.shared_memory.region",
                      self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.tiled, qs, k, v))
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.shared_memory_status, "io")
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.client.unregister_shared_memory, "io")
        self.assertEqual(self.client.shared_memory_status(), [])
        # The name is free again; unregister all returns every name.
        names = ["a", "b.2", "io"]
        for name in names:
            self.client.register_shared_memory(name, memory, byte_size=1024)
        self.assertEqual(sorted(self.client.unregister_shared_memory()), names)
        self.assertEqual(self.client.shared_memory_status(), [])
        self.assertEqual(self.client.unregister_shared_memory(), [])

    def test_truncated_region(self):
        memory = self.new_memory()
        region = self.client.register_shared_memory("cut", memory)
        q, k, v = attn_client.seed_example()
        qs = self.put(region, 0, q)
        out = region.tensor(4096, (8, 4), "fp32")
        self.assertEqual(bits(self.client.tiled(qs, k, v).output),
                         bits(self.client.tiled(q, k, v).output))
        del qs  # (A SharedTensor holds no view; the arrays of `put` are gone.)
        # No view of the memory may be touched from here on: its pages are gone (SIGBUS).
        with open("/dev/shm/" + memory.name, "r+b") as f:
            f.truncate(0)
        self.assertIn("query.shared_memory",
                      self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.tiled,
                                      SharedTensor("cut", 0, q.shape, "fp32"), k, v))
        self.assertIn("output_to",
                      self.assertCode(grpc.StatusCode.FAILED_PRECONDITION, self.client.tiled,
                                      q, k, v, output_to=SharedTensor("cut", 4096, (8, 4),
                                                                      "fp32")))
        del out
        self.assertTrue(self.server.alive())
        self.assertTrue(self.client.info()["shared_memory"])
        np.testing.assert_allclose(self.client.tiled(q, k, v).output[0], harness.SEED_OUT_ROW0,
                                   atol=1e-6)


@unittest.skipUnless(shutil.which("openssl"), "openssl not installed: identities not tested")
class IdentityTest(ServerCase):
    """Mutual TLS: each client certificate is an identity with regions of its own. (A bearer
    token is one identity for every caller that has it, and attnd takes one token.)"""

    _dir = None

    @classmethod
    def setUpClass(cls):
        cls._dir = d = tempfile.mkdtemp(prefix="attn_shm_tls_")

        def ssl(*args):
            subprocess.run(["openssl"] + list(args), check=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)

        def certificate(name, serial, extensions):
            ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-subj", "/CN=attn shm test " + name, "-keyout", "%s/%s.key" % (d, name),
                "-out", "%s/%s.csr" % (d, name))
            with open("%s/%s.ext" % (d, name), "w") as f:
                f.write(extensions + "\n")
            ssl("x509", "-req", "-in", "%s/%s.csr" % (d, name), "-CA", d + "/ca.pem", "-CAkey",
                d + "/ca.key", "-set_serial", str(serial), "-days", "1",
                "-extfile", "%s/%s.ext" % (d, name), "-out", "%s/%s.pem" % (d, name))

        ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-days", "1", "-subj", "/CN=attn shm test ca", "-keyout", d + "/ca.key",
            "-out", d + "/ca.pem")
        certificate("server", 7, "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                    "extendedKeyUsage=serverAuth")
        certificate("alice", 8, "extendedKeyUsage=clientAuth")
        certificate("bob", 9, "extendedKeyUsage=clientAuth")
        cls.server_args = ("--allow-shared-memory", "--tls-cert", d + "/server.pem",
                           "--tls-key", d + "/server.key", "--tls-client-ca", d + "/ca.pem")
        cls.server = harness.AttndProcess(ARGS.attnd, ("--threads", "2") + cls.server_args)
        cls.client = cls.connect("alice")
        cls.other = cls.connect("bob")

    @classmethod
    def connect(cls, name):
        return Client(cls.server.address, tls_ca=cls._dir + "/ca.pem",
                      tls_cert="%s/%s.pem" % (cls._dir, name),
                      tls_key="%s/%s.key" % (cls._dir, name), timeout=RPC_TIMEOUT_S)

    @classmethod
    def tearDownClass(cls):
        if cls.server is not None:
            cls.other.close()
            super().tearDownClass()
        shutil.rmtree(cls._dir, ignore_errors=True)

    def test_regions_are_per_identity(self):
        memory = self.new_memory()
        self.addCleanup(lambda: self.other.unregister_shared_memory())
        region = self.client.register_shared_memory("io", memory)
        q, k, v = attn_client.seed_example()
        qs = self.put(region, 0, q)
        expected = bits(self.client.tiled(q, k, v).output)
        self.assertEqual(bits(self.client.tiled(qs, k, v).output), expected)
        self.assertEqual(self.other.shared_memory_status(), [])
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.other.shared_memory_status, "io")
        self.assertIn("query.shared_memory.region",
                      self.assertCode(grpc.StatusCode.NOT_FOUND, self.other.tiled,
                                      SharedTensor("io", 0, q.shape, "fp32"), k, v))
        self.assertCode(grpc.StatusCode.NOT_FOUND, self.other.unregister_shared_memory, "io")
        # The same name is free for the other identity, over the same file.
        mine = self.other.register_shared_memory("io", memory, byte_size=4096, offset=4096)
        self.assertEqual((mine.offset, mine.byte_size), (4096, 4096))
        self.assertEqual(self.other.unregister_shared_memory(), ["io"])
        self.assertEqual([r["byte_size"] for r in self.client.shared_memory_status()],
                         [SHM_BYTES])
        self.assertEqual(bits(self.client.tiled(qs, k, v).output), expected)


class ReplayTailTest(ServerCase):
    """--cache-dir with a write-behind far slower than the test: appended tokens stay in the
    replay tail until a SIGKILL loses them."""

    _dir = None

    @classmethod
    def setUpClass(cls):
        cls._dir = tempfile.mkdtemp(prefix="attn_shm_cache_")
        cls.server_args = ("--allow-shared-memory", "--cache-dir", cls._dir,
                           "--cache-sync-seconds", "600")
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        shutil.rmtree(cls._dir, ignore_errors=True)

    def restart(self):
        """SIGKILL attnd and start it again over the same --cache-dir → the new Client."""
        type(self).client.close()
        self.server.stop()
        old = self.server
        type(self).server = harness.AttndProcess(ARGS.attnd,
                                                 ("--threads", "2") + tuple(self.server_args))
        old.close()
        type(self).client = Client(self.server.address, timeout=RPC_TIMEOUT_S)
        return self.client

    def test_tail_keeps_a_copy_of_shared_tokens(self):
        memory = self.new_memory()
        region = self.client.register_shared_memory("io", memory)
        cache = self.client.create_cache(2, 16, 12, dtype="fp32")
        named = self.client.create_cache(1, 8, 8, dtype="fp32")
        k, v = random32(self.rng, 2, 7, 16), random32(self.rng, 2, 7, 12)
        cache.append(self.put(region, 0, k), self.put(region, 4096, v))
        k1, v1 = random32(self.rng, 2, 1, 16), random32(self.rng, 2, 1, 12)
        q = random32(self.rng, 4, 1, 16)
        cache.decode(self.put(region, 8192, q), self.put(region, 0, k1),
                     self.put(region, 4096, v1))
        self.assertEqual(cache.durable_length, 0)
        self.assertEqual(cache.replay_tail, [(0, 7), (7, 1)])
        # Tokens through a region given by name: the client cannot read them, keeps none.
        nk, nv = random32(self.rng, 1, 3, 8), random32(self.rng, 1, 3, 8)
        self.put(region, 16384, nk)
        self.put(region, 20480, nv)
        named.append(SharedTensor("io", 16384, nk.shape, "fp32"),
                     SharedTensor("io", 20480, nv.shape, "fp32"))
        self.assertEqual(named.replay_tail, [])
        # The region overwritten: the tail holds the bytes as they were appended.
        memory.buf[:32768] = bytes(32768)
        client = self.restart()
        for each in (cache, named):
            each.client = client
        info = cache.refresh()
        self.assertEqual(info["length"], 8)
        chunks = client.export_cache(cache)
        self.assertEqual(b"".join(c.key.data for c in chunks),
                         np.concatenate([k, k1], axis=1).tobytes())
        self.assertEqual(b"".join(c.value.data for c in chunks),
                         np.concatenate([v, v1], axis=1).tobytes())
        # The kill lost the named cache's tokens too (by id: cache_info of a Cache would take
        # the server's length as its own), and its Cache has nothing to re-send.
        self.assertEqual(client.cache_info(named.id)["length"], 0)
        message = self.assertCode(grpc.StatusCode.DATA_LOSS, named.refresh)
        self.assertIn("tokens before 3 were sent in shared memory", message)
        self.assertEqual(named.length, 3)


if __name__ == "__main__":
    unittest.main(argv=ARGS.unittest_argv, exit=True)
