#!/usr/bin/python3
"""The hostile suite (issue 27): attacks on a running attnd that holds KV caches.

Starts its own attnd (loopback, free ports, a bearer token, small limits so every attack is
cheap), creates five KV caches (fp32 and bf16, odd sizes, two of them 40000 and 65536 values
wide), appends tokens and records each cache's Decode output for a fixed query (no new tokens):
the "before". Then sends each attack below and, after every one, checks that attnd is alive,
answers grpc.health.v1 Check with SERVING and GetServerInfo, that every cache still has its
length and decodes bit-identically to its "before", and that attnd's RSS stays under a bound.

  1  Tiled/Naive with query [65536, 1], key [1, 1], value [1, 900000] fp32 (3.9 MB asking for
     a 236 GB output): RESOURCE_EXHAUSTED naming max-message-bytes.
  2  The same over a cache (value_dim 65536): Tiled and Decode whose output passes the message
     limit, and a Decode batch whose items fit one by one but not together (their new tokens
     must not be kept): RESOURCE_EXHAUSTED naming max-message-bytes, lengths unchanged.
  3  --max-caches 8: the 9th CreateCache is RESOURCE_EXHAUSTED naming max-caches; after a
     DeleteCache a create works again.
  4  --max-traces 2, --trace-idle-seconds 2: two Trace streams nobody reads hold both slots (a
     third is refused at once) until the idle limit cancels them; then a trace works.
  5  --max-inflight-bytes 16 MiB: 12 concurrent 3.4 MB Tiled calls; each is either correct or
     RESOURCE_EXHAUSTED naming max-inflight-bytes, never UNAVAILABLE/INTERNAL.
  6  The JSON gateway: attack 1 as JSON (429/400 RESOURCE_EXHAUSTED), without a token (401), a
     forged huge Content-Length with no body (401 without token, 413 with, within 2 s),
     Content-Type text/plain (415), X-Timeout-Ms: -5 (400).
  7  A burst of 200 malformed requests (wrong data sizes, random bytes, negative and huge dims,
     bad dtypes, non-finite elements, bad cache appends) interleaved with 50 valid ones from 4
     threads: every malformed one INVALID_ARGUMENT, every valid one correct.

When attnd dies (an attack that crashes it), the line says so with the tail of its stderr, and
a fresh attnd with fresh caches takes over for the remaining attacks. When a check after an
attack fails while attnd lives, the caches' state is taken as the new "before", so one failure
is not blamed on every later attack. Prints one line per attack and "N passed, M failed".

  /usr/bin/python3 tests/python/attack_test.py --attnd <attnd> --stubs <generated stubs dir>

Exit status 0 when every attack passed. Needs python3-grpcio and python3-numpy (Debian).
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor



import attnd_harness as h  # noqa: E402 (tests/python is sys.path[0] for a script)


def add_arguments(parser):
    parser.add_argument("--only", default="", help="comma-separated attack groups to run, e.g. 1,4")
    parser.add_argument("--rss-limit-mib", type=int, default=1536,
                        help="attnd's VmRSS bound after every attack (ASan inflates it)")
    parser.add_argument("--verbose", action="store_true", help="print each status message too")


ARGS = h.parse_args(__doc__, add_arguments)

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402
from attention.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

# The server's limits for this suite; the attacks are sized against them.
MAX_MESSAGE_BYTES = 4 << 20
MAX_CACHES = 8
TRACE_IDLE_SECONDS = 2
MAX_TRACES = 2
MAX_INFLIGHT_BYTES = 16 << 20
MAX_QUEUE = 64
CACHE_BYTES = 512 << 20
RPC_TIMEOUT_S = 30.0
MAX_RESTARTS = 12
# Flags the issue adds; an attnd without one runs without it and the attack it serves fails.
NEW_FLAGS = ("max-caches", "trace-idle-seconds", "max-inflight-bytes")

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
F32, F16, BF16 = pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16
ELEMENT_BYTES = h.ELEMENT_BYTES  # By attention.v1 DType number.
NAN_BITS = {F32: 0x7FC00000, F16: 0x7E00, BF16: 0x7FC0}
INF_BITS = {F32: 0x7F800000, F16: 0x7C00, BF16: 0x7F80}
RNG = np.random.default_rng(20240727)

TOKEN = "attack-suite-" + secrets.token_hex(12)
AUTH = (("authorization", "Bearer " + TOKEN),)
HTTP_LINE = re.compile(r"^\s+http: http://[^\s]*:(\d+)")
# The refusals heard during the current attack, for --verbose: "<what>: <code> <message>".
HEARD = []


def heard(what, code, details):
    if ARGS.verbose and len(HEARD) < 1000:
        HEARD.append("%s: %s %s" % (what, code, details[:300]))


def code_name(code):
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


def random_tensor(shape, dtype, low=-1.0, high=1.0):
    """(Tensor, the float64 values the server sees) of uniform values in [low, high)."""
    return h.encode(RNG.uniform(low, high, size=shape).astype(np.float32), dtype)


def as4(array):
    return array.reshape((1,) * (4 - array.ndim) + array.shape)


def mentions(details, words):
    missing = [word for word in words if word not in details]
    return "" if not missing else "message %r lacks %r" % (details[:300], missing)


def expect(code, details, want, words=()):
    """'' when (code, details) is `want` with every word of `words` in the message."""
    if code != want:
        return "got %s (%s), expected %s" % (code_name(code), details[:300], want.name)
    return mentions(details, words)


# --- Problems ---------------------------------------------------------------------------------

class Problem:
    """A stateless AttentionRequest with the float64 values the server sees."""

    def __init__(self, q_shape, k_shape, v_shape, dtype=F32, **options):
        self.request = pb.AttentionRequest(options=pb.AttentionOptions(**options))
        self.seen = {}
        for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
            tensor, seen = random_tensor(shape, dtype)
            getattr(self.request, name).CopyFrom(tensor)
            self.seen[name] = seen
        self.dtype = dtype

    def check(self, response):
        """'' when the response's output (and lse) matches the float64 reference."""
        options = self.request.options
        scale = options.scale if options.HasField("scale") else None
        out, lse, score_max = h.reference_attention(
            as4(self.seen["query"]), as4(self.seen["key"]), as4(self.seen["value"]), scale=scale,
            causal=options.causal)
        q_shape = tuple(self.request.query.shape)
        out = out.reshape(q_shape[:-1] + (out.shape[-1],))
        output_dtype = options.output_dtype or self.request.query.dtype
        if response.output.dtype != output_dtype:
            return "output dtype %d, expected %d" % (response.output.dtype, output_dtype)
        why = h.output_error(h.decode(response.output), out, output_dtype, score_max)
        if not why and options.return_lse:
            why = h.lse_error(h.decode(response.lse), lse.reshape(q_shape[:-1]))
        return why


def random_problem(dtype=None, **options):
    """A small valid rank-4 problem of odd sizes."""
    dtype = dtype or int(RNG.choice([F32, F16, BF16]))
    batch = int(RNG.integers(1, 3))
    kv_heads = int(RNG.choice([1, 2]))
    heads = kv_heads * int(RNG.choice([1, 2, 3]))
    query_len, key_len = int(RNG.integers(1, 10)), int(RNG.integers(1, 14))
    head_dim, value_dim = int(RNG.integers(1, 17)), int(RNG.integers(1, 10))
    return Problem((batch, heads, query_len, head_dim), (batch, kv_heads, key_len, head_dim),
                   (batch, kv_heads, key_len, value_dim), dtype, **options)


def amplifier_request(return_lse=False):
    """Attack 1: query [65536, 1], key [1, 1], value [1, 900000] fp32 — 3.9 MB that ask for a
    65536 × 900000 fp32 output (236 GB). (The issue's value [1, 1000000] is 4.26 MB, over this
    suite's 4 MiB message limit; 900000 keeps the request under it and the output absurd.)"""
    request = pb.AttentionRequest(options=pb.AttentionOptions(return_lse=return_lse))
    request.query.CopyFrom(random_tensor((65536, 1), F32)[0])
    request.key.CopyFrom(random_tensor((1, 1), F32)[0])
    request.value.CopyFrom(random_tensor((1, 900000), F32)[0])
    return request


# --- Caches -----------------------------------------------------------------------------------

# (label, dtype, kv_heads, head_dim, value_dim, appended chunks, probe heads, probe rows)
CACHE_SPECS = [
    ("fp32 kv2 d13 dv7", F32, 2, 13, 7, (20, 17), 4, 3),
    ("bf16 kv1 d19 dv23", BF16, 1, 19, 23, (31, 19), 2, 1),
    ("bf16 kv3 d5 dv33", BF16, 3, 5, 33, (11,), 3, 2),
    ("wide fp32 d1 dv65536", F32, 1, 1, 65536, (1,), 1, 1),
    ("wide fp32 d1 dv40000", F32, 1, 1, 40000, (1,), 2, 1),
]
WIDE = 3     # CACHE_SPECS index of the 65536-wide cache.
WIDE_2 = 4   # and of the 40000-wide one.


class Cache:
    def __init__(self, spec):
        (self.label, self.dtype, self.kv_heads, self.head_dim, self.value_dim, self.chunks,
         self.heads, self.rows) = spec
        self.id = ""
        self.length = 0
        self.keys = np.zeros((self.kv_heads, 0, self.head_dim))
        self.values = np.zeros((self.kv_heads, 0, self.value_dim))
        self.probe, self.probe_seen = random_tensor((self.heads, self.rows, self.head_dim),
                                                    self.dtype)
        self.before = None  # (shape, dtype, data) of the probe's Decode output.

    def tokens(self, n):
        """(key Tensor, value Tensor, key seen, value seen) of n new tokens."""
        key, key_seen = random_tensor((self.kv_heads, n, self.head_dim), self.dtype)
        value, value_seen = random_tensor((self.kv_heads, n, self.value_dim), self.dtype)
        return key, value, key_seen, value_seen

    def probe_request(self):
        return pb.DecodeRequest(items=[pb.DecodeItem(cache_id=self.id, query=self.probe,
                                                     expected_length=self.length)])

    def reference_error(self, output):
        out, _, score_max = h.reference_attention(as4(self.probe_seen), as4(self.keys),
                                                  as4(self.values))
        return h.output_error(h.decode(output), out.reshape(output.shape), self.dtype, score_max)


# --- The server -------------------------------------------------------------------------------

class Server:
    """attnd with the suite's flags, its channel, its HTTP port and its caches."""

    def __init__(self, token_file):
        known = h.attnd_flags(ARGS.attnd)
        self.known_flags = known if "listen" in known else None  # None: --helpfull unreadable.
        self.missing_flags = [f for f in NEW_FLAGS
                              if self.known_flags is not None and f not in self.known_flags]
        wanted = [("--threads", "2"), ("--max-message-bytes", MAX_MESSAGE_BYTES),
                  ("--max-caches", MAX_CACHES), ("--trace-idle-seconds", TRACE_IDLE_SECONDS),
                  ("--max-traces", MAX_TRACES), ("--max-inflight-bytes", MAX_INFLIGHT_BYTES),
                  ("--max-queue", MAX_QUEUE), ("--cache-bytes", CACHE_BYTES),
                  ("--http-listen", "127.0.0.1:0"), ("--auth-token-file", token_file)]
        self.args = []
        for flag, value in wanted:
            if flag[2:] not in self.missing_flags:
                self.args += [flag, str(value)]
        self.process = None
        self.caches = []
        self.starts = 0
        self.max_rss_kib = 0  # The largest VmRSS the checks saw, over every attnd started.

    def start(self):
        self.starts += 1
        self.process = h.AttndProcess(ARGS.attnd, self.args)
        self.http_port = None
        deadline = time.monotonic() + 10
        while self.http_port is None and time.monotonic() < deadline:
            for line in list(self.process.stdout_lines):
                match = HTTP_LINE.match(line)
                if match:
                    self.http_port = int(match.group(1))
            time.sleep(0.02)
        if self.http_port is None:
            raise RuntimeError("attnd printed no http port:\n" + "".join(self.process.stdout_lines))
        self.channel = h.open_channel(self.process.address, max_message_bytes=64 << 20,
                                      own_connection=True)
        self.stub = pb_grpc.AttentionServiceStub(self.channel)
        self.caches = [Cache(spec) for spec in CACHE_SPECS]
        for cache in self.caches:
            self.fill(cache)

    def fill(self, cache):
        """Creates `cache` on the server, appends its chunks, records its "before"."""
        info = self.stub.CreateCache(
            pb.CreateCacheRequest(kv_heads=cache.kv_heads, head_dim=cache.head_dim,
                                  value_dim=cache.value_dim, dtype=cache.dtype),
            metadata=AUTH, timeout=RPC_TIMEOUT_S)
        cache.id = info.cache_id
        for n in cache.chunks:
            key, value, key_seen, value_seen = cache.tokens(n)
            info = self.stub.AppendCache(
                pb.AppendCacheRequest(cache_id=cache.id, key=key, value=value,
                                      expected_length=cache.length),
                metadata=AUTH, timeout=RPC_TIMEOUT_S)
            cache.length += n
            if info.length != cache.length:
                raise RuntimeError("%s: length %d after append, expected %d"
                                   % (cache.label, info.length, cache.length))
            cache.keys = np.concatenate([cache.keys, key_seen], axis=1)
            cache.values = np.concatenate([cache.values, value_seen], axis=1)
        response = self.stub.Decode(cache.probe_request(), metadata=AUTH, timeout=RPC_TIMEOUT_S)
        output = response.outputs[0]
        why = cache.reference_error(output)
        if why:
            raise RuntimeError("%s: the first Decode misses the float64 reference: %s"
                               % (cache.label, why))
        cache.before = (tuple(output.shape), output.dtype, output.data)

    def call(self, method, request, timeout=RPC_TIMEOUT_S):
        """(code, details, response) of one unary call with the token."""
        try:
            response = getattr(self.stub, method)(request, metadata=AUTH, timeout=timeout)
            return OK, "", response
        except grpc.RpcError as error:
            heard(method, code_name(error.code()), error.details() or "")
            return error.code(), error.details() or "", None

    def trace(self, request, timeout=RPC_TIMEOUT_S):
        """(code, details, events) of a Trace read to its end."""
        events = []
        try:
            for event in self.stub.Trace(request, metadata=AUTH, timeout=timeout):
                events.append(event)
            return OK, "", events
        except grpc.RpcError as error:
            heard("Trace", code_name(error.code()), error.details() or "")
            return error.code(), error.details() or "", events

    def exit_text(self):
        """How attnd ended, with the last lines of its stderr."""
        rc = self.process.process.returncode
        if rc is not None and rc < 0:
            try:
                how = "killed by %s" % signal.Signals(-rc).name
            except ValueError:
                how = "killed by signal %d" % -rc
        else:
            how = "exited with status %s" % rc
        lines = [line for line in self.process.stderr().splitlines() if line.strip()]
        interesting = [line for line in lines
                       if re.search(r"terminate|what\(\)|Sanitizer|bad_alloc|Abort|FATAL|"
                                    r"out of memory|exceeds", line)]
        tail = (interesting or lines)[-3:]
        return "attnd %s; stderr: %s" % (how, " | ".join(line.strip()[:200] for line in tail))

    def wait_exit(self, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.process.alive():
            time.sleep(0.05)
        return not self.process.alive()

    def check_state(self):
        """What is wrong after an attack ('' when nothing): alive, SERVING, GetServerInfo, every
        cache's length and bit-identical Decode, RSS."""
        if not self.process.alive() or self._unreachable():
            if self.wait_exit(3):
                return "DIED: " + self.exit_text()
            return "attnd is running but does not answer health Check"
        problems = []
        try:
            status = h.health_status(self.channel, timeout=10)
            if status != h.HEALTH_SERVING:
                problems.append("health status %d, not SERVING" % status)
        except grpc.RpcError as error:
            problems.append("health Check: %s" % code_name(error.code()))
        code, details, info = self.call("GetServerInfo", pb.GetServerInfoRequest())
        if code != OK:
            problems.append("GetServerInfo: %s %s" % (code_name(code), details[:200]))
        elif info.max_message_bytes != MAX_MESSAGE_BYTES:
            problems.append("GetServerInfo.max_message_bytes %d" % info.max_message_bytes)
        for cache in self.caches:
            code, details, described = self.call("GetCacheInfo",
                                                 pb.GetCacheInfoRequest(cache_id=cache.id))
            if code != OK:
                problems.append("%s: GetCacheInfo %s %s" % (cache.label, code_name(code),
                                                            details[:200]))
                continue
            if described.length != cache.length:
                problems.append("%s: length %d, was %d" % (cache.label, described.length,
                                                           cache.length))
                continue
            code, details, response = self.call("Decode", cache.probe_request())
            if code != OK:
                problems.append("%s: Decode %s %s" % (cache.label, code_name(code),
                                                      details[:200]))
                continue
            output = response.outputs[0]
            if (tuple(output.shape), output.dtype, output.data) != cache.before:
                problems.append("%s: Decode output differs from before" % cache.label)
        rss = self.process.rss_kib()
        if rss is not None:
            self.max_rss_kib = max(self.max_rss_kib, rss)
        if rss is not None and rss > ARGS.rss_limit_mib * 1024:
            problems.append("RSS %d MiB > %d MiB" % (rss // 1024, ARGS.rss_limit_mib))
        return "; ".join(problems)

    def _unreachable(self):
        try:
            h.health_status(self.channel, timeout=5)
            return False
        except grpc.RpcError:
            return True

    def rebaseline(self):
        """After a failed check with attnd alive: the caches as they are now become "before".
        False when one no longer answers (the caller then starts afresh: attacks name caches by
        their place in CACHE_SPECS)."""
        for cache in self.caches:
            code, _, described = self.call("GetCacheInfo",
                                           pb.GetCacheInfoRequest(cache_id=cache.id))
            if code != OK:
                return False
            cache.length = described.length
            code, _, response = self.call("Decode", cache.probe_request())
            if code != OK:
                return False
            output = response.outputs[0]
            cache.before = (tuple(output.shape), output.dtype, output.data)
        return True

    def restart(self):
        self.process.close()
        self.start()

    def stop(self):
        if self.process is not None:
            try:
                self.channel.close()
            except Exception:  # noqa: BLE001
                pass
            self.process.close()


# --- Attack 1 and 2: outputs over --max-message-bytes ------------------------------------------

LIMIT_WORD = "max-message-bytes"


def attack_amplifier(server, method, return_lse=False):
    code, details, _ = server.call(method, amplifier_request(return_lse))
    return code, expect(code, details, EXHAUSTED, [LIMIT_WORD])


def cache_query(rows, heads=1):
    return random_tensor((heads, rows, 1), F32)[0]


def attack_cache_tiled(server, rows, heads=1):
    wide = server.caches[WIDE]
    request = pb.AttentionRequest(query=cache_query(rows, heads), cache_id=wide.id)
    code, details, _ = server.call("Tiled", request)
    return code, expect(code, details, EXHAUSTED, [LIMIT_WORD])


def attack_cache_decode(server, rows):
    """One Decode item over the 65536-wide cache whose output passes the limit, carrying one new
    token (which must not be kept)."""
    wide = server.caches[WIDE]
    key, value, _, _ = wide.tokens(1)
    item = pb.DecodeItem(cache_id=wide.id, query=cache_query(rows), key=key, value=value,
                         expected_length=wide.length)
    code, details, _ = server.call("Decode", pb.DecodeRequest(items=[item]))
    return code, expect(code, details, EXHAUSTED, [LIMIT_WORD])


def attack_decode_sum(server):
    """Three items, each with a new token and an output under the limit (2.36 MB, 2.56 MB and a
    few bytes), together 4.9 MB: over it."""
    items = []
    for index, rows, heads in ((WIDE, 9, 1), (WIDE_2, 8, 2), (0, 1, 4)):
        cache = server.caches[index]
        key, value, _, _ = cache.tokens(1)
        query = random_tensor((heads, rows, cache.head_dim), F32)[0]
        items.append(pb.DecodeItem(cache_id=cache.id, query=query, key=key, value=value,
                                   expected_length=cache.length))
    total = sum(4 * item.query.shape[0] * item.query.shape[1] * server.caches[index].value_dim
                for item, index in zip(items, (WIDE, WIDE_2, 0)))
    assert total > MAX_MESSAGE_BYTES
    code, details, _ = server.call("Decode", pb.DecodeRequest(items=items))
    return code, expect(code, details, EXHAUSTED, [LIMIT_WORD])


# --- Attack 3: --max-caches -------------------------------------------------------------------

def attack_max_caches(server):
    def create():
        return server.call("CreateCache", pb.CreateCacheRequest(kv_heads=1, head_dim=3,
                                                                dtype=F32))
    code, details, listed = server.call("ListCaches", pb.ListCachesRequest())
    if code != OK:
        return code, "ListCaches: %s %s" % (code_name(code), details)
    made, why, seen = [], "", []
    try:
        for _ in range(MAX_CACHES - len(listed.caches)):
            code, details, info = create()
            if code != OK:
                return code, "create %d of %d: %s %s" % (len(listed.caches) + len(made) + 1,
                                                         MAX_CACHES, code_name(code), details)
            made.append(info.cache_id)
        code, details, info = create()
        seen.append(code_name(code))
        if code == OK:
            made.append(info.cache_id)
        why = expect(code, details, EXHAUSTED, ["max-caches"])
        if why:
            why = "cache %d: %s" % (MAX_CACHES + 1, why)
        if made:
            server.call("DeleteCache", pb.DeleteCacheRequest(cache_id=made.pop()))
            code, details, info = create()
            seen.append(code_name(code))
            if code == OK:
                made.append(info.cache_id)
            elif not why:
                why = "create after a delete: %s %s" % (code_name(code), details)
        if "max-caches" in server.missing_flags:
            why = (why + "; " if why else "") + "attnd has no --max-caches flag"
        return "9th " + " / after delete ".join(seen), why
    finally:
        for cache_id in made:
            server.call("DeleteCache", pb.DeleteCacheRequest(cache_id=cache_id))


# --- Attack 4: Trace streams nobody reads ------------------------------------------------------

def long_trace():
    """64 rows × 1000 one-key tiles = 64000 steps of ~300 bytes: far more than any flow-control
    window holds, so the server's writes stall while nobody reads."""
    problem = Problem((1, 1, 64, 8), (1, 1, 1000, 8), (1, 1, 1000, 32), block_k=1)
    return pb.TraceRequest(attention=problem.request,
                           rows=[pb.RowRef(batch=0, head=0, row=r) for r in range(64)])


def short_trace():
    problem = Problem((1, 1, 2, 4), (1, 1, 9, 4), (1, 1, 9, 3), block_k=4)
    return problem, pb.TraceRequest(attention=problem.request)


def short_trace_ok(server):
    """(code, details, why) of a short trace read to the end and checked."""
    problem, request = short_trace()
    code, details, events = server.trace(request, timeout=10)
    if code != OK:
        return code, details, ""
    kinds = [event.WhichOneof("event") for event in events]
    if not kinds or kinds[0] != "start" or kinds[-1] != "end":
        return code, details, "events %s" % kinds[:5]
    done = [event.row_done for event in events if event.HasField("row_done")]
    out, _, score_max = h.reference_attention(problem.seen["query"], problem.seen["key"],
                                              problem.seen["value"])
    why = h.output_error(np.array(done[0].output), out[0, 0, 0], F32, score_max,
                         float(np.max(np.abs(out))))
    return code, details, why


def drain(call, seconds=3.0):
    """How a stalled stream ends when read now: "<code> after <n> events" (what the client had
    buffered, then the server's cancel), or "still streaming" when it runs on for `seconds` (it
    is then cancelled here)."""
    timer = threading.Timer(seconds, call.cancel)
    timer.start()
    events = 0
    try:
        for _ in call:
            events += 1
        code, details = OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    finally:
        timer.cancel()
    if code == grpc.StatusCode.CANCELLED and "Locally cancelled" in details:
        return "still streaming (%d events)" % events
    return "%s (%d events)" % (code_name(code), events)


def metric(server, name):
    """The value of an unlabelled metric on attnd's /metrics (-1 when absent)."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % server.http_port,
                                timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
    return -1


def attack_idle_traces(server):
    streams = []
    # The unread streams get a connection of their own with a fixed window: on the shared one,
    # the short traces' traffic grew every stream's window (bandwidth-delay probing), which let a
    # stalled stream write on and restart its idle clock (seen under ASan, once).
    channel = h.open_channel(server.process.address, own_connection=True, fixed_window=True)
    idle_stub = pb_grpc.AttentionServiceStub(channel)
    try:
        opened = time.monotonic()
        for _ in range(MAX_TRACES):
            call = idle_stub.Trace(long_trace(), metadata=AUTH, timeout=60)
            call.initial_metadata()  # The server has started the stream; nothing is read.
            if call.done() and call.code() != OK:
                return call.code(), "idle stream refused: %s %s" % (code_name(call.code()),
                                                                    call.details())
            streams.append(call)
        opened = time.monotonic()
        started = time.monotonic()
        code, details, _ = server.trace(short_trace()[1], timeout=10)
        took = time.monotonic() - started
        seen = ["3rd %s in %.1fs" % (code_name(code), took)]
        why = expect(code, details, EXHAUSTED)
        if not why and took > 2:
            why = "the 3rd trace took %.1f s to be refused" % took
        if why:
            return seen[0], "3rd trace: " + why
        # The idle limit (2 s) with slack: a trace must work by 6 s after the streams stalled.
        deadline = opened + TRACE_IDLE_SECONDS + 4
        while True:
            time.sleep(0.25)
            code, details, bad = short_trace_ok(server)
            if code != EXHAUSTED or time.monotonic() > deadline:
                break
        waited = time.monotonic() - opened
        seen.append("then %s at %.1fs" % (code_name(code), waited))
        if code == OK:  # Reading the stalled streams now shows how they ended.
            # One slot frees the short trace; the other stream may be cancelled a watch tick
            # (or a stall) later, and reading it first would revive it: wait for the server to
            # count both before reading.
            wait_until = time.monotonic() + TRACE_IDLE_SECONDS + 2
            while (metric(server, "attnd_trace_idle_cancelled") < len(streams)
                   and time.monotonic() < wait_until):
                time.sleep(0.1)
            ends = [drain(call) for call in streams]
            seen.append("idle streams: " + ", ".join(ends))
            if any(end.startswith("still") for end in ends):
                why = "a trace slot came free while an idle stream still streams"
            if bad:
                why = "the trace after the idle limit: " + bad
        elif code != OK:
            why = ("no trace slot freed %.1f s after the streams went idle (idle limit %d s): %s"
                   % (waited, TRACE_IDLE_SECONDS, code_name(code)))
        if "trace-idle-seconds" in server.missing_flags:
            why = (why + "; " if why else "") + "attnd has no --trace-idle-seconds flag"
        return ", ".join(seen), why
    finally:
        for call in streams:
            call.cancel()
        channel.close()
        # The slots must come back once the client cancels (idle or not), for later attacks.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if short_trace_ok(server)[0] != EXHAUSTED:
                break
            time.sleep(0.2)


# --- Attack 5: --max-inflight-bytes -----------------------------------------------------------

def attack_inflight(server, calls=12):
    # 256 KiB query + 1 MiB key + 2 MiB value (3.4 MB) and a 512 KiB answer each.
    problems = [Problem((2, 256, 128), (2, 1024, 128), (2, 1024, 256), F32)
                for _ in range(calls)]
    barrier = threading.Barrier(calls)
    results = [None] * calls

    def fire(i):
        barrier.wait()
        results[i] = server.call("Tiled", problems[i].request, timeout=60)

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counts, whys = {}, []
    for i, (code, details, response) in enumerate(results):
        counts[code_name(code)] = counts.get(code_name(code), 0) + 1
        if code == OK:
            why = problems[i].check(response)
        elif code == EXHAUSTED:
            why = mentions(details, ["max-inflight-bytes"])
        else:
            why = "got %s (%s)" % (code_name(code), details[:200])
        if why:
            whys.append("call %d: %s" % (i, why))
    if "max-inflight-bytes" in server.missing_flags:
        whys.append("attnd has no --max-inflight-bytes flag (the bound is untested)")
    seen = " ".join("%s×%d" % item for item in sorted(counts.items()))
    return seen, "; ".join(whys[:4])


# --- Attack 6: the JSON gateway ---------------------------------------------------------------

def http_exchange(port, method, path, headers, body=b"", declared_length=None, timeout=30.0):
    """(status, headers dict, body bytes, seconds) of one HTTP/1.1 exchange over a raw socket;
    status None when no answer came (the error text as body). The body is sent from a thread
    while the answer is read, so an early answer (401, 413) is seen even when the server stops
    reading; `declared_length` forges Content-Length (the body then need not match)."""
    started = time.monotonic()
    length = len(body) if declared_length is None else declared_length
    head = ["%s %s HTTP/1.1" % (method, path), "Host: 127.0.0.1:%d" % port, "Connection: close",
            "Content-Length: %d" % length]
    head += ["%s: %s" % item for item in headers.items()]
    data = ("\r\n".join(head) + "\r\n\r\n").encode() + body
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError as error:
        return None, {}, str(error).encode(), time.monotonic() - started

    def send():
        try:
            sock.sendall(data)
        except OSError:
            pass  # The server answered and closed early; the answer is what matters.

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    received = b""
    try:
        sock.settimeout(timeout)
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        if b"\r\n\r\n" not in received:
            return None, {}, b"connection closed without an answer", time.monotonic() - started
        header_bytes, rest = received.split(b"\r\n\r\n", 1)
        lines = header_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        answer_headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            answer_headers[name.strip().lower()] = value.strip()
        want = int(answer_headers.get("content-length", "-1"))
        while want < 0 or len(rest) < want:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            rest += chunk
        return status, answer_headers, rest, time.monotonic() - started
    except socket.timeout:
        return None, {}, b"no answer within %.1f s" % timeout, time.monotonic() - started
    except (OSError, ValueError, IndexError) as error:
        return None, {}, ("%s after %r" % (error, received[:80])).encode(), \
            time.monotonic() - started
    finally:
        sock.close()
        sender.join(1.0)


def gateway_code(body):
    try:
        return json.loads(body.decode("utf-8")).get("code", "")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return ""


JSON = {"Content-Type": "application/json"}
BEARER = {"Authorization": "Bearer " + TOKEN}


def http_seen(status, body, took):
    if status != 200:
        heard("HTTP", status, body.decode("utf-8", "replace"))
    if status is None:
        return "no answer (%s)" % body.decode("utf-8", "replace")[:80]
    code = gateway_code(body)
    return "HTTP %d%s %.1fs" % (status, " " + code if code else "", took)


def attack_gateway_amplifier(server, token):
    body = json_format.MessageToJson(amplifier_request()).encode()
    headers = dict(JSON, **(BEARER if token else {}))
    status, _, answer, took = http_exchange(server.http_port, "POST", "/v1/tiled", headers, body)
    seen = http_seen(status, answer, took)
    if token:
        if status not in (429, 400) or gateway_code(answer) != "RESOURCE_EXHAUSTED":
            return seen, "expected HTTP 429 or 400 with code RESOURCE_EXHAUSTED, got %s %r" % (
                status, answer[:200])
        return seen, mentions(answer.decode("utf-8", "replace"), [LIMIT_WORD])
    if status != 401:
        return seen, "expected HTTP 401, got %s %r" % (status, answer[:200])
    return seen, ""


def attack_gateway_forged_length(server, token):
    headers = dict(JSON, **(BEARER if token else {}))
    status, _, answer, took = http_exchange(server.http_port, "POST", "/v1/tiled", headers,
                                            declared_length=10 ** 12, timeout=2.0)
    seen = http_seen(status, answer, took)
    want = 413 if token else 401
    if status != want:
        return seen, "expected HTTP %d within 2 s, got %s %r" % (want, status, answer[:200])
    return seen, ""


def small_tiled_json():
    problem = random_problem(F32)
    return problem, json_format.MessageToJson(problem.request).encode()


def attack_gateway_header(server, headers, want):
    _, body = small_tiled_json()
    status, _, answer, took = http_exchange(server.http_port, "POST", "/v1/tiled",
                                            dict(BEARER, **headers), body)
    seen = http_seen(status, answer, took)
    if status != want:
        return seen, "expected HTTP %d, got %s %r" % (want, status, answer[:200])
    return seen, ""


def control_gateway(server):
    """Not an attack: a valid JSON Tiled answered 200 and correct (so the refusals above are
    the gateway's rules, not a broken route)."""
    problem, body = small_tiled_json()
    status, _, answer, took = http_exchange(server.http_port, "POST", "/v1/tiled",
                                            dict(JSON, **BEARER), body)
    seen = http_seen(status, answer, took)
    if status != 200:
        return seen, "expected HTTP 200, got %s %r" % (status, answer[:200])
    response = json_format.Parse(answer.decode("utf-8"), pb.AttentionResponse(),
                                 ignore_unknown_fields=True)
    return seen, problem.check(response)


# --- Attack 7: a burst of malformed requests among valid ones ----------------------------------

def set_shape(tensor, shape):
    del tensor.shape[:]
    tensor.shape.extend(shape)


def malformed_stateless():
    """(name, method, request): a small valid problem with one thing broken so that the
    contract says INVALID_ARGUMENT."""
    problem = random_problem()
    request = problem.request
    name = str(RNG.choice(["query", "key", "value"]))
    tensor = getattr(request, name)
    needed = len(tensor.data)
    kind = int(RNG.integers(0, 11))
    if kind == 0:  # Random bytes of a wrong length.
        length = needed
        while length == needed:
            length = int(RNG.integers(0, needed + 65))
        tensor.data = RNG.bytes(length)
        what = "%s.data %d random bytes (needs %d)" % (name, length, needed)
    elif kind == 1:  # A negative dimension.
        dims = list(tensor.shape)
        axis = int(RNG.integers(0, len(dims)))
        dims[axis] = -int(RNG.integers(1, 1 << 63))
        set_shape(tensor, dims)
        what = "%s.shape %s" % (name, dims)
    elif kind == 2:  # A huge dimension, the data left small.
        dims = list(tensor.shape)
        axis = int(RNG.integers(0, len(dims)))
        dims[axis] = int(RNG.integers(1 << 40, (1 << 63) - 1))
        set_shape(tensor, dims)
        what = "%s.shape %s" % (name, dims)
    elif kind == 3:  # A zero dimension.
        dims = list(tensor.shape)
        dims[int(RNG.integers(0, len(dims)))] = 0
        set_shape(tensor, dims)
        what = "%s.shape %s" % (name, dims)
    elif kind == 4:  # A wrong rank (0, 1 or 5) with matching data.
        rank = int(RNG.choice([0, 1, 5]))
        dims = {0: [], 1: [needed // ELEMENT_BYTES[tensor.dtype]],
                5: [1] + list(tensor.shape)}[rank]
        set_shape(tensor, dims)
        if rank == 0:
            tensor.data = b""
        what = "%s rank %d" % (name, rank)
    elif kind == 5:  # An unknown dtype.
        tensor.dtype = int(RNG.choice([-1, 4, 5, 99, 1 << 20]))
        what = "%s.dtype %d" % (name, tensor.dtype)
    elif kind == 6:  # A NaN or an infinity.
        bits = (NAN_BITS if RNG.integers(0, 2) else INF_BITS)[tensor.dtype]
        size = ELEMENT_BYTES[tensor.dtype]
        index = int(RNG.integers(0, needed // size))
        data = bytearray(tensor.data)
        data[index * size:(index + 1) * size] = bits.to_bytes(size, "little")
        tensor.data = bytes(data)
        what = "%s element %d non-finite" % (name, index)
    elif kind == 7:  # head_dim of key differs from the query's (consistent data).
        dims = list(request.key.shape)
        dims[3] += 1
        request.key.CopyFrom(random_tensor(dims, request.key.dtype)[0])
        what = "key head_dim %d vs query %d" % (dims[3], request.query.shape[3])
    elif kind == 8:  # A missing tensor.
        request.ClearField(name)
        what = "no %s" % name
    elif kind == 9:  # kv_heads that do not divide heads.
        heads = request.query.shape[1]
        kv = heads + 1
        for field in ("key", "value"):
            dims = list(getattr(request, field).shape)
            dims[1] = kv
            getattr(request, field).CopyFrom(random_tensor(dims, getattr(request, field).dtype)[0])
        what = "kv_heads %d, heads %d" % (kv, heads)
    else:  # A bad option.
        option = int(RNG.integers(0, 3))
        if option == 0:
            request.options.scale = float("nan")
            what = "scale NaN"
        elif option == 1:
            request.options.block_k = -int(RNG.integers(1, 1 << 31))
            what = "block_k %d" % request.options.block_k
        else:
            request.options.output_dtype = int(RNG.choice([7, 42, -3]))
            what = "output_dtype %d" % request.options.output_dtype
    method = str(RNG.choice(["Naive", "Tiled", "Trace"]))
    if method == "Trace":
        request = pb.TraceRequest(attention=request)
    return what, method, request


def malformed_cache(server):
    """(name, method, request) of a malformed call on one of the checked caches (which must
    keep its length and contents)."""
    cache = server.caches[int(RNG.integers(0, len(server.caches)))]
    key, value, _, _ = cache.tokens(int(RNG.integers(1, 4)))
    kind = int(RNG.integers(0, 6))
    if kind == 0:  # Append: random bytes of a wrong length as the key.
        key.data = RNG.bytes(len(key.data) + int(RNG.choice([-1, 1, 7])))
        return ("append %s, key.data wrong length" % cache.label, "AppendCache",
                pb.AppendCacheRequest(cache_id=cache.id, key=key, value=value,
                                      expected_length=cache.length))
    if kind == 1:  # Append: tokens in the other dtype.
        other = F32 if cache.dtype != F32 else BF16
        key = random_tensor(tuple(key.shape), other)[0]
        value = random_tensor(tuple(value.shape), other)[0]
        return ("append %s in the wrong dtype" % cache.label, "AppendCache",
                pb.AppendCacheRequest(cache_id=cache.id, key=key, value=value,
                                      expected_length=cache.length))
    if kind == 2:  # Append: value tokens not matching key tokens.
        dims = list(value.shape)
        dims[1] += 1
        value = random_tensor(dims, cache.dtype)[0]
        return ("append %s, value has one token more" % cache.label, "AppendCache",
                pb.AppendCacheRequest(cache_id=cache.id, key=key, value=value,
                                      expected_length=cache.length))
    if kind == 3:  # Decode with new tokens and a query of the wrong head_dim.
        query = random_tensor((cache.heads, 1, cache.head_dim + 1), cache.dtype)[0]
        item = pb.DecodeItem(cache_id=cache.id, query=query, key=key, value=value,
                             expected_length=cache.length)
        return ("decode %s, query head_dim %d" % (cache.label, cache.head_dim + 1), "Decode",
                pb.DecodeRequest(items=[item]))
    if kind == 4:  # Decode with new tokens whose value data is random bytes, too short.
        value.data = RNG.bytes(max(0, len(value.data) - int(RNG.integers(1, 9))))
        item = pb.DecodeItem(cache_id=cache.id, query=cache.probe, key=key, value=value,
                             expected_length=cache.length)
        return ("decode %s, value.data short" % cache.label, "Decode",
                pb.DecodeRequest(items=[item]))
    # Decode naming the same cache twice, both with new tokens.
    item = pb.DecodeItem(cache_id=cache.id, query=cache.probe, key=key, value=value,
                         expected_length=cache.length)
    return ("decode %s twice in one batch" % cache.label, "Decode",
            pb.DecodeRequest(items=[item, item]))


def attack_burst(server, malformed=200, valid=50):
    jobs = []
    while len(jobs) < malformed + valid:
        if len(jobs) % 5 == 4:  # Every fifth a valid one: a checked problem or a cache probe.
            if RNG.integers(0, 2) and server.caches:
                cache = server.caches[int(RNG.integers(0, len(server.caches)))]
                jobs.append(("valid decode " + cache.label, "Decode", cache.probe_request(),
                             cache))
            else:
                problem = random_problem(return_lse=bool(RNG.integers(0, 2)))
                jobs.append(("valid problem", str(RNG.choice(["Naive", "Tiled"])),
                             problem.request, problem))
        elif RNG.integers(0, 4) == 0 and server.caches:
            jobs.append(malformed_cache(server) + (None,))
        else:
            jobs.append(malformed_stateless() + (None,))

    def run(job):
        what, method, request, expected = job
        if method == "Trace":
            code, details, _ = server.trace(request)
        else:
            code, details, response = server.call(method, request)
        if expected is None:
            return what, code, expect(code, details, INVALID)
        if code != OK:
            return what, code, "got %s (%s)" % (code_name(code), details[:200])
        if isinstance(expected, Cache):
            output = response.outputs[0]
            same = (tuple(output.shape), output.dtype, output.data) == expected.before
            return what, code, "" if same else "Decode output differs from before"
        return what, code, expected.check(response)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, jobs))
    counts, whys = {}, []
    for what, code, why in results:
        counts[code_name(code)] = counts.get(code_name(code), 0) + 1
        if why:
            whys.append("%s: %s" % (what, why))
    seen = " ".join("%s×%d" % item for item in sorted(counts.items()))
    if whys:
        return seen, "%d of %d wrong, e.g. %s" % (len(whys), len(jobs), "; ".join(whys[:4]))
    return seen, ""


# --- Running ----------------------------------------------------------------------------------

def attacks():
    """(group, name, function(server) → (status seen, why or ''))."""
    def status_of(function):
        def run(server):
            code, why = function(server)
            return code_name(code), why
        return run

    big = 900000
    return [
        ("1", "Tiled q[65536,1] v[1,900000]: 236 GB output",
         status_of(lambda s: attack_amplifier(s, "Tiled"))),
        ("1", "Naive, the same", status_of(lambda s: attack_amplifier(s, "Naive"))),
        ("1", "Tiled, the same with return_lse",
         status_of(lambda s: attack_amplifier(s, "Tiled", True))),
        ("2", "Tiled over dv65536 cache, q[1,900000,1]: 236 GB",
         status_of(lambda s: attack_cache_tiled(s, big))),
        ("2", "Tiled over dv65536 cache, q[2,24,1]: 12.6 MB",
         status_of(lambda s: attack_cache_tiled(s, 24, heads=2))),
        ("2", "Decode dv65536 cache +1 token, q[1,24,1]: 6.3 MB",
         status_of(lambda s: attack_cache_decode(s, 24))),
        ("2", "Decode dv65536 cache +1 token, q[1,900000,1]",
         status_of(lambda s: attack_cache_decode(s, big))),
        ("2", "Decode batch of 3 (+1 token each), 4.9 MB summed",
         status_of(attack_decode_sum)),
        ("3", "--max-caches 8: a 9th, then after a delete", attack_max_caches),
        ("4", "2 unread Trace streams, --trace-idle-seconds 2", attack_idle_traces),
        ("5", "12 concurrent 3.4 MB Tiled, --max-inflight-bytes", attack_inflight),
        ("6", "HTTP /v1/tiled attack-1 JSON, token",
         lambda s: attack_gateway_amplifier(s, True)),
        ("6", "HTTP /v1/tiled attack-1 JSON, no token",
         lambda s: attack_gateway_amplifier(s, False)),
        ("6", "HTTP forged Content-Length 10^12, no token",
         lambda s: attack_gateway_forged_length(s, False)),
        ("6", "HTTP forged Content-Length 10^12, token",
         lambda s: attack_gateway_forged_length(s, True)),
        ("6", "HTTP Content-Type: text/plain",
         lambda s: attack_gateway_header(s, {"Content-Type": "text/plain"}, 415)),
        ("6", "HTTP X-Timeout-Ms: -5",
         lambda s: attack_gateway_header(s, dict(JSON, **{"X-Timeout-Ms": "-5"}), 400)),
        ("6", "HTTP valid JSON Tiled (control)", control_gateway),
        ("7", "burst: 200 malformed among 50 valid", attack_burst),
    ]


def boot(server, start):
    """'' once `start` (server.start or server.restart) has attnd serving with its caches, else
    why not (printed)."""
    try:
        start()
        return ""
    except (RuntimeError, grpc.RpcError, grpc.FutureTimeoutError) as error:
        text = str(error) if not isinstance(error, grpc.RpcError) else "%s %s" % (
            code_name(error.code()), error.details())
        print("FAIL: attnd did not start with its caches: %s" % text[-2000:])
        return "attnd did not start"


def main():
    started = time.monotonic()
    only = set(filter(None, ARGS.only.split(",")))
    workdir = tempfile.mkdtemp(prefix="attnd_attack_")
    token_file = os.path.join(workdir, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN + "\n")
    server = Server(token_file)
    if server.missing_flags:
        print("note: %s has no --%s; started without (the attacks on them fail)"
              % (ARGS.attnd, ", --".join(server.missing_flags)))
    passed = failed = 0
    table = [attack for attack in attacks() if not only or attack[0] in only]
    width = max(len(name) for _, name, _ in table) + 5
    not_run = ""  # Why the remaining attacks cannot run.
    try:
        not_run = boot(server, server.start)
        print("%-*s %-40s %s" % (width, "attack", "status seen", "result"))
        for group, name, function in table:
            if not not_run and server.starts > MAX_RESTARTS:
                not_run = "attnd was started %d times" % server.starts
            if not_run:
                print("%-*s %-40s FAIL: not run: %s" % (width, group + "  " + name, "-", not_run))
                failed += 1
                continue
            del HEARD[:]
            try:
                seen, why = function(server)
            except Exception as error:  # noqa: BLE001 (a broken attack must not hide the rest)
                seen, why = "-", "the attack raised %s: %s" % (type(error).__name__, error)
            state = server.check_state()
            if state:
                why = (why + "; " if why else "") + "after: " + state
            print("%-*s %-40s %s" % (width, group + "  " + name, seen,
                                      "PASS" if not why else "FAIL: " + why))
            for line in sorted(set(HEARD))[:6]:
                print("       %s" % line)
            del HEARD[:]
            sys.stdout.flush()
            if why:
                failed += 1
            else:
                passed += 1
            if state and (state.startswith("DIED") or "does not answer" in state
                          or not server.rebaseline()):
                not_run = boot(server, server.restart)
                if not not_run:
                    print("     (a fresh attnd and fresh caches for the next attacks)")
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print("runtime %.1f s, attnd started %d times, largest RSS seen %d MiB"
          % (time.monotonic() - started, server.starts, server.max_rss_kib // 1024))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
