// Line charts of an endpoint's activity, drawn as SVG from the page (no style attributes, no
// markup from strings). Every bucket has a hit area with an SVG <title> (the values on hover),
// and the chart is focusable: the arrow keys move through the buckets, and a visible readout
// beside it (a polite live region) says the values of the bucket hovered or focused. The axis
// labels are times in the reader's zone, which the caption names.

import { el, on, text, svg } from './dom.js';
import { fmtCount, zoneName } from './format.js';

const WIDTH = 720;
const HEIGHT = 190;
const PAD_L = 48;
const PAD_R = 14;
const PAD_T = 12;
const PAD_B = 36;

function tickLabel(date, bucketS) {
  if (bucketS >= 3600) {
    return date.toLocaleString(undefined, { weekday: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit' });
  }
  return date.toLocaleTimeString(undefined, { hour: '2-digit', minute: '2-digit' });
}

function bucketLabel(date, bucketS) {
  const opts = { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', timeZoneName: 'short' };
  const end = new Date(date.getTime() + bucketS * 1000);
  return date.toLocaleString(undefined, opts) + ' \u2013 ' + end.toLocaleTimeString(undefined, { hour: '2-digit', minute: '2-digit' });
}

// buckets: [{at, ...}]; series: [{key, cls, label, digits, unit}]; opts: {testid, label, bucketS}.
// Answers {node, readout}: the figure and its readout line.
export function chart(buckets, series, opts) {
  const bucketS = opts.bucketS || 60;
  const n = buckets.length;
  const values = (b, s) => Number(b[s.key]) || 0;
  const top = Math.max(1e-9, ...buckets.map((b) => Math.max(...series.map((s) => values(b, s)))));
  const niceTop = top <= 1e-9 ? 1 : top;
  const plotW = WIDTH - PAD_L - PAD_R;
  const plotH = HEIGHT - PAD_T - PAD_B;
  const x = (i) => PAD_L + (n <= 1 ? plotW / 2 : (i * plotW) / (n - 1));
  const y = (v) => PAD_T + plotH - (v * plotH) / niceTop;
  const dates = buckets.map((b) => new Date(b.at));
  const unit = series[0].unit || '';
  const digits = series[0].digits;

  const describeAt = (i) => bucketLabel(dates[i], bucketS) + ': ' + series.map((s) =>
    s.label + ' ' + fmtCount(values(buckets[i], s), s.digits) + (s.unit || '')).join(', ');

  const parts = [];
  parts.push(svg('line', { class: 'axis', x1: PAD_L, y1: PAD_T + plotH, x2: WIDTH - PAD_R, y2: PAD_T + plotH }));
  parts.push(svg('line', { class: 'axis', x1: PAD_L, y1: PAD_T, x2: PAD_L, y2: PAD_T + plotH }));
  for (const v of [0, niceTop / 2, niceTop]) {
    parts.push(svg('line', { class: 'grid', x1: PAD_L, y1: y(v), x2: WIDTH - PAD_R, y2: y(v) }));
    parts.push(svg('text', { class: 'tick', x: PAD_L - 6, y: y(v) + 4, 'text-anchor': 'end' },
      [fmtCount(v, digits === undefined ? (niceTop < 10 ? 1 : 0) : digits) + unit]));
  }
  const ticks = Math.min(5, n);
  for (let t = 0; t < ticks; t += 1) {
    const i = ticks === 1 ? 0 : Math.round((t * (n - 1)) / (ticks - 1));
    const anchor = t === 0 ? 'start' : t === ticks - 1 ? 'end' : 'middle';
    parts.push(svg('line', { class: 'axis', x1: x(i), y1: PAD_T + plotH, x2: x(i), y2: PAD_T + plotH + 4 }));
    parts.push(svg('text', { class: 'tick', x: x(i), y: HEIGHT - 14, 'text-anchor': anchor }, [tickLabel(dates[i], bucketS)]));
  }
  for (const s of series) {
    parts.push(svg('polyline', {
      class: 'series ' + s.cls,
      points: buckets.map((b, i) => x(i).toFixed(1) + ',' + y(values(b, s)).toFixed(1)).join(' '),
    }));
  }
  const cursor = svg('line', { class: 'cursor', x1: 0, y1: PAD_T, x2: 0, y2: PAD_T + plotH, 'aria-hidden': 'true' });
  const dots = series.map((s) => svg('circle', { class: 'dot ' + s.cls, cx: 0, cy: 0, r: 3.5, 'aria-hidden': 'true' }));
  const cursorGroup = svg('g', { class: 'cursor-group', 'aria-hidden': 'true' }, [cursor, ...dots]);
  parts.push(cursorGroup);
  // The hit areas: one a bucket, full height, each with its values as an SVG <title>.
  const step = n <= 1 ? plotW : plotW / (n - 1);
  buckets.forEach((b, i) => {
    parts.push(svg('rect', {
      class: 'hit', x: (x(i) - step / 2).toFixed(1), y: PAD_T, width: step.toFixed(2), height: plotH,
      'data-index': i,
    }, [svg('title', {}, [describeAt(i)])]));
  });

  const readoutId = opts.testid + '-readout-' + Math.random().toString(36).slice(2, 8);
  const readout = el('p', { class: 'readout', id: readoutId, 'data-testid': opts.testid + '-readout', 'aria-live': 'polite' },
    'Point at the chart, or focus it and use \u2190 \u2192, to read each ' + (bucketS >= 3600 ? 'hour' : bucketS >= 900 ? '15 minutes' : 'minute') + '.');
  const figure = svg('svg', {
    viewBox: '0 0 ' + WIDTH + ' ' + HEIGHT, class: 'chart', role: 'img', 'data-testid': opts.testid,
    'aria-label': opts.label + ' (times in ' + zoneName(dates[0]) + ')', tabindex: 0, focusable: 'true',
    'aria-describedby': readoutId,
  }, parts);

  let index = -1;
  function point(i) {
    if (!n) return;
    index = Math.max(0, Math.min(n - 1, i));
    cursorGroup.classList.add('shown');
    cursor.setAttribute('x1', x(index));
    cursor.setAttribute('x2', x(index));
    series.forEach((s, k) => {
      dots[k].setAttribute('cx', x(index));
      dots[k].setAttribute('cy', y(values(buckets[index], s)));
    });
    text(readout, describeAt(index));
  }
  on(figure, 'pointermove', (event) => {
    const box = figure.getBoundingClientRect();
    if (!box.width) return;
    const px = ((event.clientX - box.left) / box.width) * WIDTH;
    point(Math.round(((px - PAD_L) / plotW) * (n - 1)));
  });
  on(figure, 'focus', () => point(index < 0 ? n - 1 : index));
  on(figure, 'keydown', (event) => {
    const moves = { ArrowLeft: -1, ArrowRight: 1, Home: -n, End: n };
    if (!(event.key in moves)) return;
    event.preventDefault();
    point((index < 0 ? n - 1 : index) + moves[event.key]);
  });
  const caption = el('p', { class: 'axis-note muted' }, 'Times in ' + zoneName(dates[0]) + '.');
  return { node: el('figure', { class: 'chart-figure' }, [figure, readout, caption]), readout };
}
