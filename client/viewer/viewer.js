// attnd's web viewer: the explainer's three ideas drawn from the server's own numbers.
//
// Inputs are built here (the seed example's formulas or a seeded random problem) in float32 and
// sent as AttentionRequest JSON (protobuf's JSON mapping) to the gateway's /v1/naive, /v1/tiled
// and /v1/trace (with "keys in a KV cache", the keys and values go once into a server-resident
// cache, /v1/caches, and the three calls send only the queries and its id). The trace answers
// text/event-stream, one TraceEvent JSON per `data:` line; it is
// read with fetch() and a stream reader (EventSource cannot POST). Every event is kept in an
// array and only the current step is drawn, so thousands of steps stay cheap.
//
// The merge of key slices (section #merge, "Idea 3 × servers") shows either a file written by
// `attn trace --shard-keys --json` or "Split and merge": one trace per slice of the keys from this
// page's server, merged here with the rule of OnlineSoftmaxRow::Merge.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const MAX_ELEMENTS = 1 << 22;   // per input tensor; beyond this the browser itself suffers
  const MAX_TABLE_KEYS = 32;      // idea 1 lists at most this many keys (the heaviest)
  const MAX_IDEA1_COMPONENTS = 4; // value components shown in idea 1, as in the explainer
  const MAX_COMPONENTS = 16;      // columns of value/accumulator shown
  const TIE_COLOURS = ['#f6c85f', '#9dd866', '#6fb7f2', '#f28e8e', '#c89df2', '#f2b56f',
                       '#7fdcd0', '#e0a3c8'];

  // ---------------------------------------------------------------------------------------------
  // Protobuf JSON mapping: floats may be "Infinity", "-Infinity" or "NaN"; int64 may be strings;
  // fields equal to their default are omitted.
  function num(x) {
    if (x === undefined || x === null) return 0;
    if (typeof x === 'number') return x;
    if (x === 'Infinity') return Infinity;
    if (x === '-Infinity') return -Infinity;
    if (x === 'NaN') return NaN;
    return Number(x);
  }
  const nums = (a) => (a || []).map(num);

  function fmt(x, digits = 4) {
    if (x === -Infinity) return '−∞';
    if (x === Infinity) return '∞';
    if (Number.isNaN(x)) return 'NaN';
    if (x === 0) return '0';
    const a = Math.abs(x);
    if (a >= 1e5 || a < Math.pow(10, -digits)) return x.toExponential(3).replace('-', '−');
    return x.toFixed(digits).replace('-', '−');
  }
  const fmtVector = (v, digits) => '[' + Array.from(v, (x) => fmt(x, digits)).join(', ') + ']';

  function fmtBytes(b) {
    const units = ['KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
    let s = `${b} bytes`;
    if (b >= 1024) {
      let x = b / 1024, u = 0;
      while (x >= 1024 && u < units.length - 1) { x /= 1024; ++u; }
      s += ` (${x.toPrecision(3)} ${units[u]})`;
    }
    return s;
  }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') e.className = v;
      else if (k === 'style') e.style.cssText = v;
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---------------------------------------------------------------------------------------------
  // Problems.
  function mulberry32(seed) {
    let a = seed >>> 0;
    return () => {
      a = (a + 0x6d2b79f5) >>> 0;
      let t = a;
      t = Math.imul(t ^ (t >>> 15), t | 1);
      t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  // Returns {queryLen, keyLen, d, q, k, v}: q in row-major [queryLen, d], k and v [keyLen, d], as
  // Float32Arrays (queryLen = keyLen = N unless the sequences set them; a ragged batch's rows and
  // keys are packed, and the seed's formulas run over the packed indices).
  function buildProblem(cfg) {
    const {queryLen, keyLen, d, multiplier} = cfg;
    const q = new Float32Array(queryLen * d);
    const k = new Float32Array(keyLen * d), v = new Float32Array(keyLen * d);
    if (cfg.example === 'seed') {
      for (let i = 0; i < queryLen; ++i) {
        for (let j = 0; j < d; ++j) q[i * d + j] = (((i + j) % 5) - 2) * multiplier;
      }
      for (let i = 0; i < keyLen; ++i) {
        for (let j = 0; j < d; ++j) {
          k[i * d + j] = (((2 * i + j) % 7) - 3) / 2;
          v[i * d + j] = ((i + j) % 9) - 4;
        }
      }
    } else {
      const rand = mulberry32(cfg.randomSeed);
      const normal = () => {
        const u = 1 - rand(), w = rand();
        return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * w);
      };
      for (let i = 0; i < q.length; ++i) q[i] = normal() * multiplier;
      for (let i = 0; i < k.length; ++i) k[i] = normal();
      for (let i = 0; i < v.length; ++i) v[i] = normal();
    }
    return {queryLen, keyLen, d, q, k, v};
  }

  function base64Float32(values) {
    const bytes = new Uint8Array(values.length * 4);
    const view = new DataView(bytes.buffer);
    values.forEach((x, i) => view.setFloat32(i * 4, x, true));  // little-endian on the wire
    let binary = '';
    for (let i = 0; i < bytes.length; i += 0x8000) {
      binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(binary);
  }

  function decodeTensor(t) {
    if (!t || !t.data) return null;
    const binary = atob(t.data);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; ++i) bytes[i] = binary.charCodeAt(i);
    const view = new DataView(bytes.buffer);
    const out = new Float32Array(bytes.length / 4);
    for (let i = 0; i < out.length; ++i) out[i] = view.getFloat32(i * 4, true);
    return {shape: (t.shape || []).map(num), data: out};
  }

  function attentionRequest(problem, cfg) {
    const tensor = (data, rows) => ({shape: [rows, problem.d], dtype: 'DTYPE_FLOAT32',
                                     data: base64Float32(data)});
    const body = {
      query: tensor(problem.q, problem.queryLen),
      key: tensor(problem.k, problem.keyLen),
      value: tensor(problem.v, problem.keyLen),
      // No scale: the server's default 1/sqrt(d), the seed's `/ d**0.5`.
      options: maskOptions(cfg, {causal: cfg.causal, blockK: cfg.blockK, returnLse: true}),
    };
    // A ragged batch: the sequences' cumulative lengths, at the request's level.
    if (cfg.sequences) {
      body.cuSeqlensQ = cfg.sequences.cuQ;
      body.cuSeqlensK = cfg.sequences.cuK;
    }
    return body;
  }

  // The window, softcap and ALiBi of the form, added to an options object (AttentionOptions
  // JSON): windowLeft/windowRight only when bounded, softcap only when on, alibiSlopes only with
  // "standard slopes" (the page's problems have one head).
  function maskOptions(cfg, options) {
    if (cfg.windowLeft !== null) options.windowLeft = cfg.windowLeft;
    if (cfg.windowRight !== null) options.windowRight = cfg.windowRight;
    if (cfg.softcap > 0) options.softcap = cfg.softcap;
    if (cfg.alibi) options.alibiSlopes = standardAlibiSlopes(1);
    return options;
  }

  // The standard ALiBi slopes for H heads (attn::client::StandardAlibiSlopes): 2^(−8(h+1)/H) for
  // a power of two; otherwise the n = 2^floor(log2 H) slopes 2^(−8(h+1)/n), then
  // 2^(−8(2i+1)/(2n)) for i = 0, 1, … for the heads past n.
  function standardAlibiSlopes(heads) {
    const n = Math.pow(2, Math.floor(Math.log2(heads)));
    const slopes = [];
    for (let h = 0; h < n; ++h) slopes.push(Math.pow(2, (-8 * (h + 1)) / n));
    for (let i = 0; slopes.length < heads; ++i) slopes.push(Math.pow(2, (-8 * (2 * i + 1)) / (2 * n)));
    return slopes;
  }

  // TileStep.hidden as the gateway prints it (enum names; numbers accepted too): 'causal',
  // 'window', 'sequence' or '' (seen).
  function hiddenName(x) {
    if (x === 'HIDDEN_CAUSAL' || x === 1) return 'causal';
    if (x === 'HIDDEN_WINDOW' || x === 2) return 'window';
    if (x === 'HIDDEN_SEQUENCE' || x === 3) return 'sequence';
    return '';
  }

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

  // The keys' side of query row `row` (kernels/geometry.h): its sequence's keys [first, end), and
  // p, the row's position counted from key `first` (key j is then at j − first). One sequence:
  // all the keys, p = query_position + row − key_position, index null. A ragged batch: the last
  // sequence s with cu_seqlens_q[s] ≤ row, whose keys sit at 0 … and queries bottom-right.
  function sequenceOf(start, row) {
    const cq = start.cuSeqlensQ, ck = start.cuSeqlensK;
    if (cq.length < 2) {
      return {index: null, first: 0, end: start.keyLen,
              p: start.queryPosition + row - start.keyPosition};
    }
    let s = 0;
    while (s + 1 < cq.length - 1 && cq[s + 1] <= row) ++s;
    return {index: s, count: cq.length - 1, rowBegin: cq[s], rowEnd: cq[s + 1],
            first: ck[s], end: ck[s + 1], p: (ck[s + 1] - ck[s]) - (cq[s + 1] - cq[s]) + (row - cq[s])};
  }

  // The geometry sequenceOf and hiddenByGeometry read (TraceStart's fields) of one sequence of
  // keyLen keys: causal, the window (null: unbounded) and the positions; no ragged batch.
  function oneSequence({keyLen, causal, windowLeft = null, windowRight = null, keyPosition = 0,
                        queryPosition = 0}) {
    return {keyLen, causal: !!causal, windowLeft, windowRight, keyPosition, queryPosition,
            cuSeqlensQ: [], cuSeqlensK: []};
  }

  // What hides key j from the row of `seq` (sequenceOf) by the trace's geometry, for keys no step
  // carries (tiles the mask hides entirely are not traced): another sequence, then causal, then
  // the window, as the server decides.
  function hiddenByGeometry(start, seq, j) {
    if (j < seq.first || j >= seq.end) return 'sequence';
    const p = seq.p, t = j - seq.first;
    if (start.causal && t > p) return 'causal';
    if (start.windowLeft !== null && t < p - start.windowLeft) return 'window';
    if (start.windowRight !== null && t > p + start.windowRight) return 'window';
    return '';
  }

  // The window of the row of `seq` as a key range [lo, hi] (key indices, clipped to its
  // sequence's keys), or null when unbounded on both sides.
  function windowRange(start, seq) {
    if (!start || (start.windowLeft === null && start.windowRight === null)) return null;
    const lo = start.windowLeft === null ? seq.first
                                         : Math.max(seq.first, seq.first + seq.p - start.windowLeft);
    const hi = start.windowRight === null ? seq.end - 1
                                          : Math.min(seq.end - 1, seq.first + seq.p + start.windowRight);
    return {lo, hi};
  }

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
  // Talking to the gateway.
  function serverBase() {
    const s = $('server').value.trim().replace(/\/+$/, '');
    return s || location.origin;
  }
  function headers(json) {
    const h = {};
    if (json) h['Content-Type'] = 'application/json';
    const token = $('token').value.trim();
    if (token) h.Authorization = `Bearer ${token}`;
    return h;
  }

  // An error to show on the page: `path` is the endpoint, `detail` what went wrong there.
  class ServerError extends Error {
    constructor(path, detail) {
      super(`${path} → ${detail}`);
      this.path = path;
      this.detail = detail;
    }
  }

  async function httpError(path, response) {
    const text = await response.text().catch(() => '');
    let detail = text.trim() || response.statusText;
    try {
      const body = JSON.parse(text);
      if (body && (body.code || body.message)) detail = `${body.code || ''}: ${body.message || ''}`;
    } catch (e) { /* not JSON: show the text as it came */ }
    return new ServerError(path, `HTTP ${response.status} ${detail}`);
  }

  async function request(path, body, signal, method) {
    let response;
    try {
      response = await fetch(serverBase() + path, {
        method: method || (body === undefined ? 'GET' : 'POST'),
        headers: headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
      });
    } catch (e) {
      if (e.name === 'AbortError') throw e;
      throw new ServerError(path, `could not reach ${serverBase()} (${e.message}). Check the ` +
                            'gateway address, and that its CORS setting allows this page.');
    }
    if (!response.ok) throw await httpError(path, response);
    return response;
  }

  // "keys in a KV cache": a server-resident cache holding the problem's keys and values
  // (POST /v1/caches, then one append), and the request over it: only the queries and its id.
  // The causal mask stays bottom-right against the cache's length, N, so the answers are the
  // stateless request's.
  async function cacheRequest(body, problem, signal) {
    const created = await (await request('/v1/caches', {
      kvHeads: 1, headDim: problem.d, valueDim: problem.d, dtype: 'DTYPE_FLOAT32'}, signal)).json();
    const cacheId = created.cacheId;
    try {
      await request(`/v1/caches/${cacheId}/append`,
                    {key: body.key, value: body.value, expectedLength: 0}, signal);
    } catch (e) {
      request(`/v1/caches/${cacheId}`, undefined, undefined, 'DELETE').catch(() => {});
      throw e;
    }
    return {cacheId, body: {query: body.query, cacheId, options: body.options}};
  }

  // Reads a text/event-stream body, calling onEvent(parsed JSON) for each event's data.
  async function readEventStream(path, response, onEvent) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '', data = [], type = '';
    const dispatch = () => {
      if (data.length === 0) { type = ''; return; }
      const text = data.join('\n');
      data = [];
      let parsed;
      try { parsed = JSON.parse(text); } catch (e) {
        throw new ServerError(path, `an event that is not JSON: ${text.slice(0, 200)}`);
      }
      const isError = type === 'error' ||
          (parsed && !parsed.start && !parsed.step && !parsed.rowDone && !parsed.end &&
           (parsed.code || parsed.message));
      type = '';
      if (isError) {
        throw new ServerError(`${path} (stream)`, `${parsed.code || 'error'}: ${parsed.message || text}`);
      }
      onEvent(parsed);
    };
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      let start = 0, nl;
      while ((nl = buffer.indexOf('\n', start)) >= 0) {
        let line = buffer.slice(start, nl);
        start = nl + 1;
        if (line.endsWith('\r')) line = line.slice(0, -1);
        if (line === '') { dispatch(); continue; }
        if (line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? '' : line.slice(colon + 1);
        if (val.startsWith(' ')) val = val.slice(1);
        if (field === 'data') data.push(val);
        else if (field === 'event') type = val;
      }
      buffer = buffer.slice(start);
    }
    dispatch();
  }

  // ---------------------------------------------------------------------------------------------
  // State of one run.
  const state = {
    abort: null,
    problem: null,
    cfg: null,
    start: null,      // TraceStart
    steps: [],        // TileStep, as parsed
    rowDone: new Map(),  // row key → RowDone, as parsed
    lastStepOfRow: new Map(),  // row key → index into steps
    end: null,
    streamDone: false,
    naive: null,      // {output, lse, stats}
    tiled: null,
    pos: 0,
    playing: false,
    chartCache: null,
  };
  const rowKey = (r) => `${num(r && r.batch)}/${num(r && r.head)}/${num(r && r.row)}`;

  function showError(message) {
    const box = $('error');
    box.hidden = false;
    box.append(el('div', {}, message));
  }
  function clearError() { $('error').hidden = true; $('error').replaceChildren(); }
  function setStatus(text) { $('status').textContent = text; }

  // Whether the form's problem can be built here; if not, says why (showError).
  function configIsUsable(cfg) {
    const ragged = cfg.sequences;
    if (ragged && ragged.error) { showError(ragged.error); return false; }
    if (ragged && cfg.useCache) {
      showError('Sequences and "keys in a KV cache" do not mix: a cache holds one sequence ' +
                '(clear one of them).');
      return false;
    }
    if (!(ragged || cfg.n >= 1) || !(cfg.d >= 1)) {
      showError('N and d must be at least 1.');
      return false;
    }
    const rows = Math.max(cfg.queryLen, cfg.keyLen);
    if (rows * cfg.d > MAX_ELEMENTS) {
      showError(`${ragged ? 'The sequences\' longer total' : 'N'} × d = ${rows * cfg.d} is more ` +
                `than this page builds (${MAX_ELEMENTS}).`);
      return false;
    }
    if (!Number.isFinite(cfg.multiplier)) {
      showError('The query multiplier must be a number.');
      return false;
    }
    for (const [name, value] of [['Window left', cfg.windowLeft], ['Window right', cfg.windowRight]]) {
      if (value !== null && !(Number.isInteger(value) && value >= 0 && value <= Math.pow(2, 53))) {
        showError(`${name} must be a whole number ≥ 0, or empty for unbounded.`);
        return false;
      }
    }
    if (!(Number.isFinite(cfg.softcap) && cfg.softcap >= 0)) {
      showError('Softcap must be a finite number ≥ 0 (0 turns it off).');
      return false;
    }
    return true;
  }

  // A number input's value: null when empty, NaN when the browser cannot read it as a number.
  function optionalNumber(id) {
    const input = $(id);
    if (input.value.trim() === '') return input.validity && input.validity.badInput ? NaN : null;
    return Number(input.value);
  }

  // The "Sequences" field: null when empty (one sequence of N); else query lengths / key lengths,
  // "5,1,10 / 7,1,8" (one list: the same lengths for both), as {q, k} lengths, their cumulative
  // cuQ, cuK (AttentionRequest.cu_seqlens_q/k) and sums queryLen, keyLen, which replace N; or
  // {error}, which configIsUsable shows.
  function parseSequences(text) {
    if (text.trim() === '') return null;
    const fail = (why) => ({error: `Sequences: ${why} Write query lengths / key lengths, e.g. ` +
                                   '5,1,10 / 7,1,8 (one list: the same for both; empty: one sequence).'});
    const sides = text.split('/');
    if (sides.length > 2) return fail(`"${text.trim()}" has ${sides.length - 1} "/"; one at most.`);
    const lists = [];
    for (const [i, side] of sides.entries()) {
      const what = sides.length === 1 ? 'length' : i === 0 ? 'query length' : 'key length';
      if (side.trim() === '') {
        return fail(`no ${what}s${sides.length > 1 ? ` ${i ? 'after' : 'before'} the "/"` : ''}.`);
      }
      const lengths = [];
      for (const item of side.trim().split(/\s*,\s*|\s+/)) {
        if (!/^\d+$/.test(item)) {
          return fail(item === '' ? `an empty ${what} (two commas in a row, or a comma at an end).`
                                  : `${what} "${item}" is not a whole number ≥ 0.`);
        }
        if (!Number.isSafeInteger(Number(item))) return fail(`${what} ${item} is too large.`);
        lengths.push(Number(item));
      }
      lists.push(lengths);
    }
    const [q, k = q] = lists;
    if (q.length !== k.length) {
      return fail(`${q.length} query length(s) but ${k.length} key length(s); give both for each ` +
                  'sequence.');
    }
    const cumulative = (lengths) => lengths.reduce((cu, x) => [...cu, cu[cu.length - 1] + x], [0]);
    const cuQ = cumulative(q), cuK = cumulative(k);
    const queryLen = cuQ[cuQ.length - 1], keyLen = cuK[cuK.length - 1];
    if (queryLen < 1) return fail('the query lengths add up to 0; a trace needs a query row.');
    if (keyLen < 1) return fail('the key lengths add up to 0; at least one key is needed.');
    return {q, k, cuQ, cuK, queryLen, keyLen};
  }

  function readConfig() {
    const int = (id) => Math.trunc(Number($(id).value));
    const n = int('n');
    const sequences = parseSequences($('sequences').value);
    const sized = sequences && !sequences.error;
    return {
      example: $('example').value,
      n,
      // The problem's query rows and keys: N each, or the sequences' sums.
      queryLen: sized ? sequences.queryLen : n,
      keyLen: sized ? sequences.keyLen : n,
      sequences,
      d: int('d'),
      blockK: int('block-k'),
      multiplier: Number($('multiplier').value),
      causal: $('causal').checked,
      row: int('row'),
      randomSeed: int('random-seed'),
      useCache: $('use-cache').checked,
      // Empty = unbounded (null); otherwise the number as typed, checked by configIsUsable.
      windowLeft: optionalNumber('window-left'),
      windowRight: optionalNumber('window-right'),
      softcap: $('softcap').value.trim() === '' ? 0 : Number($('softcap').value),
      alibi: $('alibi').checked,
    };
  }

  function describeProblem() {
    const cfg = readConfig();
    document.body.classList.toggle('random', cfg.example === 'random');
    $('problem-note').textContent = cfg.example === 'seed'
      ? 'Seed: q[i][j] = ((i + j) % 5 − 2) · multiplier, k[i][j] = ((2i + j) % 7 − 3) / 2, ' +
        'v[i][j] = (i + j) % 9 − 4, scale 1/√d (1/2 at d = 4). The seed is 8 × 4; other sizes ' +
        'extend its formulas.'
      : `Random: q, k, v drawn from N(0, 1) with seed ${cfg.randomSeed} (q × multiplier), ` +
        'scale 1/√d.';
    const ragged = cfg.sequences;
    if (ragged) {
      $('problem-note').textContent += ragged.error ? ` ${ragged.error}`
        : ` Ragged batch: ${ragged.q.length} sequence(s), query rows ${ragged.q.join(', ')} and ` +
          `keys ${ragged.k.join(', ')}: ${cfg.queryLen} query rows and ${cfg.keyLen} keys packed ` +
          '(in place of N); each sequence sees only its own keys, its queries bottom-right ' +
          'against them.';
    }
    drawBytes(cfg, null);
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

  function drawIdea1() {
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
    const hidden = Array.from({length: n}, (_, j) => hiddenByGeometry(start, seq, j));
    const alibi = start.alibiSlopes.length > 0;
    const slope = alibi ? start.alibiSlopes[0] : 0;
    const biases = Array.from({length: n},
                              (_, j) => (alibi ? Math.fround(-slope * Math.abs(seq.p - (j - seq.first))) : NaN));
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
    const weights = Array.from(scores, (s) => (done.lse === -Infinity ? 0 : Math.exp(s - done.lse)));
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
      tr.append(sc, el('td', {class: 'weight'}, el('span', {class: 'barbox'}, bar), ' ', fmt(w)));
      for (let c = 0; c < dc; ++c) tr.append(el('td', {class: 'v'}, fmt(p.v[j * d + c], 2)));
      for (let c = 0; c < dc; ++c) tr.append(el('td', {}, fmt(w * p.v[j * d + c])));
      body.append(tr);
    }
    rows.push(body);
    const result = new Float64Array(dc);
    for (let j = 0; j < n; ++j) for (let c = 0; c < dc; ++c) result[c] += weights[j] * p.v[j * d + c];
    const foot = el('tr', {}, el('th', {colspan: 3 + extra + dc},
                                 n > keys.length ? `Σ over all ${n} keys (${n - keys.length} not listed)`
                                                 : 'Σ over keys = weighted result'));
    for (let c = 0; c < dc; ++c) foot.append(el('th', {}, fmt(result[c])));
    rows.push(el('tfoot', {}, foot));
    const ties = new Set(colour.values()).size;
    rows.unshift(el('caption', {},
                    `lse = ${fmt(done.lse)}; ` + maskCaption(start, range, seq) +
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
  // Idea 3: the current step.
  function referenceFor(key) {
    const done = state.rowDone.get(key);
    if (done) return done.reference;
    if (state.naive && state.naive.output) {
      const row = Number(key.split('/')[2]);
      const vd = state.naive.output.shape.at(-1);
      return Array.from(state.naive.output.data.slice(row * vd, row * vd + vd));
    }
    return null;
  }

  let drawQueued = false;
  function scheduleDraw() {
    if (drawQueued) return;
    drawQueued = true;
    requestAnimationFrame(() => { drawQueued = false; drawStep(); });
  }

  function drawStep() {
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
      const hiddenRow = Array.from({length: n}, (_, j) => hiddenByGeometry(start, seq, j));
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
    const ref = referenceFor(key);
    const dc = Math.min(s.accumulator.length, MAX_COMPONENTS);
    const accRows = [el('thead', {}, el('tr', {}, el('th', {}, 'c'), el('th', {}, 'previous × rescale'),
                                             el('th', {}, '+ tile Σ w·v'), el('th', {}, '= accumulator'),
                                             el('th', {}, 'estimate'), el('th', {}, 'full-matrix'),
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
    drawConvergence(key, s.tile, ref);

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
      $('reference-output').textContent = ref ? fmtVector(ref, 6) : '—';
      $('max-error').textContent = '—';
    }
  }

  // The estimate of each of the first few components against the tile index, for one row; the
  // polylines are rebuilt only when that row gains steps, the marker moves every step.
  function drawConvergence(key, tile, ref) {
    const chart = $('converge-chart');
    const W = 420, H = 180, L = 44, R = 10, T = 10, B = 22;
    let cache = state.chartCache;
    const count = state.steps.length;
    if (!cache || cache.key !== key || cache.count !== count) {
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
                     'tile → estimate (dashed: full-matrix result)'));
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
      cache = state.chartCache = {key, count, x, marker};
    }
    cache.marker.setAttribute('x1', cache.x(tile));
    cache.marker.setAttribute('x2', cache.x(tile));
  }

  // The speed slider is logarithmic: 1, 2, 4, … 1024 steps per second.
  function stepsPerSecond() { return Math.pow(2, Number($('speed').value)); }
  function showSpeed() { $('speed-value').textContent = `${stepsPerSecond()}/s`; }

  // Moves to a step and draws it now, so the controls are current before the next input.
  function goTo(pos) {
    state.pos = Math.max(0, Math.min(pos, state.steps.length - 1));
    drawStep();
  }

  // Play: advances `speed` steps per second; waits at the end while the stream still runs.
  let lastTick = 0, carry = 0;
  function tick(now) {
    if (!state.playing) return;
    const speed = stepsPerSecond();
    carry += ((now - lastTick) / 1000) * speed;
    lastTick = now;
    const advance = Math.floor(carry);
    if (advance > 0) {
      carry -= advance;
      if (state.pos < state.steps.length - 1) {
        goTo(state.pos + advance);
      } else if (state.streamDone || !state.abort) {
        pause();
        return;
      }
    }
    requestAnimationFrame(tick);
  }
  function play() {
    if (state.playing || state.steps.length === 0) return;
    if (state.pos >= state.steps.length - 1 && state.streamDone) state.pos = 0;
    state.playing = true;
    lastTick = performance.now();
    carry = 1;  // move at once
    requestAnimationFrame(tick);
    scheduleDraw();
  }
  function pause() { state.playing = false; drawStep(); }

  // ---------------------------------------------------------------------------------------------
  // A run: Naive and Tiled for the result and stats, Trace for the steps.
  function onTraceEvent(e) {
    if (e.start) {
      const s = e.start;
      state.start = {
        queryLen: num(s.queryLen), keyLen: num(s.keyLen), headDim: num(s.headDim),
        valueDim: num(s.valueDim), blockK: num(s.blockK), scale: num(s.scale), causal: !!s.causal,
        naiveBytes: num(s.naiveIntermediateBytes), perRowFloats: num(s.tiledScratchFloatsPerRow),
        tilesPerRow: num(s.tilesPerRow),
        keyPosition: num(s.keyPosition), queryPosition: num(s.queryPosition),
        windowLeft: s.windowLeft === undefined || s.windowLeft === null ? null : num(s.windowLeft),
        windowRight: s.windowRight === undefined || s.windowRight === null ? null : num(s.windowRight),
        softcap: num(s.softcap), alibiSlopes: nums(s.alibiSlopes),
        // A ragged batch's cumulative lengths (empty: one sequence).
        cuSeqlensQ: nums(s.cuSeqlensQ), cuSeqlensK: nums(s.cuSeqlensK),
      };
      const sequences = Math.max(0, state.start.cuSeqlensQ.length - 1);
      drawBytes(state.cfg, state.start);
      setStatus(`Trace started: N = ${state.start.keyLen}, d = ${state.start.headDim}, ` +
                `block_k = ${state.start.blockK}, scale = ${fmt(state.start.scale, 6)}, ` +
                `${state.start.tilesPerRow} tiles per row` +
                (sequences ? `, ${sequences} sequences packed.` : '.'));
    } else if (e.step) {
      const s = e.step;
      const step = {
        row: s.row || {}, tile: num(s.tile), keyBegin: num(s.keyBegin), keyEnd: num(s.keyEnd),
        scores: nums(s.scores), maxBefore: num(s.maxBefore), maxAfter: num(s.maxAfter),
        rescale: num(s.rescale), weights: nums(s.weights), denominator: num(s.denominator),
        accumulator: nums(s.accumulator), estimate: nums(s.estimate),
        scaledScores: nums(s.scaledScores), biases: nums(s.biases),
        hidden: (s.hidden || []).map(hiddenName),
      };
      state.steps.push(step);
      state.lastStepOfRow.set(rowKey(step.row), state.steps.length - 1);
      if ($('follow').checked) state.pos = state.steps.length - 1;
      scheduleDraw();
    } else if (e.rowDone) {
      const r = e.rowDone;
      state.rowDone.set(rowKey(r.row), {
        output: nums(r.output), reference: nums(r.reference), maxAbsError: num(r.maxAbsError),
        lse: num(r.lse),
      });
      drawIdea1();
      scheduleDraw();
    } else if (e.end) {
      state.end = e.end;
      state.streamDone = true;
      setStatus(`Trace complete: ${state.steps.length} steps` +
                (state.naive && state.tiled ? '.' : '; waiting for Naive and Tiled…'));
      scheduleDraw();
    }
  }

  function statsText(name, stats) {
    if (!stats) return `${name}: —`;
    const ms = (num(stats.computeNs) / 1e6).toFixed(3);
    return `${name}: ${num(stats.intermediateBytes)} B intermediate, ` +
           `${num(stats.scratchBytes)} B scratch, ${num(stats.peakMemoryBytes)} B peak, ` +
           `${ms} ms on ${stats.backend || '?'}`;
  }

  async function run(event) {
    if (event) event.preventDefault();
    if (state.abort) state.abort.abort();
    clearError();
    pause();
    const cfg = readConfig();
    if (!configIsUsable(cfg)) return;
    const abort = new AbortController();
    Object.assign(state, {
      abort, cfg, problem: buildProblem(cfg), start: null, steps: [], rowDone: new Map(),
      lastStepOfRow: new Map(), end: null, streamDone: false, naive: null, tiled: null, pos: 0,
      chartCache: null,
    });
    $('naive-output').textContent = '—';
    $('server-stats').textContent = '—';
    $('score-table').replaceChildren();
    $('idea1-band').replaceChildren();
    $('tile-band').replaceChildren();
    drawBytes(cfg, null);
    scheduleDraw();
    setStatus('Running…');
    const signal = abort.signal;
    let body = attentionRequest(state.problem, cfg);
    let cacheId = null;
    if (cfg.useCache) {
      try {
        ({cacheId, body} = await cacheRequest(body, state.problem, signal));
      } catch (e) {
        if (e.name === 'AbortError' || state.abort !== abort) return;
        state.abort = null;
        showError(e.message);
        setStatus('Could not store the keys in a KV cache.');
        return;
      }
    }
    const unary = async (path) => {
      const response = await request(path, body, signal);
      const json = await response.json();
      return {output: decodeTensor(json.output), lse: decodeTensor(json.lse), stats: json.stats};
    };
    const failures = [];
    const guard = (p) => p.catch((e) => {
      if (e.name !== 'AbortError') failures.push(e);
      return null;
    });
    // The trace goes first so its steps start arriving at once; Naive and Tiled follow when it
    // has started (or failed), since a server admitting one computation at a time would
    // otherwise hold the stream behind them.
    let traceStarted;
    const started = new Promise((resolve) => { traceStarted = resolve; });
    const trace = guard((async () => {
      const rows = [{batch: 0, head: 0, row: cfg.row}];
      const response = await request('/v1/trace', {attention: body, rows}, signal);
      await readEventStream('/v1/trace', response, (e) => {
        if (state.abort !== abort) return;
        onTraceEvent(e);
        if (e.start) traceStarted();
      });
      if (!state.end) throw new ServerError('/v1/trace', 'the stream ended before its end event');
    })()).finally(traceStarted);
    await started;
    const naive = guard(unary('/v1/naive')).then((r) => {
      if (r && state.abort === abort) { state.naive = r; drawIdea1(); scheduleDraw(); }
    });
    const tiled = guard(unary('/v1/tiled')).then((r) => { if (r && state.abort === abort) state.tiled = r; });
    await Promise.all([naive, tiled, trace]);
    if (cacheId) {
      // The cache was this run's alone; a failure to delete it only leaves it to expire.
      await guard(request(`/v1/caches/${cacheId}`, undefined, undefined, 'DELETE'));
    }
    if (state.abort !== abort) return;  // a newer run took over
    state.streamDone = true;
    state.abort = null;
    $('server-stats').textContent =
        `${statsText('Naive', state.naive && state.naive.stats)}; ${statsText('Tiled', state.tiled && state.tiled.stats)}`;
    if (state.naive && state.naive.stats && !state.start) {
      drawBytes(cfg, {naiveBytes: num(state.naive.stats.intermediateBytes)});
    }
    // One line per distinct error, naming every endpoint that got it.
    const byDetail = new Map();
    for (const f of failures) {
      const detail = f.detail || f.message;
      byDetail.set(detail, [...(byDetail.get(detail) || []), f.path || '(page)']);
    }
    for (const [detail, paths] of byDetail) showError(`${paths.join(', ')} → ${detail}`);
    const steps = state.steps.length;
    setStatus(failures.length ? `Finished with ${failures.length} error(s); ${steps} steps received.`
                              : `Done: ${steps} steps received for row ${cfg.row}. Step through them below.`);
    drawIdea1();
    scheduleDraw();
  }

  // ---------------------------------------------------------------------------------------------
  // Idea 3 × servers: the merge of key slices. A merge model comes either from a file written by
  // `attn trace --shard-keys --json` (its JSON lines are documented in client/cli/merge_trace.h:
  // {"problem"}, then per row {"part"} lines, {"merge_step"} lines and {"merged"}) or from
  // "Split and merge": one /v1/trace per slice of this page's problem, each with its positions,
  // all answered by this page's server and merged here. Per traced row it holds each part's final
  // state and the merge steps; only the chosen row and step are drawn.
  const MAX_MERGE_PARTS = 8;  // the page's own split; a file may hold more
  const merge = {model: null, rowKey: null, pos: 0, abort: null, serial: 0};
  // Says what #merge shows now; data-serial counts the merges and failures shown (for scripts).
  function setMergeSource(text) {
    const source = $('merge-source');
    source.textContent = text;
    source.dataset.serial = String(++merge.serial);
  }

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
  // −slope · |p − t| (README "Softcap", "ALiBi": the server's order).
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
      scores.push([j, s - slope * Math.abs(seq.p - (j - seq.first))]);
    }
    const out = new Array(d).fill(0);
    if (scores.length === 0) return out;
    const max = Math.max(...scores.map(([, s]) => s));
    let sum = 0;
    scores.forEach(([j, s]) => {
      const w = Math.exp(s - max);
      sum += w;
      for (let c = 0; c < d; ++c) out[c] += w * v[j * d + c];
    });
    return out.map((x) => x / sum);
  }

  // A model from the JSON lines of `attn trace --shard-keys --json`.
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
    }
    const servers = [...new Set(rows.values().next().value.parts.map((p) => p.endpoint))];
    const label = problem.singleServer
      ? `${name}: one server (${servers[0]}) traced all of it — nothing to merge; its final ` +
        'state is the answer.'
      : `${name}: ${problem.parts} parts traced by ${servers.length} server(s): ${servers.join(', ')}.`;
    return {source: 'file', label, problem, rows};
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
    return what.length ? ` and the form's ${what.join(', ')}` : '';
  }

  // "Split and merge": this page's problem, its keys cut into contiguous slices, each traced by
  // this page's server with the form's options (causal, the window, the softcap and ALiBi slopes:
  // maskOptions, as the run sends them), key_position = the slice's first key and the whole
  // problem's query_position (0: n queries over n keys). The positions place the causal mask, the
  // window and the ALiBi distances of each slice as in the whole (the softcap is per score), so
  // each slice computes exactly its part; the states merged here. Every slice is sent, also one
  // the traced row cannot see: it comes back with no step and lse −∞, the empty state, which the
  // merge takes with factor 0. A ragged batch is refused: its sequences' positions are their own,
  // which one key_position per slice cannot give.
  async function splitAndMerge() {
    clearError();
    const cfg = readConfig();
    if (!configIsUsable(cfg)) return;
    if (cfg.sequences) {
      showError('Split and merge cuts one sequence\'s keys, each slice with its positions; a ragged ' +
                'batch takes none (each sequence has its own). Clear Sequences to split the keys.');
      return;
    }
    const problem = buildProblem(cfg);
    const n = problem.keyLen, d = problem.d;
    // The whole problem's options; each slice adds its positions.
    const options = maskOptions(cfg, {causal: cfg.causal, blockK: cfg.blockK, returnLse: true});
    const asked = Math.trunc(Number($('merge-parts').value)) || 1;
    const count = Math.max(1, Math.min(asked, MAX_MERGE_PARTS, n));
    const slices = [];
    for (let s = 0; s < count; ++s) {
      const a = Math.round((s * n) / count), b = Math.round(((s + 1) * n) / count);
      if (b > a) slices.push([a, b]);
    }
    if (merge.abort) merge.abort.abort();
    const abort = new AbortController();
    merge.abort = abort;
    const server = serverBase();
    $('merge-source').textContent = `Tracing ${slices.length} slice(s) of the keys on ${server}…`;
    const tensor = (data, rows) => ({shape: [rows, d], dtype: 'DTYPE_FLOAT32',
                                     data: base64Float32(data)});
    let traces;
    try {
      traces = await Promise.all(slices.map(async ([a, b], i) => {
        const path = `/v1/trace (part ${i + 1}, keys [${a}, ${b}))`;
        const attention = {
          query: tensor(problem.q, n),
          key: tensor(problem.k.subarray(a * d, b * d), b - a),
          value: tensor(problem.v.subarray(a * d, b * d), b - a),
          options: {...options, keyPosition: a, queryPosition: 0},
        };
        const events = {start: null, steps: [], done: null, end: null};
        try {
          const response = await request('/v1/trace',
                                         {attention, rows: [{batch: 0, head: 0, row: cfg.row}]},
                                         abort.signal);
          await readEventStream(path, response, (e) => {
            if (e.start) events.start = e.start;
            else if (e.step) events.steps.push(e.step);
            else if (e.rowDone) events.done = e.rowDone;
            else if (e.end) events.end = e.end;
          });
        } catch (e) {
          if (e.name === 'AbortError') throw e;
          throw new ServerError(path, e.detail || e.message);
        }
        if (!events.end || !events.done) {
          throw new ServerError(path, 'the stream ended before the row was done');
        }
        return events;
      }));
    } catch (e) {
      if (e.name === 'AbortError' || merge.abort !== abort) return;
      merge.abort = null;
      showError(e.message);
      setMergeSource('The split trace failed: no merge (never a partial one).');
      return;
    }
    if (merge.abort !== abort) return;
    merge.abort = null;
    const parts = traces.map((t, i) => {
      const [a, b] = slices[i];
      const last = t.steps.length ? t.steps[t.steps.length - 1] : null;
      const state = {
        index: i, endpoint: server, keyBegin: a, keyEnd: b, keyPosition: a, queryPosition: 0,
        steps: t.steps.length,
        max: last ? num(last.maxAfter) : -Infinity,           // no step: the empty state
        denominator: last ? num(last.denominator) : 0,
        accumulator: last ? nums(last.accumulator) : new Array(d).fill(0),
        lse: num(t.done.lse),
      };
      state.estimate = normalize(state.accumulator, state.denominator);
      return state;
    });
    const reference = referenceRow(problem, cfg.row, options);
    const steps = mergeSteps(parts, reference);
    const output = steps[steps.length - 1].estimate;
    const row = {batch: 0, head: 0, row: cfg.row};
    const model = {
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
                windowLeft: cfg.windowLeft, windowRight: cfg.windowRight},
      rows: new Map([[rowKey(row), {
        row, parts, steps,
        merged: {output, reference, maxAbsError: maxAbsDiff(output, reference),
                 rowDoneMaxAbsDiff: NaN},
        recomputed: 0,
      }]]),
    };
    showMerge(model);
  }

  async function loadMergeFile(file) {
    if (!file) return;
    clearError();
    try {
      showMerge(modelFromLines(await file.text(), file.name));
    } catch (e) {
      showError(`${file.name}: ${e.message}`);
      setMergeSource(`Could not load ${file.name}.`);
    }
  }

  function showMerge(model) {
    merge.model = model;
    merge.pos = 0;
    const select = $('merge-row');
    select.replaceChildren(...[...model.rows.entries()].map(([key, r]) =>
      el('option', {value: key}, `batch ${r.row.batch}, head ${r.row.head}, query ${r.row.row}`)));
    select.disabled = model.rows.size < 2;
    merge.rowKey = model.rows.keys().next().value;
    select.value = merge.rowKey;
    drawMerge();
    setMergeSource(model.label);
  }

  // What hides each of the whole problem's keys from traced row `r` (a row index): 'causal',
  // 'window' or '' (seen), by the trace's rule from the whole request's positions and window.
  function mergeHidden(problem, r) {
    const geometry = oneSequence(problem);
    const seq = sequenceOf(geometry, r);
    return Array.from({length: problem.keyLen}, (_, j) => hiddenByGeometry(geometry, seq, j));
  }
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
    let lo = Infinity, hi = -Infinity;
    for (const s of row.steps) {
      for (let c = 0; c < comps; ++c) {
        if (Number.isFinite(s.estimate[c])) { lo = Math.min(lo, s.estimate[c]); hi = Math.max(hi, s.estimate[c]); }
      }
    }
    for (let c = 0; c < comps; ++c) { lo = Math.min(lo, ref[c]); hi = Math.max(hi, ref[c]); }
    if (!(hi > lo)) { lo -= 1; hi += 1; }
    const count = row.steps.length;
    const x = (i) => L + (count <= 1 ? 0.5 : i / (count - 1)) * (W - L - R);
    const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
    const nodes = [svg('rect', {x: L, y: T, width: W - L - R, height: H - T - B, class: 'plot'})];
    nodes.push(svg('text', {x: L - 4, y: T + 8, class: 'tick', 'text-anchor': 'end'}, fmt(hi, 2)));
    nodes.push(svg('text', {x: L - 4, y: H - B, class: 'tick', 'text-anchor': 'end'}, fmt(lo, 2)));
    nodes.push(svg('text', {x: L, y: H - 6, class: 'axis'},
                   'merge step → estimate (dashed: full matrix)'));
    for (let c = 0; c < comps; ++c) {
      nodes.push(svg('line', {x1: L, x2: W - R, y1: y(ref[c]), y2: y(ref[c]), class: `ref c${c}`}));
      const pts = row.steps.map((s, i) => `${x(i).toFixed(1)},${y(s.estimate[c]).toFixed(1)}`);
      nodes.push(svg('polyline', {points: pts.join(' '), class: `est c${c}`}));
      nodes.push(svg('text', {x: W - R - (comps - 1 - c) * 26, y: H - 6, 'text-anchor': 'end',
                              class: `legend key c${c}`}, `c${c}`));
    }
    nodes.push(svg('line', {x1: x(pos), x2: x(pos), y1: T, y2: H - B, class: 'marker'}));
    chart.replaceChildren(...nodes);
  }

  function drawMerge() {
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
    const head = el('tr', {}, el('th', {}, 'part'), el('th', {}, 'keys'), el('th', {}, 'server'),
                    el('th', {}, 'tiles'), el('th', {}, 'max'), el('th', {}, 'denominator'),
                    el('th', {}, 'lse'), el('th', {}, 'estimate over its keys alone'));
    const body = el('tbody');
    row.parts.forEach((p, i) => {
      const tr = el('tr', {class: i === pos ? 'current' : ''},
                    el('td', {}, String(i + 1)), el('td', {}, keys(p)), el('td', {}, p.endpoint),
                    el('td', {}, String(p.steps)));
      if (p.steps === 0) {
        tr.append(el('td', {class: 'none', colspan: 4},
                     `saw no key: max −∞, denominator 0 (${hiddenSliceText(hidden, p.keyBegin, p.keyEnd)})`));
      } else {
        tr.append(el('td', {}, fmt(p.max)), el('td', {}, fmt(p.denominator, 6)),
                  el('td', {}, fmt(p.lse)), el('td', {}, fmtVector(p.estimate.slice(0, dc), 4)));
      }
      body.append(tr);
    });
    $('merge-parts-table').replaceChildren(
        el('caption', {}, 'Each server\'s final online-softmax state over its slice (its last tile\'s)'),
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
        `${fmtVector(s.estimate.slice(0, MAX_COMPONENTS), 6)}  max |estimate − full| ${fmt(s.maxAbsError, 8)}`;

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
    $('merge-steps-table').replaceChildren(el('thead', {}, sh), sb);
    drawMergeChart(row, pos);

    // The merged output, once the last server is merged.
    const out = $('merge-output');
    $('merge-reference').textContent = fmtVector(row.merged.reference, 6);
    if (pos === total - 1) {
      out.textContent = fmtVector(s.estimate, 6);
      out.dataset.values = JSON.stringify(s.estimate);
      out.classList.add('ready');
      $('merge-error').textContent = fmt(maxAbsDiff(s.estimate, row.merged.reference), 8);
    } else {
      out.textContent = `— (step to the last merge; ${total - 1 - pos} to go)`;
      delete out.dataset.values;
      out.classList.remove('ready');
      $('merge-error').textContent = '—';
    }
    $('merge-check').textContent = model.source === 'file'
      ? `Recomputed here from the parts' states with the same rule: max |Δ| against the file's ` +
        `merged estimate = ${fmt(row.recomputed, 8)}` +
        (Number.isFinite(row.merged.rowDoneMaxAbsDiff)
          ? `; the file's merge of the parts' finished (output, lse) differs by ` +
            `${fmt(row.merged.rowDoneMaxAbsDiff, 8)}.` : '.')
      : 'Merged here in float32 with the rule of OnlineSoftmaxRow::Merge; the reference is ' +
        'computed here in float64 from the page\'s inputs over all keys, with the same causal ' +
        'mask, window, softcap and ALiBi bias.';
  }

  function initMerge() {
    $('merge-run').addEventListener('click', splitAndMerge);
    $('merge-file').addEventListener('change', () => loadMergeFile($('merge-file').files[0]));
    const drop = $('merge-drop');
    drop.addEventListener('dragover', (e) => { e.preventDefault(); drop.classList.add('over'); });
    drop.addEventListener('dragleave', () => drop.classList.remove('over'));
    drop.addEventListener('drop', (e) => {
      e.preventDefault();
      drop.classList.remove('over');
      loadMergeFile(e.dataTransfer && e.dataTransfer.files[0]);
    });
    $('merge-row').addEventListener('change', () => {
      merge.rowKey = $('merge-row').value;
      merge.pos = 0;
      drawMerge();
    });
    const to = (pos) => { merge.pos = Math.max(0, pos); drawMerge(); };
    const last = () => {
      const row = merge.model && merge.model.rows.get(merge.rowKey);
      return row ? row.steps.length - 1 : 0;
    };
    $('merge-first').addEventListener('click', () => to(0));
    $('merge-prev').addEventListener('click', () => to(merge.pos - 1));
    $('merge-next').addEventListener('click', () => to(Math.min(merge.pos + 1, last())));
    $('merge-last').addEventListener('click', () => to(last()));
    setMergeSource('No merge yet: split this problem\'s keys, or load a file.');
    drawMerge();
  }

  // Shows the server's description; a failure goes to the error box when asked for (the button),
  // else only beside it (at load, before a token may have been typed).
  async function info(loud) {
    try {
      const response = await request('/v1/info');
      const i = await response.json();
      $('info').textContent = `attnd ${i.version || '?'} · ${i.backend || '?'} · ${i.device || ''} · ` +
          `default block_k ${num(i.defaultBlockK)} · Naive up to ${fmtBytes(num(i.maxNaiveBytes))} · ` +
          `trace ≤ ${num(i.maxTraceSteps)} steps`;
    } catch (e) {
      $('info').textContent = loud ? '' : `server info: ${e.detail || e.message}`;
      if (loud) showError(e.message);
    }
  }

  // ---------------------------------------------------------------------------------------------
  function init() {
    $('server').value = /^https?:$/.test(location.protocol) ? location.origin : 'http://127.0.0.1:8080';
    $('problem').addEventListener('submit', run);
    $('info-button').addEventListener('click', () => { clearError(); info(true); });
    for (const id of ['example', 'n', 'd', 'block-k', 'random-seed', 'sequences']) {
      $(id).addEventListener('input', describeProblem);
    }
    $('example').addEventListener('change', () => {
      if ($('example').value === 'seed') { $('n').value = 8; $('d').value = 4; }
      describeProblem();
    });
    // Stepping by hand stops play; goTo draws (once) with the controls updated.
    const stepTo = (pos) => { state.playing = false; goTo(pos); };
    $('step-first').addEventListener('click', () => stepTo(0));
    $('step-prev').addEventListener('click', () => stepTo(state.pos - 1));
    $('step-next').addEventListener('click', () => stepTo(state.pos + 1));
    $('step-last').addEventListener('click', () => stepTo(state.steps.length - 1));
    $('play').addEventListener('click', play);
    $('pause').addEventListener('click', pause);
    $('speed').addEventListener('input', showSpeed);
    showSpeed();
    $('step-slider').addEventListener('input', () => stepTo(Number($('step-slider').value)));
    document.addEventListener('keydown', (e) => {
      if (e.target.closest('input, select, textarea')) return;
      if (e.key === 'ArrowRight') stepTo(state.pos + 1);
      else if (e.key === 'ArrowLeft') stepTo(state.pos - 1);
      else if (e.key === ' ') { e.preventDefault(); state.playing ? pause() : play(); }
    });
    describeProblem();
    drawStep();
    initMerge();
    if (/^https?:$/.test(location.protocol)) info(false);
  }
  init();
})();
