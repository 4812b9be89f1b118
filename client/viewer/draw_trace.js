// Drawing the trace (the page's ideas 1 to 3, in DOM tables and SVG): the key band of a row
// (drawKeyBand: what hides each key, the window, the row's sequence, the tile), idea 1's score
// row (drawIdea1; with sinks, the sink's logit and share beside the keys'), idea 2's bytes
// (drawBytes) and idea 3's current step with its convergence chart (drawStep; with sinks, the
// sink joining the row once after its last tile). Each draw function reads the run's state
// (viewer.js's `state`: the problem, the parsed trace events, the current step) and writes only
// the page; none changes the state but the convergence chart's cache (state.chartCache).
// Exports (AttnViewer.drawTrace): HIDDEN, MAX_COMPONENTS, drawKeyBand, drawIdea1, drawBytes,
// drawStep, statsText.
'use strict';

(() => {
  const {$, el, svg} = AttnViewer.dom;
  const {num, rowKey, fmt, fmtVector, fmtBytes} = AttnViewer.format;
  const {sequenceOf, hiddenKeys, windowRange, keyDistance} = AttnViewer.geometry;

  const MAX_TABLE_KEYS = 32;      // idea 1 lists at most this many keys (the heaviest)
  const MAX_IDEA1_COMPONENTS = 4; // value components shown in idea 1, as in the explainer
  const MAX_COMPONENTS = 16;      // columns of value/accumulator shown
  const TIE_COLOURS = ['#f6c85f', '#9dd866', '#6fb7f2', '#f28e8e', '#c89df2', '#f2b56f',
                       '#7fdcd0', '#e0a3c8'];

  // How each reason is shown, wherever a hidden key is drawn: its mark in the key band (key j
  // labelled j + mark, class = the reason), its words in a score cell ("−∞ (text)", class
  // hidden-<reason>, title) and its legend entry.
  const HIDDEN = {
    causal: {mark: 'c', text: 'causal', legend: 'hidden by the causal mask',
             title: 'hidden by the causal mask: the key is after the query'},
    window: {mark: 'w', text: 'window', legend: 'hidden by the window',
             title: 'hidden by the window: outside p − left … p + right'},
    sequence: {mark: 's', text: 'other sequence', legend: 'in another sequence',
               title: 'hidden: the key is in another sequence of the ragged batch'},
  };

  // A strip of the row's n keys: each key coloured by what hides it, the window's visible range
  // as a band, (a ragged batch) the row's own sequence's keys as a bar beneath with its edges
  // drawn, and (tile) the current tile outlined.
  function drawKeyBand(chart, n, hidden, range, tile, seq) {
    const W = 1000, T = 4, H = 24, L = 4, R = 4;
    const w = (W - L - R) / Math.max(1, n);
    const x = (j) => L + j * w;
    const nodes = [];
    for (let j = 0; j < n; ++j) {
      const why = hidden[j] || '';
      const reason = HIDDEN[why];
      const r = svg('rect', {x: x(j), y: T, width: w, height: H, class: `key ${why}`,
                             'data-key': j, 'data-hidden': why || 'none'});
      r.append(svg('title', {}, `key ${j}${reason ? `: hidden (${reason.text})` : ''}`));
      nodes.push(r);
      if (n <= 64) {
        nodes.push(svg('text', {x: x(j) + w / 2, y: T + 16, class: 'key-label', 'text-anchor': 'middle'},
                       reason ? `${j}${reason.mark}` : String(j)));
      }
    }
    if (range && range.hi >= range.lo) {
      nodes.push(svg('rect', {x: x(range.lo), y: T - 2, width: (range.hi - range.lo + 1) * w,
                              height: H + 4, class: 'band', 'data-lo': range.lo, 'data-hi': range.hi}));
    }
    const ragged = seq && seq.index !== null;
    if (ragged) {
      nodes.push(svg('rect', {x: x(seq.first), y: T + H + 1, width: (seq.end - seq.first) * w,
                              height: 3, class: 'sequence-bar', 'data-sequence': seq.index,
                              'data-lo': seq.first, 'data-hi': seq.end - 1}));
      for (const edge of [seq.first, seq.end]) {
        nodes.push(svg('line', {x1: x(edge), x2: x(edge), y1: T - 4, y2: T + H + 4,
                                class: 'sequence-edge'}));
      }
    }
    if (tile) {
      nodes.push(svg('rect', {x: x(tile.begin), y: T - 3, width: (tile.end - tile.begin) * w,
                              height: H + 6, class: 'tile'}));
    }
    const legend = [range ? `band: the window, keys ${range.lo}…${range.hi}` +
        (range.hi < range.lo ? ' (none)' : '') : 'no window'];
    if (ragged) {
      legend.push(`bar: its sequence ${seq.index}, ` +
                  (seq.end > seq.first ? `keys ${seq.first}…${seq.end - 1}` : 'no keys'));
    }
    legend.push(Object.entries(HIDDEN).filter(([why]) => ragged || why !== 'sequence')
                    .map(([, reason]) => `${reason.mark}: ${reason.legend}`).join(', '));
    nodes.push(svg('text', {x: L, y: T + H + 13, class: 'key-label'}, legend.join('; ')));
    chart.replaceChildren(...nodes);
  }

  // ---------------------------------------------------------------------------------------------
  // Idea 1: one score row, its weights and the weighted result.
  function tieGroups(values) {
    // Returns a Map index → colour for scores exactly equal to at least one other (the server's
    // float32 values), and the indices of the largest score.
    const order = Array.from(values.keys()).filter((i) => Number.isFinite(values[i]))
        .sort((a, b) => values[a] - values[b]);
    const colour = new Map();
    let g = 0;
    for (let s = 0; s < order.length;) {
      let e = s + 1;
      const base = values[order[s]];
      while (e < order.length && values[order[e]] === base) ++e;
      if (e - s > 1) {
        const c = TIE_COLOURS[g++ % TIE_COLOURS.length];
        for (let i = s; i < e; ++i) colour.set(order[i], c);
      }
      s = e;
    }
    const top = order.length ? values[order[order.length - 1]] : -Infinity;
    const max = new Set(order.filter((i) => values[i] === top));
    return {colour, max};
  }

  // A score cell: the score, or −∞ with why the key is hidden (HIDDEN: class hidden-<reason>,
  // data-hidden) when the mask hides it.
  function scoreCell(score, why, cls) {
    const td = el('td', {class: cls || '', 'data-hidden': why || 'none'});
    if (why) {
      td.textContent = `−∞ (${HIDDEN[why].text})`;
      td.classList.add(`hidden-${why}`);
      td.title = HIDDEN[why].title;
    } else {
      td.textContent = score === -Infinity ? '−∞ (masked)' : fmt(score);
    }
    return td;
  }
  // A cell of a number shown beside the score (bias, scaled score), its exact value in data-value.
  function valueCell(x, cls) {
    const td = el('td', {class: cls}, Number.isNaN(x) ? '—' : fmt(x, 6));
    if (!Number.isNaN(x)) td.dataset.value = String(x);
    return td;
  }
  function maskCaption(start, range, seq) {
    const parts = [];
    if (seq.index !== null) {
      const span = (a, b) => (b > a ? `${a}…${b - 1}` : 'none');
      parts.push(`sequence ${seq.index} of ${seq.count}: query rows ${span(seq.rowBegin, seq.rowEnd)}, ` +
                 `keys ${span(seq.first, seq.end)}`);
    }
    if (range) {
      const side = (v) => (v === null ? '∞' : String(v));
      parts.push(`window left ${side(start.windowLeft)}, right ${side(start.windowRight)}: ` +
                 `keys ${range.lo}…${range.hi} visible`);
    }
    if (start.softcap > 0) parts.push(`softcap ${fmt(start.softcap)}`);
    if (start.alibiSlopes.length) parts.push(`ALiBi slope ${fmt(start.alibiSlopes[0], 8)}`);
    return parts.length ? parts.join('; ') + '; ' : '';
  }

  // The sink's row of idea 1's table: its logit where a key's score is (not scaled, capped,
  // biased or masked: '—' in those columns), its share of the row as its weight (RowDone's
  // sink_share, e^(sink − lse)), and no value row.
  function sinkRow(sink, share, anyScaled, alibi, dc) {
    const tr = el('tr', {class: 'sink', 'data-sink': String(sink)},
                  el('td', {title: 'attention sink: one more logit of the row, with no value'}, 'sink'));
    if (anyScaled) tr.append(el('td', {class: 'scaled', title: 'a sink is not scaled'}, '—'));
    if (alibi) tr.append(el('td', {class: 'bias', title: 'a sink is not biased'}, '—'));
    const bar = el('span', {class: 'bar sink', style: `width:${(share * 100).toFixed(1)}%`});
    tr.append(el('td', {class: 'score sink-logit', 'data-value': String(sink),
                        title: 'the sink\'s logit (options.sinks), as sent'}, fmt(sink, 6)),
              el('td', {class: 'weight sink-share', 'data-value': String(share),
                        title: 'the weight the sink took: RowDone.sink_share = e^(sink − lse)'},
                 el('span', {class: 'barbox'}, bar), ' ', fmt(share)),
              el('td', {class: 'v', colspan: dc}, 'no value'),
              el('td', {colspan: dc}, 'adds nothing'));
    return tr;
  }
  // The caption's words on the sink: its logit, its share and what the keys' weights sum to.
  function sinkCaption(sink, share, weights) {
    const keys = weights.reduce((a, w) => a + w, 0);
    return `sink logit ${fmt(sink, 6)} takes ${fmt(share, 6)} of the row; the keys' weights sum ` +
           `to 1 − ${fmt(share, 6)} = ${fmt(keys, 6)}; `;
  }

  function drawIdea1(state) {
    const table = $('score-table');
    const p = state.problem, cfg = state.cfg;
    if (!p || !state.start) return;
    const key = `0/0/${cfg.row}`;
    const done = state.rowDone.get(key);
    $('idea1-row').textContent = String(cfg.row);
    if (!done) {
      table.replaceChildren(el('caption', {}, 'Waiting for the trace of this row…'));
      return;
    }
    const n = p.keyLen, d = p.d;
    const scores = new Float64Array(n).fill(-Infinity);
    // Per key, from the row's steps: what hides it, its ALiBi bias and its scaled score before
    // softcap and bias; keys of tiles not traced (hidden entirely) take the geometry's answer and
    // the bias −slope·|p − t| computed here (t counted in the row's sequence, as the server does).
    const start = state.start;
    const seq = sequenceOf(start, cfg.row);
    const hidden = hiddenKeys(start, seq, n);
    const alibi = start.alibiSlopes.length > 0;
    const slope = alibi ? start.alibiSlopes[0] : 0;
    const biases = Array.from({length: n},
                              (_, j) => (alibi ? Math.fround(-slope * keyDistance(seq, j)) : NaN));
    const scaled = new Array(n).fill(NaN);
    let anyScaled = false;
    for (const s of state.steps) {
      if (rowKey(s.row) !== key) continue;
      s.scores.forEach((x, i) => { scores[s.keyBegin + i] = x; });
      s.hidden.forEach((h, i) => { hidden[s.keyBegin + i] = h; });
      s.biases.forEach((b, i) => { biases[s.keyBegin + i] = b; });
      s.scaledScores.forEach((x, i) => { scaled[s.keyBegin + i] = x; anyScaled = true; });
    }
    const range = windowRange(start, seq);
    drawKeyBand($('idea1-band'), n, hidden, range, null, seq);
    // lse includes the sink (with sinks), so the keys' weights sum to 1 − the sink's share.
    const weights = Array.from(scores, (s) => (done.lse === -Infinity ? 0 : Math.exp(s - done.lse)));
    const sink = start.sinks.length ? start.sinks[0] : null;  // head 0's: the traced row's
    const {colour, max} = tieGroups(scores);
    let keys = Array.from(scores.keys());
    if (n > MAX_TABLE_KEYS) {
      keys = keys.sort((a, b) => weights[b] - weights[a]).slice(0, MAX_TABLE_KEYS)
          .sort((a, b) => a - b);
    }
    const dc = Math.min(d, MAX_IDEA1_COMPONENTS);
    const part = dc < d ? ` (components 0–${dc - 1} of ${d})` : '';
    const extra = (anyScaled ? 1 : 0) + (alibi ? 1 : 0);
    const head = el('tr', {}, el('th', {}, 'key j'));
    if (anyScaled) head.append(el('th', {title: 'scale · q·k, before softcap and bias'}, 'scaled'));
    if (alibi) head.append(el('th', {title: `ALiBi: −${fmt(slope, 8)} · |p − t|`}, 'bias'));
    head.append(el('th', {}, 'score'),
                el('th', {}, 'weight'), el('th', {colspan: dc}, `value row v_j${part}`),
                el('th', {colspan: dc}, 'weight · v_j'));
    const rows = [el('thead', {}, head)];
    const body = el('tbody');
    const row = cfg.row;
    for (const j of keys) {
      const w = weights[j];
      const inWindow = range && j >= range.lo && j <= range.hi;
      const tr = el('tr', {class: (max.has(j) ? 'max' : '') + (inWindow ? ' in-window' : ''),
                           'data-key': j});
      const sc = scoreCell(scores[j], hidden[j], 'score');
      if (colour.has(j)) {
        sc.style.background = colour.get(j);
        sc.title = 'tied with another key\'s score';
        sc.classList.add('tie');
      }
      const bar = el('span', {class: 'bar', style: `width:${(w * 100).toFixed(1)}%`});
      tr.append(el('td', {}, String(j)));
      if (anyScaled) tr.append(valueCell(scaled[j], 'scaled'));
      if (alibi) tr.append(valueCell(biases[j], 'bias'));
      tr.append(sc, el('td', {class: 'weight', 'data-value': String(w)},
                       el('span', {class: 'barbox'}, bar), ' ', fmt(w)));
      for (let c = 0; c < dc; ++c) tr.append(el('td', {class: 'v'}, fmt(p.v[j * d + c], 2)));
      for (let c = 0; c < dc; ++c) tr.append(el('td', {}, fmt(w * p.v[j * d + c])));
      body.append(tr);
    }
    if (sink !== null) body.append(sinkRow(sink, done.sinkShare, anyScaled, alibi, dc));
    rows.push(body);
    const result = new Float64Array(dc);
    for (let j = 0; j < n; ++j) for (let c = 0; c < dc; ++c) result[c] += weights[j] * p.v[j * d + c];
    const foot = el('tr', {}, el('th', {colspan: 3 + extra + dc},
                                 (n > keys.length ? `Σ over all ${n} keys (${n - keys.length} not listed)`
                                                  : 'Σ over keys = weighted result') +
                                 (sink !== null ? ' (the sink adds no value)' : '')));
    for (let c = 0; c < dc; ++c) foot.append(el('th', {}, fmt(result[c])));
    rows.push(el('tfoot', {}, foot));
    const ties = new Set(colour.values()).size;
    rows.unshift(el('caption', {},
                    `lse = ${fmt(done.lse)}${sink !== null ? ' (the sink included)' : ''}; ` +
                    maskCaption(start, range, seq) +
                    (sink !== null ? sinkCaption(sink, done.sinkShare, weights) : '') +
                    (max.size > 1 ? `${max.size} keys tie for the largest score and share its weight; `
                                  : '') +
                    (ties ? `${ties} group(s) of equal scores highlighted.` : 'no equal scores.')));
    table.replaceChildren(...rows);
    if (state.naive && state.naive.output) {
      const vd = state.naive.output.shape.at(-1);
      $('naive-output').textContent = fmtVector(state.naive.output.data.slice(row * vd, row * vd + vd));
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Idea 2: bytes.
  function drawBytes(cfg, fromServer) {
    const n = Math.max(1, cfg.keyLen || 1);
    const naiveBytes = fromServer && fromServer.naiveBytes !== undefined
      ? fromServer.naiveBytes : 16 * Math.max(1, cfg.queryLen || 1) * n;
    const perRow = (Math.max(1, cfg.blockK || 1) + Math.max(1, cfg.d || 1) + 2);
    const perRowFloats = fromServer && fromServer.perRowFloats ? fromServer.perRowFloats : perRow;
    $('naive-bytes').textContent = fmtBytes(naiveBytes);
    $('naive-bytes').dataset.bytes = String(naiveBytes);
    $('naive-bytes').title = fromServer ? 'as the server reported it'
        : cfg.sequences ? 'computed here: 16 · packed query rows · packed keys' : 'computed here: 16·N²';
    $('tiled-bytes').textContent = '0 bytes (no N × N matrix exists)';
    $('tiled-scratch').textContent =
        `${perRowFloats} floats = ${fmtBytes(perRowFloats * 4)} per row, whatever N`;
    $('tiled-scratch').dataset.bytes = String(perRowFloats * 4);

    const chart = $('bytes-chart');
    chart.replaceChildren();
    const W = 480, H = 260, L = 62, R = 12, T = 12, B = 34;
    const nMax = Math.max(65536, 4 * n);
    const x = (v) => L + (Math.log2(v) / Math.log2(nMax)) * (W - L - R);
    const yMax = 16 * nMax * nMax;
    const y = (v) => T + (1 - Math.log10(Math.max(v, 1)) / Math.log10(yMax)) * (H - T - B);
    chart.append(svg('rect', {x: L, y: T, width: W - L - R, height: H - T - B, class: 'plot'}));
    for (let p = 0; p <= Math.log2(nMax); p += 4) {
      const v = Math.pow(2, p);
      chart.append(svg('line', {x1: x(v), x2: x(v), y1: T, y2: H - B, class: 'grid'}));
      chart.append(svg('text', {x: x(v), y: H - B + 14, class: 'tick', 'text-anchor': 'middle'},
                       v >= 1024 ? `${v / 1024}K` : String(v)));
    }
    const yLabels = ['1 B', '1 kB', '1 MB', '1 GB', '1 TB', '1 PB', '1 EB'];
    for (let p = 0; p <= Math.log10(yMax); p += 3) {
      const v = Math.pow(10, p);
      chart.append(svg('line', {x1: L, x2: W - R, y1: y(v), y2: y(v), class: 'grid'}));
      chart.append(svg('text', {x: L - 6, y: y(v) + 4, class: 'tick', 'text-anchor': 'end'},
                       yLabels[p / 3] || `1e${p} B`));
    }
    chart.append(svg('text', {x: (L + W - R) / 2, y: H - 4, class: 'axis', 'text-anchor': 'middle'},
                     'N (query and key length)'));
    const curve = (f, cls) => {
      const pts = [];
      for (let p = 0; p <= Math.log2(nMax); p += 0.25) {
        const v = Math.pow(2, p);
        pts.push(`${x(v).toFixed(1)},${y(f(v)).toFixed(1)}`);
      }
      chart.append(svg('polyline', {points: pts.join(' '), class: cls}));
    };
    curve((v) => 16 * v * v, 'naive');
    curve((v) => v * perRowFloats * 4, 'tiled-all');
    curve(() => perRowFloats * 4, 'tiled');
    chart.append(svg('circle', {cx: x(n), cy: y(16 * n * n), r: 4, class: 'naive'}));
    chart.append(svg('circle', {cx: x(n), cy: y(perRowFloats * 4), r: 4, class: 'tiled'}));
    const here = svg('text', {x: L + 10, y: T + 60, class: 'legend'}, `At N = ${n}: `);
    here.append(svg('tspan', {class: 'label naive'}, `Naive ${16 * n * n} bytes`),
                svg('tspan', {}, ', '),
                svg('tspan', {class: 'label tiled'}, `Tiled ${perRowFloats * 4} bytes per row`));
    chart.append(here);
    const legend = [['naive', 'Naive: 16·N² bytes of score and weight traffic'],
                    ['tiled-all', 'Tiled: every row\'s scratch at once, N·(block_k + d + 2)·4'],
                    ['tiled', 'Tiled: one row\'s scratch, (block_k + d + 2)·4']];
    legend.forEach(([cls, text], i) => {
      chart.append(svg('line', {x1: L + 10, x2: L + 30, y1: T + 12 + i * 14, y2: T + 12 + i * 14,
                                class: cls}));
      chart.append(svg('text', {x: L + 34, y: T + 16 + i * 14, class: 'legend'}, text));
    });
  }

  // ---------------------------------------------------------------------------------------------
  // Idea 3: the current step.
  // The weight the row's sink takes (0 without sinks): RowDone.sink_share once the row is done,
  // before that e^(sink − lse) from Naive's lse; NaN while neither has come.
  function sinkShareFor(state, key) {
    const start = state.start;
    if (!start || start.sinks.length === 0) return 0;
    const done = state.rowDone.get(key);
    if (done) return done.sinkShare;
    if (state.naive && state.naive.lse) {
      const lse = state.naive.lse.data[Number(key.split('/')[2])];
      if (lse !== undefined) return Math.exp(start.sinks[0] - lse);
    }
    return NaN;
  }
  // What the steps' estimates converge to: the reference over the keys alone, reference ÷ (1 −
  // the sink's share) (the steps never include the sink; it joins after the last tile); the
  // reference itself without sinks. Null while unknown.
  function keysReference(ref, share) {
    if (!ref || Number.isNaN(share)) return null;
    if (share === 0) return ref;
    return ref.map((x) => (share < 1 ? x / (1 - share) : 0));
  }

  function referenceFor(state, key) {
    const done = state.rowDone.get(key);
    if (done) return done.reference;
    if (state.naive && state.naive.output) {
      const row = Number(key.split('/')[2]);
      const vd = state.naive.output.shape.at(-1);
      return Array.from(state.naive.output.data.slice(row * vd, row * vd + vd));
    }
    return null;
  }

  function drawStep(state) {
    const total = state.steps.length;
    const slider = $('step-slider');
    slider.max = String(Math.max(0, total - 1));
    slider.disabled = total === 0;
    const streaming = !state.streamDone && state.abort;
    for (const id of ['step-first', 'step-prev']) $(id).disabled = total === 0 || state.pos === 0;
    for (const id of ['step-next', 'step-last']) $(id).disabled = total === 0 || state.pos >= total - 1;
    $('play').disabled = total === 0 || state.playing;
    $('pause').disabled = !state.playing;
    if (total === 0) {
      $('step-pos').textContent = streaming ? 'waiting for steps…' : 'no steps yet';
      return;
    }
    const pos = Math.min(state.pos, total - 1);
    slider.value = String(pos);
    const s = state.steps[pos];
    const key = rowKey(s.row);
    const tilesPerRow = state.start ? state.start.tilesPerRow : '?';
    $('step-pos').textContent = `step ${pos + 1} / ${total}${streaming ? ' (streaming…)' : ''}` +
        ` · row ${num(s.row.row)} · tile ${s.tile + 1} of ${tilesPerRow}`;
    $('tile-label').textContent = `keys ${s.keyBegin}…${s.keyEnd - 1}`;

    // The tile's scores and weights.
    const {colour, max} = tieGroups(s.scores);
    const start = state.start;
    const n = start ? start.keyLen : s.keyEnd;
    const row = num(s.row.row);
    const seq = start ? sequenceOf(start, row) : null;
    const range = windowRange(start, seq);
    if (start) {
      const hiddenRow = hiddenKeys(start, seq, n);
      s.hidden.forEach((h, i) => { hiddenRow[s.keyBegin + i] = h; });
      drawKeyBand($('tile-band'), n, hiddenRow, range, {begin: s.keyBegin, end: s.keyEnd}, seq);
    }
    const withScaled = s.scaledScores.length > 0, withBias = s.biases.length > 0;
    const th = el('tr', {}, el('th', {}, 'key'));
    if (withScaled) th.append(el('th', {title: 'scale · q·k, before softcap and bias'}, 'scaled'));
    if (withBias) th.append(el('th', {title: 'ALiBi: −slope · |p − t|'}, 'bias'));
    th.append(el('th', {}, 'score'), el('th', {}, 'exp(score − max_after)'));
    const tileRows = [el('thead', {}, th)];
    const tb = el('tbody');
    const shown = Math.min(s.scores.length, MAX_TABLE_KEYS);
    for (let i = 0; i < shown; ++i) {
      const j = s.keyBegin + i;
      const sc = scoreCell(s.scores[i], s.hidden[i] || '', 'score');
      if (colour.has(i)) { sc.style.background = colour.get(i); sc.classList.add('tie'); }
      const inWindow = range && j >= range.lo && j <= range.hi;
      const tr = el('tr', {class: (max.has(i) ? 'max' : '') + (inWindow ? ' in-window' : ''),
                           'data-key': j}, el('td', {}, String(j)));
      if (withScaled) tr.append(valueCell(s.scaledScores[i], 'scaled'));
      if (withBias) tr.append(valueCell(s.biases[i], 'bias'));
      tr.append(sc, el('td', {}, fmt(s.weights[i])));
      tb.append(tr);
    }
    if (shown < s.scores.length) {
      tb.append(el('tr', {}, el('td', {colspan: 3 + (withScaled ? 1 : 0) + (withBias ? 1 : 0)},
                                `… ${s.scores.length - shown} more keys`)));
    }
    tileRows.push(tb);
    $('tile-table').replaceChildren(...tileRows);

    $('max-before').textContent = fmt(s.maxBefore);
    $('max-after').textContent = fmt(s.maxAfter);
    const note = s.maxBefore === -Infinity ? ' (first tile: nothing to rescale)'
               : s.maxAfter > s.maxBefore ? ' (a larger score arrived: earlier totals shrink)'
               : ' (max unchanged)';
    $('rescale').textContent = fmt(s.rescale, 6) + note;
    const prev = pos > 0 && rowKey(state.steps[pos - 1].row) === key ? state.steps[pos - 1] : null;
    const prevDen = prev ? prev.denominator : 0;
    const tileSum = s.weights.reduce((a, b) => a + b, 0);
    $('denominator').textContent =
        `${fmt(prevDen)} × ${fmt(s.rescale)} + ${fmt(tileSum)} = ${fmt(s.denominator, 6)}`;

    // Accumulators: previous · rescale + this tile's weighted values = new; estimate = acc / den.
    // With a sink the estimate is over the keys alone, so it is checked against the reference
    // over the keys alone.
    const withSink = !!(start && start.sinks.length);
    const share = sinkShareFor(state, key);
    const fullRef = referenceFor(state, key);
    const ref = keysReference(fullRef, share);
    const dc = Math.min(s.accumulator.length, MAX_COMPONENTS);
    const refHead = withSink
      ? el('th', {title: 'the full-matrix result ÷ (1 − sink share): the keys\' part, which the ' +
                         'estimate converges to; the sink joins after the last tile'},
           'full-matrix, keys only')
      : el('th', {}, 'full-matrix');
    const accRows = [el('thead', {}, el('tr', {}, el('th', {}, 'c'), el('th', {}, 'previous × rescale'),
                                             el('th', {}, '+ tile Σ w·v'), el('th', {}, '= accumulator'),
                                             el('th', {}, 'estimate'), refHead,
                                             el('th', {}, '|error|')))];
    const ab = el('tbody');
    for (let c = 0; c < dc; ++c) {
      const before = prev ? prev.accumulator[c] * s.rescale : 0;
      const r = ref ? ref[c] : NaN;
      const err = Math.abs(s.estimate[c] - r);
      ab.append(el('tr', {}, el('td', {}, String(c)), el('td', {}, fmt(before)),
                   el('td', {}, fmt(s.accumulator[c] - before)), el('td', {}, fmt(s.accumulator[c])),
                   el('td', {class: 'estimate'}, fmt(s.estimate[c], 6)), el('td', {}, fmt(r, 6)),
                   el('td', {class: err < 1e-5 ? 'close' : 'far'}, ref ? fmt(err) : '—')));
    }
    accRows.push(ab);
    $('acc-table').replaceChildren(...accRows);
    drawConvergence(state, key, s.tile, ref, withSink);

    // The final output, once the row's last tile is reached.
    const done = state.rowDone.get(key);
    const last = state.lastStepOfRow.get(key);
    const out = $('final-output');
    if (done && last === pos) {
      out.textContent = fmtVector(done.output, 6);
      out.dataset.values = JSON.stringify(done.output);
      out.classList.add('ready');
      $('reference-output').textContent = fmtVector(done.reference, 6);
      $('max-error').textContent = fmt(done.maxAbsError, 8);
    } else {
      const remaining = state.start ? Math.max(0, state.start.tilesPerRow - s.tile - 1) : '?';
      out.textContent = `— (step to this row's last tile; about ${remaining} to go)`;
      delete out.dataset.values;
      out.classList.remove('ready');
      $('reference-output').textContent = fullRef ? fmtVector(fullRef, 6) : '—';
      $('max-error').textContent = '—';
    }
    drawSinkJoin(withSink ? start.sinks[0] : null, s, done && last === pos ? done : null);
  }

  // The sink joining the row (#sink-join), once, after its last tile: the max moves to cover its
  // logit, it takes sink_share of the row, and the output is the keys' estimate × (1 −
  // sink_share) (OnlineSoftmax::AddSink). Hidden without sinks; before the last tile, says when
  // it joins.
  function drawSinkJoin(sink, s, done) {
    const p = $('sink-join');
    p.hidden = sink === null;
    if (sink === null) return;
    delete p.dataset.share;
    if (!done) {
      p.textContent = `The sink (logit ${fmt(sink, 6)}) joins the row once, after its last tile: ` +
                      'the steps\' estimates are over the keys alone.';
      return;
    }
    const scaled = s.estimate.map((x) => x * (1 - done.sinkShare));
    p.dataset.share = String(done.sinkShare);
    p.textContent = `After the last tile the sink joins: logit ${fmt(sink, 6)}, max ` +
        `${fmt(s.maxAfter)} → ${fmt(Math.max(s.maxAfter, sink))}; it takes sink_share = ` +
        `e^(sink − lse) = ${fmt(done.sinkShare, 6)} of the row, so output = estimate × (1 − ` +
        `sink_share) = ${fmtVector(scaled.slice(0, MAX_COMPONENTS), 6)} (the server's above).`;
  }

  // The estimate of each of the first few components against the tile index, for one row, and
  // `ref` dashed (with a sink: the keys' part of the full-matrix result); the polylines are
  // rebuilt only when that row gains steps or the reference arrives, the marker moves every step.
  function drawConvergence(state, key, tile, ref, withSink) {
    const chart = $('converge-chart');
    const W = 420, H = 180, L = 44, R = 10, T = 10, B = 22;
    let cache = state.chartCache;
    const count = state.steps.length;
    if (!cache || cache.key !== key || cache.count !== count || cache.withRef !== !!ref) {
      const rowSteps = [];
      for (const s of state.steps) if (rowKey(s.row) === key) rowSteps.push(s);
      const comps = Math.min(4, rowSteps.length ? rowSteps[0].estimate.length : 0);
      let lo = Infinity, hi = -Infinity;
      for (const s of rowSteps) {
        for (let c = 0; c < comps; ++c) {
          if (Number.isFinite(s.estimate[c])) { lo = Math.min(lo, s.estimate[c]); hi = Math.max(hi, s.estimate[c]); }
        }
      }
      if (ref) for (let c = 0; c < comps; ++c) { lo = Math.min(lo, ref[c]); hi = Math.max(hi, ref[c]); }
      if (!(hi > lo)) { lo -= 1; hi += 1; }
      const tiles = Math.max(1, state.start ? state.start.tilesPerRow : rowSteps.length);
      const x = (t) => L + (tiles <= 1 ? 0.5 : t / (tiles - 1)) * (W - L - R);
      const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
      const nodes = [svg('rect', {x: L, y: T, width: W - L - R, height: H - T - B, class: 'plot'})];
      nodes.push(svg('text', {x: L - 4, y: T + 8, class: 'tick', 'text-anchor': 'end'}, fmt(hi, 2)));
      nodes.push(svg('text', {x: L - 4, y: H - B, class: 'tick', 'text-anchor': 'end'}, fmt(lo, 2)));
      nodes.push(svg('text', {x: L, y: H - 6, class: 'axis'},
                     withSink ? 'tile → estimate (dashed: the keys\' part of the full matrix)'
                              : 'tile → estimate (dashed: full-matrix result)'));
      const stride = Math.max(1, Math.floor(rowSteps.length / 400));
      for (let c = 0; c < comps; ++c) {
        if (ref) {
          nodes.push(svg('line', {x1: L, x2: W - R, y1: y(ref[c]), y2: y(ref[c]), class: `ref c${c}`}));
        }
        const pts = [];
        for (let i = 0; i < rowSteps.length; i += stride) {
          pts.push(`${x(rowSteps[i].tile).toFixed(1)},${y(rowSteps[i].estimate[c]).toFixed(1)}`);
        }
        const lastStep = rowSteps[rowSteps.length - 1];
        if (lastStep && (rowSteps.length - 1) % stride) {
          pts.push(`${x(lastStep.tile).toFixed(1)},${y(lastStep.estimate[c]).toFixed(1)}`);
        }
        nodes.push(svg('polyline', {points: pts.join(' '), class: `est c${c}`}));
        nodes.push(svg('text', {x: W - R - (comps - 1 - c) * 26, y: H - 6,
                                'text-anchor': 'end', class: `legend key c${c}`}, `c${c}`));
      }
      const marker = svg('line', {y1: T, y2: H - B, class: 'marker'});
      nodes.push(marker);
      chart.replaceChildren(...nodes);
      cache = state.chartCache = {key, count, withRef: !!ref, x, marker};
    }
    cache.marker.setAttribute('x1', cache.x(tile));
    cache.marker.setAttribute('x2', cache.x(tile));
  }

  // One backend's ResponseStats as the "Server stats" line shows it.
  function statsText(name, stats) {
    if (!stats) return `${name}: —`;
    const ms = (num(stats.computeNs) / 1e6).toFixed(3);
    return `${name}: ${num(stats.intermediateBytes)} B intermediate, ` +
           `${num(stats.scratchBytes)} B scratch, ${num(stats.peakMemoryBytes)} B peak, ` +
           `${ms} ms on ${stats.backend || '?'}`;
  }

  (globalThis.AttnViewer ??= {}).drawTrace = {HIDDEN, MAX_COMPONENTS, drawKeyBand, drawIdea1,
                                              drawBytes, drawStep, statsText};
})();
