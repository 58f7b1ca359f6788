// relay console: a client of the control plane's /v1 API, in native ES modules (no build step).
// This module is the shell: the session, the header and the router. The views are in views/,
// the shared parts in lib/ (lib/dom.js states the security rules every module keeps: text
// only, never markup from a string; el() refusing on* handlers, style and src; hash-only links;
// the token in sessionStorage only).

import { el, on, shown } from './lib/dom.js';
import { clearToken } from './lib/api.js';
import { fmtTime } from './lib/format.js';
import { clearBanner, showBanner, clamp } from './lib/widgets.js';
import {
  session, setSession, restoreSession, probeKind, loadOwnTenant, setHooks, leave, setTitle,
} from './lib/session.js';
import { viewSignIn } from './views/signin.js';
import { viewEndpoints } from './views/endpoints.js';
import { viewEndpoint } from './views/endpoint.js';
import { viewMessage } from './views/message.js';
import { viewBroker } from './views/broker.js';
import { viewTenants } from './views/tenants.js';

function signOut() {
  clearToken();
  setSession(null);
  document.getElementById('main').replaceChildren();
  // Shown at once (no hashchange to wait for): a form typed into next is not drawn again.
  if (location.hash !== '#/') history.replaceState(null, '', '#/');
  route();
}

// The header: who is signed in and the sign-out button exist only while signed in.
function renderChrome() {
  const place = document.getElementById('session');
  const nav = document.getElementById('nav');
  const s = session();
  if (!s) {
    place.replaceChildren();
    nav.replaceChildren();
    return;
  }
  const claims = s.claims || {};
  const line = ['Signed in as ', shown(claims.sub || 'unknown'), ' (' + (s.kind || 'unknown role') + ')'];
  if (s.tenant && s.tenant.name) line.push(' \u2014 ', clamp(s.tenant.name));
  if (typeof claims.exp === 'number') line.push(' \u00b7 token expires ' + fmtTime(claims.exp * 1000));
  const out = el('button', { type: 'button', class: 'secondary', 'data-testid': 'sign-out' }, 'Sign out');
  on(out, 'click', signOut);
  place.replaceChildren(el('span', { class: 'who', 'data-testid': 'who' }, line), out);
  const links = s.kind === 'operator'
    ? [['#/tenants', 'Tenants', 'nav-tenants']]
    : [['#/endpoints', 'Endpoints', 'nav-endpoints'], ['#/broker', 'Broker', 'nav-broker']];
  const current = '#/' + (location.hash.replace(/^#\/?/, '').split('/')[0] || '');
  nav.replaceChildren(...links.map(([href, label, testid]) =>
    el('a', { href, 'data-testid': testid, 'aria-current': current === href ? 'page' : null }, label)));
}

function defaultRoute() {
  const s = session();
  return s && s.kind === 'operator' ? '#/tenants' : '#/endpoints';
}

function safeDecode(s) {
  try {
    return decodeURIComponent(s);
  } catch (_) {
    return s;
  }
}

// Moves focus to the view's heading (so a screen reader starts there) once it is drawn.
function focusHeading(main) {
  const h1 = main.querySelector('h1');
  if (!h1) return;
  if (!h1.hasAttribute('tabindex')) h1.setAttribute('tabindex', '-1');
  if (!main.contains(document.activeElement) || document.activeElement === main) h1.focus({ preventScroll: true });
}

function route() {
  leave();
  const main = document.getElementById('main');
  main.replaceChildren();
  clearBanner();
  renderChrome();
  window.scrollTo(0, 0);
  const parts = location.hash.replace(/^#\/?/, '').split('/').filter(Boolean).map(safeDecode);
  const s = session();
  if (!s) {
    viewSignIn(main, defaultRoute);
    return;
  }
  const [head, id, sub, subId] = parts;
  if (!head) {
    history.replaceState(null, '', defaultRoute());
    route();
    return;
  }
  const needs = { endpoints: 'tenant', broker: 'tenant', tenants: 'operator' }[head];
  if (!needs || (head === 'endpoints' && sub && (sub !== 'messages' || !subId))) {
    setTitle('Not found');
    main.append(el('h1', { tabindex: -1 }, 'Not found'), el('p', {}, [
      'No such view. ', el('a', { href: defaultRoute() }, 'Go to the start'),
    ]));
    focusHeading(main);
    return;
  }
  if (s.kind && s.kind !== needs) {
    setTitle('Not for this token');
    main.append(el('h1', { tabindex: -1 }, 'Not for this token'), el('p', { 'data-testid': 'wrong-role' },
      'This view takes ' + (needs === 'tenant' ? "a tenant's" : "an operator's") + ' token.'));
    focusHeading(main);
    return;
  }
  if (head === 'endpoints') {
    if (id && subId) viewMessage(main, id, subId);
    else if (id) viewEndpoint(main, id);
    else viewEndpoints(main);
  } else if (head === 'broker') {
    viewBroker(main);
  } else {
    viewTenants(main, id || null);
  }
  focusHeading(main);
}

function start() {
  setHooks({ route, chrome: renderChrome });
  setSession(restoreSession());
  window.addEventListener('hashchange', route);
  route();
  const s = session();
  if (s && !s.kind) {
    probeKind().then((kind) => {
      s.kind = kind;
      route();
    }).catch((err) => showBanner(err));
  } else if (s && s.kind === 'tenant') {
    loadOwnTenant().catch((err) => showBanner(err));
  }
}

// A module runs once the document is parsed.
start();
