// An endpoint's copy: find an item (or a story) by its key, and the list of what it holds.

import { el, on, swap, shown } from '../../lib/dom.js';
import { api, path, invalid, PAGE_SIZE } from '../../lib/api.js';
import { fmtId, time } from '../../lib/format.js';
import {
  button, field, select, table, td, longTd, pagedList, pre, errorSlot, busy, announce, clamp,
} from '../../lib/widgets.js';

// A long headline: the first lines, all of it behind "Show all".
export function headline(value, attrs) {
  const s = String(value);
  if (s.length <= 300) return el('p', Object.assign({ class: 'headline' }, attrs || {}), shown(s));
  return el('div', { class: 'long-text' }, [
    el('p', Object.assign({ class: 'headline clamped' }, attrs || {}), shown(s)),
    el('details', {}, [el('summary', {}, 'Show all ' + s.length.toLocaleString() + ' characters'), el('p', { class: 'headline' }, shown(s))]),
  ]);
}

export function copySection(ctx) {
  const what = ctx.stories ? 'story id' : 'subject';
  const search = el('input', { type: 'search', 'data-testid': 'copy-search', autocomplete: 'off', spellcheck: 'false',
    placeholder: ctx.stories ? 'story id, e.g. st_12' : 'subject, e.g. announcement:88001' });
  const go = el('button', { type: 'submit', 'data-testid': 'copy-search-go' }, 'Find');
  const errors = errorSlot('copy-search-error', search);
  const form = el('form', { class: 'actions', role: 'search', 'aria-label': 'Find in the copy' }, [field(ctx.stories ? 'Story id' : 'Subject', search), go]);
  const viewer = el('div', { class: 'item', hidden: true });

  async function show(key) {
    // What was shown goes first: a failed find leaves no answer of an earlier one.
    viewer.hidden = true;
    viewer.removeAttribute('data-testid');
    viewer.replaceChildren();
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
      el('h3', { 'data-testid': 'item-key', class: 'mono wrap' }, shown(ctx.stories ? view.id : view.subject)),
      view.tombstone ? el('p', { class: 'warn' }, 'A tombstone: the item was removed.') : null,
      view.closed ? el('p', { class: 'muted' }, ['Closed', view.merged_into ? [', merged into ', shown(view.merged_into)] : null, '.']) : null,
      title !== null && title !== undefined ? headline(title, { 'data-testid': 'item-title' }) : null,
      ctx.stories ? null : el('ul', { 'data-testid': 'item-parts' }, parts.length
        ? parts.map((p) => el('li', { 'data-part-kind': p && p.kind ? String(p.kind) : null },
          p && p.headline !== undefined && p.headline !== null ? shown(String(p.headline)) : '(no headline)'))
        : el('li', { class: 'muted' }, 'No parts.')),
      el('details', { class: 'json' }, [el('summary', {}, 'As the API answers it'), pre(view, { 'data-testid': 'item-json' })]),
    );
    viewer.hidden = false;
    viewer.setAttribute('data-testid', 'item');
    // The JSON is open at once for a short item (it is the whole answer).
    if (JSON.stringify(view).length < 4000) viewer.querySelector('details.json').open = true;
  }
  ctx.showItem = async (key) => {
    errors.clear();
    try {
      await show(key);
    } catch (err) {
      errors.show(err);
      throw err;
    }
    viewer.scrollIntoView({ behavior: 'smooth', block: 'nearest' });
  };

  on(form, 'submit', (event) => {
    event.preventDefault();
    busy(go, async () => {
      const key = search.value.trim();
      viewer.hidden = true;
      viewer.replaceChildren();
      if (!key) throw invalid('type a ' + what + ' to find');
      await show(key);
      announce('Found ' + key + '.');
    }, errors);
  });

  const kind = select([['', 'all kinds'], ['announcement', 'announcement'], ['pre_earnings_analysis', 'pre_earnings_analysis']],
    { 'data-testid': 'copy-kind' });
  const tombstones = el('input', { type: 'checkbox', 'data-testid': 'copy-tombstones' });
  const keyButton = (key) => button(clamp(key), { class: 'link mono', 'data-testid': 'copy-open' }, () => ctx.showItem(key));
  const list = pagedList({
    prevId: 'copy-prev',
    nextId: 'copy-next',
    errorId: 'copy-list-error',
    empty: ctx.stories ? 'No stories in the copy.' : 'The copy holds no items.',
    fetch: (cursor) => ctx.stories
      ? api('GET', path('endpoints', ctx.id, 'stories'), { query: { limit: PAGE_SIZE, after: cursor } })
      : api('GET', path('endpoints', ctx.id, 'copy'), {
        query: { limit: PAGE_SIZE, after: cursor, item_kind: kind.value, include_tombstones: tombstones.checked ? 'true' : null },
      }),
    render: (rows) => ctx.stories
      ? table(['Story', 'Ticker', 'Version', 'Headline'], rows.map((s) =>
        el('tr', { 'data-testid': 'copy-row', 'data-subject': s.id }, [
          el('td', {}, keyButton(s.id)), td(s.ticker), td(fmtId(s.version)), longTd(s.story && s.story.headline),
        ])), { 'data-testid': 'copy-table' }, 'Stories in the copy')
      : table(['Subject', 'Kind', 'Company', 'Generation', 'Sequence', 'Tombstone', 'Updated'], rows.map((i) =>
        el('tr', { 'data-testid': 'copy-row', 'data-subject': i.subject }, [
          el('td', {}, keyButton(i.subject)), td(i.item_kind), td(fmtId(i.company_id)), td(fmtId(i.generation)),
          td(i.sequence, { class: 'mono' }), td(i.tombstone), td(time(i.updated_at)),
        ])), { 'data-testid': 'copy-table' }, 'Items in the copy'),
  });
  const filters = ctx.stories ? null : el('div', { class: 'actions' }, [
    field('Kind', kind), field('Include tombstones', tombstones, { class: 'field inline' }),
  ]);
  if (filters) {
    on(kind, 'change', () => list.reset());
    on(tombstones, 'change', () => list.reset());
  }
  ctx.reloaders.push(() => list.reload(true));
  list.reset();
  return el('div', {}, [form, errors, viewer, filters, list.node]);
}
