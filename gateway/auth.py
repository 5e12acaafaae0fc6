"""Bearer tokens on the public API: who is calling, checked in constant time.

Plain Python (no grpc, no HTTP). A token table maps secret tokens to client identities; the
identity names the caller in the per-client limits (gateway/router.py) and in logs. The
table is read from a file, one `TOKEN CLIENT` pair per line (`#` starts a comment; blank
lines are skipped), which is how a Kubernetes secret mounted as a file arrives. `env:NAME`
reads the same text from the environment variable NAME (a secret exposed as an
environment variable).

Every presented token is compared with every known token through `hmac.compare_digest` over
their SHA-256 digests, so neither the time taken nor an early exit tells an attacker how
much of a token matched, or which entry it was closest to.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

# Shortest token accepted: a guessable token is no authentication.
MIN_TOKEN_CHARS = 16


class Unauthenticated(Exception):
    """The caller presented no token, or one the table does not hold."""


@dataclass(frozen=True)
class TokenTable:
    """Known tokens (as SHA-256 digests) and the client each one names."""

    entries: tuple[tuple[bytes, str], ...]

    @classmethod
    def parse(cls, text: str, source: str = "tokens") -> TokenTable:
        """Parse `TOKEN CLIENT` lines. ValueError naming `source` and the line number for a
        line without both parts, a token shorter than MIN_TOKEN_CHARS, a token listed twice,
        or a table with no token at all."""
        entries, seen = [], set()
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{source}: line {number}: expected `TOKEN CLIENT`")
            token, client = parts
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(f"{source}: line {number}: the token is shorter than "
                                 f"{MIN_TOKEN_CHARS} characters")
            digest = hashlib.sha256(token.encode()).digest()
            if digest in seen:
                raise ValueError(f"{source}: line {number}: the token is listed twice")
            seen.add(digest)
            entries.append((digest, client))
        if not entries:
            raise ValueError(f"{source}: no token in it")
        return cls(tuple(entries))

    @classmethod
    def load(cls, where: str) -> TokenTable:
        """Read the table from a file path, or from an environment variable as `env:NAME`.
        ValueError when it cannot be read or parsed."""
        if where.startswith("env:"):
            name = where[4:]
            if name not in os.environ:
                raise ValueError(f"--auth-tokens: the environment variable {name} is not set")
            return cls.parse(os.environ[name], f"--auth-tokens {where}")
        try:
            with open(where, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--auth-tokens: cannot read {where}: {exc}") from None
        return cls.parse(text, f"--auth-tokens {where}")

    def client(self, token: str) -> str:
        """The client `token` names. Raises Unauthenticated for an unknown token."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, client in self.entries:  # no early exit: every entry costs the same
            if hmac.compare_digest(digest, known) and found is None:
                found = client
        if found is None:
            raise Unauthenticated("the bearer token is not valid")
        return found

    def authenticate(self, authorization: str | None) -> str:
        """The client of an `Authorization: Bearer TOKEN` header value (gRPC metadata
        `authorization` or the HTTP header). Raises Unauthenticated without a valid one."""
        if not authorization:
            raise Unauthenticated("a bearer token is required (`authorization: Bearer TOKEN`)")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the authorization is not `Bearer TOKEN`")
        return self.client(token.strip())
