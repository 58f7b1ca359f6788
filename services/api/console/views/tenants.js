// An operator's tenants: the list with usage and quotas, a new tenant, and the selected one's
// token, quotas and offboarding (confirmed; its panel then closes and the list is read again).

import { el, on, text, shown, swap } from '../lib/dom.js';
import { api, path, describe, invalid, PAGE_SIZE } from '../lib/api.js';
import { fmtCount, fmtTime, time, fmt } from '../lib/format.js';
import {
  button, dl, field, table, td, pagedList, copyable, shownOnce, confirmStep, loading, errorSlot, formErrors,
  busy, announce, tenantHref, clamp, report,
} from '../lib/widgets.js';
import { setTitle } from '../lib/session.js';

export function viewTenants(main, selectedId) {
  setTitle('Tenants');
  const panelHost = el('div');
  const statusLine = el('div', { class: 'status-slot' });
  const name = el('input', { type: 'text', 'data-testid': 'tenant-name', maxlength: 200, required: true, autocomplete: 'off' });
  const newId = el('input', { type: 'text', 'data-testid': 'tenant-id', placeholder: 'optional UUID', autocomplete: 'off', spellcheck: 'false' });
  const create = el('button', { type: 'submit', 'data-testid': 'tenant-create' }, 'Create tenant');
  const errors = formErrors('tenant-create', { name, id: newId });
  const form = el('form', { class: 'card', novalidate: true, 'data-testid': 'tenant-create-form', 'aria-labelledby': 'h-new-tenant' }, [
    el('h2', { id: 'h-new-tenant' }, 'New tenant'),
    el('div', { class: 'form-row' }, [
      el('div', { class: 'form-cell' }, [field('Name', name), errors.slotFor('name')]),
      el('div', { class: 'form-cell' }, [field('Id', newId), errors.slotFor('id')]),
    ]),
    errors.form,
    el('div', { class: 'actions' }, create),
  ]);
  const list = pagedList({
    prevId: 'prev-page',
    nextId: 'next-page',
    errorId: 'tenants-error',
    empty: 'No tenants yet.',
    fetch: (cursor) => api('GET', path('tenants'), { query: { limit: PAGE_SIZE, after: cursor } }),
    render: tenantTable,
  });

  function openPanel(id, tenant, created) {
    statusLine.replaceChildren();
    const panel = el('section', { class: 'card', 'data-testid': 'tenant-panel', 'aria-label': 'Selected tenant' });
    panelHost.replaceChildren(panel);
    showPanel(panel, id, tenant, created, {
      reload: () => list.reload(true),
      offboarded(t, answer) {
        // The panel goes: none of its buttons stays live for a tenant being deleted.
        panelHost.replaceChildren();
        if (location.hash !== '#/tenants') history.replaceState(null, '', '#/tenants');
        setTitle('Tenants');
        swap(statusLine, el('p', { class: 'status-line', role: 'status', 'data-testid': 'offboard-status' }, [
          'Tenant ', shown(t.name), ' (', shown(answer.id || t.id, { class: 'mono' }), ') was offboarded: ', answer.status || 'deleting',
          '. Its endpoints, queues and broker user are being deleted.',
        ]));
        announce('Tenant ' + t.name + ' offboarded.');
        return list.reload(true);
      },
    });
  }

  on(form, 'submit', (event) => {
    event.preventDefault();
    busy(create, async () => {
      const body = { name: name.value.trim() };
      if (!body.name) throw invalid('give the tenant a name', 'name');
      if (newId.value.trim()) body.id = newId.value.trim();
      const tenant = await api('POST', path('tenants'), { body });
      name.value = '';
      newId.value = '';
      history.replaceState(null, '', tenantHref(tenant.id));
      openPanel(tenant.id, tenant, true);
      announce('Tenant ' + tenant.name + ' created.');
      await list.reload(true);
    }, errors);
  });

  const refreshErrors = errorSlot('refresh-error');
  const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, async () => {
    await list.reload(true);
    announce('Tenants refreshed.');
  }, refreshErrors);
  main.append(
    el('div', { class: 'title-row' }, [el('h1', { tabindex: -1 }, 'Tenants'), refresh]),
    refreshErrors,
    statusLine,
    form,
    panelHost,
    el('section', { class: 'card', 'aria-labelledby': 'h-all-tenants' }, [el('h2', { id: 'h-all-tenants' }, 'All tenants'), list.node]),
  );
  if (selectedId) openPanel(selectedId, null, false);
  list.reset();
}

function tenantTable(tenants) {
  const rows = tenants.map((t) => {
    const used = el('td', { 'data-testid': 'usage' }, '\u2026');
    const rate = el('td', { 'data-testid': 'rate-quota' }, '\u2026');
    const overrides = el('td', { 'data-testid': 'overrides' }, '\u2026');
    api('GET', path('tenants', t.id, 'quotas')).then((q) => {
      const inForce = q.in_force || {};
      const o = q.overrides || {};
      text(used, fmtCount(q.usage && q.usage.endpoints) + ' / ' + fmtCount(inForce.max_endpoints));
      text(rate, fmtCount(inForce.max_messages_per_second));
      const set = [];
      if (o.max_endpoints !== null && o.max_endpoints !== undefined) set.push('endpoints');
      if (o.max_messages_per_second !== null && o.max_messages_per_second !== undefined) set.push('messages/s');
      text(overrides, set.length ? set.join(', ') : 'defaults');
    }).catch((err) => {
      for (const c of [used, rate, overrides]) text(c, '\u2014');
      overrides.title = describe(err);
    });
    return el('tr', { 'data-testid': 'tenant-row', 'data-tenant-id': t.id }, [
      el('td', {}, el('a', { href: tenantHref(t.id), class: 'mono', 'data-testid': 'tenant-link' }, shown(t.id))),
      el('td', { 'data-testid': 'tenant-name-cell' }, clamp(t.name)), td(time(t.created_at)), used, rate, overrides,
      el('td', {}, el('a', { href: tenantHref(t.id), 'data-testid': 'tenant-manage', 'aria-label': 'Manage ' + t.name }, 'Manage')),
    ]);
  });
  return table(['Id', 'Name', 'Created', 'Endpoints (used / quota)', 'Messages/s quota', 'Overrides', 'Actions'], rows,
    { 'data-testid': 'tenants-table' }, 'Tenants');
}

// The selected tenant: its token, its quotas, its offboarding.
async function showPanel(panel, id, tenant, created, hooks) {
  panel.replaceChildren(el('h2', {}, 'Tenant'), loading());
  let t = tenant;
  let quotas = null;
  try {
    [t, quotas] = await Promise.all([
      t ? Promise.resolve(t) : api('GET', path('tenants', id)),
      api('GET', path('tenants', id, 'quotas')),
    ]);
  } catch (err) {
    panel.replaceChildren(el('h2', {}, 'Tenant'), el('p', { class: 'muted' }, 'Could not load this tenant.'));
    report(err, panel);
    return;
  }
  if (!panel.isConnected) return;
  setTitle('Tenant ' + (t.name || t.id));

  const ttl = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'mint-ttl', placeholder: '86400' });
  const minted = el('div', { 'data-testid': 'minted-token-box' });
  const mintErrors = errorSlot('mint-error', ttl);
  const mint = button('Mint token', { 'data-testid': 'mint-token' }, async () => {
    minted.replaceChildren();
    const body = {};
    if (ttl.value !== '') body.ttl_s = Number(ttl.value);
    const issued = await api('POST', path('tenants', t.id, 'tokens'), { body });
    minted.replaceChildren(
      shownOnce(issued.token, 'minted-token', 'The tenant\u2019s token, shown once: hand it to the tenant now.'),
      el('p', { class: 'muted' }, 'Expires ' + fmtTime(issued.expires_at) + '.'),
    );
    announce('Token minted; it is shown once.');
  }, mintErrors);

  const quotaBox = el('div', { 'data-testid': 'quotas' });
  function renderQuotas(q) {
    const inForce = q.in_force || {};
    const defaults = q.defaults || {};
    const o = q.overrides || {};
    const maxEndpoints = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'quota-max-endpoints',
      placeholder: 'default ' + fmt(defaults.max_endpoints), value: o.max_endpoints === null || o.max_endpoints === undefined ? '' : o.max_endpoints });
    const maxRate = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'quota-max-rate',
      placeholder: 'default ' + fmt(defaults.max_messages_per_second),
      value: o.max_messages_per_second === null || o.max_messages_per_second === undefined ? '' : o.max_messages_per_second });
    const errors = formErrors('quotas', { max_endpoints: maxEndpoints, max_messages_per_second: maxRate });
    const save = button('Save quotas', { 'data-testid': 'quotas-save', class: 'secondary' }, async () => {
      const value = (input) => (input.value === '' ? null : Number(input.value));
      const answer = await api('PUT', path('tenants', t.id, 'quotas'),
        { body: { max_endpoints: value(maxEndpoints), max_messages_per_second: value(maxRate) } });
      renderQuotas(answer);
      announce('Quotas saved.');
      await hooks.reload();
    }, errors);
    swap(quotaBox,
      dl([
        ['Endpoints in use', fmtCount(q.usage && q.usage.endpoints), 'quota-usage'],
        ['Max endpoints in force', fmtCount(inForce.max_endpoints)],
        ['Max messages/s in force', fmtCount(inForce.max_messages_per_second)],
      ]),
      el('div', { class: 'form-row' }, [
        el('div', { class: 'form-cell' }, [field('Max endpoints', maxEndpoints), errors.slotFor('max_endpoints')]),
        el('div', { class: 'form-cell' }, [field('Max messages/s', maxRate), errors.slotFor('max_messages_per_second')]),
      ]),
      errors.form,
      el('div', { class: 'actions' }, [save, el('span', { class: 'muted' }, 'Blank: the operator\u2019s default.')]),
    );
  }
  renderQuotas(quotas);

  const offboard = confirmStep('Offboard', 'offboard',
    'Delete this tenant, every endpoint, queue and broker user of it? This cannot be undone.', async () => {
      const answer = await api('DELETE', path('tenants', t.id));
      await hooks.offboarded(t, answer);
    });

  panel.replaceChildren(
    el('h2', {}, [created ? 'Created: ' : 'Tenant: ', shown(t.name)]),
    dl([['Id', copyable(t.id, 'selected-tenant-id')], ['Name', clamp(t.name)], ['Created', time(t.created_at)]]),
    el('h3', {}, 'Token'),
    el('div', { class: 'actions' }, [field('Lifetime (s)', ttl), mint]),
    mintErrors,
    minted,
    el('h3', {}, 'Quotas'),
    quotaBox,
    el('h3', {}, 'Offboarding'),
    el('div', { class: 'actions' }, offboard),
  );
}
