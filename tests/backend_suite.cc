#include "tests/backend_suite.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attn::testing {
namespace {

// Opened backends (or the error opening gave) by backend name and options.
struct OpenBackends {
  std::mutex mutex;
  std::map<std::pair<std::string, SuiteOptions>, absl::StatusOr<std::unique_ptr<Backend>>> opened;
};

OpenBackends& Opened() {
  static OpenBackends* const opened = new OpenBackends;
  return *opened;
}

}  // namespace

absl::StatusOr<Backend*> OpenSuiteBackend(const SuiteBackend& backend,
                                          const SuiteOptions& options) {
  OpenBackends& all = Opened();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto key = std::make_pair(backend.name, options);
  auto it = all.opened.find(key);
  if (it == all.opened.end()) it = all.opened.emplace(key, backend.open(options)).first;
  if (!it->second.ok()) return it->second.status();
  return it->second->get();
}

void CloseSuiteBackends() {
  OpenBackends& all = Opened();
  std::lock_guard<std::mutex> lock(all.mutex);
  all.opened.clear();
}

bool GpuRequired() {
  const char* value = std::getenv("ATTN_REQUIRE_GPU");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

OpenOutcome OpenOrExplain(const SuiteBackend& backend, const SuiteOptions& options) {
  OpenOutcome outcome;
  absl::StatusOr<Backend*> opened = OpenSuiteBackend(backend, options);
  if (opened.ok()) {
    outcome.backend = *opened;
  } else if (backend.must_open()) {
    outcome.failure =
        absl::StrCat("the ", backend.name, " backend did not open (",
                     "ATTN_REQUIRE_GPU=", GpuRequired(), "): ", opened.status().ToString());
  } else {
    outcome.skip = absl::StrCat("no ", backend.name, " device: ", opened.status().ToString());
  }
  return outcome;
}

std::string BackendName(const ::testing::TestParamInfo<SuiteBackend>& info) {
  return info.param.name;
}

void PrintTo(const SuiteBackend& backend, std::ostream* os) { *os << backend.name; }

}  // namespace attn::testing
