// gpu_bench: Naive and Tiled on the CUDA backend, beside the device's own ceilings.
//
// One process runs a whole sweep and prints CSV lines on stdout as it goes (so a run cut short
// still leaves every line it finished):
//   ceiling,<name>,<dtype>,<reps>,<ms_median>,<value>,<unit>
//       copy_d2d: cudaMemcpy device-to-device of 1 GiB, GB/s counting bytes read + written;
//       gemm_8192: cublasGemmEx 8192³ (fp32 accumulation), TFLOP/s, on random data.
//   attn,<method>,<dtype>,<d>,<seq>,<bh>,<causal>,<reps>,<ms_median>,<ms_min>,<tflops>,
//       <rel_err>,<status>,<note>
//       ms: the backend's Stats::compute_ns (CUDA-event time of the kernels alone, without the
//       host↔device copies); TFLOP/s = 4·B·H·N²·d (halved when causal) / median time;
//       rel_err: max |out − float64 reference| / max |reference| over a few sampled rows
//       (see CheckRows); status: ok, oom
//       (RESOURCE_EXHAUSTED: the Naive budget or the device memory), bad (an unwritten or
//       wrong output), error, or timeout (the --deadline_s passed before this cell ran).
//   decode,<dtype>,<batch>,<key_len>,<heads>,<kv_heads>,<d>,<reps>,<ms_median>,<cache_gb_s>,
//       <rel_err>,<status>
//       (--method decode) Backend::Decode of one query row per sequence over server-resident
//       KV caches (the split-KV kernels, kernels/cuda/decode.cu): ms as above; cache_gb_s =
//       bytes of cache read (batch · key_len · kv_heads · 2 stored rows of d: d · element size,
//       or an fp8 row's d codes and scale) / median time, to be read against copy_d2d of the same
//       run; rel_err against Tiled over the same pages. dtype fp8: an fp8 cache (the tokens sent
//       as bf16 and quantized), queries and outputs bf16.
//   decode_forks,bf16,<batch>,<key_len>,... (the same columns; with bf16 in --dtype) issue 31's
//       forks: batch 1, one sequence of 16448 tokens; batch 16, forks of one 16384-token prompt
//       with 64 tokens of their own each (KvStore::Fork: the prompt's pages shared, read in
//       cascade units); cache_gb_s counts every sequence's tokens, shared or not.
// Lines starting with '#' are comments (the header lines among them).
//
// Shapes: batch·heads = tokens / seq with a fixed token count (default 256k), so every launch
// moves the same input bytes (≥ 100 MB, several times the 60 MB L2 of an H200), has
// tokens / 64 = 4096 query blocks of the fused kernel (≈ 31 per SM on 132 SMs) and does
// 34 GFLOP (seq 1k, d 64, causal) to 2.2 TFLOP (seq 16k, d 128).
//
// Without a CUDA device it prints "SKIPPED: no CUDA device: ..." and exits 0.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/dtype.h"
#include "kernels/kv_store.h"
#include "kernels/problem.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<std::string> methods = {"tiled", "naive"};
  std::vector<std::string> dtypes = {"bf16", "fp16"};
  std::vector<int64_t> dims = {64, 128};
  std::vector<int64_t> seqs = {1024, 4096, 16384};
  std::vector<int64_t> causal = {0, 1};
  int64_t tokens = 256 * 1024;  // batch·heads·seq.
  int64_t bh = 0;               // When set, batch·heads for every seq instead of tokens / seq.
  int reps = 7;
  int warmup = 2;
  double deadline_s = 0;     // 0: none.
  double cell_budget_s = 4;  // Wall-clock target per cell; fewer reps (≥ 3) when slower.
  double naive_gib = 64;     // Naive's budget for its score and weight matrices.
  bool ceilings = true;
  bool check = true;
  std::string backend = "cuda";  // "cpu" runs the same sweep on the CPU backend (a rehearsal).
};

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> items;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    if (end > begin) items.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return items;
}

[[noreturn]] void Usage(const char* problem) {
  std::fprintf(stderr,
               "gpu_bench: %s\n"
               "usage: gpu_bench [--method tiled,naive,decode] [--dtype bf16,fp16] [--dim 64,128]\n"
               "  [--seq 1024,4096,16384] [--causal 0,1] [--tokens 262144 | --bh N]\n"
               "  [--reps 7] [--warmup 2] [--deadline_s S] [--cell_budget_s 4]\n"
               "  [--naive_gib 64] [--ceilings 0|1] [--check 0|1] [--backend cuda|cpu]\n"
               "Each list option takes one value or a comma-separated list.\n",
               problem);
  std::exit(2);
}

int64_t ParseInt(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') Usage(("bad integer for " + flag + ": " + text).c_str());
  return value;
}

double ParseDouble(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0') Usage(("bad number for " + flag + ": " + text).c_str());
  return value;
}

std::vector<int64_t> ParseInts(const std::string& flag, const std::string& text) {
  std::vector<int64_t> values;
  for (const std::string& item : SplitList(text)) values.push_back(ParseInt(flag, item));
  if (values.empty()) Usage(("empty list for " + flag).c_str());
  return values;
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (flag == "--help" || flag == "-h") {
      Usage("help");
    } else {
      if (i + 1 >= argc) Usage(("missing value for " + flag).c_str());
      value = argv[++i];
    }
    if (flag == "--method" || flag == "--methods") {
      o.methods = SplitList(value);
    } else if (flag == "--dtype" || flag == "--dtypes") {
      o.dtypes = SplitList(value);
    } else if (flag == "--dim" || flag == "--dims") {
      o.dims = ParseInts(flag, value);
    } else if (flag == "--seq" || flag == "--seqs") {
      o.seqs = ParseInts(flag, value);
    } else if (flag == "--causal") {
      o.causal = ParseInts(flag, value);
    } else if (flag == "--tokens") {
      o.tokens = ParseInt(flag, value);
    } else if (flag == "--bh") {
      o.bh = ParseInt(flag, value);
    } else if (flag == "--reps") {
      o.reps = static_cast<int>(ParseInt(flag, value));
    } else if (flag == "--warmup") {
      o.warmup = static_cast<int>(ParseInt(flag, value));
    } else if (flag == "--deadline_s") {
      o.deadline_s = ParseDouble(flag, value);
    } else if (flag == "--cell_budget_s") {
      o.cell_budget_s = ParseDouble(flag, value);
    } else if (flag == "--naive_gib") {
      o.naive_gib = ParseDouble(flag, value);
    } else if (flag == "--ceilings") {
      o.ceilings = ParseInt(flag, value) != 0;
    } else if (flag == "--check") {
      o.check = ParseInt(flag, value) != 0;
    } else if (flag == "--backend") {
      o.backend = value;
    } else {
      Usage(("unknown flag " + flag).c_str());
    }
  }
  for (const std::string& m : o.methods) {
    if (m != "tiled" && m != "naive" && m != "decode") Usage(("unknown method " + m).c_str());
  }
  for (const std::string& d : o.dtypes) {
    if (d == "fp8" && o.methods == std::vector<std::string>{"decode"}) continue;
    if (d != "bf16" && d != "fp16" && d != "fp32") {
      Usage(("unknown dtype " + d + " (fp8: --method decode alone)").c_str());
    }
  }
  for (int64_t d : o.dims) {
    if (d < 1 || d > 256) Usage("--dim must be in 1..256");
  }
  for (int64_t s : o.seqs) {
    if (s < 1) Usage("--seq must be ≥ 1");
  }
  if (o.backend != "cuda" && o.backend != "cpu") Usage("--backend is cuda or cpu");
  if (o.reps < 1 || o.warmup < 0) Usage("--reps ≥ 1 and --warmup ≥ 0");
  if (o.bh < 0 || o.tokens < 1) Usage("--bh ≥ 0 and --tokens ≥ 1");
  return o;
}

attn::DType ParseDType(const std::string& name) {
  if (name == "bf16") return attn::DType::kBFloat16;
  if (name == "fp16") return attn::DType::kFloat16;
  if (name == "fp8") return attn::DType::kFloat8E4M3;
  return attn::DType::kFloat32;
}

// Commas and newlines would break the CSV.
std::string Clean(std::string text) {
  for (char& c : text) {
    if (c == ',' || c == '\n' || c == '\r') c = ';';
  }
  if (text.size() > 300) text.resize(300);
  return text;
}

void Line(const std::string& text) {
  std::fputs(text.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

template <class... Args>
std::string Format(const char* format, Args... args) {
  char buffer[1024];
  std::snprintf(buffer, sizeof buffer, format, args...);
  return buffer;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Fresh uniform(-1, 1) values, never zero, in `dtype`, filled by up to 16 threads (one
// splitmix64 stream each).
void FillRandom(void* data, attn::DType dtype, int64_t count, uint64_t seed) {
  const int threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  const int64_t chunk = (count + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([=] {
      uint64_t state = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(t) + 1;
      const int64_t end = std::min(count, (t + 1) * chunk);
      for (int64_t i = t * chunk; i < end; ++i) {
        float x = 0.f;
        while (x == 0.f) {
          state += 0x9e3779b97f4a7c15ull;
          uint64_t z = state;
          z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
          z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
          z ^= z >> 31;
          // [-1, 1) in steps of 2^-23: every nonzero value is a normal number or an exact
          // subnormal in fp16 and bf16 alike, so none rounds to zero.
          x = static_cast<float>(static_cast<double>(z >> 40) * 0x1p-23 - 1.0);
        }
        attn::StoreElement(data, dtype, i, x);
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
}

// Host memory registered with CUDA (pinned), so the backend's copies run at full speed; plain
// pageable memory if registration fails.
class HostBuffer {
 public:
  explicit HostBuffer(int64_t bytes) : bytes_(std::max<int64_t>(bytes, 1)) {
    data_ = static_cast<uint8_t*>(std::malloc(bytes_));
    if (data_ == nullptr) {
      std::fprintf(stderr, "gpu_bench: out of host memory (%lld bytes)\n",
                   static_cast<long long>(bytes_));
      std::exit(1);
    }
    registered_ = cudaHostRegister(data_, bytes_, cudaHostRegisterDefault) == cudaSuccess;
    if (!registered_) cudaGetLastError();
  }
  ~HostBuffer() {
    if (registered_) cudaHostUnregister(data_);
    std::free(data_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  uint8_t* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  int64_t bytes_;
  uint8_t* data_ = nullptr;
  bool registered_ = false;
};

bool CudaOk(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return true;
  std::fprintf(stderr, "gpu_bench: %s: %s (%s)\n", what, cudaGetErrorName(error),
               cudaGetErrorString(error));
  return false;
}

bool BlasOk(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return true;
  std::fprintf(stderr, "gpu_bench: %s: cuBLAS status %d\n", what, static_cast<int>(status));
  return false;
}

// Times `body` (work enqueued on the default stream) with CUDA events: warmup runs, then
// `reps` timed runs; returns the median in ms, or a negative value on error.
template <class Body>
double TimeMs(int warmup, int reps, Body body) {
  cudaEvent_t start, stop;
  if (!CudaOk(cudaEventCreate(&start), "cudaEventCreate") ||
      !CudaOk(cudaEventCreate(&stop), "cudaEventCreate")) {
    return -1;
  }
  std::vector<double> times;
  bool ok = true;
  for (int i = 0; i < warmup + reps && ok; ++i) {
    ok = CudaOk(cudaEventRecord(start), "cudaEventRecord") && body() &&
         CudaOk(cudaEventRecord(stop), "cudaEventRecord") &&
         CudaOk(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    if (ok) ok = CudaOk(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (ok && i >= warmup) times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ok ? Median(times) : -1;
}

// The device's ceilings: copy bandwidth and the cuBLAS matrix-product rate. Returns false when
// a CUDA call failed.
bool MeasureCeilings(const std::vector<std::string>& dtypes) {
  Line("#ceiling,name,dtype,reps,ms_median,value,unit");
  constexpr int kReps = 10;
  bool ok = true;
  {
    constexpr size_t kBytes = size_t{1} << 30;
    void* a = nullptr;
    void* b = nullptr;
    if (CudaOk(cudaMalloc(&a, kBytes), "cudaMalloc (copy)") &&
        CudaOk(cudaMalloc(&b, kBytes), "cudaMalloc (copy)")) {
      // Random bytes in the source (never zeros): one random 64 MiB block, copied across.
      const int64_t block = 64 << 20;
      HostBuffer host(block);
      FillRandom(host.data(), attn::DType::kFloat32, block / 4, 7);
      for (size_t offset = 0; offset < kBytes && ok; offset += block) {
        ok = CudaOk(cudaMemcpy(static_cast<uint8_t*>(a) + offset, host.data(), block,
                               cudaMemcpyHostToDevice),
                    "cudaMemcpy (copy source)");
      }
      const double ms =
          ok ? TimeMs(2, kReps,
                      [&] {
                        return CudaOk(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice),
                                      "cudaMemcpyAsync (d2d)");
                      })
             : -1;
      if (ms > 0) {
        Line(Format("ceiling,copy_d2d,-,%d,%.4f,%.1f,GB/s", kReps, ms,
                    2.0 * static_cast<double>(kBytes) / (ms * 1e-3) / 1e9));
      } else {
        ok = false;
      }
    } else {
      ok = false;
    }
    cudaFree(a);
    cudaFree(b);
  }
  cublasHandle_t handle = nullptr;
  if (!BlasOk(cublasCreate(&handle), "cublasCreate")) return false;
  constexpr int n = 8192;
  const int64_t elements = int64_t{n} * n;
  std::vector<std::string> gemm_dtypes = dtypes;
  gemm_dtypes.push_back("fp32");  // Naive's second product runs in fp32.
  for (const std::string& name : gemm_dtypes) {
    const attn::DType dtype = ParseDType(name);
    const int64_t element = attn::ElementSize(dtype);
    const cudaDataType type = dtype == attn::DType::kFloat32   ? CUDA_R_32F
                              : dtype == attn::DType::kFloat16 ? CUDA_R_16F
                                                               : CUDA_R_16BF;
    void* a = nullptr;
    void* b = nullptr;
    void* c = nullptr;
    bool here = CudaOk(cudaMalloc(&a, elements * element), "cudaMalloc (gemm)") &&
                CudaOk(cudaMalloc(&b, elements * element), "cudaMalloc (gemm)") &&
                CudaOk(cudaMalloc(&c, elements * element), "cudaMalloc (gemm)");
    if (here) {
      HostBuffer host(2 * elements * element);
      FillRandom(host.data(), dtype, 2 * elements, 11);
      here = CudaOk(cudaMemcpy(a, host.data(), elements * element, cudaMemcpyHostToDevice),
                    "cudaMemcpy (gemm)") &&
             CudaOk(cudaMemcpy(b, host.data() + elements * element, elements * element,
                               cudaMemcpyHostToDevice),
                    "cudaMemcpy (gemm)");
    }
    const float one = 1.f, zero = 0.f;
    const int reps = dtype == attn::DType::kFloat32 ? 3 : kReps;
    const double ms =
        here ? TimeMs(2, reps,
                      [&] {
                        return BlasOk(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one,
                                                   a, type, n, b, type, n, &zero, c, type, n,
                                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                                      "cublasGemmEx");
                      })
             : -1;
    if (ms > 0) {
      Line(Format("ceiling,gemm_8192,%s,%d,%.4f,%.1f,TFLOP/s", name.c_str(), reps, ms,
                  2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e12));
    } else {
      ok = false;
    }
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
  }
  cublasDestroy(handle);
  return ok;
}

// max |out − float64 reference| / max |reference| over a few rows, or +inf when any output is
// NaN (the buffer is poisoned with NaN before the checked run, so an unwritten element shows as
// NaN). Relative, because these outputs are averages of many uniform(−1, 1) values and so small
// (about 0.02 at 1k keys) that an absolute bound would pass zeros.
double CheckRows(const attn::Problem& p, const void* output, attn::DType dtype, int64_t* nans) {
  const attn::Shape& s = p.shape;
  *nans = 0;
  const int64_t total = p.OutputElements();
  for (int64_t i = 0; i < total; ++i) {
    if (std::isnan(attn::LoadElement(output, dtype, i))) ++*nans;
  }
  const int64_t bh = s.batch * s.heads;
  const int64_t samples[][2] = {{0, 0},
                                {0, s.query_len - 1},
                                {bh / 2, s.query_len / 2},
                                {bh - 1, s.query_len - 1},
                                {bh - 1, (s.query_len * 3) / 7}};
  double worst = 0, largest = 0;
  std::vector<double> scores(s.key_len);
  for (const auto& sample : samples) {
    const int64_t b = sample[0] / s.heads, h = sample[0] % s.heads, row = sample[1];
    const attn::KeyRange visible = p.Visible(row);
    double max_score = -INFINITY;
    for (int64_t k = visible.begin; k < visible.end; ++k) {
      double dot = 0;
      for (int64_t c = 0; c < s.head_dim; ++c) {
        dot += static_cast<double>(p.query[p.QueryOffset(b, h, row) + c]) *
               static_cast<double>(p.key[p.KeyOffset(b, p.KvHead(h), k) + c]);
      }
      scores[k] = dot * p.scale;
      max_score = std::max(max_score, scores[k]);
    }
    double denominator = 0;
    for (int64_t k = visible.begin; k < visible.end; ++k)
      denominator += std::exp(scores[k] - max_score);
    for (int64_t c = 0; c < s.value_dim; ++c) {
      double sum = 0;
      for (int64_t k = visible.begin; k < visible.end; ++k) {
        sum += std::exp(scores[k] - max_score) *
               static_cast<double>(p.value[p.ValueOffset(b, p.KvHead(h), k) + c]);
      }
      const double expected = visible.size() > 0 ? sum / denominator : 0;
      const double actual = attn::LoadElement(output, dtype, p.OutputOffset(b, h, row) + c);
      worst = std::max(worst, std::isnan(actual) ? INFINITY : std::abs(actual - expected));
      largest = std::max(largest, std::abs(expected));
    }
  }
  return *nans > 0 ? INFINITY : worst / std::max(largest, 1e-30);
}

// One decode cell, `batch` sequences of `key_len` cached tokens each, 32 query heads over 8 kv
// heads, d = 128, one query row per sequence, in cache dtype `dtype_name`: its CSV line (`kind`
// first: decode or decode_forks) printed.
// With forks_own > 0 the sequences are forks (KvStore::Fork) of one prompt of key_len −
// forks_own tokens, each with forks_own tokens of its own: their prompt pages shared, which the
// kernel reads in cascade units (decode.cu, DecodeUnit::members). False when the cell failed.
bool DecodeCell(attn::Backend& backend, const Options& o, double deadline_s,
                const std::function<double()>& elapsed_s, const std::string& kind,
                const std::string& dtype_name, int64_t batch, int64_t key_len, int64_t forks_own) {
  constexpr int64_t kHeads = 32, kKvHeads = 8, kDim = 128;
  // The cache's dtype; the tensors' (tokens, queries, outputs) the same, or bf16 for fp8.
  const attn::DType cache_dtype = ParseDType(dtype_name);
  const attn::DType dtype =
      cache_dtype == attn::DType::kFloat8E4M3 ? attn::DType::kBFloat16 : cache_dtype;
  const int64_t element = attn::ElementSize(dtype);
  const std::string cell = Format("%s,%s,%lld,%lld,%lld,%lld,%lld", kind.c_str(),
                                  dtype_name.c_str(), static_cast<long long>(batch),
                                  static_cast<long long>(key_len), static_cast<long long>(kHeads),
                                  static_cast<long long>(kKvHeads), static_cast<long long>(kDim));
  if (deadline_s > 0 && elapsed_s() > deadline_s) {
    Line(cell + ",0,,,,timeout");
    return true;
  }
  // One random cache content (values never zeros): every sequence's tokens, or the prompt's.
  const int64_t shared_len = forks_own > 0 ? key_len - forks_own : key_len;
  const int64_t cache_elements = kKvHeads * shared_len * kDim;
  HostBuffer key(cache_elements * element), value(cache_elements * element);
  FillRandom(key.data(), dtype, cache_elements, 11 + key_len);
  FillRandom(value.data(), dtype, cache_elements, 12 + key_len);
  HostBuffer query(batch * kHeads * kDim * element);
  FillRandom(query.data(), dtype, batch * kHeads * kDim, 13 + key_len);
  const int64_t out_elements = kHeads * kDim;
  HostBuffer out(batch * out_elements * element), check(out_elements * element);
  std::vector<std::unique_ptr<attn::KvStore>> stores;
  std::vector<attn::Problem> problems;
  std::vector<attn::Outputs> outputs;
  absl::Status status;
  auto create = [&]() -> absl::StatusOr<std::unique_ptr<attn::KvStore>> {
    absl::StatusOr<std::unique_ptr<attn::KvStore>> store =
        backend.CreateKvStore(attn::KvLayout{kKvHeads, kDim, kDim, cache_dtype});
    if (!store.ok()) return store.status();
    absl::Status appended =
        (*store)->Append({key.data(), dtype}, {value.data(), dtype}, shared_len);
    if (!appended.ok()) return appended;
    return store;
  };
  if (forks_own > 0) {
    absl::StatusOr<std::unique_ptr<attn::KvStore>> prompt = create();
    const int64_t own_elements = kKvHeads * forks_own * kDim;
    HostBuffer own_key(own_elements * element), own_value(own_elements * element);
    for (int64_t b = 0; b < batch && prompt.ok() && status.ok(); ++b) {
      absl::StatusOr<std::unique_ptr<attn::KvStore>> fork = (*prompt)->Fork(shared_len);
      if (!fork.ok()) {
        status = fork.status();
        break;
      }
      FillRandom(own_key.data(), dtype, own_elements, 21 + b);
      FillRandom(own_value.data(), dtype, own_elements, 22 + b);
      status = (*fork)->Append({own_key.data(), dtype}, {own_value.data(), dtype}, forks_own);
      stores.push_back(*std::move(fork));
    }
    if (!prompt.ok()) status = prompt.status();
  } else {
    for (int64_t b = 0; b < batch && status.ok(); ++b) {
      absl::StatusOr<std::unique_ptr<attn::KvStore>> store = create();
      if (!store.ok()) {
        status = store.status();
        break;
      }
      stores.push_back(*std::move(store));
    }
  }
  for (int64_t b = 0; b < batch && status.ok(); ++b) {
    attn::Problem p;
    p.shape = attn::Shape{1, kHeads, kKvHeads, 1, key_len, kDim, kDim};
    p.query = {static_cast<const uint8_t*>(query.data()) + b * kHeads * kDim * element, dtype};
    p.pages = &stores[b]->pages();
    p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kDim)));
    p.block_k = backend.default_block_k();
    p.output_dtype = dtype;
    problems.push_back(p);
    attn::Outputs output;
    output.output = {static_cast<uint8_t*>(out.data()) + b * out_elements * element, dtype};
    outputs.push_back(output);
  }
  std::vector<double> times_ms;
  for (int i = 0; i < o.warmup + o.reps && status.ok(); ++i) {
    absl::StatusOr<attn::Stats> stats = backend.Decode(problems, outputs);
    if (!stats.ok()) {
      status = stats.status();
    } else if (i >= o.warmup) {
      times_ms.push_back(static_cast<double>(stats->compute_ns) * 1e-6);
    }
  }
  if (!status.ok()) {
    Line(cell + ",0,,,," + Clean(status.ToString()));
    return false;
  }
  // Item 0 against Tiled over the same pages (the gathered copy, the fused kernel).
  double rel_err = 0;
  attn::Outputs tiled_output;
  tiled_output.output = {check.data(), dtype};
  absl::StatusOr<attn::Stats> tiled = backend.Tiled(problems[0], tiled_output);
  std::string verdict = "ok";
  if (!tiled.ok()) {
    verdict = "tiled_failed";
  } else {
    double worst = 0, largest = 0;
    for (int64_t i = 0; i < out_elements; ++i) {
      const double expected = attn::LoadElement(check.data(), dtype, i);
      const double actual = attn::LoadElement(out.data(), dtype, i);
      worst = std::max(worst, std::isnan(actual) ? INFINITY : std::abs(actual - expected));
      largest = std::max(largest, std::abs(expected));
    }
    rel_err = worst / std::max(largest, 1e-30);
    const double tolerance = dtype == attn::DType::kBFloat16  ? 3e-2
                             : dtype == attn::DType::kFloat16 ? 5e-3
                                                              : 1e-4;
    if (!(rel_err <= tolerance)) verdict = "bad";
  }
  const double median = Median(times_ms);
  const double bytes =
      static_cast<double>(batch * key_len * kKvHeads * 2 * attn::StoredRowBytes(cache_dtype, kDim));
  Line(cell + Format(",%zu,%.4f,%.1f,%.2e,%s", times_ms.size(), median,
                     bytes / (median * 1e-3) / 1e9, rel_err, verdict.c_str()));
  return verdict == "ok";
}

// The decode sweep (--method decode), each cell a DecodeCell: 1 sequence of 1k … 32k cached
// tokens and 16 sequences of 4k per dtype; then for bf16 issue 31's forks: one sequence of
// 16384 + 64 tokens, and 16 forks of a 16384-token prompt with 64 tokens of their own each
// (decode_forks rows; the table puts the second's time over the first's). Returns false when a
// cell failed.
bool RunDecode(attn::Backend& backend, const Options& o, double deadline_s,
               const std::function<double()>& elapsed_s) {
  Line("#decode,dtype,batch,key_len,heads,kv_heads,d,reps,ms_median,cache_gb_s,rel_err,status");
  const std::pair<int64_t, int64_t> shapes[] = {
      {1, 1024}, {1, 4096}, {1, 16384}, {1, 32768}, {16, 4096}};
  bool ok = true;
  for (const std::string& dtype_name : o.dtypes) {
    for (const auto& [batch, key_len] : shapes) {
      ok &= DecodeCell(backend, o, deadline_s, elapsed_s, "decode", dtype_name, batch, key_len, 0);
    }
  }
  if (std::find(o.dtypes.begin(), o.dtypes.end(), "bf16") != o.dtypes.end()) {
    constexpr int64_t kPrompt = 16384, kOwn = 64;
    ok &=
        DecodeCell(backend, o, deadline_s, elapsed_s, "decode_forks", "bf16", 1, kPrompt + kOwn, 0);
    ok &= DecodeCell(backend, o, deadline_s, elapsed_s, "decode_forks", "bf16", 16, kPrompt + kOwn,
                     kOwn);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = ParseOptions(argc, argv);
  const Clock::time_point begin = Clock::now();
  auto elapsed_s = [&] { return std::chrono::duration<double>(Clock::now() - begin).count(); };

  const bool cuda = o.backend == "cuda";
  std::string error;
  if (cuda && attn::cuda::DeviceCount(&error) == 0) {
    Line("SKIPPED: no CUDA device: " + (error.empty() ? std::string("none found") : error));
    return 0;
  }
  bool failed = false;
  if (cuda && o.ceilings && !MeasureCeilings(o.dtypes)) {
    Line("# ceilings: a CUDA call failed (see stderr)");
    failed = true;
  }
  const int64_t naive_bytes = static_cast<int64_t>(o.naive_gib * (1 << 30));
  if (!cuda) {
    Line("# gpu_bench: --backend cpu is gone: the CPU backend has its own benchmark, tests/bench");
    return 1;
  }
  auto backend = attn::cuda::MakeCudaBackend(0, naive_bytes);
  if (!backend.ok()) {
    Line("# gpu_bench: " + Clean(backend.status().ToString()));
    return 1;
  }
  Line("# device: " + Clean((*backend)->device()));
  if (std::find(o.methods.begin(), o.methods.end(), "decode") != o.methods.end() &&
      !RunDecode(**backend, o, o.deadline_s, elapsed_s)) {
    failed = true;
  }
  if (std::all_of(o.methods.begin(), o.methods.end(),
                  [](const std::string& m) { return m == "decode"; })) {
    Line(Format("# gpu_bench done in %.1f s%s", elapsed_s(), failed ? " (with failures)" : ""));
    return failed ? 1 : 0;
  }
  Line("#attn,method,dtype,d,seq,bh,causal,reps,ms_median,ms_min,tflops,rel_err,status,note");

  for (const std::string& dtype_name : o.dtypes) {
    const attn::DType dtype = ParseDType(dtype_name);
    for (int64_t d : o.dims) {
      // One input set per (dtype, d); every seq views the same tokens (batch·heads·seq of them),
      // so it is drawn once. Fresh random values, never zeros.
      int64_t max_tokens = 0;
      for (int64_t seq : o.seqs) max_tokens = std::max(max_tokens, (o.bh > 0 ? o.bh : 1) * seq);
      if (o.bh == 0) max_tokens = std::max(max_tokens, o.tokens);
      const int64_t element = attn::ElementSize(dtype);
      HostBuffer query(max_tokens * d * element), key(max_tokens * d * element),
          value(max_tokens * d * element), output(max_tokens * d * element);
      std::vector<float> query32, key32, value32;  // Only the sampled rows are read.
      FillRandom(query.data(), dtype, max_tokens * d, 101 + d);
      FillRandom(key.data(), dtype, max_tokens * d, 202 + d);
      FillRandom(value.data(), dtype, max_tokens * d, 303 + d);

      for (int64_t seq : o.seqs) {
        const int64_t bh = o.bh > 0 ? o.bh : std::max<int64_t>(1, o.tokens / seq);
        const int64_t heads = bh % 16 == 0 ? 16 : bh;
        for (int64_t causal : o.causal) {
          for (const std::string& method : o.methods) {
            if (method == "decode") continue;  // RunDecode above.
            attn::Problem p;
            p.shape = attn::Shape{.batch = bh / heads,
                                  .heads = heads,
                                  .kv_heads = heads,
                                  .query_len = seq,
                                  .key_len = seq,
                                  .head_dim = d,
                                  .value_dim = d};
            p.query = {query.data(), dtype};
            p.key = {key.data(), dtype};
            p.value = {value.data(), dtype};
            p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
            p.causal = causal != 0;
            p.block_k = (*backend)->default_block_k();  // The fused kernels.
            p.return_lse = false;
            p.output_dtype = dtype;
            const double flops = 4.0 * static_cast<double>(bh) * static_cast<double>(seq) *
                                 static_cast<double>(seq) * static_cast<double>(d) *
                                 (causal != 0 ? 0.5 : 1.0);
            std::string cell =
                Format("attn,%s,%s,%lld,%lld,%lld,%lld", method.c_str(), dtype_name.c_str(),
                       static_cast<long long>(d), static_cast<long long>(seq),
                       static_cast<long long>(bh), static_cast<long long>(causal));
            if (o.deadline_s > 0 && elapsed_s() > o.deadline_s) {
              Line(cell + ",0,,,,,timeout,deadline passed");
              continue;
            }
            attn::Outputs outputs;
            outputs.output = attn::MutableTensorView{output.data(), dtype};
            auto run = [&]() -> absl::StatusOr<attn::Stats> {
              return method == "naive" ? (*backend)->Naive(p, outputs)
                                       : (*backend)->Tiled(p, outputs);
            };
            std::vector<double> times_ms;
            absl::Status status;
            std::string note;
            int reps = o.reps;
            const Clock::time_point cell_begin = Clock::now();
            for (int i = 0; i < o.warmup + reps; ++i) {
              const bool last = i == o.warmup + reps - 1;
              if (last && o.check) std::memset(output.data(), 0xff, p.OutputElements() * element);
              absl::StatusOr<attn::Stats> stats = run();
              if (!stats.ok()) {
                status = stats.status();
                break;
              }
              if (i >= o.warmup) times_ms.push_back(static_cast<double>(stats->compute_ns) * 1e-6);
              if (i == 0) {
                note = Format("block_k=%d peak_mb=%.0f", stats->block_k,
                              static_cast<double>(stats->peak_memory_bytes) / 1e6);
                // Fewer reps (≥ 3) when one call is slow, so a cell keeps to its budget.
                const double call_s =
                    std::chrono::duration<double>(Clock::now() - cell_begin).count();
                const int fit =
                    static_cast<int>(o.cell_budget_s / std::max(call_s, 1e-6)) - o.warmup;
                reps = std::max(std::min(o.reps, fit), std::min(o.reps, 3));
              }
            }
            if (!status.ok()) {
              const bool oom = status.code() == absl::StatusCode::kResourceExhausted;
              Line(cell + ",0,,,,," + (oom ? "oom," : "error,") + Clean(status.ToString()));
              if (!oom) failed = true;
              if (!(*backend)->healthy()) {
                Line("# the device failed; stopping");
                return 1;
              }
              continue;
            }
            double rel_err = 0;
            std::string verdict = "ok";
            if (o.check) {
              // The reference reads fp32 copies of the sampled (batch, head) inputs only.
              attn::Problem host = p;
              const int64_t n = bh * seq * d;
              query32.resize(n);
              key32.resize(n);
              value32.resize(n);
              const int64_t per_head = seq * d;
              for (int64_t head : {int64_t{0}, bh / 2, bh - 1}) {
                for (int64_t i = head * per_head; i < (head + 1) * per_head; ++i) {
                  query32[i] = attn::LoadElement(query.data(), dtype, i);
                  key32[i] = attn::LoadElement(key.data(), dtype, i);
                  value32[i] = attn::LoadElement(value.data(), dtype, i);
                }
              }
              host.query = {query32.data(), attn::DType::kFloat32};
              host.key = {key32.data(), attn::DType::kFloat32};
              host.value = {value32.data(), attn::DType::kFloat32};
              int64_t nans = 0;
              rel_err = CheckRows(host, output.data(), dtype, &nans);
              // A few units in the last place of the output dtype, relative to the largest
              // output (the fused kernels round the weights to the input dtype too).
              const double tolerance = dtype == attn::DType::kBFloat16  ? 3e-2
                                       : dtype == attn::DType::kFloat16 ? 5e-3
                                                                        : 1e-4;
              if (!(rel_err <= tolerance)) {
                verdict = "bad";
                note += Format(" nan_outputs=%lld tolerance=%g", static_cast<long long>(nans),
                               tolerance);
                failed = true;
              }
            }
            const double median = Median(times_ms);
            const double fastest = *std::min_element(times_ms.begin(), times_ms.end());
            Line(cell + Format(",%zu,%.4f,%.4f,%.2f,%.2e,%s,%s", times_ms.size(), median, fastest,
                               flops / (median * 1e-3) / 1e12, rel_err, verdict.c_str(),
                               Clean(note).c_str()));
          }
        }
      }
    }
  }
  Line(Format("# gpu_bench done in %.1f s%s", elapsed_s(), failed ? " (with failures)" : ""));
  return failed ? 1 : 0;
}
