"""Prometheus families declared once, as class attributes (the router's and the simulator's).

A :class:`Family` holds what ``/metrics`` shows of one family (its name, help, labels and
buckets); :func:`build` makes every family of a class in one instance's registry, in the order
of declaration (the order ``/metrics`` lists them), and puts it on the instance. Reading one
afterwards is a plain instance-dict read (a family is a non-data descriptor), and its type is the
family's (``Counter``, ``Gauge``, ``Histogram``), checked by mypy.

Needs ``prometheus_client`` (the ``serve`` extra): ``agentkv.protocol`` does not import this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["Family", "build"]

M = TypeVar("M", bound=MetricWrapperBase)


class Family(Generic[M]):
    """One family: ``kind(name, doc, labels, registry=..., **options)`` in each instance."""

    def __init__(
        self, kind: type[M], name: str, doc: str, labels: Sequence[str] = (), **options: Any
    ) -> None:
        self.kind, self.name, self.doc, self.labels = kind, name, doc, tuple(labels)
        self.options = options
        self.attr = name

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @overload
    def __get__(self, obj: None, owner: type) -> Family[M]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> M: ...
    def __get__(self, obj: object, owner: type) -> Family[M] | M:
        if obj is None:
            return self
        raise AttributeError(f"{self.attr}: build() has not made this instance's metrics")


def build(obj: object, registry: CollectorRegistry, **instance: str) -> None:
    """Make each family of ``type(obj)`` in ``registry`` and set it on ``obj``.

    ``instance`` names the labels that tell this instance's series apart (the simulator's
    ``model_name`` and ``engine``): a family labelled by exactly those is set as that one series
    (its child); any other is set whole, for the class to take its children.
    """
    for attr, family in vars(type(obj)).items():
        if isinstance(family, Family):
            metric = family.kind(
                family.name, family.doc, family.labels, registry=registry, **family.options
            )
            if instance and family.labels == tuple(instance):
                metric = metric.labels(**instance)
            setattr(obj, attr, metric)
