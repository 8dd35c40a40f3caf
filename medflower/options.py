"""Run-config options: how one key is declared, coerced and checked.

Each key is declared once, as an ``Option``: the generic ones in ``medflower/config.py``, a method's own ones
on its strategy class (``options``), next to the code that reads them. ``config.py`` collects them all for
validation, ``pyproject.toml``'s defaults check and the generated docs/run-config.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Check = Callable[[Any], "str | None"]


class ConfigError(ValueError):
    """A run-config value is unknown, out of range or does not fit the rest of the run config."""


def bad(key: str, value: Any, why: str) -> ConfigError:
    """The one error format: the key, the bad value and what is valid."""
    return ConfigError(f"run-config '{key}' = {value!r} is invalid: {why}")


# ---------------------------------------------------------------------------
# Checks: each returns None when fine, else a short reason.
def positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def non_negative(v: float) -> str | None:
    return None if v >= 0 else "must be >= 0"


def unit_interval_open_left(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def fraction_below_one(v: float) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def in_range(low: float, high: float) -> Check:
    """A check that accepts ``low`` <= v <= ``high`` (an upper bound keeps a typo from becoming an allocation error on
    the sites)."""

    def check(v: float) -> str | None:
        if low <= v <= high:
            return None
        side = ("must be > 0" if low == 1 else f"must be >= {low:g}") if v < low else f"must be <= {high:g}"
        return f"{side} (valid range [{low:g}, {high:g}])"

    return check


def one_of(*choices: str) -> Check:
    """A check that accepts exactly ``choices``; the generated docs list them."""

    def check(v: str) -> str | None:
        return None if v in choices else "valid choices are " + ", ".join(choices)

    check.choices = choices  # type: ignore[attr-defined]
    return check


def parsed(parse: Callable[[str], Any]) -> Check:
    """A check that runs the parser the code reading the key uses (the same one on server and sites) and returns
    the parser's ValueError as its reason."""

    def check(v: str) -> str | None:
        try:
            parse(v)
        except ValueError as exc:
            return str(exc)
        return None

    return check


@dataclass(frozen=True)
class Option:
    """One run-config key: its default (whose type is the key's type), help text, check and docs group."""

    key: str
    default: Any
    help: str
    check: Check | None = None
    group: str = "run"
    parse: Callable[[Any], Any] | None = None  # own coercion (raises ValueError with the reason) instead of the type's

    @property
    def attr(self) -> str:
        """The attribute name on ExperimentConfig: the key with '-' -> '_'."""
        return self.key.replace("-", "_")

    @property
    def choices(self) -> tuple[str, ...]:
        return getattr(self.check, "choices", ())

    def value(self, raw: Any) -> Any:
        """``raw`` coerced to the option's type and checked, or ConfigError naming the key."""
        value = self._coerce(raw)
        if self.check is not None and (why := self.check(value)):
            raise bad(self.key, value, why)
        return value

    def _coerce(self, value: Any) -> Any:
        if self.parse is not None:
            try:
                return self.parse(value)
            except ValueError as e:
                raise bad(self.key, value, str(e)) from None
        want = type(self.default)
        if want is bool:
            if isinstance(value, bool):
                return value
            raise bad(self.key, value, "must be true or false")
        if want is int:
            if isinstance(value, bool) or not (
                isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            ):
                raise bad(self.key, value, "must be an integer")
            return int(value)
        if want is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(self.key, value, "must be a number")
            if not math.isfinite(value):
                raise bad(self.key, value, "must be a finite number")
            return float(value)
        if not isinstance(value, str):
            raise bad(self.key, value, "must be a string (quote it: key='value')")
        return value
