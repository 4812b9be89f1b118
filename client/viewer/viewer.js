// attnd's web viewer: the explainer's three ideas drawn from the server's own numbers. This is
// its entry: it wires the form and the step controls to their handlers and starts the page; the
// work is in the scripts index.html loads before it, in this order, each adding its exports to
// the page's one global, AttnViewer:
//   format.js         numbers in (protobuf JSON) and out (text); a traced row's key
//   dom.js            building elements and SVG nodes; the error box and the status line
//   geometry.js       which keys a query row sees (kernels/geometry.h's rule, for the page)
//   problem.js        the form's problem: its config, checks, inputs (float32) and note
//   transport.js      the JSON gateway: request bodies, calls, the trace's event stream
//   merge.js          merging key slices' states (OnlineSoftmaxRow::Merge) and its models
//   draw_trace.js     drawing ideas 1–3: the score row, the bytes, the current tile step
//   draw_merge.js     drawing the merge section
//   run.js            one run: the three calls, the trace's steps kept, stepping and play
//   merge_section.js  the merge section: "Split and merge", a loaded file, its controls
// Each script is a classic one (no ES modules), so the page also works opened from a file.
// Exports nothing.
'use strict';

(() => {
  const {$, showError, clearError} = AttnViewer.dom;
  const {num, fmtBytes} = AttnViewer.format;
  const {readConfig, problemNote} = AttnViewer.problem;
  const {request} = AttnViewer.transport;
  const {drawBytes, drawStep} = AttnViewer.drawTrace;
  const {state, run, goTo, play, pause, showSpeed} = AttnViewer.run;
  const {initMerge} = AttnViewer.mergeSection;

  // The note under the form and idea 2's bytes, for the form as it is now.
  function describeProblem() {
    const cfg = readConfig();
    document.body.classList.toggle('random', cfg.example === 'random');
    $('problem-note').textContent = problemNote(cfg);
    drawBytes(cfg, null);
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

  function init() {
    $('server').value = /^https?:$/.test(location.protocol) ? location.origin : 'http://127.0.0.1:8080';
    $('problem').addEventListener('submit', run);
    $('info-button').addEventListener('click', () => { clearError(); info(true); });
    for (const id of ['example', 'n', 'd', 'block-k', 'random-seed', 'sequences', 'sinks']) {
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
    drawStep(state);
    initMerge();
    if (/^https?:$/.test(location.protocol)) info(false);
  }
  init();
})();
