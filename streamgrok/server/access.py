"""Who may use the server: the API key (bearer header or `?token=`) and the Origin allow-list,
the same rules for websockets and HTTP."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping


class Access:
    """Checks a request's credentials and Origin against the server's configuration."""

    def __init__(self, api_key: str | None, origins: Iterable[str]) -> None:
        self.api_key = api_key
        self.origins = {origin.rstrip("/") for origin in origins}

    def authorized(self, headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
        """True without an API key, else when `Authorization: Bearer KEY` or `?token=KEY`
        carries it."""
        if not self.api_key:
            return True
        header = headers.get("authorization", "")
        offered = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        offered = offered or query.get("token", "")
        return hmac.compare_digest(offered.encode(), self.api_key.encode())

    def origin_allowed(self, headers: Mapping[str, str]) -> bool:
        """Requests without an Origin (not from a browser) pass; a browser's must be listed."""
        origin = headers.get("origin")
        return origin is None or origin.rstrip("/") in self.origins
