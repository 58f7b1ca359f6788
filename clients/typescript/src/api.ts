// The relay's control-plane API, as a tenant calls it (a bearer token of the tenant): the list of
// its endpoints, replay and resync of an endpoint's change stream, and the reads of its copy,
// stories and notifications.

export class RelayApiError extends Error {
  constructor(readonly status: number, readonly body: string, what: string) {
    super(`${what} answered ${status}: ${body}`);
    this.name = 'RelayApiError';
  }
}

export interface ReplayAnswer {
  webhook_endpoint_id: string;
  epoch: number;
  from_change_seq: number;
  through_change_seq: number;
}

export interface ResyncAnswer {
  webhook_endpoint_id: string;
  epoch: number;
  snapshot_items: number;
}

export interface CopyItem {
  subject: string;
  item_kind: string | null;
  generation: number;
  sequence: string;
  tombstone: boolean;
  item: Record<string, unknown> | null;
}

export interface StoryView {
  id: string;
  ticker: string | null;
  version: number;
  closed: boolean;
  merged_into: string | null;
  story?: Record<string, unknown> | null;
}

/** A webhook endpoint of the tenant, as `GET /v1/endpoints` lists it (its secrets never). */
export interface EndpointView {
  id: string;
  /** `feed` or `stories`. */
  source: string;
  lang: string | null;
  stories_mode?: string;
  tickers?: string[];
  /** `active` or `paused`. */
  status: string;
  upstream_base_url: string | null;
  upstream_api_key_set: boolean;
  created_at: string;
  updated_at: string;
}

export interface NotificationView {
  key: string;
  story_id: string;
  ticker: string | null;
  event_id: string | null;
  claimed_at: string;
  notified: boolean;
}

export class RelayApi {
  private readonly base: string;

  constructor(baseUrl: string, private readonly token: string, private readonly timeoutMs = 10_000) {
    this.base = baseUrl.replace(/\/+$/, '');
  }

  /** The tenant's webhook endpoints (every page; one being deleted is not listed). */
  endpoints(): Promise<EndpointView[]> {
    return this.pages('/v1/endpoints', {}) as Promise<EndpointView[]>;
  }

  /** Asks the relay to send the endpoint's changes again from `fromChangeSeq` of its epoch. */
  replay(endpoint: string, fromChangeSeq: number): Promise<ReplayAnswer> {
    return this.call('POST', `/v1/endpoints/${endpoint}/replay`, { from_change_seq: fromChangeSeq }) as Promise<ReplayAnswer>;
  }

  /** Asks for a new epoch, opened by a snapshot of the copy as it is now. */
  resync(endpoint: string): Promise<ResyncAnswer> {
    return this.call('POST', `/v1/endpoints/${endpoint}/resync`) as Promise<ResyncAnswer>;
  }

  /** The endpoint's copy through the API (every page). */
  copy(endpoint: string, includeTombstones = false): Promise<CopyItem[]> {
    return this.pages(`/v1/endpoints/${endpoint}/copy`, includeTombstones ? { include_tombstones: 'true' } : {}) as Promise<CopyItem[]>;
  }

  /** A stories endpoint's stories, closed ones included (every page). */
  stories(endpoint: string): Promise<StoryView[]> {
    return this.pages(`/v1/endpoints/${endpoint}/stories`, { include_closed: 'true' }) as Promise<StoryView[]>;
  }

  /** A stories endpoint's claimed notifications (every page). */
  notifications(endpoint: string): Promise<NotificationView[]> {
    return this.pages(`/v1/endpoints/${endpoint}/notifications`, {}) as Promise<NotificationView[]>;
  }

  async state(endpoint: string): Promise<Record<string, unknown>> {
    return (await this.call('GET', `/v1/endpoints/${endpoint}/state`)) as Record<string, unknown>;
  }

  private async pages(path: string, query: Record<string, string>): Promise<unknown[]> {
    const out: unknown[] = [];
    let after: string | null = null;
    for (;;) {
      const params = new URLSearchParams({ ...query, limit: '500' });
      if (after !== null) params.set('after', after);
      const page = (await this.call('GET', `${path}?${params}`)) as { data: unknown[]; next_cursor: string | null };
      out.push(...page.data);
      if (!page.next_cursor) return out;
      after = page.next_cursor;
    }
  }

  private async call(method: string, path: string, body?: unknown): Promise<unknown> {
    const headers: Record<string, string> = { authorization: `Bearer ${this.token}` };
    if (body !== undefined) headers['content-type'] = 'application/json';
    const answer = await fetch(`${this.base}${path}`, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: AbortSignal.timeout(this.timeoutMs),
    });
    const text = await answer.text();
    if (!answer.ok) throw new RelayApiError(answer.status, text, `${method} ${path}`);
    return text === '' ? null : JSON.parse(text);
  }
}
