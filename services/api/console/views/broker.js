// A tenant's broker credentials (made, rotated after a confirmation that says every live
// consumer is dropped, deleted) and where its changes go.

import { el, swap } from '../lib/dom.js';
import { api, path, ApiError } from '../lib/api.js';
import { fmtId, fmtTime, time } from '../lib/format.js';
import {
  button, dl, copyable, shownOnce, confirmStep, loading, empty, errorSlot, announce, clearBanner, clamp,
} from '../lib/widgets.js';
import { setTitle } from '../lib/session.js';

export function viewBroker(main) {
  setTitle('Broker');
  const credentials = el('div', { 'data-testid': 'broker-credentials' }, loading());
  const password = el('div', { 'data-testid': 'broker-password-box' });
  const destination = el('div', { 'data-testid': 'destination' }, loading());
  const errors = errorSlot('broker-error');
  const destinationErrors = errorSlot('destination-error');

  function renderNone() {
    password.replaceChildren();
    swap(credentials,
      empty('No broker credentials yet: make them to read your queue on the relay\u2019s broker.'),
      el('div', { class: 'actions' }, button('Create credentials', { 'data-testid': 'broker-create' }, async () => {
        const made = await api('POST', path('broker', 'credentials'));
        renderCredentials(made);
        announce('Broker credentials made; the password is shown once.');
      }, errors)),
    );
  }

  function renderCredentials(c) {
    if (c.password) {
      password.replaceChildren(shownOnce(c.password, 'broker-password',
        'The password, shown once: copy it now. Rotate for a new one if it is lost.'));
    }
    const rotate = confirmStep('Rotate password', 'broker-rotate',
      'Rotate the password? Every live consumer\u2019s connection is dropped at once and must reconnect with the new password, shown once here. The old password stops working.',
      async () => {
        renderCredentials(await api('POST', path('broker', 'credentials', 'rotate')));
        announce('Password rotated; live connections were dropped. The new password is shown once.');
      }, { slot: errors, startClass: 'secondary', confirmLabel: 'Yes, rotate and drop connections' });
    const remove = confirmStep('Delete', 'broker-delete',
      'Delete the broker user? Its connections are closed and its consumers cannot connect again.', async () => {
        await api('DELETE', path('broker', 'credentials'));
        renderNone();
        announce('Broker user deleted.');
      }, { slot: errors });
    swap(credentials,
      dl([
        ['Username', copyable(c.username, 'broker-username')],
        ['Connection URL', copyable(c.amqp_url, 'broker-url')],
        ['Host', c.host],
        ['Port', fmtId(c.port), 'broker-port'],
        ['Virtual host', c.vhost],
        ['Queues', el('ul', { 'data-testid': 'broker-queues', class: 'plain' }, [
          el('li', {}, [el('span', { class: 'muted' }, 'changes: '), copyable(c.queue, 'broker-queue')]),
          el('li', {}, [el('span', { class: 'muted' }, 'dead letters: '), copyable(c.dead_letter_queue, 'broker-dlq')]),
        ])],
        ['Created', time(c.created_at)],
        ['Password rotated', time(c.rotated_at)],
      ]),
      el('p', { class: 'muted' }, 'The URL carries no password: give it with the password above, or add it to the URL yourself.'),
      el('div', { class: 'actions' }, [rotate, remove]),
    );
  }

  async function load() {
    try {
      renderCredentials(await api('GET', path('broker', 'credentials')));
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) renderNone();
      else {
        swap(credentials, el('p', { class: 'muted' }, 'Could not load the credentials.'));
        errors.show(err);
      }
    }
  }

  async function loadDestination() {
    destinationErrors.clear();
    try {
      const d = await api('GET', path('destination'));
      swap(destination, dl([
        ['Kind', d.kind + (d.default ? ' (default)' : '')],
        ['Exchange', d.exchange],
        ['Routing key', d.routing_key],
        ['Broker URL set', d.amqp_url_set],
        ['Updated', time(d.updated_at)],
        ['Refused', d.refused_reason ? [clamp(d.refused_reason), ' (' + fmtTime(d.refused_at) + ')'] : 'no'],
      ].map((row) => (Array.isArray(row[1]) ? [row[0], el('span', {}, row[1])] : row))));
    } catch (err) {
      swap(destination, el('p', { class: 'muted' }, 'Could not load the destination.'));
      destinationErrors.show(err);
    }
  }

  const refreshErrors = errorSlot('refresh-error');
  const refresh = button('Refresh', { 'data-testid': 'refresh', class: 'secondary' }, async () => {
    errors.clear();
    password.replaceChildren();
    await Promise.all([load(), loadDestination()]);
    clearBanner();
    announce('Broker refreshed.');
  }, refreshErrors);
  main.append(
    el('div', { class: 'title-row' }, [el('h1', { tabindex: -1 }, 'Broker'), refresh]),
    refreshErrors,
    el('section', { class: 'card', 'aria-labelledby': 'h-credentials' }, [el('h2', { id: 'h-credentials' }, 'Credentials'), password, credentials, errors]),
    el('section', { class: 'card', 'aria-labelledby': 'h-destination' }, [el('h2', { id: 'h-destination' }, 'Destination'),
      el('p', { class: 'muted' }, 'Where your changes go: the relay\u2019s queue for you, or your own exchange.'), destinationErrors, destination]),
  );
  load();
  loadDestination();
}
