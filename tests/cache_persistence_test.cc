// Caches on disk (issue 29): the cache file's format and its damage handling
// (server/cache_file.h), CRC32C (common/crc32c.h), and the registry's restore, removal, budget
// and import (server/caches.h) on a real directory. Every damaged file must give back exactly a
// prefix of what was written, never a token that was not.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/cache_file.h"
#include "server/caches.h"

namespace attn {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the test's temporary directory, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "attn_cache_test_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Random tokens of a layout, dense [kv_heads, n, dim] stored rows in its dtype (any bit pattern
// but non-finite ones: random finite floats rounded to the dtype; fp8 rows quantized, each with
// its scale).
struct Tokens {
  std::vector<char> key, value;
};

Tokens RandomTokens(const KvLayout& layout, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  Tokens tokens;
  const int64_t element = ElementSize(layout.dtype);
  const int64_t key_row = KeyRowBytes(layout);
  const int64_t value_row = StoredRowBytes(layout.dtype, layout.value_dim);
  tokens.key.resize(layout.kv_heads * n * key_row);
  tokens.value.resize(layout.kv_heads * n * value_row);
  for (auto [part, width, row] : {std::tuple{&tokens.key, layout.head_dim, key_row},
                                  std::tuple{&tokens.value, layout.value_dim, value_row}}) {
    std::vector<float> x(width);
    for (int64_t r = 0; r < layout.kv_heads * n; ++r) {
      for (float& v : x) v = uniform(rng);
      if (layout.dtype == DType::kFloat8E4M3) {
        QuantizeFp8Row(x.data(), width, part->data() + r * row);
        continue;
      }
      for (int64_t i = 0; i < width; ++i)
        StoreElement(part->data() + r * row, layout.dtype, i, x[i]);
    }
  }
  if (layout.values_from_keys) {  // A latent cache's values: its keys' first columns.
    for (int64_t row = 0; row < layout.kv_heads * n; ++row) {
      std::memcpy(tokens.value.data() + row * value_row, tokens.key.data() + row * key_row,
                  layout.value_dim * element);
    }
  }
  return tokens;
}

// Token t of dense [kv_heads, n, dim] parts, as its bytes (every head's row).
std::string TokenBytes(const KvLayout& layout, const Tokens& tokens, int64_t n, int64_t t) {
  const int64_t key_row = KeyRowBytes(layout);
  const int64_t value_row = StoredRowBytes(layout.dtype, layout.value_dim);
  std::string bytes;
  for (int64_t h = 0; h < layout.kv_heads; ++h) {
    bytes.append(tokens.key.data() + (h * n + t) * key_row, key_row);
    bytes.append(tokens.value.data() + (h * n + t) * value_row, value_row);
  }
  return bytes;
}

CacheFileHeader Header(const KvLayout& layout) {
  CacheFileHeader header;
  header.id = "0123456789abcdef0123456789abcdef";
  header.owner = "CN=someone";
  header.layout = layout;
  header.created_ns = 1234567890123;
  return header;
}

// Opens `path`, collecting each token's bytes in order.
struct Opened {
  absl::Status status;
  CacheFileHeader header;
  CacheFile::Report report;
  std::vector<std::string> tokens;
  std::unique_ptr<CacheFile> file;
};

Opened OpenFile(const std::string& path) {
  Opened opened;
  absl::StatusOr<std::unique_ptr<CacheFile>> file = CacheFile::Open(
      path, &opened.header,
      [&](int64_t start, int64_t n, const void* key, const void* value) {
        EXPECT_EQ(start, static_cast<int64_t>(opened.tokens.size()));
        Tokens part;
        const KvLayout& l = opened.header.layout;
        const int64_t element = ElementSize(l.dtype);
        part.key.assign(static_cast<const char*>(key),
                        static_cast<const char*>(key) + KeyBytes(l, n));
        part.value.assign(static_cast<const char*>(value),
                          static_cast<const char*>(value) + StoredValueBytes(l, n));
        if (l.values_from_keys) {  // No values stored: each is its key's first columns.
          part.value.resize(l.kv_heads * n * l.value_dim * element);
          for (int64_t row = 0; row < l.kv_heads * n; ++row) {
            std::memcpy(part.value.data() + row * l.value_dim * element,
                        part.key.data() + row * l.head_dim * element, l.value_dim * element);
          }
        }
        for (int64_t t = 0; t < n; ++t) opened.tokens.push_back(TokenBytes(l, part, n, t));
        return absl::OkStatus();
      },
      [&](int64_t length) {
        EXPECT_LE(length, static_cast<int64_t>(opened.tokens.size()));
        opened.tokens.resize(length);
        return absl::OkStatus();
      },
      &opened.report);
  opened.status = file.status();
  if (file.ok()) opened.file = *std::move(file);
  return opened;
}

// A file of three records (5, 1 and 7 tokens); the tokens' bytes in order.
std::vector<std::string> WriteThreeRecords(const std::string& dir, const KvLayout& layout,
                                           std::string* path) {
  std::mt19937 rng(29);
  absl::StatusOr<std::unique_ptr<CacheFile>> file = CacheFile::Create(dir, Header(layout));
  EXPECT_TRUE(file.ok()) << file.status();
  std::vector<std::string> tokens;
  for (int64_t n : {5, 1, 7}) {
    const Tokens part = RandomTokens(layout, n, rng);
    EXPECT_TRUE((*file)->Reserve((*file)->BoundFor((*file)->tokens() + n)).ok());
    EXPECT_TRUE((*file)->Write(n, part.key.data(), part.value.data()).ok());
    for (int64_t t = 0; t < n; ++t) tokens.push_back(TokenBytes(layout, part, n, t));
  }
  EXPECT_TRUE((*file)->Sync().ok());
  (*file)->Trim();
  *path = (*file)->path();
  return tokens;
}

const KvLayout kGqaBf16{.kv_heads = 2, .head_dim = 3, .value_dim = 5, .dtype = DType::kBFloat16};

TEST(Crc32cTest, KnownVectorsAndChaining) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);  // The standard check value.
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::mt19937 rng(7);
  std::vector<unsigned char> data(1000);
  for (unsigned char& byte : data) byte = static_cast<unsigned char>(rng());
  for (size_t split : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    EXPECT_EQ(Crc32c(data.data() + split, data.size() - split, Crc32c(data.data(), split)),
              Crc32c(data.data(), data.size()))
        << split;
  }
  // The table and the instruction agree (on a CPU with SSE4.2, Crc32c took the latter).
  for (size_t n : {0, 1, 3, 8, 15, 64, 1000}) {
    EXPECT_EQ(~crc32c_internal::Portable(data.data(), n, ~0u), Crc32c(data.data(), n)) << n;
  }
}

TEST(CacheFileTest, RoundTripKeepsHeaderAndEveryBit) {
  TempDir dir;
  std::string path;
  const std::vector<std::string> written = WriteThreeRecords(dir.path(), kGqaBf16, &path);
  EXPECT_EQ(path, dir.path() + "/0123456789abcdef0123456789abcdef.kv");
  Opened opened = OpenFile(path);
  ASSERT_TRUE(opened.status.ok()) << opened.status;
  EXPECT_EQ(opened.header.id, "0123456789abcdef0123456789abcdef");
  EXPECT_EQ(opened.header.owner, "CN=someone");
  EXPECT_EQ(opened.header.created_ns, 1234567890123);
  EXPECT_EQ(opened.header.layout.kv_heads, 2);
  EXPECT_EQ(opened.header.layout.head_dim, 3);
  EXPECT_EQ(opened.header.layout.value_dim, 5);
  EXPECT_EQ(opened.header.layout.dtype, DType::kBFloat16);
  EXPECT_EQ(opened.report.dropped_bytes, 0);
  EXPECT_EQ(opened.tokens, written);
  EXPECT_EQ(opened.file->tokens(), 13);
  EXPECT_EQ(opened.file->size(), static_cast<int64_t>(fs::file_size(path)));
}

// A latent cache's file (values_from_keys): its header says so (version 2, so that an older
// attnd refuses it rather than read keys as values), its records hold keys only, and it reads
// back every bit.
TEST(CacheFileTest, ALatentCachesFileHoldsItsKeysOnlyAndSaysSo) {
  KvLayout latent = kGqaBf16;
  latent.head_dim = 7;
  latent.value_dim = 5;
  latent.values_from_keys = true;
  KvLayout full = latent;
  full.values_from_keys = false;
  TempDir latent_dir, full_dir;
  std::string latent_path, full_path;
  const std::vector<std::string> written =
      WriteThreeRecords(latent_dir.path(), latent, &latent_path);
  WriteThreeRecords(full_dir.path(), full, &full_path);
  Opened opened = OpenFile(latent_path);
  ASSERT_TRUE(opened.status.ok()) << opened.status;
  EXPECT_TRUE(opened.header.layout.values_from_keys);
  EXPECT_EQ(opened.header.layout.value_dim, 5);
  EXPECT_EQ(opened.tokens, written);
  EXPECT_EQ(opened.report.dropped_bytes, 0);
  // 13 tokens' values fewer, and 4 bytes of flags more.
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(full_path)) -
                static_cast<int64_t>(fs::file_size(latent_path)),
            StoredValueBytes(full, 13) - 4);
  Opened plain = OpenFile(full_path);
  ASSERT_TRUE(plain.status.ok()) << plain.status;
  EXPECT_FALSE(plain.header.layout.values_from_keys);
}

// A cut record (TruncateCache): the file holds its first tokens only, the records after it
// follow on from the cut, and BoundFor counts from it; a torn cut (the file ending inside it)
// keeps the tokens before it, an earlier state of the cache and never a mix.
TEST(CacheFileTest, ACutDropsTheTokensPastItAndLaterRecordsFollowIt) {
  TempDir dir;
  std::string path;
  std::vector<std::string> written = WriteThreeRecords(dir.path(), kGqaBf16, &path);
  Opened opened = OpenFile(path);
  ASSERT_TRUE(opened.status.ok()) << opened.status;
  CacheFile& file = *opened.file;
  ASSERT_TRUE(file.Cut(4).ok());
  EXPECT_EQ(file.tokens(), 4);
  const int64_t after_cut = file.size();
  EXPECT_EQ(file.BoundFor(4), after_cut);
  std::mt19937 rng(31);
  const Tokens more = RandomTokens(kGqaBf16, 3, rng);
  ASSERT_TRUE(file.Write(3, more.key.data(), more.value.data()).ok());
  ASSERT_TRUE(file.Sync().ok());
  EXPECT_LE(file.size(), file.BoundFor(7));
  written.resize(4);
  for (int64_t t = 0; t < 3; ++t) written.push_back(TokenBytes(kGqaBf16, more, 3, t));

  Opened reopened = OpenFile(path);
  ASSERT_TRUE(reopened.status.ok()) << reopened.status;
  EXPECT_EQ(reopened.report.dropped_bytes, 0);
  EXPECT_EQ(reopened.tokens, written);
  EXPECT_EQ(reopened.file->tokens(), 7);
  EXPECT_EQ(reopened.file->BoundFor(4), after_cut);

  // Torn inside the cut record: the 13 tokens before it, and nothing written after it.
  reopened.file.reset();
  fs::resize_file(path, after_cut - 1);
  Opened torn = OpenFile(path);
  ASSERT_TRUE(torn.status.ok()) << torn.status;
  EXPECT_EQ(torn.tokens.size(), 13u);
  EXPECT_GT(torn.report.dropped_bytes, 0);
}

// Every single-byte change anywhere in the file: the open either refuses the header or keeps
// a prefix of the records before the damage, each token bit-identical to what was written.
TEST(CacheFileTest, AnyFlippedByteKeepsOnlyAVerifiedPrefix) {
  TempDir dir;
  std::string path;
  const std::vector<std::string> written = WriteThreeRecords(dir.path(), kGqaBf16, &path);
  const std::string original = ReadFile(path);
  const int64_t token_bytes = 2 * (3 + 5) * 2;
  const int64_t records_start =
      static_cast<int64_t>(original.size()) - 3 * CacheFile::kRecordHeaderBytes - 13 * token_bytes;
  const int64_t record_end[] = {records_start + CacheFile::kRecordHeaderBytes + 5 * token_bytes,
                                records_start + 2 * CacheFile::kRecordHeaderBytes + 6 * token_bytes,
                                static_cast<int64_t>(original.size())};
  const int64_t tokens_before[] = {0, 5, 6};
  int refused = 0, cut = 0;
  for (int64_t at = 0; at < static_cast<int64_t>(original.size()); ++at) {
    std::string damaged = original;
    damaged[at] = static_cast<char>(damaged[at] ^ 0x10);
    WriteFile(path, damaged);
    Opened opened = OpenFile(path);
    if (at < records_start) {
      EXPECT_EQ(opened.status.code(), absl::StatusCode::kDataLoss) << "byte " << at;
      ++refused;
      continue;
    }
    ASSERT_TRUE(opened.status.ok()) << "byte " << at << ": " << opened.status;
    int record = 0;
    while (at >= record_end[record]) ++record;
    ASSERT_EQ(static_cast<int64_t>(opened.tokens.size()), tokens_before[record]) << "byte " << at;
    EXPECT_TRUE(std::equal(opened.tokens.begin(), opened.tokens.end(), written.begin()));
    EXPECT_GT(opened.report.dropped_bytes, 0);
    EXPECT_FALSE(opened.report.why_dropped.empty());
    // The file was cut back to the prefix, so what is written next follows it.
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)), opened.file->size());
    ++cut;
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(cut, 0);
}

TEST(CacheFileTest, TruncatedFileKeepsTheWholeRecordsAndTakesMoreAfterThem) {
  TempDir dir;
  std::string path;
  const std::vector<std::string> written = WriteThreeRecords(dir.path(), kGqaBf16, &path);
  const int64_t size = static_cast<int64_t>(fs::file_size(path));
  fs::resize_file(path, size - 10);  // Inside the last record's payload.
  Opened opened = OpenFile(path);
  ASSERT_TRUE(opened.status.ok()) << opened.status;
  ASSERT_EQ(opened.tokens.size(), 6u);
  EXPECT_TRUE(std::equal(opened.tokens.begin(), opened.tokens.end(), written.begin()));
  EXPECT_NE(opened.report.why_dropped.find("ends inside"), std::string::npos)
      << opened.report.why_dropped;
  // Appending after the cut and reopening: the prefix, then the new tokens.
  std::mt19937 rng(3);
  const Tokens more = RandomTokens(kGqaBf16, 2, rng);
  ASSERT_TRUE(opened.file->Write(2, more.key.data(), more.value.data()).ok());
  ASSERT_TRUE(opened.file->Sync().ok());
  opened.file.reset();
  Opened again = OpenFile(path);
  ASSERT_TRUE(again.status.ok());
  ASSERT_EQ(again.tokens.size(), 8u);
  EXPECT_EQ(again.report.dropped_bytes, 0);
  EXPECT_EQ(again.tokens[6], TokenBytes(kGqaBf16, more, 2, 0));
  EXPECT_EQ(again.tokens[7], TokenBytes(kGqaBf16, more, 2, 1));
}

TEST(CacheFileTest, ListingSkipsAndRemovesHalfCreatedFiles) {
  TempDir dir;
  std::string path;
  WriteThreeRecords(dir.path(), kGqaBf16, &path);
  WriteFile(dir.path() + "/ffffffffffffffffffffffffffffffff.kv.tmp", "half");
  WriteFile(dir.path() + "/notes.txt", "x");
  absl::StatusOr<std::vector<std::string>> files = ListCacheFiles(dir.path());
  ASSERT_TRUE(files.ok());
  EXPECT_EQ(*files, std::vector<std::string>{path});
  EXPECT_FALSE(fs::exists(dir.path() + "/ffffffffffffffffffffffffffffffff.kv.tmp"));
  EXPECT_EQ(ListCacheFiles(dir.path() + "/missing").status().code(), absl::StatusCode::kInternal);
}

// Under a file-size limit (what a full disk looks like to one process): Reserve and Write say
// RESOURCE_EXHAUSTED naming the directory, and a failed write leaves the file as it was. Run in
// a child process, so the limit stays there.
TEST(CacheFileTest, FullDiskIsResourceExhaustedAndLeavesTheFileWhole) {
  TempDir dir;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    signal(SIGXFSZ, SIG_IGN);
    const rlimit limit = {64 << 10, 64 << 10};
    setrlimit(RLIMIT_FSIZE, &limit);
    absl::StatusOr<std::unique_ptr<CacheFile>> file =
        CacheFile::Create(dir.path(), Header(kGqaBf16));
    if (!file.ok()) _exit(10);
    std::mt19937 rng(1);
    const Tokens small = RandomTokens(kGqaBf16, 100, rng);  // 6.4 KB.
    if (!(*file)->Write(100, small.key.data(), small.value.data()).ok()) _exit(11);
    const int64_t size = (*file)->size();
    const absl::Status reserve = (*file)->Reserve((*file)->BoundFor(100000));
    if (reserve.code() != absl::StatusCode::kResourceExhausted) _exit(12);
    if (std::string(reserve.message()).find("--cache-dir=" + dir.path()) == std::string::npos) {
      _exit(13);
    }
    const Tokens big = RandomTokens(kGqaBf16, 8000, rng);  // 512 KB: past the limit.
    const absl::Status write = (*file)->Write(8000, big.key.data(), big.value.data());
    if (write.code() != absl::StatusCode::kResourceExhausted) _exit(14);
    if ((*file)->size() != size || static_cast<int64_t>(fs::file_size((*file)->path())) != size) {
      _exit(15);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's check number " << WEXITSTATUS(status)
                                    << " failed (see the test's _exit codes)";
  Opened opened = OpenFile(dir.path() + "/0123456789abcdef0123456789abcdef.kv");
  ASSERT_TRUE(opened.status.ok());
  EXPECT_EQ(opened.tokens.size(), 100u);
  EXPECT_EQ(opened.report.dropped_bytes, 0);
}

// ---- the registry on a directory --------------------------------------------------------------

class RegistryOnDiskTest : public ::testing::Test {
 protected:
  CacheLimits Limits(int64_t budget = int64_t{64} << 20) {
    return {.budget_bytes = budget, .idle_seconds = 0, .dir = dir_.path(), .sync_seconds = 1};
  }
  // Appends n random tokens through a lease; their bytes, token by token.
  std::vector<std::string> Append(CacheRegistry& registry, const std::string& owner,
                                  const std::string& id, int64_t n) {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire(owner, id, "cache_id");
    EXPECT_TRUE(lease.ok()) << lease.status();
    const KvLayout layout = lease->layout();
    const Tokens tokens = RandomTokens(layout, n, rng_);
    EXPECT_TRUE(lease
                    ->Append(TensorView{tokens.key.data(), layout.dtype},
                             TensorView{tokens.value.data(), layout.dtype}, n, 3.0, 3.0)
                    .ok());
    lease->Commit();
    std::vector<std::string> bytes;
    for (int64_t t = 0; t < n; ++t) bytes.push_back(TokenBytes(layout, tokens, n, t));
    return bytes;
  }
  std::vector<std::string> Contents(CacheRegistry& registry, const std::string& owner,
                                    const std::string& id) {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire(owner, id, "cache_id");
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok()) return {};
    const KvLayout layout = lease->layout();
    const int64_t n = lease->length();
    Tokens tokens;
    tokens.key.resize(KeyBytes(layout, n));
    tokens.value.resize(layout.kv_heads * n * StoredRowBytes(layout.dtype, layout.value_dim));
    EXPECT_TRUE(lease->CopyOut(0, n, tokens.key.data(), tokens.value.data()).ok());
    std::vector<std::string> bytes;
    for (int64_t t = 0; t < n; ++t) bytes.push_back(TokenBytes(layout, tokens, n, t));
    return bytes;
  }

  TempDir dir_;
  CpuBackend backend_{1, 0};
  std::mt19937 rng_{2029};
};

TEST_F(RegistryOnDiskTest, RestoreBringsBackIdsOwnersLayoutsOrderAndEveryBit) {
  const KvLayout layouts[] = {
      {.kv_heads = 1, .head_dim = 16, .value_dim = 16, .dtype = DType::kFloat32},
      {.kv_heads = 2, .head_dim = 8, .value_dim = 8, .dtype = DType::kBFloat16},
      {.kv_heads = 2, .head_dim = 24, .value_dim = 40, .dtype = DType::kFloat16},
      {.kv_heads = 1,
       .head_dim = 40,
       .value_dim = 24,
       .dtype = DType::kBFloat16,
       .values_from_keys = true},  // Latent: keys only, in a version-2 file.
      // fp8: rows with their scales, widths not a multiple of 4 (padded rows).
      {.kv_heads = 2, .head_dim = 13, .value_dim = 6, .dtype = DType::kFloat8E4M3}};
  const std::string owners[] = {"alice", "bob", "alice", "carol", "carol"};
  constexpr int kCaches = 5;
  std::vector<std::string> ids;
  std::vector<std::vector<std::string>> contents;
  {
    CacheRegistry registry(backend_, Limits());
    ASSERT_TRUE(registry.persistent());
    for (int i = 0; i < kCaches; ++i) {
      absl::StatusOr<CacheDescription> cache = registry.Create(owners[i], layouts[i]);
      ASSERT_TRUE(cache.ok()) << cache.status();
      ASSERT_EQ(cache->durable_length, 0);
      ids.push_back(cache->id);
      contents.push_back(Append(registry, owners[i], cache->id, 300 + 77 * i));
      std::vector<std::string> more = Append(registry, owners[i], cache->id, 1);
      contents.back().insert(contents.back().end(), more.begin(), more.end());
    }
    ASSERT_TRUE(registry.Flush().ok());
    EXPECT_EQ(registry.Describe("alice", ids[0])->durable_length, 301);
    EXPECT_GT(registry.disk_bytes(), 0);
    EXPECT_EQ(registry.disk_lag_seconds(), 0.0);
    EXPECT_GT(registry.last_flush_seconds(), 1.7e9);
  }  // Destroyed: a clean shutdown.
  {
    CacheRegistry restored(backend_, Limits());
    absl::StatusOr<std::vector<std::string>> lines = restored.Restore();
    ASSERT_TRUE(lines.ok()) << lines.status();
    ASSERT_EQ(lines->size(), 1u);
    EXPECT_NE((*lines)[0].find("restored 5 caches"), std::string::npos) << (*lines)[0];
    for (int i = 0; i < kCaches; ++i) {
      absl::StatusOr<CacheDescription> info = restored.Describe(owners[i], ids[i]);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->length, static_cast<int64_t>(contents[i].size()));
      EXPECT_EQ(info->durable_length, info->length);
      EXPECT_EQ(info->layout.kv_heads, layouts[i].kv_heads);
      EXPECT_EQ(info->layout.value_dim, layouts[i].value_dim);
      EXPECT_EQ(info->layout.dtype, layouts[i].dtype);
      EXPECT_EQ(info->layout.values_from_keys, layouts[i].values_from_keys);
      EXPECT_EQ(Contents(restored, owners[i], ids[i]), contents[i]) << i;
    }
    EXPECT_EQ(restored.Describe("bob", ids[0]).status().code(), absl::StatusCode::kNotFound);
    const std::vector<CacheDescription> alice = restored.List("alice");
    ASSERT_EQ(alice.size(), 2u);
    EXPECT_EQ(alice[0].id, ids[0]);  // Oldest first, as before the restart.
    EXPECT_EQ(alice[1].id, ids[2]);
    // Appends after the restore land after the restored tokens, and survive the next restart.
    std::vector<std::string> later = Append(restored, "bob", ids[1], 5);
    contents[1].insert(contents[1].end(), later.begin(), later.end());
    ASSERT_TRUE(restored.Delete("alice", ids[2]).ok());
    EXPECT_FALSE(fs::exists(dir_.path() + "/" + ids[2] + ".kv"));
    ASSERT_TRUE(restored.Flush(/*shutdown=*/true).ok());
  }  // The server stops (and lets go of the directory's lock).
  CacheRegistry again(backend_, Limits());
  ASSERT_TRUE(again.Restore().ok());
  EXPECT_EQ(again.caches(), kCaches - 1);
  EXPECT_EQ(Contents(again, "bob", ids[1]), contents[1]);
}

// Cuts (TruncateCache's and a Decode's truncate_to) are on disk before they are acknowledged:
// a restart brings back exactly the kept tokens and what came after, never a cut token; a
// tentative cut that is rolled back leaves the cache (and after the next flush its file) as it
// was; the budget follows the pages.
TEST_F(RegistryOnDiskTest, CutsSurviveARestartAndARolledBackCutChangesNothing) {
  const KvLayout layout{.kv_heads = 2, .head_dim = 8, .value_dim = 5, .dtype = DType::kBFloat16};
  std::string id;
  std::vector<std::string> kept;
  {
    CacheRegistry registry(backend_, Limits());
    ASSERT_TRUE(registry.Restore().ok());
    absl::StatusOr<CacheDescription> cache = registry.Create("alice", layout);
    ASSERT_TRUE(cache.ok()) << cache.status();
    id = cache->id;
    kept = Append(registry, "alice", id, 300);
    ASSERT_TRUE(registry.Flush().ok());
    const int64_t full_bytes = registry.bytes();
    {  // TruncateCache: durable before it returns.
      absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("alice", id, "cache_id");
      ASSERT_TRUE(lease.ok());
      ASSERT_TRUE(lease->Truncate(120).ok());
      lease->Commit();
      EXPECT_EQ(lease->Describe().durable_length, 120);
    }
    kept.resize(120);
    EXPECT_LT(registry.bytes(), full_bytes);  // The pages past the cut went back to the budget.
    std::vector<std::string> more = Append(registry, "alice", id, 40);
    kept.insert(kept.end(), more.begin(), more.end());
    ASSERT_TRUE(registry.Flush().ok());
    {  // A Decode's cut whose call fails: rolled back, in memory and on disk.
      absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("alice", id, "cache_id");
      ASSERT_TRUE(lease.ok());
      ASSERT_TRUE(lease->TruncateTentatively(100).ok());
      EXPECT_EQ(lease->length(), 100);
      const Tokens other = RandomTokens(layout, 7, rng_);
      ASSERT_TRUE(lease
                      ->Append(TensorView{other.key.data(), layout.dtype},
                               TensorView{other.value.data(), layout.dtype}, 7, 3.0, 3.0)
                      .ok());
      ASSERT_TRUE(lease->PersistCut().ok());  // On disk, then the call fails all the same.
      lease->Rollback();
      EXPECT_EQ(lease->length(), 160);
    }
    EXPECT_EQ(Contents(registry, "alice", id), kept);
    ASSERT_TRUE(registry.Flush().ok());  // The writer puts back what the cut record dropped.
    EXPECT_EQ(registry.Describe("alice", id)->durable_length, 160);
    {  // A Decode's cut that succeeds.
      absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("alice", id, "cache_id");
      ASSERT_TRUE(lease.ok());
      ASSERT_TRUE(lease->TruncateTentatively(150).ok());
      const Tokens draft = RandomTokens(layout, 2, rng_);
      ASSERT_TRUE(lease
                      ->Append(TensorView{draft.key.data(), layout.dtype},
                               TensorView{draft.value.data(), layout.dtype}, 2, 3.0, 3.0)
                      .ok());
      ASSERT_TRUE(lease->PersistCut().ok());
      lease->Commit();
      kept.resize(150);
      for (int64_t t = 0; t < 2; ++t) kept.push_back(TokenBytes(layout, draft, 2, t));
    }
    EXPECT_EQ(Contents(registry, "alice", id), kept);
  }  // A clean shutdown writes the last two tokens.
  CacheRegistry restored(backend_, Limits());
  ASSERT_TRUE(restored.Restore().ok());
  EXPECT_EQ(Contents(restored, "alice", id), kept);
  EXPECT_EQ(restored.Describe("alice", id)->durable_length, 152);
}

// A cut that leaves nothing for the disk (back to what it holds) ends the disk's lag at once:
// the writer visits only caches longer than their file, so nothing else would.
TEST_F(RegistryOnDiskTest, ACutBackToTheDiskLeavesNoLag) {
  const KvLayout layout{.kv_heads = 1, .head_dim = 4, .value_dim = 4, .dtype = DType::kFloat32};
  CacheRegistry registry(backend_, Limits());
  ASSERT_TRUE(registry.Restore().ok());
  absl::StatusOr<CacheDescription> cache = registry.Create("alice", layout);
  ASSERT_TRUE(cache.ok());
  Append(registry, "alice", cache->id, 50);
  ASSERT_TRUE(registry.Flush().ok());
  for (const bool tentative : {false, true}) {
    Append(registry, "alice", cache->id, 10);  // Not on disk yet: the lag starts.
    EXPECT_GE(registry.disk_lag_seconds(), 0.0);
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("alice", cache->id, "cache_id");
    ASSERT_TRUE(lease.ok());
    if (tentative) {
      ASSERT_TRUE(lease->TruncateTentatively(50).ok());
      ASSERT_TRUE(lease->PersistCut().ok());
    } else {
      ASSERT_TRUE(lease->Truncate(50).ok());
    }
    lease->Commit();
    EXPECT_EQ(registry.disk_lag_seconds(), 0.0) << (tentative ? "a Decode's cut" : "TruncateCache");
  }
}

// The writer copies a cache's tokens under its lease and writes them after letting go: a cut in
// between must not let the copy land (it would put cut tokens back after the cut record). Passes
// back to back (Flush, on another thread) beside rounds of appends and cuts, then the file
// against what the cache holds.
TEST_F(RegistryOnDiskTest, ACutBetweenTheWritersCopyAndItsWriteIsNotUndone) {
  const KvLayout layout{.kv_heads = 1, .head_dim = 256, .value_dim = 256, .dtype = DType::kFloat32};
  CacheRegistry registry(backend_, Limits(int64_t{256} << 20));
  ASSERT_TRUE(registry.Restore().ok());
  absl::StatusOr<CacheDescription> cache = registry.Create("alice", layout);
  ASSERT_TRUE(cache.ok());
  std::vector<std::string> kept = Append(registry, "alice", cache->id, 50);
  std::atomic<bool> done{false};
  std::thread flusher([&] {
    while (!done.load()) EXPECT_TRUE(registry.Flush().ok());
  });
  for (int round = 0; round < 1000; ++round) {
    std::vector<std::string> more = Append(registry, "alice", cache->id, 300);
    kept.insert(kept.end(), more.begin(), more.end());
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("alice", cache->id, "cache_id");
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(lease->Truncate(lease->length() - 299).ok());
    lease->Commit();
    kept.resize(kept.size() - 299);
  }
  done.store(true);
  flusher.join();
  ASSERT_TRUE(registry.Flush().ok());
  EXPECT_EQ(Contents(registry, "alice", cache->id), kept);
  Opened opened = OpenFile(dir_.path() + "/" + cache->id + ".kv");
  ASSERT_TRUE(opened.status.ok()) << opened.status;
  EXPECT_EQ(opened.tokens.size(), kept.size());
  EXPECT_TRUE(opened.tokens == kept);
}

TEST_F(RegistryOnDiskTest, TwoServersNeverShareADirectory) {
  CacheRegistry first(backend_, Limits());
  ASSERT_TRUE(first.Restore().ok());
  {
    CacheRegistry second(backend_, Limits());
    const absl::StatusOr<std::vector<std::string>> refused = second.Restore();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(refused.status().message().find(absl::StrCat("pid ", getpid())), std::string::npos)
        << refused.status();
  }
}

TEST_F(RegistryOnDiskTest, TheWriterThreadCatchesUpWithinTheSyncInterval) {
  CacheRegistry registry(backend_, Limits());
  const KvLayout layout{.kv_heads = 1, .head_dim = 4, .value_dim = 4, .dtype = DType::kFloat32};
  absl::StatusOr<CacheDescription> cache = registry.Create("o", layout);
  ASSERT_TRUE(cache.ok());
  Append(registry, "o", cache->id, 10);
  EXPECT_EQ(registry.Describe("o", cache->id)->durable_length, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (registry.Describe("o", cache->id)->durable_length != 10 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(registry.Describe("o", cache->id)->durable_length, 10);
  EXPECT_EQ(registry.disk_lag_seconds(), 0.0);
  // A cache appended to without a pause: the lag stays within about one pass of the writer
  // (every 0.5 s here), never the time since the appends began.
  double worst = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1800);
  while (std::chrono::steady_clock::now() < until) {
    Append(registry, "o", cache->id, 1);
    worst = std::max(worst, registry.disk_lag_seconds());
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  EXPECT_GT(worst, 0.0);
  EXPECT_LT(worst, 1.4);
}

TEST_F(RegistryOnDiskTest, RestoreOverTheBudgetRefusesToStartAndKeepsTheFiles) {
  const KvLayout layout{.kv_heads = 4, .head_dim = 64, .value_dim = 64, .dtype = DType::kFloat32};
  std::string id;
  {
    CacheRegistry registry(backend_, Limits());
    absl::StatusOr<CacheDescription> cache = registry.Create("o", layout);
    ASSERT_TRUE(cache.ok());
    id = cache->id;
    Append(registry, "o", id, 2000);
  }
  CacheRegistry small(backend_, Limits(/*budget=*/1 << 20));
  absl::StatusOr<std::vector<std::string>> lines = small.Restore();
  EXPECT_EQ(lines.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(lines.status().message().find("--cache-bytes"), std::string::npos) << lines.status();
  EXPECT_TRUE(fs::exists(dir_.path() + "/" + id + ".kv"));
  EXPECT_EQ(small.caches(), 0);
}

// Forks (ForkCache) on disk: a fork's file holds all its tokens and is durable when Fork
// returns; a restart brings every fork back bit for bit and shares its pages again with the
// cache it was forked from, or with a sibling when that one was deleted, as far as their bytes
// agree, so that caches which fitted the budget before a restart fit it after (here unshared
// they would not).
TEST_F(RegistryOnDiskTest, ForksRestoreWholeAndShareTheirSourcesPagesAgain) {
  const KvLayout layout{.kv_heads = 2, .head_dim = 8, .value_dim = 5, .dtype = DType::kBFloat16};
  std::string source, f1, f2, f3;
  std::map<std::string, std::vector<std::string>> contents;
  int64_t in_use = 0, budget = 0;
  auto fork = [&](CacheRegistry& registry, const std::string& id, int64_t length) {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("o", id, "cache_id");
    EXPECT_TRUE(lease.ok()) << lease.status();
    absl::StatusOr<CacheDescription> forked = registry.Fork(*lease, length);
    EXPECT_TRUE(forked.ok()) << forked.status();
    EXPECT_EQ(forked->length, length);
    EXPECT_EQ(forked->durable_length, length);  // On disk (fsynced) before the answer.
    EXPECT_GT(forked->shared_bytes, 0);
    return forked->id;
  };
  auto cut = [&](CacheRegistry& registry, const std::string& id, int64_t length) {
    absl::StatusOr<CacheRegistry::Lease> lease = registry.Acquire("o", id, "cache_id");
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(lease->Truncate(length).ok());
    lease->Commit();
  };
  {
    CacheRegistry registry(backend_, Limits());
    ASSERT_TRUE(registry.Restore().ok());
    source = registry.Create("o", layout)->id;
    contents[source] = Append(registry, "o", source, 3000);  // 12 pages of 256 tokens.
    const int64_t one = registry.bytes();
    f1 = fork(registry, source, 3000);
    f2 = fork(registry, source, 2100);            // Within a page: shares it partly filled.
    EXPECT_LT(registry.bytes(), one + one / 10);  // Page tables only.
    for (const std::string& id : {f1, f2}) {
      contents[id] = Contents(registry, "o", id);
      std::vector<std::string> own = Append(registry, "o", id, 30);
      contents[id].insert(contents[id].end(), own.begin(), own.end());
    }
    f3 = fork(registry, f1, 3030);
    cut(registry, f3, 1500);
    contents[f3] = std::vector<std::string>(contents[f1].begin(), contents[f1].begin() + 1500);
    std::vector<std::string> own = Append(registry, "o", f3, 20);
    contents[f3].insert(contents[f3].end(), own.begin(), own.end());
    EXPECT_EQ(Contents(registry, "o", source), contents[source]);  // Untouched by its forks.
    ASSERT_TRUE(registry.Delete("o", source).ok());                // f2 now shares with f1 only.
    in_use = registry.bytes();
    budget = in_use + in_use / 4;
    EXPECT_LT(budget, 2 * one);  // Unshared, the three would need more than twice one.
  }
  contents.erase(source);
  {
    CacheRegistry restored(backend_, Limits(budget));
    absl::StatusOr<std::vector<std::string>> lines = restored.Restore();
    ASSERT_TRUE(lines.ok()) << lines.status();
    EXPECT_NE((*lines)[0].find("forks share"), std::string::npos) << (*lines)[0];
    EXPECT_LE(restored.bytes(), in_use);
    for (const auto& [id, tokens] : contents) {
      EXPECT_EQ(Contents(restored, "o", id), tokens) << id;
      EXPECT_GT(restored.Describe("o", id)->shared_bytes, 0) << id;
    }
    // Appends into restored forks write into their own pages, never a shared one.
    std::vector<std::string> more = Append(restored, "o", f2, 40);
    contents[f2].insert(contents[f2].end(), more.begin(), more.end());
    for (const auto& [id, tokens] : contents) EXPECT_EQ(Contents(restored, "o", id), tokens) << id;
    ASSERT_TRUE(restored.Delete("o", f1).ok());
    for (const std::string& id : {f2, f3}) EXPECT_EQ(Contents(restored, "o", id), contents[id]);
  }
  contents.erase(f1);
  CacheRegistry again(backend_, Limits(budget));
  const absl::StatusOr<std::vector<std::string>> lines = again.Restore();
  ASSERT_TRUE(lines.ok()) << lines.status();
  for (const auto& [id, tokens] : contents) EXPECT_EQ(Contents(again, "o", id), tokens) << id;
}

TEST_F(RegistryOnDiskTest, DamagedFilesAreCutOrSetAsideAndTheOthersRestoredWhole) {
  const KvLayout layout{.kv_heads = 1, .head_dim = 8, .value_dim = 8, .dtype = DType::kFloat32};
  std::vector<std::string> ids;
  std::vector<std::vector<std::string>> contents;
  {
    CacheRegistry registry(backend_, Limits());
    for (int i = 0; i < 3; ++i) {
      ids.push_back(registry.Create("o", layout)->id);
      contents.push_back(Append(registry, "o", ids[i], 40));
      ASSERT_TRUE(registry.Flush().ok());  // Two records: 40 tokens, then 40.
      std::vector<std::string> more = Append(registry, "o", ids[i], 40);
      ASSERT_TRUE(registry.Flush().ok());
      contents[i].insert(contents[i].end(), more.begin(), more.end());
    }
  }
  const std::string cut = dir_.path() + "/" + ids[0] + ".kv";
  fs::resize_file(cut, fs::file_size(cut) - 1);
  const std::string header = dir_.path() + "/" + ids[1] + ".kv";
  std::string bytes = ReadFile(header);
  bytes[20] = static_cast<char>(bytes[20] ^ 1);
  WriteFile(header, bytes);
  CacheRegistry restored(backend_, Limits());
  absl::StatusOr<std::vector<std::string>> lines = restored.Restore();
  ASSERT_TRUE(lines.ok()) << lines.status();
  ASSERT_EQ(lines->size(), 3u);
  EXPECT_NE((*lines)[0].find("restored 2 caches"), std::string::npos) << (*lines)[0];
  EXPECT_NE((*lines)[0].find("1 files refused"), std::string::npos) << (*lines)[0];
  std::vector<std::string> first(contents[0].begin(), contents[0].begin() + 40);
  EXPECT_EQ(Contents(restored, "o", ids[0]), first);
  EXPECT_EQ(restored.Describe("o", ids[1]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(fs::exists(header + ".damaged"));
  EXPECT_EQ(Contents(restored, "o", ids[2]), contents[2]);
}

TEST_F(RegistryOnDiskTest, ImportAppearsOnlyWholeAndKeepsOrReplacesItsId) {
  CacheRegistry registry(backend_, Limits());
  const KvLayout layout{.kv_heads = 2, .head_dim = 4, .value_dim = 6, .dtype = DType::kBFloat16};
  const std::string id = "00112233445566778899aabbccddeeff";
  EXPECT_EQ(
      registry.BeginImport("o", "../etc/passwd", "info.cache_id", layout, false).status().code(),
      absl::StatusCode::kInvalidArgument);
  const Tokens tokens = RandomTokens(layout, 50, rng_);
  {
    absl::StatusOr<CacheRegistry::Import> abandoned =
        registry.BeginImport("o", id, "info.cache_id", layout, false);
    ASSERT_TRUE(abandoned.ok());
    ASSERT_TRUE(abandoned->Append(tokens.key.data(), tokens.value.data(), 50, "chunk 1: ").ok());
    EXPECT_EQ(registry.caches(), 0);  // Invisible until Finish.
  }
  EXPECT_EQ(registry.bytes(), 0);  // The abandoned import gave its pages back.
  absl::StatusOr<CacheRegistry::Import> import =
      registry.BeginImport("o", id, "info.cache_id", layout, false);
  ASSERT_TRUE(import.ok());
  // A second import of the same id, begun before the first finishes, is refused at its Finish
  // and leaves the first one's file alone.
  absl::StatusOr<CacheRegistry::Import> rival =
      registry.BeginImport("o", id, "info.cache_id", layout, false);
  ASSERT_TRUE(rival.ok());
  ASSERT_TRUE(import->Append(tokens.key.data(), tokens.value.data(), 50, "chunk 1: ").ok());
  absl::StatusOr<CacheDescription> finished = import->Finish();
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_EQ(finished->id, id);
  EXPECT_EQ(finished->length, 50);
  EXPECT_EQ(rival->Finish().status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.Flush().ok());
  EXPECT_TRUE(fs::exists(dir_.path() + "/" + id + ".kv"));
  EXPECT_EQ(registry.Describe("o", id)->durable_length, 50);
  EXPECT_EQ(registry.BeginImport("o", id, "info.cache_id", layout, false).status().code(),
            absl::StatusCode::kAlreadyExists);
  absl::StatusOr<CacheRegistry::Import> second =
      registry.BeginImport("o", id, "info.cache_id", layout, true);
  ASSERT_TRUE(second.ok());
  absl::StatusOr<CacheDescription> renamed = second->Finish();
  ASSERT_TRUE(renamed.ok());
  EXPECT_NE(renamed->id, id);
  EXPECT_EQ(registry.caches(), 2);
  // A non-finite element is refused, naming the chunk.
  absl::StatusOr<CacheRegistry::Import> third =
      registry.BeginImport("o", "ffeeddccbbaa99887766554433221100", "f", layout, false);
  ASSERT_TRUE(third.ok());
  Tokens bad = tokens;
  StoreElement(bad.value.data(), layout.dtype, 7, std::numeric_limits<float>::infinity());
  const absl::Status refused = third->Append(bad.key.data(), bad.value.data(), 50, "chunk 2: key");
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("chunk 2"), std::string::npos) << refused;
}

}  // namespace
}  // namespace attn
