// Building the page's nodes: an element by id ($), an HTML element (el) or an SVG node (svg) with
// its attributes and children; and the page's two message lines: the error box (showError,
// clearError) and the status line (setStatus).
// Exports (AttnViewer.dom): $, el, svg, showError, clearError, setStatus.
'use strict';

(() => {
  const SVG_NS = 'http://www.w3.org/2000/svg';

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') e.className = v;
      else if (k === 'style') e.style.cssText = v;
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c);
    return e;
  }
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function showError(message) {
    const box = $('error');
    box.hidden = false;
    box.append(el('div', {}, message));
  }
  function clearError() { $('error').hidden = true; $('error').replaceChildren(); }
  function setStatus(text) { $('status').textContent = text; }

  (globalThis.AttnViewer ??= {}).dom = {$, el, svg, showError, clearError, setStatus};
})();
