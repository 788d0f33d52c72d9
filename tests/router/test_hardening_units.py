"""The pieces behind docs/reliability.md, in process: log escaping, tenant salts, coercion."""

from __future__ import annotations

import logging

import orjson
import pytest
from pydantic import ValidationError

from agentkv.protocol.errors import APIError
from agentkv.router.config import RouterConfig, Tenant
from agentkv.router.logs import JsonFormatter, SafeFormatter, safe
from agentkv.router.request import parse_request
from agentkv.router.tenancy import ANONYMOUS, Caller, Tenancy, derived_salt, effective_salt

BACKENDS = {"upstream": {"prefill": [{"url": "http://p:1"}], "decode": [{"url": "http://d:1"}]}}


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("agentkv.router", logging.INFO, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_safe_escapes_every_control_character():
    assert safe("a\nb\rc\td\x1b[31m\x00\x7f\x85\u2028") == (
        "a\\nb\\rc\\td\\x1b[31m\\x00\\x7f\\x85\\u2028"
    )
    assert safe("ok: ünïcode") == "ok: ünïcode"
    assert safe("x" * 2000).endswith("…") and len(safe("x" * 2000)) == 1025


def test_text_formatter_keeps_one_record_on_one_line():
    line = SafeFormatter("%(levelname)s %(message)s").format(_record("conv=%s", "a\nERROR b"))
    assert line == "INFO conv=a\\nERROR b"


def test_json_formatter_writes_one_object_with_extra_fields():
    line = JsonFormatter().format(_record("turn %s", "a\nb", conversation_id="a\nb"))
    assert "\n" not in line
    data = orjson.loads(line)
    assert data["msg"] == "turn a\nb" and data["conversation_id"] == "a\nb"
    assert data["level"] == "INFO" and data["logger"] == "agentkv.router"


def test_tenant_salts_are_derived_deterministically_and_never_collide():
    a, b = derived_salt("team-a", "s"), derived_salt("team-b", "s")
    assert a != b and a == derived_salt("team-a", "s") != derived_salt("team-a", "other")
    assert a.startswith("akv-") and len(a) == 36 and ":" not in a
    assert effective_salt(None, "c") == "c" and effective_salt(a, None) == a
    assert effective_salt(a, "c") == f"{a}:c"
    long = effective_salt(a, "c" * 128)
    assert long is not None and len(long) <= 128 and long.startswith(f"{a}:")
    # B can never send its way into A's namespace
    assert effective_salt(b, a) != a


def test_tenant_salt_options():
    cfg = RouterConfig.model_validate(
        {
            **BACKENDS,
            "tenancy": {
                "salt_secret": "s",
                "tenants": [
                    {"name": "a", "api_keys": ["ka"]},
                    {"name": "b", "api_keys": ["kb"], "cache_salt": "fixed"},
                    {"name": "c", "api_keys": ["kc"], "share_prefix_cache": True},
                ],
            },
        }
    )
    tenancy = Tenancy(cfg)
    assert tenancy.tenant_for("Bearer ka") == Caller("a", derived_salt("a", "s"))
    assert tenancy.tenant_for("Bearer kb") == Caller("b", "fixed")
    assert tenancy.tenant_for("Bearer kc") == Caller("c", shares=True)
    with pytest.raises(APIError):
        tenancy.tenant_for("Bearer nope")
    anonymous = RouterConfig.model_validate(BACKENDS)
    assert Tenancy(anonymous).tenant_for(None) == ANONYMOUS


@pytest.mark.parametrize(
    "tenant",
    [
        {"cache_salt": "x", "share_prefix_cache": True},
        {"cache_salt": "a:b"},
        {"cache_salt": "a/b"},
        {"cache_salt": ""},
        {"cache_salt": "x" * 97},
        {"cache_salt": "shared"},
    ],
)
def test_bad_tenant_salts_are_refused(tenant):
    with pytest.raises(ValidationError):
        Tenant.model_validate({"name": "t", "api_keys": ["k"], **tenant})


def test_admin_keys_are_not_tenant_keys_and_metrics_port_is_its_own():
    tenants = [{"name": "a", "api_keys": ["k"]}]
    with pytest.raises(ValidationError):
        RouterConfig.model_validate(
            {**BACKENDS, "tenancy": {"tenants": tenants, "admin_api_keys": ["k"]}}
        )
    with pytest.raises(ValidationError):
        RouterConfig.model_validate({**BACKENDS, "http": {"port": 9000, "metrics_port": 9000}})


def _parse(body: dict[str, object], headers: dict[str, str] | None = None, chat: bool = True):
    cfg = RouterConfig.model_validate(BACKENDS)
    return parse_request(orjson.dumps(body), headers or {}, chat=chat, config=cfg)


def test_the_body_carries_the_validated_values():
    messages = [{"role": "user", "content": "hi"}]
    req = _parse(
        {
            "messages": messages,
            "stream": "false",
            "max_tokens": "7",
            "return_token_ids": "1",
            "stream_options": {"include_usage": "0"},
        }
    )
    assert req.body["stream"] is False and req.stream is False
    assert req.body["max_tokens"] == 7 and req.wants_token_ids is True
    assert req.body["stream_options"] == {"include_usage": False}
    assert _parse({"messages": messages, "stream": "on"}).stream is True


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"prompt": [1, 2**63]}, {}),
        ({"prompt": [[2**64 - 1]]}, {}),
        ({"prompt": [1], "max_tokens": 2**64 - 1}, {}),
        ({"prompt": [1]}, {"x-agentkv-epoch": "9" * 40}),
        ({"prompt": [1]}, {"x-agentkv-epoch": "1_0"}),
        ({"prompt": [1], "cache_salt": "a/b"}, {}),
        ({"prompt": [1], "stream": "nah"}, {}),
    ],
)
def test_absurd_values_are_400(body, headers):
    with pytest.raises(APIError) as info:
        _parse(body, headers, chat=False)
    assert info.value.status == 400


def test_int64_epochs_are_accepted():
    assert (
        _parse({"prompt": [1]}, {"x-agentkv-epoch": str(2**63 - 1)}, chat=False).epoch == 2**63 - 1
    )


@pytest.mark.parametrize(
    "ids",
    [
        [1, True],
        [False],
        [1, -1],
        [-(2**31)],
        [2**31],
        [2**31 - 1, 2**32],
        [1, 2.0],
        [1, "2"],
        [1, None],
        [[1]],
        [],
        "1 2",
    ],
)
def test_exact_ids_are_refused_unless_every_one_is_a_token_id(ids: object) -> None:
    """Checked without a Python loop over the ids (issue 23), as strictly as before."""
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(APIError) as e:
        _parse({"messages": messages, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert e.value.status == 400


def test_exact_ids_keep_their_json_and_bytes() -> None:
    messages = [{"role": "user", "content": "hi"}]
    ids = [0, 5, 2**31 - 1, 151_643]
    req = _parse({"messages": messages, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert req.prompt_ids == ids
    assert req.prompt_ids is not None and orjson.dumps({"p": req.prompt_ids.wire}) == (
        b'{"p":[0,5,2147483647,151643]}'
    )
    assert req.prompt_ids.data == b"".join(i.to_bytes(4, "little") for i in ids)
