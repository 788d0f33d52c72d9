"""The router's one configuration model: nested groups from a file, the environment and flags in
one precedence (flags > environment > file > defaults), and the flat keys, environment names
and flags of before the groups mapped onto them (deprecated keys with a warning naming the new
key)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.router.config import RouterConfig
from agentkv.router.config_legacy import FLAT_KEYS
from agentkv.router.settings import ENV_ALIASES, env_name, load_settings

ENGINES = {
    "prefill": [{"url": "http://127.0.0.1:8100"}],
    "decode": [{"url": "http://127.0.0.1:8200"}],
}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [*os.environ]:
        if name.startswith("AGENTKV_ROUTER_") or name in ENV_ALIASES:
            monkeypatch.delenv(name)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    engines = '[[upstream.prefill]]\nurl = "http://127.0.0.1:8100"\n'
    engines += '[[upstream.decode]]\nurl = "http://127.0.0.1:8200"\n'
    path.write_text(text + "\n" + engines)
    return path


def test_every_flat_key_maps_onto_an_existing_field_of_its_group() -> None:
    for old, (group, field) in FLAT_KEYS.items():
        sub = RouterConfig.model_fields[group].annotation
        assert field in sub.model_fields, (old, group, field)  # type: ignore[union-attr]


def test_a_flat_file_key_maps_with_a_warning_naming_the_new_key(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text(
        'store = "memory"\nstore_max_entries = 7\nport = 9100\npaths = "choose"\n'
        'keep_token_identity = false\n[[prefill]]\nurl = "http://127.0.0.1:8100"\n'
        '[[decode]]\nurl = "http://127.0.0.1:8200"\n'
    )
    with pytest.warns(DeprecationWarning) as caught:
        config = load_settings(path)
    said = {str(w.message) for w in caught}
    assert (
        "router configuration key 'store_max_entries' is deprecated: use 'store.max_entries'"
        in said
    )
    assert "router configuration key 'store' is deprecated: use 'store.backend'" in said
    assert "router configuration key 'paths' is deprecated: use 'paths.mode'" in said
    assert (
        "router configuration key 'keep_token_identity' is deprecated: use 'identity.keep'" in said
    )
    assert (config.store.backend, config.store.max_entries, config.http.port) == ("memory", 7, 9100)
    assert config.paths.mode == "choose" and config.identity.keep is False
    assert [b.url for b in config.upstream.prefill] == ["http://127.0.0.1:8100"]


def test_a_flat_key_in_code_maps_too_and_the_new_key_wins() -> None:
    with pytest.warns(DeprecationWarning, match="'retries' is deprecated: use 'upstream.retries'"):
        config = RouterConfig.model_validate({"upstream": {**ENGINES, "retries": 5}, "retries": 1})
    assert config.upstream.retries == 5


def test_nested_keys_give_no_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_settings(_toml(tmp_path, '[store]\nbackend = "memory"\nmax_entries = 9'))
    assert config.store.max_entries == 9


def test_unknown_keys_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"store\.max_entires"):
        load_settings(_toml(tmp_path, "[store]\nmax_entires = 9"))


def test_precedence_flags_over_environment_over_file_over_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, "[upstream]\nretries = 3\n[http]\nport = 9001\nmax_headers = 50")
    monkeypatch.setenv(env_name("http", "port"), "9002")
    monkeypatch.setenv(env_name("upstream", "retries"), "4")
    config = load_settings(path, {"http": {"port": 9003}})
    assert config.http.port == 9003  # flag over environment
    assert config.upstream.retries == 4  # environment over file
    assert config.http.max_headers == 50  # file over default
    assert config.http.host == "127.0.0.1"  # default
    assert [b.url for b in config.upstream.decode] == ["http://127.0.0.1:8200"]  # groups merge


def test_environment_takes_json_for_lists_null_for_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTKV_ROUTER_UPSTREAM__PREFILL", json.dumps(ENGINES["prefill"]))
    monkeypatch.setenv("agentkv_router_upstream__decode", json.dumps(ENGINES["decode"]))
    monkeypatch.setenv("AGENTKV_ROUTER_RETENTION__KV_PRESSURE_WATERMARK", "null")
    monkeypatch.setenv("AGENTKV_ROUTER_IDENTITY__KEEP", "false")
    config = load_settings()
    assert len(config.upstream.decode) == 1
    assert config.retention.kv_pressure_watermark is None and config.identity.keep is False


def test_an_old_environment_name_is_an_alias_below_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, '[tenancy]\nsalt_secret = "from-file"')
    monkeypatch.setenv("AGENTKV_SALT_SECRET", "from-alias")
    assert load_settings(path).tenancy.salt_secret == "from-alias"
    monkeypatch.setenv(env_name("tenancy", "salt_secret"), "from-new-name")
    assert load_settings(path).tenancy.salt_secret == "from-new-name"


def test_flags_old_spellings_and_the_file(tmp_path: Path) -> None:
    """The CLI's flags set the nested fields, its old flags too; an invalid value is refused
    naming the flag's field (the router never starts)."""
    path = _toml(tmp_path, "[http]\nport = 9001")
    runner = CliRunner()
    cli = app
    for argv, expected in [
        (["--http-port", "0"], "http.port"),
        (["--port", "0"], "http.port"),
        (["--decoder-kv-blocks-ttl", "10"], "retention.ttl_margin_s (30) must be below"),
        (["--retention-decoder-kv-blocks-ttl-s", "10"], "retention.ttl_margin_s (30)"),
        (["--store-max-entries", "0"], "store.max_entries"),
        (["--paths-mode", "sideways"], "'sideways'"),
    ]:
        r = runner.invoke(cli, ["router", "--config", str(path), *argv])
        assert r.exit_code == 2, (argv, r.output)
        assert expected in r.output, (argv, r.output)
    r = runner.invoke(cli, ["router"])
    assert r.exit_code == 2
    assert "--prefill URL (or upstream.prefill in --config): required" in r.output


def test_an_old_flat_file_key_is_reported_by_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text('retries = -1\n[[prefill]]\nurl = "http://127.0.0.1:8100"\n')
    r = CliRunner().invoke(app, ["router", "--config", str(path)])
    assert r.exit_code == 2
    assert "'retries' is deprecated: use 'upstream.retries'" in r.output
    assert "upstream.retries: Input should be greater than or equal to 0" in r.output


def test_the_cli_reads_the_environment_below_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTKV_ROUTER_STORE__MAX_ENTRIES", "0")
    r = CliRunner().invoke(app, ["router", "--prefill", "http://p:1", "--decode", "http://d:2"])
    assert r.exit_code == 2 and "store.max_entries: Input should be greater" in r.output
    argv = ["router", "--store-max-entries", "5", "--http-port", "0"]
    r = CliRunner().invoke(app, argv)  # the flag wins: only the port is wrong
    assert r.exit_code == 2 and "store.max_entries" not in r.output and "http.port" in r.output


def test_help_lists_the_flags_by_group_with_each_fields_docstring() -> None:
    output = CliRunner().invoke(app, ["router", "--help"], env={"COLUMNS": "200"}).output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())
    for group, info in RouterConfig.model_fields.items():
        assert f"{group}: {info.description}" in text, group
    assert "--store-backend" in text and "Also --store." in text
    assert "--upstream-prefill-deadline-s" in text
    assert "How long the breaker stays open before one call probes the store again." in text
