// Building the page without ever parsing markup from a string.
//
// Security rules every module of the console keeps (the page runs under a strict
// Content-Security-Policy: script, style and requests from this origin only, nothing inline):
// - every string from the API is rendered as text: the DOM is built with createElement,
//   text nodes and textContent only (see el() and add()); no markup is ever parsed from a
//   string (no innerHTML, insertAdjacentHTML, document.write, no eval);
// - el() refuses event-handler ("on...") attributes, style, src and srcdoc, and links only to
//   hash routes built from ids passed through encodeURIComponent;
// - every string from the API is shown inside an isolating element (shown(): a <bdi>), and the
//   bidirectional control characters in it are made visible (⟦U+202E⟧), so a name cannot
//   reorder the text around it and "gnp.exe" with an override cannot read as "exe.png";
// - the token lives in sessionStorage only (lib/api.js), is sent in the Authorization header
//   of same-origin fetch() calls and never appears in a URL.

export const SAFE_ATTRS = new Set([
  'id', 'class', 'type', 'name', 'value', 'placeholder', 'href', 'title', 'for', 'min', 'max',
  'step', 'rows', 'cols', 'colspan', 'scope', 'role', 'autocomplete', 'spellcheck', 'lang',
  'maxlength', 'minlength', 'inputmode', 'tabindex', 'datetime', 'dir', 'pattern', 'open',
]);
export const BOOL_ATTRS = new Set(['disabled', 'hidden', 'checked', 'selected', 'readonly', 'required', 'open', 'novalidate']);

// The bidirectional formatting characters: embeddings and overrides (U+202A-U+202E),
// isolates (U+2066-U+2069), the marks (U+200E, U+200F) and the Arabic letter mark (U+061C).
export const BIDI_CONTROLS = /[\u202A-\u202E\u2066-\u2069\u200E\u200F\u061C]/g;
const BIDI_NAMES = {
  '\u202A': 'LEFT-TO-RIGHT EMBEDDING', '\u202B': 'RIGHT-TO-LEFT EMBEDDING',
  '\u202C': 'POP DIRECTIONAL FORMATTING', '\u202D': 'LEFT-TO-RIGHT OVERRIDE',
  '\u202E': 'RIGHT-TO-LEFT OVERRIDE', '\u2066': 'LEFT-TO-RIGHT ISOLATE',
  '\u2067': 'RIGHT-TO-LEFT ISOLATE', '\u2068': 'FIRST STRONG ISOLATE',
  '\u2069': 'POP DIRECTIONAL ISOLATE', '\u200E': 'LEFT-TO-RIGHT MARK',
  '\u200F': 'RIGHT-TO-LEFT MARK', '\u061C': 'ARABIC LETTER MARK',
};

function codePoint(c) {
  return 'U+' + c.codePointAt(0).toString(16).toUpperCase().padStart(4, '0');
}

// The marker a control character is shown as: ⟦U+202E⟧.
export function controlMarker(c) {
  return '\u27e6' + codePoint(c) + '\u27e7';
}

// A string with its bidi controls replaced by their markers (for attributes such as title).
export function visibleControls(value) {
  return String(value).replace(BIDI_CONTROLS, controlMarker);
}

// Text as nodes: a text node, or (when it holds bidi controls) text nodes and one
// <span class="bidi-control"> per control, showing its marker.
export function textNodes(value) {
  const s = String(value);
  BIDI_CONTROLS.lastIndex = 0;
  const has = BIDI_CONTROLS.test(s);
  // test() moved lastIndex, and matchAll() starts where it stands.
  BIDI_CONTROLS.lastIndex = 0;
  if (!has) return document.createTextNode(s);
  const fragment = document.createDocumentFragment();
  let last = 0;
  for (const match of s.matchAll(BIDI_CONTROLS)) {
    if (match.index > last) fragment.appendChild(document.createTextNode(s.slice(last, match.index)));
    const c = match[0];
    const span = document.createElement('span');
    span.className = 'bidi-control';
    span.title = codePoint(c) + ' ' + (BIDI_NAMES[c] || 'bidirectional control') + ' (not applied)';
    span.textContent = controlMarker(c);
    fragment.appendChild(span);
    last = match.index + c.length;
  }
  if (last < s.length) fragment.appendChild(document.createTextNode(s.slice(last)));
  return fragment;
}

// Builds an element. attrs: only safe attributes (no on*, no style, href only to '#/...');
// children: nodes, strings or numbers (as text), arrays of them; null/undefined/false skipped.
export function el(tag, attrs, children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    const key = name.toLowerCase();
    if (key.startsWith('on') || key === 'style' || key === 'src' || key === 'srcdoc') {
      throw new Error('el: attribute refused: ' + name);
    }
    if (key === 'href') {
      const href = String(value);
      if (!href.startsWith('#/') && href !== '#') throw new Error('el: only hash links');
      node.setAttribute('href', href);
    } else if (BOOL_ATTRS.has(key)) {
      node.setAttribute(key, '');
    } else if (key === 'value') {
      node.value = String(value);
    } else if (key === 'title') {
      node.setAttribute('title', visibleControls(value));
    } else if (key.startsWith('data-') || key.startsWith('aria-') || SAFE_ATTRS.has(key)) {
      node.setAttribute(key, String(value));
    } else {
      throw new Error('el: unknown attribute: ' + name);
    }
  }
  add(node, children);
  return node;
}

export function add(node, children) {
  if (children === undefined || children === null || children === false) return node;
  if (Array.isArray(children)) {
    for (const child of children) add(node, child);
  } else if (children instanceof Node) {
    node.appendChild(children);
  } else {
    node.appendChild(textNodes(children));
  }
  return node;
}

// Replaces node's children (add() skips null and false; replaceChildren would print them).
export function swap(node, ...children) {
  node.replaceChildren();
  return add(node, children);
}

export function on(node, event, handler) {
  node.addEventListener(event, handler);
  return node;
}

// Sets node's text (bidi controls made visible).
export function text(node, value) {
  node.replaceChildren();
  if (value !== undefined && value !== null) node.appendChild(textNodes(value));
  return node;
}

// A string from the API, isolated from the text around it: a <bdi> (its direction its own,
// its controls made visible). attrs as el()'s.
export function shown(value, attrs) {
  return el('bdi', attrs, value === undefined || value === null ? '' : String(value));
}

// ---- SVG

const SVG_NS = 'http://www.w3.org/2000/svg';
const SVG_ATTRS = new Set(['viewBox', 'x', 'y', 'width', 'height', 'x1', 'y1', 'x2', 'y2', 'cx', 'cy', 'r',
  'points', 'class', 'role', 'aria-label', 'aria-hidden', 'aria-describedby', 'data-testid', 'data-index',
  'preserveAspectRatio', 'text-anchor', 'tabindex', 'focusable']);

// An SVG element; only geometry, class and ARIA attributes (no handlers, no style, no links).
export function svg(tag, attrs, children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (!SVG_ATTRS.has(name)) throw new Error('svg: attribute refused: ' + name);
    node.setAttribute(name, String(value));
  }
  for (const child of children || []) {
    if (child === null || child === undefined || child === false) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(visibleControls(child)));
  }
  return node;
}
