#!/usr/bin/env python3
"""Shows that the emulated GPU suites (simt_gpu_test) catch deliberate breaks of the CUDA kernels.

For each mutation below: applies it to the source, rebuilds simt_gpu_test in the build directory
(default build/release), runs it, expects it to fail, and puts the source back as it was (also on
an error or ^C). Prints one line per mutation: caught (how many tests fail, and the emulator's
first report if its checks made one) or MISSED. Exit status 0 when every mutation is caught.
Not part of tests/run.sh: it rebuilds the emulated backend once per mutation (minutes).

    tests/simt/mutation_check.py [BUILD_DIR]
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (what, file, exact text, replacement)
MUTATIONS = [
    ("a wrong fragment index in the fused Tiled kernel (a[2] from the second row)",
     "kernels/cuda/tiled.cu",
     "a[2] = PairAt(q_tile, local_row[0] * kPitch + column + 8);",
     "a[2] = PairAt(q_tile, local_row[1] * kPitch + column + 8);"),
    ("no __syncthreads between a tile's load and its use",
     "kernels/cuda/tiled.cu",
     "    __syncthreads();\n    compute(buffer, tile);",
     "    compute(buffer, tile);"),
    ("no __syncthreads before a buffer is refilled (the next tile's copies overwrite it while "
     "other warps still read it)",
     "kernels/cuda/tiled.cu",
     "    compute(buffer, tile);\n    __syncthreads();  // Every warp is done with this buffer before it is refilled.\n",
     "    compute(buffer, tile);\n"),
    ("cp.async.wait_group with the wrong count (2 for 1)",
     "kernels/cuda/tiled.cu",
     "      WaitCopies<1>();",
     "      WaitCopies<2>();"),
    ("an off-by-one in the decode split's merge (the last chunk left out)",
     "kernels/cuda/decode.cu",
     "for (int64_t chunk = 1; chunk < item.chunks; ++chunk) {",
     "for (int64_t chunk = 1; chunk < item.chunks - 1; ++chunk) {"),
]


def build(build_dir):
    subprocess.run(["cmake", "--build", build_dir, "--target", "simt_gpu_test",
                    f"-j{os.cpu_count()}"], check=True, stdout=subprocess.DEVNULL)


def main():
    build_dir = os.path.join(ROOT, sys.argv[1] if len(sys.argv) > 1 else "build/release")
    binary = os.path.join(build_dir, "tests", "simt", "simt_gpu_test")
    missed = 0
    for what, relative, old, new in MUTATIONS:
        path = os.path.join(ROOT, relative)
        with open(path) as f:
            original = f.read()
        if original.count(old) != 1:
            sys.exit(f"{relative}: the text to mutate occurs {original.count(old)} times, not once")
        try:
            with open(path, "w") as f:
                f.write(original.replace(old, new))
            build(build_dir)
            run = subprocess.run([binary], capture_output=True, text=True, timeout=1800)
        finally:
            with open(path, "w") as f:
                f.write(original)
        out = run.stdout + run.stderr
        if run.returncode == 0:
            print(f"MISSED: {what}")
            missed += 1
            continue
        failed = len(re.findall(r"^\[  FAILED  \] .*\(\d+ ms\)$", out, re.M))
        report = next((l for l in out.splitlines() if l.startswith("simt: ")), None)
        print(f"caught: {what}: {failed} tests fail" + (f"; first report: {report}" if report else ""))
    build(build_dir)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
