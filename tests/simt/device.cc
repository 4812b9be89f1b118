// The SIMT emulator's device side (device.h): blocks run one at a time, each thread a fiber;
// barriers, warp collectives, shared memory and its checks, asynchronous copies, launches.
#include "tests/simt/device.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tests/simt/fiber.h"
#include "tests/simt/host_api.h"
#include "tests/simt/mma.h"

namespace simt {
namespace detail {
const ThreadHeader* current_thread = nullptr;
}  // namespace detail

namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kDefaultDynamicShared = 48 * 1024;  // Without cudaFuncSetAttribute.
constexpr int kReportsPrintedPerLaunch = 10;
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStackBytes = 1 << 20;  // ASan's redzones make frames larger.
#else
constexpr size_t kStackBytes = 256 << 10;
#endif

// What one byte of shared memory saw in the current barrier interval (racecheck) and whether
// this block ever wrote it (initcheck). Epochs are unique across blocks and launches, so a cell
// left by an earlier block never matches.
struct Cell {
  uint32_t write_epoch = 0, read_epoch = 0;
  uint32_t init_epoch = 0;                   // The block's first epoch once a write landed.
  uint16_t writer = 0, reader = 0;           // Linear thread indices; kManyReaders.
  uint16_t write_syncs = 0, read_syncs = 0;  // The warp's __syncwarp count at the access.
};
constexpr uint16_t kManyReaders = 0xffff;

struct SharedBuffer {
  const void* tag = nullptr;  // Null: the dynamic buffer.
  std::string name;
  char* data = nullptr;
  size_t bytes = 0;
  std::vector<Cell> cells;  // Racecheck builds only.
  bool reported_uninit = false;
  bool reported_race = false;
};

enum class Wait { kRunnable, kBarrier, kWarp, kDone };

struct Copy {
  void* shared;
  const void* global;
  int bytes, source_bytes;
  int64_t group;
};

struct Thread : ThreadHeader {
  int linear = 0, warp = 0, lane = 0;
  Fiber* fiber = nullptr;
  Wait wait = Wait::kRunnable;
  uint64_t waited_generation = 0;
  Site wait_site;
  std::vector<Copy> copies;  // Queued cp.async, oldest first.
  int64_t open_group = 0;    // Copies of groups below it are committed.
};

enum class Collective { kNone, kSyncWarp, kShuffle, kBallot, kMma };

const char* CollectiveName(Collective op) {
  switch (op) {
    case Collective::kNone:
      return "nothing";
    case Collective::kSyncWarp:
      return "__syncwarp";
    case Collective::kShuffle:
      return "a shuffle";
    case Collective::kBallot:
      return "a vote";
    case Collective::kMma:
      return "mma.sync";
  }
  return "?";
}

// One warp's collective in progress: each lane deposits its operands, the last to arrive
// computes every lane's result.
struct Warp {
  Collective op = Collective::kNone;
  unsigned mask = 0, arrived = 0, exited = 0;
  Site site;
  ShuffleKind kind = ShuffleKind::kIndex;
  int width = kWarpSize;
  uint64_t generation = 0;
  uint16_t syncs = 0;  // Completed __syncwarp.
  uint64_t payload[kWarpSize] = {}, result[kWarpSize] = {};
  int operand[kWarpSize] = {};
  MmaType mma_type = MmaType::kF16;
  uint32_t a[kWarpSize][4] = {}, b[kWarpSize][2] = {};
  float d[kWarpSize][4] = {};
};

struct Block {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int live = 0;
  // __syncthreads in progress.
  int arrived = 0;
  uint64_t generation = 0;
  Site barrier_site;
  int count = 0, count_result = 0;
  // Racecheck's interval and the barrier that opened it.
  uint32_t epoch = 0, first_epoch = 0;
  Site interval_start;
  bool interval_at_barrier = false;
  SharedBuffer dynamic;
  std::vector<std::unique_ptr<SharedBuffer>> statics;
  uintptr_t shared_lo = UINTPTR_MAX, shared_hi = 0;
  bool failed = false;
  bool reported_exits = false;
  const KernelBody* body = nullptr;
  // What device code may touch beyond shared memory and its thread's stack (checked builds):
  // device-accessible memory (a snapshot: nothing is allocated or freed during a launch), and
  // the launch's arguments; the last range hit first.
  std::vector<std::pair<uintptr_t, uintptr_t>> accessible;
  std::pair<uintptr_t, uintptr_t> last_hit{0, 0};
  bool reported_host_access = false;
};

// The device: one launch at a time.
std::mutex device_mutex;
uint32_t next_epoch = 1;
std::vector<std::unique_ptr<Fiber>> fiber_pool;
thread_local Block* current_block = nullptr;
thread_local Thread* current = nullptr;

std::mutex reports_mutex;
std::vector<std::string> reports;
int printed_this_launch = 0;

std::mutex attributes_mutex;
std::map<const void*, int> max_dynamic_shared;

// ResetDevice (host_api.cc) forgets the reports with the errors they caused.
[[maybe_unused]] const bool reset_hook_added = [] {
  AddResetHook([] {
    std::lock_guard lock(reports_mutex);
    reports.clear();
  });
  return true;
}();

std::string Where(const Site& site) {
  std::string file = site.file_name();
  if (const size_t slash = file.rfind('/'); slash != std::string::npos) {
    // Keep the last two components: kernels/cuda/tiled.cu reads better than a full path.
    const size_t previous = file.rfind('/', slash - 1);
    if (previous != std::string::npos) file = file.substr(previous + 1);
  }
  return absl::StrCat(file, ":", site.line());
}

bool SameSite(const Site& a, const Site& b) {
  // One call site's file name is one string literal: compare the pointers before the text.
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

std::string Who(const Thread& t) {
  return absl::StrFormat("thread (%u,%u,%u) of block (%u,%u,%u)", t.thread_idx.x, t.thread_idx.y,
                         t.thread_idx.z, t.block_idx.x, t.block_idx.y, t.block_idx.z);
}

void Report(const std::string& message) {
  if (current_block != nullptr) current_block->failed = true;
  std::lock_guard lock(reports_mutex);
  reports.push_back(message);
  if (printed_this_launch++ < kReportsPrintedPerLaunch) {
    std::fprintf(stderr, "simt: %s\n", message.c_str());
  }
}

Thread& Current(const char* what) {
  if (current == nullptr) {
    std::fprintf(stderr, "simt: %s called outside a kernel's thread\n", what);
    std::abort();
  }
  return *current;
}

void Park(Thread& t, Wait wait, uint64_t generation, const Site& site) {
  t.wait = wait;
  t.waited_generation = generation;
  t.wait_site = site;
  Fiber::Suspend();
  t.wait = Wait::kRunnable;
}

void OpenInterval(Block& b, const Site& site, bool at_barrier) {
  b.epoch = next_epoch++;
  b.interval_start = site;
  b.interval_at_barrier = at_barrier;
}

void CompleteBarrier(Block& b) {
  if (b.live < static_cast<int>(b.threads.size()) && !b.reported_exits) {
    // Exited threads let a device's barrier complete too, but a barrier that not every thread
    // reaches is undefined (CUDA's __syncthreads contract): compute-sanitizer's synccheck says so.
    b.reported_exits = true;
    Report(absl::StrCat("synccheck: __syncthreads at ", Where(b.barrier_site), " in block (",
                        b.threads[0].block_idx.x, ",", b.threads[0].block_idx.y, ",",
                        b.threads[0].block_idx.z, ") completes without ",
                        b.threads.size() - static_cast<size_t>(b.live),
                        " threads, which exited before reaching it"));
  }
  b.arrived = 0;
  b.count_result = b.count;
  b.count = 0;
  ++b.generation;
  OpenInterval(b, b.barrier_site, true);
}

// --- Warp collectives -----------------------------------------------------------------------

std::string Lanes(unsigned mask) {
  std::string out;
  for (int lane = 0; lane < kWarpSize; ++lane) {
    if (mask & (1u << lane)) absl::StrAppend(&out, out.empty() ? "" : ",", lane);
  }
  return out;
}

// This lane's arrival at a collective: deposit(warp, lane) stores its operands; the last lane
// of the mask runs complete(warp). Returns when the collective is complete, false when it cannot
// be (a synccheck report has been made).
template <class Deposit, class Complete>
bool Arrive(Collective op, unsigned mask, const Site& site, Deposit&& deposit,
            Complete&& complete) {
  Thread& t = Current(CollectiveName(op));
  Block& b = *current_block;
  Warp& w = b.warps[t.warp];
  const unsigned bit = 1u << t.lane;
  // Lanes a partial last warp does not have are neither live nor exited: they cannot take part.
  const int warp_threads =
      std::min<int>(kWarpSize, static_cast<int>(b.threads.size()) - t.warp * kWarpSize);
  const unsigned present = warp_threads == kWarpSize ? kFullMask : (1u << warp_threads) - 1;
  if ((mask & bit) == 0) {
    Report(absl::StrCat("synccheck: ", Who(t), " calls ", CollectiveName(op), " at ", Where(site),
                        " with mask 0x", absl::Hex(mask), ", which leaves its own lane out"));
    return false;
  }
  if (const unsigned gone = mask & (w.exited | ~present); gone != 0) {
    Report(absl::StrCat("synccheck: ", Who(t), " calls ", CollectiveName(op), " at ", Where(site),
                        " with mask 0x", absl::Hex(mask), ", but lanes ", Lanes(gone),
                        " have exited or do not exist"));
    return false;
  }
  if (w.arrived == 0) {
    w.op = op;
    w.mask = mask;
    w.site = site;
  } else if (w.op != op || w.mask != mask ||
             // Lanes may meet at different __syncwarp calls (sm_70 on); every other collective
             // is one instruction that all of its lanes execute.
             (op != Collective::kSyncWarp && !SameSite(w.site, site))) {
    Report(absl::StrCat("synccheck: divergent warp collective: ", Who(t), " calls ",
                        CollectiveName(op), " at ", Where(site), " (mask 0x", absl::Hex(mask),
                        ") while lanes ", Lanes(w.arrived), " wait in ", CollectiveName(w.op),
                        " at ", Where(w.site), " (mask 0x", absl::Hex(w.mask), ")"));
    return false;
  }
  deposit(w, t.lane);
  w.arrived |= bit;
  if (w.arrived == w.mask) {
    complete(w);
    w.arrived = 0;
    ++w.generation;
    return true;
  }
  Park(t, Wait::kWarp, w.generation, site);
  return true;
}

// --- Shared memory --------------------------------------------------------------------------

// Without ASan (the racecheck build) the emulator checks shared memory's bounds itself: each
// buffer has a redzone on either side, and an access that touches one is reported. With ASan the
// allocation is exact, so ASan's own redzone starts right past the last byte.
size_t Redzone() { return SharedAccessesChecked() ? 64 : 0; }

void TrackRange(Block& b, const SharedBuffer& buffer) {
  const auto lo = reinterpret_cast<uintptr_t>(buffer.data);
  b.shared_lo = std::min(b.shared_lo, lo - Redzone());
  b.shared_hi = std::max(b.shared_hi, lo + buffer.bytes + Redzone());
}

// Shared memory starts each block with garbage, as on a device: all-ones bytes, NaN as fp32,
// fp16 and bf16 alike, so a kernel that reads what it never wrote gets NaN.
void Poison(SharedBuffer& buffer) { std::memset(buffer.data, 0xff, buffer.bytes); }

void Allocate(SharedBuffer& buffer, size_t bytes) {
  buffer.bytes = bytes;
  char* raw = static_cast<char*>(
      ::operator new (std::max<size_t>(bytes + 2 * Redzone(), 1), std::align_val_t{16}));
  buffer.data = raw + Redzone();
  if (SharedAccessesChecked()) buffer.cells.assign(bytes, Cell{});
}

void Free(SharedBuffer& buffer) {
  if (buffer.data != nullptr) ::operator delete (buffer.data - Redzone(), std::align_val_t{16});
  buffer.data = nullptr;
  buffer.cells.clear();
}

// The buffer whose bytes or redzones hold `address`.
SharedBuffer* BufferAt(Block& b, uintptr_t address) {
  auto contains = [&](const SharedBuffer& s) {
    const auto lo = reinterpret_cast<uintptr_t>(s.data);
    return s.data != nullptr && address + Redzone() >= lo &&
           address < lo + std::max<size_t>(s.bytes, 1) + Redzone();
  };
  if (contains(b.dynamic)) return &b.dynamic;
  for (auto& s : b.statics) {
    if (contains(*s)) return s.get();
  }
  return nullptr;
}

std::string Interval(const Block& b) {
  return b.interval_at_barrier ? absl::StrCat("since the barrier at ", Where(b.interval_start))
                               : std::string("since the block started");
}

// Racecheck and initcheck of one access by thread t (device.h); a write that `lands` makes the
// bytes initialized (a cp.async's issue claims them for the thread but writes nothing yet).
// `what` names the access.
void CheckAccess(Block& b, Thread& t, uintptr_t address, size_t bytes, bool write, bool lands,
                 const char* what, const void* pc) {
  SharedBuffer* buffer = BufferAt(b, address);
  if (buffer == nullptr) return;
  const auto lo = reinterpret_cast<uintptr_t>(buffer->data);
  if (address < lo || address + bytes > lo + buffer->bytes) {
    Report(absl::StrFormat(
        "memcheck: %s %s %zu bytes at byte %lld of shared `%s` (%zu bytes): %s (pc %p)", Who(t),
        what, bytes, static_cast<long long>(address - lo), buffer->name, buffer->bytes,
        address < lo ? "before its start" : "past its end", pc));
    return;
  }
  if (buffer->cells.empty()) return;
  const uint16_t me = static_cast<uint16_t>(t.linear);
  const uint16_t syncs = b.warps[t.warp].syncs;
  // Two accesses of one interval conflict unless one thread made both, or two lanes of one warp
  // with a __syncwarp between them.
  auto conflicts = [&](uint16_t other, uint16_t other_syncs) {
    if (other == me) return false;
    if (other == kManyReaders) return true;
    return other / kWarpSize != me / kWarpSize || other_syncs == syncs;
  };
  for (size_t i = 0; i < bytes; ++i) {
    Cell& c = buffer->cells[address - lo + i];
    std::string hazard;
    uint16_t other = 0;
    if (c.write_epoch == b.epoch && conflicts(c.writer, c.write_syncs)) {
      hazard = write ? "write after write" : "read after write";
      other = c.writer;
    } else if (write && c.read_epoch == b.epoch && conflicts(c.reader, c.read_syncs)) {
      hazard = "write after read";
      other = c.reader;
    }
    if (!hazard.empty() && !buffer->reported_race) {
      buffer->reported_race = true;
      const std::string them = other == kManyReaders
                                   ? std::string("several threads")
                                   : absl::StrCat("thread ", other, " (linear index)");
      Report(absl::StrFormat(
          "racecheck: %s hazard on byte %zu of shared `%s`: %s %s it and %s "
          "accessed it %s, with no barrier between (pc %p)",
          hazard, address - lo + i, buffer->name, Who(t), what, them, Interval(b), pc));
    }
    if (!write && c.init_epoch != b.first_epoch && !buffer->reported_uninit) {
      buffer->reported_uninit = true;
      Report(absl::StrFormat(
          "initcheck: %s reads byte %zu of shared `%s`, which this block never wrote (pc %p)",
          Who(t), address - lo + i, buffer->name, pc));
    }
    if (write) {
      if (lands) c.init_epoch = b.first_epoch;
      c.write_epoch = b.epoch;
      c.writer = me;
      c.write_syncs = syncs;
    } else if (c.read_epoch != b.epoch) {
      c.read_epoch = b.epoch;
      c.reader = me;
      c.read_syncs = syncs;
    } else if (c.reader != me) {
      c.reader = kManyReaders;
    }
  }
}

void Land(Block& b, Thread& t, const Copy& copy) {
  std::memcpy(copy.shared, copy.global, static_cast<size_t>(copy.source_bytes));
  std::memset(static_cast<char*>(copy.shared) + copy.source_bytes, 0,
              static_cast<size_t>(copy.bytes - copy.source_bytes));
  const auto address = reinterpret_cast<uintptr_t>(copy.shared);
  CheckAccess(b, t, address, static_cast<size_t>(copy.bytes), /*write=*/true, /*lands=*/true,
              "lands a cp.async into", nullptr);
}

// --- Blocks ---------------------------------------------------------------------------------

void ThreadMain(void* argument) {
  Thread& t = *static_cast<Thread*>(argument);
  Block& b = *current_block;
  b.body->run(b.body->body);
  // Exited: no longer expected at barriers; a collective still waiting for it cannot finish.
  t.wait = Wait::kDone;
  --b.live;
  Warp& w = b.warps[t.warp];
  w.exited |= 1u << t.lane;
  if (w.arrived != 0 && (w.mask & (1u << t.lane)) != 0) {
    Report(absl::StrCat("synccheck: ", Who(t), " exited while lanes ", Lanes(w.arrived),
                        " of its warp wait for it in ", CollectiveName(w.op), " at ",
                        Where(w.site)));
  }
  if (b.arrived > 0 && b.arrived == b.live) CompleteBarrier(b);
}

bool Runnable(const Block& b, const Thread& t) {
  switch (t.wait) {
    case Wait::kRunnable:
      return true;
    case Wait::kBarrier:
      return b.generation != t.waited_generation;
    case Wait::kWarp:
      return b.warps[t.warp].generation != t.waited_generation;
    case Wait::kDone:
      return false;
  }
  return false;
}

std::string Deadlock(const Block& b) {
  std::string out =
      absl::StrCat("synccheck: block (", b.threads[0].block_idx.x, ",", b.threads[0].block_idx.y,
                   ",", b.threads[0].block_idx.z, ") cannot go on:");
  int shown = 0;
  for (const Thread& t : b.threads) {
    if (t.wait == Wait::kDone || shown >= 4) continue;
    ++shown;
    absl::StrAppend(&out, " thread ", t.linear, " waits in ",
                    t.wait == Wait::kBarrier ? "__syncthreads" : CollectiveName(b.warps[t.warp].op),
                    " at ", Where(t.wait_site), ";");
  }
  absl::StrAppend(&out, " ", b.live, " of ", b.threads.size(), " threads have not exited");
  return out;
}

void RunBlock(Block& b) {
  b.first_epoch = next_epoch;
  OpenInterval(b, Site::current(), false);
  b.live = static_cast<int>(b.threads.size());
  b.arrived = 0;
  b.count = 0;
  b.reported_exits = false;
  for (Warp& w : b.warps) w = Warp{};
  if (b.dynamic.data != nullptr) Poison(b.dynamic);
  for (auto& s : b.statics) Poison(*s);
  b.dynamic.reported_race = b.dynamic.reported_uninit = false;
  for (auto& s : b.statics) s->reported_race = s->reported_uninit = false;
  for (Thread& t : b.threads) {
    t.wait = Wait::kRunnable;
    t.copies.clear();
    t.open_group = 0;
    t.fiber->Reset(ThreadMain, &t);
  }
  int done = 0;
  const int total = static_cast<int>(b.threads.size());
  while (done < total) {
    bool progressed = false;
    for (Thread& t : b.threads) {
      if (!Runnable(b, t)) continue;
      current = &t;
      detail::current_thread = &t;
      t.fiber->Resume();
      current = nullptr;
      detail::current_thread = nullptr;
      progressed = true;
      if (t.fiber->finished()) ++done;
    }
    if (!progressed) {
      Report(Deadlock(b));
      return;  // Abandoned: the fibers are reset by the next block.
    }
  }
}

cudaError_t CheckConfiguration(dim3 grid, dim3 block) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  return cudaSuccess;
}

}  // namespace

// --- device.h -------------------------------------------------------------------------------

void SyncThreads(Site site) { SyncThreadsCount(0, site); }

int SyncThreadsCount(int predicate, Site site) {
  Thread& t = Current("__syncthreads");
  Block& b = *current_block;
  if (b.arrived == 0) {
    b.barrier_site = site;
  } else if (!SameSite(b.barrier_site, site)) {
    Report(absl::StrCat("synccheck: divergent __syncthreads: ", Who(t), " waits at ", Where(site),
                        " while ", b.arrived, " threads wait at ", Where(b.barrier_site)));
  }
  b.count += predicate != 0;
  if (++b.arrived == b.live) {
    CompleteBarrier(b);
    return b.count_result;
  }
  Park(t, Wait::kBarrier, b.generation, site);
  return b.count_result;
}

void SyncWarp(unsigned mask, Site site) {
  Arrive(
      Collective::kSyncWarp, mask, site, [](Warp&, int) {}, [](Warp& w) { ++w.syncs; });
}

uint64_t Shuffle(ShuffleKind kind, unsigned mask, uint64_t payload, int operand, int width,
                 Site site) {
  Thread& t = Current("a shuffle");
  if (width <= 0 || width > kWarpSize || (width & (width - 1)) != 0) {
    Report(absl::StrCat("synccheck: ", Who(t), " shuffles at ", Where(site), " with width ", width,
                        ": not a power of two in 1..32"));
    return payload;
  }
  const int lane = t.lane;
  Warp& w = current_block->warps[t.warp];
  const bool done = Arrive(
      Collective::kShuffle, mask, site,
      [&](Warp& warp, int l) {
        warp.kind = kind;
        warp.width = width;
        warp.payload[l] = payload;
        warp.operand[l] = operand;
      },
      [&](Warp& warp) {
        for (int l = 0; l < kWarpSize; ++l) {
          if ((warp.mask & (1u << l)) == 0) continue;
          const int base = l & ~(warp.width - 1);
          const int offset = l - base;
          const int op = warp.operand[l];
          int source = l;
          switch (warp.kind) {
            case ShuffleKind::kIndex:
              source = base + (op & (warp.width - 1));
              break;
            case ShuffleKind::kUp:
              source = offset >= op ? l - op : l;
              break;
            case ShuffleKind::kDown:
              source = offset + op < warp.width ? l + op : l;
              break;
            case ShuffleKind::kXor:
              source = l ^ op;
              // A later group of lanes is out of reach: the lane's own value.
              if (source >= base + warp.width || source >= kWarpSize) source = l;
              break;
          }
          if ((warp.mask & (1u << source)) == 0) {
            Report(absl::StrCat("synccheck: lane ", l, " of a shuffle at ", Where(warp.site),
                                " reads lane ", source, ", which the mask 0x", absl::Hex(warp.mask),
                                " leaves out (undefined)"));
          }
          warp.result[l] = warp.payload[source];
        }
      });
  return done ? w.result[lane] : payload;
}

unsigned Ballot(unsigned mask, int predicate, Site site) {
  Thread& t = Current("a vote");
  Warp& w = current_block->warps[t.warp];
  const int lane = t.lane;
  const bool done = Arrive(
      Collective::kBallot, mask, site, [&](Warp& warp, int l) { warp.payload[l] = predicate != 0; },
      [](Warp& warp) {
        uint64_t votes = 0;
        for (int l = 0; l < kWarpSize; ++l) {
          if ((warp.mask & (1u << l)) != 0 && warp.payload[l] != 0) votes |= 1u << l;
        }
        for (int l = 0; l < kWarpSize; ++l) warp.result[l] = votes;
      });
  return done ? static_cast<unsigned>(w.result[lane]) : 0u;
}

void MmaSync(MmaType type, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
             Site site) {
  Thread& t = Current("mma.sync");
  Warp& w = current_block->warps[t.warp];
  const int lane = t.lane;
  const bool done = Arrive(
      Collective::kMma, kFullMask, site,
      [&](Warp& warp, int l) {
        warp.mma_type = type;
        std::memcpy(warp.a[l], a, sizeof a);
        std::memcpy(warp.b[l], b, sizeof b);
        std::memcpy(warp.d[l], d, sizeof d);
      },
      [](Warp& warp) {
        mma::M16n8k16(warp.mma_type == MmaType::kF16 ? mma::Type::kF16 : mma::Type::kBF16, warp.a,
                      warp.b, warp.d, warp.d);
      });
  if (done) std::memcpy(d, w.d[lane], sizeof d);
}

void CopyAsync(void* shared, const void* global, int bytes, int source_bytes) {
  Thread& t = Current("cp.async");
  Block& b = *current_block;
  const auto address = reinterpret_cast<uintptr_t>(shared);
  if (BufferAt(b, address) == nullptr) {
    Report(absl::StrFormat("memcheck: %s issues a cp.async into %p, which is not shared memory",
                           Who(t), shared));
    return;
  }
  if ((bytes != 4 && bytes != 8 && bytes != 16) || source_bytes < 0 || source_bytes > bytes ||
      address % bytes != 0 || reinterpret_cast<uintptr_t>(global) % bytes != 0) {
    Report(absl::StrFormat(
        "memcheck: %s issues a cp.async of %d bytes (%d from global) from %p to %p: a size "
        "other than 4, 8 or 16, or an address not aligned to it (misaligned address)",
        Who(t), bytes, source_bytes, global, shared));
    return;
  }
  // From its issue on, the copy may land at any time: the bytes are the thread's to write.
  CheckAccess(b, t, address, static_cast<size_t>(bytes), /*write=*/true, /*lands=*/false,
              "issues a cp.async into", nullptr);
  t.copies.push_back(Copy{shared, global, bytes, source_bytes, t.open_group});
}

void CommitCopies() { ++Current("cp.async.commit_group").open_group; }

void WaitCopies(int pending) {
  Thread& t = Current("cp.async.wait_group");
  Block& b = *current_block;
  // Groups open_group − 1, open_group − 2, … are the most recent committed; all but `pending`
  // of them land now. The open group's copies are not waited for.
  const int64_t last_landing = t.open_group - 1 - pending;
  size_t kept = 0;
  for (size_t i = 0; i < t.copies.size(); ++i) {
    if (t.copies[i].group <= last_landing) {
      Land(b, t, t.copies[i]);
    } else {
      t.copies[kept++] = t.copies[i];
    }
  }
  t.copies.resize(kept);
}

void* DynamicShared() {
  Current("dynamic shared memory");
  return current_block->dynamic.data;
}

void* StaticShared(const void* tag, const char* name, size_t bytes, size_t alignment) {
  Current("static shared memory");
  Block& b = *current_block;
  for (auto& s : b.statics) {
    if (s->tag == tag) return s->data;
  }
  if (alignment > 16) {
    Report(absl::StrCat("launch: shared `", name, "` needs alignment ", alignment, " > 16"));
  }
  auto buffer = std::make_unique<SharedBuffer>();
  buffer->tag = tag;
  buffer->name = name;
  Allocate(*buffer, bytes);
  Poison(*buffer);
  TrackRange(b, *buffer);
  b.statics.push_back(std::move(buffer));
  return b.statics.back()->data;
}

cudaError_t SetFunctionAttribute(const void* kernel, cudaFuncAttribute attribute, int value) {
  if (StickyError() != cudaSuccess) return StickyError();
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > static_cast<size_t>(SharedMemoryOptin())) {
      RecordError(cudaErrorInvalidValue);
      return cudaErrorInvalidValue;
    }
    std::lock_guard lock(attributes_mutex);
    max_dynamic_shared[kernel] = value;
  }
  return cudaSuccess;
}

cudaError_t LaunchBody(const KernelBody& body, dim3 grid, dim3 block, size_t shared_bytes,
                       cudaStream_t stream) {
  (void)stream;  // Every launch runs to completion inside the call: streams are in order.
  if (cudaError_t sticky = StickyError(); sticky != cudaSuccess) return sticky;
  if (cudaError_t error = CheckConfiguration(grid, block); error != cudaSuccess) {
    RecordError(error);
    return error;
  }
  size_t shared_limit = kDefaultDynamicShared;
  {
    std::lock_guard lock(attributes_mutex);
    if (auto it = max_dynamic_shared.find(body.kernel); it != max_dynamic_shared.end()) {
      shared_limit = static_cast<size_t>(it->second);
    }
  }
  if (shared_bytes > shared_limit) {
    RecordError(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }

  std::lock_guard lock(device_mutex);
  {
    std::lock_guard reports_lock(reports_mutex);
    printed_this_launch = 0;
  }
  const int threads = static_cast<int>(block.x * block.y * block.z);
  while (static_cast<int>(fiber_pool.size()) < threads) {
    fiber_pool.push_back(std::make_unique<Fiber>(kStackBytes));
  }
  Block b;
  b.body = &body;
  if (SharedAccessesChecked()) {
    b.accessible = DeviceAccessibleRanges();
    const auto arguments = reinterpret_cast<uintptr_t>(body.body);
    b.accessible.push_back({arguments, arguments + body.body_bytes});
    std::sort(b.accessible.begin(), b.accessible.end());
  }
  b.threads.resize(static_cast<size_t>(threads));
  b.warps.resize(static_cast<size_t>((threads + kWarpSize - 1) / kWarpSize));
  b.dynamic.name = "dynamic shared memory";
  if (shared_bytes > 0) {
    Allocate(b.dynamic, shared_bytes);
    TrackRange(b, b.dynamic);
  }
  current_block = &b;
  for (unsigned z = 0; z < grid.z && !b.failed; ++z) {
    for (unsigned y = 0; y < grid.y && !b.failed; ++y) {
      for (unsigned x = 0; x < grid.x && !b.failed; ++x) {
        int linear = 0;
        for (unsigned tz = 0; tz < block.z; ++tz) {
          for (unsigned ty = 0; ty < block.y; ++ty) {
            for (unsigned tx = 0; tx < block.x; ++tx, ++linear) {
              Thread& t = b.threads[static_cast<size_t>(linear)];
              t.thread_idx = uint3{tx, ty, tz};
              t.block_idx = uint3{x, y, z};
              t.block_dim = block;
              t.grid_dim = grid;
              t.linear = linear;
              t.warp = linear / kWarpSize;
              t.lane = linear % kWarpSize;
              t.fiber = fiber_pool[static_cast<size_t>(linear)].get();
            }
          }
        }
        RunBlock(b);
      }
    }
  }
  current_block = nullptr;
  Free(b.dynamic);
  for (auto& s : b.statics) Free(*s);
  // A kernel the checks caught fails as a faulting kernel does: sticky, at the next call.
  if (b.failed) RecordError(cudaErrorLaunchFailure);
  return cudaSuccess;
}

std::vector<std::string> TakeReports() {
  std::lock_guard lock(reports_mutex);
  std::vector<std::string> out;
  out.swap(reports);
  return out;
}

bool SharedAccessesChecked() {
#if defined(ATTN_SIMT_RACECHECK)
  return true;
#else
  return false;
#endif
}

void CheckAccessHook(const void* address, size_t bytes, bool write, const void* pc) {
  Block* b = current_block;
  if (b == nullptr || current == nullptr) return;
  const auto a = reinterpret_cast<uintptr_t>(address);
  if (a < b->shared_hi && a + bytes > b->shared_lo) {
    CheckAccess(*b, *current, a, bytes, write, /*lands=*/write, write ? "writes" : "reads", pc);
    return;
  }
  // Global memory: the thread's stack (local memory), the emulator's view of the thread
  // (threadIdx and the rest), or device-accessible memory; anything else is host memory.
  if (a >= b->last_hit.first && a + bytes <= b->last_hit.second) return;
  if (current->fiber->OnStack(address)) return;
  if (address == &detail::current_thread) return;
  const auto threads = reinterpret_cast<uintptr_t>(b->threads.data());
  if (a >= threads && a + bytes <= threads + b->threads.size() * sizeof(Thread)) return;
  auto it = std::upper_bound(b->accessible.begin(), b->accessible.end(),
                             std::pair<uintptr_t, uintptr_t>{a, UINTPTR_MAX});
  if (it != b->accessible.begin() && a + bytes <= std::prev(it)->second) {
    b->last_hit = *std::prev(it);
    return;
  }
  if (!b->reported_host_access) {
    b->reported_host_access = true;
    Report(absl::StrFormat(
        "memcheck: %s %s %zu bytes at %p, which is neither device memory nor the kernel's "
        "own (a host pointer handed to a kernel, or past the end of an allocation) (pc %p)",
        Who(*current), write ? "writes" : "reads", bytes, address, pc));
  }
}

}  // namespace simt
