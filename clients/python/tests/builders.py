"""Messages as the relay writes them, for the tests (checked against the docs' schemas)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

TENANT = "5f0c2d0e-8d43-4c1b-9a52-0d7f3f3a6a11"
FEED = "8d2f0c39-2b63-4c55-9a8a-3f5b1d7c1e20"
STORIES = "3b7e6a41-0c2d-4f5e-8a9b-1c2d3e4f5a6b"
AT = "2026-11-29T21:00:00.123456Z"

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs"


def feed(
    seq: int,
    operation: str = "upsert",
    subject: str = "announcement:1",
    *,
    epoch: int = 1,
    item: dict[str, Any] | None = None,
    endpoint: str = FEED,
    snapshot: bool = False,
    generation: int = 1,
) -> dict[str, Any]:
    marker = operation in ("snapshot_begin", "snapshot_end")
    in_snapshot = marker or snapshot
    body: dict[str, Any] = {
        "v": 1,
        "tenant_id": TENANT,
        "webhook_endpoint_id": endpoint,
        "epoch": epoch,
        "change_seq": seq,
        "operation": operation,
        "subject": "" if marker else subject,
        "item_kind": None if marker else subject.split(":")[0],
        "generation": generation,
        "sequence": None if marker else f"{generation:010}.{seq:010}",
        "event_id": None if in_snapshot else f"evt_{epoch}_{seq}",
        "reload_generation": None,
        "snapshot": in_snapshot,
        "parts_diff": {"added": [], "changed": [], "removed": []},
        "changed_at": AT,
    }
    if operation == "upsert":
        body["item"] = item if item is not None else {"feed_item_id": subject, "seq": seq}
    return body


def story(
    seq: int,
    operation: str,
    story_id: str,
    version: int = 1,
    *,
    epoch: int = 1,
    merged_into: str | None = None,
    snapshot: bool = False,
    endpoint: str = STORIES,
    ticker: str | None = "ALFA B",
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "kind": "notification" if operation == "notified" else "story",
        "tenant_id": TENANT,
        "webhook_endpoint_id": endpoint,
        "epoch": epoch,
        "change_seq": seq,
        "operation": operation,
        "story_id": story_id,
        "ticker": ticker,
        "version": version,
        "event_id": None if snapshot or operation == "dropped" else f"evt_{epoch}_{seq}",
        "reload_round": 1 if operation == "dropped" else None,
        "changed_at": AT,
    }
    if snapshot:
        body["snapshot"] = True
    if operation in ("saved", "notified"):
        body["story"] = {"id": story_id, "ticker": ticker, "version": version}
    if merged_into is not None:
        body["merged_into"] = merged_into
    return body


def marker(seq: int, operation: str, *, epoch: int, endpoint: str) -> dict[str, Any]:
    """A snapshot marker (the feed kind's, a stories endpoint's snapshot included)."""
    return feed(seq, operation, epoch=epoch, endpoint=endpoint)


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DOCS / name).read_text())
    return loaded
