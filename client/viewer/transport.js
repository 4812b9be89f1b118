// Talking to attnd's JSON gateway (server/gateway.h): the request bodies (AttentionRequest JSON in
// protobuf's JSON mapping, tensors as base64 float32), calls with the form's gateway address and
// bearer token (request; failures as ServerError, naming the endpoint), the KV cache that "keys
// in a KV cache" stores the keys in (cacheRequest), and /v1/trace's text/event-stream read with
// fetch() and a stream reader, since EventSource cannot POST (readEventStream, collectTrace). The
// trace's events are parsed into the page's objects here (traceStartOf, tileStepOf, rowDoneOf).
// Exports (AttnViewer.transport): serverBase, ServerError, request, cacheRequest,
// readEventStream, collectTrace, tensorJson, decodeTensor, attentionRequest, maskOptions,
// traceStartOf, tileStepOf, rowDoneOf.
'use strict';

(() => {
  const {$} = AttnViewer.dom;
  const {num, nums} = AttnViewer.format;

  // ---------------------------------------------------------------------------------------------
  // Request bodies.
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

  // A float32 tensor [rows, d] as Tensor JSON.
  const tensorJson = (data, rows, d) => ({shape: [rows, d], dtype: 'DTYPE_FLOAT32',
                                          data: base64Float32(data)});

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
    const body = {
      query: tensorJson(problem.q, problem.queryLen, problem.d),
      key: tensorJson(problem.k, problem.keyLen, problem.d),
      value: tensorJson(problem.v, problem.keyLen, problem.d),
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

  // The window, softcap, ALiBi and sinks of the form, added to an options object
  // (AttentionOptions JSON): windowLeft/windowRight only when bounded, softcap only when on,
  // alibiSlopes only with "standard slopes" (the page's problems have one head), sinks only when
  // the Sinks field has them (one per query head, as problem.js's parseSinks reads them). Split
  // keys send the sinks with the slice that starts the sequence only (merge_section.js).
  function maskOptions(cfg, options) {
    if (cfg.windowLeft !== null) options.windowLeft = cfg.windowLeft;
    if (cfg.windowRight !== null) options.windowRight = cfg.windowRight;
    if (cfg.softcap > 0) options.softcap = cfg.softcap;
    if (cfg.alibi) options.alibiSlopes = standardAlibiSlopes(1);
    if (cfg.sinks && cfg.sinks.values) options.sinks = cfg.sinks.values.slice();
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

  // ---------------------------------------------------------------------------------------------
  // Calls.
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

  // ---------------------------------------------------------------------------------------------
  // The trace's event stream.

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

  // One whole trace of one row (a TraceRequest `body`), its events as the gateway sent them:
  // {start, steps, done (the RowDone), end}. Every failure, a stream that ends before the row is
  // done included, is a ServerError naming `path` (the caller's words for this trace).
  async function collectTrace(path, body, signal) {
    const events = {start: null, steps: [], done: null, end: null};
    try {
      const response = await request('/v1/trace', body, signal);
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
  }

  // TileStep.hidden as the gateway prints it (enum names; numbers accepted too): 'causal',
  // 'window', 'sequence' or '' (seen).
  function hiddenName(x) {
    if (x === 'HIDDEN_CAUSAL' || x === 1) return 'causal';
    if (x === 'HIDDEN_WINDOW' || x === 2) return 'window';
    if (x === 'HIDDEN_SEQUENCE' || x === 3) return 'sequence';
    return '';
  }

  // TraceStart JSON as the page keeps it: numbers read, an absent window side null (unbounded),
  // the geometry geometry.js reads.
  function traceStartOf(s) {
    return {
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
      // The sink logit of each query head (empty: no sinks).
      sinks: nums(s.sinks),
    };
  }

  // TileStep JSON as the page keeps it: numbers read, each hidden key's reason by name.
  function tileStepOf(s) {
    return {
      row: s.row || {}, tile: num(s.tile), keyBegin: num(s.keyBegin), keyEnd: num(s.keyEnd),
      scores: nums(s.scores), maxBefore: num(s.maxBefore), maxAfter: num(s.maxAfter),
      rescale: num(s.rescale), weights: nums(s.weights), denominator: num(s.denominator),
      accumulator: nums(s.accumulator), estimate: nums(s.estimate),
      scaledScores: nums(s.scaledScores), biases: nums(s.biases),
      hidden: (s.hidden || []).map(hiddenName),
    };
  }

  // RowDone JSON as the page keeps it: output, reference and lse include the sink (with sinks),
  // sinkShare is the weight it took, e^(sink − lse) (0 without).
  function rowDoneOf(r) {
    return {
      output: nums(r.output), reference: nums(r.reference), maxAbsError: num(r.maxAbsError),
      lse: num(r.lse), sinkShare: num(r.sinkShare),
    };
  }

  (globalThis.AttnViewer ??= {}).transport = {
    serverBase, ServerError, request, cacheRequest, readEventStream, collectTrace, tensorJson,
    decodeTensor, attentionRequest, maskOptions, traceStartOf, tileStepOf, rowDoneOf,
  };
})();
