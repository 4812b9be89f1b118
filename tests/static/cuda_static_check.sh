#!/usr/bin/env bash
# Static checks of the fused Tiled kernels (kernels/cuda/tiled.cu) and the split-KV decode
# kernels (kernels/cuda/decode.cu) that need no GPU; ctest label cuda-static
# (tests/static/CMakeLists.txt).
#
#   cuda_static_check.sh <nvcc> <source dir> <tiled_shared_bytes> "<architectures, e.g. 80;90>"
#
# For every architecture XX in the list, tiled.cu is compiled once as the build does it
# (nvcc -std=c++20 -O3, -gencode arch=compute_XX,code=sm_XX) with ptxas' report (-Xptxas -v) and
# its PTX kept (-keep: the same PTX that `nvcc -ptx` writes for compute_XX). Then, per kernel:
#   ptxas  MmaKernel<T, P> and Fp32Kernel<P>: "0 bytes stack frame, 0 bytes spill stores,
#          0 bytes spill loads"; and exactly 12 such entries (3 dtypes × 4 pitches), each one
#          that tiled_shared_bytes lists, so that a rename cannot make the check vacuous.
#          RowKernel (Tiled's unfused fallback): the same, reported once, and no mma in its PTX.
#   ptx    MmaKernel<__half, P>: mma.sync.aligned.m16n8k16 ….f16.f16… and no other mma;
#          MmaKernel<__nv_bfloat16, P>: the same in bf16; Fp32Kernel<P>: no mma of any kind and
#          no tf32 (the exact fp32 path). Read per .entry body; mma in a .func (outside every
#          entry body) fails too, since no entry could be credited or blamed for it.
#   smem   the dynamic shared memory tiled_shared_bytes reports (FusedSharedBytes) plus the
#          static shared memory ptxas reports fits the architecture's opt-in maximum per block.
#   decode decode.cu compiled the same way: DecodeKernel<T, P> (4 dtypes, fp8's codes as
#          unsigned char, × 5 pitches, 32 … 256 and the wide 576; exactly 20 entries, each one that `tiled_shared_bytes --decode`
#          lists) and MergeKernel (once): 0 bytes stack frame, 0 spill stores, 0 spill loads
#          each, and no mma in either; each DecodeKernel's dynamic shared memory
#          (DecodeSharedBytes, from `tiled_shared_bytes --decode`) plus the static shared memory
#          ptxas reports fits the architecture's opt-in maximum. (A static_assert in decode.cu
#          holds them to the smallest, 99 KB, as well.)
# One PASS/FAIL line per check, then `cuda-static: N passed, M failed`; exit status 1 on any
# failure, 2 on bad arguments.
set -euo pipefail

if [[ $# -ne 4 ]]; then
  echo "usage: $0 <nvcc> <source dir> <tiled_shared_bytes> \"<architectures, e.g. 80;90>\"" >&2
  exit 2
fi
nvcc=$1
src=$2
footprint=$3
arch_list=$4
source_file=$src/kernels/cuda/tiled.cu
decode_file=$src/kernels/cuda/decode.cu
for path in "$nvcc" "$footprint"; do
  [[ -x $path ]] || { echo "$0: not an executable: $path" >&2; exit 2; }
done
for path in "$source_file" "$decode_file"; do
  [[ -f $path ]] || { echo "$0: no such file: $path" >&2; exit 2; }
done

# Opt-in maximum dynamic shared memory per block (cudaFuncAttributeMaxDynamicSharedMemorySize,
# = cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes. The SM's shared memory less the 1 KB the
# driver reserves per block:
#   8.0  163 KB = 166912: NVIDIA Ampere Tuning Guide, §Occupancy: "For devices of compute
#        capability 8.0 (i.e., A100 GPUs) the maximum shared memory per thread block is 163 KB.
#        For GPUs with compute capability 8.6 maximum shared memory per thread block is 99 KB."
#        https://docs.nvidia.com/cuda/ampere-tuning-guide/index.html
#        (the A100's largest carve-out is 164 KB per SM, cuda_occupancy.h).
#   8.6   99 KB = 101376: same sentence.
#   9.0  227 KB = 232448: NVIDIA Hopper Tuning Guide, §Occupancy and §Unified Shared
#        Memory/L1/Texture Cache (228 KB per SM, 1 KB reserved per block, so one block may
#        address up to 227 KB), https://docs.nvidia.com/cuda/hopper-tuning-guide/index.html;
#        CUTLASS hard-codes the same figure (sm90_smem_capacity_bytes = 232448 in
#        include/cutlass/gemm/collective/builders/sm90_common.inl) and
#        cuda_occupancy.h lists 228 KB as the largest compute capability 9.x carve-out.
#   10.0 227 KB = 232448, 12.0 99 KB = 101376: NVIDIA Blackwell Tuning Guide, §Occupancy,
#        https://docs.nvidia.com/cuda/blackwell-tuning-guide/index.html
# The CUDA C++ Programming Guide's "Technical Specifications per Compute Capability" table
# ("Maximum amount of shared memory per thread block") gives the same figures. An architecture
# not listed here fails its shared-memory checks rather than being waved through.
optin_limit() {
  case $1 in
    80) echo 166912 ;;
    86) echo 101376 ;;
    90) echo 232448 ;;
    100) echo 232448 ;;
    120) echo 101376 ;;
    *) echo "" ;;
  esac
}

readonly kExpectedKernels=12  # 3 dtypes (f32, f16, bf16) × 4 pitches (32, 64, 128, 256).
readonly kExpectedDecodeKernels=20  # 4 dtypes (f32, f16, bf16, fp8) × 5 pitches (32, 64, 128, 256, 576).

work=$(mktemp -d "${TMPDIR:-/tmp}/cuda_static_check.XXXXXX")
cleanup() {
  local pids
  mapfile -t pids < <(jobs -pr)
  if [[ ${#pids[@]} -gt 0 ]]; then kill "${pids[@]}" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

passed=0
failed=0
pass() {
  echo "PASS $*"
  passed=$((passed + 1))
}
fail() {
  echo "FAIL $*"
  failed=$((failed + 1))
}

# --- The architectures: "80;90", also "80-real", "90a", commas or spaces ---------------------
archs=()
IFS=';, ' read -r -a raw_archs <<<"$arch_list"
for raw in "${raw_archs[@]}"; do
  [[ -z $raw ]] && continue
  arch=${raw%-real}
  arch=${arch%-virtual}
  if [[ ! $arch =~ ^[0-9]+[a-z]?$ ]]; then
    echo "$0: cannot check architecture '$raw' (give numbers, e.g. 80;90)" >&2
    exit 2
  fi
  [[ " ${archs[*]} " == *" $arch "* ]] || archs+=("$arch")
done
if [[ ${#archs[@]} -eq 0 ]]; then
  echo "$0: no architectures given" >&2
  exit 2
fi

# --- Compile tiled.cu once per architecture, all in parallel ---------------------------------
declare -A compile_pid decode_pid
for arch in "${archs[@]}"; do
  mkdir -p "$work/sm_$arch"
  "$nvcc" -std=c++20 -O3 -DNDEBUG -DATTN_HAVE_CUDA=1 -I"$src" \
    -gencode "arch=compute_$arch,code=sm_$arch" -Xptxas -v -keep -keep-dir "$work/sm_$arch" \
    -c "$source_file" -o "$work/sm_$arch/tiled.o" >"$work/sm_$arch/compile.log" 2>&1 &
  compile_pid[$arch]=$!
  mkdir -p "$work/sm_$arch/decode"
  "$nvcc" -std=c++20 -O3 -DNDEBUG -DATTN_HAVE_CUDA=1 -I"$src" \
    -gencode "arch=compute_$arch,code=sm_$arch" -Xptxas -v -keep -keep-dir "$work/sm_$arch/decode" \
    -c "$decode_file" -o "$work/sm_$arch/decode/decode.o" >"$work/sm_$arch/decode/compile.log" 2>&1 &
  decode_pid[$arch]=$!
done

# --- The launch footprint: `dtype pitch shared_bytes block_k` per kernel --------------------
footprint_ok=1
if ! "$footprint" >"$work/footprint.txt" 2>"$work/footprint.err"; then
  fail "tiled_shared_bytes: exited with an error: $(tr '\n' ' ' <"$work/footprint.err")"
  footprint_ok=0
elif ! awk 'NF != 4 || $1 !~ /^(f32|f16|bf16)$/ || $2 !~ /^(32|64|128|256)$/ ||
            $3 !~ /^[0-9]+$/ || $4 !~ /^[1-9][0-9]*$/ { bad = 1 }
            { seen[$1 " " $2]++ }
            END { exit bad || NR != 12 || length(seen) != 12 }' "$work/footprint.txt"; then
  fail "tiled_shared_bytes: expected 12 distinct lines 'dtype pitch shared_bytes block_k'," \
    "got: $(tr '\n' '|' <"$work/footprint.txt")"
  footprint_ok=0
else
  pass "tiled_shared_bytes: 12 kernels (f32, f16, bf16 × 32, 64, 128, 256)"
fi

# The decode kernel's footprint: `dtype pitch shared_bytes rows keys` per instance.
decode_footprint_ok=1
if ! "$footprint" --decode >"$work/decode_footprint.txt" 2>"$work/decode_footprint.err"; then
  fail "tiled_shared_bytes --decode: exited with an error: $(tr '\n' ' ' <"$work/decode_footprint.err")"
  decode_footprint_ok=0
elif ! awk -v want="$kExpectedDecodeKernels" '
            NF != 5 || $1 !~ /^(f32|f16|bf16|fp8_e4m3)$/ || $2 !~ /^(32|64|128|256|576)$/ ||
            $3 !~ /^[0-9]+$/ || $4 !~ /^[1-9][0-9]*$/ || $5 !~ /^[1-9][0-9]*$/ { bad = 1 }
            { seen[$1 " " $2]++ }
            END { exit bad || NR != want || length(seen) != want }' \
    "$work/decode_footprint.txt"; then
  fail "tiled_shared_bytes --decode: expected $kExpectedDecodeKernels distinct lines" \
    "'dtype pitch shared_bytes rows keys', got: $(tr '\n' '|' <"$work/decode_footprint.txt")"
  decode_footprint_ok=0
else
  pass "tiled_shared_bytes --decode: $kExpectedDecodeKernels kernels (f32, f16, bf16, fp8_e4m3 × 32, 64, 128, 256, 576)"
fi

# The kernel a footprint line describes: a readable label, and a fragment of its mangled name
# ("9MmaKernelI6__halfLi64EE" = MmaKernel<__half, 64>).
kernel_label() {
  case $1 in
    f32) echo "Fp32Kernel<$2>" ;;
    f16) echo "MmaKernel<__half,$2>" ;;
    bf16) echo "MmaKernel<__nv_bfloat16,$2>" ;;
  esac
}
kernel_fragment() {
  case $1 in
    f32) echo "10Fp32KernelILi${2}EE" ;;
    f16) echo "9MmaKernelI6__halfLi${2}EE" ;;
    bf16) echo "9MmaKernelI13__nv_bfloat16Li${2}EE" ;;
  esac
}
decode_label() {
  case $1 in
    f32) echo "DecodeKernel<float,$2>" ;;
    f16) echo "DecodeKernel<__half,$2>" ;;
    bf16) echo "DecodeKernel<__nv_bfloat16,$2>" ;;
    fp8_e4m3) echo "DecodeKernel<unsigned char,$2>" ;;
  esac
}
decode_fragment() {
  case $1 in
    f32) echo "12DecodeKernelIfLi${2}EE" ;;
    f16) echo "12DecodeKernelI6__halfLi${2}EE" ;;
    bf16) echo "12DecodeKernelI13__nv_bfloat16Li${2}EE" ;;
    fp8_e4m3) echo "12DecodeKernelIhLi${2}EE" ;;
  esac
}

# ptxas -v → one line per entry function: name stack spill_stores spill_loads registers smem.
parse_ptxas() {
  awk '
    /Compiling entry function/ {
      name = $0
      sub(/^.*Compiling entry function \047/, "", name)
      sub(/\047.*$/, "", name)
      entry = name; props = ""; order[++n] = name
      stack[name] = "?"; st[name] = "?"; ld[name] = "?"; regs[name] = "?"; smem[name] = 0
      next
    }
    /Function properties for / {
      props = $0
      sub(/^.*Function properties for /, "", props)
      next
    }
    /bytes stack frame/ && props == entry && entry != "" {
      if (match($0, /[0-9]+ bytes stack frame/)) stack[entry] = substr($0, RSTART, RLENGTH) + 0
      if (match($0, /[0-9]+ bytes spill stores/)) st[entry] = substr($0, RSTART, RLENGTH) + 0
      if (match($0, /[0-9]+ bytes spill loads/)) ld[entry] = substr($0, RSTART, RLENGTH) + 0
      next
    }
    /Used [0-9]+ registers/ && entry != "" {
      if (match($0, /Used [0-9]+ registers/)) {
        r = substr($0, RSTART + 5, RLENGTH - 5); regs[entry] = r + 0
      }
      if (match($0, /[0-9]+ bytes smem/)) smem[entry] = substr($0, RSTART, RLENGTH) + 0
      next
    }
    END { for (i = 1; i <= n; ++i) print order[i], stack[order[i]], st[order[i]], ld[order[i]], regs[order[i]], smem[order[i]] }
  ' "$1"
}

# PTX → one line per .entry/.func: kind name mma f16_m16n8k16 bf16_m16n8k16 tf32, counting the
# instructions of its body (from the header to the first "}" in column 0).
parse_ptx() {
  awk '
    function flush() { if (name != "") print kind, name, mma, f16, bf16, tf32; name = "" }
    /^[ \t]*(\.(visible|weak|extern)[ \t]+)*\.(entry|func)[ \t]/ {
      flush()
      kind = ($0 ~ /\.entry[ \t]/) ? "entry" : "func"
      line = $0
      sub(/^.*\.(entry|func)[ \t]+/, "", line)
      sub(/^\([^)]*\)[ \t]*/, "", line)  # A .func return value: .func (.param .b32 r) name(
      sub(/[ \t(;].*$/, "", line)
      name = line; mma = 0; f16 = 0; bf16 = 0; tf32 = 0
      next
    }
    name == "" { next }
    /^}/ { flush(); next }
    {
      code = $0
      sub(/\/\/.*$/, "", code)
      if (match(code, /(^|[^A-Za-z0-9_$])(wgmma|wmma|mma)\.[A-Za-z0-9_.:]*/)) {
        mma++
        if (code ~ /mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32/) f16++
        if (code ~ /mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32/) bf16++
      }
      if (code ~ /tf32/) tf32++
    }
    END { flush() }
  ' "$1"
}

# decode.cu for one architecture: every DecodeKernel<T, P> and the MergeKernel without stack
# frame, spills or mma; every DecodeKernel's shared memory within the opt-in limit.
# The kernel whose mangled name holds FRAGMENT, reported once in the ptxas table FILE: no stack
# frame, no spills (a pass or a fail under LABEL). Returns 1 when it was not reported exactly once.
expect_one_without_spills() {
  local tag=$1 label=$2 fragment=$3 file=$4
  local matches stack spill_st spill_ld regs report
  matches=$(awk -v f="$fragment" 'index($1, f) { n++ } END { print n + 0 }' "$file")
  if [[ $matches -ne 1 ]]; then
    fail "$tag ptxas $label: reported $matches times (expected once)"
    return 1
  fi
  read -r _ stack spill_st spill_ld regs _ < <(awk -v f="$fragment" 'index($1, f)' "$file")
  report="$stack bytes stack frame, $spill_st bytes spill stores, $spill_ld bytes spill loads"
  if [[ $stack == 0 && $spill_st == 0 && $spill_ld == 0 ]]; then
    pass "$tag ptxas $label: $report ($regs registers)"
  else
    fail "$tag ptxas $label: $report ($regs registers); expected 0, 0, 0"
  fi
}

check_decode() {
  local arch=$1 dir=$work/sm_$1/decode tag="sm_$1"
  if ! wait "${decode_pid[$arch]}"; then
    fail "$tag compile: nvcc failed on kernels/cuda/decode.cu; its output ends:"
    tail -n 15 "$dir/compile.log" | sed 's/^/    /'
    return
  fi
  local ptx_files
  shopt -s nullglob
  ptx_files=("$dir"/*.ptx)
  shopt -u nullglob
  if [[ ${#ptx_files[@]} -ne 1 ]]; then
    fail "$tag compile: expected one kept PTX file for decode.cu, found ${#ptx_files[@]}"
    return
  fi
  pass "$tag compile: kernels/cuda/decode.cu (ptxas -v, PTX for compute_$arch)"
  parse_ptxas "$dir/compile.log" >"$dir/ptxas.txt"
  parse_ptx "${ptx_files[0]}" >"$dir/ptx.txt"
  local limit entries label fragment matches stack spill_st spill_ld regs static_smem report
  local dtype pitch shared_bytes rows keys total sizes mma
  limit=$(optin_limit "${arch%[a-z]}")

  # ptxas reported every DecodeKernel instance, and no more than there are.
  entries=$(awk 'index($1, "12DecodeKernel") { n++ } END { print n + 0 }' "$dir/ptxas.txt")
  if [[ $entries -eq $kExpectedDecodeKernels ]]; then
    pass "$tag ptxas: $entries DecodeKernel entry functions reported (expected $kExpectedDecodeKernels)"
  else
    fail "$tag ptxas: $entries DecodeKernel entry functions reported (expected" \
      "$kExpectedDecodeKernels: DecodeKernel<float|__half|__nv_bfloat16|unsigned char, P>, P = 32, 64, 128, 256, 576)"
  fi

  # Each instance the footprint lists: no stack frame, no spills; shared memory within the limit.
  if [[ $decode_footprint_ok -eq 1 ]]; then
    while read -r dtype pitch shared_bytes rows keys; do
      label=$(decode_label "$dtype" "$pitch")
      fragment=$(decode_fragment "$dtype" "$pitch")
      matches=$(awk -v f="$fragment" 'index($1, f) { n++ } END { print n + 0 }' "$dir/ptxas.txt")
      if [[ $matches -ne 1 ]]; then
        fail "$tag ptxas $label: reported $matches times (expected once)"
        continue
      fi
      read -r _ stack spill_st spill_ld regs static_smem < <(
        awk -v f="$fragment" 'index($1, f)' "$dir/ptxas.txt")
      report="$stack bytes stack frame, $spill_st bytes spill stores, $spill_ld bytes spill loads"
      if [[ $stack == 0 && $spill_st == 0 && $spill_ld == 0 ]]; then
        pass "$tag ptxas $label: $report ($regs registers; $rows rows × $keys keys)"
      else
        fail "$tag ptxas $label: $report ($regs registers); expected 0, 0, 0"
      fi
      total=$((shared_bytes + static_smem))
      sizes="$shared_bytes dynamic + $static_smem static = $total bytes"
      if [[ -z $limit ]]; then
        fail "$tag smem $label: $sizes; no opt-in limit known for sm_$arch (add it to $0)"
      elif [[ $total -le $limit ]]; then
        pass "$tag smem $label: $sizes ≤ $limit (opt-in maximum per block)"
      else
        fail "$tag smem $label: $sizes > $limit (opt-in maximum per block)"
      fi
    done <"$work/decode_footprint.txt"
  fi

  # The merge kernel: no stack frame, no spills.
  expect_one_without_spills "$tag" MergeKernel 11MergeKernel "$dir/ptxas.txt"

  # Neither uses tensor cores (fp32 FMA).
  for fragment in 12DecodeKernel 11MergeKernel; do
    label=${fragment#??}
    mma=$(awk -v f="$fragment" '$1 == "entry" && index($2, f) { n += $3 } END { print n + 0 }' \
      "$dir/ptx.txt")
    if [[ $mma -eq 0 ]]; then
      pass "$tag ptx $label: no mma (fp32 FMA)"
    else
      fail "$tag ptx $label: $mma mma instructions (expected none)"
    fi
  done
}

for arch in "${archs[@]}"; do
  check_decode "$arch"
  dir=$work/sm_$arch
  tag="sm_$arch"
  if ! wait "${compile_pid[$arch]}"; then
    fail "$tag compile: nvcc failed on kernels/cuda/tiled.cu; its output ends:"
    tail -n 15 "$dir/compile.log" | sed 's/^/    /'
    continue
  fi
  shopt -s nullglob
  ptx_files=("$dir"/*.ptx)
  shopt -u nullglob
  if [[ ${#ptx_files[@]} -ne 1 ]]; then
    fail "$tag compile: expected one kept PTX file, found ${#ptx_files[@]}"
    continue
  fi
  pass "$tag compile: kernels/cuda/tiled.cu (ptxas -v, PTX for compute_$arch)"

  parse_ptxas "$dir/compile.log" >"$dir/ptxas.txt"
  parse_ptx "${ptx_files[0]}" >"$dir/ptx.txt"

  # ptxas reported every fused kernel, and no more than the 12 there are.
  reported=$(awk '$1 ~ /MmaKernel|Fp32Kernel/ { n++ } END { print n + 0 }' "$dir/ptxas.txt")
  if [[ $reported -eq $kExpectedKernels ]]; then
    pass "$tag ptxas: $reported fused Tiled entry functions reported (expected $kExpectedKernels)"
  else
    fail "$tag ptxas: $reported fused Tiled entry functions reported (expected $kExpectedKernels:" \
      "MmaKernel<__half|__nv_bfloat16, P> and Fp32Kernel<P>, P = 32, 64, 128, 256)"
  fi

  # mma in a device function (a .func body) is in no entry body: refuse to guess whose it is.
  stray=$(awk '$1 == "func" && $3 > 0 { printf "%s%s", sep, $2; sep = ", " }' "$dir/ptx.txt")
  if [[ -z $stray ]]; then
    pass "$tag ptx: no mma outside the entry bodies"
  else
    fail "$tag ptx: mma in device functions outside every entry body: $stray"
  fi

  # The row kernel (Tiled at any block_k, or where a fused kernel's shared memory does not fit
  # the device): no stack frame and no spills either, and no mma.
  if expect_one_without_spills "$tag" RowKernel 9RowKernel "$dir/ptxas.txt"; then
    row_mma=$(awk '$1 == "entry" && index($2, "9RowKernel") { print $3 }' "$dir/ptx.txt")
    if [[ $row_mma == 0 ]]; then
      pass "$tag ptx RowKernel: no mma"
    else
      fail "$tag ptx RowKernel: ${row_mma:-no entry} mma instructions (expected 0)"
    fi
  fi

  limit=$(optin_limit "${arch%[a-z]}")
  [[ $footprint_ok -eq 1 ]] || continue
  while read -r dtype pitch shared_bytes _; do
    label=$(kernel_label "$dtype" "$pitch")
    fragment=$(kernel_fragment "$dtype" "$pitch")

    # (a) No stack frame, no spills.
    matches=$(awk -v f="$fragment" 'index($1, f) { n++ } END { print n + 0 }' "$dir/ptxas.txt")
    static_smem=0
    if [[ $matches -ne 1 ]]; then
      fail "$tag ptxas $label: reported $matches times (expected once)"
    else
      read -r _ stack spill_st spill_ld regs static_smem < <(
        awk -v f="$fragment" 'index($1, f)' "$dir/ptxas.txt")
      report="$stack bytes stack frame, $spill_st bytes spill stores, $spill_ld bytes spill loads"
      if [[ $stack == 0 && $spill_st == 0 && $spill_ld == 0 ]]; then
        pass "$tag ptxas $label: $report ($regs registers)"
      else
        fail "$tag ptxas $label: $report ($regs registers); expected 0, 0, 0"
      fi
    fi

    # (b) Tensor cores in the fp16/bf16 bodies, none in the fp32 body.
    entries=$(awk -v f="$fragment" '$1 == "entry" && index($2, f) { n++ } END { print n + 0 }' \
      "$dir/ptx.txt")
    if [[ $entries -ne 1 ]]; then
      fail "$tag ptx $label: $entries .entry blocks (expected 1)"
    else
      read -r _ _ n_mma n_f16 n_bf16 n_tf32 < <(
        awk -v f="$fragment" '$1 == "entry" && index($2, f)' "$dir/ptx.txt")
      case $dtype in
        f16 | bf16)
          if [[ $dtype == f16 ]]; then want=$n_f16; else want=$n_bf16; fi
          instruction="mma.sync.aligned.m16n8k16.row.col.f32.$dtype.$dtype.f32"
          if [[ $want -gt 0 && $want -eq $n_mma ]]; then
            pass "$tag ptx $label: $want × $instruction"
          else
            fail "$tag ptx $label: $want × $instruction among $n_mma mma instructions" \
              "(expected at least one, and no other kind)"
          fi
          ;;
        f32)
          if [[ $n_mma -eq 0 && $n_tf32 -eq 0 ]]; then
            pass "$tag ptx $label: no mma, no tf32 (exact fp32)"
          else
            fail "$tag ptx $label: $n_mma mma and $n_tf32 tf32 instructions (expected none)"
          fi
          ;;
      esac
    fi

    # (c) Shared memory: dynamic + static within the opt-in maximum.
    total=$((shared_bytes + static_smem))
    sizes="$shared_bytes dynamic + $static_smem static = $total bytes"
    if [[ -z $limit ]]; then
      fail "$tag smem $label: $sizes; no opt-in limit known for sm_$arch (add it to $0)"
    elif [[ $total -le $limit ]]; then
      pass "$tag smem $label: $sizes ≤ $limit (opt-in maximum per block)"
    else
      fail "$tag smem $label: $sizes > $limit (opt-in maximum per block)"
    fi
  done <"$work/footprint.txt"
done

echo "cuda-static: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
