"""API-key authentication: `Authorization: Bearer <key>`, compared in constant time.

Only SHA-256 digests of the keys are kept, so a key never sits in a replica's memory in the clear
after start-up, and no error message, log line or metric can contain one.

Example:
    >>> keys = ApiKeys.from_plaintext(["sk-local-1"])
    >>> keys.check("Bearer sk-local-1") is None
    True
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from moonserve.pipeline.api.errors import APIError


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class ApiKeys:
    digests: tuple[bytes, ...]

    @classmethod
    def from_plaintext(cls, keys: list[str]) -> ApiKeys:
        return cls(tuple(digest(k) for k in keys))

    def check(self, authorization: str | None) -> None:
        """Raises a 401 `APIError` unless the header carries one of the keys."""
        presented = bearer_key(authorization)
        if presented is None:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        candidate = digest(presented)
        # Compare against every key (no early exit), so timing says nothing about which matched.
        matched = False
        for known in self.digests:
            matched |= hmac.compare_digest(candidate, known)
        if not matched:
            raise unauthorized("invalid API key")


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header; None when there is none."""
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return None
    return presented.strip()


def client_id(authorization: str | None, address: str | None, keyed: bool) -> str:
    """Who a request counts against for rate limits: its API key's digest when the app checks
    keys (`keyed`), else the client's address. Never the key itself."""
    key = bearer_key(authorization) if keyed else None
    if key is not None:
        return "key:" + digest(key).hex()[:32]
    return f"address:{address or 'unknown'}"


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def keys_from_env(variable: str) -> list[str]:
    """Comma-separated keys from an environment variable (unset or empty: none)."""
    return [k.strip() for k in os.environ.get(variable, "").split(",") if k.strip()]
