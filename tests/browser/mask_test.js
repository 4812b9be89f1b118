// The viewer's masks and biases (tests/browser_test.sh runs it after viewer_test.js): the seed
// example, causal with a left window of 2 and ALiBi's standard slope (one head: 2^-8), row 5
// (query at position 5, key j at j): keys 0…2 are hidden by the window, 6 and 7 by the causal
// mask, the window band covers keys 3…7 (right side unbounded), key j's bias is −2^-8·|5 − j|,
// and the final output is the masked, biased softmax computed here in float64. Bad window and
// softcap values are refused by the page with a message, before any request.
// Then "Split and merge" of the same causal window with ALiBi and a softcap of 1 into 4 parts,
// keys [0, 2) [2, 4) [4, 6) [6, 8): every slice's /v1/trace carries the window, the softcap, the
// slope and its positions (key_position = its first key, query_position 0); part 1 is hidden from
// row 5 by the window and part 4 by the causal mask (both come back empty and enter the merge
// with factor 0), and the merged output equals the unsplit /v1/tiled output of row 5 and the
// capped, biased, windowed softmax computed here (within 5e-5, and within 1e-5 of the page's own
// reference, as viewer_test.js's split).
// Then attention sinks: bad Sinks values are refused by the page; the server refuses a wrong
// count (naming options.sinks) and a non-finite sink (naming options.sinks[0]). The causal window
// of 4 with ALiBi and a sink of 1.5, row 5 (keys 1…5 seen): the trace request carries sinks [1.5],
// idea 1 draws the sink's row with its logit and its share e^(sink − lse) (computed here in
// float64), the keys' weights summing to 1 − that share, the steps' estimates converge to the
// keys' part (reference ÷ (1 − share)), the sink's join after the last tile is shown, and the
// final output and Naive's are the softmax with the sink computed here. "Split and merge" of it
// with a softcap of 1 into 4 parts: only part 1 (key_position 0) carries the sinks, parts 2–4 none
// (their requests have none, their traces echo none); the sink joins the merged state once after
// the last part, and the merged output equals the unsplit /v1/tiled row 5 and the float64 softmax
// with the sink computed here, and the parts' RowDone (output, lse) merge to it; with the window
// of 2, part 1 sees no key and carries only the sink (its lse is the sink's), and the merge still
// equals the float64 answer. Saves the sink view beside SCREENSHOT as *-sinks.png.
// Then a ragged batch: "Sequences" 5,1,10 / 7,1,9 (16 query rows, 17 keys: the sums replace N),
// block_k 5, the left window 4, row 12: its sequence (rows 6…15, keys 8…16, 10 queries bottom-right
// against 9 keys) puts it at p = 5 over its keys t = j − 8, so keys 0…7 are hidden as another
// sequence's, 8 by the window and 14…16 by the causal mask; the request carries cuSeqlensQ/K and
// the packed shapes, the sequence's bar spans keys 8…16 and the window band 9…16, the traced tiles
// carry the server's marks (keys 5…7 of tile 1 in another sequence), each key's bias is
// −2^-8·|13 − j|, and the final output is that sequence's softmax computed here. Bad sequences,
// and sequences with "keys in a KV cache", are refused by the page with a message, and so is
// "Split and merge" of a ragged batch. Saves the ragged view beside SCREENSHOT as *-ragged.png.
// Usage: node mask_test.js URL SCREENSHOT
'use strict';
const {chromium} = require('playwright-core');
const [url, screenshot] = process.argv.slice(2);
const failures = [];
let passed = 0;
// The viewer draws on an animation frame (run.js, scheduleDraw): what a check reads after a run
// or a step button is on the page only once that frame ran. Two frames: the queued draw's, and
// one it may queue in turn.
const drawn = (page) => page.evaluate(
    () => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));

function check(name, ok, detail) {
  if (ok) { ++passed; console.log(`ok   ${name}`); }
  else { failures.push(name); console.log(`FAIL ${name}${detail ? `: ${detail}` : ''}`); }
}
const numbersIn = (text) => (text.replace(/−/g, '-').match(/-?\d+(\.\d+)?(e-?\d+)?/g) || []).map(Number);
const ROW = 5, LEFT = 2, SLOPE = Math.pow(2, -8), N = 8, D = 4;
// The seed's row `row` over keys lo…hi (packed indices), each score capped at `cap` (cap·tanh(s /
// cap); none when absent) and then key j biased by −SLOPE·distance(j), with the attention sink
// `sink` when given (one more logit of the sum, with no value), in float64: {out, lse, share (the
// sink's weight, e^(sink − lse); 0 without)}.
function expectedRow(row, lo, hi, distance, cap, sink) {
  const q = (i, j) => ((i + j) % 5) - 2;
  const k = (i, j) => (((2 * i + j) % 7) - 3) / 2;
  const v = (i, j) => ((i + j) % 9) - 4;
  const s = [];
  for (let j = lo; j <= hi; ++j) {
    let dot = 0;
    for (let c = 0; c < D; ++c) dot += q(row, c) * k(j, c);
    const scaled = dot / Math.sqrt(D);
    s.push([j, (cap ? cap * Math.tanh(scaled / cap) : scaled) - SLOPE * distance(j)]);
  }
  const withSink = sink !== undefined;
  const m = Math.max(...s.map(([, x]) => x), withSink ? sink : -Infinity);
  let sum = withSink ? Math.exp(sink - m) : 0;
  const out = new Array(D).fill(0);
  for (const [j, x] of s) {
    const w = Math.exp(x - m);
    sum += w;
    for (let c = 0; c < D; ++c) out[c] += w * v(j, c);
  }
  const lse = m + Math.log(sum);
  return {out: out.map((x) => x / sum), lse, share: withSink ? Math.exp(sink - lse) : 0};
}
const expectedOut = (row, lo, hi, distance, cap) => expectedRow(row, lo, hi, distance, cap).out;
const near = (a, b, tol) => a.length === b.length && a.every((x, i) => Math.abs(x - b[i]) <= tol);
// Float32 tensor JSON, for requests sent from here.
const tensorJson = (values, rows, d) => ({shape: [rows, d], dtype: 'DTYPE_FLOAT32',
                                          data: Buffer.from(new Float32Array(values).buffer).toString('base64')});
// One row of a float32 output tensor's JSON.
function rowOf(tensor, row, d) {
  const bytes = Buffer.from((tensor && tensor.data) || '', 'base64');
  if (!tensor || !tensor.shape || Number(tensor.shape.at(-1)) !== d || bytes.length < (row + 1) * d * 4) return [];
  return Array.from({length: d}, (_, c) => bytes.readFloatLE((row * d + c) * 4));
}
(async () => {
  const browser = await chromium.launch({
    executablePath: '/usr/bin/chromium', headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
           '--disable-background-networking', '--disable-component-update', '--disable-sync']});
  try {
    const page = await browser.newPage({viewport: {width: 1280, height: 900}});
    page.setDefaultTimeout(30000);
    const errors = [];
    page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
    page.on('pageerror', (e) => errors.push(`uncaught: ${e.message}`));
    let posts = 0, traceBody = null;
    const traceBodies = [];  // every /v1/trace request's body, in order
    page.on('request', (r) => {
      if (r.method() !== 'POST') return;
      ++posts;
      if (new URL(r.url()).pathname === '/v1/trace') {
        traceBody = JSON.parse(r.postData() || 'null');
        traceBodies.push(traceBody);
      }
    });
    await page.goto(url, {waitUntil: 'load'});
    await page.selectOption('#example', 'seed');
    await page.fill('#n', String(N));
    await page.fill('#d', String(D));
    await page.fill('#block-k', '2');
    await page.fill('#row', String(ROW));
    await page.setChecked('#causal', true);

    // Bad values: a message on the page, no request.
    for (const [id, value, pattern] of [['#window-left', '-1', /Window left must be a whole number/],
                                        ['#window-right', '1.5', /Window right must be a whole number/],
                                        ['#softcap', '-1', /Softcap must be a finite number/]]) {
      await page.fill('#window-left', '');
      await page.fill('#window-right', '');
      await page.fill('#softcap', '0');
      await page.fill(id, value);
      const before = posts;
      await page.click('#run');
      await page.waitForFunction(() => !document.getElementById('error').hidden);
      const text = await page.textContent('#error');
      check(`${id} = ${value} is refused in the page`, pattern.test(text) && posts === before,
            `error "${text}", ${posts - before} requests`);
    }

    await page.fill('#window-left', String(LEFT));
    await page.fill('#window-right', '');
    await page.fill('#softcap', '0');
    await page.setChecked('#alibi', true);
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const err = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('the windowed ALiBi run shows no error', err === '', err);

    const cells = await page.$$eval('#score-table tr[data-key]', (rows) => rows.map((r) => ({
      key: Number(r.dataset.key),
      hidden: r.querySelector('td.score').dataset.hidden,
      text: r.querySelector('td.score').textContent,
      bias: r.querySelector('td.bias') ? Number(r.querySelector('td.bias').dataset.value) : NaN,
    })));
    const why = (j) => (j < ROW - LEFT ? 'window' : j > ROW ? 'causal' : 'none');
    check('idea 1 marks keys 0–2 hidden by the window and 6–7 by the causal mask',
          cells.length === N && cells.every((c) => c.hidden === why(c.key) &&
                                            (c.hidden === 'none' || c.text.includes(c.hidden))),
          JSON.stringify(cells.map((c) => `${c.key}:${c.hidden}`)));
    check('idea 1 shows each key\'s bias −2^-8·|5 − j|',
          cells.length === N && cells.every((c) => Math.abs(c.bias + SLOPE * Math.abs(ROW - c.key)) < 1e-9),
          JSON.stringify(cells.map((c) => c.bias)));
    const band = await page.$eval('#idea1-band rect.band', (r) => [r.dataset.lo, r.dataset.hi])
        .catch(() => null);
    check('idea 1 draws the window band over keys 3…7 (right unbounded)',
          band && band[0] === '3' && band[1] === '7',
          JSON.stringify(band));
    check('one sequence: no sequence bar, no "another sequence" legend',
          await page.locator('#idea1-band rect.sequence-bar').count() === 0 &&
              !/another sequence/.test(await page.textContent('#idea1-band')));

    // The first traced tile holds key 2 (hidden by the window, bias −3·2^-8) and key 3.
    if (await page.isEnabled('#step-first')) await page.click('#step-first');
    await drawn(page);
    const tile = await page.$$eval('#tile-table tr[data-key]', (rows) => rows.map((r) => ({
      key: Number(r.dataset.key), hidden: r.querySelector('td.score').dataset.hidden,
      bias: r.querySelector('td.bias') ? Number(r.querySelector('td.bias').dataset.value) : NaN})));
    const k2 = tile.find((t) => t.key === 2);
    check('the first tile step marks key 2 as hidden by the window, bias −3·2^-8',
          k2 && k2.hidden === 'window' && Math.abs(k2.bias + 3 * SLOPE) < 1e-9 &&
              tile.some((t) => t.key === 3 && t.hidden === 'none'),
          JSON.stringify(tile));
    if (await page.isEnabled('#step-last')) await page.click('#step-last');
    await drawn(page);
    const shown = numbersIn(await page.textContent('#final-output'));
    const expected = expectedOut(ROW, ROW - LEFT, ROW, (j) => Math.abs(ROW - j));
    check(`the final output is the windowed, biased softmax [${expected.map((x) => x.toFixed(4))}]`,
          shown.length === D && shown.every((x, i) => Math.abs(x - expected[i]) <= 5e-5), String(shown));
    await page.screenshot({path: screenshot, fullPage: true});

    // Split and merge with the causal window, ALiBi and a softcap of 1. First the unsplit run:
    // its /v1/tiled answer for row 5 is what the merge must give.
    const CAP = 1, PARTS = 4;
    const SLICES = [[0, 2], [2, 4], [4, 6], [6, 8]];  // the page's [round(s·N/P), round((s+1)·N/P))
    await page.fill('#softcap', String(CAP));
    const tiledAnswer = page.waitForResponse((r) => r.request().method() === 'POST' &&
                                             new URL(r.url()).pathname === '/v1/tiled');
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const tiledJson = await (await tiledAnswer).json();
    const tiledBytes = Buffer.from((tiledJson.output && tiledJson.output.data) || '', 'base64');
    const vd = tiledJson.output && tiledJson.output.shape ? Number(tiledJson.output.shape.at(-1)) : 0;
    const unsplit = vd === D && tiledBytes.length >= N * D * 4
      ? Array.from({length: D}, (_, c) => tiledBytes.readFloatLE((ROW * D + c) * 4)) : [];
    const capped = expectedOut(ROW, ROW - LEFT, ROW, (j) => Math.abs(ROW - j), CAP);
    check(`the unsplit Tiled row 5 is the capped, biased, windowed softmax [${capped.map((x) => x.toFixed(4))}]`,
          unsplit.length === D && unsplit.every((x, i) => Math.abs(x - capped[i]) <= 5e-5),
          `${JSON.stringify(tiledJson.output && tiledJson.output.shape)} ${unsplit}`);

    await page.fill('#merge-parts', String(PARTS));
    const serialBefore = await page.getAttribute('#merge-source', 'data-serial');
    traceBodies.length = 0;
    await page.click('#merge-run');
    await page.waitForFunction(
        (old) => document.getElementById('merge-source').dataset.serial !== old, serialBefore);
    const splitErr = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('the split of the windowed, capped ALiBi problem shows no error', splitErr === '', splitErr);
    const sent = traceBodies.map((b) => b && b.attention)
        .sort((x, y) => Number(x && x.options && x.options.keyPosition) -
                        Number(y && y.options && y.options.keyPosition));
    const carried = (a, [lo, hi], left = LEFT) => {
      const o = (a && a.options) || {};
      return o.causal === true && Number(o.windowLeft) === left && o.windowRight === undefined &&
          Number(o.softcap) === CAP && JSON.stringify((o.alibiSlopes || []).map(Number)) === JSON.stringify([SLOPE]) &&
          Number(o.keyPosition || 0) === lo && Number(o.queryPosition || 0) === 0 &&
          o.returnLse === true && JSON.stringify(a.key.shape) === JSON.stringify([hi - lo, D]) &&
          JSON.stringify(a.query.shape) === JSON.stringify([N, D]);
    };
    check(`each of the ${PARTS} slices' /v1/trace carries the window, softcap, slope and its positions`,
          sent.length === PARTS && sent.every((a, i) => carried(a, SLICES[i])),
          JSON.stringify(sent.map((a) => a && a.options)));
    const partsText = await page.textContent('#merge-parts-table');
    const noKey = partsText.match(/saw no key[^)]*\)/g) || [];
    check('parts 1 and 4 saw no key: the window hides part 1, the causal mask part 4',
          noKey.length === 2 && /the window hides/.test(noKey[0]) && /the causal mask hides/.test(noKey[1]),
          partsText);
    const hatched = await page.$$eval('#merge-keys rect.unseen',
                                      (rs) => rs.map((r) => `${r.dataset.hidden}:${r.dataset.lo}-${r.dataset.hi}`));
    check('the merge\'s key axis hatches keys 0–2 (window) and 6–7 (causal)',
          JSON.stringify(hatched) === JSON.stringify(['window:0-2', 'causal:6-7']), JSON.stringify(hatched));
    const factors = (await page.locator('#merge-steps-table td.part-rescale').allTextContents())
        .map((t) => numbersIn(t)[0]);
    check('the empty parts 1 and 4 enter the merge with factor 0',
          factors.length === PARTS && factors[0] === 0 && factors[3] === 0 && factors[1] > 0 && factors[2] > 0,
          String(factors));
    if (await page.isEnabled('#merge-last')) await page.click('#merge-last');
    const mergedOut = numbersIn(await page.textContent('#merge-output'));
    check('the merged output equals the unsplit Tiled output of row 5 (within 5e-5)',
          mergedOut.length === D && unsplit.length === D &&
              mergedOut.every((x, i) => Math.abs(x - unsplit[i]) <= 5e-5),
          `merged ${mergedOut}, unsplit ${unsplit}`);
    check('the merged output is the capped, biased, windowed softmax computed here (within 5e-5)',
          mergedOut.length === D && mergedOut.every((x, i) => Math.abs(x - capped[i]) <= 5e-5),
          `merged ${mergedOut}, here ${capped}`);
    const splitMergeErr = numbersIn(await page.textContent('#merge-error'))[0];
    check('the merged output is within 1e-5 of the page\'s full-matrix reference (same mask and bias)',
          splitMergeErr < 1e-5, String(splitMergeErr));
    await page.fill('#softcap', '0');

    // Attention sinks. Bad values: a message on the page, no request.
    for (const [value, pattern] of [['abc', /Sinks: "abc" is not a finite number/],
                                    ['Infinity', /Sinks: "Infinity" is not a finite number/],
                                    ['1,,2', /Sinks: an empty value/],
                                    ['1, 2', /Sinks: 2 values, but the page's problems have 1 query head/]]) {
      await page.fill('#sinks', value);
      const before = posts;
      await page.click('#run');
      await page.waitForFunction(() => !document.getElementById('error').hidden);
      const text = await page.textContent('#error');
      check(`sinks "${value}" are refused in the page`, pattern.test(text) && posts === before,
            `error "${text}", ${posts - before} requests`);
    }
    // The server's own checks, through the gateway (from here, not the page: its console stays
    // clean): one sink per query head, each finite.
    {
      const tiny = {query: tensorJson([1, 0, 0, 1], 2, 2), key: tensorJson([1, 0, 0, 1], 2, 2),
                    value: tensorJson([1, 2, 3, 4], 2, 2)};
      for (const [sinks, pattern] of [[[0.5, 1], /options\.sinks/], [['NaN'], /options\.sinks\[0\]/]]) {
        const response = await fetch(new URL('/v1/tiled', url), {
          method: 'POST', headers: {'Content-Type': 'application/json'},
          body: JSON.stringify({...tiny, options: {sinks}})});
        const text = await response.text();
        check(`the server refuses sinks ${JSON.stringify(sinks)} for one head, naming the field`,
              response.status === 400 && /INVALID_ARGUMENT/.test(text) && pattern.test(text),
              `${response.status} ${text}`);
      }
    }

    // The causal window of 4 with ALiBi and a sink: row 5 sees keys 1…5, and the sink.
    const SINK = 1.5, SLEFT = 4;
    await page.fill('#sinks', String(SINK));
    await page.fill('#window-left', String(SLEFT));
    const sinkNote = await page.textContent('#problem-note');
    check('the note describes the sink', /Attention sink: logit 1\.5 per query head/.test(sinkNote), sinkNote);
    traceBody = null;
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const sinkErr = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('the run with a sink shows no error', sinkErr === '', sinkErr);
    const sinkOptions = (traceBody && traceBody.attention && traceBody.attention.options) || {};
    check('the trace request carries options.sinks [1.5]',
          JSON.stringify((sinkOptions.sinks || []).map(Number)) === JSON.stringify([SINK]),
          JSON.stringify(sinkOptions));
    const withSink = expectedRow(ROW, ROW - SLEFT, ROW, (j) => Math.abs(ROW - j), 0, SINK);
    const idea1 = await page.$eval('#score-table', (table) => {
      const sink = table.querySelector('tr.sink');
      return {
        keys: Array.from(table.querySelectorAll('tr[data-key] td.weight'), (td) => Number(td.dataset.value)),
        logit: sink ? Number(sink.querySelector('td.sink-logit').dataset.value) : NaN,
        share: sink ? Number(sink.querySelector('td.sink-share').dataset.value) : NaN,
        label: sink ? sink.cells[0].textContent : '',
        caption: (table.querySelector('caption') || {}).textContent || '',
      };
    });
    const keySum = idea1.keys.reduce((a, w) => a + w, 0);
    check(`idea 1 draws the sink's row: logit 1.5, share e^(sink − lse) = ${withSink.share.toFixed(6)}`,
          idea1.label === 'sink' && idea1.logit === SINK && Math.abs(idea1.share - withSink.share) < 1e-5,
          JSON.stringify(idea1));
    check('idea 1: the keys\' weights sum to 1 − the sink\'s share, as its caption says',
          idea1.keys.length === N && Math.abs(keySum - (1 - withSink.share)) < 1e-5 &&
              /sink logit 1\.500000 takes/.test(idea1.caption) && /keys' weights sum to 1 −/.test(idea1.caption),
          `Σ ${keySum}, 1 − share ${1 - withSink.share}; ${idea1.caption}`);
    if (await page.isEnabled('#step-last')) await page.click('#step-last');
    await drawn(page);
    const sinkShown = numbersIn(await page.textContent('#final-output'));
    check(`the final output is the windowed, biased softmax with the sink [${withSink.out.map((x) => x.toFixed(4))}]`,
          near(sinkShown, withSink.out, 5e-5), `${sinkShown} vs ${withSink.out}`);
    const naiveShown = numbersIn(await page.textContent('#naive-output'));
    check('Naive\'s row 5 is the same softmax with the sink', near(naiveShown, withSink.out, 5e-5),
          String(naiveShown));
    const join = await page.$eval('#sink-join', (p) => ({hidden: p.hidden, share: Number(p.dataset.share),
                                                        text: p.textContent}));
    check('after the last tile the sink\'s join is shown, with its share',
          !join.hidden && Math.abs(join.share - withSink.share) < 1e-5 && /output = estimate × \(1 − sink_share\)/.test(join.text),
          JSON.stringify(join));
    const accClose = await page.locator('#acc-table td.close').count();
    check('the last step\'s estimate (keys only) matches the keys\' part of the reference, every component',
          accClose === D, `${accClose} close of ${D}`);
    await page.screenshot({path: screenshot.replace(/\.png$/, '') + '-sinks.png', fullPage: true});

    // Split and merge with the sink (and a softcap of 1): the unsplit Tiled answer first.
    await page.fill('#softcap', String(CAP));
    const sinkTiled = page.waitForResponse((r) => r.request().method() === 'POST' &&
                                           new URL(r.url()).pathname === '/v1/tiled');
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const sinkUnsplit = rowOf((await (await sinkTiled).json()).output, ROW, D);
    const cappedSink = expectedRow(ROW, ROW - SLEFT, ROW, (j) => Math.abs(ROW - j), CAP, SINK);
    check('the unsplit Tiled row 5 with the sink is the float64 softmax with the sink',
          near(sinkUnsplit, cappedSink.out, 5e-5), `${sinkUnsplit} vs ${cappedSink.out}`);
    const splitWithSink = async (left) => {
      const before = await page.getAttribute('#merge-source', 'data-serial');
      traceBodies.length = 0;
      await page.click('#merge-run');
      await page.waitForFunction(
          (old) => document.getElementById('merge-source').dataset.serial !== old, before);
      if (await page.isEnabled('#merge-last')) await page.click('#merge-last');
      const err = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
      return {
        err,
        sent: traceBodies.map((b) => b && b.attention)
            .sort((x, y) => Number(x && x.options && x.options.keyPosition) -
                            Number(y && y.options && y.options.keyPosition)),
        carriers: await page.$$eval('#merge-parts-table td.sink', (tds) => tds.map((td) => td.dataset.sink)),
        partsText: await page.textContent('#merge-parts-table'),
        merged: numbersIn(await page.textContent('#merge-output')),
        error: numbersIn(await page.textContent('#merge-error'))[0],
        rowDoneDiff: Number(await page.getAttribute('#merge-check', 'data-row-done-diff')),
        note: await page.$eval('#merge-sink', (p) => ({hidden: p.hidden, share: Number(p.dataset.share)})),
        sinkSteps: await page.locator('#merge-steps-table tr.sink-step').count(),
        factors: await page.locator('#merge-steps-table td.part-rescale').count(),
        left,
      };
    };
    const sinksOf = (a) => ((a && a.options && a.options.sinks) || []).map(Number);
    const split4 = await splitWithSink(SLEFT);
    check('the split with the sink shows no error', split4.err === '', split4.err);
    check('only part 1 (key_position 0) sends the sinks; parts 2–4 send none, with the rest of the options',
          split4.sent.length === PARTS && split4.sent.every((a, i) => carried(a, SLICES[i], SLEFT)) &&
              JSON.stringify(sinksOf(split4.sent[0])) === JSON.stringify([SINK]) &&
              split4.sent.slice(1).every((a) => a.options.sinks === undefined),
          JSON.stringify(split4.sent.map((a) => a && a.options)));
    check('the parts table shows the sink on part 1 only (what each trace echoed)',
          JSON.stringify(split4.carriers) === JSON.stringify([String(SINK), 'none', 'none', 'none']),
          JSON.stringify(split4.carriers));
    check('the sink joins once, after the last part (one step row, one share)',
          split4.sinkSteps === 1 && split4.factors === PARTS && !split4.note.hidden &&
              Math.abs(split4.note.share - cappedSink.share) < 1e-5,
          JSON.stringify({steps: split4.sinkSteps, factors: split4.factors, note: split4.note,
                          expected: cappedSink.share}));
    check('split and merge with the sink equals the unsplit Tiled row 5 (within 5e-5)',
          near(split4.merged, sinkUnsplit, 5e-5), `merged ${split4.merged}, unsplit ${sinkUnsplit}`);
    check('split and merge with the sink equals the float64 softmax with the sink (within 5e-5)',
          near(split4.merged, cappedSink.out, 5e-5) && split4.error < 1e-5,
          `merged ${split4.merged}, here ${cappedSink.out}, page's reference error ${split4.error}`);
    check('the parts\' RowDone (output, lse), part 1\'s with the sink, merge to the same output',
          split4.rowDoneDiff < 1e-5, String(split4.rowDoneDiff));

    // The window of 2: part 1 sees none of its keys and carries only the sink.
    await page.fill('#window-left', String(LEFT));
    const split2 = await splitWithSink(LEFT);
    const capped2 = expectedRow(ROW, ROW - LEFT, ROW, (j) => Math.abs(ROW - j), CAP, SINK);
    check('window 2: part 1 sees no key and sends the only sink',
          split2.err === '' && split2.sent.length === PARTS &&
              split2.sent.every((a, i) => carried(a, SLICES[i], LEFT)) &&
              JSON.stringify(sinksOf(split2.sent[0])) === JSON.stringify([SINK]) &&
              split2.sent.slice(1).every((a) => a.options.sinks === undefined) &&
              /its lse 1\.5000 is the sink's alone/.test(split2.partsText),
          `${split2.err} ${JSON.stringify(split2.carriers)} ${split2.partsText}`);
    check('window 2: the merge with the sink equals the float64 softmax with the sink, and the RowDone merge',
          near(split2.merged, capped2.out, 5e-5) && split2.error < 1e-5 && split2.rowDoneDiff < 1e-5,
          `merged ${split2.merged}, here ${capped2.out}, error ${split2.error}, RowDone Δ ${split2.rowDoneDiff}`);
    await page.fill('#sinks', '');
    await page.fill('#softcap', '0');

    // A ragged batch. Bad sequences: a message on the page, no request.
    await page.fill('#window-left', '4');
    for (const [value, pattern] of [['5,1,10 / 7,1', /3 query length\(s\) but 2 key length\(s\)/],
                                    ['5,-1,10 / 7,1,9', /query length "-1" is not a whole number ≥ 0/],
                                    ['5,1,10 / 7,1,9 / 2', /one at most/],
                                    ['0,0 / 3,4', /query lengths add up to 0/]]) {
      await page.fill('#sequences', value);
      const before = posts;
      await page.click('#run');
      await page.waitForFunction(() => !document.getElementById('error').hidden);
      const text = await page.textContent('#error');
      check(`sequences "${value}" are refused in the page`, pattern.test(text) && posts === before,
            `error "${text}", ${posts - before} requests`);
    }
    const SEQ = '5,1,10 / 7,1,9', RROW = 12, RLEFT = 4;
    await page.fill('#sequences', SEQ);
    await page.setChecked('#use-cache', true);
    {
      const before = posts;
      await page.click('#run');
      await page.waitForFunction(() => !document.getElementById('error').hidden);
      const text = await page.textContent('#error');
      check('sequences with "keys in a KV cache" are refused in the page',
            /do not mix/.test(text) && posts === before, `error "${text}", ${posts - before} requests`);
    }
    await page.setChecked('#use-cache', false);
    await page.fill('#n', String(N));  // not the sums: the sequences set the sizes
    await page.fill('#block-k', '5');
    await page.fill('#row', String(RROW));
    const note = await page.textContent('#problem-note');
    check('the note gives the packed sizes', /16 query rows and 17 keys/.test(note), note);
    traceBody = null;
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    await drawn(page);
    const rerr = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('the ragged run shows no error', rerr === '', rerr);
    const a = traceBody && traceBody.attention;
    check('the trace request carries cuSeqlensQ [0,5,6,16], cuSeqlensK [0,7,8,17] and the packed shapes',
          a && JSON.stringify((a.cuSeqlensQ || []).map(Number)) === '[0,5,6,16]' &&
              JSON.stringify((a.cuSeqlensK || []).map(Number)) === '[0,7,8,17]' &&
              JSON.stringify(a.query.shape) === '[16,4]' && JSON.stringify(a.key.shape) === '[17,4]' &&
              JSON.stringify(a.value.shape) === '[17,4]',
          a && JSON.stringify({q: a.cuSeqlensQ, k: a.cuSeqlensK, qs: a.query.shape, ks: a.key.shape}));

    // Row 12: its sequence is rows 6…15 and keys 8…16, so p = 9 − 10 + 6 = 5 and key j is at j − 8.
    const rwhy = (j) => (j < 8 ? 'sequence' : j < 8 + 5 - RLEFT ? 'window' : j > 8 + 5 ? 'causal' : 'none');
    const rcells = await page.$$eval('#score-table tr[data-key]', (rows) => rows.map((r) => ({
      key: Number(r.dataset.key),
      hidden: r.querySelector('td.score').dataset.hidden,
      text: r.querySelector('td.score').textContent,
      bias: r.querySelector('td.bias') ? Number(r.querySelector('td.bias').dataset.value) : NaN,
    })));
    check('idea 1 marks keys 0–7 as another sequence\'s, 8 hidden by the window, 14–16 by the causal mask',
          rcells.length === 17 && rcells.every((c) => c.hidden === rwhy(c.key)) &&
              rcells.filter((c) => c.hidden === 'sequence').every((c) => c.text.includes('other sequence')),
          JSON.stringify(rcells.map((c) => `${c.key}:${c.hidden}`)));
    check('idea 1 shows each key\'s bias −2^-8·|13 − j| (distances within the sequence)',
          rcells.length === 17 && rcells.every((c) => Math.abs(c.bias + SLOPE * Math.abs(13 - c.key)) < 1e-9),
          JSON.stringify(rcells.map((c) => c.bias)));
    const rband = await page.$eval('#idea1-band', (chart) => ({
      window: (chart.querySelector('rect.band') || {dataset: {}}).dataset,
      seq: (chart.querySelector('rect.sequence-bar') || {dataset: {}}).dataset,
      edges: chart.querySelectorAll('line.sequence-edge').length,
      keys: Array.from(chart.querySelectorAll('rect.key'), (r) => r.dataset.hidden),
      text: chart.textContent,
    }));
    check('idea 1 draws its sequence\'s bar over keys 8…16 and the window band over 9…16 (right unbounded)',
          rband.seq.sequence === '2' && rband.seq.lo === '8' && rband.seq.hi === '16' &&
              rband.edges === 2 && rband.window.lo === '9' && rband.window.hi === '16',
          JSON.stringify({window: rband.window, seq: rband.seq, edges: rband.edges}));
    check('idea 1\'s key band marks keys 0–7 "sequence", with the legend entry',
          rband.keys.length === 17 && rband.keys.every((h, j) => h === rwhy(j)) &&
              /0s/.test(rband.text) && /s: in another sequence/.test(rband.text),
          JSON.stringify(rband));

    // The traced tiles are 1 (keys 5…9) and 2 (keys 10…14); the server marks them.
    if (await page.isEnabled('#step-first')) await page.click('#step-first');
    await drawn(page);
    const tile1 = await page.$$eval('#tile-table tr[data-key]', (rows) => rows.map((r) => ({
      key: Number(r.dataset.key), hidden: r.querySelector('td.score').dataset.hidden,
      text: r.querySelector('td.score').textContent})));
    check('the first tile step (keys 5…9) shows 5–7 in another sequence, 8 hidden by the window',
          tile1.length === 5 && tile1.every((t) => t.hidden === rwhy(t.key)) &&
              tile1.slice(0, 3).every((t) => t.text.includes('other sequence')),
          JSON.stringify(tile1));
    const tband = await page.$$eval('#tile-band rect.key', (rs) => rs.map((r) => r.dataset.hidden));
    check('the tile\'s key band marks the same keys',
          tband.length === 17 && tband.every((h, j) => h === rwhy(j)), JSON.stringify(tband));
    if (await page.isEnabled('#step-last')) await page.click('#step-last');
    await drawn(page);
    const tile2 = await page.$$eval('#tile-table tr[data-key]', (rows) => rows.map((r) => ({
      key: Number(r.dataset.key), hidden: r.querySelector('td.score').dataset.hidden})));
    check('the last tile step (keys 10…14) shows key 14 hidden by the causal mask',
          tile2.length === 5 && tile2.every((t) => t.hidden === rwhy(t.key)), JSON.stringify(tile2));
    const rshown = numbersIn(await page.textContent('#final-output'));
    const rexpected = expectedOut(RROW, 9, 13, (j) => Math.abs(13 - j));
    check(`the final output is row 12's softmax over its sequence's keys 9…13 ` +
          `[${rexpected.map((x) => x.toFixed(4))}]`,
          rshown.length === D && rshown.every((x, i) => Math.abs(x - rexpected[i]) <= 5e-5), String(rshown));
    await page.screenshot({path: screenshot.replace(/\.png$/, '') + '-ragged.png', fullPage: true});
    {
      // Split and merge takes one sequence's keys only.
      const before = posts;
      await page.click('#merge-run');
      await page.waitForFunction(() => !document.getElementById('error').hidden);
      const text = await page.textContent('#error');
      check('split and merge of a ragged batch is refused in the page',
            /Split and merge cuts one sequence's keys/.test(text) && posts === before,
            `error "${text}", ${posts - before} requests`);
    }
    check('no console errors', errors.length === 0, errors.join(' | '));
  } finally {
    await browser.close();
  }
})().then(() => {
  console.log(`masks: ${passed} passed, ${failures.length} failed`);
  process.exit(failures.length ? 1 : 0);
}, (e) => {
  console.log(`FAIL ${e.stack || e}`);
  process.exit(1);
});
