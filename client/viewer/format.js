// Numbers in and out of the page: the protobuf JSON mapping's numbers read (num, nums), a traced
// row's identity (rowKey), and numbers written for people (fmt, fmtVector, fmtBytes).
// Exports (AttnViewer.format): num, nums, rowKey, fmt, fmtVector, fmtBytes.
// Loaded first of the viewer's scripts (index.html lists their order); it depends on nothing.
'use strict';

(() => {
  // Protobuf JSON mapping: floats may be "Infinity", "-Infinity" or "NaN"; int64 may be strings;
  // fields equal to their default are omitted.
  function num(x) {
    if (x === undefined || x === null) return 0;
    if (typeof x === 'number') return x;
    if (x === 'Infinity') return Infinity;
    if (x === '-Infinity') return -Infinity;
    if (x === 'NaN') return NaN;
    return Number(x);
  }
  const nums = (a) => (a || []).map(num);

  // A traced row (TraceRow JSON, fields possibly omitted) as a map key: "batch/head/row".
  const rowKey = (r) => `${num(r && r.batch)}/${num(r && r.head)}/${num(r && r.row)}`;

  function fmt(x, digits = 4) {
    if (x === -Infinity) return '−∞';
    if (x === Infinity) return '∞';
    if (Number.isNaN(x)) return 'NaN';
    if (x === 0) return '0';
    const a = Math.abs(x);
    if (a >= 1e5 || a < Math.pow(10, -digits)) return x.toExponential(3).replace('-', '−');
    return x.toFixed(digits).replace('-', '−');
  }
  const fmtVector = (v, digits) => '[' + Array.from(v, (x) => fmt(x, digits)).join(', ') + ']';

  function fmtBytes(b) {
    const units = ['KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
    let s = `${b} bytes`;
    if (b >= 1024) {
      let x = b / 1024, u = 0;
      while (x >= 1024 && u < units.length - 1) { x /= 1024; ++u; }
      s += ` (${x.toPrecision(3)} ${units[u]})`;
    }
    return s;
  }

  (globalThis.AttnViewer ??= {}).format = {num, nums, rowKey, fmt, fmtVector, fmtBytes};
})();
