// The merge of key slices ("Idea 3 × servers"): the one merge rule (OnlineSoftmaxRow::Merge of
// kernels/online_softmax.h) in float32, the steps of merging a row's parts one at a time, an
// attention sink joining the merged row once (addSink, OnlineSoftmax::AddSink), the merge of
// finished (output, lse) states (mergeStates, client::MergeStates), the float64 reference row it
// is all checked against, and the two ways a merge model is made: from the JSON lines of
// `attn trace --shard-keys --json` (modelFromLines) or from this page's own traces of slices of
// its keys (keySlices, then modelFromSlices).
// A model is {source: 'file' | 'server', label, problem, rows}: rows maps rowKey → {row, parts
// (each part's final state over its slice), steps (mergeSteps), sinkJoin (addSink after the last
// step, or null without sinks), merged, recomputed}.
// Sinks: the parts' states are their last tile steps', over their keys alone (a step never
// includes the sink), so the merged keys' state takes the row's sink once, after the last part,
// as `attn trace --shard-keys` does; the parts' RowDone (output, lse) — the first slice's lse
// includes the sink, the others' carry none — merge to the same answer (merged.rowDoneMaxAbsDiff).
// Exports (AttnViewer.merge): mergeSteps, addSink, mergeStates, normalize, maxAbsDiff,
// referenceRow, modelFromLines, keySlices, modelFromSlices, mergeHidden.
'use strict';

(() => {
  const {num, nums, rowKey, fmt} = AttnViewer.format;
  const {sequenceOf, oneSequence, hiddenByGeometry, hiddenKeys, keyDistance} = AttnViewer.geometry;

  const MAX_MERGE_PARTS = 8;  // the page's own split; a file may hold more

  // OnlineSoftmaxRow::Merge (kernels/online_softmax.h), the one merge rule, in float32 as the
  // servers and attn compute it: m_new = max(m_running, m_part); each side rescaled by
  // exp(m − m_new), 0 for a side that saw no key (max −∞); the denominators and accumulators added.
  const f32 = Math.fround;
  function mergeInto(running, part) {
    const maxAfter = running.max > part.max ? running.max : part.max;
    const runningRescale = running.max === -Infinity ? 0 : f32(Math.exp(running.max - maxAfter));
    const partRescale = part.max === -Infinity ? 0 : f32(Math.exp(part.max - maxAfter));
    const denominator = f32(f32(running.denominator * runningRescale) +
                            f32(part.denominator * partRescale));
    const accumulator = running.accumulator.map(
        (a, c) => f32(f32(a * runningRescale) + f32(part.accumulator[c] * partRescale)));
    return {max: maxAfter, denominator, accumulator, runningRescale, partRescale};
  }
  // OnlineSoftmaxRow::Normalize: accumulator / denominator, 0 when the denominator is 0.
  const normalize = (accumulator, denominator) =>
    accumulator.map((a) => (denominator > 0 ? f32(a / denominator) : 0));
  function maxAbsDiff(a, b) {
    if (!a || !b || a.length !== b.length) return NaN;
    let d = 0;
    for (let i = 0; i < a.length; ++i) d = Math.max(d, Math.abs(a[i] - b[i]));
    return d;
  }

  // OnlineSoftmax::AddSink: the row's sink joins a merged state once — the merge with the state of
  // one key of score `sink` and a zero value row: max → max(max, sink), the running side rescaled
  // by factor = exp(max − max_new) (0 for a state that saw no key), the sink's term exp(sink −
  // max_new) added to the denominator. The output is then accumulator · factor ÷ denominator (0
  // for a row that saw no key), lse = max + log(denominator) includes the sink, and the sink's
  // share of the row is exp(sink − lse) (OnlineSoftmax::SinkShare).
  function addSink(state, sink) {
    const none = new Array(state.accumulator.length).fill(0);  // the sink's value row
    const joined = mergeInto(state, {max: sink, denominator: 1, accumulator: none});
    const lse = joined.denominator > 0 ? f32(joined.max + f32(Math.log(joined.denominator)))
                                       : -Infinity;
    return {
      sink, maxBefore: state.max, maxAfter: joined.max, factor: joined.runningRescale,
      sinkTerm: joined.partRescale, denominatorBefore: state.denominator,
      denominator: joined.denominator, accumulator: joined.accumulator,
      output: normalize(joined.accumulator, joined.denominator), lse,
      sinkShare: f32(Math.exp(sink - lse)),
    };
  }

  // client::MergeStates for one row: finished (output, lse) states, in float64 — O = Σ
  // exp(lseᵢ − lse)·Oᵢ with lse = log Σ exp(lseᵢ); a part with lse −∞ adds nothing. Returns
  // {output, lse}.
  function mergeStates(states) {
    const width = states.length ? states[0].output.length : 0;
    const m = Math.max(-Infinity, ...states.map((st) => st.lse));
    if (m === -Infinity) return {output: new Array(width).fill(0), lse: -Infinity};
    let sum = 0;
    const out = new Array(width).fill(0);
    for (const st of states) {
      if (st.lse === -Infinity) continue;
      const w = Math.exp(st.lse - m);
      sum += w;
      for (let c = 0; c < width; ++c) out[c] += w * st.output[c];
    }
    return {output: out.map((x) => x / sum), lse: m + Math.log(sum)};
  }

  // The merge steps of one row: its parts' states merged one at a time into a running state that
  // starts empty (max −∞, denominator 0).
  function mergeSteps(parts, reference) {
    const width = parts.length ? parts[0].accumulator.length : 0;
    let running = {max: -Infinity, denominator: 0, accumulator: new Array(width).fill(0)};
    return parts.map((part, i) => {
      const next = mergeInto(running, part);
      const estimate = normalize(next.accumulator, next.denominator);
      const step = {
        part: i, maxBefore: running.max, partMax: part.max, maxAfter: next.max,
        runningRescale: next.runningRescale, partRescale: next.partRescale,
        denominatorBefore: running.denominator, partDenominator: part.denominator,
        denominator: next.denominator, accumulator: next.accumulator, estimate,
        maxAbsError: reference ? maxAbsDiff(estimate, reference) : NaN,
      };
      running = next;
      return step;
    });
  }

  // The row's full-matrix answer in float64 from the page's own inputs, under `options` (the
  // whole problem's AttentionOptions JSON, as maskOptions builds it): the page's problem is n
  // queries × n keys at positions 0…n−1, so query i is at p = i and key j at t = j; the keys the
  // causal mask or the window hide are left out (hiddenByGeometry, the trace's rule), and each
  // seen score is scale · q·k, capped (softcap · tanh(s / softcap)), then biased by
  // −slope · |p − t| (README "Softcap", "ALiBi": the server's order). With sinks, head 0's sink
  // (as sent: float32) is one more term of the row's sum with no value — out = Σ e^(x−m) v ÷
  // (Σ e^(x−m) + e^(sink−m)), m = max(max x, sink) — and a row that sees no key outputs 0.
  function referenceRow(problem, row, options) {
    const {keyLen: n, d, q, k, v} = problem;
    const scale = f32(1 / Math.sqrt(d));  // the server's default scale, rounded to fp32
    const geometry = oneSequence({keyLen: n, causal: options.causal,
                                  windowLeft: options.windowLeft, windowRight: options.windowRight});
    const seq = sequenceOf(geometry, row);
    const cap = options.softcap > 0 ? options.softcap : 0;
    const slope = options.alibiSlopes && options.alibiSlopes.length ? options.alibiSlopes[0] : 0;
    const scores = [];
    for (let j = 0; j < n; ++j) {
      if (hiddenByGeometry(geometry, seq, j)) continue;
      let dot = 0;
      for (let c = 0; c < d; ++c) dot += q[row * d + c] * k[j * d + c];
      let s = scale * dot;
      if (cap > 0) s = cap * Math.tanh(s / cap);
      scores.push([j, s - slope * keyDistance(seq, j)]);
    }
    const out = new Array(d).fill(0);
    if (scores.length === 0) return out;
    const sink = options.sinks && options.sinks.length ? f32(options.sinks[0]) : null;
    const max = Math.max(...scores.map(([, s]) => s), sink === null ? -Infinity : sink);
    let sum = sink === null ? 0 : Math.exp(sink - max);
    scores.forEach(([j, s]) => {
      const w = Math.exp(s - max);
      sum += w;
      for (let c = 0; c < d; ++c) out[c] += w * v[j * d + c];
    });
    return out.map((x) => x / sum);
  }

  // A model from the JSON lines of `attn trace --shard-keys --json` (documented in
  // client/cli/merge_trace.h: {"problem"}, then per row {"part"} lines, {"merge_step"} lines and
  // {"merged"}); `name` is the file's, for the label. Throws an Error saying what is wrong.
  function modelFromLines(text, name) {
    let problem = null;
    const rows = new Map();
    const rowOf = (r) => {
      const key = rowKey(r);
      if (!rows.has(key)) {
        rows.set(key, {row: {batch: num(r && r.batch), head: num(r && r.head), row: num(r && r.row)},
                       parts: [], steps: [], merged: null});
      }
      return rows.get(key);
    };
    text.split(/\r?\n/).forEach((line, i) => {
      if (!line.trim()) return;
      let o;
      try { o = JSON.parse(line); } catch (e) {
        throw new Error(`line ${i + 1} is not JSON (${e.message})`);
      }
      if (o.problem) {
        const p = o.problem;
        problem = {
          keyLen: num(p.keyLen), queryLen: num(p.queryLen), valueDim: num(p.valueDim),
          causal: !!p.causal, keyPosition: num(p.keyPosition), queryPosition: num(p.queryPosition),
          parts: num(p.parts), singleServer: !!p.singleServer, keysSent: num(p.keysSent),
          endpoints: (p.endpoints || []).map(String), heads: num(p.heads), kvHeads: num(p.kvHeads),
          scale: num(p.scale),
          // Absent: unbounded on that side.
          windowLeft: p.windowLeft === undefined || p.windowLeft === null ? null : num(p.windowLeft),
          windowRight: p.windowRight === undefined || p.windowRight === null ? null : num(p.windowRight),
          // One per query head when the file gives them (empty: none, or not said).
          sinks: nums(p.sinks),
        };
      } else if (o.part) {
        const p = o.part;
        rowOf(p.row).parts.push({
          index: num(p.index), endpoint: String(p.endpoint || '?'), keyBegin: num(p.keyBegin),
          keyEnd: num(p.keyEnd), keyPosition: num(p.keyPosition), queryPosition: num(p.queryPosition),
          steps: num(p.steps), max: num(p.max), denominator: num(p.denominator),
          accumulator: nums(p.accumulator), lse: num(p.lse), estimate: nums(p.estimate),
        });
      } else if (o.merge_step) {
        const s = o.merge_step;
        rowOf(s.row).steps.push({
          index: num(s.index), part: num(s.part), maxBefore: num(s.maxBefore),
          partMax: num(s.partMax), maxAfter: num(s.maxAfter), runningRescale: num(s.runningRescale),
          partRescale: num(s.partRescale), denominatorBefore: num(s.denominatorBefore),
          partDenominator: num(s.partDenominator), denominator: num(s.denominator),
          accumulator: nums(s.accumulator), estimate: nums(s.estimate),
          maxAbsError: num(s.maxAbsError),
        });
      } else if (o.merged) {
        const m = o.merged;
        rowOf(m.row).merged = {
          output: nums(m.output), lse: num(m.lse), reference: nums(m.reference),
          maxAbsError: num(m.maxAbsError), relativeError: num(m.relativeError),
          rowDoneMaxAbsDiff: m.rowDoneMaxAbsDiff === undefined ? NaN : num(m.rowDoneMaxAbsDiff),
          // The weight the row's sink took after the merge (0: no sinks).
          sinkShare: num(m.sinkShare),
        };
      } else if (o.start || o.step || o.rowDone || o.end) {
        throw new Error('this is the output of attn trace --json (one server\'s events); load ' +
                        'that of attn trace --shard-keys --json');
      } else {
        throw new Error(`line ${i + 1}: expected a "problem", "part", "merge_step" or "merged" ` +
                        `object, got ${line.slice(0, 80)}`);
      }
    });
    if (!problem) throw new Error('no {"problem": …} line: not an attn trace --shard-keys --json file');
    if (rows.size === 0) throw new Error('no traced rows in the file');
    for (const r of rows.values()) {
      const where = `row ${r.row.batch}:${r.row.head}:${r.row.row}`;
      r.parts.sort((a, b) => a.index - b.index);
      r.steps.sort((a, b) => a.index - b.index);
      if (r.parts.length !== problem.parts || r.steps.length !== problem.parts || !r.merged) {
        throw new Error(`${where}: ${r.parts.length} parts, ${r.steps.length} merge steps` +
                        `${r.merged ? '' : ', no merged line'}; the problem says ${problem.parts} parts`);
      }
      // The same rule again, here, from the parts' states: it must give the file's steps.
      r.recomputed = maxAbsDiff(mergeSteps(r.parts, null).at(-1).estimate, r.steps.at(-1).estimate);
      // The row's sink, joined here after the last step: the file's problem.sinks[head] when it
      // gives them, else the logit its merged lse and sink share imply, lse + log(sink share).
      const sink = problem.sinks.length > r.row.head ? problem.sinks[r.row.head]
        : r.merged.sinkShare > 0 ? f32(r.merged.lse + Math.log(r.merged.sinkShare)) : null;
      r.sinkFromShare = sink !== null && problem.sinks.length <= r.row.head;
      r.sinkJoin = sink === null ? null : addSink(lastState(r.steps), sink);
    }
    const servers = [...new Set(rows.values().next().value.parts.map((p) => p.endpoint))];
    const label = problem.singleServer
      ? `${name}: one server (${servers[0]}) traced all of it — nothing to merge; its final ` +
        'state is the answer.'
      : `${name}: ${problem.parts} parts traced by ${servers.length} server(s): ${servers.join(', ')}.`;
    return {source: 'file', label, problem, rows};
  }

  // The running state after a row's last merge step.
  const lastState = (steps) => {
    const last = steps[steps.length - 1];
    return {max: last.maxAfter, denominator: last.denominator, accumulator: last.accumulator};
  };

  // The page's own split of n keys into `asked` contiguous slices [a, b) (at most MAX_MERGE_PARTS,
  // at most n, at least 1; none empty).
  function keySlices(n, asked) {
    const count = Math.max(1, Math.min(asked, MAX_MERGE_PARTS, n));
    const slices = [];
    for (let s = 0; s < count; ++s) {
      const a = Math.round((s * n) / count), b = Math.round(((s + 1) * n) / count);
      if (b > a) slices.push([a, b]);
    }
    return slices;
  }

  // What the slices carried beside their positions, for the label: ' and …' or ''.
  function sentWith(options) {
    const side = (v) => (v === undefined ? '∞' : String(v));
    const what = [];
    if (options.windowLeft !== undefined || options.windowRight !== undefined) {
      what.push(`window left ${side(options.windowLeft)}, right ${side(options.windowRight)}`);
    }
    if (options.softcap > 0) what.push(`softcap ${fmt(options.softcap)}`);
    if (options.alibiSlopes) what.push(`ALiBi slope ${fmt(options.alibiSlopes[0], 8)}`);
    let text = what.length ? ` and the form's ${what.join(', ')}` : '';
    if (options.sinks) text += ` (the sink ${fmt(options.sinks[0], 6)} with part 1 only)`;
    return text;
  }

  // A model from "Split and merge": `traces` (transport's collectTrace, one per slice of
  // `slices`, all answered by `server`) of row cfg.row of the page's `problem` under the whole
  // problem's `options`. A part's state is its last step's; a slice the row cannot see has no
  // step and is the empty state (max −∞, denominator 0), which the merge takes with factor 0.
  // With sinks (options.sinks) the row's sink joins the merged state once, after the last part;
  // each part keeps the sinks its trace echoed (TraceStart.sinks: the first slice's only) and its
  // RowDone's (output, lse, sink share), whose merge is checked against the answer.
  function modelFromSlices({server, problem, cfg, options, slices, traces}) {
    const n = problem.keyLen, d = problem.d;
    const parts = traces.map((t, i) => {
      const [a, b] = slices[i];
      const last = t.steps.length ? t.steps[t.steps.length - 1] : null;
      const state = {
        index: i, endpoint: server, keyBegin: a, keyEnd: b, keyPosition: a, queryPosition: 0,
        steps: t.steps.length,
        max: last ? num(last.maxAfter) : -Infinity,           // no step: the empty state
        denominator: last ? num(last.denominator) : 0,
        accumulator: last ? nums(last.accumulator) : new Array(d).fill(0),
        lse: num(t.done.lse), output: nums(t.done.output),
        // The sink the part's server applied (head 0's; null: none) and the share it took.
        sink: t.start && t.start.sinks && t.start.sinks.length ? num(t.start.sinks[0]) : null,
        sinkShare: num(t.done.sinkShare),
      };
      state.estimate = normalize(state.accumulator, state.denominator);
      return state;
    });
    const reference = referenceRow(problem, cfg.row, options);
    const steps = mergeSteps(parts, reference);
    const sink = options.sinks && options.sinks.length ? f32(options.sinks[0]) : null;
    const sinkJoin = sink === null ? null : addSink(lastState(steps), sink);
    const output = sinkJoin ? sinkJoin.output : steps[steps.length - 1].estimate;
    const rowDone = mergeStates(parts);
    const row = {batch: 0, head: 0, row: cfg.row};
    return {
      source: 'server',
      label: parts.length === 1
        ? `One part: this server (${server}) traced all ${n} keys — nothing to merge; its final ` +
          'state is the answer.'
        : `All ${parts.length} parts were answered by this one server (${server}), one trace per ` +
          `slice of the keys with its positions${sentWith(options)}, and merged here: the merge a ` +
          `client of ${parts.length} servers would do.`,
      problem: {keyLen: n, queryLen: n, valueDim: d, causal: cfg.causal, keyPosition: 0,
                queryPosition: 0, parts: parts.length, singleServer: parts.length === 1,
                keysSent: n, endpoints: [server],
                windowLeft: cfg.windowLeft, windowRight: cfg.windowRight,
                sinks: (options.sinks || []).map(f32)},
      rows: new Map([[rowKey(row), {
        row, parts, steps, sinkJoin, sinkFromShare: false,
        merged: {output, reference, maxAbsError: maxAbsDiff(output, reference),
                 lse: sinkJoin ? sinkJoin.lse : NaN, sinkShare: sinkJoin ? sinkJoin.sinkShare : 0,
                 rowDoneOutput: rowDone.output,
                 rowDoneMaxAbsDiff: maxAbsDiff(output, rowDone.output)},
        recomputed: 0,
      }]]),
    };
  }

  // What hides each of the whole problem's keys from traced row `r` (a row index): 'causal',
  // 'window' or '' (seen), by the trace's rule from the whole request's positions and window.
  function mergeHidden(problem, r) {
    const geometry = oneSequence(problem);
    return hiddenKeys(geometry, sequenceOf(geometry, r), problem.keyLen);
  }

  (globalThis.AttnViewer ??= {}).merge = {mergeSteps, addSink, mergeStates, normalize, maxAbsDiff,
                                          referenceRow, modelFromLines, keySlices, modelFromSlices,
                                          mergeHidden};
})();
