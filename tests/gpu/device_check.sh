#!/usr/bin/env bash
# The device check: on a machine with a GPU (and nvcc, no network), from the repository root:
#
#   bash tests/gpu/device_check.sh
#
# 1. binaries: the ones tests/gpu/pack.sh built on the development machine and the device tool
#    carried in build/gpu-carry, when they start here and were built from these sources; else
#    a build here with the machine's nvcc and CMake for its own GPU architecture (a CMake
#    project of its own: kernels + tests, no gRPC or protobuf; abseil and GoogleTest headers and
#    static libraries come from build/gpu-carry). Without either, only the SDPA column runs.
# 2. gpu_test (its summary);
# 3. gpu_bench: the device's ceilings (copy GB/s, cuBLAS GEMM TFLOP/s), then Tiled; then
#    Decode over KV caches (bf16 and fp8, 32 query heads over 8 kv heads, d 128, 1 × 1k…32k
#    and 16 × 4k tokens): cache bytes read per second beside the copy bandwidth of this run,
#    and the fp8 step's speed over bf16's per shape; 16 forks of one 16384-token bf16 prompt
#    against one sequence's step (issue 31);
# 4. sdpa_bench.py: torch SDPA on the same shapes (skipped without torch or CUDA);
# 5. gpu_bench: Naive (last: the least important and the heaviest on memory);
# 6. one table: TFLOP/s of Naive, Tiled and SDPA, ratios to SDPA and Tiled / GEMM peak.
# Sweep: fp16 and bf16 × head_dim 64, 128 × seq 1k, 4k, 16k × causal or not, batch·heads =
# 256k tokens / seq (see tests/gpu/bench.cc).
#
# Every stage has its own timeout inside a total budget (ATTN_CHECK_BUDGET_S, default 450 s,
# under the 8 minutes the issue allows). Raw CSVs, logs and the table go to $OUT when it is set
# (the device tool returns it), else to build/device-check. Without a GPU (the rehearsal on the
# development machine) every GPU stage says why it was skipped and the script exits 0.
#
# Environment: OUT, ATTN_CARRY_DIR (default build/gpu-carry), ATTN_CHECK_BUDGET_S,
# ATTN_CHECK_BUILD=1 (build here even when the carried binaries would do), ATTN_CHECK_ARCH
# (CUDA architecture when nvidia-smi cannot tell, default 90), ATTN_BENCH_ARGS (extra gpu_bench
# and sdpa_bench.py arguments, e.g. "--seq 1024 --reps 3").
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD

# The sources the binaries are built from; tests/gpu/pack.sh records the same checksum.
source_checksum() {
  find kernels tests/reference.h tests/reference.cc tests/checks.h tests/checks.cc \
    tests/backend_suite.h tests/backend_suite.cc tests/backend_kernels_test.cc \
    tests/backend_trace_test.cc tests/gpu -type f \
    \( -name '*.h' -o -name '*.cc' -o -name '*.cu' \) | LC_ALL=C sort | xargs sha256sum |
    sha256sum | cut -c1-16
}
if [ "${1:-}" = "--source-checksum" ]; then
  source_checksum
  exit 0
fi

T0=$SECONDS
BUDGET=${ATTN_CHECK_BUDGET_S:-450}
CARRY=${ATTN_CARRY_DIR:-build/gpu-carry}
case $CARRY in /*) ;; *) CARRY=$ROOT/$CARRY ;; esac
RESULTS=${OUT:-$ROOT/build/device-check}
mkdir -p "$RESULTS"
# At most 8 files come back from $OUT: env.txt build.log gpu_test.log bench.csv sdpa.csv
# table.txt table.csv.
rm -f "$RESULTS"/{env.txt,build.log,gpu_test.log,bench.csv,sdpa.csv,table.txt,table.csv}
BENCH_ARGS=${ATTN_BENCH_ARGS:-}
export PYTHONUNBUFFERED=1
SUMMARY=()

elapsed() { echo $((SECONDS - T0)); }
left() { echo $((BUDGET - (SECONDS - T0))); }
stage() { echo; echo "=== [$(elapsed)s] $*"; }
note() { SUMMARY+=("$*"); echo "--> $*"; }
FAILED=0
failed() { FAILED=1; note "$@"; }
# A stage's timeout: at most $1 seconds, leaving $2 for the stages after it; 0 = no time left.
budget_for() {
  local cap=$1 reserve=$2 t
  t=$(($(left) - reserve))
  [ "$t" -gt "$cap" ] && t=$cap
  [ "$t" -lt 15 ] && t=0
  echo "$t"
}

# --- 0. the machine ------------------------------------------------------------------------
stage "machine"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm)"
  # shellcheck disable=SC1091
  [ -r /etc/os-release ] && echo "os: $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "glibc: $(ldd --version 2> /dev/null | head -1)"
  echo "nvcc: $(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2> /dev/null || echo none)"
  echo "cmake: $(command -v cmake || echo none); ninja: $(command -v ninja || echo none)"
  echo "python3: $(command -v python3 || echo none)"
  echo "sources: $(source_checksum)"
  [ -f "$CARRY/MANIFEST" ] && sed 's/^/carried /' "$CARRY/MANIFEST"
  echo
  timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi: not available"
} > "$RESULTS/env.txt" 2>&1
HAVE_GPU=0
GPU=$(timeout 20 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total \
  --format=csv,noheader 2> /dev/null | head -1)
if [ -n "$GPU" ]; then
  HAVE_GPU=1
  ARCH=$(echo "$GPU" | cut -d, -f2 | tr -d ' .')
  echo "GPU: $GPU"
  timeout 10 nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu \
    --format=csv 2> /dev/null
else
  ARCH=${ATTN_CHECK_ARCH:-90}
  note "no GPU: nvidia-smi found none (the rehearsal on a development machine); the GPU stages will say what they would run"
fi
[[ $ARCH =~ ^[0-9]+$ ]] || ARCH=90
NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
echo "nvcc: ${NVCC:-none}; CUDA architecture for a build here: $ARCH"

# --- 1. binaries ---------------------------------------------------------------------------
stage "binaries"
# cuBLAS is not carried (hundreds of MB): the CUDA toolkit's, else PyTorch's pip packages'.
find_cublas() {
  local dir py site
  for dir in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/lib \
    /usr/local/cuda/targets/x86_64-linux/lib ${NVCC:+"$(dirname "$NVCC")/../lib64"}; do
    if [ -e "$dir/libcublas.so.13" ] && [ -e "$dir/libcublasLt.so.13" ]; then
      echo "$dir"
      return
    fi
  done
  dir=$(ldconfig -p 2> /dev/null | awk '$1 == "libcublas.so.13" {print $NF; exit}')
  if [ -n "$dir" ]; then
    dirname "$dir"
    return
  fi
  for py in python3 /opt/torch/.venv/bin/python3; do
    for site in $(timeout 20 "$py" -c 'import site; print(" ".join(site.getsitepackages()))' \
      2> /dev/null); do
      dir=$(find "$site/nvidia" -name 'libcublas.so.13*' 2> /dev/null | head -1)
      if [ -n "$dir" ]; then
        dirname "$dir"
        return
      fi
    done
  done
}
CUBLAS_DIR=$(find_cublas)
echo "libcublas.so.13: ${CUBLAS_DIR:-not found}"
export LD_LIBRARY_PATH="$CARRY/lib${CUBLAS_DIR:+:$CUBLAS_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Whether a binary starts: the loader finds its libraries and main() runs.
starts() {
  local rc
  timeout 30 "$@" > /dev/null 2>&1
  rc=$?
  [ "$rc" -ne 126 ] && [ "$rc" -ne 127 ] && [ "$rc" -lt 124 ]
}
BIN=""
if [ -x "$CARRY/bin/gpu_test" ] || [ -f "$CARRY/bin/gpu_test" ]; then
  chmod +x "$CARRY"/bin/* 2> /dev/null
  carried_sources=$(awk '/^sources:/ {print $2}' "$CARRY/MANIFEST" 2> /dev/null)
  if ! starts "$CARRY/bin/gpu_test" --gtest_list_tests || ! starts "$CARRY/bin/gpu_bench" --help; then
    note "carried binaries do not start here:"
    timeout 30 "$CARRY/bin/gpu_test" --gtest_list_tests 2>&1 | tail -3
    ldd "$CARRY/bin/gpu_test" "$CARRY/bin/gpu_bench" 2>&1 | grep 'not found' | sort -u
  elif [ "$carried_sources" != "$(source_checksum)" ]; then
    note "carried binaries were built from other sources ($carried_sources, here $(source_checksum)): building here instead"
    STALE_BIN=$CARRY/bin
  elif [ "${ATTN_CHECK_BUILD:-0}" = 1 ]; then
    note "ATTN_CHECK_BUILD=1: building here although the carried binaries start"
    STALE_BIN=$CARRY/bin
  else
    BIN=$CARRY/bin
    note "binaries: carried ($CARRY/bin, $(grep -h '^built:' "$CARRY/MANIFEST" 2> /dev/null | cut -c8-))"
  fi
else
  note "no carried binaries in $CARRY (run tests/gpu/pack.sh on the development machine and carry build/gpu-carry)"
fi

# The fallback: the kernels and the GPU test and benchmark with this machine's nvcc and CMake.
build_here() {
  local work=/tmp/attn-device-check t=$1 cmake_bin
  cmake_bin=$(command -v cmake)
  if [ -z "$NVCC" ] || [ -z "$cmake_bin" ]; then
    echo "cannot build here: nvcc=${NVCC:-none} cmake=${cmake_bin:-none}"
    return 1
  fi
  if [ ! -d "$CARRY/include/absl" ] || ! ls "$CARRY"/static/libabsl_*.a > /dev/null 2>&1; then
    echo "cannot build here: abseil headers and static libraries are missing ($CARRY/include/absl," \
      "$CARRY/static): this machine has no abseil; carry build/gpu-carry from tests/gpu/pack.sh"
    return 1
  fi
  rm -rf "$work"
  mkdir -p "$work/src"
  cat > "$work/src/CMakeLists.txt" << EOF
# Written by tests/gpu/device_check.sh: the kernels, gpu_test and gpu_bench, without gRPC or
# protobuf, against the carried abseil and GoogleTest.
cmake_minimum_required(VERSION 3.24)
project(attn_device_check LANGUAGES CXX CUDA)
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
find_package(Threads REQUIRED)
set(REPO "$ROOT")
set(CARRY "$CARRY")
file(GLOB KERNEL_SOURCES \${REPO}/kernels/cuda/*.cc \${REPO}/kernels/cuda/*.cu)
file(GLOB ABSL_LIBS \${CARRY}/static/libabsl_*.a)
# CMake 3.25 does not know nvcc's C++20 flag (as in the top-level CMakeLists.txt).
set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
find_file(CUBLAS_HEADER cublas_v2.h PATHS \${CUDAToolkit_INCLUDE_DIRS} NO_DEFAULT_PATH)
if(TARGET CUDA::cublas AND CUBLAS_HEADER)
  set(CUBLAS CUDA::cublas)
else()  # PyTorch's pip cuBLAS: <dir>/lib/libcublas.so.13, headers in <dir>/include.
  set(CUBLAS "$CUBLAS_DIR/libcublas.so.13" "$CUBLAS_DIR/libcublasLt.so.13")
  include_directories("$CUBLAS_DIR/../include")
endif()
add_library(attn_kernels STATIC \${KERNEL_SOURCES})
target_include_directories(attn_kernels PUBLIC \${REPO} \${CARRY}/include)
target_compile_definitions(attn_kernels PUBLIC ATTN_HAVE_CUDA=1)
target_link_libraries(attn_kernels PUBLIC CUDA::cudart_static \${CUBLAS} Threads::Threads
  -Wl,--start-group \${ABSL_LIBS} -Wl,--end-group)
add_library(attn_test_support STATIC \${REPO}/tests/reference.cc)
target_link_libraries(attn_test_support PUBLIC attn_kernels)
add_executable(gpu_bench \${REPO}/tests/gpu/bench.cc)
target_link_libraries(gpu_bench PRIVATE attn_test_support)
# gpu_test: the suite every backend runs (tests/backend_*_test.cc) over CUDA, and the device's own.
add_executable(gpu_test \${REPO}/tests/gpu/gpu_test.cc \${REPO}/tests/gpu/kv_cache_test.cc
  \${REPO}/tests/gpu/cuda_suite_backend.cc \${REPO}/tests/backend_kernels_test.cc
  \${REPO}/tests/backend_trace_test.cc \${REPO}/tests/checks.cc \${REPO}/tests/backend_suite.cc)
target_link_libraries(gpu_test PRIVATE attn_test_support \${CARRY}/static/libgtest_main.a
  \${CARRY}/static/libgtest.a Threads::Threads)
EOF
  local generator=()
  command -v ninja > /dev/null && generator=(-G Ninja)
  echo "building in $work (sm_$ARCH, nvcc $("$NVCC" --version | grep -o 'release [0-9.]*'))"
  timeout "$t" "$cmake_bin" -S "$work/src" -B "$work/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" ||
    return 1
  # gpu_bench first: it is worth having even if gpu_test does not build.
  timeout "$t" "$cmake_bin" --build "$work/build" --target gpu_bench -j "$(nproc)" || return 1
  timeout "$t" "$cmake_bin" --build "$work/build" --target gpu_test -j "$(nproc)" ||
    echo "gpu_test did not build here (gpu_bench did)"
  BIN=$work/build
}
if [ -z "$BIN" ]; then
  t=$(budget_for 200 230)
  if [ "$t" -eq 0 ]; then
    note "no time left to build here"
  else
    echo "building here (timeout ${t}s; log in build.log)"
    build_here "$t" > "$RESULTS/build.log" 2>&1
    build_rc=$?
    tail -5 "$RESULTS/build.log"
    if [ "$build_rc" -eq 0 ] && [ -n "$BIN" ]; then
      note "binaries: built here in $BIN (sm_$ARCH)"
    else
      note "the build here failed (build.log): $(grep -m1 -E 'error|cannot|Error' "$RESULTS/build.log")"
      BIN=""
    fi
  fi
  if [ -z "$BIN" ] && [ -n "${STALE_BIN:-}" ]; then
    BIN=$STALE_BIN
    note "using the carried binaries although built from other sources"
  fi
fi
[ -z "$BIN" ] && note "no GPU binaries: only the SDPA column can run"

# --- 2. gpu_test ---------------------------------------------------------------------------
stage "gpu_test"
if [ -n "$BIN" ] && [ -x "$BIN/gpu_test" ]; then
  t=$(budget_for 100 200)
  if [ "$t" -eq 0 ]; then
    note "gpu_test: skipped, no time left"
  else
    timeout -k 5 "$t" "$BIN/gpu_test" --gtest_brief=1 --gtest_color=no > "$RESULTS/gpu_test.log" 2>&1
    rc=$?
    grep -E '^\[ *(PASSED|FAILED|SKIPPED) *\]|tests? from .* ran' "$RESULTS/gpu_test.log" | head -40
    [ "$rc" -ne 0 ] && tail -n 25 "$RESULTS/gpu_test.log"
    counts=$(grep -E '^\[ *(PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?' "$RESULTS/gpu_test.log" |
      sed -E 's/^\[ *([A-Z]+) *\] ([0-9]+) tests?.*/\2 \1/' | tr '\n' ' ')
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      failed "gpu_test: TIMED OUT after ${t}s"
    elif [ "$rc" -ne 0 ]; then
      failed "gpu_test: FAILED (exit $rc): $counts"
    else
      note "gpu_test: passed: $counts"
    fi
  fi
else
  note "gpu_test: not run (no binary)"
fi

# --- 3-5. benchmarks ------------------------------------------------------------------------
echo
echo "sweep: bf16, fp16 × head_dim 64, 128 × seq 1024, 4096, 16384 × causal 0, 1;" \
  "batch·heads = 262144 / seq${BENCH_ARGS:+; extra arguments: $BENCH_ARGS}"
run_bench() {  # $1 = cap, $2 = reserve, the rest: gpu_bench arguments
  local cap=$1 reserve=$2 t rc
  shift 2
  t=$(budget_for "$cap" "$reserve")
  if [ "$t" -eq 0 ]; then
    note "gpu_bench $*: skipped, no time left"
    return
  fi
  echo "gpu_bench $* (timeout ${t}s)"
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of arguments.
  timeout -k 5 "$t" "$BIN/gpu_bench" "$@" --deadline_s $((t - 12)) $BENCH_ARGS 2>&1 |
    tee -a "$RESULTS/bench.csv"
  rc=$?
  case $rc in
    0) ;;
    124 | 137) failed "gpu_bench $*: TIMED OUT after ${t}s" ;;
    *) failed "gpu_bench $*: exit $rc (a cell failed: see its status and note)" ;;
  esac
}
PY=python3
if ! timeout 60 python3 -c 'import torch' > /dev/null 2>&1 && [ -x /opt/torch/.venv/bin/python3 ]; then
  PY=/opt/torch/.venv/bin/python3
fi
run_sdpa() {
  local t rc
  stage "sdpa_bench.py (torch SDPA, default dispatch)"
  t=$(budget_for 120 "$1")
  if [ "$t" -eq 0 ]; then
    note "sdpa_bench: skipped, no time left"
    return
  fi
  echo "$PY tests/gpu/sdpa_bench.py (timeout ${t}s)"
  # shellcheck disable=SC2086
  timeout -k 5 "$t" "$PY" tests/gpu/sdpa_bench.py --deadline_s $((t - 15)) $BENCH_ARGS 2>&1 |
    tee "$RESULTS/sdpa.csv"
  rc=$?
  case $rc in
    0) ;;
    124 | 137) failed "sdpa_bench: TIMED OUT after ${t}s" ;;
    *) failed "sdpa_bench: exit $rc" ;;
  esac
  grep -q '^SKIPPED' "$RESULTS/sdpa.csv" 2> /dev/null && note "sdpa: $(grep -m1 '^SKIPPED' "$RESULTS/sdpa.csv")"
}

if [ -n "$BIN" ] && [ -x "$BIN/gpu_bench" ]; then
  stage "gpu_bench: ceilings, then Tiled"
  run_bench 150 150 --method tiled
  grep -q '^SKIPPED' "$RESULTS/bench.csv" 2> /dev/null && note "gpu_bench: $(grep -m1 '^SKIPPED' "$RESULTS/bench.csv")"
  if ! grep -q '^SKIPPED' "$RESULTS/bench.csv" 2> /dev/null; then
    stage "gpu_bench: Decode over KV caches"
    run_bench 90 200 --method decode --dtype bf16,fp8 --ceilings 0
  fi
  run_sdpa 60
  if ! grep -q '^SKIPPED' "$RESULTS/bench.csv" 2> /dev/null; then
    stage "gpu_bench: Naive"
    run_bench 200 15 --method naive --ceilings 0
  else
    note "gpu_bench --method naive --ceilings 0 --deadline_s ...: not run (no CUDA device)"
  fi
else
  note "gpu_bench: not run (no binary)"
  run_sdpa 15
fi

# --- 6. the table ---------------------------------------------------------------------------
stage "table"
if ! timeout 30 python3 - "$RESULTS" << 'EOF'; then
import csv, os, sys

results = sys.argv[1]
def rows(name):
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [r for r in csv.reader(f) if r and not r[0].startswith("#")]

cells, ceilings, device, torch_line = {}, {}, "", ""
for name in ("bench.csv", "sdpa.csv"):
    for r in rows(name):
        if r[0] == "attn" and len(r) >= 14:
            method, dtype, d, seq, bh, causal = r[1:7]
            cells[(dtype, int(d), int(seq), int(causal), method)] = r
            cells.setdefault((dtype, int(d), int(seq), int(causal), "bh"), bh)
        elif r[0] == "ceiling" and len(r) >= 7:
            ceilings[(r[1], r[2])] = float(r[5])
for name in ("bench.csv", "sdpa.csv"):
    path = os.path.join(results, name)
    if os.path.exists(path):
        for text in open(path):
            if text.startswith("# device: "):
                device = text[10:].strip()
            elif text.startswith("# torch "):
                torch_line = text[2:].strip()

def rate(r):
    if r is None:
        return None, "-"
    if r[12] == "ok" and r[10]:
        return float(r[10]), f"{float(r[10]):.1f}"
    return None, r[12] or "?"

def ratio(a, b):
    return f"{a / b:.2f}" if a is not None and b else "-"

shapes = sorted({k[:4] for k in cells}, key=lambda k: (k[0], k[1], k[2], k[3]))
header = ["dtype", "d", "seq", "bh", "causal", "naive", "tiled", "sdpa", "sdpa_backend",
          "naive/sdpa", "tiled/sdpa", "tiled/gemm"]
table = []
for shape in shapes:
    dtype = shape[0]
    naive, naive_s = rate(cells.get(shape + ("naive",)))
    tiled, tiled_s = rate(cells.get(shape + ("tiled",)))
    sdpa_row = cells.get(shape + ("sdpa",))
    sdpa, sdpa_s = rate(sdpa_row)
    backend = "-"
    if sdpa_row is not None and "backend=" in sdpa_row[13]:
        backend = sdpa_row[13].split("backend=")[1].split()[0]
    gemm = ceilings.get(("gemm_8192", dtype))
    table.append([dtype, str(shape[1]), str(shape[2]), cells.get(shape + ("bh",), "?"),
                  str(shape[3]), naive_s, tiled_s, sdpa_s, backend, ratio(naive, sdpa),
                  ratio(tiled, sdpa), ratio(tiled, gemm)])

lines = ["attention TFLOP/s = 4·B·H·N²·d (halved when causal) / median kernel time "
         "(CUDA events; Naive and Tiled: the backend's compute_ns, without host copies)"]
if device:
    lines.append(f"device: {device}")
if torch_line:
    lines.append(f"sdpa: {torch_line}")
copy = ceilings.get(("copy_d2d", "-"))
gemms = ", ".join(f"{dt} {v:.0f}" for (name, dt), v in sorted(ceilings.items())
                  if name == "gemm_8192")
lines.append("ceilings: copy " + (f"{copy:.0f} GB/s (read + write)" if copy else "-") +
             "; cuBLAS GEMM 8192³ TFLOP/s: " + (gemms or "-"))
if table:
    widths = [max(len(row[i]) for row in table + [header]) for i in range(len(header))]
    fmt = lambda row: "  ".join(c.rjust(w) if i not in (0, 8) else c.ljust(w)
                                for i, (c, w) in enumerate(zip(row, widths)))
    lines.append(fmt(header))
    lines.extend(fmt(row) for row in table)
else:
    lines.append("(no benchmark rows: nothing ran on a GPU)")
# Decode: cache bytes read per second against the copy bandwidth measured in this run.
decodes = [r for r in rows("bench.csv") if r[0] == "decode" and len(r) >= 12]
if decodes:
    lines.append("")
    lines.append("decode over KV caches: cache GB/s = batch·key_len·kv_heads·2d·bytes / median "
                 "kernel time; vs copy = that / copy_d2d (read + write) of this run")
    lines.append("dtype  batch  key_len  heads/kv   d       ms  cache_GB/s  vs_copy  rel_err  status")
    for r in decodes:
        gbs = float(r[9]) if r[11] == "ok" and r[9] else None
        lines.append(f"{r[1]:5}  {r[2]:>5}  {r[3]:>7}  {r[4]:>5}/{r[5]:<2}  {r[6]:>3}  "
                     f"{r[8] or '-':>7}  {r[9] or '-':>10}  {ratio(gbs, copy):>7}  "
                     f"{r[10] or '-':>7}  {r[11]}")
    # An fp8 cache's step against bf16's, same shape, same run (issue 32: ≥ 1.7× at 1 × 32768).
    step = {(r[1], r[2], r[3]): float(r[8]) for r in decodes if r[11] == "ok" and r[8]}
    for (dtype, batch, key_len), ms in step.items():
        if dtype == "fp8" and ("bf16", batch, key_len) in step:
            lines.append(f"fp8 step speed / bf16 at {batch} x {key_len}: "
                         f"{step[('bf16', batch, key_len)] / ms:.2f}x")
# Forks of one prompt (issue 31: 16 forks of a 16384-token bf16 prompt, 64 tokens of their own
# each, ≤ 2× one 16448-token sequence's step): gpu_bench's decode_forks rows.
forks = {r[2]: r for r in rows("bench.csv") if r[0] == "decode_forks" and len(r) >= 12}
for batch in ("1", "16"):
    if batch in forks:
        r = forks[batch]
        lines.append(f"forks: batch {batch:>2} x {r[3]} tokens: {r[8] or '-'} ms, "
                     f"rel_err {r[10] or '-'}, {r[11]}")
if all(b in forks and forks[b][11] == "ok" and forks[b][8] for b in ("1", "16")):
    lines.append(f"16 forks / one sequence's step: "
                 f"{float(forks['16'][8]) / float(forks['1'][8]):.2f}x (issue 31: <= 2x)")
text = "\n".join(lines)
open(os.path.join(results, "table.txt"), "w").write(text + "\n")
with open(os.path.join(results, "table.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(header)
    w.writerows(table)
EOF
  failed "table: the join failed"
fi

stage "summary (results in $RESULTS)"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
[ -f "$RESULTS/table.txt" ] && { echo; cat "$RESULTS/table.txt"; }
echo
if [ "$HAVE_GPU" = 1 ] && [ -z "$BIN" ]; then FAILED=1; fi
echo "device_check: done in $(elapsed) s (budget $BUDGET s)$([ "$FAILED" = 1 ] && echo ', WITH FAILURES')"
exit "$FAILED"
