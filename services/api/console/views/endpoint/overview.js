// An endpoint's overview: its settings (edited here: name, language or tickers and mode, the
// upstream's URL and key), pause and resume, delete (confirmed), its state, and its signing
// secrets (rotate or add: pasted as the upstream shows it, or made here and shown once).

import { el, on, swap, shown } from '../../lib/dom.js';
import { api, path, invalid } from '../../lib/api.js';
import { fmtCount, fmtDuration, fmtId, fmtTime, time } from '../../lib/format.js';
import {
  button, dl, field, select, table, td, empty, shownOnce, confirmStep, errorSlot, formErrors, busy,
  announce, randomSecret, clamp, answerSlot,
} from '../../lib/widgets.js';
import { go } from '../../lib/session.js';
import { upstreamSummary } from '../endpoints.js';

export function overviewSection(ctx) {
  const endpointBox = el('div');
  const editBox = el('div');
  const stateBox = el('div');
  const secretsBox = el('div');
  const statusErrors = errorSlot('status-error');

  function renderEndpoint() {
    const ep = ctx.endpoint;
    const paused = ep.status === 'paused';
    const pause = button('Pause', { 'data-testid': 'pause', class: 'secondary', disabled: paused }, async () => {
      ctx.setEndpoint(await api('POST', path('endpoints', ctx.id, 'pause')));
      renderEndpoint();
      announce('Endpoint paused.');
      await ctx.refreshState();
    }, statusErrors);
    const resume = button('Resume', { 'data-testid': 'resume', class: 'secondary', disabled: !paused }, async () => {
      ctx.setEndpoint(await api('POST', path('endpoints', ctx.id, 'resume')));
      renderEndpoint();
      announce('Endpoint resumed.');
      await ctx.refreshState();
    }, statusErrors);
    const remove = confirmStep('Delete endpoint', 'endpoint-delete',
      'Delete this endpoint? From now on the front tier answers 404 for it (delete it at the upstream too), and its stored messages, copy and changes are purged. This cannot be undone.',
      async () => {
        const answer = await api('DELETE', path('endpoints', ctx.id));
        go('#/endpoints', { testid: 'endpoint-deleted', text: 'Endpoint ' + (ctx.endpoint.name || answer.id) + ' (' + answer.id + ') is ' + answer.status + ': it is gone from every read, and its data is being purged.' });
      });
    swap(endpointBox,
      dl([
        ['Name', ep.name ? clamp(ep.name) : null, 'endpoint-name'],
        ['Id', shown(ep.id, { class: 'mono' }), 'endpoint-id'],
        ['Status', el('span', { class: 'badge ' + (paused ? 'warn' : 'ok') }, ep.status), 'endpoint-status'],
        ['Source', ep.source],
        ctx.stories ? ['Stories mode', ep.stories_mode] : ['Language', ep.lang, 'endpoint-lang'],
        ctx.stories ? ['Tickers', ep.tickers, 'endpoint-tickers'] : null,
        ['Upstream base URL', ep.upstream_base_url ? clamp(ep.upstream_base_url) : null, 'endpoint-base-url'],
        ['Upstream API key set', ep.upstream_api_key_set, 'endpoint-api-key-set'],
        ['Created', time(ep.created_at)],
        ['Updated', time(ep.updated_at)],
      ].filter(Boolean)),
      el('div', { class: 'actions' }, [pause, resume,
        el('span', { class: 'muted' }, paused
          ? 'Paused: the front tier answers 410. Resume it at the upstream too.'
          : 'Active: the front tier takes messages.')]),
      statusErrors,
      el('div', { class: 'actions' }, remove),
    );
  }

  function renderEdit() {
    const ep = ctx.endpoint;
    const name = el('input', { type: 'text', 'data-testid': 'endpoint-edit-name', maxlength: 200, autocomplete: 'off', value: ep.name || '', placeholder: 'no name' });
    const lang = el('input', { type: 'text', 'data-testid': 'endpoint-edit-lang', autocomplete: 'off', spellcheck: 'false', value: ep.lang || '', class: 'short' });
    const tickers = el('input', { type: 'text', 'data-testid': 'endpoint-edit-tickers', autocomplete: 'off', spellcheck: 'false', value: (ep.tickers || []).join(', ') });
    const mode = select([['snapshot', 'snapshot'], ['fetch_on_notify', 'fetch_on_notify']], { 'data-testid': 'endpoint-edit-stories-mode' });
    mode.value = ep.stories_mode || 'snapshot';
    const baseUrl = el('input', { type: 'text', 'data-testid': 'endpoint-edit-base-url', autocomplete: 'off', spellcheck: 'false', value: ep.upstream_base_url || '', inputmode: 'url' });
    const apiKey = el('input', { type: 'password', 'data-testid': 'endpoint-edit-api-key', autocomplete: 'new-password',
      placeholder: ep.upstream_api_key_set ? 'set: leave empty to keep it' : 'not set' });
    const save = el('button', { type: 'submit', 'data-testid': 'endpoint-edit-save' }, 'Save settings');
    const errors = formErrors('endpoint-edit', { name, lang, tickers, stories_mode: mode, upstream_base_url: baseUrl, upstream_api_key: apiKey, body: save });
    const cell = (label, control, key, hint) => el('div', { class: 'form-cell' + (key === 'upstream_base_url' ? ' wide' : '') },
      [field(label, control, {}, hint), errors.slotFor(key)]);
    const form = el('form', { class: 'edit-form', 'data-testid': 'endpoint-edit-form', 'aria-label': 'Settings' }, [
      el('div', { class: 'form-row' }, [
        cell('Name', name, 'name', 'Empty clears it'),
        ctx.stories ? cell('Tickers', tickers, 'tickers', 'Comma-separated: the whole new list') : cell('Language', lang, 'lang'),
        ctx.stories ? cell('Stories mode', mode, 'stories_mode') : null,
      ]),
      el('div', { class: 'form-row' }, [
        cell('Upstream base URL', baseUrl, 'upstream_base_url'),
        cell('Upstream API key', apiKey, 'upstream_api_key', 'Write-only: never shown'),
      ]),
      errors.slotFor('body'),
      errors.form,
      el('div', { class: 'actions' }, save),
    ]);
    on(form, 'submit', (event) => {
      event.preventDefault();
      busy(save, async () => {
        const saved = form.querySelector('[data-testid="endpoint-edit-saved"]');
        if (saved) saved.remove();
        // Only what changed is sent (absent fields keep their value).
        const cur = ctx.endpoint;
        const body = {};
        const newName = name.value.trim();
        if (newName !== (cur.name || '')) body.name = newName;
        if (ctx.stories) {
          const list = tickers.value.split(',').map((t) => t.trim()).filter(Boolean);
          if (list.join('\n') !== (cur.tickers || []).join('\n')) body.tickers = list;
          if (mode.value !== (cur.stories_mode || 'snapshot')) body.stories_mode = mode.value;
        } else if (lang.value.trim() !== (cur.lang || '')) {
          body.lang = lang.value.trim();
        }
        if (baseUrl.value.trim() !== (cur.upstream_base_url || '')) {
          if (!baseUrl.value.trim()) throw invalid('the URL cannot be removed here, only changed', 'upstream_base_url');
          body.upstream_base_url = baseUrl.value.trim();
        }
        if (apiKey.value) body.upstream_api_key = apiKey.value;
        if (!Object.keys(body).length) throw invalid('nothing changed', 'body');
        const updated = await api('PATCH', path('endpoints', ctx.id), { body });
        ctx.setEndpoint(updated);
        renderEndpoint();
        renderEdit();
        announce('Settings saved.');
        editBox.querySelector('[data-testid="endpoint-edit-form"]').appendChild(
          el('p', { class: 'saved', 'data-testid': 'endpoint-edit-saved' }, 'Saved at ' + fmtTime(new Date()) + '.'));
      }, errors);
    });
    swap(editBox, el('details', { class: 'edit', 'data-testid': 'endpoint-edit' }, [
      el('summary', { 'data-testid': 'endpoint-edit-open' }, 'Edit settings'), form,
    ]));
  }

  function renderState(s) {
    const u = s.upstream || {};
    const rows = [
      ['Upstream status', upstreamSummary(u)],
      ['Consecutive failures', fmtCount(u.consecutive_failures)],
      ['Failing since', time(u.failing_since)],
      ['Last failure', time(u.last_failure_at)],
      ['Last success after failing', time(u.last_success_at)],
      ['Last arrival', fmtId(s.last_arrival_seq), 'state-last-arrival'],
      ['Applied through arrival', fmtId(s.applied_arrival_seq)],
      ['Messages waiting', fmtCount(s.messages_waiting), 'state-waiting'],
      ['Apply lag', fmtDuration(s.apply_lag_s), 'state-apply-lag'],
      ['Oldest waiting received', time(s.oldest_waiting_received_at)],
      ['Last applied (received)', time(s.last_applied_received_at)],
      ['Last applied at', time(s.last_applied_at)],
      ['Outbox backlog', fmtCount(s.outbox_backlog), 'state-outbox'],
      ['Change epoch', fmtId(s.change_epoch), 'state-epoch'],
      ['Last change_seq', fmtId(s.last_change_seq), 'state-last-change-seq'],
      ['Quarantined', fmtCount(s.messages_quarantined), 'state-quarantined'],
      ['Last quarantine reason', s.last_quarantine_reason ? clamp(s.last_quarantine_reason) : null],
      ['Restore held', s.restore
        ? 'yes: restored ' + fmtTime(s.restore.restored_at) + (s.restore.last_was_reset
          ? ', last was a reset (the feed is read again)'
          : ', rewind from ' + (s.restore.through || '\u2014'))
        : 'no', 'state-restore'],
    ];
    if (s.reload_waiting_since) rows.push(['Reload waiting for a slot since', time(s.reload_waiting_since)]);
    if (!ctx.stories) rows.push(['Reload running', s.reload_running, 'state-reload']);
    const st = s.stories;
    if (st) {
      const reload = st.reload || {};
      rows.push(
        ['Loaded', st.loaded],
        ['Reload', reload.status + (reload.round !== null && reload.round !== undefined ? ' (round ' + fmtId(reload.round) + ')' : ''), 'state-reload'],
        ['Last reload finished', time(reload.reloaded_at)],
        ['Caught up at', time(st.caught_up_at)],
        ['Catch-up cursor', st.catch_up_cursor],
        ['Tickers loading', st.tickers_loading],
        ['Tickers dropping', st.tickers_dropping],
        ['Rounds', fmtCount(st.rounds)],
        ['Story reads owed', fmtCount(st.reads_owed)],
        ['Owed since', time(st.reads_owed_since)],
      );
    }
    const parts = [el('h3', {}, 'State'), dl(rows, { 'data-testid': 'state' })];
    if (Array.isArray(s.tracks) && s.tracks.length) {
      parts.push(el('h3', {}, 'Tracks'), table(
        ['Track', 'Generation', 'Access version', 'Through', 'Last was reset', 'Reload', 'Reload begun'],
        s.tracks.map((t) => el('tr', { 'data-testid': 'track-row' }, [
          td(t.track), td(fmtId(t.generation)), td(t.access_version), td(t.through), td(t.last_was_reset),
          td(t.reload_running ? clamp(JSON.stringify(t.reload)) : 'no'), td(time(t.reload_begun_at)),
        ])),
        { 'data-testid': 'tracks-table' }, 'Tracks',
      ));
    }
    swap(stateBox, parts);
  }

  const secretsTable = el('div');
  async function reloadSecrets() {
    const list = await api('GET', path('endpoints', ctx.id, 'secrets'));
    swap(secretsTable, secretRows(list));
  }

  function renderSecrets(secrets) {
    swap(secretsTable, secretRows(secrets || []));
    // Rotation: the new secret verifies now, the old ones during the overlap.
    const value = el('input', { type: 'password', 'data-testid': 'rotate-secret-value', autocomplete: 'off', spellcheck: 'false', placeholder: 'whsec_\u2026 or empty to generate' });
    const overlap = el('input', { type: 'number', min: 0, step: 1, 'data-testid': 'rotate-overlap', placeholder: '86400' });
    const rotateErrors = formErrors('rotate', { secret: value, overlap_s: overlap });
    const output = answerSlot('rotation');
    const rotate = button('Rotate secret', { 'data-testid': 'rotate-secret' }, async () => {
      output.clear();
      const pasted = value.value.trim();
      const secret = pasted || randomSecret();
      const body = { secret };
      if (overlap.value !== '') body.overlap_s = Number(overlap.value);
      const answer = await api('POST', path('endpoints', ctx.id, 'secrets', 'rotate'), { body });
      value.value = '';
      output.show(
        pasted ? null : shownOnce(secret, 'new-secret', 'The new signing secret, made in this browser and shown once: give it to the upstream now.'),
        el('p', { 'data-testid': 'rotation-answer' }, 'Secret ' + fmtId(answer.secret && answer.secret.id) +
          (pasted ? ' (the one pasted)' : '') + ' verifies now; ' + fmtCount(answer.old_secrets) + ' older secret(s) verify until ' +
          fmtTime(answer.old_secrets_expire_at) + '.'),
      );
      announce('Secret rotated.');
      await reloadSecrets();
    }, rotateErrors);
    // Adding: one more secret verifies (as the upstream holds two while it rotates).
    const addValue = el('input', { type: 'password', 'data-testid': 'add-secret-value', autocomplete: 'off', spellcheck: 'false', placeholder: 'whsec_\u2026 or empty to generate' });
    const expires = el('input', { type: 'number', min: 1, step: 1, 'data-testid': 'add-secret-expires', placeholder: 'never' });
    const addErrors = formErrors('add-secret', { secret: addValue, expires_in_s: expires });
    const added = answerSlot('secret-added');
    const addButton = button('Add secret', { 'data-testid': 'add-secret', class: 'secondary' }, async () => {
      added.clear();
      const pasted = addValue.value.trim();
      const secret = pasted || randomSecret();
      const body = { secret };
      if (expires.value !== '') body.expires_in_s = Number(expires.value);
      const answer = await api('POST', path('endpoints', ctx.id, 'secrets'), { body });
      addValue.value = '';
      added.show(
        pasted ? null : shownOnce(secret, 'added-secret', 'The added secret, made in this browser and shown once.'),
        el('p', {}, 'Secret ' + fmtId(answer.id) + ' added; it verifies ' + (answer.expires_at ? 'until ' + fmtTime(answer.expires_at) : 'until expired') + '.'),
      );
      announce('Secret added.');
      await reloadSecrets();
    }, addErrors);
    swap(secretsBox,
      el('h3', {}, 'Signing secrets'),
      secretsTable,
      el('h4', {}, 'Rotate'),
      el('p', { class: 'muted' }, 'Paste the secret the upstream shows after rotating there, or leave the field empty to make one in this browser (shown once, to give to the upstream). The old secrets keep verifying during the overlap.'),
      el('div', { class: 'form-row' }, [
        el('div', { class: 'form-cell wide' }, [field('New secret', value), rotateErrors.slotFor('secret')]),
        el('div', { class: 'form-cell' }, [field('Overlap (s)', overlap, {}, 'Default 86400, at most 604800'), rotateErrors.slotFor('overlap_s')]),
      ]),
      rotateErrors.form,
      el('div', { class: 'actions' }, rotate),
      output,
      el('h4', {}, 'Add'),
      el('div', { class: 'form-row' }, [
        el('div', { class: 'form-cell wide' }, [field('Secret to add', addValue), addErrors.slotFor('secret')]),
        el('div', { class: 'form-cell' }, [field('Expires in (s)', expires), addErrors.slotFor('expires_in_s')]),
      ]),
      addErrors.form,
      el('div', { class: 'actions' }, addButton),
      added,
    );
  }

  function secretRows(secrets) {
    if (!secrets.length) return empty('No secrets.');
    return table(['Id', 'Created', 'Expires', 'Active'], secrets.map((s) => el('tr', { 'data-testid': 'secret-row', 'data-secret-id': s.id }, [
      td(fmtId(s.id)), td(time(s.created_at)), td(time(s.expires_at)), td(s.active),
    ])), { 'data-testid': 'secrets-table' }, 'Signing secrets');
  }

  renderEndpoint();
  renderEdit();
  renderState(ctx.state);
  renderSecrets(ctx.endpoint.secrets);
  ctx.listeners.push(renderState);
  ctx.endpointListeners = [() => renderEndpoint()];
  ctx.reloaders.push(reloadSecrets);
  return el('div', {}, [endpointBox, editBox, stateBox, secretsBox]);
}
