// Drives attnd's web viewer in Debian's chromium through playwright-core (tests/browser_test.sh).
//
// Loads the page from a running attnd, runs the seed example's trace of row 0 with block_k 2,
// steps to the end and checks: the displayed final output equals the seed's out[0] (computed here
// in float64, independently of the server) to 4 decimals; the byte accounting shows 1024 bytes
// for Naive at N = 8; the tied scores of row 0 are highlighted; no console errors; the same run
// with "keys in a KV cache" (the keys stored in a server-resident cache first) gives the same
// out[0] and leaves no cache behind. Then checks
// that a bad request's error is shown on the page. Then the merge of key slices ("Idea 3 ×
// servers"): "Split and merge" into 3 parts (three traces with positions from the one server,
// merged in the page) gives out[0] again, draws three key ranges and shows each step's rescale
// factors equal to exp(m − m_new) computed here; causal row 2 shows the two parts that see none of
// its keys; a JSON-lines file in the schema of attn trace --shard-keys --json (built here from the
// seed in float64) loads through the file input and through the drop zone, its rows selectable,
// its merge recomputed by the page; a file of such a merge with an attention sink (added once
// after the merge, as attn trace --shard-keys does: the file gives its share, not its logit)
// merges to the seed's row 0 with the sink; a file of the wrong kind is refused with a clear
// message.
// Saves a screenshot, and merge.png of the merge section. Last, the page opened as a file
// (file://…/client/viewer/index.html): every script loads and runs, with no console error.
// Usage: node viewer_test.js URL SCREENSHOT.png
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const {chromium} = require('playwright-core');

const [url, screenshot] = process.argv.slice(2);
if (!url || !screenshot) {
  console.error('usage: node viewer_test.js URL SCREENSHOT.png');
  process.exit(2);
}

// The seed example (the explainer's idea 1): out[0] of softmax(q kᵀ / sqrt(d)) v, n = 8, d = 4.
// The viewer draws on an animation frame (run.js, scheduleDraw): what a check reads after a run
// or a step button is on the page only once that frame ran. Two frames: the queued draw's, and
// one it may queue in turn.
const drawn = (page) => page.evaluate(
    () => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));

function seedOut0() {
  const n = 8, d = 4;
  const q = (i, j) => ((i + j) % 5) - 2;
  const k = (i, j) => (((2 * i + j) % 7) - 3) / 2;
  const v = (i, j) => ((i + j) % 9) - 4;
  const scores = [];
  for (let j = 0; j < n; ++j) {
    let dot = 0;
    for (let c = 0; c < d; ++c) dot += q(0, c) * k(j, c);
    scores.push(dot / Math.sqrt(d));
  }
  const max = Math.max(...scores);
  const weights = scores.map((s) => Math.exp(s - max));
  const sum = weights.reduce((a, b) => a + b, 0);
  const out = new Array(d).fill(0);
  for (let j = 0; j < n; ++j) for (let c = 0; c < d; ++c) out[c] += (weights[j] / sum) * v(j, c);
  return out;
}

// The seed example's online-softmax state of query row `row` over keys [a, b) (causal: keys j ≤
// row), in float64: {max, denominator, accumulator}; the empty state when it sees none of them.
const SEED_N = 8, SEED_D = 4;
function seedState(row, a, b, causal) {
  const q = (i, j) => ((i + j) % 5) - 2;
  const k = (i, j) => (((2 * i + j) % 7) - 3) / 2;
  const v = (i, j) => ((i + j) % 9) - 4;
  const scores = [];
  for (let j = a; j < b && (!causal || j <= row); ++j) {
    let dot = 0;
    for (let c = 0; c < SEED_D; ++c) dot += q(row, c) * k(j, c);
    scores.push([j, dot / Math.sqrt(SEED_D)]);
  }
  const state = {max: -Infinity, denominator: 0, accumulator: new Array(SEED_D).fill(0)};
  if (scores.length === 0) return state;
  state.max = Math.max(...scores.map(([, s]) => s));
  for (const [j, s] of scores) {
    const w = Math.exp(s - state.max);
    state.denominator += w;
    for (let c = 0; c < SEED_D; ++c) state.accumulator[c] += w * v(j, c);
  }
  return state;
}
// The merge rule (kernels/online_softmax.h OnlineSoftmaxRow::Merge), independently, in float64.
function mergeSeed(states) {
  let run = {max: -Infinity, denominator: 0, accumulator: new Array(SEED_D).fill(0)};
  return states.map((p) => {
    const m = Math.max(run.max, p.max);
    const mine = run.max === -Infinity ? 0 : Math.exp(run.max - m);
    const theirs = p.max === -Infinity ? 0 : Math.exp(p.max - m);
    const next = {max: m, denominator: run.denominator * mine + p.denominator * theirs,
                  accumulator: run.accumulator.map((x, c) => x * mine + p.accumulator[c] * theirs)};
    const step = {maxBefore: run.max, partMax: p.max, maxAfter: m, runningRescale: mine,
                  partRescale: theirs, denominatorBefore: run.denominator,
                  partDenominator: p.denominator, denominator: next.denominator,
                  accumulator: next.accumulator,
                  estimate: next.accumulator.map((x) => (next.denominator > 0 ? x / next.denominator : 0))};
    run = next;
    return step;
  });
}
// An attention sink joining a finished state once (OnlineSoftmax::AddSink), in float64: one more
// logit with no value.
function joinSink(state, sink) {
  const m = Math.max(state.max, sink);
  const mine = state.max === -Infinity ? 0 : Math.exp(state.max - m);
  return {max: m, denominator: state.denominator * mine + Math.exp(sink - m),
          accumulator: state.accumulator.map((x) => x * mine)};
}
const estimateOf = (st) => st.accumulator.map((x) => (st.denominator > 0 ? x / st.denominator : 0));
// The page's split of N keys into P parts: [round(s·N/P), round((s+1)·N/P)).
const seedSlices = (parts) => Array.from({length: parts}, (_, s) =>
  [Math.round((s * SEED_N) / parts), Math.round(((s + 1) * SEED_N) / parts)]);

// The JSON lines attn trace --shard-keys --json writes (client/cli/merge_trace.h), for the seed
// example's `rows`, its keys split as `slices` over `endpoints`; with `sink`, the request's sink
// (the first slice's RowDone lse includes it; the merged row takes it once after the last part
// and says its sinkShare; the problem line does not repeat it).
function seedMergeFile(rows, slices, endpoints, sink) {
  const j = (x) => (x === -Infinity ? '-Infinity' : x === Infinity ? 'Infinity' : x);
  const lines = [{problem: {batch: 1, heads: 1, kvHeads: 1, queryLen: SEED_N, keyLen: SEED_N,
                            headDim: SEED_D, valueDim: SEED_D, scale: 0.5, causal: false,
                            keyPosition: 0, queryPosition: 0, blockK: 2, endpoints,
                            parts: slices.length, singleServer: slices.length === 1,
                            keysSent: SEED_N}}];
  for (const r of rows) {
    const row = {batch: 0, head: 0, row: r};
    const states = slices.map(([a, b]) => seedState(r, a, b, false));
    const withSink = (st) => (sink === undefined ? st : joinSink(st, sink));
    const reference = estimateOf(withSink(seedState(r, 0, SEED_N, false)));
    states.forEach((p, i) => {
      const estimate = p.accumulator.map((x) => x / p.denominator);
      const done = i === 0 ? withSink(p) : p;  // the first slice's RowDone carries the sink
      lines.push({part: {row, index: i, parts: slices.length, endpoint: endpoints[i],
                         keyBegin: slices[i][0], keyEnd: slices[i][1], keyPosition: slices[i][0],
                         queryPosition: 0, blockK: 2, steps: Math.ceil((slices[i][1] - slices[i][0]) / 2),
                         max: j(p.max), denominator: p.denominator, accumulator: p.accumulator,
                         lse: done.max + Math.log(done.denominator), estimate,
                         output: estimateOf(done), maxAbsError: 0}});
    });
    const steps = mergeSeed(states);
    steps.forEach((s, i) => {
      lines.push({merge_step: {row, index: i, part: i, endpoint: endpoints[i],
                               keyBegin: slices[i][0], keyEnd: slices[i][1],
                               maxBefore: j(s.maxBefore), partMax: j(s.partMax),
                               maxAfter: j(s.maxAfter), runningRescale: s.runningRescale,
                               partRescale: s.partRescale, partDenominator: s.partDenominator,
                               denominatorBefore: s.denominatorBefore, denominator: s.denominator,
                               accumulator: s.accumulator, estimate: s.estimate,
                               maxAbsError: Math.max(...s.estimate.map((x, c) => Math.abs(x - reference[c])))}});
    });
    const last = steps[steps.length - 1];
    const merged = withSink({max: last.maxAfter, denominator: last.denominator,
                             accumulator: last.accumulator});
    const lse = merged.max + Math.log(merged.denominator);
    lines.push({merged: {row, parts: slices.length, singleServer: slices.length === 1,
                         output: estimateOf(merged), lse, reference, referenceLse: lse,
                         maxAbsError: 0, relativeError: 0, rowDoneOutput: estimateOf(merged),
                         rowDoneMaxAbsDiff: 0,
                         sinkShare: sink === undefined ? 0 : Math.exp(sink - lse)}});
  }
  return lines.map((l) => JSON.stringify(l)).join('\n') + '\n';
}

const failures = [];
let passed = 0;
function check(name, ok, detail) {
  if (ok) {
    ++passed;
    console.log(`ok   ${name}`);
  } else {
    failures.push(name);
    console.log(`FAIL ${name}${detail ? `: ${detail}` : ''}`);
  }
}
const numbersIn = (text) => (text.replace(/−/g, '-').match(/-?\d+(\.\d+)?(e-?\d+)?/g) || []).map(Number);

async function main() {
  const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'attn-viewer-chromium-'));
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: '/usr/bin/chromium',
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: {width: 1280, height: 900},
    timeout: 60000,
  });
  try {
    const page = context.pages()[0] || await context.newPage();
    page.setDefaultTimeout(30000);
    const consoleErrors = [];
    let allowHttpErrors = false;
    page.on('console', (message) => {
      if (message.type() !== 'error') return;
      if (allowHttpErrors && /Failed to load resource/.test(message.text())) return;
      consoleErrors.push(message.text());
    });
    page.on('pageerror', (error) => consoleErrors.push(`uncaught: ${error.message}`));

    await page.goto(url, {waitUntil: 'load'});
    check('the page loads with its run button', await page.locator('#run').isVisible());

    // The seed example, N = 8, d = 4, block_k 2, row 0.
    await page.selectOption('#example', 'seed');
    await page.fill('#n', '8');
    await page.fill('#d', '4');
    await page.fill('#block-k', '2');
    await page.fill('#multiplier', '1');
    await page.fill('#row', '0');
    await page.setChecked('#causal', false);
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const errorText = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('the run shows no error', errorText === '', errorText);

    // Step to the end with the next button, waiting for each step to be drawn.
    const at = async () => Number(((await page.textContent('#step-pos')).match(/step (\d+) \//) || [])[1]);
    const stepToEnd = async () => {
      let clicks = 0;
      while (await page.isEnabled('#step-next') && clicks < 100) {
        const before = await at();
        await page.click('#step-next');
        ++clicks;
        await page.waitForFunction((n) => !new RegExp(`step ${n} /`).test(
            document.getElementById('step-pos').textContent), before);
      }
      return clicks;
    };
    const clicks = await stepToEnd();
    const position = await page.textContent('#step-pos');
    check('four tiles of two keys, stepped to the last', clicks === 3 && /step 4 \/ 4/.test(position),
          `${clicks} clicks, "${position}"`);

    const expected = seedOut0();
    const finalText = await page.textContent('#final-output');
    const shown = numbersIn(finalText);
    const close = shown.length === expected.length &&
        shown.every((x, i) => Math.abs(x - expected[i]) <= 5e-5);
    check(`final output equals the seed's out[0] = [${expected.map((x) => x.toFixed(4)).join(', ')}] ` +
          'to 4 decimals', close, `page shows "${finalText}"`);

    const naiveBytes = await page.textContent('#naive-bytes');
    check('byte accounting shows 1024 bytes for Naive at N = 8', /(^|\D)1024 bytes/.test(naiveBytes),
          `page shows "${naiveBytes}"`);

    const ties = await page.locator('#score-table td.tie').count();
    check('row 0\'s tied largest scores (keys 0 and 7) are highlighted', ties >= 2, `${ties} tied cells`);
    const rescale = await page.textContent('#rescale');
    check('the step shows its rescale factor', numbersIn(rescale).length >= 1, rescale);

    fs.mkdirSync(path.dirname(path.resolve(screenshot)), {recursive: true});
    await page.screenshot({path: screenshot, fullPage: true});
    console.log(`screenshot: ${path.resolve(screenshot)}`);

    check('no console errors', consoleErrors.length === 0, consoleErrors.join(' | '));

    // The same trace over a server-resident KV cache: the page stores the keys first, the calls
    // send only the queries and the cache id, and the answer is the same; the cache is deleted.
    await page.setChecked('#use-cache', true);
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const cacheError = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('the KV-cache run shows no error', cacheError === '', cacheError);
    const cacheClicks = await stepToEnd();
    const cacheShown = numbersIn(await page.textContent('#final-output'));
    check('over a KV cache: four steps and the seed\'s out[0] again',
          cacheClicks === 3 && cacheShown.length === expected.length &&
              cacheShown.every((x, i) => Math.abs(x - expected[i]) <= 5e-5),
          `${cacheClicks} clicks, page shows "${cacheShown.join(', ')}"`);
    const left = await page.evaluate(async () => (await (await fetch('/v1/caches')).json()).caches);
    check('the page deleted its cache', Array.isArray(left) && left.length === 0, JSON.stringify(left));
    const metrics = await page.evaluate(async () => (await fetch('/metrics')).text());
    for (const method of ['CreateCache', 'AppendCache', 'DeleteCache']) {
      check(`the page made one ${method} call`,
            new RegExp(`method="${method}",code="OK"\\} 1$`, 'm').test(metrics),
            metrics.split('\n').filter((l) => l.includes(method)).join(' | ') || 'no such line');
    }
    check('no console errors over a KV cache', consoleErrors.length === 0, consoleErrors.join(' | '));
    await page.setChecked('#use-cache', false);

    // The merge of key slices: "Split and merge" into 3 parts, all answered by this server.
    // Waits for the merge view to show its next merge or failure (#merge-source's data-serial).
    const serial = async () => page.getAttribute('#merge-source', 'data-serial');
    const mergeDone = async (before) => page.waitForFunction(
        (old) => document.getElementById('merge-source').dataset.serial !== old, before);
    const mergeStepToEnd = async () => {
      let clicks = 0;
      while (await page.isEnabled('#merge-next') && clicks < 20) {
        await page.click('#merge-next');
        ++clicks;
      }
      return clicks;
    };
    const cellNumbers = async (selector) =>
      (await page.locator(selector).allTextContents()).map((t) => numbersIn(t)[0]);
    await page.fill('#row', '0');
    await page.setChecked('#causal', false);
    await page.fill('#merge-parts', '3');
    let source = await serial();
    await page.click('#merge-run');
    await mergeDone(source);
    source = await serial();
    const label = await page.textContent('#merge-source');
    const mergeError = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('split and merge shows no error', mergeError === '', mergeError);
    check('the split is labelled as answered by this one server',
          /All 3 parts were answered by this one server/.test(label), label);
    check('three key ranges drawn on the key axis',
          await page.locator('#merge-keys rect.part').count() === 3);
    const slices = seedSlices(3);
    const expectedSteps = mergeSeed(slices.map(([a, b]) => seedState(0, a, b, false)));
    const running = await cellNumbers('#merge-steps-table td.running-rescale');
    const incoming = await cellNumbers('#merge-steps-table td.part-rescale');
    check('each merge step shows exp(m_running − m_new) and exp(m_part − m_new) as computed here',
          running.length === 3 && incoming.length === 3 &&
              expectedSteps.every((s, i) => Math.abs(running[i] - s.runningRescale) < 2e-6 &&
                                            Math.abs(incoming[i] - s.partRescale) < 2e-6),
          `page: ${running} / ${incoming}; here: ${expectedSteps.map((s) => `${s.runningRescale.toFixed(6)}/${s.partRescale.toFixed(6)}`)}`);
    const notYet = await page.textContent('#merge-output');
    const mergeClicks = await mergeStepToEnd();
    const merged = numbersIn(await page.textContent('#merge-output'));
    check('before the last merge step the output waits; after it, the seed\'s out[0]',
          /to go/.test(notYet) && mergeClicks === 2 && merged.length === expected.length &&
              merged.every((x, i) => Math.abs(x - expected[i]) <= 5e-5),
          `"${notYet}", ${mergeClicks} clicks, page shows ${merged}`);
    const mergeErr = numbersIn(await page.textContent('#merge-error'))[0];
    check('the merged output is within 1e-5 of the full-matrix reference', mergeErr < 1e-5,
          String(mergeErr));
    const section = page.locator('#merge');
    await section.screenshot({path: path.join(path.dirname(path.resolve(screenshot)), 'merge.png')});

    // Causal row 2 sees keys 0…2 only: parts 2 and 3 see none of theirs.
    await page.setChecked('#causal', true);
    await page.fill('#row', '2');
    await page.click('#merge-run');
    await mergeDone(source);
    source = await serial();
    const partsText = await page.textContent('#merge-parts-table');
    check('causal row 2: two parts saw no key', (partsText.match(/saw no key/g) || []).length === 2,
          partsText);
    check('causal row 2: the keys it cannot see are hatched',
          await page.locator('#merge-keys rect.unseen').count() === 1);
    await mergeStepToEnd();
    const causalExpected = mergeSeed([seedState(2, 0, SEED_N, true)])[0].estimate;
    const causalShown = numbersIn(await page.textContent('#merge-output'));
    check('causal row 2 merges to its full-matrix answer',
          causalShown.length === 4 && causalShown.every((x, i) => Math.abs(x - causalExpected[i]) <= 5e-5),
          `page ${causalShown}, here ${causalExpected}`);
    const lastRunning = (await cellNumbers('#merge-steps-table td.part-rescale')).slice(1);
    check('a part that saw no key comes in with factor 0', lastRunning.every((x) => x === 0),
          String(lastRunning));
    await page.setChecked('#causal', false);
    await page.fill('#row', '0');

    // A file of attn trace --shard-keys --json: the file input, two rows.
    const endpoints = ['10.0.0.1:50051', '10.0.0.2:50051', '10.0.0.3:50051'];
    const file = seedMergeFile([0, 1], slices, endpoints);
    await page.setInputFiles('#merge-file', {name: 'seed-merge.jsonl', mimeType: 'application/x-ndjson',
                                             buffer: Buffer.from(file)});
    await mergeDone(source);
    source = await serial();
    const fileLabel = await page.textContent('#merge-source');
    check('the file loads, naming its servers',
          /seed-merge\.jsonl: 3 parts traced by 3 server\(s\): 10\.0\.0\.1:50051/.test(fileLabel),
          fileLabel);
    check('the file\'s two rows are offered', await page.locator('#merge-row option').count() === 2);
    const recheck = await page.textContent('#merge-check');
    const delta = numbersIn(recheck.split('=')[1] || '')[0];
    check('the page recomputes the file\'s merge with the same rule', delta < 1e-5, recheck);
    await mergeStepToEnd();
    const fromFile = numbersIn(await page.textContent('#merge-output'));
    check('the file\'s row 0 merges to out[0]',
          fromFile.length === 4 && fromFile.every((x, i) => Math.abs(x - expected[i]) <= 5e-5),
          String(fromFile));
    await page.selectOption('#merge-row', '0/0/1');
    await mergeStepToEnd();
    const out1 = mergeSeed([seedState(1, 0, SEED_N, false)])[0].estimate;
    const fromFile1 = numbersIn(await page.textContent('#merge-output'));
    check('the file\'s row 1 merges to out[1]',
          fromFile1.length === 4 && fromFile1.every((x, i) => Math.abs(x - out1[i]) <= 5e-5),
          `${fromFile1} vs ${out1}`);

    // A file of the same split with an attention sink of 1.25: the page joins it once after the
    // last step (its logit from the file's merged lse and sink share) and gives the seed's row 0
    // with the sink.
    const SINK = 1.25;
    await page.setInputFiles('#merge-file', {name: 'seed-sink.jsonl', mimeType: 'application/x-ndjson',
                                             buffer: Buffer.from(seedMergeFile([0], slices, endpoints, SINK))});
    await mergeDone(source);
    source = await serial();
    await mergeStepToEnd();
    const sinkState = joinSink(seedState(0, 0, SEED_N, false), SINK);
    const sinkExpected = estimateOf(sinkState);
    const sinkShare = Math.exp(SINK - (sinkState.max + Math.log(sinkState.denominator)));
    const fromSinkFile = numbersIn(await page.textContent('#merge-output'));
    const sinkNote = await page.$eval('#merge-sink', (p) => ({hidden: p.hidden, share: Number(p.dataset.share),
                                                            text: p.textContent}));
    const sinkFileErr = numbersIn(await page.textContent('#merge-error'))[0];
    check('a file with a sink: the sink joins once after the last part, the seed\'s row 0 with the sink',
          fromSinkFile.length === 4 && fromSinkFile.every((x, i) => Math.abs(x - sinkExpected[i]) <= 5e-5) &&
              sinkFileErr < 1e-5 && !sinkNote.hidden && Math.abs(sinkNote.share - sinkShare) < 1e-5 &&
              /logit 1\.250000, from the file's merged lse and sink share/.test(sinkNote.text),
          `page ${fromSinkFile}, here ${sinkExpected}, error ${sinkFileErr}, ${JSON.stringify(sinkNote)}`);
    check('a file with a sink: one "+ sink" row after the merge steps',
          await page.locator('#merge-steps-table tr.sink-step').count() === 1 &&
              await page.locator('#merge-steps-table td.part-rescale').count() === 3);

    // The drop zone, with a file of one server that traced all of it.
    const single = seedMergeFile([0], [[0, SEED_N]], ['10.0.0.9:50051']);
    const transfer = await page.evaluateHandle((text) => {
      const dt = new DataTransfer();
      dt.items.add(new File([text], 'single.jsonl', {type: 'application/x-ndjson'}));
      return dt;
    }, single);
    await page.dispatchEvent('#merge-drop', 'drop', {dataTransfer: transfer});
    await mergeDone(source);
    source = await serial();
    const singleLabel = await page.textContent('#merge-source');
    check('a dropped single-server file says there is nothing to merge',
          /single\.jsonl: one server \(10\.0\.0\.9:50051\) traced all of it/.test(singleLabel),
          singleLabel);

    // attn trace --json (one server's events) is not a merge trace: refused, saying so.
    const wrong = '{"start":{"batch":"1"}}\n{"end":{}}\n';
    await page.setInputFiles('#merge-file', {name: 'plain.jsonl', mimeType: 'application/x-ndjson',
                                             buffer: Buffer.from(wrong)});
    await page.waitForFunction(() => !document.getElementById('error').hidden);
    const wrongText = await page.textContent('#error');
    check('a plain trace file is refused, naming what to load',
          /plain\.jsonl: .*--shard-keys --json/.test(wrongText), wrongText);
    check('no console errors in the merge view', consoleErrors.length === 0, consoleErrors.join(' | '));

    // A row out of range: the server's INVALID_ARGUMENT is shown on the page.
    allowHttpErrors = true;
    await page.fill('#row', '99');
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const shownError = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('a bad row shows the server\'s error', /HTTP 4\d\d/.test(shownError) && /row/i.test(shownError),
          `error box: "${shownError}"`);
    check('no other console errors', consoleErrors.length === 0, consoleErrors.join(' | '));

    // The page opened as a file (client/viewer/index.html from the source tree): its scripts are
    // classic ones, so they load from file:// too (ES modules would be refused there) and all run:
    // the problem note, the speed and the merge section's source line are set by them.
    const filePage = await context.newPage();
    const fileErrors = [];
    filePage.on('console', (message) => {
      if (message.type() === 'error') fileErrors.push(message.text());
    });
    filePage.on('pageerror', (error) => fileErrors.push(`uncaught: ${error.message}`));
    const indexFile = path.join(__dirname, '..', '..', 'client', 'viewer', 'index.html');
    await filePage.goto(`file://${indexFile}`, {waitUntil: 'load'});
    const opened = await filePage.evaluate(() => ({
      note: document.getElementById('problem-note').textContent,
      speed: document.getElementById('speed-value').textContent,
      mergeSerial: document.getElementById('merge-source').dataset.serial,
      server: document.getElementById('server').value,
    }));
    check('opened as a file, every script runs (note, speed, merge section drawn)',
          /^Seed: /.test(opened.note) && opened.speed === '4/s' && opened.mergeSerial === '1',
          JSON.stringify(opened));
    check('opened as a file, the gateway field defaults to http://127.0.0.1:8080',
          opened.server === 'http://127.0.0.1:8080', opened.server);
    check('no console errors opened as a file', fileErrors.length === 0, fileErrors.join(' | '));
    await filePage.close();
  } finally {
    await context.close();
    fs.rmSync(userDataDir, {recursive: true, force: true});
  }
}

main().then(() => {
  console.log(`${passed} passed, ${failures.length} failed`);
  process.exit(failures.length ? 1 : 0);
}, (error) => {
  console.log(`FAIL ${error.stack || error}`);
  console.log(`${passed} passed, ${failures.length + 1} failed`);
  process.exit(1);
});
