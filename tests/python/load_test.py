#!/usr/bin/python3
"""Load test: 32 concurrent clients of mixed Naive/Tiled/Trace calls against one attnd.

Starts its own attnd on a free loopback port with a small admission window (--max-inflight 2
--max-queue 4 by default, so that 32 clients overrun it and admission refusals happen), then for
--seconds (default 30) runs --clients (default 32) threads. Each thread has its OWN channel and
TCP connection (grpc.use_local_subchannel_pool, so gRPC does not share one connection among
them), and loops: draw a random problem (batch 1–2, heads 1–4 with grouped-query key/value
heads sometimes, query/key lengths 1–300 drawn log-uniformly, head/value dims 8–64 including
odd ones, ranks 2–4, f32/f16/bf16 inputs and outputs, causal or not, random block_k, lse
sometimes), call Naive, Tiled or Trace, and check the answer against a float64 numpy reference:
  - Naive/Tiled: the output with the dtype's tolerance (attnd_harness.output_error: fp32 relative
    error ≤ 1e-5; f16/bf16 one output ulp per element + the fp32 budget), lse when asked for;
  - Trace: the event sequence (start, per row one step per visited tile in order and a row_done,
    end with the right counts), the running max never decreasing, each row's final output equal
    to its last step's estimate and to the reference row, the row's lse.
The only error allowed is RESOURCE_EXHAUSTED from admission ("server busy"). attnd's VmRSS is
sampled every 0.5 s and must not grow past its start by more than --rss-growth-bound-mib (default
256 MiB; see RSS_GROWTH_BOUND_MIB).

At the end prints requests/s, p50/p99 latency per method, errors by code and peak RSS; exits 1 on
any wrong answer, unexpected error, RSS over the bound, or a server that is no longer healthy.

  /usr/bin/python3 tests/python/load_test.py --attnd <attnd> --stubs <stubs dir> [--seconds 30]

Needs python3-grpcio and python3-numpy (Debian). Loopback only; bounded by --seconds (each call
has a 60 s deadline) and by --max-requests.
"""

import collections
import math
import os
import sys
import threading
import time
import traceback


# The RSS bound, on growth: what attnd holds at start depends on the build (a CUDA build has
# touched ~150 MiB of its libraries before the first call), what queueing, buffering and leaks
# move is the growth. On the 2-core development VM (Debian 12, CPU backend, --threads 1) attnd's
# VmRSS under this load grows by ~70–75 MiB (19 → 94 MiB in a CPU-only build; 175 → 288 MiB in
# the CUDA build without a GPU, before Naive's products left OpenBLAS for the project's kernels
# and attnd stopped linking OpenBLAS: the growth in the CPU-only build stayed the same). The
# arithmetic worst case of the requests is ~100 MiB: the largest here is ~1.8 MiB (f32 B2 H4
# N300 d64 ×3), 32 of them can sit in the server at once, plus Naive's kept 5.8 MiB matrices.
# 256 MiB (the old bound on the whole RSS, now on its growth: the ASan build's quarantine, up to
# 64 MiB, counts in it too) is ~2.3× the largest growth seen: it catches unbounded queueing or
# buffering and a leak of ≥ ~40 KiB per call (~7,000 calls a run), while leaving room for
# allocator behaviour.
RSS_GROWTH_BOUND_MIB = 256


import attnd_harness as h  # noqa: E402 (tests/python is sys.path[0] for a script)


def add_arguments(parser):
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the clients send")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument("--max-requests", type=int, default=200000, help="stop after this many")
    parser.add_argument("--max-inflight", type=int, default=2, help="attnd --max-inflight")
    parser.add_argument("--max-queue", type=int, default=4, help="attnd --max-queue")
    parser.add_argument("--max-traces", type=int, default=4, help="attnd --max-traces")
    parser.add_argument("--threads", type=int, default=1, help="attnd --threads (per computation)")
    parser.add_argument("--rss-growth-bound-mib", type=float, default=RSS_GROWTH_BOUND_MIB)
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: time)")


ARGS = h.parse_args(__doc__, add_arguments)

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from attention.v1 import attention_pb2 as pb  # noqa: E402
from attention.v1 import attention_pb2_grpc as pb_grpc  # noqa: E402

RPC_TIMEOUT_S = 60.0
DTYPES = (pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT16, pb.DTYPE_BFLOAT16)
METHODS = ("Naive", "Tiled", "Trace")
METHOD_WEIGHTS = (0.4, 0.4, 0.2)


# --- Random problems ----------------------------------------------------------------------------

class RandomProblem:
    """A random valid request, the float64 inputs the server will see, and the reference."""

    def __init__(self, rng, for_trace):
        batch = int(rng.integers(1, 3))
        heads = int(rng.choice([1, 2, 3, 4]))
        divisors = [g for g in range(1, heads + 1) if heads % g == 0]
        kv_heads = heads if rng.random() < 0.5 else int(rng.choice(divisors))
        rank = int(rng.choice([2, 3, 4])) if (batch == 1 and kv_heads == heads == 1) else \
            (3 if batch == 1 and rng.random() < 0.3 else 4)
        query_len = int(round(math.exp(rng.uniform(0, math.log(300)))))
        key_len = query_len if rng.random() < 0.4 else \
            int(round(math.exp(rng.uniform(0, math.log(300)))))
        head_dim = int(rng.integers(8, 65))
        value_dim = head_dim if rng.random() < 0.6 else int(rng.integers(8, 65))
        dtype = int(rng.choice(DTYPES))
        key_dtype = dtype if rng.random() < 0.85 else int(rng.choice(DTYPES))
        output_dtype = 0 if rng.random() < 0.7 else int(rng.choice(DTYPES))
        causal = bool(rng.random() < 0.5)
        block_k = 0 if rng.random() < 0.3 else int(rng.integers(1, 129))
        if for_trace:  # At most ~48 steps per row, so streams stay a few hundred events.
            block_k = max(block_k or 1, -(-key_len // 48))
        options = dict(causal=causal, block_k=block_k, return_lse=bool(rng.random() < 0.5),
                       output_dtype=output_dtype)
        scale = None
        if rng.random() < 0.2:
            scale = float(np.float32(rng.uniform(0.05, 1.0)))
            options["scale"] = scale
        spread = float(rng.choice([1.0, 1.0, 3.0]))  # Sometimes peaky softmax rows.

        shapes = {"query": (batch, heads, query_len, head_dim),
                  "key": (batch, kv_heads, key_len, head_dim),
                  "value": (batch, kv_heads, key_len, value_dim)}
        dtypes = {"query": dtype, "key": key_dtype, "value": key_dtype}
        self.request = pb.AttentionRequest(options=pb.AttentionOptions(**options))
        seen = {}
        for name, shape in shapes.items():
            array = rng.uniform(-spread, spread, size=shape).astype(np.float32)
            tensor, seen[name] = h.encode(array.reshape(shape[4 - rank:]), dtypes[name])
            seen[name] = seen[name].reshape(shape)
            getattr(self.request, name).CopyFrom(tensor)
        self.rank = rank
        self.shape = dict(batch=batch, heads=heads, kv_heads=kv_heads, query_len=query_len,
                          key_len=key_len, head_dim=head_dim, value_dim=value_dim)
        self.output_dtype = output_dtype or dtype
        self.causal = causal
        self.return_lse = options["return_lse"]
        self.block_k = min(block_k, key_len) if block_k else None  # None: server default.
        self.scale = scale if scale is not None else float(np.float32(1.0 / math.sqrt(head_dim)))
        self._seen = seen
        self._reference = None

    def reference(self):
        """(out [B, H, Nq, dv], lse [B, H, Nq]) in float64, computed once."""
        if self._reference is None:
            out, lse, self.score_max = h.reference_attention(
                self._seen["query"], self._seen["key"], self._seen["value"], scale=self.scale,
                causal=self.causal)
            self._reference = (out, lse)
        return self._reference

    def visible_keys(self, row):
        s = self.shape
        if not self.causal:
            return s["key_len"]
        return min(max(row + s["key_len"] - s["query_len"] + 1, 0), s["key_len"])

    def describe(self):
        s = self.shape
        return ("B%d H%d/%d Nq%d Nk%d d%d dv%d %s->%s rank%d causal=%d block_k=%s"
                % (s["batch"], s["heads"], s["kv_heads"], s["query_len"], s["key_len"],
                   s["head_dim"], s["value_dim"], h.DTYPE_NAMES[self.request.query.dtype],
                   h.DTYPE_NAMES[self.output_dtype], self.rank, self.causal, self.block_k))


# --- Checks -------------------------------------------------------------------------------------

# The worst output error seen, as a fraction of its bound, per output dtype (the margin).
WORST_RATIO = collections.defaultdict(float)


def output_error(out, ref, output_dtype, score_max, magnitude=None):
    ratio = h.output_error_ratio(out, ref, output_dtype, score_max, magnitude)
    WORST_RATIO[output_dtype] = max(WORST_RATIO[output_dtype], ratio)  # GIL: races only lose
    return h.output_error(out, ref, output_dtype, score_max, magnitude) if ratio > 1 else ""


def check_unary(problem, response):
    """'' when a Naive/Tiled response is right, else what is wrong."""
    s = problem.shape
    out_ref, lse_ref = problem.reference()
    expected_shape = [s["batch"], s["heads"], s["query_len"], s["value_dim"]][4 - problem.rank:]
    if list(response.output.shape) != expected_shape:
        return "output shape %s, expected %s" % (list(response.output.shape), expected_shape)
    if response.output.dtype != problem.output_dtype:
        return "output dtype %d, expected %d" % (response.output.dtype, problem.output_dtype)
    error = output_error(h.decode(response.output).reshape(out_ref.shape), out_ref,
                         problem.output_dtype, problem.score_max)
    if error:
        return error
    if problem.return_lse:
        if response.lse.dtype != pb.DTYPE_FLOAT32:
            return "lse dtype %d" % response.lse.dtype
        error = h.lse_error(h.decode(response.lse).reshape(lse_ref.shape), lse_ref)
        if error:
            return error
    elif response.HasField("lse") and response.lse.data:
        return "lse returned without return_lse"
    return ""


def trace_rows(rng, problem):
    s = problem.shape
    count = int(rng.integers(1, 4))
    return [(int(rng.integers(0, s["batch"])), int(rng.integers(0, s["heads"])),
             int(rng.integers(0, s["query_len"]))) for _ in range(count)]


def check_trace(problem, rows, events):
    """'' when a Trace stream is consistent and its rows match the reference."""
    s = problem.shape
    out_ref, lse_ref = problem.reference()
    magnitude = float(np.max(np.abs(out_ref)))  # Rows are judged against the whole output's.
    if len(events) < 2 or not events[0].HasField("start") or not events[-1].HasField("end"):
        return "stream does not run start … end (%d events)" % len(events)
    start = events[0].start
    got = (start.batch, start.heads, start.kv_heads, start.query_len, start.key_len,
           start.head_dim, start.value_dim, start.causal)
    want = (s["batch"], s["heads"], s["kv_heads"], s["query_len"], s["key_len"], s["head_dim"],
            s["value_dim"], problem.causal)
    if got != want:
        return "start %s, expected %s" % (got, want)
    block_k = start.block_k
    if block_k < 1 or (problem.block_k is not None and block_k != problem.block_k):
        return "start.block_k %d, asked for %s" % (block_k, problem.block_k)
    position = 1
    steps = 0
    for batch, head, row in rows:
        visited = -(-problem.visible_keys(row) // block_k)
        max_so_far = -math.inf
        last_estimate = None
        for tile in range(visited):
            event = events[position] if position < len(events) else None
            if event is None or not event.HasField("step"):
                return "row %s: expected step %d of %d" % ((batch, head, row), tile, visited)
            step = event.step
            position += 1
            steps += 1
            if (step.row.batch, step.row.head, step.row.row) != (batch, head, row) or \
                    step.tile != tile or step.key_begin != tile * block_k or \
                    step.key_end != min((tile + 1) * block_k, s["key_len"]):
                return "row %s tile %d: step is for %s tile %d keys [%d, %d)" % (
                    (batch, head, row), tile, (step.row.batch, step.row.head, step.row.row),
                    step.tile, step.key_begin, step.key_end)
            if step.max_before != max_so_far or step.max_after < step.max_before:
                return "row %s tile %d: running max %r → %r after %r" % (
                    (batch, head, row), tile, step.max_before, step.max_after, max_so_far)
            max_so_far = step.max_after
            if len(step.estimate) != s["value_dim"] or not math.isfinite(step.denominator):
                return "row %s tile %d: estimate of %d, denominator %r" % (
                    (batch, head, row), tile, len(step.estimate), step.denominator)
            last_estimate = np.array(step.estimate, dtype=np.float64)
        event = events[position] if position < len(events) else None
        if event is None or not event.HasField("row_done"):
            return "row %s: no row_done after %d steps" % ((batch, head, row), visited)
        position += 1
        done = event.row_done
        output = np.array(done.output, dtype=np.float64)
        expected = out_ref[batch, head, row]
        error = output_error(output, expected, pb.DTYPE_FLOAT32, problem.score_max, magnitude) \
            or output_error(np.array(done.reference, dtype=np.float64), expected,
                            pb.DTYPE_FLOAT32, problem.score_max, magnitude)
        if error:
            return "row %s: %s" % ((batch, head, row), error)
        if last_estimate is not None and h.output_error(last_estimate, output, pb.DTYPE_FLOAT32,
                                                        problem.score_max, magnitude):
            return "row %s: final output differs from the last step's estimate" % (
                (batch, head, row),)
        error = h.lse_error(np.array([done.lse], dtype=np.float64),
                            np.array([lse_ref[batch, head, row]]))
        if error:
            return "row %s: %s" % ((batch, head, row), error)
    if position != len(events) - 1:
        return "%d events after the last row_done" % (len(events) - 1 - position)
    end = events[-1].end
    if end.rows != len(rows) or end.steps != steps:
        return "end rows %d steps %d, expected %d and %d" % (end.rows, end.steps, len(rows), steps)
    return ""


# --- Clients ------------------------------------------------------------------------------------

class Tally:
    """Counts shared by the client threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies = collections.defaultdict(list)  # method → seconds of OK calls
        self.errors = collections.Counter()  # (method, code name) → count
        self.failures = []  # (method, problem, what) of wrong answers and unexpected errors
        self.requests = 0

    def take_ticket(self):
        with self.lock:
            if self.requests >= ARGS.max_requests:
                return False
            self.requests += 1
            return True

    def fail(self, method, problem, what):
        with self.lock:
            self.failures.append((method, problem, what))


def client(index, address, stop_at, seed, tally):
    rng = np.random.default_rng([seed, index])
    try:
        channel = h.open_channel(address, own_connection=True)
    except Exception as error:  # noqa: BLE001
        tally.fail("connect", "client %d" % index, repr(error))
        return
    stub = pb_grpc.AttentionServiceStub(channel)
    try:
        while time.monotonic() < stop_at and tally.take_ticket():
            method = str(rng.choice(METHODS, p=METHOD_WEIGHTS))
            problem = RandomProblem(rng, for_trace=method == "Trace")
            rows = trace_rows(rng, problem) if method == "Trace" else None
            began = time.perf_counter()
            try:
                if method == "Trace":
                    request = pb.TraceRequest(attention=problem.request, rows=[
                        pb.RowRef(batch=b, head=hd, row=r) for b, hd, r in rows])
                    result = list(stub.Trace(request, timeout=RPC_TIMEOUT_S))
                else:
                    result = getattr(stub, method)(problem.request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as error:
                code = error.code()
                with tally.lock:
                    tally.errors[(method, code.name)] += 1
                # Naive/Tiled: --max-queue; Trace: --max-traces.
                admission = (code == grpc.StatusCode.RESOURCE_EXHAUSTED
                             and "server busy" in (error.details() or ""))
                if not admission:
                    tally.fail(method, problem.describe(),
                               "%s: %s" % (code.name, error.details()))
                continue
            elapsed = time.perf_counter() - began
            with tally.lock:
                tally.latencies[method].append(elapsed)
            why = check_trace(problem, rows, result) if method == "Trace" else \
                check_unary(problem, result)
            if why:
                tally.fail(method, problem.describe() + (" rows %s" % rows if rows else ""), why)
    except Exception:  # noqa: BLE001  A bug here must fail the test, not vanish with the thread.
        tally.fail("client %d" % index, "", traceback.format_exc())
    finally:
        channel.close()


# --- Main ---------------------------------------------------------------------------------------

def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(fraction * len(ordered))) - 1)]


def main():
    seed = ARGS.seed if ARGS.seed is not None else int(time.time())
    server = h.AttndProcess(ARGS.attnd, [
        "--threads", str(ARGS.threads), "--max-inflight", str(ARGS.max_inflight),
        "--max-traces", str(ARGS.max_traces),
        "--max-queue", str(ARGS.max_queue), "--log-level", "error"])
    print("attnd pid %d on %s: %s" % (server.pid, server.address, " ".join(server.args[1:])))
    print("%d clients (one channel and TCP connection each) for %.0f s, seed %d, %d CPUs"
          % (ARGS.clients, ARGS.seconds, seed, os.cpu_count()))
    tally = Tally()
    rss = {"peak_kib": server.rss_kib() or 0, "start_kib": server.rss_kib() or 0, "samples": 0}
    sampling = threading.Event()

    def sample_rss():
        while not sampling.wait(0.5):
            value = server.rss_kib()
            if value is not None:
                rss["peak_kib"] = max(rss["peak_kib"], value)
                rss["samples"] += 1

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    failures = []
    try:
        began = time.monotonic()
        stop_at = began + ARGS.seconds
        threads = [threading.Thread(target=client, args=(i, server.address, stop_at, seed, tally))
                   for i in range(ARGS.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - began
        sampling.set()
        sampler.join()
        final_rss = server.rss_kib()

        healthy = False
        if server.alive():
            channel = h.open_channel(server.address)
            healthy = h.health_status(channel) == h.HEALTH_SERVING
            channel.close()
        if not healthy:
            failures.append("attnd is not healthy after the load (alive: %s)" % server.alive())
    finally:
        sampling.set()
        server.stop()
        stderr = server.stderr()
        server.close()

    ok_calls = sum(len(v) for v in tally.latencies.values())
    errors = sum(tally.errors.values())
    print("\n%d calls in %.1f s: %.1f requests/s (%.1f OK/s), %d OK, %d refused or failed"
          % (ok_calls + errors, elapsed, (ok_calls + errors) / elapsed, ok_calls / elapsed,
             ok_calls, errors))
    print("%-6s %7s %9s %9s %9s" % ("method", "OK", "p50 ms", "p99 ms", "max ms"))
    for method in METHODS:
        values = tally.latencies.get(method, [])
        if values:
            print("%-6s %7d %9.1f %9.1f %9.1f" % (method, len(values), 1e3 * percentile(values, .5),
                                                  1e3 * percentile(values, .99),
                                                  1e3 * max(values)))
        else:
            print("%-6s %7d" % (method, 0))
    by_code = collections.Counter()
    for (method, code), count in tally.errors.items():
        by_code[code] += count
    print("errors by code: %s" % (", ".join("%s %d" % item for item in sorted(by_code.items()))
                                  or "none"))
    print("errors by method: %s" % (", ".join("%s/%s %d" % (m, c, n) for (m, c), n in
                                              sorted(tally.errors.items())) or "none"))
    print("worst output error / tolerance: %s" % ", ".join(
        "%s %.2f" % (h.DTYPE_NAMES[d], r) for d, r in sorted(WORST_RATIO.items())))
    growth_kib = rss["peak_kib"] - rss["start_kib"]
    print("attnd VmRSS: start %.1f MiB, peak %.1f MiB (growth %.1f MiB), end %s MiB (%d samples "
          "at 0.5 s); growth bound %.0f MiB"
          % (rss["start_kib"] / 1024, rss["peak_kib"] / 1024, growth_kib / 1024,
             "%.1f" % (final_rss / 1024) if final_rss else "?", rss["samples"],
             ARGS.rss_growth_bound_mib))

    if growth_kib > ARGS.rss_growth_bound_mib * 1024:
        failures.append("RSS grew by %.1f MiB (%.1f → %.1f MiB), over the bound %.0f MiB"
                        % (growth_kib / 1024, rss["start_kib"] / 1024, rss["peak_kib"] / 1024,
                           ARGS.rss_growth_bound_mib))
    if ok_calls == 0:
        failures.append("no call succeeded")
    for method in METHODS:
        if not tally.latencies.get(method):
            failures.append("no %s call succeeded" % method)
    for method, problem, what in tally.failures[:20]:
        failures.append("%s %s: %s" % (method, problem, what))
    if len(tally.failures) > 20:
        failures.append("... and %d more wrong answers or unexpected errors"
                        % (len(tally.failures) - 20))
    if failures:
        sys.stderr.write("--- attnd stderr (tail) ---\n%s\n" % stderr[-4000:])
        for failure in failures:
            print("FAILED: %s" % failure)
        return 1
    print("PASS: every answer matched the float64 reference; only admission refusals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
