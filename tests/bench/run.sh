#!/usr/bin/env bash
# The CPU benchmark: builds attention_bench if needed, runs it (Naive and Tiled beside an sgemm
# through the same OpenBLAS, one process, JSON), times NumPy's matmul-softmax-matmul on the same
# fp32 problems, and prints ONE table of ratios plus the targets of the CPU issue.
#
#   tests/bench/run.sh [--quick] [--threads N] [--no-numpy] [--out DIR] [-- BENCH_FLAGS...]
#
# --quick        a smoke run of seconds (attention_bench --quick); the targets that need rows it
#                does not run print "not measured"
# --threads N    worker threads for the backend, OpenBLAS and NumPy (default $ATTN_BENCH_THREADS,
#                else 2)
# --no-numpy     skip the NumPy column
# --no-targets   skip the interleaved target rows (then the targets come from the sweep)
# --repetitions R  repetitions of each interleaved target row (default 7)
# --out DIR      keep bench.json, targets.json, numpy.json and table.txt there (default: a
#                temporary folder)
# after --        flags for attention_bench itself (see the top of attention_bench.cc), e.g.
#                -- --n=1024,4096 --d=64 --dtype=fp32 --causal=0
# Environment: ATTN_BENCH_BUILD_DIR (default build/release, the release preset's), ATTN_BENCH_PYTHON
# (default /usr/bin/python3, which has python3-numpy).
#
# Not a test: it exits 0 when the run completes, whether or not the targets are met. It never
# sets OPENBLAS_CORETYPE or OPENBLAS_L2_SIZE (see the env README); the header shows them if set.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"

build_dir="${ATTN_BENCH_BUILD_DIR:-build/release}"
python="${ATTN_BENCH_PYTHON:-/usr/bin/python3}"
threads="${ATTN_BENCH_THREADS:-2}"
quick=0
numpy=1
targets=1
repetitions=7
out=""
bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --threads) threads="$2"; shift ;;
    --threads=*) threads="${1#*=}" ;;
    --no-numpy) numpy=0 ;;
    --no-targets) targets=0 ;;
    --repetitions) repetitions="$2"; shift ;;
    --repetitions=*) repetitions="${1#*=}" ;;
    --out) out="$2"; shift ;;
    --out=*) out="${1#*=}" ;;
    --) shift; bench_args=("$@"); break ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1 (bench flags go after --)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$out" ]; then
  out="$(mktemp -d -t attn-bench.XXXXXX)"
fi
mkdir -p "$out"

# Build (incremental: a no-op when attention_bench is up to date).
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  if [ "$build_dir" = build/release ]; then
    cmake --preset release >&2
  else
    cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release >&2
  fi
fi
cmake --build "$build_dir" --target attention_bench -j"$(nproc)" >&2
bench="$build_dir/tests/bench/attention_bench"

flags=(--threads="$threads")
[ "$quick" = 1 ] && flags+=(--quick)
echo "run.sh: $bench ${flags[*]} ${bench_args[*]:-}" >&2
"$bench" "${flags[@]}" ${bench_args[@]+"${bench_args[@]}"} \
  --benchmark_out="$out/bench.json" --benchmark_out_format=json >&2

# The targets again, apart from the sweep: the sgemm ceiling and Tiled fp32 and bf16 at the
# target shape, each repeated and run in random order in one process, so that a slow phase of a
# shared machine falls on the ceiling and on the kernel alike. The targets use medians of these.
rm -f "$out/targets.json"
if [ "$quick" = 0 ] && [ "$targets" = 1 ]; then
  echo "run.sh: target rows, $repetitions repetitions each, randomly interleaved" >&2
  "$bench" --threads="$threads" --n=4096 --d=64 --heads=8 --dtype=fp32,bf16 --causal=0 \
    --methods=tiled --no_refusal --min_time=0.5 --benchmark_repetitions="$repetitions" \
    --benchmark_enable_random_interleaving=true \
    --benchmark_out="$out/targets.json" --benchmark_out_format=json >&2
fi

rm -f "$out/numpy.json"
if [ "$numpy" = 1 ]; then
  numpy_max_n=8192
  [ "$quick" = 1 ] && numpy_max_n=1024
  echo "run.sh: NumPy baseline ($python)" >&2
  # OPENBLAS_NUM_THREADS only for this command: NumPy's BLAS gets the same thread count.
  OPENBLAS_NUM_THREADS="$threads" "$python" tests/bench/numpy_attention.py \
    --bench-json "$out/bench.json" --max-n "$numpy_max_n" --threads "$threads" \
    --out "$out/numpy.json" || echo "run.sh: the NumPy baseline failed; no NumPy column" >&2
fi

"$python" - "$out/bench.json" "$out/numpy.json" "$out/targets.json" <<'PY' | tee "$out/table.txt"
import json, os, statistics, sys

bench = json.load(open(sys.argv[1]))
numpy = json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) else None
interleaved = json.load(open(sys.argv[3])) if os.path.exists(sys.argv[3]) else None
ctx = bench.get("context", {})
MiB = 1024.0 * 1024.0


def fields(name):
    parts = name.split("/")
    kv = dict(p.split(":", 1) for p in parts if ":" in p)
    return parts, kv


# Google Benchmark rows: one per run, or aggregates when --benchmark_repetitions is given (then
# the median is used).
runs = {}
for row in bench["benchmarks"]:
    name = row.get("run_name", row["name"])
    if row.get("run_type") == "aggregate" and row.get("aggregate_name") != "median":
        continue
    prev = runs.get(name)
    if prev is not None and prev.get("run_type") == "aggregate":
        continue
    if row.get("run_type") == "aggregate" or prev is None or row.get("error_occurred"):
        runs[name] = row

scale_ms = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
sgemm = {}
rows = {}  # (method, dtype, causal, N, H, d) -> dict
for name, row in runs.items():
    parts, kv = fields(name)
    if parts[0] == "sgemm":
        if not row.get("error_occurred"):
            sgemm[kv["at"]] = (int(kv["N"]), row["GFLOP/s"])
        continue
    key = (parts[0], parts[1], int(kv["causal"]), int(kv["N"]), int(kv["H"]), int(kv["d"]))
    r = {"error": row.get("error_message") if row.get("error_occurred") else None}
    if r["error"] is None:
        r["ms"] = row["real_time"] * scale_ms[row.get("time_unit", "ns")]
        r["gflops"] = row["GFLOP/s"]  # A rate counter: already GFLOP per second.
        r["peak"] = row.get("peak_bytes")
        r["inter"] = row.get("intermediate_bytes")
    rows[key] = r
if numpy:
    for n in numpy["rows"]:
        key = ("numpy", "fp32", int(n["causal"]), n["N"], n["H"], n["d"])
        rows[key] = {"error": None, "ms": n["median_s"] * 1e3, "gflops": n["gflops"],
                     "peak": None, "inter": None}

peak = max((g for _, g in sgemm.values()), default=None)


def get(method, dtype, causal, n, h, d):
    r = rows.get((method, dtype, causal, n, h, d))
    return r if r and r["error"] is None else None


def mem(b):
    if b is None:
        return "-"
    return f"{b / MiB:.1f} MiB" if b >= 0.1 * MiB else f"{b / 1024:.0f} KiB"


# Header.
threads = ctx.get("attn_threads", "?")
cpu = ctx.get("attn_device", "?").split(",")[0]  # "<model>, N threads" from the backend.
print(f"CPU {cpu} | threads {threads} | "
      f"OpenBLAS core {ctx.get('openblas_corename', '?')} | block_k {ctx.get('attn_block_k', '?')} | "
      f"Naive budget {int(ctx.get('attn_naive_budget_bytes', 0)) / MiB / 1024:g} GiB | "
      f"load avg {' '.join(f'{x:.2f}' for x in ctx.get('load_avg', []))}")
if sgemm:
    n = next(iter(sgemm.values()))[0]
    at = ", ".join(f"{k} {g:.1f}" for k, (_, g) in sorted(sgemm.items(), reverse=False))
    drift = ""
    if len(sgemm) == 2:
        lo, hi = sorted(g for _, g in sgemm.values())
        if hi > 1.1 * lo:
            drift = f"  (begin/end differ by {100 * (hi / lo - 1):.0f}%: a noisy machine)"
    print(f"sgemm {n}x{n}x{n}, same OpenBLAS, same run: {peak:.1f} GFLOP/s peak ({at}){drift}")
else:
    print("sgemm: not measured (its rows are missing or failed)")
env = [f"{v}={ctx[v]}" for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS")
       if ctx.get(v)]
if numpy:
    b = numpy.get("blas", {})
    print(f"NumPy {numpy['numpy']} (float32, median of >=3 runs) on {b.get('library')} "
          f"core {b.get('corename')}, {b.get('threads')} BLAS threads")
if env:
    print("environment: " + " ".join(env))
print("GFLOP/s = 4*B*H*N^2*d (halved when causal) / time; B = 1; x sgemm = GFLOP/s / sgemm peak; "
      "speed-ups on Tiled rows = other time / Tiled time")
print()

order = {"tiled": 0, "naive": 1, "numpy": 2}
keys = sorted(rows, key=lambda k: (k[5], k[1] != "fp32", k[1], k[2], k[3], order.get(k[0], 9)))
head = ["method", "dtype", "causal", "N", "H", "d", "time ms", "GFLOP/s", "x sgemm",
        "Tiled/Naive", "Tiled/NumPy", "peak extra", "Naive interm."]
table = []
notes = {}  # error message -> the rows that reported it
prev_group = None
for k in keys:
    method, dtype, causal, n, h, d = k
    group = (d, dtype, causal)
    if prev_group is not None and group != prev_group:
        table.append(None)
    prev_group = group
    r = rows[k]
    cells = [method, dtype, "yes" if causal else "no", str(n), str(h), str(d)]
    if r["error"] is not None:
        code = r["error"].split(":", 1)[0]
        notes.setdefault(r["error"], []).append(f"{method} {dtype} causal={causal} N={n} d={d}")
        table.append((cells, f"refused ({code}), see below" if code == "RESOURCE_EXHAUSTED"
                      else f"error ({code}), see below"))
        continue
    cells += [f"{r['ms']:.2f}", f"{r['gflops']:.1f}",
              f"{r['gflops'] / peak:.2f}" if peak else "-"]
    if method == "tiled":
        nv = get("naive", dtype, causal, n, h, d)
        npy = get("numpy", dtype, causal, n, h, d)
        cells += [f"{nv['ms'] / r['ms']:.2f}x" if nv else "-",
                  f"{npy['ms'] / r['ms']:.2f}x" if npy else "-"]
    else:
        cells += ["", ""]
    cells += [mem(r["peak"]), mem(r["inter"]) if method == "naive" else ""]
    table.append(cells)

full = [c for c in table if isinstance(c, list)]
short = [c[0] for c in table if isinstance(c, tuple)]
widths = [max([len(head[i])] + [len(c[i]) for c in full + short if i < len(c)])
          for i in range(len(head))]
right = set(range(3, len(head)))


def line(cells):
    return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                     for i, (c, w) in enumerate(zip(cells, widths))).rstrip()


print(line(head))
print(line(["-" * w for w in widths]))
for cells in table:
    if cells is None:
        print()
    elif isinstance(cells, tuple):  # A refused or failed row: its status across the columns.
        print(line(cells[0]) + "  " + cells[1].rjust(widths[6]))
    else:
        print(line(cells))
for message, where in notes.items():
    print(f"  {'; '.join(where)}:\n    {message}")
print()

# The interleaved target rows: every repetition's GFLOP/s, by row (both sgemm rows pooled).
reps = {}
if interleaved:
    for row in interleaved["benchmarks"]:
        if row.get("run_type") == "aggregate" or row.get("error_occurred"):
            continue
        parts, kv = fields(row.get("run_name", row["name"]))
        reps.setdefault("sgemm" if parts[0] == "sgemm" else f"{parts[0]} {parts[1]}",
                        []).append(row["GFLOP/s"])
    count = max((len(v) for k, v in reps.items() if k != "sgemm"), default=0)
    print(f"interleaved target rows ({count} repetitions each in random order, one process; "
          "GFLOP/s median [min-max]):")
    for key in ("sgemm", "tiled fp32", "tiled bf16"):
        v = reps.get(key)
        if v:
            ratio = ""
            if key != "sgemm" and reps.get("sgemm"):
                ratio = f"  = {statistics.median(v) / statistics.median(reps['sgemm']):.2f}x sgemm"
            print(f"  {key:11s} {statistics.median(v):6.1f} [{min(v):.1f}-{max(v):.1f}]{ratio}")
    print()


def median_of(key):
    v = reps.get(key)
    return statistics.median(v) if v else None


# Targets: 2 threads, fp32, non-causal, B=1, H=8, d=64, N=4096.
print(f"targets (fp32, non-causal, B=1, H=8, d=64, N=4096; this run: {threads} threads):")
results = []


def target(label, value, met):
    state = "not measured" if met is None else ("met" if met else "NOT MET")
    results.append((label, value, state))


t = get("tiled", "fp32", 0, 4096, 8, 64)
it_sgemm, it_fp32, it_bf16 = median_of("sgemm"), median_of("tiled fp32"), median_of("tiled bf16")
if it_sgemm and it_fp32:
    target("Tiled >= 0.75x sgemm (interleaved medians)",
           f"{it_fp32 / it_sgemm:.2f}x ({it_fp32:.1f} / {it_sgemm:.1f} GFLOP/s)",
           it_fp32 >= 0.75 * it_sgemm)
    if t and peak:
        target("  (info) in the sweep, against its peak",
               f"{t['gflops'] / peak:.2f}x ({t['gflops']:.1f} / {peak:.1f} GFLOP/s)",
               t["gflops"] >= 0.75 * peak)
elif t and peak:
    target("Tiled >= 0.75x sgemm peak (sweep)",
           f"{t['gflops'] / peak:.2f}x ({t['gflops']:.1f} / {peak:.1f} GFLOP/s)",
           t["gflops"] >= 0.75 * peak)
else:
    target("Tiled >= 0.75x sgemm peak", "-", None)

pairs = []
for (method, dtype, causal, n, h, d), r in rows.items():
    if method == "tiled" and dtype == "fp32" and causal == 0 and d == 64 and n >= 1024:
        nv = get("naive", dtype, causal, n, h, d)
        if r["error"] is None and nv:
            pairs.append((n, nv["ms"] / r["ms"]))
pairs.sort()
if pairs:
    worst = min(pairs, key=lambda p: p[1])
    target("Tiled faster than Naive at every N >= 1024",
           f"min {worst[1]:.2f}x at N={worst[0]} (N = {', '.join(str(n) for n, _ in pairs)})",
           all(s > 1.0 for _, s in pairs))
else:
    target("Tiled faster than Naive at every N >= 1024", "-", None)
# The same over every dtype, causal and d, for information.
allpairs = []
for (method, dtype, causal, n, h, d), r in rows.items():
    if method == "tiled" and n >= 1024 and r["error"] is None:
        nv = get("naive", dtype, causal, n, h, d)
        if nv:
            allpairs.append((nv["ms"] / r["ms"], f"{dtype} causal={causal} N={n} d={d}"))
if allpairs:
    s, where = min(allpairs)
    target("  (info) same over every dtype/causal/d", f"min {s:.2f}x at {where}", s > 1.0)

npy = get("numpy", "fp32", 0, 4096, 8, 64)
if t and npy:
    s = npy["ms"] / t["ms"]
    target("Tiled >= 2.5x faster than NumPy", f"{s:.2f}x ({npy['ms']:.1f} / {t['ms']:.1f} ms)", s >= 2.5)
else:
    target("Tiled >= 2.5x faster than NumPy", "-", None)

big = get("tiled", "fp32", 0, 32768, 1, 64)
if big and big["peak"] is not None:
    target("Tiled N=32768 H=1 d=64 peak extra < 64 MiB", mem(big["peak"]), big["peak"] < 64 * MiB)
else:
    target("Tiled N=32768 H=1 d=64 peak extra < 64 MiB", "-", None)

refusal = rows.get(("naive", "fp32", 0, 32768, 1, 64))
budget_gib = int(ctx.get("attn_naive_budget_bytes", 0)) / MiB / 1024
if refusal is None:
    target(f"Naive N=32768 refused under {budget_gib:g} GiB", "-", None)
elif refusal["error"] is None:
    target(f"Naive N=32768 refused under {budget_gib:g} GiB", "ran (not refused)", False)
else:
    code = refusal["error"].split(":", 1)[0]
    target(f"Naive N=32768 refused under {budget_gib:g} GiB", code,
           code == "RESOURCE_EXHAUSTED" and abs(budget_gib - 4) < 1e-9)

bf = get("tiled", "bf16", 0, 4096, 8, 64)
if it_fp32 and it_bf16:  # Same FLOPs: the time ratio is the inverse of the rate ratio.
    s = it_fp32 / it_bf16
    target("bf16 Tiled time <= 1.3x fp32 (interleaved)",
           f"{s:.2f}x ({it_bf16:.1f} / {it_fp32:.1f} GFLOP/s)", s <= 1.3)
elif t and bf:
    s = bf["ms"] / t["ms"]
    target("bf16 Tiled time <= 1.3x fp32 Tiled", f"{s:.2f}x ({bf['ms']:.1f} / {t['ms']:.1f} ms)", s <= 1.3)
else:
    target("bf16 Tiled time <= 1.3x fp32 Tiled", "-", None)

lw = max(len(l) for l, _, _ in results)
vw = max(len(v) for _, v, _ in results)
for label, value, state in results:
    print(f"  {label.ljust(lw)}  {value.ljust(vw)}  {state}")
if str(threads) != "2":
    print("  (the targets are stated for 2 threads)")
PY
echo "run.sh: JSON and table in $out" >&2
