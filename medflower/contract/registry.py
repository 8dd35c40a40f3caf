"""The strategy registry: run-config ``strategy`` name -> strategy class.

A strategy registers itself with ``@register_strategy`` where it is defined (timm's ``register_model`` and
peft's ``register_peft_method`` work the same way); ``medflower/strategies/__init__.py`` imports every
method module, so importing ``medflower.strategies`` fills the registry.
"""

from __future__ import annotations

from typing import Any, TypeVar

S = TypeVar("S", bound=type)

STRATEGIES: dict[str, Any] = {}  # name -> a FederatedStrategy subclass (server.py; this module imports nothing)


def register_strategy(cls: S) -> S:
    """Class decorator: make ``cls`` selectable as ``strategy='<cls.name>'``.

    Refuses a class without a name or client half, a name already taken, and a run-config option whose key
    another registered strategy declares differently (each key is declared once).
    """
    name = getattr(cls, "name", "")
    if not name:
        raise TypeError(f"{cls.__qualname__} has no strategy name (set the class attribute 'name')")
    if name in STRATEGIES:
        raise ValueError(
            f"strategy name {name!r} is taken by {STRATEGIES[name].__module__}."
            f"{STRATEGIES[name].__qualname__}; {cls.__module__}.{cls.__qualname__} needs another name"
        )
    if getattr(cls, "client_half", None) is None:
        raise TypeError(f"strategy {name!r} ({cls.__qualname__}) names no client half (class attribute 'client_half')")
    declared = {o.key: (o, other) for other in STRATEGIES.values() for o in other.options}
    for option in cls.options:
        if option.key in declared and declared[option.key][0] is not option:
            other = declared[option.key][1]
            raise ValueError(
                f"strategy {name!r} declares run-config key {option.key!r}, which strategy "
                f"{other.name!r} declares differently; share the Option object instead"
            )
    STRATEGIES[name] = cls
    return cls


def strategies_with(fact: str) -> list[str]:
    """Names of the registered strategies whose class attribute ``fact`` is true, for error messages."""
    return [name for name, cls in STRATEGIES.items() if getattr(cls, fact)]


def strategies_with_dp(mode: str) -> list[str]:
    """Names of the registered strategies that allow client-level DP ``mode`` (their ``client_dp``), or DP-SGD
    (``mode='dp-sgd'``: their ``dp_sgd``)."""
    if mode == "dp-sgd":
        return [name for name, cls in STRATEGIES.items() if cls.dp_sgd]
    return [name for name, cls in STRATEGIES.items() if mode in cls.client_dp]
