"""One namespace for ``--set`` and ``--sweep``: every settings field and every profile key.

A name is looked up in the profile's parameters first (``prefill_ms_per_token``,
``acceptance_rate_spread``...), then in ``SimSettings`` (``max_num_seqs``, ``output_spread``...);
values are parsed to the parameter's type and checked like the profile file or the CLI.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from dpsim.costmodel import PARAMETERS, CostProfile, ProfileError, with_values
from dpsim.settings import SETTINGS_FIELDS, SimSettings, problems

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


class ParamError(ValueError):
    """A parameter name or value that cannot be used (the message says why)."""


def known_names() -> list[str]:
    return sorted(PARAMETERS) + sorted(SETTINGS_FIELDS)


def _parse(name: str, text: str, kind: Any) -> Any:
    optional = False
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        optional, kind = True, args[0]
    if optional and text.lower() in {"none", "null", ""}:
        return None
    try:
        if kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is Path:
            return Path(text)
        return text
    except ValueError:
        raise ParamError(f"{name}: expected {kind.__name__}, got {text!r}") from None


def apply(settings: SimSettings, profile: CostProfile, assignments: dict[str, str]) -> tuple[SimSettings, CostProfile]:
    """``settings`` and ``profile`` with ``name -> text`` assignments applied and checked."""
    profile_values: dict[str, Any] = {}
    settings_values: dict[str, Any] = {}
    hints = typing.get_type_hints(SimSettings)
    for name, text in assignments.items():
        if name in PARAMETERS:
            profile_values[name] = _parse(name, text, PARAMETERS[name][0])
        elif name in SETTINGS_FIELDS:
            settings_values[name] = _parse(name, text, hints[name])
        else:
            raise ParamError(f"unknown parameter {name!r}; known: {', '.join(known_names())}")
    if profile_values:
        try:
            profile = with_values(profile, profile_values, "--set/--sweep")
        except ProfileError as exc:
            raise ParamError(str(exc)) from None
    if settings_values:
        settings = dataclasses.replace(settings, **settings_values)
        found = problems(settings)
        if found:
            raise ParamError("; ".join(found))
    return settings, profile


def parse_assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ParamError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def parse_sweep(text: str) -> tuple[str, list[str]]:
    name, values = parse_assignment(text)
    listed = [v.strip() for v in values.split(",") if v.strip()]
    if not listed:
        raise ParamError(f"--sweep {name}: give at least one value (NAME=v1,v2,...)")
    return name, listed
