// An endpoint's stored messages: found by webhook-id (exactly), searched by text in their
// bodies, filtered by status and time; each row opens the message's own page.

import { el, on, shown } from '../../lib/dom.js';
import { api, path, invalid, PAGE_SIZE } from '../../lib/api.js';
import { fmtCount, fmtId, fmtTime, time, zoneName, DASH } from '../../lib/format.js';
import {
  button, field, select, table, td, pagedList, errorSlot, busy, announce, answerSlot, clamp, messageHref,
} from '../../lib/widgets.js';

// The most pages one search reads to fill a page: a text search scans a bounded number of
// messages a page, so a page may come back short, or empty, with more to read.
const SEARCH_PAGES = 10;

export function outcomeText(applied) {
  if (!applied) return DASH;
  return applied.outcome + (applied.reason ? ': ' + applied.reason : '') + ' (' + fmtCount(applied.events_applied) +
    ' applied, ' + fmtCount(applied.events_ignored) + ' ignored)';
}

export function messagesSection(ctx) {
  // ---- find one by its webhook-id
  const webhookId = el('input', { type: 'search', 'data-testid': 'message-find-id', autocomplete: 'off', spellcheck: 'false', placeholder: 'msg_2KWPBgLlAfxdpx2AI54pPJ85f4W' });
  const findGo = el('button', { type: 'submit', 'data-testid': 'message-find-go' }, 'Find');
  const findErrors = errorSlot('message-find-error', webhookId);
  const found = answerSlot('message-found');
  const findForm = el('form', { class: 'actions', role: 'search', 'aria-label': 'Find a message by webhook-id' },
    [field('Webhook id (exact)', webhookId), findGo]);
  on(findForm, 'submit', (event) => {
    event.preventDefault();
    busy(findGo, async () => {
      found.clear();
      const id = webhookId.value.trim();
      if (!id) throw invalid('type a webhook-id to find');
      const detail = await api('GET', path('endpoints', ctx.id, 'messages', 'by-webhook-id', id));
      const m = detail.message || {};
      found.show(el('p', {}, [
        'Arrival ', el('a', { href: messageHref(ctx.id, m.arrival_seq), 'data-testid': 'message-found-link' }, fmtId(m.arrival_seq)),
        ': ', shown(m.webhook_id, { class: 'mono' }), ', received ', time(m.received_at), ', ', shown(m.status, { 'data-testid': 'message-found-status' }), '.',
      ]));
      announce('Found message ' + m.arrival_seq + '.');
    }, findErrors);
  });

  // ---- the list, its filters and the text search
  const status = select([['', 'any status'], ['waiting', 'waiting'], ['applied', 'applied'], ['ignored', 'ignored'],
    ['quarantined', 'quarantined'], ['duplicate', 'sent more than once']], { 'data-testid': 'messages-status' });
  const order = select([['newest', 'newest first'], ['arrival', 'by arrival']], { 'data-testid': 'messages-order' });
  const from = el('input', { type: 'datetime-local', step: 1, 'data-testid': 'messages-from' });
  const before = el('input', { type: 'datetime-local', step: 1, 'data-testid': 'messages-before' });
  const contains = el('input', { type: 'search', 'data-testid': 'messages-contains', autocomplete: 'off', maxlength: 200, placeholder: 'text in the body' });
  const listErrors = errorSlot('messages-error');
  const instant = (input, fieldName) => {
    if (!input.value) return null;
    const d = new Date(input.value);
    if (Number.isNaN(d.getTime())) throw invalid('not a time: ' + input.value, fieldName);
    return d.toISOString();
  };
  // Asked of the list: with a text search, pages are read on until one holds rows (or a few
  // were read), so the reader does not page through empty stretches.
  async function fetchPage(cursor) {
    const query = {
      limit: PAGE_SIZE, order: order.value, status: status.value, contains: contains.value.trim() || null,
      received_from: instant(from, 'received_from'), received_before: instant(before, 'received_before'),
    };
    let next = cursor;
    const data = [];
    for (let i = 0; i < (query.contains ? SEARCH_PAGES : 1); i += 1) {
      const page = await api('GET', path('endpoints', ctx.id, 'messages'), { query: Object.assign({}, query, { cursor: next }) });
      data.push(...(page.data || []));
      next = page.next_cursor || null;
      if (!next || data.length) break;
    }
    const emptyNote = next ? 'No match in the messages read so far: Next page reads further.' : null;
    return { data, next_cursor: next, emptyNote };
  }
  const list = pagedList({
    prevId: 'messages-prev',
    nextId: 'messages-next',
    slot: listErrors,
    empty: 'No messages match.',
    fetch: fetchPage,
    render: (rows) => table(['Arrival', 'Received', 'Webhook id', 'Track', 'Generation', 'Attempt', 'Bytes',
      'Status', 'Outcome', 'Duplicate'], rows.map((m) => {
      const duplicate = m.duplicates > 0
        ? 'yes, ' + fmtCount(m.duplicates) + ' repeat(s), last ' + fmtTime(m.last_duplicate_at)
        : 'no';
      return el('tr', { 'data-testid': 'message-row', 'data-arrival-seq': m.arrival_seq, 'data-webhook-id': m.webhook_id }, [
        el('td', {}, el('a', { href: messageHref(ctx.id, m.arrival_seq), 'data-testid': 'message-link', 'aria-label': 'Message ' + m.arrival_seq }, fmtId(m.arrival_seq))),
        td(time(m.received_at)), el('td', { class: 'mono' }, clamp(m.webhook_id)), td(m.track),
        td(fmtId(m.generation)), td(fmtId(m.attempt)), td(fmtCount(m.body_bytes)), td(m.status, { 'data-testid': 'message-status' }),
        el('td', {}, clamp(outcomeText(m.applied))), td(duplicate, { 'data-testid': 'duplicate' }),
      ]);
    }), { 'data-testid': 'messages-table' }, 'Messages'),
  });
  const filters = el('form', { class: 'actions', 'aria-label': 'Filter messages' }, [
    field('Text in the body', contains), field('Status', status), field('Order', order),
    field('Received from', from, {}, 'Your time: ' + zoneName()), field('Received before', before, {}, 'Your time: ' + zoneName()),
    el('button', { type: 'submit', 'data-testid': 'messages-apply', class: 'secondary' }, 'Apply filters'),
  ]);
  on(filters, 'submit', (event) => {
    event.preventDefault();
    list.reset();
  });
  ctx.reloaders.push(() => list.reload(true));
  list.reset();
  return el('div', {}, [
    findForm, findErrors, found,
    el('h3', {}, 'All messages'),
    filters,
    listErrors,
    list.node,
  ]);
}

