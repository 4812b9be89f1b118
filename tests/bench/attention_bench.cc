// attention_bench: Naive and Tiled on the CPU backend beside the machine's single-precision GEMM
// rate (OpenBLAS cblas_sgemm), measured in the same process, in the same run, so that every
// attention figure can be read as a fraction of the peak measured right then. Google Benchmark;
// not a ctest test: tests/bench/run.sh runs it (JSON) and prints one table of ratios.
//
// Only the sgemm rows call OpenBLAS (the backend's kernels are the project's own), on the kernels
// the library picks: its own choice, or OPENBLAS_CORETYPE's. Debian's OpenBLAS 0.3.21 may not
// know a new CPU and pick old kernels, so tests/bench/run.sh measures the sgemm ceiling under
// every core type the CPU allows, one child process each (--methods=sgemm with OPENBLAS_CORETYPE
// set), and runs the other rows with the best. The context reports the core (openblas_corename).
//
// Rows, in this order:
//   sgemm/N:<n>/at:begin                      an n×n×n cblas_sgemm (2·n³ FLOP) on `threads`
//                                             threads, for each n of --sgemm_n
//   memread/MiB:<m>/at:begin                 (decode or memory methods) a sum of an m MiB fp32
//                                             buffer on `threads` threads (16 lanes where the CPU
//                                             has AVX-512F, else 8): the memory-read ceiling, once
//                                             at --memread_mib and (decode) once at the largest
//                                             decode cache's size
//   memcopy/MiB:<m>/at:begin                 (decode or memory methods) memcpy of an m MiB buffer
//                                             into another (--memcopy_mib), `threads` workers
//                                             each copying one contiguous part; GB/s counts the
//                                             bytes read and written (2·m MiB, STREAM's way)
//   <decode method>/<dtype>/B:<b>/N:<n>/H:<h>/KV:<kv>/d:<d>   one decode step of a batch of b
//                                             sequences of n cached tokens (server-resident, paged
//                                             stores), 1 query row each; for dtype, shape
//   memread/..., memcopy/.../at:end           the memory ceilings again
//   <method>/<dtype>/causal:<0|1>/N:<n>/H:<h>/d:<d>   for d, dtype, causal, N (ascending), method
//   sgemm/N:<n>/at:end                        the same sgemm again, to show drift during the run
// Counters of an attention row: GFLOP/s = 4·B·H·N²·d (halved when causal) / time; peak_bytes =
// the backend's Stats::peak_memory_bytes (the peak extra memory of the call: scratch + output);
// scratch_bytes; intermediate_bytes (Naive: the explainer's score/weight traffic);
// block_k. A refused row (Naive past its budget) is an error row whose message starts with the
// status code, e.g. "RESOURCE_EXHAUSTED: Naive needs ...".
//
// Method naive_gemm (fp32, non-causal rows only): Naive's two matrix products alone, the same
// KvTile calls NaiveRows makes (kernels/cpu/naive.cc) for every 128-row block of every head —
// each worker packs a head once as one tile, then S = scale·Q·Kᵀ into the block's rows of an
// [H, N, N] score matrix, then O = S·V — on `threads` workers, as the backend runs them; no
// softmax, no allocation (the matrix is allocated and touched once, outside the timing). The
// packing is timed, as Naive pays it. GFLOP/s counts the same 4·H·N²·d as the attention rows:
// read it against the sgemm ceiling.
//
// Shapes: B = 1, self-attention (Nq = Nk = N), kv_heads = heads, value_dim = head_dim, inputs
// uniform(−1, 1) in the row's dtype, output in the same dtype, no lse. Heads default to 8 for
// N ≤ 4096 and to max(1, 8·4096²/N²) above, so the big-N rows stay a few seconds each on two
// cores (N = 32768 has H = 1, the shape of the memory target).
//
// Decode rows (methods decode, decode_tiled): `decode` is Backend::Decode (the CPU decode kernel,
// kernels/cpu/decode.h), `decode_tiled` the same step as Tiled calls, one per sequence (the
// Backend default). Counter GB/s = cache bytes read per step, b·kv·n·(d + dv)·element size, per
// second: compare it with the memread and memcopy rows' GB/s.
//
// Naive runs up to --naive_max_n; above it a Naive row is registered only when its score and
// weight matrices pass the budget (--naive_budget_gib, default 4 GiB), so the backend refuses it
// at once (RESOURCE_EXHAUSTED) instead of allocating. One such refusal row (N = 32768, H = 1,
// d = 64, fp32, non-causal) is always registered, also in --quick, when Naive is among the
// methods.
//
// Flags (before or among Google Benchmark's own --benchmark_* flags):
//   --threads=N        worker threads for the backend and OpenBLAS (default $ATTN_BENCH_THREADS,
//                      else 2)
//   --quick            a smoke run of a few seconds: N 256,1024; d 64; sgemm 1024; short min time
//   --n=LIST --d=LIST --dtype=fp32,bf16 --causal=0,1   (--dtype also fp16, and fp8: a cache's
//                      dtype, so decode rows only; their queries and outputs are bf16)
//   --methods=LIST     of tiled, naive, naive_gemm, decode, decode_tiled, sgemm, memory (default
//                      tiled,naive). sgemm alone: only the sgemm rows (run.sh's ceiling probes);
//                      memory: the memory ceilings without decode rows. The sgemm rows are
//                      always registered.
//   --heads=H          fixed heads for every N (default 0: the policy above)
//   --window_left=L    a sliding window on every attention row (AttentionOptions.window_left;
//                      default -1: none); the row's name ends /window:L and its GFLOP/s counts
//                      the pairs the window leaves (Problem::Flops)
//   --softcap=C        a softcap on every attention row (AttentionOptions.softcap; default 0:
//                      none); the row's name ends /softcap:C
//   --alibi            ALiBi on every attention row: head h's slope 2^(−8(h+1)/H)
//                      (AttentionOptions.alibi_slopes); the row's name ends /alibi
//   --ragged=L1,L2,... also Tiled over a ragged batch of self-attention sequences of these
//                      lengths (AttentionRequest.cu_seqlens_q/k), for every d, dtype and causal:
//                      ragged/<dtype>/causal:<c>/seqs:<S>/N:<total>/H:<h>/d:<d>/packed (one call
//                      over the packed batch) and .../one_by_one (each sequence a call of its own,
//                      in turn); GFLOP/s counts the pairs each sequence sees (Problem::Flops)
//   --naive_max_n=N    largest N Naive runs at (default 8192; --quick 1024)
//   --naive_budget_gib=G   the backend's max_naive_bytes (default 4)
//   --sgemm_n=LIST     the ceiling's sizes (default 2048; --quick 1024)
//   --block_k=K        keys per tile (default: the backend's default_block_k)
//   --min_time=S       Google Benchmark's minimum time per row (default 0.5; --quick 0.05)
//   --deadline_s=S     attention rows that would start after S seconds report "timeout" (default
//                      0: none); the sgemm rows always run
//   --no_refusal       do not add the explicit refusal row
//   --decode_shapes=BxN,...   decode batches × cache lengths (default 1x32768,16x4096; --quick
//                      1x4096,4x1024); rows only when --methods names decode or decode_tiled
//   --decode_heads=HxKV  query heads × kv heads of the decode rows (default 32x8)
//   --decode_d=D       head_dim = value_dim of the decode rows (default 128)
//   --decode_latent=DV latent caches (values_from_keys: MLA, as DeepSeek-V3 decodes): value_dim DV
//                      (≤ D), each value the first DV columns of its key; the rows then also
//                      count GFLOP/s (read it against the sgemm rows: 128 query heads over one
//                      latent head is bound by compute)
//   --decode_forks=OWN each decode batch's sequences are forks of one N-token prompt
//                      (KvStore::Fork, as ForkCache makes them), each with OWN tokens of its own
//                      appended; rows named .../forks_own:OWN. Their pages shared, the decode
//                      kernel runs the prompt once for the batch (cascade): compare B:16 with B:1
//   --memread_mib=M    the memory-read ceiling's buffer (default 1024, well past the L3 cache;
//                      --quick 256)
//   --memcopy_mib=M    the copy ceiling's source (and destination) buffer (default 1024; --quick
//                      256)
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "benchmark/benchmark.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_dispatch.h"
#include "kernels/cpu/kv_tile.h"
#include "kernels/cpu/row_blocks.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/dtype.h"
#include "kernels/lanes.h"
#include "kernels/problem.h"
#include "tests/reference.h"

namespace {

using attn::DType;
using Clock = std::chrono::steady_clock;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Problems above this many FLOPs get no untimed warm-up call (its cost would double theirs, and
// one call of that size is not sensitive to cold caches or thread start-up).
constexpr double kWarmupMaxFlops = 8e9;

struct Options {
  int threads = 2;
  bool quick = false;
  std::vector<int64_t> seqs = {256, 512, 1024, 2048, 4096, 8192, 16384, 32768};
  std::vector<int64_t> dims = {64, 128};
  std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16};
  std::vector<int64_t> causal = {0, 1};
  std::vector<std::string> methods = {"tiled", "naive"};
  int64_t heads = 0;
  int64_t window_left = -1;
  double softcap = 0;
  bool alibi = false;
  std::vector<int64_t> ragged;  // Sequence lengths of the ragged rows; empty: none.
  int64_t naive_max_n = 8192;
  double naive_budget_gib = 4;
  std::vector<int64_t> sgemm_n = {2048};
  int block_k = 0;
  double min_time = 0.5;
  double deadline_s = 0;
  bool refusal = true;
  std::vector<std::pair<int64_t, int64_t>> decode_shapes = {{1, 32768}, {16, 4096}};
  int64_t decode_heads = 32, decode_kv_heads = 8, decode_d = 128, decode_latent_dv = 0;
  int64_t decode_forks_own = 0;  // > 0: forks of one prompt, this many tokens of their own.
  int64_t memread_mib = 1024;
  int64_t memcopy_mib = 1024;
};

struct Cell {
  std::string method;
  DType dtype = DType::kFloat32;
  bool causal = false;
  int64_t n = 0;
  int64_t heads = 0;
  int64_t d = 0;
  int64_t window_left = -1;  // −1: none.
  double softcap = 0;        // 0: none.
  bool alibi = false;

  std::string Name() const {
    return absl::StrCat(
        method, "/", DTypeLabel(dtype), "/causal:", causal ? 1 : 0, "/N:", n, "/H:", heads,
        "/d:", d, window_left >= 0 ? absl::StrCat("/window:", window_left) : "",
        softcap > 0 ? absl::StrCat("/softcap:", softcap) : "", alibi ? "/alibi" : "");
  }
  static const char* DTypeLabel(DType dtype) {
    return dtype == DType::kFloat32 ? "fp32" : attn::DTypeName(dtype);
  }
  // Naive's fp32 score and weight matrices, as the backend counts them against its budget.
  double NaiveStorageBytes() const { return 2.0 * heads * n * n * 4; }
  // The count: 4·B·H·Nq·Nk·d, halved for causal.
  double Flops() const { return 4.0 * heads * n * n * d * (causal ? 0.5 : 1.0); }
};

Clock::time_point g_start;
double g_deadline_s = 0;

bool DeadlinePassed() {
  return g_deadline_s > 0 &&
         std::chrono::duration<double>(Clock::now() - g_start).count() > g_deadline_s;
}

// The flags, for Usage and --help.
constexpr char kFlags[] =
    "flags: --threads=N --quick --n=LIST --d=LIST --dtype=fp32,bf16,fp16,fp8 (fp8: decode rows "
    "only) --causal=0,1\n"
    "  --methods=tiled,naive,naive_gemm,decode,decode_tiled,sgemm,memory\n"
    "  --heads=H --window_left=L --softcap=C --alibi --ragged=LIST --naive_max_n=N "
    "--naive_budget_gib=G\n"
    "  --sgemm_n=LIST --block_k=K --min_time=S --deadline_s=S --no_refusal\n"
    "  --decode_shapes=BxN,... --decode_heads=HxKV --decode_d=D --decode_latent=DV "
    "--decode_forks=OWN --memread_mib=M\n"
    "  --memcopy_mib=M\n";

[[noreturn]] void Usage(const std::string& problem) {
  std::fprintf(stderr, "attention_bench: %s\n%s  and Google Benchmark's --benchmark_* flags\n",
               problem.c_str(), kFlags);
  std::exit(2);
}

int64_t ParseInt(const std::string& flag, absl::string_view text) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 0) Usage(absl::StrCat("bad value for ", flag));
  return value;
}

double ParseDouble(const std::string& flag, absl::string_view text) {
  double value = 0;
  if (!absl::SimpleAtod(text, &value) || !(value >= 0)) {
    Usage(absl::StrCat("bad value for ", flag));
  }
  return value;
}

std::vector<int64_t> ParseInts(const std::string& flag, absl::string_view text) {
  std::vector<int64_t> values;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const int64_t value = ParseInt(flag, item);
    if (value == 0) Usage(absl::StrCat(flag, " values must be positive"));
    values.push_back(value);
  }
  if (values.empty()) Usage(absl::StrCat(flag, " needs at least one value"));
  return values;
}

// Takes this binary's own flags out of argv (leaving Google Benchmark's).
Options ParseOptions(int* argc, char** argv) {
  Options options;
  if (const char* env = std::getenv("ATTN_BENCH_THREADS"); env != nullptr && *env != '\0') {
    options.threads = static_cast<int>(ParseInt("ATTN_BENCH_THREADS", env));
  }
  // --quick first, so explicit flags override what it sets whatever their order.
  for (int i = 1; i < *argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      options.quick = true;
      options.seqs = {256, 1024};
      options.dims = {64};
      options.naive_max_n = 1024;
      options.sgemm_n = {1024};
      options.min_time = 0.05;
      options.decode_shapes = {{1, 4096}, {4, 1024}};
      options.memread_mib = 256;
      options.memcopy_mib = 256;
    }
  }
  int kept = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string flag = arg.substr(0, eq);
    const absl::string_view value =
        eq == std::string::npos ? absl::string_view() : absl::string_view(arg).substr(eq + 1);
    auto need_value = [&] {
      if (eq == std::string::npos) Usage(absl::StrCat(flag, " needs =VALUE"));
    };
    if (flag == "--quick") {
    } else if (flag == "--no_refusal") {
      options.refusal = false;
    } else if (flag == "--threads") {
      need_value();
      options.threads = static_cast<int>(ParseInt(flag, value));
    } else if (flag == "--n") {
      need_value();
      options.seqs = ParseInts(flag, value);
    } else if (flag == "--d") {
      need_value();
      options.dims = ParseInts(flag, value);
    } else if (flag == "--causal") {
      need_value();
      options.causal.clear();
      for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        if (item != "0" && item != "1") Usage("--causal takes 0 and/or 1");
        options.causal.push_back(item == "1");
      }
      if (options.causal.empty()) Usage("--causal needs at least one value");
    } else if (flag == "--dtype") {
      need_value();
      options.dtypes.clear();
      for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        if (item == "fp32" || item == "f32") {
          options.dtypes.push_back(DType::kFloat32);
        } else if (item == "bf16") {
          options.dtypes.push_back(DType::kBFloat16);
        } else if (item == "fp16" || item == "f16") {
          options.dtypes.push_back(DType::kFloat16);
        } else if (item == "fp8") {  // Decode rows only: a cache's dtype.
          options.dtypes.push_back(DType::kFloat8E4M3);
        } else {
          Usage(absl::StrCat("unknown dtype ", item));
        }
      }
      if (options.dtypes.empty()) Usage("--dtype needs at least one value");
    } else if (flag == "--decode_shapes") {
      need_value();
      options.decode_shapes.clear();
      for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        const std::vector<absl::string_view> parts = absl::StrSplit(item, 'x');
        if (parts.size() != 2) Usage("--decode_shapes takes BxN,...");
        const int64_t b = ParseInt(flag, parts[0]), n = ParseInt(flag, parts[1]);
        if (b == 0 || n == 0) Usage("--decode_shapes values must be positive");
        options.decode_shapes.emplace_back(b, n);
      }
    } else if (flag == "--decode_heads") {
      need_value();
      const std::vector<absl::string_view> parts = absl::StrSplit(value, 'x');
      if (parts.size() != 2) Usage("--decode_heads takes HxKV");
      options.decode_heads = ParseInt(flag, parts[0]);
      options.decode_kv_heads = ParseInt(flag, parts[1]);
      if (options.decode_kv_heads == 0 || options.decode_heads % options.decode_kv_heads != 0) {
        Usage("--decode_heads: kv heads must divide heads");
      }
    } else if (flag == "--decode_d") {
      need_value();
      options.decode_d = ParseInt(flag, value);
      if (options.decode_d == 0) Usage("--decode_d must be positive");
    } else if (flag == "--decode_latent") {
      need_value();
      options.decode_latent_dv = ParseInt(flag, value);
    } else if (flag == "--decode_forks") {
      need_value();
      options.decode_forks_own = ParseInt(flag, value);
    } else if (flag == "--memread_mib") {
      need_value();
      options.memread_mib = ParseInt(flag, value);
      if (options.memread_mib == 0) Usage("--memread_mib must be positive");
    } else if (flag == "--memcopy_mib") {
      need_value();
      options.memcopy_mib = ParseInt(flag, value);
      if (options.memcopy_mib == 0) Usage("--memcopy_mib must be positive");
    } else if (flag == "--methods") {
      need_value();
      options.methods.clear();
      for (absl::string_view item : absl::StrSplit(value, ',', absl::SkipEmpty())) {
        if (item != "tiled" && item != "naive" && item != "naive_gemm" && item != "decode" &&
            item != "decode_tiled" && item != "sgemm" && item != "memory") {
          Usage(absl::StrCat("unknown method ", item));
        }
        options.methods.emplace_back(item);
      }
    } else if (flag == "--heads") {
      need_value();
      options.heads = ParseInt(flag, value);
    } else if (flag == "--window_left") {
      need_value();
      int64_t window = 0;
      if (!absl::SimpleAtoi(value, &window) || window < -1) {
        Usage("--window_left expects an integer >= 0, or -1 for none");
      }
      options.window_left = window;
    } else if (flag == "--softcap") {
      need_value();
      options.softcap = ParseDouble(flag, value);
      if (!(options.softcap >= 0) || !std::isfinite(options.softcap)) {
        Usage("--softcap expects a finite value >= 0");
      }
    } else if (flag == "--alibi") {
      options.alibi = true;
    } else if (flag == "--ragged") {
      need_value();
      options.ragged = ParseInts(flag, value);
    } else if (flag == "--naive_max_n") {
      need_value();
      options.naive_max_n = ParseInt(flag, value);
    } else if (flag == "--naive_budget_gib") {
      need_value();
      options.naive_budget_gib = ParseDouble(flag, value);
    } else if (flag == "--sgemm_n") {
      need_value();
      options.sgemm_n = ParseInts(flag, value);
    } else if (flag == "--block_k") {
      need_value();
      options.block_k = static_cast<int>(ParseInt(flag, value));
    } else if (flag == "--min_time") {
      need_value();
      options.min_time = ParseDouble(flag, value);
    } else if (flag == "--deadline_s") {
      need_value();
      options.deadline_s = ParseDouble(flag, value);
    } else if (flag == "--help" || flag == "-h") {
      std::printf(
          "attention_bench %s  (see tests/bench/attention_bench.cc); Google Benchmark's own "
          "flags follow.\n\n",
          kFlags);
      argv[kept++] = argv[i];
    } else if (flag.rfind("--benchmark_", 0) == 0) {
      argv[kept++] = argv[i];
    } else {
      Usage(absl::StrCat("unknown flag ", arg));
    }
  }
  *argc = kept;
  argv[kept] = nullptr;
  if (options.threads < 1) Usage("--threads must be at least 1");
  if (options.naive_budget_gib <= 0) Usage("--naive_budget_gib must be positive");
  return options;
}

int64_t HeadsFor(const Options& options, int64_t n) {
  if (options.heads > 0) return options.heads;
  if (n <= 4096) return 8;
  return std::max<int64_t>(1, int64_t{8} * 4096 * 4096 / (n * n));
}

void Skip(benchmark::State& state, const std::string& message) {
  state.SkipWithError(message.c_str());
}

std::string StatusText(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

void RunAttention(benchmark::State& state, attn::Backend* backend, const Cell& cell, int block_k) {
  if (DeadlinePassed()) return Skip(state, "timeout: --deadline_s passed before this row ran");

  const attn::Shape shape =
      attn::testing::MakeShape(1, cell.heads, cell.heads, cell.n, cell.n, cell.d, cell.d);
  attn::testing::HostProblem host = attn::testing::RandomProblem(
      shape, cell.dtype, cell.causal, block_k, /*seed=*/0x5eed0000u + cell.n + cell.d);
  host.return_lse = false;
  if (cell.window_left >= 0) host.window_left = cell.window_left;
  host.softcap = static_cast<float>(cell.softcap);
  for (int64_t h = 0; cell.alibi && h < cell.heads; ++h) {
    host.alibi_slopes.push_back(static_cast<float>(std::exp2(-8.0 * (h + 1) / cell.heads)));
  }
  const attn::Problem problem = host.View();

  // The output buffer, poisoned with NaN so that an unwritten element shows after the run.
  std::vector<uint8_t> output(problem.OutputElements() * attn::ElementSize(cell.dtype));
  for (int64_t i = 0; i < problem.OutputElements(); ++i) {
    attn::StoreElement(output.data(), cell.dtype, i, std::numeric_limits<float>::quiet_NaN());
  }
  attn::Outputs outputs;
  outputs.output = attn::MutableTensorView{output.data(), cell.dtype};

  auto call = [&] {
    return cell.method == "naive" ? backend->Naive(problem, outputs)
                                  : backend->Tiled(problem, outputs);
  };
  absl::StatusOr<attn::Stats> stats = absl::UnknownError("not run");
  if (cell.Flops() <= kWarmupMaxFlops) {
    stats = call();
    if (!stats.ok()) return Skip(state, StatusText(stats.status()));
  }
  for (auto _ : state) {
    stats = call();
    if (!stats.ok()) {
      Skip(state, StatusText(stats.status()));
      break;
    }
  }
  if (!stats.ok()) return;

  for (int64_t i = 0; i < problem.OutputElements(); ++i) {
    if (!std::isfinite(attn::LoadElement(output.data(), cell.dtype, i))) {
      return Skip(state, absl::StrCat("bad: output element ", i, " is not finite (unwritten?)"));
    }
  }

  using benchmark::Counter;
  const double flops = cell.window_left >= 0 ? problem.Flops() : cell.Flops();
  state.counters["GFLOP/s"] = Counter(flops / 1e9, Counter::kIsIterationInvariantRate);
  state.counters["peak_bytes"] =
      Counter(static_cast<double>(stats->peak_memory_bytes), Counter::kDefaults, Counter::kIs1024);
  state.counters["scratch_bytes"] =
      Counter(static_cast<double>(stats->scratch_bytes), Counter::kDefaults, Counter::kIs1024);
  if (cell.method == "naive") {
    state.counters["intermediate_bytes"] = Counter(static_cast<double>(stats->intermediate_bytes),
                                                   Counter::kDefaults, Counter::kIs1024);
  }
  state.counters["block_k"] = problem.block_k;
}

// Tiled over a ragged batch of self-attention sequences (Nq = Nk per sequence) of `lengths`,
// packed into one call (`packed`) or run one sequence per call, in turn.
void RunRagged(benchmark::State& state, attn::Backend* backend, const Cell& cell,
               const std::vector<int64_t>& lengths, bool packed, int block_k) {
  if (DeadlinePassed()) return Skip(state, "timeout: --deadline_s passed before this row ran");
  std::vector<attn::testing::HostProblem> hosts;
  const auto make = [&](int64_t rows) -> attn::testing::HostProblem& {
    hosts.push_back(attn::testing::RandomProblem(
        attn::testing::MakeShape(1, cell.heads, cell.heads, rows, rows, cell.d, cell.d), cell.dtype,
        cell.causal, block_k, /*seed=*/0x5eed0000u + rows + hosts.size()));
    hosts.back().return_lse = false;
    return hosts.back();
  };
  if (packed) {
    attn::testing::HostProblem& host = make(cell.n);
    host.cu_seqlens_q = {0};
    for (int64_t length : lengths) host.cu_seqlens_q.push_back(host.cu_seqlens_q.back() + length);
    host.cu_seqlens_k = host.cu_seqlens_q;
  } else {
    for (int64_t length : lengths) make(length);
  }
  std::vector<attn::Problem> problems;
  std::vector<std::vector<uint8_t>> outputs;
  double flops = 0;
  for (const attn::testing::HostProblem& host : hosts) {
    problems.push_back(host.View());
    flops += problems.back().Flops();
    outputs.emplace_back(problems.back().OutputElements() * attn::ElementSize(cell.dtype));
  }
  auto call = [&]() -> absl::Status {
    for (size_t i = 0; i < problems.size(); ++i) {
      attn::Outputs out;
      out.output = attn::MutableTensorView{outputs[i].data(), cell.dtype};
      if (absl::StatusOr<attn::Stats> stats = backend->Tiled(problems[i], out); !stats.ok()) {
        return stats.status();
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status warm = call(); !warm.ok()) return Skip(state, StatusText(warm));
  for (auto _ : state) {
    if (absl::Status run = call(); !run.ok()) return Skip(state, StatusText(run));
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

struct DecodeCell {
  std::string method;  // "decode" or "decode_tiled".
  DType dtype = DType::kBFloat16;
  int64_t batch = 1, n = 0, heads = 32, kv_heads = 8, d = 128;
  int64_t latent_dv = 0;  // > 0: a latent cache of value_dim latent_dv.
  int64_t forks_own = 0;  // > 0: forks of one n-token prompt, each with this many of its own.

  int64_t ValueDim() const { return latent_dv > 0 ? latent_dv : d; }
  int64_t Length() const { return n + forks_own; }  // Each sequence's.
  std::string Name() const {
    return absl::StrCat(method, "/", Cell::DTypeLabel(dtype), "/B:", batch, "/N:", n, "/H:", heads,
                        "/KV:", kv_heads, "/d:", d,
                        latent_dv > 0 ? absl::StrCat("/latent_dv:", latent_dv) : "",
                        forks_own > 0 ? absl::StrCat("/forks_own:", forks_own) : "");
  }
  // Cache bytes one step reads: every sequence's keys and stored values once (forks: the
  // prompt's once, and each one's own).
  double CacheBytes() const {
    const double tokens =
        forks_own > 0 ? static_cast<double>(n + batch * forks_own) : static_cast<double>(batch) * n;
    return tokens * kv_heads * (latent_dv > 0 ? 1 : 2) * attn::StoredRowBytes(dtype, d);
  }
  // The queries' and outputs' dtype: the cache's, or bf16 over an fp8 cache (fp8 is a cache's
  // dtype only).
  DType WireDType() const { return dtype == DType::kFloat8E4M3 ? DType::kBFloat16 : dtype; }
};

void RunDecode(benchmark::State& state, attn::Backend* backend, const DecodeCell& cell) {
  if (DeadlinePassed()) return Skip(state, "timeout: --deadline_s passed before this row ran");
  std::mt19937 rng(0xdec0de + cell.n);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  // Each sequence's cache, filled by appends of up to 4096 fp32 tokens (converted on append).
  std::vector<std::unique_ptr<attn::KvStore>> stores;
  constexpr int64_t kPiece = 4096;
  std::vector<float> key, value;
  std::unique_ptr<attn::KvStore> prompt;  // With forks_own: the one they are forks of.
  for (int64_t b = 0; b < (cell.forks_own > 0 ? cell.batch + 1 : cell.batch); ++b) {
    const bool fork = cell.forks_own > 0 && b > 0;
    absl::StatusOr<std::unique_ptr<attn::KvStore>> store =
        fork ? prompt->Fork(cell.n)
             : backend->CreateKvStore(attn::KvLayout{.kv_heads = cell.kv_heads,
                                                     .head_dim = cell.d,
                                                     .value_dim = cell.ValueDim(),
                                                     .dtype = cell.dtype,
                                                     .values_from_keys = cell.latent_dv > 0});
    if (!store.ok()) return Skip(state, StatusText(store.status()));
    const int64_t from = fork ? cell.n : 0, to = fork ? cell.Length() : cell.n;
    for (int64_t done = from; done < to; done += kPiece) {
      const int64_t n = std::min(kPiece, to - done);
      key.resize(cell.kv_heads * n * cell.d);
      value.resize(key.size());
      for (float& x : key) x = uniform(rng);
      for (float& x : value) x = uniform(rng);
      const absl::Status appended =
          (*store)->Append(attn::TensorView{key.data(), DType::kFloat32},
                           attn::TensorView{value.data(), DType::kFloat32}, n);
      if (!appended.ok()) return Skip(state, StatusText(appended));
    }
    if (cell.forks_own > 0 && b == 0) {
      prompt = *std::move(store);
    } else {
      stores.push_back(*std::move(store));
    }
  }
  const DType wire = cell.WireDType();
  const int64_t esize = attn::ElementSize(wire);
  std::vector<uint8_t> queries(cell.batch * cell.heads * cell.d * esize);
  for (int64_t i = 0; i < cell.batch * cell.heads * cell.d; ++i) {
    attn::StoreElement(queries.data(), wire, i, uniform(rng));
  }
  std::vector<std::vector<uint8_t>> output_bytes(cell.batch);
  std::vector<std::vector<float>> lse(cell.batch);
  std::vector<attn::Problem> problems(cell.batch);
  std::vector<attn::Outputs> outputs(cell.batch);
  for (int64_t b = 0; b < cell.batch; ++b) {
    attn::Problem& p = problems[b];
    p.shape = attn::testing::MakeShape(1, cell.heads, cell.kv_heads, 1, cell.Length(), cell.d,
                                       cell.ValueDim());
    p.query = attn::TensorView{queries.data() + b * cell.heads * cell.d * esize, wire};
    p.pages = &stores[b]->pages();
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cell.d)));
    p.block_k = backend->default_block_k();
    p.return_lse = true;
    p.output_dtype = wire;
    output_bytes[b].resize(p.OutputElements() * esize);  // [heads, 1, value_dim]
    for (int64_t i = 0; i < p.OutputElements(); ++i) {
      attn::StoreElement(output_bytes[b].data(), wire, i, std::numeric_limits<float>::quiet_NaN());
    }
    lse[b].resize(p.LseElements());
    outputs[b].output = attn::MutableTensorView{output_bytes[b].data(), wire};
    outputs[b].lse = lse[b].data();
  }
  auto call = [&] {
    return cell.method == "decode" ? backend->Decode(problems, outputs)
                                   : backend->attn::Backend::Decode(problems, outputs);
  };
  absl::StatusOr<attn::Stats> stats = call();  // Warm-up.
  if (!stats.ok()) return Skip(state, StatusText(stats.status()));
  double compute_s = 0;
  for (auto _ : state) {
    stats = call();
    if (!stats.ok()) {
      Skip(state, StatusText(stats.status()));
      break;
    }
    compute_s += stats->compute_ns * 1e-9;
  }
  if (!stats.ok()) return;
  for (int64_t b = 0; b < cell.batch; ++b) {
    for (int64_t i = 0; i < problems[b].OutputElements(); ++i) {
      if (!std::isfinite(attn::LoadElement(output_bytes[b].data(), wire, i))) {
        return Skip(state, absl::StrCat("bad: output ", b, " element ", i, " is not finite"));
      }
    }
  }
  using benchmark::Counter;
  state.counters["GB/s"] = Counter(cell.CacheBytes() / 1e9, Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = Counter(stats->flops / 1e9, Counter::kIsIterationInvariantRate);
  state.counters["compute_ms"] = compute_s * 1e3 / static_cast<double>(state.iterations());
  state.counters["cache_bytes"] = Counter(cell.CacheBytes(), Counter::kDefaults, Counter::kIs1024);
  state.counters["scratch_bytes"] =
      Counter(static_cast<double>(stats->scratch_bytes), Counter::kDefaults, Counter::kIs1024);
}

// Σ of `count` floats in 8 lanes × 4 independent sums: a read that the vector units keep up
// with, so that its rate is the memory's.
ATTN_CPU_FAST float SumFloatsAvx2(const float* p, int64_t count) {
  using attn::lanes::Floats;
  Floats a{}, b{}, c{}, d{};
  int64_t i = 0;
  for (; i + 32 <= count; i += 32) {
    a += attn::lanes::Load(p + i);
    b += attn::lanes::Load(p + i + 8);
    c += attn::lanes::Load(p + i + 16);
    d += attn::lanes::Load(p + i + 24);
  }
  const Floats sum = (a + b) + (c + d);
  float total = 0;
  for (int k = 0; k < 8; ++k) total += sum[k];
  for (; i < count; ++i) total += p[i];
  return total;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same in 16 lanes (a whole cache line per load), for CPUs with AVX-512F: the ceiling is
// measured with the widest loads the machine has.
typedef float Floats16 __attribute__((vector_size(64), aligned(4)));

__attribute__((target("avx512f"))) float SumFloatsAvx512(const float* p, int64_t count) {
  Floats16 a{}, b{}, c{}, d{};
  int64_t i = 0;
  auto load = [p](int64_t at) {
    Floats16 v;
    std::memcpy(&v, p + at, sizeof(v));
    return v;
  };
  for (; i + 64 <= count; i += 64) {
    a += load(i);
    b += load(i + 16);
    c += load(i + 32);
    d += load(i + 48);
  }
  const Floats16 sum = (a + b) + (c + d);
  float total = 0;
  for (int k = 0; k < 16; ++k) total += sum[k];
  for (; i < count; ++i) total += p[i];
  return total;
}

bool CpuHasAvx512f() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#else
float SumFloatsAvx512(const float* p, int64_t count) { return SumFloatsAvx2(p, count); }
bool CpuHasAvx512f() { return false; }
#endif

// The memory-read ceiling: the whole buffer read once per iteration, in 1 MiB slices handed to
// `threads` workers of a pool like the backend's.
void RunMemread(benchmark::State& state, int64_t mib, int threads) {
  const int64_t count = mib * (1 << 20) / 4;
  std::vector<float> buffer(count);
  for (int64_t i = 0; i < count; ++i) buffer[i] = static_cast<float>(i & 1023);
  attn::ThreadPool pool(threads);
  constexpr int64_t kSlice = (1 << 20) / 4;
  const int64_t slices = (count + kSlice - 1) / kSlice;
  const bool wide = CpuHasAvx512f();
  std::vector<double> sums(threads);
  auto read = [&] {
    std::fill(sums.begin(), sums.end(), 0.0);
    pool.Run(slices, [&](int64_t slice, int worker) {
      const int64_t begin = slice * kSlice;
      const int64_t n = std::min(kSlice, count - begin);
      sums[worker] += wide ? SumFloatsAvx512(buffer.data() + begin, n)
                           : SumFloatsAvx2(buffer.data() + begin, n);
    });
  };
  read();
  for (auto _ : state) {
    read();
    benchmark::DoNotOptimize(sums.data());
  }
  double total = 0;
  for (double x : sums) total += x;
  if (!std::isfinite(total)) return Skip(state, "bad: memread sum");
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(count) * 4 / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["lanes"] = wide ? 16 : 8;
}

// The copy ceiling: memcpy of the whole buffer into another once per iteration, one contiguous
// part per worker (`threads` workers). Parts that large take glibc's streaming-store path; on
// the development VM 64 MiB slices did not and copied at 0.55× the rate (docs/perf.md). GB/s
// counts reading and writing, 2 · size / time, as tests/gpu/bench's copy_d2d does.
void RunMemcopy(benchmark::State& state, int64_t mib, int threads) {
  const int64_t bytes = mib << 20;
  std::unique_ptr<uint8_t[]> from(new uint8_t[bytes]), to(new uint8_t[bytes]);
  std::memset(to.get(), 0, bytes);  // Touch every page outside the timing.
  std::memset(from.get(), 1, bytes);
  attn::ThreadPool pool(threads);
  const int64_t part = (bytes / threads + 4095) / 4096 * 4096;
  const int64_t parts = (bytes + part - 1) / part;
  auto copy = [&] {
    pool.Run(parts, [&](int64_t index, int) {
      const int64_t begin = index * part;
      std::memcpy(to.get() + begin, from.get() + begin, std::min(part, bytes - begin));
    });
  };
  copy();
  for (auto _ : state) {
    copy();
    benchmark::DoNotOptimize(to.get());
    benchmark::ClobberMemory();
  }
  if (to[bytes - 1] != 1) return Skip(state, "bad: memcopy");
  state.counters["GB/s"] = benchmark::Counter(2.0 * static_cast<double>(bytes) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["copied_GB/s"] = benchmark::Counter(static_cast<double>(bytes) / 1e9,
                                                     benchmark::Counter::kIsIterationInvariantRate);
}

// Naive's two products alone (see the top of this file): NaiveRows's KvTile calls, with the same
// arguments, per 128-row block, on `threads` workers.
void RunNaiveGemm(benchmark::State& state, const Cell& cell, int threads) {
  if (DeadlinePassed()) return Skip(state, "timeout: --deadline_s passed before this row ran");
  const int64_t heads = cell.heads, n = cell.n, d = cell.d;
  std::mt19937 rng(0x9e33 + n + d);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<float> query(heads * n * d), key(heads * n * d), value(heads * n * d);
  for (float& x : query) x = uniform(rng);
  for (float& x : key) x = uniform(rng);
  for (float& x : value) x = uniform(rng);
  // The [H, N, N] score matrix as Naive writes it; the second product reads the block just
  // written, as Naive's reads the weights its softmax has just written.
  std::unique_ptr<float[]> scores(new (std::nothrow) float[heads * n * n]);
  if (!scores) return Skip(state, "RESOURCE_EXHAUSTED: no memory for the score matrix");
  std::memset(scores.get(), 0, sizeof(float) * heads * n * n);
  attn::ThreadPool pool(threads);
  const int64_t per_head = (n + attn::kRowsPerBlock - 1) / attn::kRowsPerBlock;
  const int n32 = static_cast<int>(n), d32 = static_cast<int>(d);
  const int stride = attn::AccStride(d32);
  struct Worker {
    attn::KvTile head;
    int64_t packed_head = -1;
    std::vector<float> out;
  };
  std::vector<Worker> workers(threads);
  for (Worker& worker : workers) worker.out.resize(attn::kRowsPerBlock * stride);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  auto run = [&] {
    for (Worker& worker : workers) worker.packed_head = -1;  // Every call packs its heads.
    pool.Run(heads * per_head, [&](int64_t task, int worker_index) {
      Worker& worker = workers[worker_index];
      const int64_t head = task / per_head;
      const int64_t row = task % per_head * attn::kRowsPerBlock;
      const int m = static_cast<int>(std::min(attn::kRowsPerBlock, n - row));
      if (worker.packed_head != head) {
        worker.head.Load(key.data() + head * n * d, value.data() + head * n * d, n32, d32, d32,
                         scale);
        worker.packed_head = head;
      }
      float* s = scores.get() + (head * n + row) * n;
      worker.head.Scores(query.data() + (head * n + row) * d, m, s);
      std::fill(worker.out.begin(), worker.out.end(), 0.f);
      worker.head.Accumulate(s, m, worker.out.data());
    });
  };
  run();  // Warm-up: every worker's buffers.
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(workers.data());
    benchmark::ClobberMemory();
  }
  for (const Worker& worker : workers) {
    for (float x : worker.out) {
      if (!std::isfinite(x)) return Skip(state, "bad: naive_gemm output");
    }
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(cell.Flops() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

// Runs even past --deadline_s: the table needs the ceiling.
void RunSgemm(benchmark::State& state, int64_t n, int threads) {
  std::vector<float> a(n * n), b(n * n), c(n * n);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (float& x : a) x = uniform(rng);
  for (float& x : b) x = uniform(rng);
  const int n32 = static_cast<int>(n);

  openblas_set_num_threads(threads);  // Only the sgemm rows use OpenBLAS.
  auto sgemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n32, n32, n32, 1.f, a.data(), n32,
                b.data(), n32, 0.f, c.data(), n32);
  };
  sgemm();  // Warm-up: OpenBLAS's threads and buffers, the pages of c.
  for (auto _ : state) {
    sgemm();
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  // OpenBLAS's idle threads spin (yielding) for a while after a call; let them fall asleep so
  // they do not compete with the next row's workers (run.sh interleaves sgemm with Tiled).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  if (!std::isfinite(c[0]) || !std::isfinite(c[n * n - 1])) return Skip(state, "bad: sgemm output");
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * n * n * n / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

std::string EnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = ParseOptions(&argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  auto has_method = [&](const char* name) {
    return std::find(options.methods.begin(), options.methods.end(), name) != options.methods.end();
  };

  const int64_t budget = static_cast<int64_t>(options.naive_budget_gib * kGiB);
  attn::CpuBackend backend(options.threads, budget);
  const int block_k = options.block_k > 0 ? options.block_k : backend.default_block_k();

  benchmark::AddCustomContext("attn_device", backend.device());
  benchmark::AddCustomContext("attn_threads", absl::StrCat(options.threads));
  benchmark::AddCustomContext("attn_naive_budget_bytes", absl::StrCat(budget));
  benchmark::AddCustomContext("attn_naive_max_n", absl::StrCat(options.naive_max_n));
  benchmark::AddCustomContext("attn_block_k", absl::StrCat(block_k));
  benchmark::AddCustomContext("attn_quick", options.quick ? "1" : "0");
  benchmark::AddCustomContext("attn_sgemm_n", absl::StrJoin(options.sgemm_n, ","));
  benchmark::AddCustomContext("attn_memread_mib", absl::StrCat(options.memread_mib));
  benchmark::AddCustomContext("attn_memcopy_mib", absl::StrCat(options.memcopy_mib));
  benchmark::AddCustomContext("attn_memory_lanes", CpuHasAvx512f() ? "16" : "8");
  benchmark::AddCustomContext("openblas_corename", openblas_get_corename());
  benchmark::AddCustomContext("openblas_config", openblas_get_config());
  benchmark::AddCustomContext("OPENBLAS_CORETYPE", EnvOr("OPENBLAS_CORETYPE", ""));
  benchmark::AddCustomContext("OPENBLAS_L2_SIZE", EnvOr("OPENBLAS_L2_SIZE", ""));
  benchmark::AddCustomContext("OPENBLAS_NUM_THREADS", EnvOr("OPENBLAS_NUM_THREADS", ""));

  auto add_sgemm = [&](const char* at) {
    for (int64_t n : options.sgemm_n) {
      benchmark::RegisterBenchmark(
          absl::StrCat("sgemm/N:", n, "/at:", at).c_str(),
          [n, threads = options.threads](benchmark::State& state) { RunSgemm(state, n, threads); })
          ->UseRealTime()
          ->MinTime(options.min_time)
          ->Unit(benchmark::kMillisecond);
    }
  };
  std::set<std::string> registered;
  auto add_attention = [&](const Cell& cell) {
    if (!registered.insert(cell.Name()).second) return;
    benchmark::RegisterBenchmark(
        cell.Name().c_str(),
        [&backend, cell, block_k, threads = options.threads](benchmark::State& state) {
          if (cell.method == "naive_gemm") {
            RunNaiveGemm(state, cell, threads);
          } else {
            RunAttention(state, &backend, cell, block_k);
          }
        })
        ->UseRealTime()
        ->MinTime(options.min_time)
        ->Unit(benchmark::kMillisecond);
  };

  std::vector<DecodeCell> decode_cells;
  for (const std::string& method : options.methods) {
    if (method != "decode" && method != "decode_tiled") continue;
    for (DType dtype : options.dtypes) {
      for (const auto& [batch, n] : options.decode_shapes) {
        decode_cells.push_back(DecodeCell{method, dtype, batch, n, options.decode_heads,
                                          options.decode_kv_heads, options.decode_d,
                                          options.decode_latent_dv, options.decode_forks_own});
      }
    }
  }
  // The memory ceilings: the read at --memread_mib and at the largest decode cache's size, the
  // copy at --memcopy_mib.
  std::set<int64_t> memread_sizes;
  const bool memory = !decode_cells.empty() || has_method("memory");
  if (memory) {
    memread_sizes.insert(options.memread_mib);
    double largest = 0;
    for (const DecodeCell& cell : decode_cells) largest = std::max(largest, cell.CacheBytes());
    if (largest > 0) {
      memread_sizes.insert(std::max<int64_t>(1, static_cast<int64_t>(largest / (1 << 20))));
    }
  }
  auto add_memory = [&](const char* at) {
    if (!memory) return;
    for (int64_t mib : memread_sizes) {
      benchmark::RegisterBenchmark(absl::StrCat("memread/MiB:", mib, "/at:", at).c_str(),
                                   [mib, threads = options.threads](benchmark::State& state) {
                                     RunMemread(state, mib, threads);
                                   })
          ->UseRealTime()
          ->MinTime(options.min_time)
          ->Unit(benchmark::kMillisecond);
    }
    benchmark::RegisterBenchmark(
        absl::StrCat("memcopy/MiB:", options.memcopy_mib, "/at:", at).c_str(),
        [mib = options.memcopy_mib, threads = options.threads](benchmark::State& state) {
          RunMemcopy(state, mib, threads);
        })
        ->UseRealTime()
        ->MinTime(options.min_time)
        ->Unit(benchmark::kMillisecond);
  };

  add_sgemm("begin");
  add_memory("begin");
  for (const DecodeCell& cell : decode_cells) {
    benchmark::RegisterBenchmark(
        cell.Name().c_str(),
        [&backend, cell](benchmark::State& state) { RunDecode(state, &backend, cell); })
        ->UseRealTime()
        ->MinTime(options.min_time)
        ->Unit(benchmark::kMillisecond);
  }
  add_memory("end");
  if (!options.ragged.empty()) {
    int64_t total = 0;
    for (int64_t length : options.ragged) total += length;
    for (int64_t d : options.dims) {
      for (DType dtype : options.dtypes) {
        if (dtype == DType::kFloat8E4M3) continue;  // Decode rows only.
        for (int64_t causal : options.causal) {
          for (bool packed : {true, false}) {
            const Cell cell{"ragged", dtype, causal != 0, total, HeadsFor(options, total), d};
            const std::string name =
                absl::StrCat("ragged/", Cell::DTypeLabel(dtype), "/causal:", causal,
                             "/seqs:", options.ragged.size(), "/N:", total, "/H:", cell.heads,
                             "/d:", d, packed ? "/packed" : "/one_by_one");
            benchmark::RegisterBenchmark(name.c_str(),
                                         [&backend, cell, packed, block_k,
                                          lengths = options.ragged](benchmark::State& state) {
                                           RunRagged(state, &backend, cell, lengths, packed,
                                                     block_k);
                                         })
                ->UseRealTime()
                ->MinTime(options.min_time)
                ->Unit(benchmark::kMillisecond);
          }
        }
      }
    }
  }
  std::vector<int64_t> seqs = options.seqs;
  std::sort(seqs.begin(), seqs.end());
  for (int64_t d : options.dims) {
    for (DType dtype : options.dtypes) {
      if (dtype == DType::kFloat8E4M3) continue;  // Decode rows only.
      for (int64_t causal : options.causal) {
        for (int64_t n : seqs) {
          for (const std::string& method : options.methods) {
            if (method != "tiled" && method != "naive" && method != "naive_gemm") continue;
            // Naive's GEMM phases: fp32 (what Naive multiplies in), non-causal (its GEMMs do
            // not skip masked blocks), at the sizes Naive runs at.
            if (method == "naive_gemm" &&
                (dtype != DType::kFloat32 || causal != 0 || n > options.naive_max_n)) {
              continue;
            }
            const Cell cell{method,
                            dtype,
                            causal != 0,
                            n,
                            HeadsFor(options, n),
                            d,
                            options.window_left,
                            options.softcap,
                            options.alibi};
            // Past --naive_max_n, Naive only where the backend refuses it before allocating.
            if (method == "naive" && n > options.naive_max_n &&
                cell.NaiveStorageBytes() <= static_cast<double>(budget)) {
              continue;
            }
            add_attention(cell);
          }
        }
      }
    }
  }
  if (options.refusal && has_method("naive")) {
    const Cell refusal{"naive", DType::kFloat32, false, 32768, 1, 64};
    if (refusal.NaiveStorageBytes() > static_cast<double>(budget)) add_attention(refusal);
  }
  add_sgemm("end");

  g_start = Clock::now();
  g_deadline_s = options.deadline_s;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
