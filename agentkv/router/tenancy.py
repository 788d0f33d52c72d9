"""Who sends a request (its API key's tenant, or an admin) and which prefix-cache namespace
(``cache_salt``) its turns get.

**Keys.** Every tenant's and admin's key is in one table keyed by the SHA-256 of the key. A
lookup hashes the presented token (time depends on its length only) and finds its digest in a
dict: whatever timing that lookup shows depends on the *digest* of what the caller sent, which
tells nothing about any key's characters (learning that a guess's digest shares bytes with a
key's digest does not bring the guess closer to the key). So the lookup is constant-time in the
keys' content, for tenant and admin keys alike, and costs the same with 3 keys or 30 000.

**Namespaces.** A tenant's salt is its configured ``cache_salt`` or ``akv-`` + HMAC-SHA256 of its
name under ``tenancy.salt_secret``; neither can contain ``:``. What reaches the engines
(:func:`effective_salt`):

- a salted tenant: its salt, or ``<salt>:<client cache_salt>``;
- a sharing tenant (``share_prefix_cache``): nothing (the engines' unsalted cache, shared), or
  ``shared:<client cache_salt>``; ``shared`` is refused as a configured salt and a derived salt
  starts with ``akv-``, so no client value of a sharing tenant equals any salted tenant's
  namespace or any other tenant's configured salt;
- no tenants configured (one anonymous tenant): the client's ``cache_salt`` as sent.

**The secret.** With tenants whose salt is derived and no ``tenancy.salt_secret`` (nor
``AGENTKV_SALT_SECRET``), a random secret is generated once and kept, mode 0600, in
``salt_secret`` under the user's state directory (platformdirs: ``$XDG_STATE_HOME/agentkv`` on
Linux), so restarts and router replicas on the same host derive the same salts. Replicas on
other hosts would generate their own (their turns would then miss each other's prefix caches
and handles: lost reuse, never a wrong read): a warning says to configure one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agentkv.protocol.errors import APIError
from agentkv.router.config import SHARED_NAMESPACE, RouterConfig

__all__ = [
    "ADMIN",
    "ANONYMOUS",
    "Caller",
    "KeyTable",
    "Tenancy",
    "bearer",
    "derived_salt",
    "effective_salt",
    "kept_secret",
    "secret_path",
]

log = logging.getLogger("agentkv.router")

_MAX_SALT = 128  # vLLM's limit on cache_salt
_MIN_KEPT_SECRET = 32


@dataclass(frozen=True)
class Caller:
    """What an API key identifies."""

    tenant: str
    salt: str | None = None
    """The tenant's prefix-cache namespace (``None``: a sharing tenant, or no tenants)."""
    shares: bool = False
    """``share_prefix_cache``: the unsalted cache, client salts under ``shared:``."""
    admin: bool = False

    def cache_salt(self, client_salt: str | None) -> str | None:
        """The ``cache_salt`` the engines get for a request carrying ``client_salt``."""
        return effective_salt(self.salt, client_salt, shares=self.shares)


ANONYMOUS = Caller("default")
"""Every request when no tenants are configured."""
ADMIN = Caller("", admin=True)


def bearer(authorization: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ("" without one)."""
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return ""


def derived_salt(tenant: str, secret: str) -> str:
    """A tenant's default ``cache_salt``: ``akv-`` + HMAC-SHA256 of its name under ``secret``,
    128 bits in hex."""
    return "akv-" + hmac.new(secret.encode(), tenant.encode(), hashlib.sha256).hexdigest()[:32]


def _join(namespace: str, client_salt: str) -> str:
    combined = f"{namespace}:{client_salt}"
    if len(combined) <= _MAX_SALT:
        return combined
    return f"{namespace}:h-{hashlib.sha256(client_salt.encode()).hexdigest()[:32]}"


def effective_salt(
    tenant_salt: str | None, client_salt: str | None, *, shares: bool = False
) -> str | None:
    """The ``cache_salt`` the engines get (see the module docstring): the tenant's salt, then the
    client's own after a ``:`` (hashed when the two would pass vLLM's 128 characters); a sharing
    tenant's client salt under ``shared:``; with neither, the client's salt as sent."""
    if shares:
        return None if client_salt is None else _join(SHARED_NAMESPACE, client_salt)
    if tenant_salt is None:
        return client_salt
    if client_salt is None:
        return tenant_salt
    return _join(tenant_salt, client_salt)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyTable:
    """API keys to callers, looked up by the keys' SHA-256 (see the module docstring)."""

    def __init__(self, entries: Iterable[tuple[str, Caller]]) -> None:
        self._by_digest = {_digest(key): caller for key, caller in entries if key}

    def get(self, token: str) -> Caller | None:
        return self._by_digest.get(_digest(token)) if token else None


def secret_path() -> Path:
    """Where a generated ``tenancy.salt_secret`` is kept: the file ``salt_secret`` in the user's
    state directory."""
    import platformdirs

    return Path(platformdirs.user_state_dir("agentkv", appauthor=False)) / "salt_secret"


def kept_secret(path: Path) -> str:
    """The secret kept in ``path``, generated (32 random bytes, mode 0600) when there is none.

    Processes starting together agree: the new secret is written to a private file and linked
    into place, which fails for all but the first; the others read the winner's."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another process kept one first
                os.link(tmp, path)
        finally:
            tmp.unlink()
    secret = path.read_text().strip()
    if len(secret) < _MIN_KEPT_SECRET:
        raise ValueError(
            f"{path} holds no usable salt secret (fewer than {_MIN_KEPT_SECRET} characters): "
            "delete it to have a new one generated, or set tenancy.salt_secret"
        )
    return secret


class Tenancy:
    """The configured tenants' and admins' keys, each tenant's namespace computed once.

    ``secret_file``: where to keep a generated secret (default :func:`secret_path`); read only
    when some tenant's salt is derived and ``tenancy.salt_secret`` is unset. Raises ``OSError`` or
    ``ValueError`` (at start-up) when that file cannot be made or read."""

    def __init__(self, config: RouterConfig, *, secret_file: Path | None = None) -> None:
        self.enabled = bool(config.tenancy.tenants)
        secret = config.tenancy.salt_secret
        derives = [
            t for t in config.tenancy.tenants if t.cache_salt is None and not t.share_prefix_cache
        ]
        if derives and secret is None:
            path = secret_file or secret_path()
            secret = kept_secret(path)
            log.warning(
                "tenancy.salt_secret is not set: tenant salts are derived from the secret kept "
                "in %s (the same for every restart and router on this host). Router replicas on "
                "other hosts need the same secret: set tenancy.salt_secret (or "
                "AGENTKV_SALT_SECRET) on all of them",
                path,
            )
        entries: list[tuple[str, Caller]] = []
        for tenant in config.tenancy.tenants:
            if tenant.share_prefix_cache:
                caller = Caller(tenant.name, shares=True)
            else:
                if tenant.cache_salt is not None:
                    caller = Caller(tenant.name, tenant.cache_salt)
                else:
                    assert secret is not None  # resolved above: this tenant derives its salt
                    caller = Caller(tenant.name, derived_salt(tenant.name, secret))
            entries += [(key, caller) for key in tenant.api_keys]
        entries += [(key, ADMIN) for key in config.tenancy.admin_api_keys]
        self._keys = KeyTable(entries)

    def caller(self, authorization: str | None) -> Caller | None:
        """Whom an ``Authorization`` header's key identifies (``None``: no known key)."""
        return self._keys.get(bearer(authorization))

    def tenant_for(self, authorization: str | None) -> Caller:
        """The tenant of an ``Authorization`` header; 401 when tenants are configured and the
        key is not a tenant's. Without tenants: :data:`ANONYMOUS`, whatever the key."""
        if not self.enabled:
            return ANONYMOUS
        caller = self.caller(authorization)
        if caller is None or caller.admin:
            raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>).")
        return caller

    def is_admin(self, authorization: str | None) -> bool:
        """Whether the header carries one of ``tenancy.admin_api_keys``."""
        caller = self.caller(authorization)
        return caller is not None and caller.admin
