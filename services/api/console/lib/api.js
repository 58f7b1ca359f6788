// The control plane's /v1 API: one fetch wrapper, its errors, the bound on requests in flight,
// and the token (sessionStorage only: kept for this tab, sent in the Authorization header of
// same-origin requests, never in a URL).

const TOKEN_KEY = 'relay-console-token';
// Requests in flight at once: the API bounds each tenant's (RELAY_API_MAX_REQUESTS_PER_TENANT).
export const MAX_IN_FLIGHT = 4;
export const PAGE_SIZE = 50;

export class ApiError extends Error {
  constructor(status, code, detail, field) {
    super(detail || code || 'HTTP ' + status);
    this.status = status;
    this.code = code;
    this.detail = detail;
    this.field = field;
  }
}

// An error as one line for the reader.
export function describe(err) {
  if (err instanceof ApiError) {
    let message = (err.status ? err.status + ' ' : '') + (err.code || 'error') + ': ' + (err.detail || '');
    if (err.field) message += ' (field: ' + err.field + ')';
    if (err.status === 401) message += ' \u2014 sign out and sign in with a valid token.';
    return message;
  }
  if (err instanceof TypeError) return 'network error: the control plane could not be reached (' + err.message + ')';
  return String(err && err.message ? err.message : err);
}

// A refusal made in the page before anything is sent (status 0), naming the field.
export function invalid(detail, field) {
  return new ApiError(0, 'invalid_request', detail, field);
}

export function getToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY);
  } catch (_) {
    return null;
  }
}

export function setToken(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
}

export function clearToken() {
  try {
    sessionStorage.removeItem(TOKEN_KEY);
  } catch (_) { /* nothing stored */ }
}

let inFlight = 0;
const waiting = [];

function acquire() {
  if (inFlight < MAX_IN_FLIGHT) {
    inFlight += 1;
    return Promise.resolve();
  }
  return new Promise((resolve) => waiting.push(resolve));
}

function release() {
  const next = waiting.shift();
  if (next) next();
  else inFlight -= 1;
}

export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// A path under /v1 from segments, each percent-encoded (dot segments refused: a URL would
// resolve them to another route).
export function path(...segments) {
  return '/v1/' + segments.map((segment) => {
    const s = String(segment);
    if (s === '' || s === '.' || s === '..') throw invalid('not a valid id: "' + s + '"');
    return encodeURIComponent(s);
  }).join('/');
}

// One request: JSON in and out, the token in its header; an answer that is not 2xx throws an
// ApiError with the API's code, detail and field.
export async function api(method, url, options) {
  const opts = options || {};
  const token = getToken();
  if (!token) throw new ApiError(401, 'unauthorized', 'not signed in');
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(opts.query || {})) {
    if (value !== undefined && value !== null && value !== '' && value !== false) query.set(name, String(value));
  }
  const target = query.toString() ? url + '?' + query.toString() : url;
  const headers = { Accept: 'application/json', Authorization: 'Bearer ' + token };
  const init = { method, headers, credentials: 'omit', cache: 'no-store', redirect: 'error', referrerPolicy: 'no-referrer' };
  if (opts.body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(opts.body);
  }
  let response;
  await acquire();
  try {
    for (let attempt = 0; ; attempt += 1) {
      response = await fetch(target, init);
      // 429: nothing was done; a read is asked again after Retry-After (at most twice).
      if (response.status !== 429 || method !== 'GET' || attempt >= 2) break;
      const after = Number(response.headers.get('Retry-After')) || 1;
      await sleep(Math.min(after, 5) * 1000);
    }
  } finally {
    release();
  }
  const body = await response.text();
  let json = null;
  if (body) {
    try {
      json = JSON.parse(body);
    } catch (_) {
      json = null;
    }
  }
  if (!response.ok) {
    const e = json && typeof json === 'object' ? json : {};
    throw new ApiError(response.status, e.error || 'http_' + response.status, e.detail || response.statusText, e.field);
  }
  return json;
}
