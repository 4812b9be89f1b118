#!/usr/bin/python3
"""The Python client's decode step against the C++ client's, on one attnd: issue 32's Python
target (attn_client's Cache.decode ≤ the C++ client's wall + 300 µs on the same step).

Starts attnd (--threads 2 unless --attnd-flag says otherwise) on a free loopback port and runs
--rounds rounds, each of the C++ client (`attn bench --decode --lengths L --batches 1 --steps N
--repeats 0`, its wall − compute p50 read from the table it prints) and then of the Python
client on a cache of its own of the same shape (32 query heads over 8 kv heads, d 128, bf16 by
default), filled with L tokens. A Python step is what a caller writes: one
`cache.decode(q, k, v, causal=True)` with float32 NumPy q [heads, 1, d], k, v [kv_heads, 1, d]
(the client rounds k and v to the cache's dtype), one new token per step, as attn bench's steps.

Printed per round, µs, p50 over the steps:
  Cache.decode   wall − compute of the whole call (the ExecutionStats' compute_ns)
  raw stub       wall − compute of the generated stub's Decode on a request built beforehand:
                 gRPC Python's own round trip, without the client's work
  client work    Cache.decode's p50 wall − the raw stub's (encoding q, k, v, building the
                 request, reading the answer, the Cache's bookkeeping)
  floor          a GetServerInfo round trip through the generated stub
and the target line. Not a test (tests/CMakeLists.txt runs it once, --quick, to keep it
working): it exits 0 when the run completes, whether or not the target is met. Run with
/usr/bin/python3 (Debian's python3-grpcio and python3-numpy); about 10 s.

  tests/bench/python_decode.py [--length 4096] [--steps 200] [--rounds 2] [--quick]
      [--attnd build/release/attnd] [--attn build/release/attn] [--stubs build/release/python]
      [--attnd-flag=--threads=2 ...]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import attnd_harness as h  # noqa: E402  (tests/python, for AttndProcess and the stubs' path)

TARGET_US = 300  # Issue 32: Cache.decode's wall ≤ the C++ client's wall + 300 µs.


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    build = os.path.join(h.REPO_ROOT, "build", "release")
    parser.add_argument("--attnd", default=os.path.join(build, "attnd"))
    parser.add_argument("--attn", default=os.path.join(build, "attn"))
    parser.add_argument("--stubs", default=os.path.join(build, "python"))
    parser.add_argument("--length", type=int, default=4096, help="cached tokens before the steps")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round and client")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heads", default="32x8", help="query heads x kv heads")
    parser.add_argument("--dim", type=int, default=128, help="head_dim = value_dim")
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16", "fp8"))
    parser.add_argument("--attnd-flag", action="append", default=None,
                        help="an attnd flag (repeatable; default --threads=2)")
    parser.add_argument("--quick", action="store_true",
                        help="64 tokens, 5 steps, 1 round: a smoke run of seconds")
    args = parser.parse_args()
    if args.quick:
        args.length, args.steps, args.rounds = 64, 5, 1
    if args.length < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--length, --steps and --rounds must be ≥ 1")
    match = re.fullmatch(r"(\d+)x(\d+)", args.heads)
    if not match or int(match.group(2)) < 1 or int(match.group(1)) % int(match.group(2)):
        parser.error("--heads must be QxKV with Q a multiple of KV ≥ 1, e.g. 32x8")
    args.query_heads, args.kv_heads = int(match.group(1)), int(match.group(2))
    if args.attnd_flag is None:
        args.attnd_flag = ["--threads=2"]
    h.add_stubs_path(args.stubs)
    return args


def cpp_round(args, address):
    """attn bench --decode over one sequence → its wall − compute p50, µs (from its table)."""
    dtype = {"fp32": "f32", "fp16": "f16"}.get(args.dtype, args.dtype)  # attn's names.
    command = [args.attn, "bench", "--decode", "--target", address,
               "--lengths", str(args.length), "--batches", "1", "--steps", str(args.steps),
               "--repeats", "0", "--dtype", dtype, "--heads=%d" % args.query_heads,
               "--kv-heads=%d" % args.kv_heads, "--head-dim=%d" % args.dim]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
                          check=False)
    text = done.stdout.decode("utf-8", "replace")
    # The row of "where wall − compute goes": B, cached, wall, compute, wall−comp, ... (µs).
    row = re.search(r"^\s*1\s+%d\s+(\d+) µs\s+(\d+) µs\s+(\d+) µs" % args.length, text, re.M)
    if done.returncode != 0 or row is None:
        sys.exit("python_decode.py: attn bench --decode failed or printed no stage row "
                 "(exit %d):\n%s" % (done.returncode, text))
    return int(row.group(3))


def python_round(args, client, pb):
    """The Python client's steps on a fresh cache → {"decode", "raw", "floor"}: p50 µs."""
    import attn_client
    import numpy as np
    rng = np.random.default_rng()
    width = (args.kv_heads, args.length, args.dim)
    cache = client.create_cache(args.kv_heads, args.dim, dtype=args.dtype)
    try:
        cache.append(rng.uniform(-1, 1, width).astype(np.float32),
                     rng.uniform(-1, 1, width).astype(np.float32))

        def step_inputs():
            return (rng.uniform(-1, 1, (args.query_heads, 1, args.dim)).astype(np.float32),
                    rng.uniform(-1, 1, (args.kv_heads, 1, args.dim)).astype(np.float32),
                    rng.uniform(-1, 1, (args.kv_heads, 1, args.dim)).astype(np.float32))

        decode = []
        for index in range(args.steps + 1):  # The first is a warm-up.
            q, k, v = step_inputs()
            start = time.perf_counter_ns()
            result = cache.decode(q, k, v, causal=True)
            wall = time.perf_counter_ns() - start
            if index > 0:
                decode.append(wall - result.stats["compute_ns"])

        # The same steps through the generated stub, each request built before its clock starts.
        raw = []
        length = cache.length
        token_dtype = pb.DTYPE_FLOAT32 if args.dtype in ("fp32", "fp8") else \
            pb.DTYPE_FLOAT16 if args.dtype == "fp16" else pb.DTYPE_BFLOAT16
        for index in range(args.steps + 1):
            q, k, v = step_inputs()
            request = pb.DecodeRequest(options=pb.AttentionOptions(causal=True))
            item = request.items.add(cache_id=cache.id, expected_length=length)
            # The client's own encoding, outside the clock.
            attn_client._encode("query", q, pb.DTYPE_FLOAT32, into=item.query)
            attn_client._encode("key", k, token_dtype, into=item.key)
            attn_client._encode("value", v, token_dtype, into=item.value)
            start = time.perf_counter_ns()
            response = client._stub.Decode(request)
            wall = time.perf_counter_ns() - start
            length += 1
            if index > 0:
                raw.append(wall - response.stats.compute_ns)

        floor = []
        for _ in range(args.steps):
            start = time.perf_counter_ns()
            client._stub.GetServerInfo(pb.GetServerInfoRequest())
            floor.append(time.perf_counter_ns() - start)
    finally:
        cache.delete()
    return {name: statistics.median(samples) / 1e3
            for name, samples in (("decode", decode), ("raw", raw), ("floor", floor))}


def main():
    args = arguments()
    from attention.v1 import attention_pb2 as pb
    import attn_client
    server = h.AttndProcess(args.attnd, args.attnd_flag)
    try:
        client = attn_client.Client(server.address)
        info = client.info()
        print("python_decode.py: one sequence of %d cached tokens, %d query heads over %d kv "
              "heads, d %d, %s cache; %d steps per round and client, 1 new token each"
              % (args.length, args.query_heads, args.kv_heads, args.dim, args.dtype, args.steps))
        print("server: attnd %s on %s, %s, at %s (%s)"
              % (info.get("version", "?"), info.get("device", "?"),
                 info.get("backend", "?"), server.address, " ".join(args.attnd_flag)))
        print("µs, p50 of each part:")
        print("%5s  %16s  %16s  %8s  %11s  %6s  %13s"
              % ("round", "C++ wall−compute", "Cache.decode w−c", "raw stub", "client work",
                 "floor", "Python − C++"))
        gaps = []
        for index in range(args.rounds):
            cpp = cpp_round(args, server.address)
            python = python_round(args, client, pb)
            gap = python["decode"] - cpp
            gaps.append(gap)
            print("%5d  %16.0f  %16.0f  %8.0f  %11.0f  %6.0f  %+13.0f"
                  % (index + 1, cpp, python["decode"], python["raw"],
                     python["decode"] - python["raw"], python["floor"], gap))
        worst = max(gaps)
        print("target (issue 32): Cache.decode wall ≤ the C++ client's wall + %d µs: worst round "
              "+%.0f µs: %s" % (TARGET_US, worst, "met" if worst <= TARGET_US else "MISSED"))
        client.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
