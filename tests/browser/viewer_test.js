// Drives attnd's web viewer in Debian's chromium through playwright-core (tests/browser_test.sh).
//
// Loads the page from a running attnd, runs the seed example's trace of row 0 with block_k 2,
// steps to the end and checks: the displayed final output equals the seed's out[0] (computed here
// in float64, independently of the server) to 4 decimals; the byte accounting shows 1024 bytes
// for Naive at N = 8; the tied scores of row 0 are highlighted; no console errors; the same run
// with "keys in a KV cache" (the keys stored in a server-resident cache first) gives the same
// out[0] and leaves no cache behind. Then checks
// that a bad request's error is shown on the page. Saves a screenshot.
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

    // A row out of range: the server's INVALID_ARGUMENT is shown on the page.
    allowHttpErrors = true;
    await page.fill('#row', '99');
    await page.click('#run');
    await page.waitForFunction(() => /^(Done|Finished)/.test(document.getElementById('status').textContent));
    const shownError = await page.locator('#error').isVisible() ? await page.textContent('#error') : '';
    check('a bad row shows the server\'s error', /HTTP 4\d\d/.test(shownError) && /row/i.test(shownError),
          `error box: "${shownError}"`);
    check('no other console errors', consoleErrors.length === 0, consoleErrors.join(' | '));
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
