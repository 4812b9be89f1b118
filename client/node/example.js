'use strict';
// The seed example (8 queries, keys and values of width 4, scale 1/2) through Tiled, then a
// trace of row 0 with 2 keys per tile: each step's scores, running max, rescale factor,
// denominator and the estimate converging to the full-matrix row.
// Usage: node client/node/example.js [HOST:PORT] [--token T] [--tls-ca ca.pem]
const {Client, seedExample, tensor, toFloat32Array} = require('./client');

function parseArgs(argv) {
  const args = {target: '127.0.0.1:50051', options: {}};
  for (let i = 0; i < argv.length; ++i) {
    if (argv[i] === '--token') args.options.token = argv[++i];
    else if (argv[i] === '--tls-ca') args.options.tlsCa = argv[++i];
    else args.target = argv[i];
  }
  return args;
}

// The seed example as a Tiled request with block_k 2.
function seedRequest() {
  const {q, k, v} = seedExample();
  return {
    query: tensor(q, [8, 4]),
    key: tensor(k, [8, 4]),
    value: tensor(v, [8, 4]),
    options: {scale: 0.5, blockK: 2},
  };
}

const fmt = (x) => (Number.isFinite(x) ? x.toFixed(6) : String(x).replace('Infinity', 'inf'));
const list = (xs) => `[${Array.from(xs, fmt).join(', ')}]`;

async function main() {
  const {target, options} = parseArgs(process.argv.slice(2));
  const client = new Client(target, options);
  try {
    const request = seedRequest();
    const response = await client.tiled(request);
    const out = toFloat32Array(response.output);
    const d = response.output.shape[response.output.shape.length - 1];
    console.log(`out[0] = ${list(out.subarray(0, d))}`);
    console.log(`  (${response.stats.backend}, block_k ${response.stats.blockK}, ` +
                `${response.stats.computeNs} ns)`);

    for await (const ev of client.trace({attention: request, rows: [{row: 0}]})) {
      if (ev.event === 'start') {
        const s = ev.start;
        console.log(`trace: N=${s.queryLen} d=${s.headDim} block_k=${s.blockK} ` +
                    `scale=${s.scale}, ${s.tilesPerRow} tiles per row; Naive would move ` +
                    `${s.naiveIntermediateBytes} bytes, Tiled keeps ` +
                    `${s.tiledScratchFloatsPerRow} floats per row`);
      } else if (ev.event === 'step') {
        const s = ev.step;
        console.log(`tile ${s.tile}, keys [${s.keyBegin}, ${s.keyEnd}): scores ${list(s.scores)}`);
        console.log(`  max ${fmt(s.maxBefore)} -> ${fmt(s.maxAfter)}  rescale ${fmt(s.rescale)}` +
                    `  weights ${list(s.weights)}  denominator ${fmt(s.denominator)}`);
        console.log(`  estimate ${list(s.estimate)}`);
      } else if (ev.event === 'rowDone') {
        const r = ev.rowDone;
        console.log(`row ${r.row.row}: output ${list(r.output)}`);
        console.log(`  full-matrix ${list(r.reference)}, max |online − full| = ` +
                    `${r.maxAbsError.toExponential(2)}, lse ${fmt(r.lse)}`);
      } else if (ev.event === 'end') {
        console.log(`trace end: ${ev.end.rows} rows, ${ev.end.steps} steps`);
      }
    }
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(`example: ${err.message}`);
  process.exit(1);
});
