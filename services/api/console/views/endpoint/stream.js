// An endpoint's change stream: its epoch and last change_seq, a replay from a change_seq, and
// a resync (a new epoch from a snapshot; confirmed).

import { el, text } from '../../lib/dom.js';
import { api, path, invalid } from '../../lib/api.js';
import { fmtCount, fmtId } from '../../lib/format.js';
import { button, field, answerSlot, errorSlot, confirmStep, announce, pre } from '../../lib/widgets.js';

export function streamSection(ctx) {
  const epoch = el('dd', { 'data-testid': 'stream-epoch' });
  const last = el('dd', { 'data-testid': 'stream-last-seq' });
  const backlog = el('dd', { 'data-testid': 'stream-backlog' });
  const show = (s) => {
    text(epoch, fmtId(s.change_epoch));
    text(last, fmtId(s.last_change_seq));
    text(backlog, fmtCount(s.outbox_backlog));
  };
  show(ctx.state);
  ctx.listeners.push(show);

  const from = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'replay-from', placeholder: 'change_seq' });
  const replayErrors = errorSlot('replay-error', from);
  const replayAnswer = answerSlot('replay-answer');
  const replay = button('Replay', { 'data-testid': 'replay' }, async () => {
    replayAnswer.clear();
    const n = Number(from.value);
    if (from.value === '' || !Number.isInteger(n) || n < 1) {
      throw invalid('give a change_seq of 1 or more to replay from', 'from_change_seq');
    }
    const answer = await api('POST', path('endpoints', ctx.id, 'replay'), { body: { from_change_seq: n } });
    replayAnswer.show(
      el('p', {}, 'Replaying changes ' + fmtId(answer.from_change_seq) + ' through ' +
        fmtId(answer.through_change_seq) + ' of epoch ' + fmtId(answer.epoch) + ' to the destination.'),
      pre(answer),
    );
    announce('Replay started.');
    await ctx.refreshState();
  }, replayErrors);

  const resyncAnswer = answerSlot('resync-answer');
  const resync = confirmStep('Resync', 'resync',
    'Begin a new epoch with a snapshot of the whole copy? Consumers rebuild from it.', async () => {
      resyncAnswer.clear();
      const answer = await api('POST', path('endpoints', ctx.id, 'resync'));
      resyncAnswer.show(
        el('p', {}, 'Epoch ' + fmtId(answer.epoch) + ' begun with a snapshot of ' + fmtCount(answer.snapshot_items) + ' item(s).'),
        pre(answer),
      );
      announce('Resync begun.');
      await ctx.refreshState();
    });

  return el('div', {}, [
    el('dl', { class: 'kv' }, [el('dt', {}, 'Epoch'), epoch, el('dt', {}, 'Last change_seq'), last,
      el('dt', {}, 'Outbox backlog'), backlog]),
    el('h3', {}, 'Replay'),
    el('p', { class: 'muted' }, 'Send the changes from a change_seq of the current epoch to the destination again, in order.'),
    el('div', { class: 'actions' }, [field('From change_seq', from), replay]),
    replayErrors,
    replayAnswer,
    el('h3', {}, 'Resync'),
    el('div', { class: 'actions' }, resync),
    resyncAnswer,
  ]);
}
