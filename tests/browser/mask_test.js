// The viewer's masks and biases (tests/browser_test.sh runs it after viewer_test.js): the seed
// example, causal with a left window of 2 and ALiBi's standard slope (one head: 2^-8), row 5
// (query at position 5, key j at j): keys 0…2 are hidden by the window, 6 and 7 by the causal
// mask, the window band covers keys 3…7 (right side unbounded), key j's bias is −2^-8·|5 − j|,
// and the final output is the masked, biased softmax computed here in float64. Bad window and
// softcap values are refused by the page with a message, before any request.
// Usage: node mask_test.js URL SCREENSHOT
'use strict';
const {chromium} = require('playwright-core');
const [url, screenshot] = process.argv.slice(2);
const failures = [];
let passed = 0;
function check(name, ok, detail) {
  if (ok) { ++passed; console.log(`ok   ${name}`); }
  else { failures.push(name); console.log(`FAIL ${name}${detail ? `: ${detail}` : ''}`); }
}
const numbersIn = (text) => (text.replace(/−/g, '-').match(/-?\d+(\.\d+)?(e-?\d+)?/g) || []).map(Number);
const ROW = 5, LEFT = 2, SLOPE = Math.pow(2, -8), N = 8, D = 4;
function expectedOut() {
  const q = (i, j) => ((i + j) % 5) - 2;
  const k = (i, j) => (((2 * i + j) % 7) - 3) / 2;
  const v = (i, j) => ((i + j) % 9) - 4;
  const s = [];
  for (let j = ROW - LEFT; j <= ROW; ++j) {
    let dot = 0;
    for (let c = 0; c < D; ++c) dot += q(ROW, c) * k(j, c);
    s.push([j, dot / Math.sqrt(D) - SLOPE * Math.abs(ROW - j)]);
  }
  const m = Math.max(...s.map(([, x]) => x));
  let sum = 0;
  const out = new Array(D).fill(0);
  for (const [j, x] of s) {
    const w = Math.exp(x - m);
    sum += w;
    for (let c = 0; c < D; ++c) out[c] += w * v(j, c);
  }
  return out.map((x) => x / sum);
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
    let posts = 0;
    page.on('request', (r) => { if (r.method() === 'POST') ++posts; });
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

    // The first traced tile holds key 2 (hidden by the window, bias −3·2^-8) and key 3.
    if (await page.isEnabled('#step-first')) await page.click('#step-first');
    const tile = await page.$$eval('#tile-table tr[data-key]', (rows) => rows.map((r) => ({
      key: Number(r.dataset.key), hidden: r.querySelector('td.score').dataset.hidden,
      bias: r.querySelector('td.bias') ? Number(r.querySelector('td.bias').dataset.value) : NaN})));
    const k2 = tile.find((t) => t.key === 2);
    check('the first tile step marks key 2 as hidden by the window, bias −3·2^-8',
          k2 && k2.hidden === 'window' && Math.abs(k2.bias + 3 * SLOPE) < 1e-9 &&
              tile.some((t) => t.key === 3 && t.hidden === 'none'),
          JSON.stringify(tile));
    if (await page.isEnabled('#step-last')) await page.click('#step-last');
    const shown = numbersIn(await page.textContent('#final-output'));
    const expected = expectedOut();
    check(`the final output is the windowed, biased softmax [${expected.map((x) => x.toFixed(4))}]`,
          shown.length === D && shown.every((x, i) => Math.abs(x - expected[i]) <= 5e-5), String(shown));
    await page.screenshot({path: screenshot, fullPage: true});
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
