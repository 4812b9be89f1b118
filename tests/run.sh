#!/usr/bin/env bash
# Installs what is missing, then runs every test in four stages and exits non-zero on any
# failure:
#   1. release: builds the Release preset (the build deploy/run.sh serves from) and runs the whole
#      suite: C++ unit and service tests, the Python client test, the CLI test, the fuzz corpus
#      replay and the format check.
#   2. asan: the same suite built with AddressSanitizer + UndefinedBehaviorSanitizer (preset
#      "asan", build/asan); any sanitizer report fails, including one from an attnd that a test
#      stopped without reading its exit status.
#   3. fuzz: the libFuzzer target tests/fuzz/attention_fuzz (preset "fuzz", clang, build/fuzz)
#      for ATTN_FUZZ_SECONDS (default 60) on a copy of tests/fuzz/corpus; any crash, sanitizer
#      report or Naive/Tiled mismatch fails, and the input is saved in build/fuzz/artifacts/.
#   4. image: tests/image_test.sh builds the Dockerfile's CPU image on a Debian 12 base it makes
#      with debootstrap (cached in build/image/), runs it under Docker (starting dockerd when
#      none runs) and checks it from outside with the release build's attn: user, read-only
#      root, HEALTHCHECK, the three RPCs and caches, token and TLS, drain on docker stop, and
#      deploy/compose.yaml's CPU service.
# Each stage prints how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
fuzz_seconds=${ATTN_FUZZ_SECONDS:-60}

stage_start=$SECONDS
stage_done() {  # stage_done NAME
  echo "tests/run.sh: stage $1 passed in $((SECONDS - stage_start)) s"
  stage_start=$SECONDS
}

./deploy/install-deps.sh

# --- 1. release ------------------------------------------------------------------------------
cmake --preset release
cmake --build --preset release -j"$jobs"
ctest --preset release -j"$jobs"
stage_done release

# --- 2. asan ---------------------------------------------------------------------------------
# The test preset's environment (CMakePresets.json) sets the policy: halt on the first error,
# leak checking on (known leaks inside system libraries: tests/lsan.supp), and a 64 MiB
# quarantine instead of 256 MiB so the load test's bound on attnd's RSS still holds. log_path
# here also writes every report to a file, so a report from a process whose exit status no test
# reads (an attnd that a script stops with a signal) fails the run too.
reports=$PWD/build/asan/sanitizer-reports
cmake --preset asan
cmake --build --preset asan -j"$jobs"
rm -rf "$reports"
mkdir -p "$reports"
asan_failed=0
ASAN_OPTIONS="log_path=$reports/asan" UBSAN_OPTIONS="log_path=$reports/ubsan" \
  ctest --preset asan -j"$jobs" || asan_failed=1
if [ -n "$(ls -A "$reports")" ]; then
  for report in "$reports"/*; do
    echo "=== sanitizer report $report"
    cat "$report"
  done
  asan_failed=1
fi
[ "$asan_failed" -eq 0 ] || { echo "tests/run.sh: stage asan FAILED"; exit 1; }
stage_done asan

# --- 3. fuzz ---------------------------------------------------------------------------------
cmake --preset fuzz
cmake --build --preset fuzz -j"$jobs"
fuzz_dir=$PWD/build/fuzz
rm -rf "$fuzz_dir/corpus" "$fuzz_dir/artifacts"
mkdir -p "$fuzz_dir/corpus" "$fuzz_dir/artifacts"
cp tests/fuzz/corpus/* "$fuzz_dir/corpus/"  # The fuzzer adds to its corpus; keep ours as is.
fuzz_status=0
# -max_len: room for problems of a few hundred keys.
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
  "$fuzz_dir/tests/fuzz/attention_fuzz" "$fuzz_dir/corpus" -max_total_time="$fuzz_seconds" \
  -max_len=32768 -timeout=10 -print_final_stats=1 -artifact_prefix="$fuzz_dir/artifacts/" \
  >"$fuzz_dir/fuzz.log" 2>&1 || fuzz_status=$?
if [ "$fuzz_status" -ne 0 ] || [ -n "$(ls -A "$fuzz_dir/artifacts")" ]; then
  tail -n 80 "$fuzz_dir/fuzz.log"
  echo "tests/run.sh: stage fuzz FAILED (exit $fuzz_status; log $fuzz_dir/fuzz.log, inputs in" \
    "$fuzz_dir/artifacts/; rerun one with build/fuzz/tests/fuzz/attention_fuzz FILE)"
  exit 1
fi
executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$fuzz_dir/fuzz.log")
rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$fuzz_dir/fuzz.log")
added=$(sed -n 's/^stat::new_units_added: *//p' "$fuzz_dir/fuzz.log")
echo "tests/run.sh: fuzz ran ${executions:-?} executions in ${fuzz_seconds} s (${rate:-?}/s)," \
  "${added:-?} new corpus inputs, no failure"
stage_done fuzz

# --- 4. image --------------------------------------------------------------------------------
./tests/image_test.sh build/release || {
  echo "tests/run.sh: stage image FAILED (its logs: build/image/build.log, compose.log," \
    "dockerd.log, debootstrap.log; rerun it alone with tests/image_test.sh build/release)"
  exit 1
}
stage_done image
