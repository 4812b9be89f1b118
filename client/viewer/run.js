// One run of the form's problem ("Run"): the trace of the chosen row from /v1/trace, streamed in
// and kept whole (`state.steps`, every TileStep; only the current one is drawn, so thousands of
// steps stay cheap), then Naive and Tiled from /v1/naive and /v1/tiled for the full-matrix result
// and the server's stats ("keys in a KV cache": the keys stored in a cache first, the three calls
// sending only the queries and its id); and moving through the steps (goTo, play, pause).
// Exports (AttnViewer.run): state, run, goTo, play, pause, showSpeed.
'use strict';

(() => {
  const {$, showError, clearError, setStatus} = AttnViewer.dom;
  const {num, rowKey, fmt} = AttnViewer.format;
  const {readConfig, configError, buildProblem} = AttnViewer.problem;
  const {ServerError, request, cacheRequest, readEventStream, decodeTensor, attentionRequest,
         traceStartOf, tileStepOf, rowDoneOf} = AttnViewer.transport;
  const {drawIdea1, drawBytes, drawStep, statsText} = AttnViewer.drawTrace;

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

  let drawQueued = false;
  function scheduleDraw() {
    if (drawQueued) return;
    drawQueued = true;
    requestAnimationFrame(() => { drawQueued = false; drawStep(state); });
  }

  // The speed slider is logarithmic: 1, 2, 4, … 1024 steps per second.
  function stepsPerSecond() { return Math.pow(2, Number($('speed').value)); }
  function showSpeed() { $('speed-value').textContent = `${stepsPerSecond()}/s`; }

  // Moves to a step and draws it now, so the controls are current before the next input.
  function goTo(pos) {
    state.pos = Math.max(0, Math.min(pos, state.steps.length - 1));
    drawStep(state);
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
  function pause() { state.playing = false; drawStep(state); }

  // One event of the run's trace, parsed into `state` (the start, each step, each row's end), and
  // what it changes drawn.
  function onTraceEvent(e) {
    if (e.start) {
      state.start = traceStartOf(e.start);
      const sequences = Math.max(0, state.start.cuSeqlensQ.length - 1);
      drawBytes(state.cfg, state.start);
      setStatus(`Trace started: N = ${state.start.keyLen}, d = ${state.start.headDim}, ` +
                `block_k = ${state.start.blockK}, scale = ${fmt(state.start.scale, 6)}, ` +
                `${state.start.tilesPerRow} tiles per row` +
                (sequences ? `, ${sequences} sequences packed` : '') +
                (state.start.sinks.length ? `, sink ${fmt(state.start.sinks[0], 6)}.` : '.'));
    } else if (e.step) {
      const step = tileStepOf(e.step);
      state.steps.push(step);
      state.lastStepOfRow.set(rowKey(step.row), state.steps.length - 1);
      if ($('follow').checked) state.pos = state.steps.length - 1;
      scheduleDraw();
    } else if (e.rowDone) {
      state.rowDone.set(rowKey(e.rowDone.row), rowDoneOf(e.rowDone));
      drawIdea1(state);
      scheduleDraw();
    } else if (e.end) {
      state.end = e.end;
      state.streamDone = true;
      setStatus(`Trace complete: ${state.steps.length} steps` +
                (state.naive && state.tiled ? '.' : '; waiting for Naive and Tiled…'));
      scheduleDraw();
    }
  }

  // A run: Naive and Tiled for the result and stats, Trace for the steps.
  async function run(event) {
    if (event) event.preventDefault();
    if (state.abort) state.abort.abort();
    clearError();
    pause();
    const cfg = readConfig();
    const unusable = configError(cfg);
    if (unusable) { showError(unusable); return; }
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
      if (r && state.abort === abort) { state.naive = r; drawIdea1(state); scheduleDraw(); }
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
    drawIdea1(state);
    scheduleDraw();
  }

  (globalThis.AttnViewer ??= {}).run = {state, run, goTo, play, pause, showSpeed};
})();
