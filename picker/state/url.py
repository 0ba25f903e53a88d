"""`--state-store`: where the shared state lives, `redis://[user:pass@]host:port[/db]` or
`rediss://` for TLS; `--state-store-key`: which of the state it holds is this picker's."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

SCHEMES = ("redis", "rediss")
FORMAT = "redis://[user:pass@]host:port[/db] (or rediss:// for TLS)"
DEFAULT_PORT = 6379
_KEY = re.compile(r"[A-Za-z0-9._:/-]{1,200}")


@dataclass(frozen=True, slots=True)
class StoreUrl:
    """A checked state-store URL. `text` is as given (it may hold a password: log `redacted`)."""

    text: str
    tls: bool
    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    @property
    def redacted(self) -> str:
        """The URL without its password, for logs."""
        scheme = "rediss" if self.tls else "redis"
        user = f"{self.username or ''}:***@" if self.password else (f"{self.username}@" if self.username else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{user}{host}:{self.port}/{self.db}"


def parse_store_url(text: str) -> StoreUrl:
    """Check `text`; ValueError says what is wrong with it (never echoing a password)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        raise ValueError(f"expected {FORMAT}: the port is invalid") from None
    if parts.scheme not in SCHEMES:
        shown = f"{parts.scheme}://" if parts.scheme else "no scheme"
        raise ValueError(f"expected {FORMAT}, got {shown}")
    if not parts.hostname:
        raise ValueError(f"expected {FORMAT}: the host is missing")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"the database must be a number (redis://host:port/0), got /{path}")
    if parts.query or parts.fragment:
        raise ValueError(f"query parameters and fragments are not supported: expected {FORMAT}")
    return StoreUrl(
        text=text.strip(),
        tls=parts.scheme == "rediss",
        host=parts.hostname,
        port=port or DEFAULT_PORT,
        db=int(path or 0),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )


def parse_store_key(text: str) -> str:
    """Check a `--state-store-key`; ValueError says what is wrong with it."""
    if not _KEY.fullmatch(text):
        raise ValueError(f"expected 1 to 200 letters, digits and . _ : / -, got {text!r}")
    return text
