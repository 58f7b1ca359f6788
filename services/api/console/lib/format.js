// Formatting values for display. Ids (arrival_seq, change_seq, epochs, generations, secret
// ids, ports) are plain digits, never grouped as numbers: fmtId(). Only counts, rates and
// durations are formatted for the reader's locale: fmtCount().

import { el, shown } from './dom.js';

export const DASH = '\u2014';

function missing(value) {
  return value === null || value === undefined || value === '';
}

// A count, a rate or a duration, in the reader's locale (1,234.5).
export function fmtCount(value, digits) {
  if (missing(value)) return DASH;
  const n = Number(value);
  if (!Number.isFinite(n)) return String(value);
  return n.toLocaleString(undefined, digits === undefined ? undefined : { maximumFractionDigits: digits });
}

// An id, a sequence number, a port: its digits as sent (12345, never 12,345).
export function fmtId(value) {
  if (missing(value)) return DASH;
  return String(value);
}

const TIME_FORMAT = {
  year: 'numeric', month: 'short', day: 'numeric',
  hour: '2-digit', minute: '2-digit', second: '2-digit', timeZoneName: 'short',
};

// A time in the reader's zone, the zone named (12 Mar 2025, 14:03:07 CET).
export function fmtTime(value) {
  if (missing(value)) return DASH;
  const d = value instanceof Date ? value : new Date(value);
  return Number.isNaN(d.getTime()) ? String(value) : d.toLocaleString(undefined, TIME_FORMAT);
}

// The reader's zone: its IANA name and short name (Europe/Stockholm, CET).
export function zoneName(at) {
  const d = at instanceof Date ? at : new Date();
  let iana = '';
  try {
    iana = Intl.DateTimeFormat().resolvedOptions().timeZone || '';
  } catch (_) { /* no Intl zone */ }
  const part = new Intl.DateTimeFormat(undefined, { timeZoneName: 'short' })
    .formatToParts(d).find((p) => p.type === 'timeZoneName');
  const short = part ? part.value : '';
  return iana && short && iana !== short ? iana + ' (' + short + ')' : iana || short || 'local time';
}

// A <time> element: the time in the reader's zone, the instant as sent in its title.
export function time(value) {
  if (missing(value)) return document.createTextNode(DASH);
  return el('time', { datetime: String(value), title: String(value) }, fmtTime(value));
}

// Any value as text: booleans as yes/no, numbers as plain digits (counts go through
// fmtCount), lists joined, objects as JSON.
export function fmt(value) {
  if (missing(value)) return DASH;
  if (typeof value === 'boolean') return value ? 'yes' : 'no';
  if (typeof value === 'number') return String(value);
  if (Array.isArray(value)) return value.length ? value.map(fmt).join(', ') : DASH;
  if (typeof value === 'object') return JSON.stringify(value);
  return String(value);
}

// A value from the API as an isolated node (a <bdi>), or a dash.
export function show(value, attrs) {
  if (value instanceof Node) return value;
  if (missing(value) || (Array.isArray(value) && !value.length)) return document.createTextNode(DASH);
  if (typeof value === 'boolean') return document.createTextNode(value ? 'yes' : 'no');
  return shown(fmt(value), attrs);
}

// A seconds duration (12.5 s, 3 min 20 s, 2 h 5 min) with locale numbers.
export function fmtDuration(seconds) {
  if (missing(seconds)) return DASH;
  const s = Number(seconds);
  if (!Number.isFinite(s)) return String(seconds);
  if (s < 120) return fmtCount(s, 1) + ' s';
  if (s < 7200) return fmtCount(Math.floor(s / 60)) + ' min ' + fmtCount(Math.round(s % 60)) + ' s';
  return fmtCount(Math.floor(s / 3600)) + ' h ' + fmtCount(Math.round((s % 3600) / 60)) + ' min';
}
