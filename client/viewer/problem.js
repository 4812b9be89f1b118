// The form's problem: its fields read as a config (readConfig; the "Sequences" field parsed by
// parseSequences, the "Sinks" field by parseSinks), what makes a config unusable (configError),
// the inputs it builds in float32 (buildProblem: the seed example's formulas or a seeded random
// problem) and the note describing them (problemNote).
// Exports (AttnViewer.problem): readConfig, configError, buildProblem, problemNote.
'use strict';

(() => {
  const {$} = AttnViewer.dom;

  const MAX_ELEMENTS = 1 << 22;   // per input tensor; beyond this the browser itself suffers
  const QUERY_HEADS = 1;          // the page's problems have one query head (and one kv head)

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

  // Why the form's problem cannot be built here (a message for the error box), or null.
  function configError(cfg) {
    const ragged = cfg.sequences;
    if (ragged && ragged.error) return ragged.error;
    if (ragged && cfg.useCache) {
      return 'Sequences and "keys in a KV cache" do not mix: a cache holds one sequence ' +
             '(clear one of them).';
    }
    if (!(ragged || cfg.n >= 1) || !(cfg.d >= 1)) return 'N and d must be at least 1.';
    const rows = Math.max(cfg.queryLen, cfg.keyLen);
    if (rows * cfg.d > MAX_ELEMENTS) {
      return `${ragged ? 'The sequences\' longer total' : 'N'} × d = ${rows * cfg.d} is more ` +
             `than this page builds (${MAX_ELEMENTS}).`;
    }
    if (!Number.isFinite(cfg.multiplier)) return 'The query multiplier must be a number.';
    for (const [name, value] of [['Window left', cfg.windowLeft], ['Window right', cfg.windowRight]]) {
      if (value !== null && !(Number.isInteger(value) && value >= 0 && value <= Math.pow(2, 53))) {
        return `${name} must be a whole number ≥ 0, or empty for unbounded.`;
      }
    }
    if (!(Number.isFinite(cfg.softcap) && cfg.softcap >= 0)) {
      return 'Softcap must be a finite number ≥ 0 (0 turns it off).';
    }
    if (cfg.sinks && cfg.sinks.error) return cfg.sinks.error;
    return null;
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
  // {error}, which configError returns.
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

  // The "Sinks" field (AttentionOptions.sinks): null when empty (no sinks); else one finite logit
  // per query head, "0.5" or a comma list "0.5, 1" — one value is applied to every head — as
  // {values} (one per head, what options.sinks carries), or {error}, which configError returns.
  function parseSinks(text) {
    if (text.trim() === '') return null;
    const fail = (why) => ({error: `Sinks: ${why} Write one finite logit per query head, e.g. 0.5 ` +
                                   '(one value: every head; empty: no sinks).'});
    const values = [];
    for (const item of text.trim().split(/\s*,\s*|\s+/)) {
      if (item === '') return fail('an empty value (two commas in a row, or a comma at an end).');
      const x = Number(item);
      if (!Number.isFinite(x)) return fail(`"${item}" is not a finite number.`);
      values.push(x);
    }
    if (values.length === 1) return {values: new Array(QUERY_HEADS).fill(values[0])};
    if (values.length !== QUERY_HEADS) {
      return fail(`${values.length} values, but the page's problems have ${QUERY_HEADS} query ` +
                  `head${QUERY_HEADS === 1 ? '' : 's'}.`);
    }
    return {values};
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
      // Empty = unbounded (null); otherwise the number as typed, checked by configError.
      windowLeft: optionalNumber('window-left'),
      windowRight: optionalNumber('window-right'),
      softcap: $('softcap').value.trim() === '' ? 0 : Number($('softcap').value),
      alibi: $('alibi').checked,
      // null: no sinks; else {values} (one per query head) or {error}.
      sinks: parseSinks($('sinks').value),
    };
  }

  // The text under the form: the inputs' formulas or seed, and a ragged batch's sizes (or why the
  // Sequences field cannot be read).
  function problemNote(cfg) {
    let note = cfg.example === 'seed'
      ? 'Seed: q[i][j] = ((i + j) % 5 − 2) · multiplier, k[i][j] = ((2i + j) % 7 − 3) / 2, ' +
        'v[i][j] = (i + j) % 9 − 4, scale 1/√d (1/2 at d = 4). The seed is 8 × 4; other sizes ' +
        'extend its formulas.'
      : `Random: q, k, v drawn from N(0, 1) with seed ${cfg.randomSeed} (q × multiplier), ` +
        'scale 1/√d.';
    const ragged = cfg.sequences;
    if (ragged) {
      note += ragged.error ? ` ${ragged.error}`
        : ` Ragged batch: ${ragged.q.length} sequence(s), query rows ${ragged.q.join(', ')} and ` +
          `keys ${ragged.k.join(', ')}: ${cfg.queryLen} query rows and ${cfg.keyLen} keys packed ` +
          '(in place of N); each sequence sees only its own keys, its queries bottom-right ' +
          'against them.';
    }
    const sinks = cfg.sinks;
    if (sinks) {
      note += sinks.error ? ` ${sinks.error}`
        : ` Attention sink: logit ${sinks.values.join(', ')} per query head, one more term of each ` +
          'row\'s softmax that takes weight but adds no value (options.sinks; not scaled, capped, ' +
          'biased or masked).';
    }
    return note;
  }

  (globalThis.AttnViewer ??= {}).problem = {readConfig, configError, buildProblem, problemNote};
})();
