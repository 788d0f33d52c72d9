"""Tenancy in process (issue 21, items 2, 7, 8): one constant-time key lookup for tenants and
admins, salts no client value can reach and no outsider can compute, per-tenant store bounds.
The same on real processes: test_tenancy_e2e.py."""

from __future__ import annotations

import hashlib
import hmac
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv.protocol.errors import APIError
from agentkv.router.config import RouterConfig
from agentkv.router.memory_store import MemoryStore
from agentkv.router.store import Bound, StoredHandle
from agentkv.router.tenancy import (
    ANONYMOUS,
    Caller,
    KeyTable,
    Tenancy,
    derived_salt,
    effective_salt,
    kept_secret,
)

BACKENDS = {"upstream": {"prefill": [{"url": "http://p:1"}], "decode": [{"url": "http://d:1"}]}}
TENANTS = [
    {"name": "a", "api_keys": ["sk-a-1", "sk-a-2"]},
    {"name": "b", "api_keys": ["sk-b"], "cache_salt": "b-fixed"},
    {"name": "s", "api_keys": ["sk-s"], "share_prefix_cache": True},
]
ADMINS = ["sk-admin-1", "sk-admin-2"]
OLD_FIXED_KEY = "agentkv-tenant-salt-v1"  # what an unset salt_secret used to mean


def config(store: dict[str, int] | None = None, **tenancy: object) -> RouterConfig:
    """With :data:`TENANTS`, and ``tenancy``'s and ``store``'s fields."""
    return RouterConfig.model_validate(
        {**BACKENDS, "tenancy": {"tenants": TENANTS, **tenancy}, "store": store or {}}
    )


# -- item 8: one constant-time lookup for tenant and admin keys ----------------------------------
def test_every_key_resolves_to_its_tenant_or_admin():
    tenancy = Tenancy(config(salt_secret="s" * 32, admin_api_keys=ADMINS))
    a = Caller("a", derived_salt("a", "s" * 32))
    assert tenancy.tenant_for("Bearer sk-a-1") == a == tenancy.tenant_for("bearer  sk-a-2 ")
    assert tenancy.tenant_for("Bearer sk-b") == Caller("b", "b-fixed")
    assert tenancy.tenant_for("Bearer sk-s") == Caller("s", shares=True)
    for key in ADMINS:
        assert tenancy.is_admin(f"Bearer {key}")
        with pytest.raises(APIError) as info:  # an admin key is not a tenant's
            tenancy.tenant_for(f"Bearer {key}")
        assert info.value.status == 401
    for key in ("sk-a-1", "sk-b", "sk-s"):
        assert not tenancy.is_admin(f"Bearer {key}")
    # near misses: prefixes, extensions, case, other schemes, nothing
    for header in (
        "Bearer sk-a-",
        "Bearer sk-a-1x",
        "Bearer SK-A-1",
        "Bearer sk-admin-",
        "Basic sk-a-1",
        "sk-a-1",
        "Bearer ",
        "",
        None,
    ):
        with pytest.raises(APIError):
            tenancy.tenant_for(header)
        assert not tenancy.is_admin(header)


def test_without_tenants_every_key_is_the_anonymous_tenant_and_admins_still_resolve():
    tenancy = Tenancy(
        RouterConfig.model_validate({**BACKENDS, "tenancy": {"admin_api_keys": ADMINS}})
    )
    for header in (None, "Bearer anything", "Bearer sk-admin-1"):
        assert tenancy.tenant_for(header) == ANONYMOUS
    assert tenancy.is_admin("Bearer sk-admin-2") and not tenancy.is_admin("Bearer sk-admin-")


def test_the_key_table_holds_digests_not_keys():
    """The lookup is a dict keyed by SHA-256 digests: what a caller's timing can depend on is
    its own token's digest, never a comparison against a key's characters."""
    table = KeyTable([("sk-secret-key", ADMIN_CALLER), ("", ANONYMOUS)])
    stored = vars(table)["_by_digest"]
    assert list(stored) == [hashlib.sha256(b"sk-secret-key").digest()]  # "" is never a key
    assert table.get("sk-secret-key") is ADMIN_CALLER
    assert table.get("") is None and table.get("sk-secret-ke") is None


ADMIN_CALLER = Caller("", admin=True)


# -- item 2: salts no client value can reach ------------------------------------------------------
def test_a_sharing_tenants_client_salt_never_reaches_a_tenant_namespace():
    tenancy = Tenancy(config(salt_secret="s" * 32))
    a, b, s = (tenancy.tenant_for(f"Bearer {k}") for k in ("sk-a-1", "sk-b", "sk-s"))
    assert a.salt is not None and b.salt == "b-fixed"
    assert s.cache_salt(None) is None  # unsalted: shared with the other sharing tenants
    for probe in (a.salt, b.salt, f"{a.salt}:x", "shared", "akv-0"):
        sent = s.cache_salt(probe)
        assert sent == f"shared:{probe}"
        assert sent not in (a.salt, b.salt, a.cache_salt("x"), b.cache_salt("x"))
    # a salted tenant sending another's salt stays in its own namespace
    assert b.cache_salt(a.salt) == f"b-fixed:{a.salt}"
    assert ANONYMOUS.cache_salt("mine") == "mine"


_SALT_TEXT = st.text(
    st.characters(blacklist_characters="@/\\\x00", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=128,
)
_TENANT_SALT = st.text(
    st.characters(blacklist_characters="@/\\\x00:", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=96,
).filter(lambda salt: salt != "shared")


@given(tenant_salt=_TENANT_SALT, mine=_SALT_TEXT, theirs=st.none() | _SALT_TEXT)
def test_no_sharing_client_salt_equals_any_salted_namespace(tenant_salt, mine, theirs):
    shared = effective_salt(None, mine, shares=True)
    assert shared is not None and shared.startswith("shared:") and len(shared) <= 128
    assert shared != effective_salt(tenant_salt, theirs)


# -- item 2: salts nobody computes without the secret ---------------------------------------------
def test_an_unset_secret_is_generated_once_and_kept(tmp_path):
    path = tmp_path / "state" / "salt_secret"
    salt = Tenancy(config(), secret_file=path).tenant_for("Bearer sk-a-1").salt
    kept = path.read_text().strip()
    assert len(kept) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert salt == derived_salt("a", kept)
    # not what the name alone (under the old fixed key) gives, and another host differs
    assert salt != derived_salt("a", OLD_FIXED_KEY)
    other = Tenancy(config(), secret_file=tmp_path / "elsewhere" / "salt_secret")
    assert other.tenant_for("Bearer sk-a-1").salt != salt
    # a restart (or another router on this host) derives the same
    assert Tenancy(config(), secret_file=path).tenant_for("Bearer sk-a-1").salt == salt
    # a configured secret wins and the kept one is not read
    configured = Tenancy(config(salt_secret="c" * 32), secret_file=tmp_path / "unused")
    assert configured.tenant_for("Bearer sk-a-1").salt == derived_salt("a", "c" * 32)
    assert not (tmp_path / "unused").exists()


def test_no_secret_is_kept_when_no_salt_is_derived(tmp_path):
    tenants = [t for t in TENANTS if t["name"] != "a"]
    cfg = RouterConfig.model_validate({**BACKENDS, "tenancy": {"tenants": tenants}})
    Tenancy(cfg, secret_file=tmp_path / "salt_secret")
    assert not (tmp_path / "salt_secret").exists()


def test_routers_starting_together_keep_one_secret(tmp_path):
    path = tmp_path / "salt_secret"
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(kept_secret(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["salt_secret"]  # no temporary file left


def test_an_unusable_kept_secret_stops_the_start(tmp_path):
    path = tmp_path / "salt_secret"
    path.write_text("short\n")
    with pytest.raises(ValueError, match="delete it"):
        Tenancy(config(), secret_file=path)


def test_the_default_salt_secret_path_is_the_user_state_dir(tmp_path, monkeypatch):
    from agentkv.router.tenancy import secret_path

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert secret_path() == Path(tmp_path) / "agentkv" / "salt_secret"


def test_derived_salts_are_hmac_of_the_name():
    expected = hmac.new(b"k" * 32, b"team-a", hashlib.sha256).hexdigest()[:32]
    assert derived_salt("team-a", "k" * 32) == f"akv-{expected}"


# -- item 7: isolation is the default -------------------------------------------------------------
def _handle(n: int) -> StoredHandle:
    return StoredHandle(
        params={"remote_request_id": f"req-{n}", "remote_block_ids": [[n]]},
        block_hashes=bytes([n % 256]) * 16,
        tail_tokens=[],
        num_tokens=16,
        block_size=16,
        epoch=0,
        decode_url="http://d:1",
    )


def test_with_tenants_each_gets_an_equal_share_by_default():
    assert config({"max_entries": 10}).tenant_bound == 3
    assert config({"max_entries": 2}).tenant_bound == 1
    assert config({"max_entries_per_tenant": 7}).tenant_bound == 7
    assert RouterConfig.model_validate(BACKENDS).tenant_bound is None


@pytest.mark.anyio
async def test_a_full_memory_store_evicts_from_the_tenant_holding_most(anyio_backend):
    """Even with per-tenant bounds that add up to more than the store (overcommitted by
    configuration), a tenant within its share is never evicted by another."""
    evictions: list[tuple[str, Bound]] = []
    store = MemoryStore(
        max_entries=6,
        max_entries_per_tenant=5,
        per_conversation=1,
        on_evict=lambda tenant, bound: evictions.append((tenant, bound)),
    )
    for i in range(3):
        assert await store.put(("quiet", f"q{i}"), _handle(100 + i), 60) == []
    displaced = []
    for i in range(10):
        displaced += await store.put(("noisy", f"n{i}"), _handle(i), 60)
    # the store is full at 6: the noisy tenant, holding the most, loses its oldest
    assert [h.params["remote_request_id"] for h in displaced] == [f"req-{i}" for i in range(7)]
    assert evictions == [("noisy", "store")] * 7
    for i in range(3):
        assert await store.take(("quiet", f"q{i}")) is not None
    # room again: the noisy tenant grows to its own bound (5), then evicts its own
    displaced = []
    for i in range(10, 13):
        displaced += await store.put(("noisy", f"n{i}"), _handle(i), 60)
    assert [h.params["remote_request_id"] for h in displaced] == ["req-7"]
    assert evictions[7:] == [("noisy", "tenant")]
