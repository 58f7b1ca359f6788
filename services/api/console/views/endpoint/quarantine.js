// An endpoint's quarantine: messages set aside because they cannot be applied. Each is retried
// (stored again as a new arrival) or discarded (kept for audit, never applied; confirmed),
// one by one or several at once: checkboxes, select all on the page, bulk Retry and bulk
// Discard (confirmed), and each message's result said in a table.

import { el, on, shown } from '../../lib/dom.js';
import { api, path, invalid, PAGE_SIZE } from '../../lib/api.js';
import { fmtCount, fmtId, time } from '../../lib/format.js';
import {
  button, field, select, table, td, pagedList, errorSlot, announce, answerSlot, clamp, confirmStep,
  messageHref, report,
} from '../../lib/widgets.js';

const RESULTS = {
  done: 'done',
  already_resolved: 'already retried or discarded',
  not_found: 'no such quarantined message',
};

export function quarantineSection(ctx) {
  const status = select([['quarantined', 'quarantined'], ['retried', 'retried'], ['discarded', 'discarded'], ['all', 'all']],
    { 'data-testid': 'quarantine-status' });
  const answer = answerSlot('quarantine-answer');
  const errors = errorSlot('quarantine-error');
  const selectAll = el('input', { type: 'checkbox', 'data-testid': 'quarantine-select-all' });
  let boxes = []; // [checkbox, arrival_seq] of the page shown
  let list = null;

  const selected = () => boxes.filter(([box]) => box.checked && !box.disabled).map(([, seq]) => seq);
  function syncAll() {
    const open = boxes.filter(([box]) => !box.disabled);
    selectAll.checked = open.length > 0 && open.every(([box]) => box.checked);
    selectAll.indeterminate = !selectAll.checked && open.some(([box]) => box.checked);
    const n = selected().length;
    bulkRetry.disabled = n === 0;
    bulkDiscard.start.disabled = n === 0;
    countLine.textContent = n ? n + ' selected' : 'None selected';
  }
  on(selectAll, 'change', () => {
    for (const [box] of boxes) if (!box.disabled) box.checked = selectAll.checked;
    syncAll();
  });

  async function after() {
    await Promise.all([list.reload(true), ctx.refreshState().catch((err) => report(err, answer))]);
  }

  async function act(seq, action) {
    answer.clear();
    const result = await api('POST', path('endpoints', ctx.id, 'quarantine', seq, action));
    answer.show(
      el('p', { 'data-testid': 'quarantine-result' }, 'Arrival ' + fmtId(result.arrival_seq) + ': ' + result.status +
        (result.retried_as !== null && result.retried_as !== undefined ? ', stored again as arrival ' + fmtId(result.retried_as) : '') + '.'),
    );
    announce('Arrival ' + result.arrival_seq + ' ' + result.status + '.');
    await after();
  }

  async function bulk(action) {
    answer.clear();
    const seqs = selected();
    if (!seqs.length) throw invalid('select one or more messages first');
    if (seqs.length > 100) throw invalid('at most 100 at once');
    const reply = await api('POST', path('endpoints', ctx.id, 'quarantine', action), { body: { arrival_seqs: seqs } });
    const results = reply.results || [];
    const done = results.filter((r) => r.result === 'done').length;
    answer.show(
      el('p', {}, (action === 'retry' ? 'Retried ' : 'Discarded ') + fmtCount(done) + ' of ' + fmtCount(results.length) + '.'),
      table(['Arrival', 'Result', 'Now'], results.map((r) => el('tr', { 'data-testid': 'bulk-result-row', 'data-arrival-seq': r.arrival_seq }, [
        td(fmtId(r.arrival_seq)),
        td(RESULTS[r.result] || r.result, { 'data-testid': 'bulk-result', 'data-result': r.result }),
        td(r.quarantined ? r.quarantined.status + (r.quarantined.retried_as !== null && r.quarantined.retried_as !== undefined
          ? ', stored again as arrival ' + fmtId(r.quarantined.retried_as) : '') : '\u2014'),
      ])), { 'data-testid': 'bulk-results' }, 'Results'),
    );
    announce((action === 'retry' ? 'Retried ' : 'Discarded ') + done + ' of ' + results.length + '.');
    await after();
  }

  const bulkRetry = button('Retry selected', { 'data-testid': 'quarantine-bulk-retry', class: 'secondary', disabled: true }, () => bulk('retry'), errors);
  const bulkDiscard = confirmStep('Discard selected', 'quarantine-bulk-discard',
    () => 'Discard ' + selected().length + ' message(s)? They are kept for audit and never applied; this cannot be undone.',
    () => bulk('discard'), { slot: errors });
  bulkDiscard.start.disabled = true;
  const countLine = el('span', { class: 'muted', 'data-testid': 'quarantine-selected', 'aria-live': 'polite' }, 'None selected');

  list = pagedList({
    prevId: 'quarantine-prev',
    nextId: 'quarantine-next',
    errorId: 'quarantine-list-error',
    empty: 'Nothing quarantined.',
    fetch: (cursor) => api('GET', path('endpoints', ctx.id, 'quarantine'), {
      query: { limit: PAGE_SIZE, after: cursor, status: status.value },
    }),
    render: (rows) => {
      boxes = [];
      const node = table([el('span', { class: 'visually-hidden' }, 'Select'), 'Arrival', 'Webhook id', 'Reason', 'Attempts', 'Quarantined', 'Status', 'Resolved',
        'Retried as', 'Actions'], rows.map((q) => {
        const open = q.status === 'quarantined';
        const box = el('input', { type: 'checkbox', 'data-testid': 'quarantine-select', disabled: !open, 'aria-label': 'Select arrival ' + q.arrival_seq });
        on(box, 'change', syncAll);
        boxes.push([box, q.arrival_seq]);
        const rowErrors = errorSlot('row-error');
        return el('tr', { 'data-testid': 'quarantine-row', 'data-arrival-seq': q.arrival_seq }, [
          el('td', {}, box),
          el('td', {}, el('a', { href: messageHref(ctx.id, q.arrival_seq), 'data-testid': 'quarantine-message-link' }, fmtId(q.arrival_seq))),
          el('td', { class: 'mono' }, clamp(q.webhook_id || '\u2014')), el('td', { 'data-testid': 'reason' }, clamp(q.reason)),
          td(fmtCount(q.attempts)), td(time(q.quarantined_at)), td(q.status, { 'data-testid': 'quarantine-status-cell' }),
          td(time(q.resolved_at)), td(fmtId(q.retried_as)),
          el('td', { class: 'row-actions' }, [
            button('Retry', { 'data-testid': 'retry', class: 'secondary small', disabled: !open, 'aria-label': 'Retry arrival ' + q.arrival_seq },
              () => act(q.arrival_seq, 'retry'), rowErrors),
            open ? confirmStep('Discard', 'discard', 'Discard arrival ' + q.arrival_seq + '? Kept for audit, never applied.',
              () => act(q.arrival_seq, 'discard'), { slot: rowErrors }) : null,
            rowErrors,
          ]),
        ]);
      }), { 'data-testid': 'quarantine-table' }, 'Quarantined messages');
      syncAll();
      return node;
    },
  });
  on(status, 'change', () => list.reset());
  ctx.reloaders.push(() => list.reload(true));
  list.reset();
  return el('div', {}, [
    el('p', { class: 'muted' }, 'Messages set aside because they cannot be applied. Retry stores one again as a new arrival; discard keeps it for audit, never applied.'),
    el('div', { class: 'actions' }, [field('Show', status), field('Select all on this page', selectAll, { class: 'field inline' })]),
    el('div', { class: 'actions' }, [bulkRetry, bulkDiscard, countLine]),
    errors,
    answer,
    list.node,
  ]);
}

