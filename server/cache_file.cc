#include "server/cache_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "proto/dtype_mapping.h"
#include "server/request.h"

namespace attn {
namespace {

constexpr char kMagic[8] = {'A', 'T', 'T', 'N', 'K', 'V', '0', '1'};
// Version 1: the layout as below; version 2 (written for latent caches and forks only, so that
// files of other caches stay readable by an older attnd): then a u32 of flags, bit 0
// values_from_keys, bit 1 a fork (then u32 + bytes twice: the ids of the cache it was forked
// from and of the first cache of its family, the one no fork made).
constexpr uint32_t kVersion = 1;
constexpr uint32_t kFlagsVersion = 2;
constexpr uint32_t kValuesFromKeysFlag = 1;
constexpr uint32_t kForkFlag = 2;
constexpr uint32_t kRecordMagic = 0x4352564B;  // "KVRC" little-endian.
constexpr uint32_t kTokensRecord = 1;
constexpr uint32_t kCutRecord = 2;
constexpr int64_t kMaxHeaderBody = 1 << 16;

// Little-endian encoding into and out of byte strings (the project only builds little-endian).
template <typename T>
void Put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

template <typename T>
bool Get(const char*& p, const char* end, T* value) {
  if (end - p < static_cast<ptrdiff_t>(sizeof(T))) return false;
  std::memcpy(value, p, sizeof(T));
  p += sizeof(T);
  return true;
}

bool GetString(const char*& p, const char* end, std::string* value) {
  uint32_t n;
  if (!Get(p, end, &n) || end - p < static_cast<ptrdiff_t>(n)) return false;
  value->assign(p, n);
  p += n;
  return true;
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool DiskFull(int error) { return error == ENOSPC || error == EDQUOT || error == EFBIG; }

// A record's 40-byte header: magic, kind, start, n, payload bytes, the payload's CRC32C, then
// the CRC32C of those 36 bytes.
std::string RecordHeader(uint32_t kind, int64_t start, int64_t n, int64_t payload_bytes,
                         uint32_t payload_crc) {
  std::string record;
  Put<uint32_t>(record, kRecordMagic);
  Put<uint32_t>(record, kind);
  Put<int64_t>(record, start);
  Put<int64_t>(record, n);
  Put<uint64_t>(record, static_cast<uint64_t>(payload_bytes));
  Put<uint32_t>(record, payload_crc);
  Put<uint32_t>(record, Crc32c(record.data(), record.size()));
  return record;
}

// Writes all of [data, data + n) at `offset`, retrying short writes; errno on failure.
bool WriteAll(int fd, const void* data, size_t n, int64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t written = pwrite(fd, p, n, offset);
    if (written < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += written;
    n -= static_cast<size_t>(written);
    offset += written;
  }
  return true;
}

// Reads up to n bytes at `offset`; the count read (short only at the end of the file), -1 on
// an error.
int64_t ReadUpTo(int fd, void* data, size_t n, int64_t offset) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = pread(fd, p + got, n - got, offset + static_cast<int64_t>(got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<int64_t>(got);
}

std::string EncodeHeader(const CacheFileHeader& header) {
  std::string body;
  const uint32_t flags = (header.layout.values_from_keys ? kValuesFromKeysFlag : 0) |
                         (header.parent.empty() ? 0 : kForkFlag);
  Put<uint32_t>(body, flags != 0 ? kFlagsVersion : kVersion);
  Put<int64_t>(body, header.layout.kv_heads);
  Put<int64_t>(body, header.layout.head_dim);
  Put<int64_t>(body, header.layout.value_dim);
  Put<uint32_t>(body, static_cast<uint32_t>(ToProtoDType(header.layout.dtype)));
  Put<int64_t>(body, header.created_ns);
  Put<uint32_t>(body, static_cast<uint32_t>(header.owner.size()));
  body += header.owner;
  Put<uint32_t>(body, static_cast<uint32_t>(header.id.size()));
  body += header.id;
  if (flags != 0) Put<uint32_t>(body, flags);
  if ((flags & kForkFlag) != 0) {
    for (const std::string* id : {&header.parent, &header.root}) {
      Put<uint32_t>(body, static_cast<uint32_t>(id->size()));
      body += *id;
    }
  }
  std::string out(kMagic, sizeof kMagic);
  Put<uint32_t>(out, static_cast<uint32_t>(body.size()));
  out += body;
  Put<uint32_t>(out, Crc32c(out.data(), out.size()));
  return out;
}

}  // namespace

void SyncCacheDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  fsync(fd);
  close(fd);
}

CacheFile::CacheFile(std::string path, int fd, const KvLayout& layout, int64_t header_bytes)
    : path_(std::move(path)),
      dir_(DirOf(path_)),
      fd_(fd),
      layout_(layout),
      header_bytes_(header_bytes),
      size_(header_bytes),
      cut_bytes_(header_bytes) {}

CacheFile::~CacheFile() { close(fd_); }

absl::Status CacheFile::Failed(const std::string& what, int error) const {
  const std::string message =
      absl::StrCat(what, " ", path_, ": ", std::strerror(error), " (--cache-dir=", dir_, ")");
  if (DiskFull(error)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the disk of --cache-dir=", dir_, " is full: ", message,
                     "; free space there or delete caches you no longer need"));
  }
  return absl::InternalError(message);
}

absl::StatusOr<std::unique_ptr<CacheFile>> CacheFile::Create(const std::string& dir,
                                                             const CacheFileHeader& header) {
  const std::string path = absl::StrCat(dir, "/", header.id, ".kv");
  const std::string temporary = path + ".tmp";
  const std::string bytes = EncodeHeader(header);
  const int fd = open(temporary.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  auto fail = [&](const std::string& what) -> absl::Status {
    const int error = errno;
    CacheFile file(path, fd, header.layout, 0);  // For its message; closes fd.
    if (fd >= 0) unlink(temporary.c_str());
    return file.Failed(what, error);
  };
  if (fd < 0) {
    const int error = errno;
    const std::string message = absl::StrCat("cannot create ", temporary, ": ",
                                             std::strerror(error), " (--cache-dir=", dir, ")");
    if (DiskFull(error)) return absl::ResourceExhaustedError(message);
    return absl::InternalError(message);
  }
  if (!WriteAll(fd, bytes.data(), bytes.size(), 0)) return fail("cannot write");
  if (fdatasync(fd) != 0) return fail("cannot sync");
  if (rename(temporary.c_str(), path.c_str()) != 0) return fail("cannot rename");
  SyncCacheDir(dir);
  return std::unique_ptr<CacheFile>(
      new CacheFile(path, fd, header.layout, static_cast<int64_t>(bytes.size())));
}

namespace {

// Reads and verifies the header of the file open at `fd` into *header: its bytes, or DATA_LOSS
// naming the file.
absl::StatusOr<int64_t> ReadHeaderAt(int fd, const std::string& path, CacheFileHeader* header) {
  auto damaged = [&](const std::string& why) {
    return absl::DataLossError(
        absl::StrCat(path, ": the header does not verify (", why, "); the file is left as it is"));
  };
  char fixed[sizeof kMagic + 4];
  if (ReadUpTo(fd, fixed, sizeof fixed, 0) != static_cast<int64_t>(sizeof fixed)) {
    return damaged("the file ends inside it");
  }
  if (std::memcmp(fixed, kMagic, sizeof kMagic) != 0) return damaged("not an attnd cache file");
  uint32_t body_bytes;
  std::memcpy(&body_bytes, fixed + sizeof kMagic, 4);
  if (body_bytes > kMaxHeaderBody) return damaged("its length is out of range");
  std::string head(sizeof fixed + body_bytes + 4, '\0');
  if (ReadUpTo(fd, head.data(), head.size(), 0) != static_cast<int64_t>(head.size())) {
    return damaged("the file ends inside it");
  }
  uint32_t stored_crc;
  std::memcpy(&stored_crc, head.data() + head.size() - 4, 4);
  if (Crc32c(head.data(), head.size() - 4) != stored_crc) return damaged("checksum mismatch");
  const char* p = head.data() + sizeof fixed;
  const char* end = head.data() + head.size() - 4;
  uint32_t version, dtype;
  if (!Get(p, end, &version) || (version != kVersion && version != kFlagsVersion)) {
    return damaged("unknown format version");
  }
  if (!Get(p, end, &header->layout.kv_heads) || !Get(p, end, &header->layout.head_dim) ||
      !Get(p, end, &header->layout.value_dim) || !Get(p, end, &dtype) ||
      !Get(p, end, &header->created_ns) || !GetString(p, end, &header->owner) ||
      !GetString(p, end, &header->id)) {
    return damaged("its fields do not fit its length");
  }
  uint32_t flags = 0;
  if (version == kFlagsVersion &&
      (!Get(p, end, &flags) || flags == 0 || (flags & ~(kValuesFromKeysFlag | kForkFlag)) != 0)) {
    return damaged("its flags are unknown");
  }
  header->parent.clear();
  header->root.clear();
  if ((flags & kForkFlag) != 0 &&
      (!GetString(p, end, &header->parent) || !GetString(p, end, &header->root))) {
    return damaged("its fields do not fit its length");
  }
  // The rule a new cache's layout meets (so no record size can overflow); value_dim is stored
  // resolved, never 0.
  const absl::StatusOr<KvLayout> layout =
      CheckCacheLayout(header->layout.kv_heads, header->layout.head_dim, header->layout.value_dim,
                       static_cast<int>(dtype), (flags & kValuesFromKeysFlag) != 0);
  if (!layout.ok() || header->layout.value_dim < 1) {
    return damaged(absl::StrCat("its layout is invalid: ", layout.status().message()));
  }
  header->layout = *layout;
  return static_cast<int64_t>(head.size());
}

}  // namespace

absl::Status CacheFile::ReadHeader(const std::string& path, CacheFileHeader* header) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  const absl::StatusOr<int64_t> bytes = ReadHeaderAt(fd, path, header);
  close(fd);
  return bytes.status();
}

absl::StatusOr<std::unique_ptr<CacheFile>> CacheFile::Open(const std::string& path,
                                                           CacheFileHeader* header,
                                                           const TokenSink& tokens,
                                                           const CutSink& cut, Report* report) {
  *report = Report();
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat info;
  if (fstat(fd, &info) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path, ": ", std::strerror(errno)));
  }
  const int64_t file_size = info.st_size;
  const absl::StatusOr<int64_t> header_bytes = ReadHeaderAt(fd, path, header);
  if (!header_bytes.ok()) {
    close(fd);
    return header_bytes.status();
  }
  std::unique_ptr<CacheFile> file(new CacheFile(path, fd, header->layout, *header_bytes));
  // The records, while they verify.
  const int64_t token_bytes = TokenBytes(header->layout);
  std::vector<char> payload;
  int64_t offset = file->size_;
  while (offset < file_size) {
    char record[kRecordHeaderBytes];
    const int64_t got = ReadUpTo(fd, record, sizeof record, offset);
    if (got < 0) return file->Failed("cannot read", errno);
    if (got < kRecordHeaderBytes) {
      report->why_dropped = "the file ends inside a record's header";
      break;
    }
    const char* r = record;
    uint32_t magic, kind, payload_crc, header_crc;
    int64_t start, n;
    uint64_t bytes;
    Get(r, record + sizeof record, &magic);
    Get(r, record + sizeof record, &kind);
    Get(r, record + sizeof record, &start);
    Get(r, record + sizeof record, &n);
    Get(r, record + sizeof record, &bytes);
    Get(r, record + sizeof record, &payload_crc);
    Get(r, record + sizeof record, &header_crc);
    if (magic != kRecordMagic || Crc32c(record, kRecordHeaderBytes - 4) != header_crc) {
      report->why_dropped = absl::StrCat("a record header at byte ", offset, " does not verify");
      break;
    }
    if (kind == kCutRecord && start >= 0 && start <= file->tokens_ && n == 0 && bytes == 0 &&
        payload_crc == 0) {
      if (absl::Status kept = cut(start); !kept.ok()) return kept;
      file->tokens_ = start;
      offset += kRecordHeaderBytes;
      file->size_ = offset;
      file->cut_bytes_ = offset;
      file->cut_tokens_ = start;
      continue;
    }
    if (kind != kTokensRecord || start != file->tokens_ || n < 1 ||
        n > std::max<int64_t>(1, kMaxRecordPayload / token_bytes) ||
        bytes != static_cast<uint64_t>(n * token_bytes)) {
      report->why_dropped = absl::StrCat("the record at byte ", offset, " does not follow (start ",
                                         start, ", n ", n, " after ", file->tokens_, " tokens)");
      break;
    }
    payload.resize(bytes);
    const int64_t read = ReadUpTo(fd, payload.data(), bytes, offset + kRecordHeaderBytes);
    if (read < 0) return file->Failed("cannot read", errno);
    if (read < static_cast<int64_t>(bytes)) {
      report->why_dropped = absl::StrCat("the file ends inside the record at byte ", offset);
      break;
    }
    if (Crc32c(payload.data(), bytes) != payload_crc) {
      report->why_dropped = absl::StrCat("the payload of the record at byte ", offset, " (tokens ",
                                         start, "..", start + n, ") does not verify");
      break;
    }
    const int64_t key_bytes = KeyBytes(header->layout, n);
    if (absl::Status kept = tokens(start, n, payload.data(), payload.data() + key_bytes);
        !kept.ok()) {
      return kept;
    }
    file->tokens_ += n;
    offset += kRecordHeaderBytes + static_cast<int64_t>(bytes);
    file->size_ = offset;
  }
  report->tokens = file->tokens_;
  report->dropped_bytes = file_size - file->size_;
  if (report->dropped_bytes > 0) {
    if (ftruncate(fd, file->size_) != 0) return file->Failed("cannot cut back", errno);
    fdatasync(fd);
  }
  return file;
}

int64_t CacheFile::TokensPerRecord() const {
  return std::max<int64_t>(1, kMaxRecordPayload / TokenBytes(layout_));
}

int64_t CacheFile::BoundFor(int64_t tokens) const {
  return cut_bytes_ +
         std::max<int64_t>(0, tokens - cut_tokens_) * (TokenBytes(layout_) + kRecordHeaderBytes);
}

absl::Status CacheFile::Reserve(int64_t bytes) {
  if (removed_ || bytes <= reserved_) return absl::OkStatus();
  // A file-size limit (ulimit -f) is a full disk for this process; preallocating beyond the end
  // would not meet it (the size does not change), the writes would.
  int64_t most = INT64_MAX;
  rlimit limit;
  if (getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    most = static_cast<int64_t>(std::min<rlim_t>(limit.rlim_cur, INT64_MAX));
  }
  if (bytes > most) return Failed("cannot allocate space for", EFBIG);
  // Ahead by an eighth (at least 1 MiB), so that one-token appends rarely reach the disk here.
  const int64_t ahead =
      std::min(most, std::max<int64_t>(bytes + bytes / 8, bytes + (int64_t{1} << 20)));
  int result = fallocate(fd_, FALLOC_FL_KEEP_SIZE, 0, ahead);
  if (result != 0 && DiskFull(errno)) {
    result = fallocate(fd_, FALLOC_FL_KEEP_SIZE, 0, bytes);  // Perhaps the exact need fits.
    if (result == 0) {
      reserved_ = bytes;
      return absl::OkStatus();
    }
  }
  if (result != 0) {
    if (DiskFull(errno)) return Failed("cannot allocate space for", errno);
    reserved_ = most;  // This file system cannot preallocate: writes find out instead.
    return absl::OkStatus();
  }
  reserved_ = ahead;
  return absl::OkStatus();
}

absl::Status CacheFile::Write(int64_t n, const void* key, const void* value) {
  if (removed_) {
    tokens_ += n;
    return absl::OkStatus();
  }
  const int64_t key_bytes = KeyBytes(layout_, n);
  const int64_t value_bytes = StoredValueBytes(layout_, n);
  const std::string record = RecordHeader(kTokensRecord, tokens_, n, key_bytes + value_bytes,
                                          Crc32c(value, value_bytes, Crc32c(key, key_bytes)));
  // The payload first and the header last: a crash in between leaves a tail that never verifies.
  const int64_t at = size_;
  if (!WriteAll(fd_, key, key_bytes, at + kRecordHeaderBytes) ||
      !WriteAll(fd_, value, value_bytes, at + kRecordHeaderBytes + key_bytes) ||
      !WriteAll(fd_, record.data(), record.size(), at)) {
    const int error = errno;
    [[maybe_unused]] const int cut = ftruncate(fd_, at);
    return Failed("cannot write", error);
  }
  size_ = at + kRecordHeaderBytes + key_bytes + value_bytes;
  tokens_ += n;
  return absl::OkStatus();
}

absl::Status CacheFile::Cut(int64_t length) {
  if (removed_) {
    tokens_ = length;
    return absl::OkStatus();
  }
  const std::string record = RecordHeader(kCutRecord, length, 0, 0, 0);
  const int64_t at = size_;
  if (!WriteAll(fd_, record.data(), record.size(), at)) {
    const int error = errno;
    [[maybe_unused]] const int cut = ftruncate(fd_, at);
    return Failed("cannot write", error);
  }
  size_ = at + kRecordHeaderBytes;
  tokens_ = length;
  cut_bytes_ = size_;
  cut_tokens_ = length;
  return absl::OkStatus();
}

absl::Status CacheFile::Sync() {
  if (removed_ || fdatasync(fd_) == 0) return absl::OkStatus();
  return Failed("cannot sync", errno);
}

void CacheFile::Trim() {
  if (removed_ || reserved_ <= size_) return;
  [[maybe_unused]] const int cut = ftruncate(fd_, size_);
  reserved_ = 0;
}

void CacheFile::Remove() {
  if (removed_) return;
  removed_ = true;
  unlink(path_.c_str());
}

absl::StatusOr<std::unique_ptr<CacheDirLock>> CacheDirLock::Take(const std::string& dir) {
  const std::string path = dir + "/attnd.lock";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char holder[32] = {};
    [[maybe_unused]] const ssize_t got = pread(fd, holder, sizeof holder - 1, 0);
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("another attnd (pid ", absl::StripAsciiWhitespace(holder),
                     ") uses --cache-dir=", dir, "; two servers must never share one directory"));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) == 0) WriteAll(fd, pid.data(), pid.size(), 0);
  return std::unique_ptr<CacheDirLock>(new CacheDirLock(fd));
}

CacheDirLock::~CacheDirLock() { close(fd_); }  // Closing the file releases the lock.

absl::StatusOr<std::vector<std::string>> ListCacheFiles(const std::string& dir) {
  DIR* handle = opendir(dir.c_str());
  if (handle == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot read --cache-dir=", dir, ": ", std::strerror(errno)));
  }
  std::vector<std::string> files;
  while (const dirent* entry = readdir(handle)) {
    const std::string name = entry->d_name;
    if (absl::EndsWith(name, ".kv.tmp")) {
      unlink(absl::StrCat(dir, "/", name).c_str());
    } else if (absl::EndsWith(name, ".kv") && name.size() > 3) {
      files.push_back(absl::StrCat(dir, "/", name));
    }
  }
  closedir(handle);
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace attn
