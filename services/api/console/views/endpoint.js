// One endpoint's page: its sections (views/endpoint/*.js), a Refresh that reads everything
// again in place (the scroll position holds), and an auto-refresh every 10 s (off by default,
// paused while the tab is hidden).

import { el, on, swap, shown, visibleControls } from '../lib/dom.js';
import { api, path } from '../lib/api.js';
import { button, field, loading, section, announce, report, busy, errorSlot, nameOrId } from '../lib/widgets.js';
import { setTitle, onLeave } from '../lib/session.js';
import { overviewSection } from './endpoint/overview.js';
import { activitySection } from './endpoint/activity.js';
import { copySection } from './endpoint/copy.js';
import { messagesSection } from './endpoint/messages.js';
import { quarantineSection } from './endpoint/quarantine.js';
import { streamSection } from './endpoint/stream.js';
import { storiesSection } from './endpoint/stories.js';

const AUTO_REFRESH_MS = 10000;

export async function viewEndpoint(main, id) {
  setTitle('Endpoint ' + id);
  const heading = el('h1', { tabindex: -1, class: 'endpoint-title', 'data-testid': 'endpoint-title' }, ['Endpoint ', shown(id, { class: 'mono' })]);
  const holder = el('div', {}, loading());
  main.append(
    el('p', {}, el('a', { href: '#/endpoints' }, '\u2190 Endpoints')),
    heading,
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
  if (!holder.isConnected) return;
  const ctx = {
    id, endpoint, state, stories: endpoint.source === 'stories', listeners: [], reloaders: [], showItem: null,
    setState(next) {
      ctx.state = next;
      for (const listener of ctx.listeners) listener(next);
    },
    async refreshState() {
      ctx.setState(await api('GET', path('endpoints', id, 'state')));
    },
    setEndpoint(next) {
      ctx.endpoint = next;
      showHeading();
    },
  };
  function showHeading() {
    const ep = ctx.endpoint;
    swap(heading, 'Endpoint ', ep.name ? shown(ep.name, { 'data-testid': 'endpoint-heading-name' }) : shown(ep.id, { class: 'mono' }));
    heading.classList.add('title-clamp');
    heading.setAttribute('title', visibleControls('Endpoint ' + nameOrId(ep)));
    setTitle('Endpoint ' + nameOrId(ep));
  }
  showHeading();
  const sections = [
    ['overview', 'Overview', overviewSection],
    ['activity', 'Activity', activitySection],
    ['copy', 'Copy', copySection],
    ['messages', 'Messages', messagesSection],
    ['quarantine', 'Quarantine', quarantineSection],
    ['stream', 'Stream', streamSection],
  ];
  if (ctx.stories) sections.push(['stories', 'Stories', storiesSection]);
  const built = sections.map(([testid, title, build]) => section(testid, title, build(ctx)));
  const jump = el('nav', { class: 'jump', 'aria-label': 'Sections' }, sections.map(([testid, title]) => {
    const b = el('button', { type: 'button', class: 'link' }, title);
    on(b, 'click', () => {
      const target = document.getElementById('section-' + testid);
      target.scrollIntoView({ behavior: 'smooth' });
      const h2 = target.querySelector('h2');
      if (h2) {
        h2.setAttribute('tabindex', '-1');
        h2.focus({ preventScroll: true });
      }
    });
    return b;
  }));

  const refreshErrors = errorSlot('refresh-error');
  // Everything read again in place: the sections' lists and figures are replaced as their
  // answers come, and the scroll position is put back where it was.
  async function refreshAll() {
    const x = window.scrollX;
    const y = window.scrollY;
    const [ep] = await Promise.all([
      api('GET', path('endpoints', id)),
      ctx.refreshState(),
      ...ctx.reloaders.map((reload) => reload()),
    ]);
    ctx.setEndpoint(ep);
    for (const listener of ctx.endpointListeners || []) listener(ep);
    window.scrollTo(x, y);
  }
  const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, async () => {
    await refreshAll();
    announce('Endpoint refreshed.');
  }, refreshErrors);

  const auto = el('input', { type: 'checkbox', 'data-testid': 'auto-refresh' });
  let timer = null;
  const tick = () => {
    if (document.hidden || !holder.isConnected || refresh.disabled) return;
    busy(refresh, refreshAll, refreshErrors);
  };
  on(auto, 'change', () => {
    if (timer) clearInterval(timer);
    timer = auto.checked ? setInterval(tick, AUTO_REFRESH_MS) : null;
    announce(auto.checked ? 'Auto-refresh on: every 10 seconds while this tab is shown.' : 'Auto-refresh off.');
  });
  const onVisible = () => {
    if (!document.hidden && auto.checked) tick();
  };
  document.addEventListener('visibilitychange', onVisible);
  onLeave(() => {
    if (timer) clearInterval(timer);
    document.removeEventListener('visibilitychange', onVisible);
  });

  holder.replaceChildren(
    el('div', { class: 'title-row' }, [jump, el('div', { class: 'refresh-box' }, [
      field('Auto-refresh every 10 s', auto, { class: 'field inline' }), refresh,
    ])]),
    refreshErrors,
    ...built,
  );
}
