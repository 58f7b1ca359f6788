"""What a store holds, read the same way from either store, for comparisons."""

from __future__ import annotations

from typing import Any

from relay_consumer import MemoryStore, Store
from relay_consumer.postgres import PostgresStore

Copy = dict[str, Any]


async def read(store: Store) -> Copy:
    if isinstance(store, MemoryStore):
        return {
            "positions": {e: (store.position(e).epoch, store.position(e).last_change_seq) for e in store.endpoints()},
            "items": {e: {s: i.item for s, i in store.items(e).items()} for e in store.endpoints() if store.items(e)},
            "stories": {
                e: {s: (r.ticker, r.version, r.closed, r.story, r.merged_into) for s, r in store.stories(e).items()}
                for e in store.endpoints()
                if store.stories(e)
            },
            "notified": {k: store.notification_repeats.get(k, 0) for k in store.notifications},
            "handed": store.handed(),
            "held": store.held_count(),
        }
    assert isinstance(store, PostgresStore)
    conn = store.connection
    out: Copy = {"positions": {}, "items": {}, "stories": {}, "notified": {}, "handed": set()}
    async with conn.cursor() as cur:
        await cur.execute("SELECT endpoint_id::text, epoch, last_change_seq FROM relay_positions")
        for e, epoch, last in await cur.fetchall():
            out["positions"][e] = (epoch, last)
        await cur.execute("SELECT endpoint_id::text, subject, item FROM relay_items WHERE NOT tombstone")
        for e, s, item in await cur.fetchall():
            out["items"].setdefault(e, {})[s] = item
        await cur.execute(
            "SELECT endpoint_id::text, story_id, ticker, version, closed, story, merged_into FROM relay_stories"
        )
        for e, s, t, v, c, st, m in await cur.fetchall():
            out["stories"].setdefault(e, {})[s] = (t, v, c, st, m)
        await cur.execute("SELECT endpoint_id::text, story_id, repeats, handed_at IS NOT NULL FROM relay_notifications")
        for e, s, repeats, handed in await cur.fetchall():
            out["notified"][(e, s)] = repeats
            if handed:
                out["handed"].add((e, s))
        await cur.execute("SELECT count(*) FROM relay_held")
        row = await cur.fetchone()
        out["held"] = row[0] if row else 0
    return out
