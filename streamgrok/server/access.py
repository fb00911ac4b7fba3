"""Who may use the server: the API key (bearer header or `?token=`) and the Origin allow-list,
the same rules for websockets and HTTP."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping


class Access:
    """Checks a request's credentials and Origin against the server's configuration."""

    def __init__(self, api_key: str | None, origins: Iterable[str]) -> None:
        """`api_key`: one key, or several separated by commas (each client's own)."""
        self.api_key = api_key
        self.keys = [key.strip() for key in (api_key or "").split(",") if key.strip()]
        self.origins = {origin.rstrip("/") for origin in origins}

    def authorized(self, headers: Mapping[str, str], query: Mapping[str, str]) -> bool:
        """True without an API key, else when `Authorization: Bearer KEY` or `?token=KEY`
        carries one of the keys."""
        return self.principal(headers, query) is not None

    def principal(self, headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
        """The key a request carries when it is one of the server's ("" when the server has
        none), else None."""
        if not self.keys:
            return ""
        header = headers.get("authorization", "")
        offered = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        offered = offered or query.get("token", "")
        matches = [hmac.compare_digest(offered.encode(), key.encode()) for key in self.keys]
        return offered if any(matches) else None

    def origin_allowed(self, headers: Mapping[str, str]) -> bool:
        """Requests without an Origin (not from a browser) pass; a browser's must be listed."""
        origin = headers.get("origin")
        return origin is None or origin.rstrip("/") in self.origins
