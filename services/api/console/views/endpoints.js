// A tenant's endpoints: the list with each one's state at a glance, and a form to register one.

import { el, add, on, text, shown, swap } from '../lib/dom.js';
import { api, path, describe, invalid, PAGE_SIZE } from '../lib/api.js';
import { fmtCount, fmtDuration, DASH } from '../lib/format.js';
import {
  button, field, select, table, td, pagedList, shownOnce, formErrors, busy, announce,
  randomSecret, randomUuid, endpointHref, answerSlot, report, clamp, errorSlot,
} from '../lib/widgets.js';
import { session, loadOwnTenant, setTitle, takeCarried } from '../lib/session.js';

export function viewEndpoints(main) {
  setTitle('Endpoints');
  const carried = takeCarried();
  const summary = el('p', { class: 'muted', 'data-testid': 'tenant-summary' });
  const showSummary = (tenant) => {
    if (!tenant) return;
    const q = tenant.quotas || {};
    const u = tenant.usage || {};
    swap(summary, 'Tenant ', clamp(tenant.name), ' (', shown(tenant.id, { class: 'mono' }), '): ' + fmtCount(u.endpoints) + ' of ' +
      fmtCount(q.max_endpoints) + ' endpoints, at most ' + fmtCount(q.max_messages_per_second) + ' messages/s.');
  };
  const list = pagedList({
    prevId: 'prev-page',
    nextId: 'next-page',
    errorId: 'endpoints-error',
    empty: 'No endpoints yet: register one below.',
    renderEmpty: true,
    fetch: (cursor) => api('GET', path('endpoints'), { query: { limit: PAGE_SIZE, after: cursor } }),
    render: endpointTable,
  });
  const refreshErrors = errorSlot('refresh-error');
  const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, async () => {
    await Promise.all([list.reload(true), loadOwnTenant().then(showSummary)]);
    announce('Endpoints refreshed.');
  }, refreshErrors);
  const create = createForm(async () => {
    await Promise.all([list.reload(true), loadOwnTenant().then(showSummary).catch(() => {})]);
  });
  add(main, [
    el('div', { class: 'title-row' }, [el('h1', { tabindex: -1 }, 'Endpoints'), refresh]),
    refreshErrors,
    carried ? el('p', { class: 'status-line', role: 'status', 'data-testid': carried.testid }, carried.text) : null,
    summary,
    el('section', { class: 'card', 'aria-label': 'All endpoints' }, list.node),
    create,
  ]);
  const s = session();
  showSummary(s && s.tenant);
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
      el('td', { class: 'name-cell' }, [
        el('a', { href: endpointHref(ep.id), 'data-testid': 'endpoint-link' },
          ep.name ? clamp(ep.name, { 'data-testid': 'endpoint-name' }) : shown(ep.id, { class: 'mono' })),
        ep.name ? el('div', { class: 'muted mono small' }, shown(ep.id)) : null,
      ]),
      el('td', {}, clamp(details || DASH)),
      td(ep.source, { 'data-testid': 'source' }),
      el('td', { 'data-testid': 'status' }, el('span', { class: 'badge ' + (ep.status === 'paused' ? 'warn' : 'ok') }, ep.status)),
      cells.upstream, cells.lag, cells.waiting, cells.outbox, cells.quarantined, cells.notes,
    ]);
    loadRowState(ep.id, cells);
    return tr;
  });
  if (!rows.length) {
    rows.push(el('tr', {}, el('td', { colspan: 10, class: 'empty', 'data-testid': 'empty' },
      'No endpoints yet: register one below.')));
  }
  return table(['Endpoint', 'Language / tickers', 'Source', 'Status', 'Upstream', 'Apply lag',
    'Waiting', 'Outbox backlog', 'Quarantined', 'Notes'], rows, { 'data-testid': 'endpoints-table' }, 'Endpoints');
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
  text(cells.lag, fmtDuration(state.apply_lag_s));
  text(cells.waiting, fmtCount(state.messages_waiting));
  text(cells.outbox, fmtCount(state.outbox_backlog));
  text(cells.quarantined, fmtCount(state.messages_quarantined));
  const notes = stateNotes(state);
  cells.notes.replaceChildren(notes.length ? clamp(notes.join('; ')) : document.createTextNode(DASH));
}

export function upstreamSummary(upstream) {
  const u = upstream || {};
  const cls = u.status === 'ok' ? 'ok' : u.status === 'failing' ? 'bad' : 'warn';
  return el('span', {}, [
    el('span', { class: 'badge ' + cls, 'data-testid': 'upstream-status' }, u.status || 'unknown'),
    u.last_error ? el('span', { class: 'last-error', 'data-testid': 'last-error' },
      [u.last_error_kind ? shown(u.last_error_kind) : null, u.last_error_kind ? ': ' : null, clamp(u.last_error)]) : null,
  ]);
}

export function stateNotes(state) {
  const notes = [];
  if (state.restore) notes.push('restore held: waiting for the feed rewind');
  if (state.reload_running) notes.push('reload running');
  if (state.reload_waiting_since) notes.push('reload waiting for a slot');
  const stories = state.stories;
  if (stories && stories.reload) {
    if (stories.reload.status === 'running') notes.push('reload running');
    if (stories.reload.status === 'owed') notes.push('reload owed');
  }
  if (stories && stories.tickers_loading && stories.tickers_loading.length) notes.push('tickers loading: ' + stories.tickers_loading.join(', '));
  if (stories && stories.reads_owed) notes.push(fmtCount(stories.reads_owed) + ' story reads owed');
  return notes;
}

// ---- registering an endpoint

function splitTickers(value) {
  return value.split(',').map((t) => t.trim()).filter(Boolean);
}

function createForm(created) {
  const id = el('input', { type: 'text', 'data-testid': 'endpoint-new-id', autocomplete: 'off', spellcheck: 'false',
    placeholder: 'the upstream\u2019s webhook_endpoint_id (a UUID)', required: true, class: 'mono' });
  const generate = button('Generate', { 'data-testid': 'endpoint-new-id-generate', class: 'secondary small' }, async () => {
    id.value = randomUuid();
  });
  const name = el('input', { type: 'text', 'data-testid': 'endpoint-new-name', maxlength: 200, autocomplete: 'off', placeholder: 'optional' });
  const source = select([['feed', 'feed'], ['stories', 'stories']], { 'data-testid': 'endpoint-new-source' });
  const lang = el('input', { type: 'text', 'data-testid': 'endpoint-new-lang', value: 'en', autocomplete: 'off', spellcheck: 'false', class: 'short' });
  const tickers = el('input', { type: 'text', 'data-testid': 'endpoint-new-tickers', autocomplete: 'off', spellcheck: 'false', placeholder: 'ALFA B, BETA' });
  const mode = select([['snapshot', 'snapshot'], ['fetch_on_notify', 'fetch_on_notify']], { 'data-testid': 'endpoint-new-stories-mode' });
  const baseUrl = el('input', { type: 'text', 'data-testid': 'endpoint-new-base-url', autocomplete: 'off', spellcheck: 'false', placeholder: 'https://api.example.com', inputmode: 'url' });
  const apiKey = el('input', { type: 'password', 'data-testid': 'endpoint-new-api-key', autocomplete: 'new-password', spellcheck: 'false', placeholder: 'write-only' });
  const secret = el('input', { type: 'password', 'data-testid': 'endpoint-new-secret', autocomplete: 'off', spellcheck: 'false', placeholder: 'whsec_\u2026 or empty to generate one' });
  const submit = el('button', { type: 'submit', 'data-testid': 'endpoint-create' }, 'Register endpoint');
  const errors = formErrors('endpoint-create', {
    id, name, source, lang, tickers, stories_mode: mode, upstream_base_url: baseUrl, upstream_api_key: apiKey, secrets: secret,
  });
  const answer = answerSlot('endpoint-created');
  const slot = (key) => errors.slotFor(key);
  const feedOnly = el('div', { class: 'form-row' }, [el('div', { class: 'form-cell' }, [field('Language', lang, {}, 'As set at the upstream: en, sv, pt-BR'), slot('lang')])]);
  const storiesOnly = el('div', { class: 'form-row', hidden: true }, [
    el('div', { class: 'form-cell' }, [field('Tickers', tickers, {}, 'Comma-separated, 1 to 100'), slot('tickers')]),
    el('div', { class: 'form-cell' }, [field('Stories mode', mode), slot('stories_mode')]),
  ]);
  on(source, 'change', () => {
    feedOnly.hidden = source.value !== 'feed';
    storiesOnly.hidden = source.value !== 'stories';
  });
  const form = el('form', { class: 'create-form', novalidate: true, 'data-testid': 'endpoint-create-form', 'aria-label': 'Register an endpoint' }, [
    el('div', { class: 'form-row' }, [
      el('div', { class: 'form-cell wide' }, [el('div', { class: 'with-button' }, [field('Id', id), generate]), slot('id')]),
      el('div', { class: 'form-cell' }, [field('Name', name, {}, '1 to 200 characters'), slot('name')]),
      el('div', { class: 'form-cell' }, [field('Source', source), slot('source')]),
    ]),
    feedOnly,
    storiesOnly,
    el('div', { class: 'form-row' }, [
      el('div', { class: 'form-cell wide' }, [field('Upstream base URL', baseUrl, {}, 'Optional: for reloads and rewinds'), slot('upstream_base_url')]),
      el('div', { class: 'form-cell' }, [field('Upstream API key', apiKey, {}, 'Optional, write-only'), slot('upstream_api_key')]),
    ]),
    el('div', { class: 'form-row' }, [
      el('div', { class: 'form-cell wide' }, [field('Signing secret', secret, {}, 'Paste the secret the upstream shows, or leave empty to generate one here (shown once)'), slot('secrets')]),
    ]),
    errors.form,
    el('div', { class: 'actions' }, submit),
  ]);
  on(form, 'submit', (event) => {
    event.preventDefault();
    busy(submit, async () => {
      errors.clear();
      answer.clear();
      const endpointId = id.value.trim();
      if (!endpointId) throw invalid('give the endpoint\u2019s id (Generate makes one)', 'id');
      const body = { id: endpointId, source: source.value };
      if (name.value.trim()) body.name = name.value.trim();
      if (source.value === 'feed') {
        body.lang = lang.value.trim();
      } else {
        body.tickers = splitTickers(tickers.value);
        body.stories_mode = mode.value;
      }
      if (baseUrl.value.trim()) body.upstream_base_url = baseUrl.value.trim();
      if (apiKey.value) body.upstream_api_key = apiKey.value;
      const pasted = secret.value.trim();
      const generated = pasted ? null : randomSecret();
      body.secrets = [pasted || generated];
      const made = await api('POST', path('endpoints'), { body });
      for (const input of [id, name, tickers, baseUrl, apiKey, secret]) input.value = '';
      answer.show(
        el('p', {}, ['Registered ', el('a', { href: endpointHref(made.id), 'data-testid': 'endpoint-created-link' },
          made.name ? shown(made.name) : shown(made.id, { class: 'mono' })), '.']),
        generated ? shownOnce(generated, 'endpoint-created-secret',
          'Its signing secret, made in this browser and shown once: give it to the upstream now.') : null,
      );
      announce('Endpoint registered.');
      await created();
    }, errors);
  });
  return el('details', { class: 'card create', 'data-testid': 'endpoint-create-section' }, [
    el('summary', { 'data-testid': 'endpoint-create-open' }, el('h2', { class: 'inline-h2' }, 'Register an endpoint')),
    form,
    answer,
  ]);
}

