// Who is signed in, and the hooks the views call back into the shell (app.js) through: so no
// view imports app.js.

import { api, path, ApiError, getToken } from './api.js';
import { visibleControls } from './dom.js';

// {token, claims, kind: 'tenant'|'operator'|null, tenant?: OwnTenantView}
let current = null;

export function session() {
  return current;
}

export function setSession(value) {
  current = value;
}

export function decodeClaims(token) {
  const parts = token.split('.');
  if (parts.length !== 3) return null;
  try {
    let b64 = parts[1].replace(/-/g, '+').replace(/_/g, '/');
    while (b64.length % 4) b64 += '=';
    const binary = atob(b64);
    const bytes = Uint8Array.from(binary, (c) => c.charCodeAt(0));
    const claims = JSON.parse(new TextDecoder().decode(bytes));
    return claims && typeof claims === 'object' && !Array.isArray(claims) ? claims : null;
  } catch (_) {
    return null;
  }
}

export function kindOfClaims(claims) {
  if (!claims) return null;
  if (claims.role === 'operator') return 'operator';
  if (claims.role === 'tenant' || claims.tenant) return 'tenant';
  return null;
}

// The token's kind by asking the API, for a token whose claims do not say.
export async function probeKind() {
  try {
    await api('GET', path('tenant'));
    return 'tenant';
  } catch (err) {
    if (!(err instanceof ApiError) || (err.status !== 401 && err.status !== 403)) throw err;
  }
  await api('GET', path('tenants'), { query: { limit: 1 } });
  return 'operator';
}

export function restoreSession() {
  const token = getToken();
  if (!token) return null;
  const claims = decodeClaims(token) || {};
  return { token, claims, kind: kindOfClaims(claims), tenant: null };
}

// ---- hooks into the shell

const hooks = { route: () => {}, chrome: () => {} };

export function setHooks(next) {
  Object.assign(hooks, next);
}

// Draws the current route again (after signing in or out).
export function rerender() {
  hooks.route();
}

// Goes to a route (a hash such as '#/endpoints'); a status line may be carried to the next view.
let carried = null;
export function go(hash, status) {
  carried = status || null;
  if (location.hash === hash) hooks.route();
  else location.hash = hash;
}

// The status line carried from the view before (once).
export function takeCarried() {
  const value = carried;
  carried = null;
  return value;
}

// The signed-in tenant, read again (the header shows its name).
export async function loadOwnTenant() {
  const asked = current;
  if (!asked || asked.kind !== 'tenant') return null;
  const tenant = await api('GET', path('tenant'));
  // An answer for a session signed out meanwhile names someone else's tenant: drop it.
  if (current !== asked) return null;
  current.tenant = tenant;
  hooks.chrome();
  return tenant;
}

// ---- what a view leaves behind when the route changes (timers, listeners)

let leaving = [];

export function onLeave(fn) {
  leaving.push(fn);
}

export function leave() {
  const fns = leaving;
  leaving = [];
  for (const fn of fns) {
    try {
      fn();
    } catch (_) { /* a view's cleanup never stops the next view */ }
  }
}

// The page's title: where you are.
export function setTitle(where) {
  // A long name is cut (the tab shows the start); its bidi controls shown as markers.
  const place = where ? visibleControls(where.length > 80 ? where.slice(0, 79) + '\u2026' : where) : '';
  document.title = (place ? place + ' \u00b7 ' : '') + 'relay console';
}
