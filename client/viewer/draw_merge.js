// Drawing the merge of key slices (section #merge, "Idea 3 × servers"): each part's slice on
// the key axis with the keys the row cannot see hatched, each part's final state, the current
// merge step's rescale factors and estimate, every step's table and chart, (with sinks) the sink
// joining the merged row once after the last part, and the merged output against the reference.
// drawMerge reads the section's view (viewer.js's `merge`: a model from merge.js, the chosen row
// and step) and writes only the page, but for caching the row's hidden keys on the row
// (row.hidden, once per row).
// Exports (AttnViewer.drawMerge): drawMerge.
'use strict';

(() => {
  const {$, el, svg} = AttnViewer.dom;
  const {fmt, fmtVector} = AttnViewer.format;
  const {maxAbsDiff, mergeHidden} = AttnViewer.merge;
  const {HIDDEN, MAX_COMPONENTS} = AttnViewer.drawTrace;

  // The mask's words for a part that saw no key: what hides its slice [a, b).
  function hiddenSliceText(hidden, a, b) {
    const why = new Set(hidden.slice(a, b).filter((h) => h));
    if (why.has('causal') && why.has('window')) return 'the causal mask and the window hide its whole slice';
    if (why.has('window')) return 'the window hides its whole slice';
    if (why.has('causal')) return 'the causal mask hides its whole slice';
    return 'it sees none of its slice';
  }

  function drawMergeKeys(problem, row, pos, hidden) {
    const chart = $('merge-keys');
    const W = 1000, H = 84, L = 12, R = 12, top = 24, bar = 24;
    const n = Math.max(1, problem.keyLen);
    const x = (j) => L + (j / n) * (W - L - R);
    const pattern = svg('pattern', {id: 'merge-hatch', width: 6, height: 6,
                                    patternUnits: 'userSpaceOnUse', patternTransform: 'rotate(45)'});
    pattern.append(svg('rect', {width: 6, height: 6, fill: '#ffffff', 'fill-opacity': 0.55}),
                   svg('line', {x1: 0, y1: 0, x2: 0, y2: 6, stroke: '#1d2330', 'stroke-width': 2}));
    const defs = svg('defs');
    defs.append(pattern);
    const nodes = [defs];
    row.parts.forEach((p, i) => {
      const state = i < pos ? 'merged' : i === pos ? 'current' : 'pending';
      const w = Math.max(1, x(p.keyEnd) - x(p.keyBegin));
      const rect = svg('rect', {x: x(p.keyBegin), y: top, width: w, height: bar,
                                class: `part p${i % 8} ${state}`});
      rect.append(svg('title', {}, `part ${i + 1}: keys [${p.keyBegin}, ${p.keyEnd}) on ${p.endpoint}`));
      nodes.push(rect);
      const mid = (x(p.keyBegin) + x(p.keyEnd)) / 2;
      nodes.push(svg('text', {x: mid, y: top - 6, class: 'part-label', 'text-anchor': 'middle'},
                     `part ${i + 1}${p.steps === 0 ? ' (sees none)' : ''}`));
      nodes.push(svg('text', {x: x(p.keyBegin) + 2, y: top + bar + 12, class: 'tick'},
                     String(p.keyBegin)));
    });
    if (problem.keysSent < problem.keyLen) {
      nodes.push(svg('rect', {x: x(problem.keysSent), y: top, height: bar, class: 'unsent',
                              width: x(problem.keyLen) - x(problem.keysSent)}));
    }
    // Keys this row cannot see (the causal mask: after its position; the window: outside
    // p − left … p + right), one hatched range per run of keys hidden for the same reason.
    const reasons = new Set();
    for (let j = 0; j < hidden.length;) {
      let e = j + 1;
      while (e < hidden.length && hidden[e] === hidden[j]) ++e;
      if (hidden[j]) {
        reasons.add(hidden[j]);
        const rect = svg('rect', {x: x(j), y: top, width: x(e) - x(j), height: bar, class: 'unseen',
                                  'data-hidden': hidden[j], 'data-lo': j, 'data-hi': e - 1});
        rect.append(svg('title', {}, `keys ${j}…${e - 1}: ${HIDDEN[hidden[j]].legend}`));
        nodes.push(rect);
      }
      j = e;
    }
    nodes.push(svg('text', {x: W - R, y: top + bar + 12, class: 'tick', 'text-anchor': 'end'},
                   String(problem.keyLen)));
    nodes.push(svg('text', {x: L, y: H - 6, class: 'axis'},
                   `keys 0…${problem.keyLen - 1}: each part's slice` +
                   (reasons.size ? `; hatched: keys this row cannot see (${[...reasons].join(', ')})` : '') +
                   (problem.keysSent < problem.keyLen ? '; grey: sent to no server' : '')));
    chart.replaceChildren(...nodes);
  }

  function drawMergeChart(row, pos) {
    const chart = $('merge-chart');
    const W = 420, H = 180, L = 44, R = 10, T = 10, B = 22;
    const ref = row.merged.reference;
    const comps = Math.min(4, ref.length);
    // The estimates after each step, then (with a sink) the output once the sink has joined.
    const points = row.steps.map((s) => s.estimate);
    if (row.sinkJoin) points.push(row.sinkJoin.output);
    let lo = Infinity, hi = -Infinity;
    for (const s of row.steps) {
      for (let c = 0; c < comps; ++c) {
        if (Number.isFinite(s.estimate[c])) { lo = Math.min(lo, s.estimate[c]); hi = Math.max(hi, s.estimate[c]); }
      }
    }
    if (row.sinkJoin) {
      for (let c = 0; c < comps; ++c) {
        lo = Math.min(lo, row.sinkJoin.output[c]); hi = Math.max(hi, row.sinkJoin.output[c]);
      }
    }
    for (let c = 0; c < comps; ++c) { lo = Math.min(lo, ref[c]); hi = Math.max(hi, ref[c]); }
    if (!(hi > lo)) { lo -= 1; hi += 1; }
    const count = points.length;
    const x = (i) => L + (count <= 1 ? 0.5 : i / (count - 1)) * (W - L - R);
    const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
    const nodes = [svg('rect', {x: L, y: T, width: W - L - R, height: H - T - B, class: 'plot'})];
    nodes.push(svg('text', {x: L - 4, y: T + 8, class: 'tick', 'text-anchor': 'end'}, fmt(hi, 2)));
    nodes.push(svg('text', {x: L - 4, y: H - B, class: 'tick', 'text-anchor': 'end'}, fmt(lo, 2)));
    nodes.push(svg('text', {x: L, y: H - 6, class: 'axis'},
                   'merge step → estimate (dashed: full matrix)'));
    for (let c = 0; c < comps; ++c) {
      nodes.push(svg('line', {x1: L, x2: W - R, y1: y(ref[c]), y2: y(ref[c]), class: `ref c${c}`}));
      const pts = points.map((e, i) => `${x(i).toFixed(1)},${y(e[c]).toFixed(1)}`);
      nodes.push(svg('polyline', {points: pts.join(' '), class: `est c${c}`}));
      nodes.push(svg('text', {x: W - R - (comps - 1 - c) * 26, y: H - 6, 'text-anchor': 'end',
                              class: `legend key c${c}`}, `c${c}`));
    }
    if (row.sinkJoin) {  // the last point: the output once the sink has joined
      nodes.push(svg('text', {x: x(count - 1) - 3, y: T + 10, class: 'tick', 'text-anchor': 'end'},
                     '+ sink'));
    }
    nodes.push(svg('line', {x1: x(pos), x2: x(pos), y1: T, y2: H - B, class: 'marker'}));
    chart.replaceChildren(...nodes);
  }

  function drawMerge(merge) {
    const model = merge.model;
    const row = model && model.rows.get(merge.rowKey);
    const total = row ? row.steps.length : 0;
    for (const id of ['merge-first', 'merge-prev']) $(id).disabled = total === 0 || merge.pos === 0;
    for (const id of ['merge-next', 'merge-last']) $(id).disabled = total === 0 || merge.pos >= total - 1;
    if (!row) return;
    const pos = Math.max(0, Math.min(merge.pos, total - 1));
    const s = row.steps[pos];
    const partOf = (i) => row.parts[i];
    const keys = (p) => `[${p.keyBegin}, ${p.keyEnd})`;
    $('merge-pos').textContent = `merge step ${pos + 1} / ${total}`;
    if (!row.hidden) row.hidden = mergeHidden(model.problem, row.row.row);  // once per row
    const hidden = row.hidden;
    drawMergeKeys(model.problem, row, pos, hidden);

    // Each part's final state.
    const dc = Math.min(row.parts.length ? row.parts[0].accumulator.length : 0, MAX_COMPONENTS);
    // With sinks, this page's split shows which part's server applied one (the first slice's only):
    // its RowDone's lse includes the sink; its max and denominator (the last tile's) do not.
    const sinkColumn = !!row.sinkJoin && model.source === 'server';
    const head = el('tr', {}, el('th', {}, 'part'), el('th', {}, 'keys'), el('th', {}, 'server'),
                    el('th', {}, 'tiles'), el('th', {}, 'max'), el('th', {}, 'denominator'),
                    el('th', {}, 'lse'), el('th', {}, 'estimate over its keys alone'));
    if (sinkColumn) {
      head.append(el('th', {title: 'the sink its trace carried (TraceStart.sinks) and the share of ' +
                                   'its row it took (RowDone.sink_share)'}, 'sink sent'));
    }
    const body = el('tbody');
    row.parts.forEach((p, i) => {
      const tr = el('tr', {class: i === pos ? 'current' : ''},
                    el('td', {}, String(i + 1)), el('td', {}, keys(p)), el('td', {}, p.endpoint),
                    el('td', {}, String(p.steps)));
      const withSink = p.sink !== undefined && p.sink !== null;
      if (p.steps === 0) {
        tr.append(el('td', {class: 'none', colspan: 4},
                     `saw no key: max −∞, denominator 0 (${hiddenSliceText(hidden, p.keyBegin, p.keyEnd)})` +
                     (withSink ? `; its lse ${fmt(p.lse)} is the sink's alone` : '')));
      } else {
        tr.append(el('td', {}, fmt(p.max)), el('td', {}, fmt(p.denominator, 6)),
                  el('td', {}, fmt(p.lse)), el('td', {}, fmtVector(p.estimate.slice(0, dc), 4)));
      }
      if (sinkColumn) {
        tr.append(el('td', {class: 'sink', 'data-sink': withSink ? String(p.sink) : 'none'},
                     withSink ? `${fmt(p.sink, 6)}, took ${fmt(p.sinkShare, 6)}` : 'none'));
      }
      body.append(tr);
    });
    $('merge-parts-table').replaceChildren(
        el('caption', {}, 'Each server\'s final online-softmax state over its slice (its last tile\'s)' +
                          (sinkColumn ? '; only the first slice carries the sink, which its lse includes' : '')),
        el('thead', {}, head), body);

    // The current step.
    const p = partOf(s.part);
    $('merge-step-label').textContent = `step ${pos + 1} of ${total}: + part ${s.part + 1}, keys ${keys(p)}`;
    $('merge-max').textContent = `${fmt(s.maxBefore)} → ${fmt(s.maxAfter)} (the part's ${fmt(s.partMax)})`;
    $('merge-running-rescale').textContent =
        `exp(${fmt(s.maxBefore)} − ${fmt(s.maxAfter)}) = ${fmt(s.runningRescale, 6)}` +
        (s.maxBefore === -Infinity ? ' (nothing merged yet: nothing to rescale)'
         : s.maxAfter > s.maxBefore ? ' (a larger max arrived: the running totals shrink)'
         : ' (max unchanged)');
    $('merge-part-rescale').textContent =
        `exp(${fmt(s.partMax)} − ${fmt(s.maxAfter)}) = ${fmt(s.partRescale, 6)}` +
        (s.partMax === -Infinity ? ' (this part saw no key: it adds nothing)' : '');
    $('merge-denominator').textContent =
        `${fmt(s.denominatorBefore)} × ${fmt(s.runningRescale)} + ${fmt(s.partDenominator)} × ` +
        `${fmt(s.partRescale)} = ${fmt(s.denominator, 6)}`;
    $('merge-estimate').textContent =
        `${fmtVector(s.estimate.slice(0, MAX_COMPONENTS), 6)}  max |estimate − full| ${fmt(s.maxAbsError, 8)}` +
        (row.sinkJoin ? ' (the row\'s sink joins after the last part)' : '');

    // Every step.
    const sh = el('tr', {}, el('th', {}, 'step'), el('th', {}, '+ part'), el('th', {}, 'max'),
                  el('th', {}, 'exp(m_running − m_new)'), el('th', {}, 'exp(m_part − m_new)'),
                  el('th', {}, 'denominator'), el('th', {}, 'estimate'), el('th', {}, '|error|'));
    const sb = el('tbody');
    row.steps.forEach((t, i) => {
      sb.append(el('tr', {class: i === pos ? 'current' : ''},
                   el('td', {}, String(i + 1)), el('td', {}, `${t.part + 1} ${keys(partOf(t.part))}`),
                   el('td', {}, `${fmt(t.maxBefore)} → ${fmt(t.maxAfter)}`),
                   el('td', {class: 'running-rescale'}, fmt(t.runningRescale, 6)),
                   el('td', {class: 'part-rescale'}, fmt(t.partRescale, 6)),
                   el('td', {}, fmt(t.denominator, 6)),
                   el('td', {class: 'estimate'}, fmtVector(t.estimate.slice(0, Math.min(dc, 4)), 4)),
                   el('td', {class: t.maxAbsError < 1e-5 ? 'close' : 'far'}, fmt(t.maxAbsError))));
    });
    const join = row.sinkJoin;
    if (join) {
      sb.append(el('tr', {class: 'sink-step'},
                   el('td', {}, '+'), el('td', {}, `the sink ${fmt(join.sink, 6)}`),
                   el('td', {}, `${fmt(join.maxBefore)} → ${fmt(join.maxAfter)}`),
                   el('td', {class: 'sink-factor'}, fmt(join.factor, 6)),
                   el('td', {class: 'sink-term'}, fmt(join.sinkTerm, 6)),
                   el('td', {}, fmt(join.denominator, 6)),
                   el('td', {class: 'estimate'}, fmtVector(join.output.slice(0, Math.min(dc, 4)), 4)),
                   el('td', {class: maxAbsDiff(join.output, row.merged.reference) < 1e-5 ? 'close' : 'far'},
                      fmt(maxAbsDiff(join.output, row.merged.reference)))));
    }
    $('merge-steps-table').replaceChildren(el('thead', {}, sh), sb);
    drawMergeChart(row, pos);

    // The sink, once, after the last part (OnlineSoftmax::AddSink).
    const sinkNote = $('merge-sink');
    sinkNote.hidden = !join;
    if (join) {
      sinkNote.dataset.share = String(join.sinkShare);
      sinkNote.textContent =
          `After the last part the row's sink joins, once (logit ${fmt(join.sink, 6)}` +
          (row.sinkFromShare ? ', from the file\'s merged lse and sink share' : '') + '): max ' +
          `${fmt(join.maxBefore)} → ${fmt(join.maxAfter)}; the merged state × ` +
          `exp(${fmt(join.maxBefore)} − ${fmt(join.maxAfter)}) = ${fmt(join.factor, 6)}, plus the ` +
          `sink's exp(${fmt(join.sink)} − ${fmt(join.maxAfter)}) = ${fmt(join.sinkTerm, 6)} in the ` +
          `denominator: ${fmt(join.denominatorBefore, 6)} → ${fmt(join.denominator, 6)}. It takes ` +
          `${fmt(join.sinkShare, 6)} of the row; output = accumulator × ${fmt(join.factor, 6)} ÷ ` +
          `${fmt(join.denominator, 6)} = ${fmtVector(join.output.slice(0, MAX_COMPONENTS), 6)}.`;
    } else {
      delete sinkNote.dataset.share;
    }

    // The merged output, once the last server is merged.
    const out = $('merge-output');
    $('merge-reference').textContent = fmtVector(row.merged.reference, 6);
    if (pos === total - 1) {
      const merged = join ? join.output : s.estimate;  // the sink joins after the last part
      out.textContent = fmtVector(merged, 6);
      out.dataset.values = JSON.stringify(merged);
      out.classList.add('ready');
      $('merge-error').textContent = fmt(maxAbsDiff(merged, row.merged.reference), 8);
    } else {
      out.textContent = `— (step to the last merge; ${total - 1 - pos} to go)`;
      delete out.dataset.values;
      out.classList.remove('ready');
      $('merge-error').textContent = '—';
    }
    const check = $('merge-check');
    const rowDoneDiff = row.merged.rowDoneMaxAbsDiff;
    if (Number.isFinite(rowDoneDiff)) check.dataset.rowDoneDiff = String(rowDoneDiff);
    else delete check.dataset.rowDoneDiff;
    check.textContent = model.source === 'file'
      ? `Recomputed here from the parts' states with the same rule: max |Δ| against the file's ` +
        `merged estimate = ${fmt(row.recomputed, 8)}` +
        (Number.isFinite(rowDoneDiff)
          ? `; the file's merge of the parts' finished (output, lse) differs by ` +
            `${fmt(rowDoneDiff, 8)}.` : '.')
      : 'Merged here in float32 with the rule of OnlineSoftmaxRow::Merge' +
        (join ? ', the sink added once after the last part (OnlineSoftmax::AddSink)' : '') +
        '; the reference is computed here in float64 from the page\'s inputs over all keys, with ' +
        `the same causal mask, window, softcap${join ? ', ALiBi bias and sink' : ' and ALiBi bias'}. ` +
        'The parts\' finished (output, lse), merged as client::MergeStates does' +
        (join ? ' (the first part\'s lse includes the sink)' : '') +
        `, differ from the merged output by ${fmt(rowDoneDiff, 8)}.`;
  }

  (globalThis.AttnViewer ??= {}).drawMerge = {drawMerge};
})();
