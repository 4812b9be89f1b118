#include "server/cache_transfer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "proto/dtype_mapping.h"
#include "server/request.h"
#include "server/response.h"

namespace attn {

namespace v1 = attention::v1;

namespace {

void SetShape(v1::Tensor* tensor, int64_t kv_heads, int64_t n, int64_t dim, DType dtype) {
  tensor->add_shape(kv_heads);
  tensor->add_shape(n);
  tensor->add_shape(dim);
  tensor->set_dtype(ToProtoDType(dtype));
}

}  // namespace

absl::StatusOr<CacheExporter> CacheExporter::Start(CacheRegistry& caches, const std::string& owner,
                                                   const std::string& id,
                                                   const std::string& field) {
  absl::StatusOr<CacheRegistry::Lease> lease = caches.Acquire(owner, id, field);
  if (!lease.ok()) return lease.status();
  return CacheExporter(caches, owner, field, lease->Describe(), lease->cuts());
}

absl::StatusOr<bool> CacheExporter::Next(v1::CacheChunk* chunk) {
  chunk->Clear();
  if (done_) return false;
  if (!info_sent_) {
    CacheDescription info = info_;
    info.durable_length.reset();
    EncodeCacheInfo(info, chunk->mutable_info());
    info_sent_ = true;
  }
  const KvLayout& layout = info_.layout;
  if (sent_ < info_.length) {
    const int64_t n =
        std::min(info_.length - sent_, std::max<int64_t>(1, kChunkBytes / TokenBytes(layout)));
    absl::StatusOr<CacheRegistry::Lease> lease = caches_->Acquire(owner_, info_.id, field_);
    if (!lease.ok()) return lease.status();
    if (lease->cuts() != cuts_) {
      return absl::AbortedError(absl::StrCat("cache ", info_.id,
                                             " was truncated during its export (TruncateCache or "
                                             "a Decode's truncate_to); export it again"));
    }
    // The stored bytes: a latent cache's chunks carry keys alone.
    const bool latent = layout.values_from_keys;
    std::string* key = chunk->mutable_key()->mutable_data();
    std::string value_bytes;
    std::string* value = latent ? &value_bytes : chunk->mutable_value()->mutable_data();
    key->resize(KeyBytes(layout, n));
    value->resize(StoredValueBytes(layout, n));
    if (absl::Status copied =
            lease->CopyOut(sent_, sent_ + n, key->data(), latent ? nullptr : value->data());
        !copied.ok()) {
      return copied;
    }
    SetShape(chunk->mutable_key(), layout.kv_heads, n, layout.head_dim, layout.dtype);
    if (!latent)
      SetShape(chunk->mutable_value(), layout.kv_heads, n, layout.value_dim, layout.dtype);
    chunk->set_start(sent_);
    crc_ = Crc32c(value->data(), value->size(), Crc32c(key->data(), key->size(), crc_));
    sent_ += n;
  }
  if (sent_ == info_.length) {
    chunk->set_crc32c(crc_);
    done_ = true;
  }
  return true;
}

absl::Status CacheImporter::Add(const v1::CacheChunk& chunk, int64_t index) {
  const std::string at = absl::StrCat("chunk ", index, ": ");
  auto invalid = [&](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(at, field, " ", why));
  };
  if (index == 0) {
    if (!chunk.has_info()) return invalid("info", "is missing; the first chunk carries it");
    const v1::CacheInfo& info = chunk.info();
    absl::StatusOr<KvLayout> layout = CheckCacheLayout(
        info.kv_heads(), info.head_dim(), info.value_dim(), info.dtype(), info.values_from_keys());
    if (!layout.ok()) return invalid("info.", std::string(layout.status().message()));
    if (info.length() < 0) return invalid("info.length", absl::StrCat("is ", info.length()));
    absl::StatusOr<CacheRegistry::Import> import = caches_->BeginImport(
        owner_, info.cache_id(), at + "info.cache_id", *layout, chunk.new_id_if_taken());
    if (!import.ok()) return import.status();
    import_.emplace(*std::move(import));
    expected_length_ = info.length();
  } else if (chunk.has_info()) {
    return invalid("info", "is set; only the first chunk carries it");
  }
  if (sent_crc_) return invalid("", "follows the chunk that carried crc32c (the last)");
  const KvLayout& layout = import_->layout();
  const bool has_tokens = chunk.has_key() || chunk.has_value();
  if (has_tokens) {
    if (chunk.start() != import_->length()) {
      return invalid("start", absl::StrCat("is ", chunk.start(), "; the chunks before it brought ",
                                           import_->length(), " tokens"));
    }
    const int64_t n = chunk.key().shape_size() == 3 ? chunk.key().shape(1) : 0;
    if (layout.values_from_keys && chunk.has_value()) {
      return invalid("value",
                     "is set, but the cache is latent (values_from_keys): its chunks "
                     "carry keys alone");
    }
    const std::pair<const v1::Tensor*, int64_t> parts[] = {{&chunk.key(), layout.head_dim},
                                                           {&chunk.value(), layout.value_dim}};
    for (const auto& [tensor, dim] : parts) {
      if (tensor == &chunk.value() && layout.values_from_keys) continue;
      const std::string name = tensor == &chunk.key() ? "key" : "value";
      const std::string want =
          absl::StrCat("[", layout.kv_heads, ", n, ", dim, "] in ", DTypeName(layout.dtype));
      if (tensor->shape_size() != 3 || tensor->shape(0) != layout.kv_heads ||
          tensor->shape(1) < 1 || tensor->shape(1) != n || tensor->shape(2) != dim ||
          FromProtoCacheDType(tensor->dtype()) != layout.dtype) {
        return invalid(name,
                       absl::StrCat("must be ", want, " with n ≥ 1 the same for key and value"));
      }
      if (n > static_cast<int64_t>(tensor->data().size())) {  // Before any product with n.
        return invalid(name + ".data", absl::StrCat("holds ", tensor->data().size(),
                                                    " bytes, fewer than its ", n, " tokens"));
      }
      // Stored rows (an fp8 row with its scale: StoredRowBytes).
      const int64_t bytes = layout.kv_heads * n * StoredRowBytes(layout.dtype, dim);
      if (static_cast<int64_t>(tensor->data().size()) != bytes) {
        return invalid(name + ".data", absl::StrCat("holds ", tensor->data().size(),
                                                    " bytes; its shape needs ", bytes));
      }
    }
    if (n > expected_length_ - import_->length()) {
      return invalid("key", absl::StrCat("brings tokens up to ", import_->length() + n,
                                         ", past the export's info.length ", expected_length_));
    }
    if (absl::Status appended =
            import_->Append(chunk.key().data().data(), chunk.value().data().data(), n, at + "key");
        !appended.ok()) {
      return appended;
    }
    crc_ = Crc32c(chunk.value().data().data(), chunk.value().data().size(),
                  Crc32c(chunk.key().data().data(), chunk.key().data().size(), crc_));
  }
  if (chunk.has_crc32c()) sent_crc_ = chunk.crc32c();
  return absl::OkStatus();
}

absl::StatusOr<CacheDescription> CacheImporter::Finish() {
  if (!import_) return absl::InvalidArgumentError("the stream held no chunk; nothing imported");
  if (import_->length() != expected_length_ || !sent_crc_) {
    return absl::DataLossError(absl::StrCat("the stream ended after ", import_->length(),
                                            " of the export's ", expected_length_, " tokens",
                                            sent_crc_ ? "" : " without its last chunk (crc32c)",
                                            "; the export was cut short: nothing imported"));
  }
  if (*sent_crc_ != crc_) {
    return absl::DataLossError(absl::StrCat("the tokens' CRC32C is ", crc_, ", the export's ",
                                            *sent_crc_,
                                            ": the data was damaged on the way; nothing imported"));
  }
  absl::StatusOr<CacheDescription> finished = import_->Finish();
  if (!finished.ok()) return finished.status();
  finished->crc32c = crc_;
  return finished;
}

}  // namespace attn
