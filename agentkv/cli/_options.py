"""typer options generated from a pydantic model's fields, so that a new field of a config model
is a new flag with no CLI edit.

Each field ``name`` becomes ``--name`` in kebab case with the field's default (a bool that
defaults to true: the switch ``--no-name`` that turns it off, whose name may be changed) and, for
help, the CLI's short text for it if it has one, else the first sentence of the field's
``description`` (a model with ``use_attribute_docstrings`` takes it from the attribute docstring).
A ``Literal`` is passed as a string (the model validates it, so the error names the choices); a
nested model, ``dict`` or ``list`` as JSON; a field with a ``default_factory`` (a random id) is
unset unless given.

A model of groups (``RouterConfig``: each field a model) gives ``--GROUP-FIELD`` options
(:func:`group_parameters`), unset unless given so that a file and the environment show through,
under one help heading per group; :func:`group_values` nests what was given.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from agentkv.cli._common import single_command

__all__ = [
    "Flag",
    "group_parameters",
    "group_values",
    "model_command",
    "model_values",
    "option_name",
    "with_model_options",
]

F = TypeVar("F", bound=Callable[..., Any])
_SCALARS = (bool, int, float, str)
_OFF = "no_"  # the parameter of a --no-NAME switch: no_NAME
_ALIAS = "alias_"  # the parameter of an old name of a group's field: alias_GROUP__NAME


@dataclass(frozen=True)
class Flag:
    """What the CLI says about one field beyond the model: a shorter help text, more names,
    and for a bool that defaults to true the switch that turns it off instead of
    ``--no-NAME``."""

    help: str | None = None
    aliases: tuple[str, ...] = ()
    off: str | None = None


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _plain(doc: str) -> str:
    text = " ".join(doc.split())
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"\1", text)
    return text.replace("``", "")


def _first_sentence(text: str) -> str:
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.\s", text)
    return text[: match.start() + 1] if match else text


def _shape(annotation: Any) -> tuple[type, bool, tuple[str, ...], bool]:
    """(the type typer parses, whether None is allowed, a Literal's choices, whether JSON)."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else Any
        origin = typing.get_origin(annotation)
    if origin is Literal:
        return str, optional, tuple(str(a) for a in typing.get_args(annotation)), False
    if annotation in _SCALARS:
        return annotation, optional, (), False
    return str, optional, (), True  # a model, dict, list, union: JSON


def _help(name: str, flag: Flag, description: str | None) -> str:
    if flag.help is not None:
        return flag.help
    return _first_sentence(_plain(description or "")) or f"{name.replace('_', ' ')}."


def _param_name(prefix: str, name: str) -> str:
    return f"{prefix}__{name}" if prefix else name


def model_parameters(
    model: type[BaseModel],
    flags: Mapping[str, Flag],
    *,
    skip: tuple[str, ...] = (),
    prefix: str = "",
    unset: bool = False,
    panel: str | None = None,
) -> list[inspect.Parameter]:
    """One keyword-only parameter per field of ``model`` (those in ``skip`` left out). With a
    ``prefix`` (a group of a nested model): ``--PREFIX-NAME``, parameter ``PREFIX__NAME``. With
    ``unset``: every option is unset unless given (so a file's or the environment's value shows
    through), the model's default in its help."""
    unknown = set(flags) - set(model.model_fields)
    if unknown:
        raise ValueError(f"flags for fields {model.__name__} does not have: {sorted(unknown)}")
    params = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag = flags.get(name, Flag())
        long = f"{prefix}_{name}" if prefix else name
        kind, optional, choices, is_json = _shape(info.annotation)
        help_text = _help(name, flag, info.description)
        if choices and flag.help is None:
            help_text = f"{help_text} ({' | '.join(choices)})"
        if info.default_factory is not None:
            default: Any = None
        elif info.default is PydanticUndefined:
            default = ...
        else:
            default = info.default
        aliases = flag.aliases
        if unset and aliases:  # hidden options of their own: the help's names stay one a line
            help_text = f"{help_text} Also {', '.join(aliases)}."
            aliases = ()
        if unset and default not in (None, ...) and not (kind is bool and not optional):
            help_text = f"{help_text} [default: {default}]"
            default = None
        param = _param_name(prefix, name)
        if kind is bool and not optional:
            # a switch, as vLLM's and the old hand-written flags are: typer's --x/--no-x pair
            # takes a second column that squeezes every flag's name in an 80-column help
            if default is True:
                param, default = _OFF + param, False
                decls = [flag.off or f"--no-{long.replace('_', '-')}", *aliases]
                if flag.help is None:
                    help_text = f"Turn off {long}: {help_text}"
            else:
                decls = [option_name(long), *aliases]
            option = typer.Option(*decls, help=help_text, show_default=False, rich_help_panel=panel)
            shown: Any = bool
        else:
            decls = [option_name(long), *aliases]
            option = typer.Option(
                *decls,
                help=help_text,
                metavar="JSON" if is_json else None,
                rich_help_panel=panel,
            )
            shown = kind | None if (optional or default is None) else kind
        params.append(
            inspect.Parameter(
                param,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=Annotated[shown, option],
            )
        )
        if aliases != flag.aliases:
            hidden = typer.Option(*flag.aliases, hidden=True, show_default=False)
            params.append(
                inspect.Parameter(
                    _ALIAS + param,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=default,
                    annotation=Annotated[shown, hidden],
                )
            )
    return params


def _groups(model: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """The fields of ``model`` that are models themselves: its groups."""
    out = {}
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out[name] = kind
    return out


def group_parameters(
    model: type[BaseModel], flags: Mapping[str, Flag], *, skip: tuple[str, ...] = ()
) -> list[inspect.Parameter]:
    """The options of a model of groups (``RouterConfig``): ``--GROUP-FIELD`` for each field of
    each group, unset unless given, listed under the group's heading. ``flags`` and ``skip``
    name fields ``GROUP.FIELD``."""
    groups = _groups(model)
    unknown = {k.split(".", 1)[0] for k in [*flags, *skip]} - set(groups)
    if unknown:
        raise ValueError(f"flags for groups {model.__name__} does not have: {sorted(unknown)}")
    params = []
    for group, sub in groups.items():
        own = {k.split(".", 1)[1]: f for k, f in flags.items() if k.startswith(group + ".")}
        mine = tuple(k.split(".", 1)[1] for k in skip if k.startswith(group + "."))
        about = _plain(model.model_fields[group].description or "")
        panel = f"{group}: {about}" if about else group
        params += model_parameters(sub, own, skip=mine, prefix=group, unset=True, panel=panel)
    return params


def with_model_options(
    model: type[BaseModel],
    flags: Mapping[str, Flag],
    *,
    skip: tuple[str, ...] = (),
    extra: Callable[..., Any] | None = None,
    groups: bool = False,
) -> Callable[[F], F]:
    """Decorate a ``**values`` command so that typer sees one option per field of ``model``
    (``groups``: per field of each of its groups, :func:`group_parameters`), then ``extra``'s
    parameters (options that are not fields)."""
    make = group_parameters if groups else model_parameters
    params = make(model, flags, skip=skip)
    if extra is not None:
        hints = typing.get_type_hints(extra, include_extras=True)
        for p in inspect.signature(extra).parameters.values():
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name]))

    def decorate(func: F) -> F:
        func.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        func.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
        return func

    return decorate


def model_command(
    name: str,
    help: str,
    run: Callable[..., None],
    model: type[BaseModel],
    flags: Mapping[str, Flag],
    **options: Any,
) -> Any:
    """The click command ``name`` (its help ``help``) that calls ``run(**values)`` with one option
    per field of ``model`` (``options``: :func:`with_model_options`'s); ``run`` is left as it is."""

    def command(**values: Any) -> None:
        run(**values)

    command.__doc__ = help
    return single_command(name, with_model_options(model, flags, **options)(command))


def model_values(
    model: type[BaseModel], values: Mapping[str, Any], *, prefix: str = ""
) -> dict[str, Any]:
    """The options that set fields of ``model``, as the model takes them: unset (None) ones left
    out, so the model's defaults apply; JSON ones parsed (ValueError naming the flag)."""
    import json

    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        param = _param_name(prefix, name)
        kind, optional, _, is_json = _shape(info.annotation)
        switch = bool(prefix) and kind is bool and not optional  # False: a group's switch not given
        given = (values.get(param), values.get(_ALIAS + param))
        value = next((v for v in given if v is not None and not (switch and v is False)), None)
        if values.get(_OFF + param) or values.get(_ALIAS + _OFF + param):  # --no-NAME
            value = False
        if value is None:
            continue
        if is_json and isinstance(value, str):
            flag = option_name(f"{prefix}_{name}" if prefix else name)
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{flag} is not valid JSON: {exc}") from exc
        out[name] = value
    return out


def group_values(model: type[BaseModel], values: Mapping[str, Any]) -> dict[str, Any]:
    """The options of :func:`group_parameters` that were given, nested as the model takes
    them (``{"store": {"backend": …}}``)."""
    out = {}
    for group, sub in _groups(model).items():
        given = model_values(sub, values, prefix=group)
        if given:
            out[group] = given
    return out
