// Signing in: a token pasted, checked once with the API, kept in this tab's sessionStorage.

import { el, on } from '../lib/dom.js';
import { api, path, setToken, clearToken, invalid } from '../lib/api.js';
import { field, busy, errorSlot } from '../lib/widgets.js';
import { decodeClaims, kindOfClaims, probeKind, setSession, rerender, setTitle } from '../lib/session.js';

export function viewSignIn(main, defaultRoute) {
  setTitle('Sign in');
  const input = el('textarea', {
    id: 'token-input', 'data-testid': 'token-input', rows: 5, spellcheck: 'false',
    autocomplete: 'off', placeholder: 'eyJhbGciOiJIUzI1NiIs\u2026', required: true,
  });
  const submit = el('button', { type: 'submit', 'data-testid': 'sign-in' }, 'Sign in');
  const errors = errorSlot('sign-in-error', input);
  const form = el('form', { class: 'card sign-in', novalidate: true, 'data-testid': 'sign-in-form' }, [
    el('h1', { tabindex: -1 }, 'Sign in'),
    el('p', {}, "Paste a tenant's or an operator's token. It is kept in this browser tab only (sessionStorage) and sent to this control plane's API."),
    field('Token (JWT)', input),
    errors,
    el('div', { class: 'actions' }, submit),
  ]);
  on(form, 'submit', (event) => {
    event.preventDefault();
    busy(submit, () => signIn(input.value, defaultRoute), errors);
  });
  main.append(form);
  input.focus();
}

async function signIn(raw, defaultRoute) {
  const token = raw.trim().replace(/^Bearer\s+/i, '');
  if (!/^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$/.test(token)) {
    throw invalid('this is not a JWT (three base64url parts separated by dots)', 'token');
  }
  const claims = decodeClaims(token) || {};
  setToken(token);
  const next = { token, claims, kind: kindOfClaims(claims), tenant: null };
  setSession(next);
  try {
    if (!next.kind) next.kind = await probeKind();
    // Ask the API once: a token it refuses does not sign in.
    if (next.kind === 'tenant') next.tenant = await api('GET', path('tenant'));
    else await api('GET', path('tenants'), { query: { limit: 1 } });
  } catch (err) {
    clearToken();
    setSession(null);
    throw err;
  }
  // The view asked for before signing in, or the start of the token's views.
  if (location.hash.replace(/^#\/?/, '')) rerender();
  else location.hash = defaultRoute();
}
