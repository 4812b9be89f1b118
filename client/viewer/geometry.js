// Which keys a query row sees: the page's mirror of kernels/geometry.h, read from a trace's
// geometry (TraceStart's fields, as transport.js parses them: keyLen, causal, windowLeft/Right,
// keyPosition, queryPosition, cuSeqlensQ/K). A hidden key's reason is 'sequence' (another sequence
// of a ragged batch), 'causal' (after the row's position) or 'window' (outside p − left … p +
// right); '' is seen. Checked in that order, as the server decides.
// Exports (AttnViewer.geometry): sequenceOf, oneSequence, hiddenByGeometry, hiddenKeys,
// windowRange, keyDistance.
'use strict';

(() => {
  // The keys' side of query row `row` (kernels/geometry.h): its sequence's keys [first, end), and
  // p, the row's position counted from key `first` (key j is then at j − first). One sequence:
  // all the keys, p = query_position + row − key_position, index null. A ragged batch: the last
  // sequence s with cu_seqlens_q[s] ≤ row, whose keys sit at 0 … and queries bottom-right.
  function sequenceOf(start, row) {
    const cq = start.cuSeqlensQ, ck = start.cuSeqlensK;
    if (cq.length < 2) {
      return {index: null, first: 0, end: start.keyLen,
              p: start.queryPosition + row - start.keyPosition};
    }
    let s = 0;
    while (s + 1 < cq.length - 1 && cq[s + 1] <= row) ++s;
    return {index: s, count: cq.length - 1, rowBegin: cq[s], rowEnd: cq[s + 1],
            first: ck[s], end: ck[s + 1], p: (ck[s + 1] - ck[s]) - (cq[s + 1] - cq[s]) + (row - cq[s])};
  }

  // The geometry sequenceOf and hiddenByGeometry read (TraceStart's fields) of one sequence of
  // keyLen keys: causal, the window (null: unbounded) and the positions; no ragged batch.
  function oneSequence({keyLen, causal, windowLeft = null, windowRight = null, keyPosition = 0,
                        queryPosition = 0}) {
    return {keyLen, causal: !!causal, windowLeft, windowRight, keyPosition, queryPosition,
            cuSeqlensQ: [], cuSeqlensK: []};
  }

  // What hides key j from the row of `seq` (sequenceOf) by the trace's geometry, for keys no step
  // carries (tiles the mask hides entirely are not traced): another sequence, then causal, then
  // the window, as the server decides.
  function hiddenByGeometry(start, seq, j) {
    if (j < seq.first || j >= seq.end) return 'sequence';
    const p = seq.p, t = j - seq.first;
    if (start.causal && t > p) return 'causal';
    if (start.windowLeft !== null && t < p - start.windowLeft) return 'window';
    if (start.windowRight !== null && t > p + start.windowRight) return 'window';
    return '';
  }

  // hiddenByGeometry for keys 0 … count − 1, as an array.
  function hiddenKeys(start, seq, count) {
    return Array.from({length: count}, (_, j) => hiddenByGeometry(start, seq, j));
  }

  // The window of the row of `seq` as a key range [lo, hi] (key indices, clipped to its
  // sequence's keys), or null when unbounded on both sides.
  function windowRange(start, seq) {
    if (!start || (start.windowLeft === null && start.windowRight === null)) return null;
    const lo = start.windowLeft === null ? seq.first
                                         : Math.max(seq.first, seq.first + seq.p - start.windowLeft);
    const hi = start.windowRight === null ? seq.end - 1
                                          : Math.min(seq.end - 1, seq.first + seq.p + start.windowRight);
    return {lo, hi};
  }

  // |p − t|, the distance ALiBi biases by, between the row of `seq` and key j (t counted in the
  // row's sequence, as the server does).
  const keyDistance = (seq, j) => Math.abs(seq.p - (j - seq.first));

  (globalThis.AttnViewer ??= {}).geometry = {sequenceOf, oneSequence, hiddenByGeometry, hiddenKeys,
                                             windowRange, keyDistance};
})();
