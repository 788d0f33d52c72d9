"""The router's configuration from a file, the environment and flags, in one precedence:
flags > environment > file > defaults (pydantic-settings' sources, merged group by group).

The environment: ``AGENTKV_ROUTER_<GROUP>__<FIELD>`` (``AGENTKV_ROUTER_STORE__BACKEND``,
``AGENTKV_ROUTER_UPSTREAM__RETRIES``; lists and tables as JSON, ``null`` for None), and the
names documented before the groups (:data:`ENV_ALIASES`: ``AGENTKV_SALT_SECRET``), below the
new names. A file's old flat keys are mapped onto the groups
(:mod:`agentkv.router.config_legacy`, with a DeprecationWarning each)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from agentkv.router.config import RouterConfig, read_file
from agentkv.router.config_legacy import migrate

__all__ = ["ENV_ALIASES", "ENV_NESTED_DELIMITER", "ENV_PREFIX", "env_name", "load_settings"]

ENV_PREFIX = "AGENTKV_ROUTER_"
ENV_NESTED_DELIMITER = "__"
ENV_ALIASES: dict[str, tuple[str, str]] = {"AGENTKV_SALT_SECRET": ("tenancy", "salt_secret")}
"""Environment variables named before the groups → (group, field); the new name wins."""


def env_name(group: str, field: str) -> str:
    """``AGENTKV_ROUTER_STORE__BACKEND`` for ``store.backend``."""
    return f"{ENV_PREFIX}{group}{ENV_NESTED_DELIMITER}{field}".upper()


class _Aliases(PydanticBaseSettingsSource):
    """The environment variables of :data:`ENV_ALIASES` that are set."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything is in __call__

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (group, field) in ENV_ALIASES.items():
            value = os.environ.get(name)
            if value:
                out.setdefault(group, {})[field] = value
        return out


class RouterConfigSources(BaseSettings, RouterConfig):
    """:class:`RouterConfig` read by pydantic-settings: keyword arguments (the flags), then the
    environment, then :attr:`file_data`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        case_sensitive=False,
        env_parse_none_str="null",
        extra="forbid",
        use_attribute_docstrings=True,
    )
    file_data: ClassVar[dict[str, Any]] = {}
    """The file's data, lowest but the defaults (a subclass per file: :func:`load_settings`)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            _Aliases(settings_cls),
            InitSettingsSource(settings_cls, cls.file_data),
        )


def load_settings(
    path: str | Path | None = None, flags: Mapping[str, Any] | None = None
) -> RouterConfig:
    """The router's configuration: ``flags`` (nested: ``{"store": {"backend": …}}``) over the
    environment over the file at ``path`` (TOML, or JSON by its suffix) over the defaults."""
    file_data = migrate(read_file(path), stacklevel=2) if path is not None else {}
    settings = type("RouterConfigFromFile", (RouterConfigSources,), {"file_data": file_data})
    config: RouterConfig = settings(**dict(flags or {}))
    return config
