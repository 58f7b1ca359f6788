// An endpoint's activity over the last hour, day or week: messages received and changes
// written per bucket, and the greatest apply lag sampled in each; the lag and backlog now.

import { el, on, swap, text } from '../../lib/dom.js';
import { api, path } from '../../lib/api.js';
import { fmtCount, fmtDuration, fmtTime } from '../../lib/format.js';
import { field, select, loading, errorSlot } from '../../lib/widgets.js';
import { chart } from '../../lib/chart.js';

const WINDOWS = { hour: 'the last hour', day: 'the last day', week: 'the last week' };

export function activitySection(ctx) {
  const box = el('div', {}, loading());
  const now = el('p', { class: 'muted', 'data-testid': 'activity-now' });
  const windowSelect = select([['hour', 'Last hour (per minute)'], ['day', 'Last day (per 15 minutes)'], ['week', 'Last week (per hour)']],
    { 'data-testid': 'activity-window' });
  const errors = errorSlot('activity-error', windowSelect);
  const showNow = (state) => text(now, 'Now: apply lag ' + fmtDuration(state.apply_lag_s) + ', '
    + fmtCount(state.messages_waiting) + ' messages waiting, outbox backlog '
    + fmtCount(state.outbox_backlog) + '.');
  showNow(ctx.state);
  ctx.listeners.push(showNow);
  let asked = 0;

  async function load(quiet) {
    const mine = ++asked;
    const win = windowSelect.value;
    errors.clear();
    if (!quiet) swap(box, loading());
    try {
      const activity = await api('GET', path('endpoints', ctx.id, 'activity'), { query: { window: win } });
      if (mine !== asked) return;
      render(activity, win);
    } catch (err) {
      if (mine !== asked) return;
      swap(box);
      errors.show(err);
      throw err;
    }
  }

  function render(activity, win) {
    // `buckets` (every window); an older control plane sends `minutes` for the hour.
    const buckets = Array.isArray(activity.buckets) ? activity.buckets : (activity.minutes || []);
    const bucketS = Number(activity.bucket_s) || 60;
    const shownWindow = activity.window || (bucketS === 60 ? 'hour' : win);
    const span = WINDOWS[shownWindow] || WINDOWS.hour;
    const total = (key) => buckets.reduce((sum, m) => sum + (Number(m[key]) || 0), 0);
    const cut = activity.received_cut || activity.written_cut;
    const per = bucketS >= 3600 ? 'hour' : bucketS >= 900 ? '15 minutes' : 'minute';
    const throughput = chart(buckets, [
      { key: 'received', cls: 'received', label: 'received', digits: 0 },
      { key: 'written', cls: 'written', label: 'written', digits: 0 },
    ], { testid: 'activity-chart', label: 'Messages received and changes written per ' + per + ', ' + span, bucketS });
    const lag = chart(buckets, [{ key: 'apply_lag_s', cls: 'lag', label: 'apply lag', unit: ' s', digits: 1 }],
      { testid: 'lag-chart', label: 'Greatest apply lag sampled per ' + per + ', in seconds, ' + span, bucketS });
    swap(box,
      el('p', { 'data-testid': 'activity-totals' }, [
        el('span', { class: 'legend received' }, 'Received'), ' ' + fmtCount(total('received')) + ' messages, ',
        el('span', { class: 'legend written' }, 'written'), ' ' + fmtCount(total('written')) + ' changes in ' + span,
        buckets.length ? ' (since ' + fmtTime(buckets[0].at) + ')' : '',
        cut ? '. The earliest buckets are undercounted: the window holds more rows than one read scans.' : '.',
      ]),
      throughput.node,
      el('p', { 'data-testid': 'lag-totals' }, [
        el('span', { class: 'legend lag' }, 'Apply lag'),
        ', the most sampled in each ' + per + ': at most ' + fmtDuration(Math.max(0, ...buckets.map((m) => Number(m.apply_lag_s) || 0)))
          + ' in ' + span + '.',
      ]),
      lag.node);
  }

  on(windowSelect, 'change', () => load(false).catch(() => {}));
  ctx.reloaders.push(() => load(true));
  load(false).catch(() => {});
  return el('div', {}, [now, el('div', { class: 'actions' }, field('Window', windowSelect)), errors, box]);
}
