// The merge section ("Idea 3 × servers"): its view (`merge`: the model shown, the chosen row
// and merge step), its two sources of a model — "Split and merge" (splitAndMerge: one /v1/trace
// per slice of this page's problem, each with its positions, all answered by this page's server
// and merged here) and a file of `attn trace --shard-keys --json` (loadMergeFile, through the
// file input or the drop zone) — and its controls (initMerge). Per traced row a model holds each
// part's final state and the merge steps (merge.js); only the chosen row and step are drawn
// (draw_merge.js).
// Exports (AttnViewer.mergeSection): initMerge.
'use strict';

(() => {
  const {$, el, showError, clearError} = AttnViewer.dom;
  const {readConfig, configError, buildProblem} = AttnViewer.problem;
  const {serverBase, collectTrace, tensorJson, maskOptions} = AttnViewer.transport;
  const {modelFromLines, keySlices, modelFromSlices} = AttnViewer.merge;
  const {drawMerge} = AttnViewer.drawMerge;

  const merge = {model: null, rowKey: null, pos: 0, abort: null, serial: 0};
  // Says what #merge shows now; data-serial counts the merges and failures shown (for scripts).
  function setMergeSource(text) {
    const source = $('merge-source');
    source.textContent = text;
    source.dataset.serial = String(++merge.serial);
  }

  // "Split and merge": this page's problem, its keys cut into contiguous slices, each traced by
  // this page's server with the form's options (causal, the window, the softcap, ALiBi slopes and
  // sinks: maskOptions, as the run sends them), key_position = the slice's first key and the whole
  // problem's query_position (0: n queries over n keys). The positions place the causal mask, the
  // window and the ALiBi distances of each slice as in the whole (the softcap is per score), so
  // each slice computes exactly its part; the states merged here. A sink belongs to the row once,
  // not to each slice: only the slice that starts the keys (key 0, the first part) carries the
  // sinks, the others are sent without, and the row's sink joins the merged state once
  // (merge.js). Every slice is sent, also one the traced row cannot see: it comes back with no
  // step (lse −∞, or the sink's with the sinks), the empty state, which the merge takes with
  // factor 0. A ragged batch is refused: its sequences' positions are their own, which one
  // key_position per slice cannot give.
  async function splitAndMerge() {
    clearError();
    const cfg = readConfig();
    const unusable = configError(cfg);
    if (unusable) { showError(unusable); return; }
    if (cfg.sequences) {
      showError('Split and merge cuts one sequence\'s keys, each slice with its positions; a ragged ' +
                'batch takes none (each sequence has its own). Clear Sequences to split the keys.');
      return;
    }
    const problem = buildProblem(cfg);
    const n = problem.keyLen, d = problem.d;
    // The whole problem's options; each slice adds its positions, and all but the first drop the
    // sinks.
    const options = maskOptions(cfg, {causal: cfg.causal, blockK: cfg.blockK, returnLse: true});
    const sliceOptions = (a) => {
      const {sinks, ...rest} = options;
      return {...(a === 0 ? options : rest), keyPosition: a, queryPosition: 0};
    };
    const slices = keySlices(n, Math.trunc(Number($('merge-parts').value)) || 1);
    if (merge.abort) merge.abort.abort();
    const abort = new AbortController();
    merge.abort = abort;
    const server = serverBase();
    $('merge-source').textContent = `Tracing ${slices.length} slice(s) of the keys on ${server}…`;
    let traces;
    try {
      traces = await Promise.all(slices.map(([a, b], i) => collectTrace(
          `/v1/trace (part ${i + 1}, keys [${a}, ${b}))`,
          {
            attention: {
              query: tensorJson(problem.q, n, d),
              key: tensorJson(problem.k.subarray(a * d, b * d), b - a, d),
              value: tensorJson(problem.v.subarray(a * d, b * d), b - a, d),
              options: sliceOptions(a),
            },
            rows: [{batch: 0, head: 0, row: cfg.row}],
          },
          abort.signal)));
    } catch (e) {
      if (e.name === 'AbortError' || merge.abort !== abort) return;
      merge.abort = null;
      showError(e.message);
      setMergeSource('The split trace failed: no merge (never a partial one).');
      return;
    }
    if (merge.abort !== abort) return;
    merge.abort = null;
    showMerge(modelFromSlices({server, problem, cfg, options, slices, traces}));
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
    drawMerge(merge);
    setMergeSource(model.label);
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
      drawMerge(merge);
    });
    const to = (pos) => { merge.pos = Math.max(0, pos); drawMerge(merge); };
    const last = () => {
      const row = merge.model && merge.model.rows.get(merge.rowKey);
      return row ? row.steps.length - 1 : 0;
    };
    $('merge-first').addEventListener('click', () => to(0));
    $('merge-prev').addEventListener('click', () => to(merge.pos - 1));
    $('merge-next').addEventListener('click', () => to(Math.min(merge.pos + 1, last())));
    $('merge-last').addEventListener('click', () => to(last()));
    setMergeSource('No merge yet: split this problem\'s keys, or load a file.');
    drawMerge(merge);
  }

  (globalThis.AttnViewer ??= {}).mergeSection = {initMerge};
})();
