#!/usr/bin/python3
"""NumPy's eager attention (matmul, softmax, matmul) in float32: the baseline column of
tests/bench/run.sh.

Times the same problems as attention_bench's fp32 rows: B = 1, H heads, N queries and keys,
head and value width d, scale 1/sqrt(d), inputs uniform(-1, 1), causal rows masked bottom-right
(with N = N that is the upper triangle above the diagonal). Everything is float32; the two
matmuls go through NumPy's BLAS (Debian's python3-numpy: the system OpenBLAS, via libblas.so.3).
Each problem runs once untimed, then at least --reps times (more while under --min-seconds);
the median is reported.

Shapes come from the benchmark's JSON (--bench-json: its fp32 rows that ran, N <= --max-n) or
from --shape N,H,d,causal (repeatable). Writes one JSON object to --out (default stdout):
  {"numpy": version, "blas": {"library", "corename", "config", "threads", "coretype"},
   "threads": T,
   "rows": [{"N", "H", "d", "causal", "reps", "median_s", "min_s", "gflops"}]}
gflops counts 4*H*N*N*d, halved when causal, as the benchmark does.

Run it with /usr/bin/python3 (the interpreter that has python3-numpy). OpenBLAS picks its
kernels as it loads, from the CPU model or OPENBLAS_CORETYPE; Debian's 0.3.21 may not know a new
CPU and fall back to old kernels, so run.sh runs this script under every core type the CPU's
flags allow (one process each) and takes the best; "blas" reports the core that ran
(openblas_get_corename) and OPENBLAS_CORETYPE as given.
"""

import argparse
import ctypes
import json
import os
import re
import statistics
import sys
import time

import numpy as np


def blas_info():
    """The BLAS library NumPy mapped into this process, and what OpenBLAS says of itself."""
    info = {"library": None, "corename": None, "config": None, "threads": None}
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return info, None
    candidates = sorted(p for p in paths if re.search(r"(open)?blas", os.path.basename(p)))
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if not hasattr(lib, "openblas_get_corename"):
            continue
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_config.restype = ctypes.c_char_p
        info["library"] = os.path.realpath(path)
        info["corename"] = lib.openblas_get_corename().decode()
        info["config"] = lib.openblas_get_config().decode()
        info["threads"] = lib.openblas_get_num_threads()
        return info, lib
    if candidates:
        info["library"] = os.path.realpath(candidates[0])
    return info, None


def attention(q, k, v, scale, mask):
    """softmax(q kᵀ · scale + mask) v, in float32, as an eager framework computes it."""
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    s *= scale
    if mask is not None:
        s += mask
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v)


def time_problem(n, heads, d, causal, reps, min_seconds, seed):
    rng = np.random.default_rng(seed)
    shape = (1, heads, n, d)
    q, k, v = (rng.uniform(-1.0, 1.0, shape).astype(np.float32) for _ in range(3))
    scale = np.float32(1.0 / np.sqrt(d))
    mask = None
    if causal:
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
    out = attention(q, k, v, scale, mask)  # Warm-up, and the checks below.
    assert out.dtype == np.float32 and out.shape == (1, heads, n, d), (out.dtype, out.shape)
    assert np.isfinite(out).all()
    times = []
    started = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - started < min_seconds and len(times) < 50):
        begin = time.perf_counter()
        attention(q, k, v, scale, mask)
        times.append(time.perf_counter() - begin)
    median = statistics.median(times)
    flops = 4.0 * heads * n * n * d * (0.5 if causal else 1.0)
    return {"N": n, "H": heads, "d": d, "causal": bool(causal), "reps": len(times),
            "median_s": median, "min_s": min(times), "gflops": flops / median / 1e9}


def shapes_from_bench(path, max_n):
    """(N, H, d, causal) of the benchmark's fp32 attention rows that ran."""
    with open(path) as f:
        report = json.load(f)
    shapes = []
    for row in report.get("benchmarks", []):
        parts = row.get("run_name", row["name"]).split("/")
        if parts[0] not in ("tiled", "naive") or len(parts) < 2 or parts[1] != "fp32":
            continue
        if row.get("error_occurred") or row.get("run_type", "iteration") != "iteration":
            continue
        fields = dict(p.split(":", 1) for p in parts[2:] if ":" in p)
        shape = (int(fields["N"]), int(fields["H"]), int(fields["d"]), fields["causal"] == "1")
        if shape[0] <= max_n and shape not in shapes:
            shapes.append(shape)
    return shapes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-json", help="attention_bench's --benchmark_out JSON")
    parser.add_argument("--shape", action="append", default=[], metavar="N,H,d,causal",
                        help="a problem to time (repeatable)")
    parser.add_argument("--max-n", type=int, default=8192,
                        help="largest N taken from --bench-json (default 8192)")
    parser.add_argument("--threads", type=int, default=2,
                        help="OpenBLAS threads (default 2; set through openblas_set_num_threads)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs at least (default 3)")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="keep timing (up to 50 runs) until this much time (default 1)")
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args()

    shapes = []
    if args.bench_json:
        shapes += shapes_from_bench(args.bench_json, args.max_n)
    for text in args.shape:
        n, h, d, c = (int(x) for x in text.split(","))
        shapes.append((n, h, d, bool(c)))
    if not shapes:
        parser.error("no shapes: give --bench-json with fp32 rows or --shape")

    info, lib = blas_info()
    if lib is not None:
        lib.openblas_set_num_threads(args.threads)
        info["threads"] = lib.openblas_get_num_threads()

    rows = []
    for i, (n, h, d, causal) in enumerate(shapes):
        row = time_problem(n, h, d, causal, args.reps, args.min_seconds, seed=1000 + i)
        print(f"numpy N={n} H={h} d={d} causal={int(causal)}: {row['median_s'] * 1e3:.2f} ms "
              f"median of {row['reps']}, {row['gflops']:.1f} GFLOP/s", file=sys.stderr)
        rows.append(row)

    # OPENBLAS_CORETYPE (read by OpenBLAS as it loads) chooses its kernels: tests/bench/run.sh
    # runs this script once per core type the CPU allows and keeps the best.
    info["coretype"] = os.environ.get("OPENBLAS_CORETYPE")
    report = {"numpy": np.__version__, "python": sys.version.split()[0], "blas": info,
              "threads": args.threads, "rows": rows}
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
