// relay console: a single-page client of the control plane's /v1 API.
//
// Security rules this file keeps (the page runs under a strict Content-Security-Policy):
// - every string from the API is rendered as text: the DOM is built with createElement,
//   textContent and text nodes only (see el()); no markup is ever parsed from a string;
// - el() refuses event-handler ("on...") and style attributes, and links only to hash routes
//   built here from ids passed through encodeURIComponent;
// - the token lives in sessionStorage only, is sent in the Authorization header of same-origin
//   fetch() calls (credentials omitted, never cached) and never appears in a URL.
'use strict';

(function () {
  const TOKEN_KEY = 'relay-console-token';
  const PAGE_SIZE = 50;
  // Requests in flight at once: the API bounds each tenant's (RELAY_API_MAX_REQUESTS_PER_TENANT).
  const MAX_IN_FLIGHT = 4;
  const DASH = '\u2014';

  // ---------------------------------------------------------------- DOM helpers

  const SAFE_ATTRS = new Set([
    'id', 'class', 'type', 'name', 'value', 'placeholder', 'href', 'title', 'for', 'min', 'max',
    'step', 'rows', 'cols', 'colspan', 'scope', 'role', 'autocomplete', 'spellcheck', 'lang',
    'maxlength', 'inputmode', 'tabindex', 'datetime',
  ]);
  const BOOL_ATTRS = new Set(['disabled', 'hidden', 'checked', 'selected', 'readonly', 'required']);

  // Builds an element. attrs: only safe attributes (no on*, no style, href only to '#/...');
  // children: nodes, strings or numbers (as text nodes), arrays of them; null/false skipped.
  function el(tag, attrs, children) {
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
      } else if (key.startsWith('data-') || key.startsWith('aria-') || SAFE_ATTRS.has(key)) {
        node.setAttribute(key, String(value));
      } else {
        throw new Error('el: unknown attribute: ' + name);
      }
    }
    add(node, children);
    return node;
  }

  function add(node, children) {
    if (children === undefined || children === null || children === false) return node;
    if (Array.isArray(children)) {
      for (const child of children) add(node, child);
    } else if (children instanceof Node) {
      node.appendChild(children);
    } else {
      node.appendChild(document.createTextNode(String(children)));
    }
    return node;
  }

  // Replaces node's children (add() skips null and false; replaceChildren would print them).
  function swap(node, ...children) {
    node.replaceChildren();
    return add(node, children);
  }

  function on(node, event, handler) {
    node.addEventListener(event, handler);
    return node;
  }

  function text(node, value) {
    node.textContent = value === undefined || value === null ? '' : String(value);
    return node;
  }

  // A button whose handler runs with the button disabled until its promise settles.
  function button(label, attrs, handler) {
    const b = el('button', Object.assign({ type: 'button' }, attrs || {}), label);
    if (handler) on(b, 'click', () => busy(b, handler));
    return b;
  }

  async function busy(btn, fn) {
    if (btn.disabled) return;
    btn.disabled = true;
    btn.setAttribute('aria-busy', 'true');
    try {
      await fn();
    } catch (err) {
      report(err, btn);
    } finally {
      btn.disabled = false;
      btn.removeAttribute('aria-busy');
    }
  }

  function loading(label) {
    return el('p', { class: 'loading', 'data-testid': 'loading' }, label || 'Loading\u2026');
  }

  function empty(label) {
    return el('p', { class: 'empty', 'data-testid': 'empty' }, label);
  }

  function field(label, control, attrs) {
    return el('label', Object.assign({ class: 'field' }, attrs || {}), [el('span', {}, label), control]);
  }

  function select(options, attrs) {
    return el('select', attrs, options.map(([value, label]) => el('option', { value }, label)));
  }

  function table(headers, rows, attrs) {
    return el('div', { class: 'table-wrap' }, el('table', attrs, [
      el('thead', {}, el('tr', {}, headers.map((h) => el('th', { scope: 'col' }, h)))),
      el('tbody', {}, rows),
    ]));
  }

  function td(content, attrs) {
    return el('td', attrs, content instanceof Node ? content : fmt(content));
  }

  // A definition list from [label, value, testid?] rows.
  function dl(rows, attrs) {
    return el('dl', Object.assign({ class: 'kv' }, attrs || {}), rows.flatMap(([label, value, testid]) => [
      el('dt', {}, label),
      el('dd', testid ? { 'data-testid': testid } : {}, value instanceof Node ? value : fmt(value)),
    ]));
  }

  function section(testid, title, children) {
    return el('section', { class: 'card', 'data-testid': testid, id: 'section-' + testid }, [
      el('h2', {}, title), children,
    ]);
  }

  function pre(value, attrs) {
    return el('pre', attrs, JSON.stringify(value, null, 2));
  }

  // ---------------------------------------------------------------- formatting

  function fmtNum(value, digits) {
    if (value === null || value === undefined || value === '') return DASH;
    const n = Number(value);
    if (!Number.isFinite(n)) return String(value);
    return n.toLocaleString(undefined, digits === undefined ? undefined : { maximumFractionDigits: digits });
  }

  function fmtTime(value) {
    if (!value) return DASH;
    const d = new Date(value);
    return Number.isNaN(d.getTime()) ? String(value) : d.toLocaleString();
  }

  function time(value) {
    if (!value) return document.createTextNode(DASH);
    return el('time', { datetime: String(value), title: String(value) }, fmtTime(value));
  }

  function fmt(value) {
    if (value === null || value === undefined || value === '') return DASH;
    if (typeof value === 'boolean') return value ? 'yes' : 'no';
    if (typeof value === 'number') return fmtNum(value);
    if (Array.isArray(value)) return value.length ? value.map(fmt).join(', ') : DASH;
    if (typeof value === 'object') return JSON.stringify(value);
    return String(value);
  }

  // ---------------------------------------------------------------- errors and banner

  class ApiError extends Error {
    constructor(status, code, detail, field) {
      super(detail || code || 'HTTP ' + status);
      this.status = status;
      this.code = code;
      this.detail = detail;
      this.field = field;
    }
  }

  function describe(err) {
    if (err instanceof ApiError) {
      let message = (err.status ? err.status + ' ' : '') + (err.code || 'error') + ': ' + (err.detail || '');
      if (err.field) message += ' (field: ' + err.field + ')';
      if (err.status === 401) message += ' \u2014 sign out and sign in with a valid token.';
      return message;
    }
    if (err instanceof TypeError) return 'network error: the control plane could not be reached (' + err.message + ')';
    return String(err && err.message ? err.message : err);
  }

  // The banner exists only while there is an error to show (tests wait for its presence).
  function showError(err) {
    document.getElementById('banner').replaceChildren(
      el('div', { class: 'banner error', 'data-testid': 'error', role: 'alert' }, describe(err)));
  }

  function clearError() {
    document.getElementById('banner').replaceChildren();
  }

  // An answer shown in place: the element with its testid appears only once there is one.
  function answerSlot(testid) {
    const slot = el('div');
    slot.show = (...children) => swap(slot, el('div', { class: 'answer', 'data-testid': testid }, children));
    return slot;
  }

  // Shows an error unless the part of the page it belongs to was replaced meanwhile.
  function report(err, node) {
    if (!node || node.isConnected) showError(err);
  }

  // ---------------------------------------------------------------- the API

  let inFlight = 0;
  const waiting = [];

  function acquire() {
    if (inFlight < MAX_IN_FLIGHT) {
      inFlight += 1;
      return Promise.resolve();
    }
    return new Promise((resolve) => waiting.push(resolve));
  }

  function release() {
    const next = waiting.shift();
    if (next) next();
    else inFlight -= 1;
  }

  function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
  }

  // A path under /v1 from segments, each percent-encoded (dot segments refused: a URL would
  // resolve them to another route).
  function path(...segments) {
    return '/v1/' + segments.map((segment) => {
      const s = String(segment);
      if (s === '' || s === '.' || s === '..') throw new ApiError(0, 'invalid_request', 'not a valid id: "' + s + '"');
      return encodeURIComponent(s);
    }).join('/');
  }

  async function api(method, url, options) {
    const opts = options || {};
    const token = getToken();
    if (!token) throw new ApiError(401, 'unauthorized', 'not signed in');
    const query = new URLSearchParams();
    for (const [name, value] of Object.entries(opts.query || {})) {
      if (value !== undefined && value !== null && value !== '' && value !== false) query.set(name, String(value));
    }
    const target = query.toString() ? url + '?' + query.toString() : url;
    const headers = { Accept: 'application/json', Authorization: 'Bearer ' + token };
    const init = { method, headers, credentials: 'omit', cache: 'no-store', redirect: 'error', referrerPolicy: 'no-referrer' };
    if (opts.body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(opts.body);
    }
    let response;
    await acquire();
    try {
      for (let attempt = 0; ; attempt += 1) {
        response = await fetch(target, init);
        // 429: nothing was done; a read is asked again after Retry-After (at most twice).
        if (response.status !== 429 || method !== 'GET' || attempt >= 2) break;
        const after = Number(response.headers.get('Retry-After')) || 1;
        await sleep(Math.min(after, 5) * 1000);
      }
    } finally {
      release();
    }
    const body = await response.text();
    let json = null;
    if (body) {
      try {
        json = JSON.parse(body);
      } catch (_) {
        json = null;
      }
    }
    if (!response.ok) {
      const e = json && typeof json === 'object' ? json : {};
      throw new ApiError(response.status, e.error || 'http_' + response.status, e.detail || response.statusText, e.field);
    }
    return json;
  }

  // ---------------------------------------------------------------- the session

  let session = null; // {token, claims, kind: 'tenant'|'operator', tenant?: OwnTenantView}

  function getToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch (_) {
      return null;
    }
  }

  function decodeClaims(token) {
    const parts = token.split('.');
    if (parts.length !== 3) return null;
    try {
      let b64 = parts[1].replace(/-/g, '+').replace(/_/g, '/');
      while (b64.length % 4) b64 += '=';
      const binary = atob(b64);
      const bytes = Uint8Array.from(binary, (c) => c.charCodeAt(0));
      const claims = JSON.parse(new TextDecoder().decode(bytes));
      return claims && typeof claims === 'object' && !Array.isArray(claims) ? claims : null;
    } catch (_) {
      return null;
    }
  }

  function kindOfClaims(claims) {
    if (!claims) return null;
    if (claims.role === 'operator') return 'operator';
    if (claims.role === 'tenant' || claims.tenant) return 'tenant';
    return null;
  }

  // The token's kind by asking the API, for a token whose claims do not say.
  async function probeKind() {
    try {
      await api('GET', path('tenant'));
      return 'tenant';
    } catch (err) {
      if (!(err instanceof ApiError) || (err.status !== 401 && err.status !== 403)) throw err;
    }
    await api('GET', path('tenants'), { query: { limit: 1 } });
    return 'operator';
  }

  function restoreSession() {
    const token = getToken();
    if (!token) return null;
    const claims = decodeClaims(token) || {};
    return { token, claims, kind: kindOfClaims(claims), tenant: null };
  }

  function signOut() {
    try {
      sessionStorage.removeItem(TOKEN_KEY);
    } catch (_) { /* nothing stored */ }
    session = null;
    document.getElementById('main').replaceChildren();
    // Shown at once (no hashchange to wait for): a form typed into next is not drawn again.
    if (location.hash !== '#/') history.replaceState(null, '', '#/');
    route();
  }

  async function loadOwnTenant() {
    const asked = session;
    if (!asked || asked.kind !== 'tenant') return null;
    const tenant = await api('GET', path('tenant'));
    // An answer for a session signed out meanwhile names someone else's tenant: drop it.
    if (session !== asked) return null;
    session.tenant = tenant;
    renderChrome();
    return tenant;
  }

  // ---------------------------------------------------------------- chrome and routing

  // The header: who is signed in and the sign-out button exist only while signed in.
  function renderChrome() {
    const place = document.getElementById('session');
    const nav = document.getElementById('nav');
    if (!session) {
      place.replaceChildren();
      nav.replaceChildren();
      return;
    }
    const claims = session.claims || {};
    let line = 'Signed in as ' + (claims.sub || 'unknown') + ' (' + (session.kind || 'unknown role') + ')';
    if (session.tenant && session.tenant.name) line += ' \u2014 ' + session.tenant.name;
    if (typeof claims.exp === 'number') line += ' \u00b7 token expires ' + fmtTime(claims.exp * 1000);
    const out = el('button', { type: 'button', class: 'secondary', 'data-testid': 'sign-out' }, 'Sign out');
    on(out, 'click', signOut);
    place.replaceChildren(el('span', { class: 'who', 'data-testid': 'who' }, line), out);
    const links = session.kind === 'operator'
      ? [['#/tenants', 'Tenants', 'nav-tenants']]
      : [['#/endpoints', 'Endpoints', 'nav-endpoints'], ['#/broker', 'Broker', 'nav-broker']];
    const current = '#/' + (location.hash.replace(/^#\/?/, '').split('/')[0] || '');
    nav.replaceChildren(...links.map(([href, label, testid]) =>
      el('a', { href, 'data-testid': testid, 'aria-current': current === href ? 'page' : null }, label)));
  }

  function defaultRoute() {
    return session && session.kind === 'operator' ? '#/tenants' : '#/endpoints';
  }

  function safeDecode(s) {
    try {
      return decodeURIComponent(s);
    } catch (_) {
      return s;
    }
  }

  function route() {
    const main = document.getElementById('main');
    main.replaceChildren();
    clearError();
    renderChrome();
    window.scrollTo(0, 0);
    const parts = location.hash.replace(/^#\/?/, '').split('/').filter(Boolean).map(safeDecode);
    if (!session) {
      viewSignIn(main);
      return;
    }
    const [head, id] = parts;
    if (!head) {
      history.replaceState(null, '', defaultRoute());
      route();
      return;
    }
    const needs = { endpoints: 'tenant', broker: 'tenant', tenants: 'operator' }[head];
    if (!needs) {
      main.append(el('h1', {}, 'Not found'), el('p', {}, [
        'No such view. ', el('a', { href: defaultRoute() }, 'Go to the start'),
      ]));
      return;
    }
    if (session.kind && session.kind !== needs) {
      main.append(el('h1', {}, 'Not for this token'), el('p', { 'data-testid': 'wrong-role' },
        'This view takes ' + (needs === 'tenant' ? "a tenant's" : "an operator's") + ' token.'));
      return;
    }
    if (head === 'endpoints') {
      if (id) viewEndpoint(main, id);
      else viewEndpoints(main);
    } else if (head === 'broker') {
      viewBroker(main);
    } else {
      viewTenants(main, id || null);
    }
  }

  // ---------------------------------------------------------------- paged lists

  // A list read page by page: fetch(cursor) answers {data, next_cursor}; render(data) a node.
  function pagedList(opts) {
    const body = el('div', { class: 'list-body' });
    const prev = el('button', { type: 'button', class: 'secondary', 'data-testid': opts.prevId }, '\u2190 Previous page');
    const next = el('button', { type: 'button', class: 'secondary', 'data-testid': opts.nextId }, 'Next page \u2192');
    const info = el('span', { class: 'muted' });
    const host = el('div', { class: 'paged' }, [body, el('div', { class: 'pager' }, [prev, info, next])]);
    const before = []; // the cursors of the pages before this one
    let current = null;
    let following = null;

    async function load(cursor) {
      body.replaceChildren(loading());
      prev.disabled = true;
      next.disabled = true;
      try {
        const page = (await opts.fetch(cursor)) || {};
        current = cursor;
        following = page.next_cursor || null;
        const data = Array.isArray(page.data) ? page.data : [];
        body.replaceChildren(data.length || opts.renderEmpty ? opts.render(data) : empty(opts.empty));
        text(info, 'Page ' + (before.length + 1));
      } catch (err) {
        body.replaceChildren(el('p', { class: 'muted' }, 'Could not load this list.'));
        report(err, host);
      } finally {
        prev.disabled = before.length === 0;
        next.disabled = !following;
      }
    }

    // load() disables both buttons while the page is read, and enables each as it applies.
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
      reload: () => load(current),
      reset: () => {
        before.length = 0;
        return load(null);
      },
    };
  }

  // ---------------------------------------------------------------- small widgets

  function flashLabel(btn, label, original) {
    text(btn, label);
    setTimeout(() => text(btn, original), 1500);
  }

  // Copies getText() with the clipboard API where the browser offers it.
  function copyButton(getText, attrs) {
    const b = el('button', Object.assign({ type: 'button', class: 'secondary small' }, attrs || {}), 'Copy');
    on(b, 'click', async () => {
      const value = getText();
      if (navigator.clipboard && window.isSecureContext && typeof navigator.clipboard.writeText === 'function') {
        try {
          await navigator.clipboard.writeText(value);
          flashLabel(b, 'Copied', 'Copy');
          return;
        } catch (_) { /* fall through */ }
      }
      flashLabel(b, 'Select and copy by hand', 'Copy');
    });
    return b;
  }

  function copyable(value, testid) {
    const code = el('code', { 'data-testid': testid, class: 'copyable' }, value);
    return el('span', { class: 'copy-line' }, [code, copyButton(() => code.textContent)]);
  }

  // A value shown once (a secret, a password, a token), with its copy button.
  function shownOnce(value, testid, note) {
    return el('div', { class: 'once' }, [
      el('p', { class: 'warn' }, note || 'Shown once: copy it now. It cannot be read again.'),
      copyable(value, testid),
    ]);
  }

  // A button that asks for confirmation in the page before it acts.
  function confirmStep(label, testid, question, action) {
    const host = el('span', { class: 'confirm-step' });
    const start = button(label, { 'data-testid': testid, class: 'danger' });
    function idle() {
      host.replaceChildren(start);
    }
    on(start, 'click', () => {
      const yes = button('Yes, ' + label.toLowerCase(), { 'data-testid': testid + '-confirm', class: 'danger' }, async () => {
        no.disabled = true;
        try {
          await action();
        } catch (err) {
          report(err, host);
        }
        if (host.isConnected) idle();
      });
      const no = button('Cancel', { 'data-testid': testid + '-cancel', class: 'secondary' }, async () => idle());
      host.replaceChildren(el('span', { class: 'question' }, question), yes, no);
    });
    idle();
    return host;
  }

  function randomSecret() {
    const bytes = new Uint8Array(32);
    crypto.getRandomValues(bytes);
    let binary = '';
    for (const b of bytes) binary += String.fromCharCode(b);
    return 'whsec_' + btoa(binary);
  }

  function endpointHref(id) {
    return '#/endpoints/' + encodeURIComponent(String(id));
  }

  function tenantHref(id) {
    return '#/tenants/' + encodeURIComponent(String(id));
  }

  // ---------------------------------------------------------------- sign-in

  function viewSignIn(main) {
    const input = el('textarea', {
      id: 'token-input', 'data-testid': 'token-input', rows: 5, spellcheck: 'false',
      autocomplete: 'off', placeholder: 'eyJhbGciOiJIUzI1NiIs\u2026', required: true,
    });
    const submit = el('button', { type: 'submit', 'data-testid': 'sign-in' }, 'Sign in');
    const form = el('form', { class: 'card sign-in', 'data-testid': 'sign-in-form' }, [
      el('h1', {}, 'Sign in'),
      el('p', {}, "Paste a tenant's or an operator's token. It is kept in this browser tab only (sessionStorage) and sent to this control plane's API."),
      field('Token (JWT)', input),
      el('div', { class: 'actions' }, submit),
    ]);
    on(form, 'submit', (event) => {
      event.preventDefault();
      busy(submit, () => signIn(input.value));
    });
    main.append(form);
    input.focus();
  }

  async function signIn(raw) {
    clearError();
    const token = raw.trim().replace(/^Bearer\s+/i, '');
    if (!/^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$/.test(token)) {
      throw new ApiError(0, 'invalid_token', 'this is not a JWT (three base64url parts separated by dots)');
    }
    const claims = decodeClaims(token) || {};
    sessionStorage.setItem(TOKEN_KEY, token);
    session = { token, claims, kind: kindOfClaims(claims), tenant: null };
    try {
      if (!session.kind) session.kind = await probeKind();
      // Ask the API once: a token it refuses does not sign in.
      if (session.kind === 'tenant') session.tenant = await api('GET', path('tenant'));
      else await api('GET', path('tenants'), { query: { limit: 1 } });
    } catch (err) {
      sessionStorage.removeItem(TOKEN_KEY);
      session = null;
      throw err;
    }
    // The view asked for before signing in, or the start of the token's views.
    if (location.hash.replace(/^#\/?/, '')) route();
    else location.hash = defaultRoute();
  }

  // ---------------------------------------------------------------- tenant: endpoints list

  function viewEndpoints(main) {
    const summary = el('p', { class: 'muted', 'data-testid': 'tenant-summary' });
    const showSummary = (tenant) => {
      if (!tenant) return;
      const q = tenant.quotas || {};
      const u = tenant.usage || {};
      text(summary, 'Tenant ' + tenant.name + ' (' + tenant.id + '): ' + fmtNum(u.endpoints) + ' of ' +
        fmtNum(q.max_endpoints) + ' endpoints, at most ' + fmtNum(q.max_messages_per_second) + ' messages/s.');
    };
    const list = pagedList({
      prevId: 'prev-page',
      nextId: 'next-page',
      empty: 'No endpoints yet: register one with POST /v1/endpoints.',
      renderEmpty: true,
      fetch: (cursor) => api('GET', path('endpoints'), { query: { limit: PAGE_SIZE, after: cursor } }),
      render: endpointTable,
    });
    const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, async () => {
      await Promise.all([list.reload(), loadOwnTenant().then(showSummary)]);
    });
    main.append(
      el('div', { class: 'title-row' }, [el('h1', {}, 'Endpoints'), refresh]),
      summary,
      list.node,
    );
    showSummary(session.tenant);
    loadOwnTenant().then(showSummary).catch((err) => report(err, summary));
    list.reset();
  }

  function endpointTable(endpoints) {
    const rows = endpoints.map((ep) => {
      const cell = (testid) => el('td', { 'data-testid': testid, class: 'pending' }, '\u2026');
      const cells = {
        upstream: cell('upstream'), lag: cell('apply-lag'), waiting: cell('messages-waiting'),
        outbox: cell('outbox-backlog'), quarantined: cell('quarantined'), notes: cell('notes'),
      };
      const details = ep.source === 'stories' ? (ep.tickers || []).join(', ') : ep.lang;
      const tr = el('tr', { 'data-testid': 'endpoint-row', 'data-endpoint-id': ep.id }, [
        el('td', {}, el('a', { href: endpointHref(ep.id), 'data-testid': 'endpoint-link', class: 'mono' }, ep.id)),
        td(details),
        td(ep.source, { 'data-testid': 'source' }),
        el('td', { 'data-testid': 'status' }, el('span', { class: 'badge ' + (ep.status === 'paused' ? 'warn' : 'ok') }, ep.status)),
        cells.upstream, cells.lag, cells.waiting, cells.outbox, cells.quarantined, cells.notes,
      ]);
      loadRowState(ep.id, cells);
      return tr;
    });
    if (!rows.length) {
      rows.push(el('tr', {}, el('td', { colspan: 10, class: 'empty', 'data-testid': 'empty' },
        'No endpoints yet: register one with POST /v1/endpoints.')));
    }
    return table(['Endpoint', 'Language / tickers', 'Source', 'Status', 'Upstream', 'Apply lag (s)',
      'Waiting', 'Outbox backlog', 'Quarantined', 'Notes'], rows, { 'data-testid': 'endpoints-table' });
  }

  async function loadRowState(id, cells) {
    let state;
    try {
      state = await api('GET', path('endpoints', id, 'state'));
    } catch (err) {
      for (const c of Object.values(cells)) text(c, DASH);
      text(cells.notes, 'state unavailable: ' + describe(err));
      return;
    }
    for (const c of Object.values(cells)) c.classList.remove('pending');
    cells.upstream.replaceChildren(upstreamSummary(state.upstream));
    text(cells.lag, fmtNum(state.apply_lag_s, 1));
    text(cells.waiting, fmtNum(state.messages_waiting));
    text(cells.outbox, fmtNum(state.outbox_backlog));
    text(cells.quarantined, fmtNum(state.messages_quarantined));
    const notes = stateNotes(state);
    text(cells.notes, notes.length ? notes.join('; ') : DASH);
  }

  function upstreamSummary(upstream) {
    const u = upstream || {};
    const cls = u.status === 'ok' ? 'ok' : u.status === 'failing' ? 'bad' : 'warn';
    return el('span', {}, [
      el('span', { class: 'badge ' + cls, 'data-testid': 'upstream-status' }, u.status || 'unknown'),
      u.last_error ? el('span', { class: 'last-error', 'data-testid': 'last-error' },
        (u.last_error_kind ? u.last_error_kind + ': ' : '') + u.last_error) : null,
    ]);
  }

  function stateNotes(state) {
    const notes = [];
    if (state.restore) notes.push('restore held: waiting for the feed rewind');
    if (state.reload_running) notes.push('reload running');
    const stories = state.stories;
    if (stories && stories.reload) {
      if (stories.reload.status === 'running') notes.push('reload running');
      if (stories.reload.status === 'owed') notes.push('reload owed');
    }
    if (stories && stories.tickers_loading && stories.tickers_loading.length) notes.push('tickers loading: ' + stories.tickers_loading.join(', '));
    if (stories && stories.reads_owed) notes.push(fmtNum(stories.reads_owed) + ' story reads owed');
    return notes;
  }

  // ---------------------------------------------------------------- tenant: one endpoint

  async function viewEndpoint(main, id) {
    const holder = el('div', {}, loading());
    main.append(
      el('p', {}, el('a', { href: '#/endpoints' }, '\u2190 Endpoints')),
      el('h1', { class: 'mono' }, 'Endpoint ' + id),
      holder,
    );
    let endpoint;
    let state;
    try {
      [endpoint, state] = await Promise.all([
        api('GET', path('endpoints', id)),
        api('GET', path('endpoints', id, 'state')),
      ]);
    } catch (err) {
      holder.replaceChildren(el('p', { class: 'muted' }, 'Could not load this endpoint.'));
      report(err, holder);
      return;
    }
    const ctx = {
      id, endpoint, state, stories: endpoint.source === 'stories', listeners: [], showItem: null,
      setState(next) {
        ctx.state = next;
        for (const listener of ctx.listeners) listener(next);
      },
      async refreshState() {
        ctx.setState(await api('GET', path('endpoints', id, 'state')));
      },
    };
    const sections = [
      ['overview', 'Overview', overviewSection],
      ['activity', 'Last hour', activitySection],
      ['copy', 'Copy', copySection],
      ['messages', 'Messages', messagesSection],
      ['quarantine', 'Quarantine', quarantineSection],
      ['stream', 'Stream', streamSection],
    ];
    if (ctx.stories) sections.push(['stories', 'Stories', storiesSection]);
    const built = sections.map(([testid, title, build]) => section(testid, title, build(ctx)));
    const jump = el('nav', { class: 'jump', 'aria-label': 'Sections' }, sections.map(([testid, title]) => {
      const b = el('button', { type: 'button', class: 'link' }, title);
      on(b, 'click', () => document.getElementById('section-' + testid).scrollIntoView({ behavior: 'smooth' }));
      return b;
    }));
    const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, () => {
      route();
    });
    holder.replaceChildren(el('div', { class: 'title-row' }, [jump, refresh]), ...built);
  }

  // ---- activity: the last hour's throughput, and the lag and backlog now

  const SVG_NS = 'http://www.w3.org/2000/svg';
  const SVG_ATTRS = new Set(['viewBox', 'x', 'y', 'width', 'height', 'x1', 'y1', 'x2', 'y2',
    'points', 'class', 'role', 'aria-label', 'data-testid', 'preserveAspectRatio', 'text-anchor']);

  // An SVG element; only geometry and class attributes (no handlers, no style, no links).
  function svg(tag, attrs, children) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (!SVG_ATTRS.has(name)) throw new Error('svg: attribute refused: ' + name);
      node.setAttribute(name, String(value));
    }
    for (const child of children || []) {
      node.appendChild(typeof child === 'string' ? document.createTextNode(child) : child);
    }
    return node;
  }

  // Series per minute as lines over a shared scale: keys of the minutes, each with its class.
  function activityChart(minutes, series, testid, label, unit) {
    const width = 720;
    const height = 160;
    const pad = 28;
    const top = Math.max(1, ...minutes.map((m) => Math.max(...series.map(([key]) => m[key]))));
    const x = (i) => pad + (i * (width - 2 * pad)) / Math.max(1, minutes.length - 1);
    const y = (n) => height - pad - (n * (height - 2 * pad)) / top;
    const line = (key, cls) => svg('polyline', {
      class: cls, points: minutes.map((m, i) => x(i).toFixed(1) + ',' + y(m[key]).toFixed(1)).join(' '),
    });
    return svg('svg', {
      viewBox: '0 0 ' + width + ' ' + height, class: 'chart', role: 'img', 'data-testid': testid,
      'aria-label': label,
    }, [
      svg('line', { class: 'axis', x1: pad, y1: height - pad, x2: width - pad, y2: height - pad }),
      svg('line', { class: 'axis', x1: pad, y1: pad, x2: pad, y2: height - pad }),
      svg('text', { class: 'tick', x: pad - 4, y: pad + 4, 'text-anchor': 'end' }, [fmtNum(top, unit ? 1 : 0) + (unit || '')]),
      svg('text', { class: 'tick', x: pad - 4, y: height - pad, 'text-anchor': 'end' }, ['0']),
      svg('text', { class: 'tick', x: pad, y: height - 8 }, ['60 min ago']),
      svg('text', { class: 'tick', x: width - pad, y: height - 8, 'text-anchor': 'end' }, ['now']),
      ...series.map(([key, cls]) => line(key, 'series ' + cls)),
    ]);
  }

  function activitySection(ctx) {
    const box = el('div', {}, loading());
    const now = el('p', { class: 'muted', 'data-testid': 'activity-now' });
    const showNow = (state) => text(now, 'Now: apply lag ' + fmtNum(state.apply_lag_s, 1) + ' s, '
      + fmtNum(state.messages_waiting) + ' messages waiting, outbox backlog '
      + fmtNum(state.outbox_backlog) + '.');
    showNow(ctx.state);
    ctx.listeners.push(showNow);
    (async () => {
      try {
        const activity = await api('GET', path('endpoints', ctx.id, 'activity'));
        const total = (key) => activity.minutes.reduce((sum, m) => sum + m[key], 0);
        const cut = activity.received_cut || activity.written_cut;
        swap(box,
          el('p', { 'data-testid': 'activity-totals' }, [
            el('span', { class: 'legend received' }, 'Received'), ' ' + fmtNum(total('received')) + ' messages, ',
            el('span', { class: 'legend written' }, 'written'), ' ' + fmtNum(total('written')) + ' changes in the last hour',
            cut ? ' (the earliest minutes are undercounted: more rows than one read scans)' : '',
          ]),
          activityChart(activity.minutes, [['received', 'received'], ['written', 'written']],
            'activity-chart', 'Messages received and changes written per minute, last hour'),
          el('p', { 'data-testid': 'lag-totals' }, [
            el('span', { class: 'legend lag' }, 'Apply lag'),
            ', the most sampled in each minute: at most ' + fmtNum(Math.max(0, ...activity.minutes.map((m) => m.apply_lag_s)), 1)
              + ' s in the last hour',
          ]),
          activityChart(activity.minutes, [['apply_lag_s', 'lag']], 'lag-chart',
            'Apply lag per minute, in seconds, last hour', ' s'));
      } catch (err) {
        swap(box, el('p', { class: 'muted' }, 'Activity unavailable.'));
        report(err, box);
      }
    })();
    return [now, box];
  }

  // ---- overview

  function overviewSection(ctx) {
    const endpointBox = el('div');
    const stateBox = el('div');
    const secretsBox = el('div');

    function renderEndpoint() {
      const ep = ctx.endpoint;
      const paused = ep.status === 'paused';
      const pause = button('Pause', { 'data-testid': 'pause', class: 'secondary', disabled: paused }, async () => {
        ctx.endpoint = await api('POST', path('endpoints', ctx.id, 'pause'));
        renderEndpoint();
        await ctx.refreshState();
      });
      const resume = button('Resume', { 'data-testid': 'resume', class: 'secondary', disabled: !paused }, async () => {
        ctx.endpoint = await api('POST', path('endpoints', ctx.id, 'resume'));
        renderEndpoint();
        await ctx.refreshState();
      });
      endpointBox.replaceChildren(
        dl([
          ['Id', ep.id],
          ['Status', el('span', { class: 'badge ' + (paused ? 'warn' : 'ok') }, ep.status), 'endpoint-status'],
          ['Source', ep.source],
          ctx.stories ? ['Stories mode', ep.stories_mode] : ['Language', ep.lang],
          ctx.stories ? ['Tickers', ep.tickers] : null,
          ['Upstream base URL', ep.upstream_base_url],
          ['Upstream API key set', ep.upstream_api_key_set],
          ['Created', time(ep.created_at)],
          ['Updated', time(ep.updated_at)],
        ].filter(Boolean)),
        el('div', { class: 'actions' }, [pause, resume,
          el('span', { class: 'muted' }, paused
            ? 'Paused: the front tier answers 410. Resume it at the upstream too.'
            : 'Active: the front tier takes messages.')]),
      );
    }

    function renderState(s) {
      const u = s.upstream || {};
      const rows = [
        ['Upstream status', upstreamSummary(u)],
        ['Consecutive failures', u.consecutive_failures],
        ['Failing since', time(u.failing_since)],
        ['Last failure', time(u.last_failure_at)],
        ['Last success after failing', time(u.last_success_at)],
        ['Last arrival', s.last_arrival_seq],
        ['Applied through arrival', s.applied_arrival_seq],
        ['Messages waiting', s.messages_waiting, 'state-waiting'],
        ['Apply lag (s)', fmtNum(s.apply_lag_s, 1), 'state-apply-lag'],
        ['Oldest waiting received', time(s.oldest_waiting_received_at)],
        ['Last applied (received)', time(s.last_applied_received_at)],
        ['Last applied at', time(s.last_applied_at)],
        ['Outbox backlog', s.outbox_backlog, 'state-outbox'],
        ['Change epoch', s.change_epoch],
        ['Last change_seq', s.last_change_seq],
        ['Quarantined', s.messages_quarantined, 'state-quarantined'],
        ['Last quarantine reason', s.last_quarantine_reason],
        ['Restore held', s.restore
          ? 'yes: restored ' + fmtTime(s.restore.restored_at) + (s.restore.last_was_reset
            ? ', last was a reset (the feed is read again)'
            : ', rewind from ' + fmt(s.restore.through))
          : 'no', 'state-restore'],
      ];
      if (!ctx.stories) rows.push(['Reload running', s.reload_running, 'state-reload']);
      const st = s.stories;
      if (st) {
        const reload = st.reload || {};
        rows.push(
          ['Loaded', st.loaded],
          ['Reload', reload.status + (reload.round !== null && reload.round !== undefined ? ' (round ' + reload.round + ')' : ''), 'state-reload'],
          ['Last reload finished', time(reload.reloaded_at)],
          ['Caught up at', time(st.caught_up_at)],
          ['Catch-up cursor', st.catch_up_cursor],
          ['Tickers loading', st.tickers_loading],
          ['Tickers dropping', st.tickers_dropping],
          ['Rounds', st.rounds],
          ['Story reads owed', st.reads_owed],
          ['Owed since', time(st.reads_owed_since)],
        );
      }
      const parts = [el('h3', {}, 'State'), dl(rows, { 'data-testid': 'state' })];
      if (Array.isArray(s.tracks) && s.tracks.length) {
        parts.push(el('h3', {}, 'Tracks'), table(
          ['Track', 'Generation', 'Access version', 'Through', 'Last was reset', 'Reload', 'Reload begun'],
          s.tracks.map((t) => el('tr', { 'data-testid': 'track-row' }, [
            td(t.track), td(t.generation), td(t.access_version), td(t.through), td(t.last_was_reset),
            td(t.reload_running ? fmt(t.reload) : 'no'), td(time(t.reload_begun_at)),
          ])),
          { 'data-testid': 'tracks-table' },
        ));
      }
      stateBox.replaceChildren(...parts);
    }

    function renderSecrets(secrets) {
      const overlap = el('input', { type: 'number', min: 0, step: 1, 'data-testid': 'rotate-overlap', placeholder: 'default' });
      const output = el('div', { 'data-testid': 'rotation' });
      const rotate = button('Rotate secret', { 'data-testid': 'rotate-secret' }, async () => {
        const secret = randomSecret();
        const body = { secret };
        if (overlap.value !== '') body.overlap_s = Number(overlap.value);
        const answer = await api('POST', path('endpoints', ctx.id, 'secrets', 'rotate'), { body });
        output.replaceChildren(
          shownOnce(secret, 'new-secret', 'The new signing secret, shown once: give it to the upstream now.'),
          el('p', { 'data-testid': 'rotation-answer' }, 'Secret ' + fmt(answer.secret && answer.secret.id) +
            ' verifies now; ' + fmtNum(answer.old_secrets) + ' older secret(s) verify until ' +
            fmtTime(answer.old_secrets_expire_at) + '.'),
        );
        const list = await api('GET', path('endpoints', ctx.id, 'secrets'));
        secretsTable.replaceChildren(secretRows(list));
      });
      const secretsTable = el('div', {}, secretRows(secrets || []));
      secretsBox.replaceChildren(
        el('h3', {}, 'Signing secrets'),
        secretsTable,
        el('div', { class: 'actions' }, [field('Overlap (s)', overlap), rotate,
          el('span', { class: 'muted' }, 'A new secret is made in this browser; the old ones keep verifying during the overlap.')]),
        output,
      );
    }

    function secretRows(secrets) {
      if (!secrets.length) return empty('No secrets.');
      return table(['Id', 'Created', 'Expires', 'Active'], secrets.map((s) => el('tr', { 'data-testid': 'secret-row' }, [
        td(s.id), td(time(s.created_at)), td(time(s.expires_at)), td(s.active),
      ])), { 'data-testid': 'secrets-table' });
    }

    renderEndpoint();
    renderState(ctx.state);
    renderSecrets(ctx.endpoint.secrets);
    ctx.listeners.push(renderState);
    return el('div', {}, [endpointBox, stateBox, secretsBox]);
  }

  // ---- copy

  function copySection(ctx) {
    const search = el('input', { type: 'search', 'data-testid': 'copy-search', autocomplete: 'off',
      placeholder: ctx.stories ? 'story id, e.g. st_12' : 'subject, e.g. announcement:88001' });
    const go = el('button', { type: 'submit', 'data-testid': 'copy-search-go' }, 'Find');
    const form = el('form', { class: 'actions' }, [field(ctx.stories ? 'Story id' : 'Subject', search), go]);
    const viewer = el('div', { class: 'item', hidden: true });

    async function show(key) {
      const view = ctx.stories
        ? await api('GET', path('endpoints', ctx.id, 'stories', key))
        : await api('GET', path('endpoints', ctx.id, 'copy', key));
      renderItem(view);
    }

    function renderItem(view) {
      const parts = [];
      let title = null;
      if (ctx.stories) {
        title = view.story && view.story.headline;
      } else if (view.item && typeof view.item === 'object') {
        title = view.item.head && view.item.head.title;
        if (Array.isArray(view.item.parts)) parts.push(...view.item.parts);
      }
      swap(viewer,
        el('h3', { 'data-testid': 'item-key', class: 'mono' }, ctx.stories ? view.id : view.subject),
        view.tombstone ? el('p', { class: 'warn' }, 'A tombstone: the item was removed.') : null,
        view.closed ? el('p', { class: 'muted' }, 'Closed' + (view.merged_into ? ', merged into ' + view.merged_into : '') + '.') : null,
        title ? el('p', { 'data-testid': 'item-title', class: 'headline' }, String(title)) : null,
        ctx.stories ? null : el('ul', { 'data-testid': 'item-parts' }, parts.length
          ? parts.map((p) => el('li', { 'data-part-kind': p && p.kind ? String(p.kind) : null },
            p && p.headline !== undefined && p.headline !== null ? String(p.headline) : '(no headline)'))
          : el('li', { class: 'muted' }, 'No parts.')),
        pre(view, { 'data-testid': 'item-json' }),
      );
      viewer.hidden = false;
      viewer.setAttribute('data-testid', 'item');
    }
    ctx.showItem = async (key) => {
      await show(key);
      viewer.scrollIntoView({ behavior: 'smooth', block: 'nearest' });
    };

    on(form, 'submit', (event) => {
      event.preventDefault();
      const key = search.value.trim();
      if (!key) {
        showError('Type a ' + (ctx.stories ? 'story id' : 'subject') + ' to find.');
        return;
      }
      busy(go, async () => {
        clearError();
        await show(key);
      });
    });

    const kind = select([['', 'all kinds'], ['announcement', 'announcement'], ['pre_earnings_analysis', 'pre_earnings_analysis']],
      { 'data-testid': 'copy-kind' });
    const tombstones = el('input', { type: 'checkbox', 'data-testid': 'copy-tombstones' });
    const keyButton = (key) => button(key, { class: 'link mono', 'data-testid': 'copy-open' }, () => show(key));
    const list = pagedList({
      prevId: 'copy-prev',
      nextId: 'copy-next',
      empty: ctx.stories ? 'No stories in the copy.' : 'The copy holds no items.',
      fetch: (cursor) => ctx.stories
        ? api('GET', path('endpoints', ctx.id, 'stories'), { query: { limit: PAGE_SIZE, after: cursor } })
        : api('GET', path('endpoints', ctx.id, 'copy'), {
          query: { limit: PAGE_SIZE, after: cursor, item_kind: kind.value, include_tombstones: tombstones.checked ? 'true' : null },
        }),
      render: (rows) => ctx.stories
        ? table(['Story', 'Ticker', 'Version', 'Headline'], rows.map((s) =>
          el('tr', { 'data-testid': 'copy-row', 'data-subject': s.id }, [
            el('td', {}, keyButton(s.id)), td(s.ticker), td(s.version), td(s.story && s.story.headline),
          ])), { 'data-testid': 'copy-table' })
        : table(['Subject', 'Kind', 'Company', 'Generation', 'Sequence', 'Tombstone', 'Updated'], rows.map((i) =>
          el('tr', { 'data-testid': 'copy-row', 'data-subject': i.subject }, [
            el('td', {}, keyButton(i.subject)), td(i.item_kind), td(i.company_id), td(i.generation),
            td(i.sequence), td(i.tombstone), td(time(i.updated_at)),
          ])), { 'data-testid': 'copy-table' }),
    });
    const filters = ctx.stories ? null : el('div', { class: 'actions' }, [
      field('Kind', kind), field('Include tombstones', tombstones, { class: 'field inline' }),
    ]);
    if (filters) {
      on(kind, 'change', () => list.reset());
      on(tombstones, 'change', () => list.reset());
    }
    list.reset();
    return el('div', {}, [form, viewer, filters, list.node]);
  }

  // ---- messages

  function messagesSection(ctx) {
    const status = select([['', 'any status'], ['waiting', 'waiting'], ['applied', 'applied'], ['ignored', 'ignored'],
      ['quarantined', 'quarantined'], ['duplicate', 'sent more than once']], { 'data-testid': 'messages-status' });
    const order = select([['newest', 'newest first'], ['arrival', 'by arrival']], { 'data-testid': 'messages-order' });
    const from = el('input', { type: 'datetime-local', step: 1, 'data-testid': 'messages-from' });
    const before = el('input', { type: 'datetime-local', step: 1, 'data-testid': 'messages-before' });
    const instant = (input) => {
      if (!input.value) return null;
      const d = new Date(input.value);
      if (Number.isNaN(d.getTime())) throw new ApiError(0, 'invalid_request', 'not a time: ' + input.value);
      return d.toISOString();
    };
    const list = pagedList({
      prevId: 'messages-prev',
      nextId: 'messages-next',
      empty: 'No messages match.',
      fetch: (cursor) => api('GET', path('endpoints', ctx.id, 'messages'), {
        query: {
          limit: PAGE_SIZE, cursor, order: order.value, status: status.value,
          received_from: instant(from), received_before: instant(before),
        },
      }),
      render: (rows) => table(['Arrival', 'Received', 'Webhook id', 'Track', 'Generation', 'Attempt', 'Bytes',
        'Status', 'Outcome', 'Duplicate'], rows.map((m) => {
        const applied = m.applied;
        const outcome = applied
          ? applied.outcome + (applied.reason ? ': ' + applied.reason : '') + ' (' + fmtNum(applied.events_applied) +
            ' applied, ' + fmtNum(applied.events_ignored) + ' ignored)'
          : DASH;
        const duplicate = m.duplicates > 0
          ? 'yes, ' + fmtNum(m.duplicates) + ' repeat(s), last ' + fmtTime(m.last_duplicate_at)
          : 'no';
        return el('tr', { 'data-testid': 'message-row', 'data-arrival-seq': m.arrival_seq }, [
          td(m.arrival_seq), td(time(m.received_at)), td(m.webhook_id, { class: 'mono' }), td(m.track),
          td(m.generation), td(m.attempt), td(m.body_bytes), td(m.status, { 'data-testid': 'message-status' }),
          td(outcome), td(duplicate, { 'data-testid': 'duplicate' }),
        ]);
      }), { 'data-testid': 'messages-table' }),
    });
    const apply = button('Apply filters', { 'data-testid': 'messages-apply', class: 'secondary' }, () => list.reset());
    list.reset();
    return el('div', {}, [
      el('div', { class: 'actions' }, [field('Status', status), field('Order', order),
        field('Received from', from), field('Received before', before), apply]),
      list.node,
    ]);
  }

  // ---- quarantine

  function quarantineSection(ctx) {
    const status = select([['quarantined', 'quarantined'], ['retried', 'retried'], ['discarded', 'discarded'], ['all', 'all']],
      { 'data-testid': 'quarantine-status' });
    const answer = answerSlot('quarantine-answer');
    let list = null;

    async function act(seq, action) {
      const result = await api('POST', path('endpoints', ctx.id, 'quarantine', seq, action));
      answer.show(
        el('p', {}, 'Arrival ' + fmt(result.arrival_seq) + ': ' + fmt(result.status) +
          (result.retried_as !== null && result.retried_as !== undefined ? ', stored again as arrival ' + result.retried_as : '') + '.'),
        pre(result),
      );
      await Promise.all([list.reload(), ctx.refreshState().catch((err) => report(err, answer))]);
    }

    list = pagedList({
      prevId: 'quarantine-prev',
      nextId: 'quarantine-next',
      empty: 'Nothing quarantined.',
      fetch: (cursor) => api('GET', path('endpoints', ctx.id, 'quarantine'), {
        query: { limit: PAGE_SIZE, after: cursor, status: status.value },
      }),
      render: (rows) => table(['Arrival', 'Webhook id', 'Reason', 'Attempts', 'Quarantined', 'Status', 'Resolved',
        'Retried as', 'Actions'], rows.map((q) => {
        const open = q.status === 'quarantined';
        return el('tr', { 'data-testid': 'quarantine-row', 'data-arrival-seq': q.arrival_seq }, [
          td(q.arrival_seq), td(q.webhook_id, { class: 'mono' }), td(q.reason, { 'data-testid': 'reason' }),
          td(q.attempts), td(time(q.quarantined_at)), td(q.status, { 'data-testid': 'quarantine-status-cell' }),
          td(time(q.resolved_at)), td(q.retried_as),
          el('td', { class: 'row-actions' }, [
            button('Retry', { 'data-testid': 'retry', class: 'secondary', disabled: !open }, () => act(q.arrival_seq, 'retry')),
            button('Discard', { 'data-testid': 'discard', class: 'danger', disabled: !open }, () => act(q.arrival_seq, 'discard')),
          ]),
        ]);
      }), { 'data-testid': 'quarantine-table' }),
    });
    on(status, 'change', () => list.reset());
    list.reset();
    return el('div', {}, [
      el('p', { class: 'muted' }, 'Messages set aside because they cannot be applied. Retry stores one again as a new arrival; discard keeps it for audit, never applied.'),
      el('div', { class: 'actions' }, field('Show', status)),
      answer,
      list.node,
    ]);
  }

  // ---- stream

  function streamSection(ctx) {
    const epoch = el('dd', { 'data-testid': 'stream-epoch' });
    const last = el('dd', { 'data-testid': 'stream-last-seq' });
    const backlog = el('dd', { 'data-testid': 'stream-backlog' });
    const show = (s) => {
      text(epoch, fmtNum(s.change_epoch));
      text(last, fmtNum(s.last_change_seq));
      text(backlog, fmtNum(s.outbox_backlog));
    };
    show(ctx.state);
    ctx.listeners.push(show);

    const from = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'replay-from', placeholder: 'change_seq' });
    const replayAnswer = answerSlot('replay-answer');
    const replay = button('Replay', { 'data-testid': 'replay' }, async () => {
      const n = Number(from.value);
      if (from.value === '' || !Number.isInteger(n) || n < 1) {
        throw new ApiError(0, 'invalid_request', 'give a change_seq of 1 or more to replay from', 'from_change_seq');
      }
      replayAnswer.replaceChildren();
      const answer = await api('POST', path('endpoints', ctx.id, 'replay'), { body: { from_change_seq: n } });
      replayAnswer.show(
        el('p', {}, 'Replaying changes ' + fmtNum(answer.from_change_seq) + ' through ' +
          fmtNum(answer.through_change_seq) + ' of epoch ' + fmtNum(answer.epoch) + ' to the destination.'),
        pre(answer),
      );
      await ctx.refreshState();
    });

    const resyncAnswer = answerSlot('resync-answer');
    const resync = confirmStep('Resync', 'resync',
      'Begin a new epoch with a snapshot of the whole copy? Consumers rebuild from it.', async () => {
        const answer = await api('POST', path('endpoints', ctx.id, 'resync'));
        resyncAnswer.show(
          el('p', {}, 'Epoch ' + fmtNum(answer.epoch) + ' begun with a snapshot of ' + fmtNum(answer.snapshot_items) + ' item(s).'),
          pre(answer),
        );
        await ctx.refreshState();
      });

    return el('div', {}, [
      el('dl', { class: 'kv' }, [el('dt', {}, 'Epoch'), epoch, el('dt', {}, 'Last change_seq'), last,
        el('dt', {}, 'Outbox backlog'), backlog]),
      el('h3', {}, 'Replay'),
      el('p', { class: 'muted' }, 'Send the changes from a change_seq of the current epoch to the destination again, in order.'),
      el('div', { class: 'actions' }, [field('From change_seq', from), replay]),
      replayAnswer,
      el('h3', {}, 'Resync'),
      el('div', { class: 'actions' }, resync),
      resyncAnswer,
    ]);
  }

  // ---- stories

  function storiesSection(ctx) {
    const tickers = ctx.endpoint.tickers || [];
    const tickerFilter = select([['', 'all tickers'], ...tickers.map((t) => [t, t])], { 'data-testid': 'stories-ticker' });
    const includeClosed = el('input', { type: 'checkbox', 'data-testid': 'stories-include-closed' });
    const syncLine = el('p', { class: 'muted', 'data-testid': 'stories-sync' });
    const showSync = (s) => {
      const st = s.stories || {};
      const parts = [];
      if (st.tickers_loading && st.tickers_loading.length) parts.push('loading: ' + st.tickers_loading.join(', '));
      if (st.tickers_dropping && st.tickers_dropping.length) parts.push('dropping: ' + st.tickers_dropping.join(', '));
      text(syncLine, (st.loaded ? 'Copy loaded.' : 'Copy not fully loaded.') + (parts.length ? ' Tickers ' + parts.join('; ') + '.' : ''));
    };
    showSync(ctx.state);
    ctx.listeners.push(showSync);

    const stories = pagedList({
      prevId: 'stories-prev',
      nextId: 'stories-next',
      empty: 'No stories.',
      fetch: (cursor) => api('GET', path('endpoints', ctx.id, 'stories'), {
        query: { limit: PAGE_SIZE, after: cursor, ticker: tickerFilter.value, include_closed: includeClosed.checked ? 'true' : null },
      }),
      render: (rows) => table(['Story', 'Ticker', 'Version', 'Closed', 'Merged into', 'Headline'], rows.map((s) =>
        el('tr', { 'data-testid': 'story-row', 'data-story-id': s.id }, [
          el('td', {}, button(s.id, { class: 'link mono', 'data-testid': 'story-open' }, () => ctx.showItem(s.id))),
          td(s.ticker), td(s.version), td(s.closed), td(s.merged_into),
          td(s.story && s.story.headline, { 'data-testid': 'story-headline' }),
        ])), { 'data-testid': 'stories-table' }),
    });
    on(tickerFilter, 'change', () => stories.reset());
    on(includeClosed, 'change', () => stories.reset());

    const notifications = pagedList({
      prevId: 'notifications-prev',
      nextId: 'notifications-next',
      empty: 'No notifications claimed.',
      fetch: (cursor) => api('GET', path('endpoints', ctx.id, 'notifications'), { query: { limit: PAGE_SIZE, after: cursor } }),
      render: (rows) => table(['Key', 'Story', 'Ticker', 'Event', 'Claimed', 'Notified'], rows.map((n) =>
        el('tr', { 'data-testid': 'notification-row' }, [
          td(n.key, { class: 'mono' }), td(n.story_id, { class: 'mono' }), td(n.ticker), td(n.event_id, { class: 'mono' }),
          td(time(n.claimed_at)), td(n.notified),
        ])), { 'data-testid': 'notifications-table' }),
    });
    stories.reset();
    notifications.reset();
    return el('div', {}, [
      el('h3', {}, 'Tickers'),
      el('ul', { class: 'tags', 'data-testid': 'tickers' }, tickers.length
        ? tickers.map((t) => el('li', {}, t)) : el('li', { class: 'muted' }, 'none')),
      syncLine,
      el('h3', {}, 'Stories'),
      el('div', { class: 'actions' }, [field('Ticker', tickerFilter),
        field('Include closed', includeClosed, { class: 'field inline' })]),
      stories.node,
      el('h3', {}, 'Notifications'),
      notifications.node,
    ]);
  }

  // ---------------------------------------------------------------- tenant: broker

  function viewBroker(main) {
    const credentials = el('div', { 'data-testid': 'broker-credentials' }, loading());
    const password = el('div', { 'data-testid': 'broker-password-box' });
    const destination = el('div', { 'data-testid': 'destination' }, loading());

    function renderNone() {
      password.replaceChildren();
      credentials.replaceChildren(
        empty('No broker credentials yet: make them to read your queue on the relay\u2019s broker.'),
        el('div', { class: 'actions' }, button('Create credentials', { 'data-testid': 'broker-create' }, async () => {
          const made = await api('POST', path('broker', 'credentials'));
          renderCredentials(made);
        })),
      );
    }

    function renderCredentials(c) {
      if (c.password) {
        password.replaceChildren(shownOnce(c.password, 'broker-password',
          'The password, shown once: copy it now. Rotate for a new one if it is lost.'));
      }
      const rotate = button('Rotate password', { 'data-testid': 'broker-rotate' }, async () => {
        renderCredentials(await api('POST', path('broker', 'credentials', 'rotate')));
      });
      const remove = confirmStep('Delete', 'broker-delete',
        'Delete the broker user? Its connections are closed.', async () => {
          await api('DELETE', path('broker', 'credentials'));
          renderNone();
        });
      credentials.replaceChildren(
        dl([
          ['Username', copyable(c.username, 'broker-username')],
          ['Connection URL', copyable(c.amqp_url, 'broker-url')],
          ['Host', c.host],
          ['Port', String(c.port)],
          ['Virtual host', c.vhost],
          ['Queues', el('ul', { 'data-testid': 'broker-queues', class: 'plain' }, [
            el('li', {}, [el('span', { class: 'muted' }, 'changes: '), copyable(c.queue, 'broker-queue')]),
            el('li', {}, [el('span', { class: 'muted' }, 'dead letters: '), copyable(c.dead_letter_queue, 'broker-dlq')]),
          ])],
          ['Created', time(c.created_at)],
          ['Password rotated', time(c.rotated_at)],
        ]),
        el('p', { class: 'muted' }, 'The URL carries no password: give it with the password above, or add it to the URL yourself.'),
        el('div', { class: 'actions' }, [rotate, remove]),
      );
    }

    async function load() {
      credentials.replaceChildren(loading());
      try {
        renderCredentials(await api('GET', path('broker', 'credentials')));
      } catch (err) {
        if (err instanceof ApiError && err.status === 404) renderNone();
        else {
          credentials.replaceChildren(el('p', { class: 'muted' }, 'Could not load the credentials.'));
          report(err, credentials);
        }
      }
    }

    async function loadDestination() {
      try {
        const d = await api('GET', path('destination'));
        destination.replaceChildren(dl([
          ['Kind', d.kind + (d.default ? ' (default)' : '')],
          ['Exchange', d.exchange],
          ['Routing key', d.routing_key],
          ['Broker URL set', d.amqp_url_set],
          ['Updated', time(d.updated_at)],
          ['Refused', d.refused_reason ? d.refused_reason + ' (' + fmtTime(d.refused_at) + ')' : 'no'],
        ]));
      } catch (err) {
        destination.replaceChildren(el('p', { class: 'muted' }, 'Could not load the destination.'));
        report(err, destination);
      }
    }

    const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, async () => {
      password.replaceChildren();
      await Promise.all([load(), loadDestination()]);
    });
    main.append(
      el('div', { class: 'title-row' }, [el('h1', {}, 'Broker'), refresh]),
      el('section', { class: 'card' }, [el('h2', {}, 'Credentials'), password, credentials]),
      el('section', { class: 'card' }, [el('h2', {}, 'Destination'),
        el('p', { class: 'muted' }, 'Where your changes go: the relay\u2019s queue for you, or your own exchange.'), destination]),
    );
    load();
    loadDestination();
  }

  // ---------------------------------------------------------------- operator: tenants

  function viewTenants(main, selectedId) {
    const panel = el('section', { class: 'card', hidden: true });
    const name = el('input', { type: 'text', 'data-testid': 'tenant-name', maxlength: 200, required: true, autocomplete: 'off' });
    const newId = el('input', { type: 'text', 'data-testid': 'tenant-id', placeholder: 'optional UUID', autocomplete: 'off', spellcheck: 'false' });
    const create = el('button', { type: 'submit', 'data-testid': 'tenant-create' }, 'Create tenant');
    const form = el('form', { class: 'card', 'data-testid': 'tenant-create-form' }, [
      el('h2', {}, 'New tenant'),
      el('div', { class: 'actions' }, [field('Name', name), field('Id', newId), create]),
    ]);
    const list = pagedList({
      prevId: 'prev-page',
      nextId: 'next-page',
      empty: 'No tenants yet.',
      fetch: (cursor) => api('GET', path('tenants'), { query: { limit: PAGE_SIZE, after: cursor } }),
      render: tenantTable,
    });

    on(form, 'submit', (event) => {
      event.preventDefault();
      busy(create, async () => {
        clearError();
        const body = { name: name.value.trim() };
        if (newId.value.trim()) body.id = newId.value.trim();
        const tenant = await api('POST', path('tenants'), { body });
        name.value = '';
        newId.value = '';
        history.replaceState(null, '', tenantHref(tenant.id));
        showPanel(panel, tenant.id, tenant, list, true);
        await list.reload();
      });
    });

    const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, () => list.reload());
    main.append(
      el('div', { class: 'title-row' }, [el('h1', {}, 'Tenants'), refresh]),
      form,
      panel,
      el('section', { class: 'card' }, [el('h2', {}, 'All tenants'), list.node]),
    );
    if (selectedId) showPanel(panel, selectedId, null, list, false);
    list.reset();
  }

  function tenantTable(tenants) {
    const rows = tenants.map((t) => {
      const used = el('td', { 'data-testid': 'usage' }, '\u2026');
      const rate = el('td', { 'data-testid': 'rate-quota' }, '\u2026');
      const overrides = el('td', { 'data-testid': 'overrides' }, '\u2026');
      api('GET', path('tenants', t.id, 'quotas')).then((q) => {
        const inForce = q.in_force || {};
        const o = q.overrides || {};
        text(used, fmtNum(q.usage && q.usage.endpoints) + ' / ' + fmtNum(inForce.max_endpoints));
        text(rate, fmtNum(inForce.max_messages_per_second));
        const set = [];
        if (o.max_endpoints !== null && o.max_endpoints !== undefined) set.push('endpoints');
        if (o.max_messages_per_second !== null && o.max_messages_per_second !== undefined) set.push('messages/s');
        text(overrides, set.length ? set.join(', ') : 'defaults');
      }).catch((err) => {
        for (const c of [used, rate, overrides]) text(c, DASH);
        overrides.title = describe(err);
      });
      return el('tr', { 'data-testid': 'tenant-row', 'data-tenant-id': t.id }, [
        el('td', {}, el('a', { href: tenantHref(t.id), class: 'mono', 'data-testid': 'tenant-link' }, t.id)),
        td(t.name, { 'data-testid': 'tenant-name-cell' }), td(time(t.created_at)), used, rate, overrides,
        el('td', {}, el('a', { href: tenantHref(t.id), 'data-testid': 'tenant-manage' }, 'Manage')),
      ]);
    });
    return table(['Id', 'Name', 'Created', 'Endpoints (used / quota)', 'Messages/s quota', 'Overrides', ''], rows,
      { 'data-testid': 'tenants-table' });
  }

  // The selected tenant: its token, its quotas, its offboarding.
  async function showPanel(panel, id, tenant, list, created) {
    panel.hidden = false;
    panel.setAttribute('data-testid', 'tenant-panel');
    panel.replaceChildren(el('h2', {}, 'Tenant'), loading());
    let t = tenant;
    let quotas = null;
    try {
      [t, quotas] = await Promise.all([
        t ? Promise.resolve(t) : api('GET', path('tenants', id)),
        api('GET', path('tenants', id, 'quotas')),
      ]);
    } catch (err) {
      panel.replaceChildren(el('h2', {}, 'Tenant'), el('p', { class: 'muted' }, 'Could not load this tenant.'));
      report(err, panel);
      return;
    }

    const ttl = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'mint-ttl', placeholder: '86400' });
    const minted = el('div', { 'data-testid': 'minted-token-box' });
    const mint = button('Mint token', { 'data-testid': 'mint-token' }, async () => {
      const body = {};
      if (ttl.value !== '') body.ttl_s = Number(ttl.value);
      const issued = await api('POST', path('tenants', t.id, 'tokens'), { body });
      minted.replaceChildren(
        shownOnce(issued.token, 'minted-token', 'The tenant\u2019s token, shown once: hand it to the tenant now.'),
        el('p', { class: 'muted' }, 'Expires ' + fmtTime(issued.expires_at) + '.'),
      );
    });

    const quotaBox = el('div', { 'data-testid': 'quotas' });
    function renderQuotas(q) {
      const inForce = q.in_force || {};
      const defaults = q.defaults || {};
      const o = q.overrides || {};
      const maxEndpoints = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'quota-max-endpoints',
        placeholder: 'default ' + fmt(defaults.max_endpoints), value: o.max_endpoints === null || o.max_endpoints === undefined ? '' : o.max_endpoints });
      const maxRate = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'quota-max-rate',
        placeholder: 'default ' + fmt(defaults.max_messages_per_second),
        value: o.max_messages_per_second === null || o.max_messages_per_second === undefined ? '' : o.max_messages_per_second });
      const save = button('Save quotas', { 'data-testid': 'quotas-save', class: 'secondary' }, async () => {
        const value = (input) => (input.value === '' ? null : Number(input.value));
        const answer = await api('PUT', path('tenants', t.id, 'quotas'),
          { body: { max_endpoints: value(maxEndpoints), max_messages_per_second: value(maxRate) } });
        renderQuotas(answer);
        await list.reload();
      });
      quotaBox.replaceChildren(
        dl([
          ['Endpoints in use', q.usage && q.usage.endpoints, 'quota-usage'],
          ['Max endpoints in force', inForce.max_endpoints],
          ['Max messages/s in force', inForce.max_messages_per_second],
        ]),
        el('div', { class: 'actions' }, [field('Max endpoints', maxEndpoints), field('Max messages/s', maxRate), save,
          el('span', { class: 'muted' }, 'Blank: the operator\u2019s default.')]),
      );
    }
    renderQuotas(quotas);

    const offboardAnswer = answerSlot('offboard-answer');
    const offboard = confirmStep('Offboard', 'offboard',
      'Delete this tenant, every endpoint, queue and broker user of it? This cannot be undone.', async () => {
        const answer = await api('DELETE', path('tenants', t.id));
        offboardAnswer.show('Tenant ' + fmt(answer.id) + ': ' + fmt(answer.status) + '.');
        await list.reload();
      });

    panel.replaceChildren(
      el('h2', {}, (created ? 'Created: ' : 'Tenant: ') + t.name),
      dl([['Id', copyable(t.id, 'selected-tenant-id')], ['Name', t.name], ['Created', time(t.created_at)]]),
      el('h3', {}, 'Token'),
      el('div', { class: 'actions' }, [field('Lifetime (s)', ttl), mint]),
      minted,
      el('h3', {}, 'Quotas'),
      quotaBox,
      el('h3', {}, 'Offboarding'),
      el('div', { class: 'actions' }, offboard),
      offboardAnswer,
    );
  }

  // ---------------------------------------------------------------- start

  function start() {
    session = restoreSession();
    window.addEventListener('hashchange', route);
    route();
    if (session && !session.kind) {
      probeKind().then((kind) => {
        session.kind = kind;
        route();
      }).catch((err) => showError(err));
    } else if (session && session.kind === 'tenant') {
      loadOwnTenant().catch((err) => showError(err));
    }
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
