// What ends a consumer and what it retries (clients/README.md, "Lifecycle"). A transient failure
// (the broker connection or channel lost or closed, the broker not answering, the store's
// database restarting or unreachable, a serialization failure) is retried forever with backoff;
// a permanent one (the broker refusing the credentials, the queue not found, the store's
// database missing or refusing the credentials, a store schema newer than this library's) ends
// the consumer with a PermanentError naming its cause.

import { RefusedMessage } from './message';

/** Why a consumer stopped for good. */
export type PermanentCause = 'broker_auth' | 'queue_not_found' | 'store_missing' | 'store_auth' | 'schema_newer';

/** A failure no retry cures: `done` rejects with it (and the command exits 2). */
export class PermanentError extends Error {
  readonly causeKind: PermanentCause;

  constructor(causeKind: PermanentCause, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'PermanentError';
    this.causeKind = causeKind;
  }
}

/**
 * A handler of yours threw (a change's handler while its batch was applied, which rolls the
 * batch back): the consumer stops with it, nothing of the batch acknowledged.
 */
export class HandlerError extends Error {
  constructor(what: string, cause: unknown) {
    super(`the ${what} handler threw: ${describeError(cause)}`, { cause });
    this.name = 'HandlerError';
  }
}

/** How the consumer takes an error. */
export type Classified =
  | { kind: 'transient' }
  | { kind: 'permanent'; error: PermanentError }
  /** Not a failure of the broker or the store: your handler, or a message refused (onRefused 'stop'). */
  | { kind: 'fatal' };

interface Coded {
  code?: unknown;
  message?: unknown;
}

/** One line about an error, with the broker's close code and text or Postgres's SQLSTATE. */
export function describeError(error: unknown): string {
  if (!(error instanceof Error)) return String(error);
  const { code } = error as Coded;
  // amqplib's messages carry the close code and text already ("Connection closed: 320
  // (CONNECTION-FORCED) with message ..."); pg's carry neither its code nor the server's words.
  if (typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code) && 'severity' in error) return `${error.message} (SQLSTATE ${code})`;
  if (typeof code === 'string' && !error.message.includes(code)) return `${error.message} (${code})`;
  return error.message;
}

const PG_PERMANENT: Record<string, PermanentCause> = {
  '3D000': 'store_missing',
  '28P01': 'store_auth',
  '28000': 'store_auth',
};

export function classify(error: unknown): Classified {
  if (error instanceof PermanentError) return { kind: 'permanent', error };
  if (error instanceof HandlerError || error instanceof RefusedMessage) return { kind: 'fatal' };
  if (!(error instanceof Error)) return { kind: 'transient' };
  const { code } = error as Coded;
  const text = error.message;
  if (typeof code === 'string' && PG_PERMANENT[code]) {
    const cause = PG_PERMANENT[code]!;
    const what = cause === 'store_missing' ? "the store's database does not exist" : "the store's database refused the credentials";
    return { kind: 'permanent', error: new PermanentError(cause, `${what}: ${describeError(error)}`, { cause: error }) };
  }
  // The broker: a close of the connection during the handshake (amqplib gives no code then, the
  // text has it) or of the channel, with its reply code.
  if (code === 403 || /\b403\b.*ACCESS[-_]REFUSED/.test(text)) {
    return { kind: 'permanent', error: new PermanentError('broker_auth', `the broker refused access: ${text}`, { cause: error }) };
  }
  if (code === 404 || /\b404\b.*NOT[-_]FOUND/.test(text)) {
    return { kind: 'permanent', error: new PermanentError('queue_not_found', `the queue was not found: ${text}`, { cause: error }) };
  }
  return { kind: 'transient' };
}
