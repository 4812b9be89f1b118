#include "client/cli/merge_trace.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/render.h"
#include "client/merge.h"
#include "kernels/online_softmax.h"

namespace attn::cli {
namespace {

namespace v1 = attention::v1;

// A float for people: −∞ spelled out, else %g.
std::string Num(double x) {
  if (x == -INFINITY) return "−∞";
  return absl::StrFormat("%g", x);
}

std::string RowName(const v1::RowRef& row) {
  return absl::StrCat("batch ", row.batch(), ", head ", row.head(), ", query ", row.row());
}

// "1 tile", "3 tiles".
std::string Count(int64_t n, const char* noun) {
  return absl::StrCat(n, " ", noun, n == 1 ? "" : "s");
}

std::string Keys(int64_t begin, int64_t end) { return absl::StrCat("[", begin, ", ", end, ")"); }

using RowKey = std::tuple<int64_t, int64_t, int64_t>;
RowKey KeyOf(const v1::RowRef& row) { return {row.batch(), row.head(), row.row()}; }

// A request's tensors decoded and normalized to rank 4: query [B, H, Nq, D], key [B, K, Nk, D],
// value [B, K, Nk, Dv].
struct Whole {
  int64_t batch, heads, kv_heads, query_len, key_len, head_dim, value_dim;
  client::Array query, key, value;
};

absl::StatusOr<Whole> Decode(const v1::AttentionRequest& request) {
  if (!request.cache_id().empty()) {
    return absl::InvalidArgumentError(
        "a trace over a cache cannot be split by keys here: its keys live on one server");
  }
  Whole whole;
  for (const auto& [name, tensor, array] : {std::tuple{"query", &request.query(), &whole.query},
                                            std::tuple{"key", &request.key(), &whole.key},
                                            std::tuple{"value", &request.value(), &whole.value}}) {
    absl::StatusOr<client::Array> decoded = client::FromTensor(*tensor);
    if (!decoded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", decoded.status().message()));
    }
    if (decoded->shape.size() < 2 || decoded->shape.size() > 4) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has rank ", decoded->shape.size(), "; expected 2, 3 or 4"));
    }
    *array = *std::move(decoded);
  }
  const auto dim = [](const client::Array& a, int from_end) -> int64_t {
    const int rank = static_cast<int>(a.shape.size());
    return from_end <= rank ? a.shape[rank - from_end] : 1;
  };
  whole.batch = dim(whole.query, 4);
  whole.heads = dim(whole.query, 3);
  whole.query_len = dim(whole.query, 2);
  whole.head_dim = dim(whole.query, 1);
  whole.kv_heads = dim(whole.key, 3);
  whole.key_len = dim(whole.key, 2);
  whole.value_dim = dim(whole.value, 1);
  if (whole.query.shape.size() != whole.key.shape.size() ||
      whole.key.shape.size() != whole.value.shape.size() || dim(whole.key, 4) != whole.batch ||
      dim(whole.value, 4) != whole.batch || dim(whole.value, 3) != whole.kv_heads ||
      dim(whole.value, 2) != whole.key_len || dim(whole.key, 1) != whole.head_dim ||
      whole.kv_heads < 1 || whole.heads % whole.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("query [", absl::StrJoin(whole.query.shape, ", "), "], key [",
                     absl::StrJoin(whole.key.shape, ", "), "] and value [",
                     absl::StrJoin(whole.value.shape, ", "), "] do not agree"));
  }
  return whole;
}

// The float64 answer for one row over every key it sees, from the positions and the window as
// attention.proto states them: key j at key_position + j, query row i at query_position + i, a
// query at p seeing a key at t iff t ≤ p when causal and p − window_left ≤ t ≤ p + window_right
// for the sides set; query head h reads kv head h / (heads / kv_heads); the head's sink (when
// the request has sinks) one more term e^sink of the sum with no value.
void Reference(const Whole& w, const MergeTrace& t, const v1::RowRef& row,
               std::vector<double>* output, double* lse) {
  const int64_t b = row.batch(), h = row.head(), i = row.row();
  const int64_t kv = h / (w.heads / w.kv_heads);
  const float* q = w.query.values.data() + ((b * w.heads + h) * w.query_len + i) * w.head_dim;
  const float* k = w.key.values.data() + (b * w.kv_heads + kv) * w.key_len * w.head_dim;
  const float* v = w.value.values.data() + (b * w.kv_heads + kv) * w.key_len * w.value_dim;
  std::vector<std::pair<int64_t, double>> scores;  // (key, score) of the keys the row sees.
  double max = -INFINITY;
  const int64_t p = t.query_position + i;
  for (int64_t j = 0; j < w.key_len; ++j) {
    const int64_t position = t.key_position + j;
    if ((t.causal && position > p) || (t.window_left && position < p - *t.window_left) ||
        (t.window_right && position > p + *t.window_right)) {
      continue;
    }
    double dot = 0;
    for (int64_t c = 0; c < w.head_dim; ++c) dot += double(q[c]) * double(k[j * w.head_dim + c]);
    scores.emplace_back(j, t.scale * dot);
    max = std::max(max, scores.back().second);
  }
  output->assign(w.value_dim, 0.0);
  double sum = 0;
  if (!t.sinks.empty()) {
    const double sink = t.sinks[h];
    max = std::max(max, sink);
    sum = std::exp(sink - max);
  }
  for (const auto& [j, score] : scores) {
    const double weight = std::exp(score - max);
    sum += weight;
    for (int64_t c = 0; c < w.value_dim; ++c)
      (*output)[c] += weight * double(v[j * w.value_dim + c]);
  }
  for (double& x : *output) x = sum > 0 ? x / sum : 0.0;
  *lse = sum > 0 ? max + std::log(sum) : -INFINITY;
}

template <class A, class B>
double MaxAbsDiff(const A& a, const B& b) {
  double diff = 0;
  for (size_t c = 0; c < a.size() && c < b.size(); ++c) {
    const double d = std::abs(double(a[c]) - double(b[c]));
    if (std::isnan(d)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, d);
  }
  return a.size() == b.size() ? diff : std::numeric_limits<double>::infinity();
}

// One part's trace, read: its TraceStart, each row's steps and RowDone.
struct PartTrace {
  v1::TraceStart start;
  std::map<RowKey, std::vector<const v1::TileStep*>> steps;
  std::map<RowKey, const v1::RowDone*> done;
};

absl::StatusOr<PartTrace> ReadPart(const std::vector<v1::TraceEvent>& events,
                                   const std::string& name, int64_t value_dim) {
  PartTrace part;
  bool started = false, ended = false;
  for (const v1::TraceEvent& event : events) {
    switch (event.event_case()) {
      case v1::TraceEvent::kStart:
        part.start = event.start();
        started = true;
        break;
      case v1::TraceEvent::kStep:
        if (event.step().accumulator_size() != value_dim) {
          return absl::InternalError(absl::StrCat(name, ": a step has ",
                                                  event.step().accumulator_size(),
                                                  " accumulator values, value_dim is ", value_dim));
        }
        part.steps[KeyOf(event.step().row())].push_back(&event.step());
        break;
      case v1::TraceEvent::kRowDone:
        if (event.row_done().output_size() != value_dim) {
          return absl::InternalError(absl::StrCat(name, ": a RowDone has ",
                                                  event.row_done().output_size(),
                                                  " output values, value_dim is ", value_dim));
        }
        part.done[KeyOf(event.row_done().row())] = &event.row_done();
        break;
      case v1::TraceEvent::kEnd:
        ended = true;
        break;
      case v1::TraceEvent::EVENT_NOT_SET:
        break;
    }
  }
  if (!started || !ended) {
    return absl::InternalError(
        absl::StrCat(name, ": the trace stream has no ", started ? "TraceEnd" : "TraceStart"));
  }
  return part;
}

std::string PartName(size_t i, size_t parts, const client::ShardPart& part,
                     const std::string& endpoint) {
  return absl::StrCat("part ", i + 1, " of ", parts, " (keys ", Keys(part.key_begin, part.key_end),
                      ") at ", endpoint);
}

// JSON pieces. Floats: 9 significant digits round-trip a float32, 17 a float64; non-finite ones
// as protobuf's JSON mapping spells them.
std::string JsonNumber(double x, int digits) {
  if (std::isnan(x)) return "\"NaN\"";
  if (std::isinf(x)) return x > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  return absl::StrFormat("%.*g", digits, x);
}
std::string JsonFloat(float x) { return JsonNumber(x, 9); }
std::string JsonDouble(double x) { return JsonNumber(x, 17); }
template <class Values>
std::string JsonArray(const Values& values, int digits) {
  std::vector<std::string> items;
  for (const auto x : values) items.push_back(JsonNumber(static_cast<double>(x), digits));
  return absl::StrCat("[", absl::StrJoin(items, ","), "]");
}
std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}
std::string JsonRow(const v1::RowRef& row) {
  return absl::StrCat("{\"batch\":", row.batch(), ",\"head\":", row.head(), ",\"row\":", row.row(),
                      "}");
}
std::string JsonBool(bool b) { return b ? "true" : "false"; }

}  // namespace

absl::StatusOr<MergeTrace> MergeTraces(const v1::TraceRequest& request,
                                       const std::vector<client::ShardPart>& parts,
                                       const std::vector<std::string>& endpoints,
                                       const std::vector<std::vector<v1::TraceEvent>>& events) {
  if (parts.empty() || events.size() != parts.size() || endpoints.size() < parts.size()) {
    return absl::InvalidArgumentError(absl::StrCat("merge trace: ", parts.size(), " parts, ",
                                                   events.size(), " traces and ", endpoints.size(),
                                                   " endpoints"));
  }
  const v1::AttentionRequest& attention = request.attention();
  absl::StatusOr<Whole> whole = Decode(attention);
  if (!whole.ok()) return whole.status();
  const v1::AttentionOptions& options = attention.options();

  MergeTrace trace;
  trace.batch = whole->batch;
  trace.heads = whole->heads;
  trace.kv_heads = whole->kv_heads;
  trace.query_len = whole->query_len;
  trace.key_len = whole->key_len;
  trace.head_dim = whole->head_dim;
  trace.value_dim = whole->value_dim;
  trace.causal = options.causal();
  trace.key_position = options.key_position();
  trace.query_position = options.has_query_position()
                             ? options.query_position()
                             : options.key_position() + whole->key_len - whole->query_len;
  if (options.has_window_left()) trace.window_left = options.window_left();
  if (options.has_window_right()) trace.window_right = options.window_right();
  trace.sinks.assign(options.sinks().begin(), options.sinks().end());
  if (!trace.sinks.empty() && static_cast<int64_t>(trace.sinks.size()) != whole->heads) {
    return absl::InvalidArgumentError(absl::StrCat("options.sinks has ", trace.sinks.size(),
                                                   " values but the query has ", whole->heads,
                                                   " heads; give one sink per query head"));
  }
  trace.block_k = options.block_k();
  trace.endpoints = endpoints;
  trace.single_server = parts.size() == 1;
  trace.keys_first = parts.front().key_slice ? parts.front().key_begin : 0;
  trace.keys_sent = parts.back().key_slice ? parts.back().key_end : whole->key_len;
  // The scale the servers applied (the request's, or 1/sqrt(head_dim) rounded to fp32 as theirs).
  trace.scale = options.has_scale()
                    ? options.scale()
                    : static_cast<float>(1.0 / std::sqrt(static_cast<double>(whole->head_dim)));

  std::vector<PartTrace> traces;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string name = PartName(i, parts.size(), parts[i], endpoints[i]);
    absl::StatusOr<PartTrace> part = ReadPart(events[i], name, whole->value_dim);
    if (!part.ok()) return part.status();
    TracedPart& traced = trace.parts.emplace_back();
    traced.endpoint = endpoints[i];
    traced.key_slice = parts[i].key_slice;
    traced.key_begin = parts[i].key_slice ? parts[i].key_begin : 0;
    traced.key_end = parts[i].key_slice ? parts[i].key_end : whole->key_len;
    traced.key_position = part->start.key_position();
    traced.query_position = part->start.query_position();
    traced.block_k = part->start.block_k();
    traced.tiles_per_row = part->start.tiles_per_row();
    traces.push_back(*std::move(part));
  }

  std::vector<v1::RowRef> rows(request.rows().begin(), request.rows().end());
  if (rows.empty()) rows.emplace_back();  // The server's default: row 0 of batch 0, head 0.
  const int64_t width = whole->value_dim;
  for (const v1::RowRef& ref : rows) {
    RowMerge& row = trace.rows.emplace_back();
    row.row = ref;
    if (ref.batch() < 0 || ref.batch() >= whole->batch || ref.head() < 0 ||
        ref.head() >= whole->heads || ref.row() < 0 || ref.row() >= whole->query_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("row (", RowName(ref), ") is not in the problem"));
    }
    Reference(*whole, trace, ref, &row.reference, &row.reference_lse);

    // Each part's final state of this row.
    std::vector<client::AttentionState> finished;
    for (size_t i = 0; i < traces.size(); ++i) {
      const PartTrace& part = traces[i];
      const auto done = part.done.find(KeyOf(ref));
      if (done == part.done.end()) {
        return absl::InternalError(absl::StrCat(PartName(i, parts.size(), parts[i], endpoints[i]),
                                                ": the trace has no RowDone for row (",
                                                RowName(ref), ")"));
      }
      PartState& state = row.parts.emplace_back();
      const auto steps = part.steps.find(KeyOf(ref));
      if (steps == part.steps.end() || steps->second.empty()) {
        state.max = -INFINITY;  // The row sees no key of this slice: the empty state.
        state.denominator = 0.f;
        state.accumulator.assign(width, 0.f);
      } else {
        const v1::TileStep& last = *steps->second.back();
        state.steps = static_cast<int64_t>(steps->second.size());
        state.max = last.max_after();
        state.denominator = last.denominator();
        state.accumulator.assign(last.accumulator().begin(), last.accumulator().end());
      }
      OnlineSoftmaxRow own{.max = state.max, .denominator = state.denominator};
      for (float a : state.accumulator) state.estimate.push_back(own.Normalize(a));
      state.lse = done->second->lse();
      state.output.assign(done->second->output().begin(), done->second->output().end());
      state.max_abs_error = done->second->max_abs_error();
      client::AttentionState& as_done = finished.emplace_back();
      as_done.output = {.shape = {1, width}, .values = state.output};
      as_done.lse = {.shape = {1}, .values = {state.lse}};
    }

    // The merge, one server at a time, into a running state that starts empty.
    OnlineSoftmaxRow running;  // max −inf, denominator 0.
    std::vector<float> accumulator(width, 0.f);
    for (size_t i = 0; i < row.parts.size(); ++i) {
      const PartState& part = row.parts[i];
      MergeStep& step = row.steps.emplace_back();
      step.part = static_cast<int>(i);
      step.max_before = running.max;
      step.denominator_before = running.denominator;
      step.part_max = part.max;
      step.part_denominator = part.denominator;
      const OnlineSoftmaxRow incoming{.max = part.max, .denominator = part.denominator};
      const MergeFactors factors =
          running.MergeInto(incoming, part.accumulator.data(), accumulator.data(), width);
      step.running_rescale = factors.mine;
      step.part_rescale = factors.theirs;
      step.max_after = running.max;
      step.denominator = running.denominator;
      step.accumulator = accumulator;
      for (float a : accumulator) step.estimate.push_back(running.Normalize(a));
      step.max_abs_error = MaxAbsDiff(step.estimate, row.reference);
    }
    row.output = row.steps.back().estimate;
    if (!trace.sinks.empty()) {  // The row's sink, once, as a server finishes a row.
      const float sink = trace.sinks[ref.head()];
      const float factor = running.AddSink(sink);
      for (int64_t c = 0; c < width; ++c)
        row.output[c] = running.Normalize(accumulator[c] * factor);
      row.sink_share = OnlineSoftmaxRow::SinkShare(sink, running.LogSumExp());
    }
    row.lse = running.LogSumExp();
    row.max_abs_error = MaxAbsDiff(row.output, row.reference);
    double scale = 0;
    for (double x : row.reference) scale = std::max(scale, std::abs(x));
    row.relative_error = scale > 0 ? row.max_abs_error / scale : row.max_abs_error;

    absl::StatusOr<client::AttentionState> merged_done = client::MergeStates(finished);
    if (!merged_done.ok()) return merged_done.status();
    row.row_done_output = merged_done->output.values;
    row.row_done_max_abs_diff = MaxAbsDiff(row.output, row.row_done_output);
  }
  return trace;
}

absl::StatusOr<MergeTrace> TraceAndMerge(const std::vector<std::string>& endpoints,
                                         const client::ClientOptions& options,
                                         const v1::TraceRequest& request) {
  if (endpoints.empty()) return absl::InvalidArgumentError("trace --shard-keys: no endpoints");
  if (!request.attention().cache_id().empty()) {
    return absl::InvalidArgumentError(
        "trace --shard-keys: a trace over a cache cannot be split by keys (its keys live on one "
        "server)");
  }
  const std::vector<client::ShardPart> parts =
      client::SplitKeys(request.attention(), static_cast<int>(endpoints.size()));
  std::vector<std::vector<v1::TraceEvent>> events(parts.size());
  std::vector<absl::Status> statuses(parts.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < parts.size(); ++i) {
      threads.emplace_back([&, i] {
        client::Client client(endpoints[i], options);
        v1::TraceRequest part;
        *part.mutable_attention() = parts[i].request;
        *part.mutable_rows() = request.rows();
        statuses[i] = client.Trace(part, [&](const v1::TraceEvent& event) {
          events[i].push_back(event);
          return true;
        });
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    if (statuses[i].ok()) continue;
    return absl::Status(statuses[i].code(),
                        absl::StrCat(PartName(i, parts.size(), parts[i], endpoints[i]), ": ",
                                     statuses[i].message()));
  }
  return MergeTraces(request, parts, endpoints, events);
}

void PrintMergeTrace(const MergeTrace& t, std::FILE* out) {
  absl::FPrintF(out,
                "Merge trace of [batch %d, heads %d (kv %d), %d queries × %d keys], head_dim %d, "
                "value_dim %d, scale %g%s\n",
                t.batch, t.heads, t.kv_heads, t.query_len, t.key_len, t.head_dim, t.value_dim,
                t.scale, t.causal ? ", causal" : "");
  absl::FPrintF(out, "Positions: key j at %d + j, query row i at %d + i.\n", t.key_position,
                t.query_position);
  if (t.single_server) {
    absl::FPrintF(out,
                  "One server traced all of it: %s holds keys %s, so there is nothing to merge — "
                  "its final state is the answer%s.\n",
                  t.parts[0].endpoint, Keys(t.parts[0].key_begin, t.parts[0].key_end),
                  t.endpoints.size() == 1 ? " (one endpoint given)"
                                          : " (the keys could not be split further)");
  } else {
    absl::FPrintF(out,
                  "The keys split into %d slices, one per server, each traced with its "
                  "positions so its causal mask is its share of the whole:\n",
                  t.parts.size());
  }
  for (size_t i = 0; i < t.parts.size(); ++i) {
    const TracedPart& p = t.parts[i];
    absl::FPrintF(out,
                  "  part %d  keys %-12s %s   key_position %d, query_position %d, %s of "
                  "block_k %d\n",
                  i + 1, Keys(p.key_begin, p.key_end), p.endpoint, p.key_position, p.query_position,
                  Count(p.tiles_per_row, "tile"), p.block_k);
  }
  for (const auto& [begin, end] :
       {std::pair{int64_t{0}, t.keys_first}, std::pair{t.keys_sent, t.key_len}}) {
    if (begin >= end) continue;
    absl::FPrintF(out, "  keys %s: no query row sees them, so no server was sent them.\n",
                  Keys(begin, end));
  }

  for (const RowMerge& row : t.rows) {
    absl::FPrintF(out, "\nRow (%s): each server's final state over its keys\n", RowName(row.row));
    for (size_t i = 0; i < row.parts.size(); ++i) {
      const PartState& s = row.parts[i];
      const TracedPart& p = t.parts[i];
      absl::FPrintF(out, "  part %d, keys %s at %s: %s\n", i + 1, Keys(p.key_begin, p.key_end),
                    p.endpoint, Count(s.steps, "step"));
      if (s.steps == 0) {
        absl::FPrintF(out,
                      "    (the causal mask hides every key of this slice from this row: max −∞, "
                      "denominator 0)\n");
        continue;
      }
      absl::FPrintF(out, "    max          %g\n", s.max);
      absl::FPrintF(out, "    denominator  %.6f\n", s.denominator);
      absl::FPrintF(out, "    accumulator  %s\n", Vector(s.accumulator));
      absl::FPrintF(out, "    lse          %g\n", s.lse);
      absl::FPrintF(out, "    estimate     %s   (its keys alone)\n", Vector(s.estimate));
    }

    if (t.single_server) {
      absl::FPrintF(out, "\n  One server: no merge step; its estimate is the output.\n");
    } else {
      absl::FPrintF(out,
                    "\n  Merge, one server at a time (the running state starts empty: max −∞, "
                    "denominator 0):\n");
      for (const MergeStep& step : row.steps) {
        const TracedPart& p = t.parts[step.part];
        absl::FPrintF(out, "  step %d: + part %d (keys %s, %s)\n", step.part + 1, step.part + 1,
                      Keys(p.key_begin, p.key_end), p.endpoint);
        absl::FPrintF(out, "    max          %s → %s   (the part's %s)\n", Num(step.max_before),
                      Num(step.max_after), Num(step.part_max));
        absl::FPrintF(out, "    rescale      running exp(%s − %s) = %g, part exp(%s − %s) = %g\n",
                      Num(step.max_before), Num(step.max_after), step.running_rescale,
                      Num(step.part_max), Num(step.max_after), step.part_rescale);
        absl::FPrintF(out, "    denominator  %.6f × %g + %.6f × %g = %.6f\n",
                      step.denominator_before, step.running_rescale, step.part_denominator,
                      step.part_rescale, step.denominator);
        absl::FPrintF(out, "    accumulator  %s\n", Vector(step.accumulator));
        absl::FPrintF(out, "    estimate     %s   max |estimate − full| = %.3g\n",
                      Vector(step.estimate), step.max_abs_error);
      }
    }
    if (!t.sinks.empty()) {
      absl::FPrintF(out, "\n  sink           %g, added after the merge: it takes %.6f of the row\n",
                    t.sinks[row.row.head()], row.sink_share);
    }
    absl::FPrintF(out, "\n  merged output  %s\n", Vector(row.output));
    absl::FPrintF(out, "  full matrix    %s   (float64, here, over all %d keys)\n",
                  Vector(row.reference), t.key_len);
    absl::FPrintF(out, "  max |merged − full| = %.3g (relative %.3g), lse = %g (full %g)\n",
                  row.max_abs_error, row.relative_error, row.lse, row.reference_lse);
    absl::FPrintF(out, "  max |merged − the parts' RowDone (output, lse) merged| = %.3g\n",
                  row.row_done_max_abs_diff);
  }
}

void PrintMergeTraceJson(const MergeTrace& t, std::FILE* out) {
  std::vector<std::string> endpoints;
  for (const std::string& endpoint : t.endpoints) endpoints.push_back(JsonString(endpoint));
  absl::FPrintF(
      out,
      "{\"problem\":{\"batch\":%d,\"heads\":%d,\"kvHeads\":%d,\"queryLen\":%d,\"keyLen\":%d,"
      "\"headDim\":%d,\"valueDim\":%d,\"scale\":%s,\"causal\":%s,\"keyPosition\":%d,"
      "\"queryPosition\":%d,\"blockK\":%d,\"endpoints\":[%s],\"parts\":%d,\"singleServer\":%s,"
      "\"keysFirst\":%d,\"keysSent\":%d%s}}\n",
      t.batch, t.heads, t.kv_heads, t.query_len, t.key_len, t.head_dim, t.value_dim,
      JsonFloat(t.scale), JsonBool(t.causal), t.key_position, t.query_position, t.block_k,
      absl::StrJoin(endpoints, ","), t.parts.size(), JsonBool(t.single_server), t.keys_first,
      t.keys_sent,
      absl::StrCat(t.window_left ? absl::StrCat(",\"windowLeft\":", *t.window_left) : "",
                   t.window_right ? absl::StrCat(",\"windowRight\":", *t.window_right) : ""));
  for (const RowMerge& row : t.rows) {
    const std::string row_json = JsonRow(row.row);
    for (size_t i = 0; i < row.parts.size(); ++i) {
      const PartState& s = row.parts[i];
      const TracedPart& p = t.parts[i];
      absl::FPrintF(
          out,
          "{\"part\":{\"row\":%s,\"index\":%d,\"parts\":%d,\"endpoint\":%s,\"keyBegin\":%d,"
          "\"keyEnd\":%d,\"keyPosition\":%d,\"queryPosition\":%d,\"blockK\":%d,\"steps\":%d,"
          "\"max\":%s,\"denominator\":%s,\"accumulator\":%s,\"lse\":%s,\"estimate\":%s,"
          "\"output\":%s,\"maxAbsError\":%s}}\n",
          row_json, i, t.parts.size(), JsonString(p.endpoint), p.key_begin, p.key_end,
          p.key_position, p.query_position, p.block_k, s.steps, JsonFloat(s.max),
          JsonFloat(s.denominator), JsonArray(s.accumulator, 9), JsonFloat(s.lse),
          JsonArray(s.estimate, 9), JsonArray(s.output, 9), JsonFloat(s.max_abs_error));
    }
    for (size_t i = 0; i < row.steps.size(); ++i) {
      const MergeStep& s = row.steps[i];
      const TracedPart& p = t.parts[s.part];
      absl::FPrintF(
          out,
          "{\"merge_step\":{\"row\":%s,\"index\":%d,\"part\":%d,\"endpoint\":%s,\"keyBegin\":%d,"
          "\"keyEnd\":%d,\"maxBefore\":%s,\"partMax\":%s,\"maxAfter\":%s,\"runningRescale\":%s,"
          "\"partRescale\":%s,\"partDenominator\":%s,\"denominatorBefore\":%s,"
          "\"denominator\":%s,\"accumulator\":%s,\"estimate\":%s,\"maxAbsError\":%s}}\n",
          row_json, i, s.part, JsonString(p.endpoint), p.key_begin, p.key_end,
          JsonFloat(s.max_before), JsonFloat(s.part_max), JsonFloat(s.max_after),
          JsonFloat(s.running_rescale), JsonFloat(s.part_rescale), JsonFloat(s.part_denominator),
          JsonFloat(s.denominator_before), JsonFloat(s.denominator), JsonArray(s.accumulator, 9),
          JsonArray(s.estimate, 9), JsonDouble(s.max_abs_error));
    }
    absl::FPrintF(out,
                  "{\"merged\":{\"row\":%s,\"parts\":%d,\"singleServer\":%s,\"output\":%s,"
                  "\"lse\":%s,\"reference\":%s,\"referenceLse\":%s,\"maxAbsError\":%s,"
                  "\"relativeError\":%s,\"rowDoneOutput\":%s,\"rowDoneMaxAbsDiff\":%s,"
                  "\"sinkShare\":%s}}\n",
                  row_json, t.parts.size(), JsonBool(t.single_server), JsonArray(row.output, 9),
                  JsonFloat(row.lse), JsonArray(row.reference, 17), JsonDouble(row.reference_lse),
                  JsonDouble(row.max_abs_error), JsonDouble(row.relative_error),
                  JsonArray(row.row_done_output, 9), JsonDouble(row.row_done_max_abs_diff),
                  JsonFloat(row.sink_share));
  }
}

absl::Status RunShardedTrace(const std::vector<std::string>& endpoints,
                             const client::ClientOptions& options, const v1::TraceRequest& request,
                             bool json, std::FILE* out) {
  absl::StatusOr<MergeTrace> trace = TraceAndMerge(endpoints, options, request);
  if (!trace.ok()) return trace.status();
  if (json) {
    PrintMergeTraceJson(*trace, out);
  } else {
    PrintMergeTrace(*trace, out);
  }
  std::fflush(out);
  return absl::OkStatus();
}

}  // namespace attn::cli
