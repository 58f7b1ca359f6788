// One stored message: what it was (its headers and body, pretty-printed when it is JSON), how
// it applied, its quarantine row (Retry, Discard), and the changes it made.

import { el, shown, swap, visibleControls } from '../lib/dom.js';
import { api, path } from '../lib/api.js';
import { fmtCount, fmtId, time } from '../lib/format.js';
import {
  button, dl, table, td, loading, report, errorSlot, confirmStep, announce, answerSlot, clamp, endpointHref, pre,
} from '../lib/widgets.js';
import { setTitle } from '../lib/session.js';
import { outcomeText } from './endpoint/messages.js';

export async function viewMessage(main, endpointId, seq) {
  setTitle('Message ' + seq + ' of endpoint ' + endpointId);
  const heading = el('h1', { tabindex: -1, 'data-testid': 'message-title' }, ['Message ', shown(seq, { class: 'mono' })]);
  const holder = el('div', {}, loading());
  main.append(
    el('p', {}, el('a', { href: endpointHref(endpointId), 'data-testid': 'back-to-endpoint' }, ['\u2190 Endpoint ', shown(endpointId, { class: 'mono' })])),
    heading,
    holder,
  );

  async function load() {
    const [detail, endpoint] = await Promise.all([
      api('GET', path('endpoints', endpointId, 'messages', seq)),
      api('GET', path('endpoints', endpointId)).catch(() => null),
    ]);
    if (!holder.isConnected) return;
    render(detail, endpoint);
  }

  function render(detail, endpoint) {
    const m = detail.message || {};
    const name = endpoint && endpoint.name ? endpoint.name : endpointId;
    setTitle('Message ' + m.arrival_seq + ' \u00b7 Endpoint ' + name);
    swap(heading, 'Message ', shown(fmtId(m.arrival_seq), { class: 'mono' }), ' of ', shown(name));
    heading.classList.add('title-clamp');
    heading.setAttribute('title', visibleControls('Message ' + m.arrival_seq + ' of ' + name));
    const h = detail.headers || {};
    const parts = [];
    parts.push(el('section', { class: 'card', 'data-testid': 'message-summary', 'aria-labelledby': 'h-msg' }, [
      el('h2', { id: 'h-msg' }, 'Message'),
      dl([
        ['Arrival', fmtId(m.arrival_seq), 'message-arrival-seq'],
        ['Webhook id', shown(m.webhook_id, { class: 'mono' }), 'message-webhook-id'],
        ['Status', m.status, 'message-detail-status'],
        ['Outcome', outcomeText(m.applied), 'message-outcome'],
        ['Applied at', time(m.applied && m.applied.applied_at)],
        ['Received', time(m.received_at)],
        ['Signed at', time(m.signed_at)],
        ['Track', m.track],
        ['Generation', fmtId(m.generation)],
        ['Attempt', fmtId(m.attempt)],
        ['Body', fmtCount(m.body_bytes) + ' bytes'],
        ['Answered', fmtId(m.answered)],
        ['Sent again', m.duplicates > 0 ? fmtCount(m.duplicates) + ' time(s), last ' : 'no', 'message-duplicates'],
      ]),
    ]));
    if (m.duplicates > 0) parts[0].querySelector('[data-testid="message-duplicates"]').append(time(m.last_duplicate_at));

    parts.push(el('section', { class: 'card', 'data-testid': 'message-headers', 'aria-labelledby': 'h-headers' }, [
      el('h2', { id: 'h-headers' }, 'Headers'),
      dl([
        ['webhook-id', shown(h['webhook-id'], { class: 'mono' })],
        ['webhook-timestamp', shown(h['webhook-timestamp'], { class: 'mono' })],
        ['webhook-attempt', h['webhook-attempt'] === null || h['webhook-attempt'] === undefined ? null : shown(h['webhook-attempt'], { class: 'mono' })],
      ]),
    ]));

    const body = typeof detail.body === 'string' ? detail.body : '';
    let pretty = null;
    try {
      pretty = JSON.stringify(JSON.parse(body), null, 2);
    } catch (_) {
      pretty = null;
    }
    parts.push(el('section', { class: 'card', 'data-testid': 'message-body-section', 'aria-labelledby': 'h-body' }, [
      el('h2', { id: 'h-body' }, 'Body'),
      el('p', { class: 'muted' }, pretty !== null ? 'JSON, pretty-printed.' : 'Not JSON: shown as text (bytes that are not UTF-8 replaced).'),
      pre(pretty !== null ? pretty : body, { 'data-testid': 'message-body', class: 'body', 'aria-label': 'Message body' }),
    ]));

    const q = detail.quarantine;
    if (q) parts.push(quarantineCard(q));

    const changes = Array.isArray(detail.changes) ? detail.changes : [];
    parts.push(el('section', { class: 'card', 'data-testid': 'message-changes', 'aria-labelledby': 'h-changes' }, [
      el('h2', { id: 'h-changes' }, 'Changes it made'),
      changes.length
        ? table(['change_seq', 'Operation', 'Subject', 'Kind', 'Generation', 'Sequence', 'Event id', 'Written'], changes.map((c) =>
          el('tr', { 'data-testid': 'change-row', 'data-change-seq': c.change_seq }, [
            td(fmtId(c.change_seq), { class: 'mono' }), td(c.operation), el('td', { class: 'mono' }, clamp(c.subject)), td(c.item_kind),
            td(fmtId(c.generation)), td(c.sequence, { class: 'mono' }), el('td', { class: 'mono' }, c.event_id ? clamp(c.event_id) : '\u2014'),
            td(time(c.created_at)),
          ])), { 'data-testid': 'changes-table' }, 'Changes')
        : el('p', { class: 'empty', 'data-testid': 'no-changes' }, 'No changes: it changed nothing in the copy (or has not been applied yet).'),
      detail.changes_cut ? el('p', { class: 'warn', 'data-testid': 'changes-cut' },
        'Only the first changes are listed: this message made more than one read returns.') : null,
    ]));
    swap(holder, parts);
  }

  function quarantineCard(q) {
    const errors = errorSlot('message-quarantine-error');
    const answer = answerSlot('message-quarantine-answer');
    const open = q.status === 'quarantined';
    const act = async (action) => {
      const result = await api('POST', path('endpoints', endpointId, 'quarantine', q.arrival_seq, action));
      announce('Arrival ' + result.arrival_seq + ' ' + result.status + '.');
      await load();
      const slot = document.querySelector('[data-testid="message-quarantine"] .answer-slot');
      if (slot) slot.show(el('p', {}, 'Arrival ' + fmtId(result.arrival_seq) + ': ' + result.status +
        (result.retried_as !== null && result.retried_as !== undefined ? ', stored again as arrival ' + fmtId(result.retried_as) : '') + '.'),
        result.retried_as !== null && result.retried_as !== undefined
          ? el('p', {}, el('a', { href: '#/endpoints/' + encodeURIComponent(endpointId) + '/messages/' + encodeURIComponent(result.retried_as), 'data-testid': 'retried-as-link' }, 'Open arrival ' + fmtId(result.retried_as)))
          : null);
    };
    return el('section', { class: 'card', 'data-testid': 'message-quarantine', 'aria-labelledby': 'h-q' }, [
      el('h2', { id: 'h-q' }, 'Quarantine'),
      dl([
        ['Status', q.status, 'message-quarantine-status'],
        ['Reason', q.reason],
        ['Attempts', fmtCount(q.attempts)],
        ['Quarantined', time(q.quarantined_at)],
        ['Resolved', time(q.resolved_at)],
        ['Retried as', q.retried_as === null || q.retried_as === undefined ? null
          : el('a', { href: '#/endpoints/' + encodeURIComponent(endpointId) + '/messages/' + encodeURIComponent(q.retried_as) }, fmtId(q.retried_as))],
      ]),
      open ? el('div', { class: 'actions' }, [
        button('Retry', { 'data-testid': 'message-retry', class: 'secondary' }, () => act('retry'), errors),
        confirmStep('Discard', 'message-discard', 'Discard this message? It is kept for audit and never applied; this cannot be undone.',
          () => act('discard'), { slot: errors }),
      ]) : null,
      errors,
      answer,
    ]);
  }

  try {
    await load();
  } catch (err) {
    holder.replaceChildren(el('p', { class: 'muted', 'data-testid': 'message-unavailable' }, 'Could not load this message.'));
    report(err, holder);
  }
}
