"""The router's flat configuration keys of before the groups (deprecated; kept for one release).

:data:`FLAT_KEYS` maps each old key onto its group and field; :func:`migrate` moves the old keys
of a configuration's data there, with a :class:`DeprecationWarning` naming the new key. A value
under the new key wins over one under the old (it is the one a reader of the new docs set).
``store`` and ``paths`` were strings and are groups now: a string there is the old key
(``store.backend``, ``paths.mode``)."""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel

__all__ = ["FLAT_KEYS", "migrate"]

FLAT_KEYS: dict[str, tuple[str, str]] = {
    "prefill": ("upstream", "prefill"),
    "decode": ("upstream", "decode"),
    "block_size": ("upstream", "block_size"),
    "kv_recompute_threshold": ("upstream", "kv_recompute_threshold"),
    "prefill_deadline_s": ("upstream", "prefill_deadline_s"),
    "prefill_deadline_per_1k_tokens_s": ("upstream", "prefill_deadline_per_1k_s"),
    "request_timeout_s": ("upstream", "request_timeout_s"),
    "upstream_max_connections": ("upstream", "max_connections"),
    "upstream_keepalive_s": ("upstream", "keepalive_s"),
    "retries": ("upstream", "retries"),
    "health_interval_s": ("upstream", "health_interval_s"),
    "eject_after_failures": ("upstream", "eject_after_failures"),
    "affinity_max_outstanding_tokens": ("upstream", "affinity_max_in_flight"),
    "decode_first_byte_timeout_s": ("upstream", "decode_first_byte_timeout_s"),
    "decode_token_timeout_s": ("upstream", "decode_token_timeout_s"),
    "drain_timeout_s": ("upstream", "drain_timeout_s"),
    "max_drains": ("upstream", "max_drains"),
    "tokenize_with": ("upstream", "tokenize_with"),
    "store": ("store", "backend"),
    "store_max_entries": ("store", "max_entries"),
    "store_max_entries_per_tenant": ("store", "max_entries_per_tenant"),
    "handles_per_conversation": ("store", "handles_per_conversation"),
    "store_failures_to_open": ("store", "failures_to_open"),
    "store_open_s": ("store", "open_s"),
    "decoder_kv_blocks_ttl_s": ("retention", "decoder_kv_blocks_ttl_s"),
    "ttl_margin_s": ("retention", "ttl_margin_s"),
    "lease_check_interval_s": ("retention", "lease_check_interval_s"),
    "max_leases_per_tenant": ("retention", "max_leases_per_tenant"),
    "kv_pressure_watermark": ("retention", "kv_pressure_watermark"),
    "tenants": ("tenancy", "tenants"),
    "salt_secret": ("tenancy", "salt_secret"),
    "admin_api_keys": ("tenancy", "admin_api_keys"),
    "paths": ("paths", "mode"),
    "reuse_policy": ("paths", "reuse_policy"),
    "decode_max_new_tokens": ("paths", "decode_max_new_tokens"),
    "decode_tokens_in_flight": ("paths", "decode_tokens_in_flight"),
    "path_costs": ("paths", "costs"),
    "host": ("http", "host"),
    "port": ("http", "port"),
    "metrics_port": ("http", "metrics_port"),
    "max_body_bytes": ("http", "max_body_bytes"),
    "max_header_bytes": ("http", "max_header_bytes"),
    "max_headers": ("http", "max_headers"),
    "http_parser": ("http", "parser"),
    "log_format": ("http", "log_format"),
    "responses_ttl_s": ("responses", "ttl_s"),
    "responses_max_per_tenant": ("responses", "max_per_tenant"),
    "responses_max_bytes_per_tenant": ("responses", "max_bytes_per_tenant"),
    "keep_token_identity": ("identity", "keep"),
    "identity_max_tokens_per_conversation": ("identity", "max_tokens_per_conversation"),
    "identity_max_tokens": ("identity", "max_tokens"),
    "identity_ttl_s": ("identity", "ttl_s"),
}
"""Old flat key → (group, field)."""

_GROUPS = {group for group, _ in FLAT_KEYS.values()}


def _is_old(key: str, value: Any) -> bool:
    if key not in FLAT_KEYS:
        return False
    # "store" and "paths" name both an old key (a string) and a group (a table)
    return key not in _GROUPS or not isinstance(value, dict)


def migrate(data: dict[str, Any], *, stacklevel: int = 2) -> dict[str, Any]:
    """``data`` with each old flat key moved to its group (a new dict; ``data`` is unchanged),
    one DeprecationWarning per key moved."""
    if not any(_is_old(k, v) for k, v in data.items()):
        return data
    out: dict[str, Any] = {}
    moved: list[tuple[str, str, Any]] = []
    for key, value in data.items():
        if _is_old(key, value):
            group, field = FLAT_KEYS[key]
            moved.append((group, field, value))
            warnings.warn(
                f"router configuration key {key!r} is deprecated: use '{group}.{field}'",
                DeprecationWarning,
                stacklevel=stacklevel + 1,
            )
        else:
            out[key] = value
    for group, field, value in moved:
        table = out.get(group)
        if isinstance(table, BaseModel):  # a group given as its model
            table = table.model_dump(exclude_unset=True)
        table = dict(table) if isinstance(table, dict) else {}
        table.setdefault(field, value)
        out[group] = table
    return out
