"""Which content format a chat template expects (vLLM ``_detect_content_format``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2
import jinja2.nodes

from agentkv.chat.environment import environment

__all__ = ["ContentFormat", "detect_content_format"]

ContentFormat = Literal["string", "openai"]
"""vLLM's two content formats: ``"string"`` joins text parts; ``"openai"`` keeps a list."""


# --------------------------------------------------------------------------------------------
# Content format detection (vLLM ``_detect_content_format``): "openai" when the template loops
# over a message's content.

_N = jinja2.nodes


@lru_cache(maxsize=32)
def detect_content_format(source: str) -> ContentFormat:
    """``"openai"`` when the template iterates over ``message['content']`` (directly, through
    an alias, or through a macro parameter), else ``"string"``; unparsable templates are
    ``"string"``. This is vLLM's AST probe for ``--chat-template-content-format auto``."""
    try:
        ast = environment().parse(source)
        next(_content_loops(ast))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"


def _is_var(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, _N.Name):
        return node.ctx == "load" and node.name == varname
    if isinstance(node, _N.Getattr) and "." in varname:  # `ns.rest`
        base, _, attr = varname.rpartition(".")
        return node.attr == attr and _is_var(node.node, base)
    return False


def _is_attr(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, _N.Getitem):
        return (
            _is_var(node.node, varname) and isinstance(node.arg, _N.Const) and node.arg.value == key
        )
    if isinstance(node, _N.Getattr):
        return _is_var(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, _N.Filter):
        return node.node is not None and _is_var_or_elems(node.node, varname, key)
    if isinstance(node, _N.Test):
        return _is_var_or_elems(node.node, varname, key)
    if isinstance(node, _N.Getitem) and isinstance(node.arg, _N.Slice):
        return _is_var_or_elems(node.node, varname, key)
    return _is_attr(node, varname, key) if key else _is_var(node, varname)


def _dotted_name(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, _N.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, _N.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, _N.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases_of(root: jinja2.nodes.Template, varname: str) -> Iterator[str]:
    """``varname`` and every variable assigned from it (breadth first)."""
    yield varname
    seen = {varname}
    pending = deque([varname])
    while pending:
        related = pending.popleft()
        for assign in root.find_all(_N.Assign):
            lhs, rhs = assign.target, assign.node
            if isinstance(lhs, _N.Name) and _is_var_or_elems(rhs, related):
                yield lhs.name
                if lhs.name != related and lhs.name not in seen:
                    seen.add(lhs.name)
                    pending.append(lhs.name)
            aliases: list[str] = []
            if (
                isinstance(lhs, _N.Name)
                and isinstance(rhs, _N.Call)
                and isinstance(rhs.node, _N.Name)
                and rhs.node.name == "namespace"
            ):
                aliases = [
                    f"{lhs.name}.{kw.key}"
                    for kw in rhs.kwargs
                    if _is_var_or_elems(kw.value, related)
                ]
            elif isinstance(lhs, (_N.Getattr, _N.NSRef)) and _is_var_or_elems(rhs, related):
                dotted = _dotted_name(lhs)
                aliases = [dotted] if dotted is not None else []
            for alias in aliases:
                yield alias
                if alias != related and alias not in seen:
                    seen.add(alias)
                    pending.append(alias)


def _message_loops(root: jinja2.nodes.Template) -> Iterator[str]:
    """Loop variables of ``{% for message in messages %}``-like loops."""
    names = list(_aliases_of(root, "messages"))
    for loop in root.find_all(_N.For):
        for varname in names:
            if _is_var_or_elems(loop.iter, varname):
                if not isinstance(loop.target, _N.Name):
                    raise TypeError("unexpected loop target")
                yield loop.target.name
                break


def _content_loops(root: jinja2.nodes.Template) -> Iterator[str]:
    """Loop variables of loops over a message's content (or a macro parameter bound to it)."""
    message_names = list(_message_loops(root))
    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(_N.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(_N.Call):
            if not (isinstance(call.node, _N.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                    _is_var_or_elems(arg, v, "content") for v in message_names
                ):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if (
                    isinstance(kw, _N.Keyword)
                    and kw.key in param_names
                    and any(_is_var_or_elems(kw.value, v, "content") for v in message_names)
                ):
                    content_params.add(kw.key)
        for loop in macro.find_all(_N.For):
            loops_in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params

    for loop in root.find_all(_N.For):
        target = loop.target
        if any(_is_var_or_elems(loop.iter, v, "content") for v in message_names):
            if not isinstance(target, _N.Name):
                raise TypeError("unexpected loop target")
            yield target.name
            continue
        params = params_by_loop.get(id(loop))
        if isinstance(loop.iter, _N.Name) and (
            (params is not None and loop.iter.name in params)
            or (id(loop) not in loops_in_macros and loop.iter.name == "content")
        ):
            if not isinstance(target, _N.Name):
                raise TypeError("unexpected loop target")
            yield target.name
