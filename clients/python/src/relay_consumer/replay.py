"""The relay's stream API, for a tenant: replay (changes sent again) and resync (a new epoch).

Standard library only (``urllib``, run in a worker thread): a consumer needs two calls.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


class ReplayError(Exception):
    """The relay refused or failed the call (``status`` is None when it could not be reached)."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class ReplayAnswer:
    endpoint_id: str
    epoch: int
    from_change_seq: int
    #: The endpoint's last change when the replay was asked for.
    through_change_seq: int


@dataclass(frozen=True, slots=True)
class ResyncAnswer:
    endpoint_id: str
    epoch: int
    snapshot_items: int


class RelayApi:
    """``api_base_url`` such as ``http://127.0.0.1:8081``; ``token`` a tenant token."""

    def __init__(self, api_base_url: str, token: str, *, timeout_s: float = 10.0) -> None:
        self.base = api_base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    async def replay(self, endpoint_id: str, from_change_seq: int) -> ReplayAnswer:
        """``POST /v1/endpoints/{id}/replay``: the endpoint's changes from ``from_change_seq`` of
        its current epoch go to the queue again, under their own message ids."""
        body = await self._call(
            "POST",
            f"/v1/endpoints/{endpoint_id}/replay",
            {"from_change_seq": from_change_seq},
        )
        return ReplayAnswer(
            endpoint_id=str(body["webhook_endpoint_id"]),
            epoch=int(body["epoch"]),
            from_change_seq=int(body["from_change_seq"]),
            through_change_seq=int(body["through_change_seq"]),
        )

    async def resync(self, endpoint_id: str) -> ResyncAnswer:
        """``POST /v1/endpoints/{id}/resync``: a new epoch opened by a snapshot of the copy."""
        body = await self._call("POST", f"/v1/endpoints/{endpoint_id}/resync", None)
        return ResyncAnswer(
            endpoint_id=str(body["webhook_endpoint_id"]),
            epoch=int(body["epoch"]),
            snapshot_items=int(body["snapshot_items"]),
        )

    async def get(self, path: str) -> Any:
        """A GET of the tenant's API (e.g. ``/v1/endpoints/{id}/copy``), its JSON answer."""
        return await self._call("GET", path, None)

    async def _call(self, method: str, path: str, payload: object) -> Any:
        return await asyncio.to_thread(self._call_blocking, method, path, payload)

    def _call_blocking(self, method: str, path: str, payload: object) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method)
        request.add_header("authorization", f"Bearer {self.token}")
        request.add_header("accept", "application/json")
        if data is not None:
            request.add_header("content-type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            raise ReplayError(
                f"{method} {path}: {error.code} {text[:500]}", error.code, text
            ) from None
        except (urllib.error.URLError, OSError) as error:
            raise ReplayError(f"{method} {path}: {error}") from None
        return json.loads(text) if text else None
