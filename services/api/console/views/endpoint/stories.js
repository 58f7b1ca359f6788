// A stories endpoint's tickers, its stories and the notifications it claimed.

import { el, on, text, shown } from '../../lib/dom.js';
import { api, path, PAGE_SIZE } from '../../lib/api.js';
import { fmtId, time } from '../../lib/format.js';
import { button, field, select, table, td, longTd, pagedList, clamp } from '../../lib/widgets.js';

export function storiesSection(ctx) {
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
    errorId: 'stories-list-error',
    empty: 'No stories.',
    fetch: (cursor) => api('GET', path('endpoints', ctx.id, 'stories'), {
      query: { limit: PAGE_SIZE, after: cursor, ticker: tickerFilter.value, include_closed: includeClosed.checked ? 'true' : null },
    }),
    render: (rows) => table(['Story', 'Ticker', 'Version', 'Closed', 'Merged into', 'Headline'], rows.map((s) =>
      el('tr', { 'data-testid': 'story-row', 'data-story-id': s.id }, [
        el('td', {}, button(clamp(s.id), { class: 'link mono', 'data-testid': 'story-open' }, () => ctx.showItem(s.id))),
        td(s.ticker), td(fmtId(s.version)), td(s.closed), td(s.merged_into),
        longTd(s.story && s.story.headline, { 'data-testid': 'story-headline' }),
      ])), { 'data-testid': 'stories-table' }, 'Stories'),
  });
  on(tickerFilter, 'change', () => stories.reset());
  on(includeClosed, 'change', () => stories.reset());

  const notifications = pagedList({
    prevId: 'notifications-prev',
    nextId: 'notifications-next',
    errorId: 'notifications-list-error',
    empty: 'No notifications claimed.',
    fetch: (cursor) => api('GET', path('endpoints', ctx.id, 'notifications'), { query: { limit: PAGE_SIZE, after: cursor } }),
    render: (rows) => table(['Key', 'Story', 'Ticker', 'Event', 'Claimed', 'Notified'], rows.map((n) =>
      el('tr', { 'data-testid': 'notification-row' }, [
        el('td', { class: 'mono' }, clamp(n.key)), el('td', { class: 'mono' }, clamp(n.story_id)), td(n.ticker),
        el('td', { class: 'mono' }, clamp(n.event_id)), td(time(n.claimed_at)), td(n.notified),
      ])), { 'data-testid': 'notifications-table' }, 'Notifications'),
  });
  ctx.reloaders.push(() => stories.reload(true), () => notifications.reload(true));
  stories.reset();
  notifications.reset();
  return el('div', {}, [
    el('h3', {}, 'Tickers'),
    el('ul', { class: 'tags', 'data-testid': 'tickers' }, tickers.length
      ? tickers.map((t) => el('li', {}, shown(t))) : el('li', { class: 'muted' }, 'none')),
    syncLine,
    el('h3', {}, 'Stories'),
    el('div', { class: 'actions' }, [field('Ticker', tickerFilter),
      field('Include closed', includeClosed, { class: 'field inline' })]),
    stories.node,
    el('h3', {}, 'Notifications'),
    notifications.node,
  ]);
}
