"""API keys -> principals. Keys are never stored: only their ``sha256:`` hashes.

Sources of keys, merged into one :class:`KeyStore`:

* the fleet config's ``tenants`` (hashes, allowed features, admin flag);
* ``TIDAL_ADMIN_KEY`` -- the operator's admin key;
* ``TIDAL_DEV_API_KEY`` -- the development tenant ``dev`` (all features), set by ``tidal up``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.api.errors import APIError
from tidal.fleet import FleetConfig, hash_api_key

__all__ = ["KeyStore", "Principal", "bearer_principal"]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a tenant, the features it may use (``"*"`` = all) and whether it is an admin."""

    tenant: str
    features: frozenset[str]
    admin: bool = False

    def may_use(self, feature: str) -> bool:
        return "*" in self.features or feature in self.features

    @property
    def default_feature(self) -> str | None:
        """The feature used when a request names none: the tenant's only one, if it has exactly one."""
        named = sorted(self.features - {"*"})
        return named[0] if len(named) == 1 else None


class KeyStore:
    """Looks up a presented key by its hash; the plain key never leaves this function."""

    def __init__(self) -> None:
        self._by_hash: dict[str, Principal] = {}

    def add_hash(self, key_hash: str, principal: Principal) -> None:
        self._by_hash[key_hash] = principal

    def add_key(self, key: str, principal: Principal) -> None:
        self.add_hash(hash_api_key(key), principal)

    def lookup(self, key: str) -> Principal | None:
        return self._by_hash.get(hash_api_key(key))

    def __len__(self) -> int:
        return len(self._by_hash)

    @classmethod
    def from_fleet(
        cls, fleet: FleetConfig, *, admin_key: str | None = None, dev_key: str | None = None
    ) -> KeyStore:
        store = cls()
        for t in fleet.tenants:
            principal = Principal(t.name, frozenset(t.features or ["*"]), admin=t.admin)
            for h in t.key_hashes:
                store.add_hash(h, principal)
        if admin_key:
            store.add_key(admin_key, Principal("admin", frozenset({"*"}), admin=True))
        if dev_key:
            store.add_key(dev_key, Principal("dev", frozenset({"*"})))
        return store


def bearer_principal(keys: KeyStore, authorization: str) -> Principal:
    """The caller named by an ``Authorization: Bearer <key>`` header value; an OpenAI-shaped 401
    (:class:`~api.errors.APIError`) when the header is missing, malformed or the key unknown."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
    principal = keys.lookup(key.strip())
    if principal is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return principal
