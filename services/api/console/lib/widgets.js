// The console's small parts: buttons that run an action with its own error slot, the banner
// (errors with no field or action of their own), the status region, paged lists, confirmation
// steps, values to copy and values shown once.

import { el, swap, on, text, shown, visibleControls } from './dom.js';
import { describe, ApiError } from './api.js';
import { fmt, show, DASH } from './format.js';

// ---- the banner and the status region

// The banner exists only while there is an error to show (tests wait for its presence). It is
// for errors that belong to no field or action (a view that could not load); it has a Dismiss
// button and the next action that succeeds clears it.
export function showBanner(err) {
  const place = document.getElementById('banner');
  const dismiss = el('button', { type: 'button', class: 'secondary small', 'data-testid': 'error-dismiss' }, 'Dismiss');
  on(dismiss, 'click', () => clearBanner());
  place.replaceChildren(el('div', { class: 'banner error', role: 'alert' }, [
    el('span', { class: 'banner-text', 'data-testid': 'error' }, describe(err)), dismiss,
  ]));
}

export function clearBanner() {
  const place = document.getElementById('banner');
  if (place) place.replaceChildren();
}

// Says a result in the polite live region (screen readers read it; the page shows it too
// where the result is drawn).
export function announce(message) {
  const region = document.getElementById('status');
  if (!region) return;
  region.textContent = '';
  // A new text node a moment later is read even when the message is the same as the last.
  setTimeout(() => text(region, message), 30);
}

// Shows an error in the banner unless the part of the page it belongs to was replaced meanwhile.
export function report(err, node) {
  if (!node || node.isConnected) showBanner(err);
}

// ---- errors next to what caused them

let slotCount = 0;

// Where one form's or action's error is shown, next to it: empty until there is one, then a
// role="alert" paragraph with the given testid. clear() when the action is tried again.
export function errorSlot(testid, defaultControl) {
  slotCount += 1;
  const id = 'err-' + slotCount;
  const slot = el('div', { class: 'error-slot' });
  let controls = [];
  slot.show = (err, control) => {
    slot.clear();
    swap(slot, el('p', { class: 'field-error', role: 'alert', id, 'data-testid': testid }, describe(err)));
    controls = control ? [control] : defaultControl ? [defaultControl] : [];
    for (const c of controls) {
      c.setAttribute('aria-invalid', 'true');
      c.setAttribute('aria-describedby', id);
    }
  };
  slot.clear = () => {
    slot.replaceChildren();
    for (const c of controls) {
      c.removeAttribute('aria-invalid');
      c.removeAttribute('aria-describedby');
    }
    controls = [];
  };
  return slot;
}

// A form's errors: one slot per field the API may name (shown under that field), and one for
// the form. fields: {apiFieldName: control}. slotFor(name) places a field's slot.
export function formErrors(prefix, fields) {
  const form = errorSlot(prefix + '-error');
  const slots = {};
  for (const name of Object.keys(fields)) slots[name] = errorSlot(prefix + '-' + name.replace(/_/g, '-') + '-error');
  return {
    form,
    slotFor: (name) => slots[name],
    clear() {
      form.clear();
      for (const s of Object.values(slots)) s.clear();
    },
    show(err) {
      const key = err instanceof ApiError && err.field ? String(err.field).replace(/\[\d+\]$/, '') : null;
      if (key && slots[key]) slots[key].show(err, fields[key]);
      else form.show(err);
    },
  };
}

// Runs an action: its slot cleared first, its error shown in its slot (or, with none, in the
// banner); a success clears the banner.
export async function runAction(fn, slot) {
  if (slot) slot.clear();
  try {
    await fn();
    clearBanner();
  } catch (err) {
    if (slot) slot.show(err);
    else showBanner(err);
  }
}

// Runs fn with btn disabled until it settles (a second click meanwhile does nothing).
export async function busy(btn, fn, slot) {
  if (btn.disabled) return;
  btn.disabled = true;
  btn.setAttribute('aria-busy', 'true');
  try {
    await runAction(fn, slot);
  } finally {
    btn.disabled = false;
    btn.removeAttribute('aria-busy');
  }
}

// A button whose handler runs through busy(), its errors in slot.
export function button(label, attrs, handler, slot) {
  const b = el('button', Object.assign({ type: 'button' }, attrs || {}), label);
  if (handler) on(b, 'click', () => busy(b, handler, slot));
  return b;
}

// ---- building blocks

export function loading(label) {
  return el('p', { class: 'loading', 'data-testid': 'loading' }, label || 'Loading\u2026');
}

export function empty(label) {
  return el('p', { class: 'empty', 'data-testid': 'empty' }, label);
}

// A labelled control (the label wraps it, so it names it); hint: a line under it.
export function field(label, control, attrs, hint) {
  return el('label', Object.assign({ class: 'field' }, attrs || {}), [
    el('span', { class: 'field-label' }, label), control,
    hint ? el('small', { class: 'hint' }, hint) : null,
  ]);
}

export function select(options, attrs) {
  return el('select', attrs, options.map(([value, label]) => el('option', { value }, label)));
}

// A table in a wrapper that scrolls sideways within the page.
export function table(headers, rows, attrs, caption) {
  return el('div', { class: 'table-wrap' }, el('table', attrs, [
    caption ? el('caption', { class: 'visually-hidden' }, caption) : null,
    el('thead', {}, el('tr', {}, headers.map((h) => el('th', { scope: 'col' }, h)))),
    el('tbody', {}, rows),
  ]));
}

// A cell: a node as it is, any other value as isolated text.
export function td(content, attrs) {
  return el('td', attrs, show(content));
}

// A cell for long text: one line, cut with an ellipsis, the whole text in its title.
export function longTd(value, attrs) {
  if (value === null || value === undefined || value === '') return el('td', attrs, DASH);
  return el('td', attrs, clamp(value));
}

// Long text clamped to one line, the whole of it in the title.
export function clamp(value, attrs) {
  const s = fmt(value);
  return shown(s, Object.assign({ class: 'clamp', title: s }, attrs || {}));
}

// A definition list from [label, value, testid?] rows.
export function dl(rows, attrs) {
  return el('dl', Object.assign({ class: 'kv' }, attrs || {}), rows.flatMap(([label, value, testid]) => [
    el('dt', {}, label),
    el('dd', testid ? { 'data-testid': testid } : {}, show(value)),
  ]));
}

export function section(testid, title, children) {
  return el('section', { class: 'card', 'data-testid': testid, id: 'section-' + testid, 'aria-labelledby': 'h-' + testid }, [
    el('h2', { id: 'h-' + testid }, title), children,
  ]);
}

export function pre(value, attrs) {
  return el('pre', Object.assign({ tabindex: 0 }, attrs || {}), typeof value === 'string' ? value : JSON.stringify(value, null, 2));
}

// An answer shown in place: the element with its testid appears only once there is one.
export function answerSlot(testid) {
  const slot = el('div', { class: 'answer-slot' });
  slot.show = (...children) => swap(slot, el('div', { class: 'answer', 'data-testid': testid }, children));
  slot.clear = () => slot.replaceChildren();
  return slot;
}

// ---- paged lists

// A list read page by page: fetch(cursor) answers {data, next_cursor}; render(data) a node.
// reload() reads the page shown again in place (what is shown stays until the answer comes:
// the scroll position holds); a failed read is said in the list, next to it.
export function pagedList(opts) {
  const body = el('div', { class: 'list-body' });
  const prev = el('button', { type: 'button', class: 'secondary', 'data-testid': opts.prevId }, '\u2190 Previous page');
  const next = el('button', { type: 'button', class: 'secondary', 'data-testid': opts.nextId }, 'Next page \u2192');
  const info = el('span', { class: 'muted' });
  const errors = opts.slot || errorSlot(opts.errorId || 'list-error');
  const host = el('div', { class: 'paged' }, [opts.slot ? null : errors, body, el('div', { class: 'pager' }, [prev, info, next])]);
  const before = []; // the cursors of the pages before this one
  let current = null;
  let following = null;
  let asked = 0;

  async function load(cursor, quiet) {
    const mine = ++asked;
    if (!quiet) body.replaceChildren(loading());
    body.setAttribute('aria-busy', 'true');
    prev.disabled = true;
    next.disabled = true;
    errors.clear();
    try {
      const page = (await opts.fetch(cursor)) || {};
      if (mine !== asked) return;
      current = cursor;
      following = page.next_cursor || null;
      const data = Array.isArray(page.data) ? page.data : [];
      body.replaceChildren(data.length || opts.renderEmpty ? opts.render(data, page) : empty(page.emptyNote || opts.empty));
      text(info, 'Page ' + (before.length + 1));
    } catch (err) {
      if (mine !== asked) return;
      following = null;
      body.replaceChildren();
      errors.show(err);
    } finally {
      if (mine === asked) {
        body.removeAttribute('aria-busy');
        prev.disabled = before.length === 0;
        next.disabled = !following;
      }
    }
  }

  on(prev, 'click', () => {
    if (before.length) load(before.pop());
  });
  on(next, 'click', () => {
    if (!following) return;
    before.push(current);
    load(following);
  });
  return {
    node: host,
    reload: (quiet) => load(current, quiet),
    reset: () => {
      before.length = 0;
      return load(null);
    },
  };
}

// ---- confirmation, copying, values shown once

// A button that asks in the page before it acts: the question (testid-question), a "Yes"
// (testid-confirm) and Cancel (testid-cancel). The action's error shows in slot (or one of
// its own, testid-error, beside the button).
export function confirmStep(label, testid, question, action, opts) {
  const o = opts || {};
  const slot = o.slot || errorSlot(testid + '-error');
  const host = el('span', { class: 'confirm-step' });
  const start = el('button', { type: 'button', 'data-testid': testid, class: o.startClass || 'danger', disabled: o.disabled }, label);
  const wrap = el('span', { class: 'confirm-wrap' }, [host, o.slot ? null : slot]);
  function idle() {
    host.replaceChildren(start);
  }
  on(start, 'click', () => {
    slot.clear();
    const no = el('button', { type: 'button', 'data-testid': testid + '-cancel', class: 'secondary' }, 'Cancel');
    const yes = el('button', { type: 'button', 'data-testid': testid + '-confirm', class: 'danger' }, o.confirmLabel || 'Yes, ' + label.toLowerCase());
    on(no, 'click', () => {
      idle();
      start.focus();
    });
    on(yes, 'click', () => busy(yes, async () => {
      no.disabled = true;
      try {
        await action();
      } finally {
        if (host.isConnected) idle();
      }
    }, slot));
    slotCount += 1;
    const qid = 'q-' + slotCount;
    const q = el('span', { class: 'question', id: qid, 'data-testid': testid + '-question' }, typeof question === 'function' ? question() : question);
    yes.setAttribute('aria-describedby', qid);
    host.replaceChildren(q, yes, no);
    yes.focus();
  });
  idle();
  wrap.start = start;
  return wrap;
}

function flashLabel(btn, label, original) {
  text(btn, label);
  setTimeout(() => text(btn, original), 1500);
}

// Copies getText() with the clipboard API where the browser offers it.
export function copyButton(getText, attrs) {
  const b = el('button', Object.assign({ type: 'button', class: 'secondary small', 'aria-label': 'Copy' }, attrs || {}), 'Copy');
  on(b, 'click', async () => {
    const value = getText();
    if (navigator.clipboard && window.isSecureContext && typeof navigator.clipboard.writeText === 'function') {
      try {
        await navigator.clipboard.writeText(value);
        flashLabel(b, 'Copied', 'Copy');
        announce('Copied.');
        return;
      } catch (_) { /* fall through */ }
    }
    flashLabel(b, 'Select and copy by hand', 'Copy');
  });
  return b;
}

// A value with its copy button (the value copied as sent, its bidi controls included).
export function copyable(value, testid) {
  const code = el('code', { 'data-testid': testid, class: 'copyable' }, value);
  return el('span', { class: 'copy-line' }, [code, copyButton(() => String(value))]);
}

// A value shown once (a secret, a password, a token), with its copy button.
export function shownOnce(value, testid, note) {
  return el('div', { class: 'once' }, [
    el('p', { class: 'warn' }, note || 'Shown once: copy it now. It cannot be read again.'),
    copyable(value, testid),
  ]);
}

// ---- values made here

export function randomSecret() {
  const bytes = new Uint8Array(32);
  crypto.getRandomValues(bytes);
  let binary = '';
  for (const b of bytes) binary += String.fromCharCode(b);
  return 'whsec_' + btoa(binary);
}

export function randomUuid() {
  if (typeof crypto.randomUUID === 'function') return crypto.randomUUID();
  const b = new Uint8Array(16);
  crypto.getRandomValues(b);
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = [...b].map((x) => x.toString(16).padStart(2, '0')).join('');
  return h.slice(0, 8) + '-' + h.slice(8, 12) + '-' + h.slice(12, 16) + '-' + h.slice(16, 20) + '-' + h.slice(20);
}

export function endpointHref(id) {
  return '#/endpoints/' + encodeURIComponent(String(id));
}

export function messageHref(endpoint, seq) {
  return endpointHref(endpoint) + '/messages/' + encodeURIComponent(String(seq));
}

export function tenantHref(id) {
  return '#/tenants/' + encodeURIComponent(String(id));
}

// A name or, when there is none, the id; for titles and headings.
export function nameOrId(thing) {
  return thing && thing.name ? thing.name : thing ? thing.id : '';
}

// Whether title text (for document.title) holds bidi controls: shown as markers there too.
export function titleText(value) {
  return visibleControls(value);
}

