"""Typed values from plain ones: the one parser behind configs, mechanism options,
experiment settings and benchmark sizes.

A dataclass is filled from a nested mapping (YAML, JSON, a checkpoint) by `from_dict`, each
value checked against its field's annotation by `coerce`; `key=value` text (the command
line) becomes nested mapping entries through `parse_key_value` / `apply_overrides`. Unknown
keys and values of the wrong type raise ConfigError naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any, Literal, Union

import yaml

from memattn.errors import ConfigError


def field_types(cls) -> dict[str, Any]:
    """The resolved annotation of each field of dataclass `cls`."""
    return typing.get_type_hints(cls)


def coerce(key: str, value: Any, annotation: Any, owner: type | None = None) -> Any:
    """Convert `value` to the type `annotation` (a field's annotation) or raise ConfigError.

    A string annotation is resolved against dataclass `owner`. tuple[X, ...] takes a
    non-empty list; a dataclass takes a mapping (through `from_dict`).
    """
    if isinstance(annotation, str) and owner is not None:
        annotation = field_types(owner)[key.rsplit(".", 1)[-1]]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is tuple and args[1:] == (Ellipsis,):
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"{key}: expected a list of {getattr(args[0], '__name__', args[0])} "
                              f"like [a,b], got {value!r}")
        return tuple(coerce(key, v, args[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(coerce(key, v, a) for v, a in zip(value, args))
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(annotation, value, key)
    raise ConfigError(f"{key}: cannot read a value of type {annotation}")


def from_dict(cls, data: dict[str, Any], prefix: str = "", *, name: str | None = None):
    """Build dataclass `cls` from a nested mapping, checking every key and type.

    prefix: the key path of `data` in error messages; name: what `cls` is called there when
    the prefix is empty (default: the class name). A class may read its own mapping with a
    classmethod `from_mapping(data, prefix)`.
    """
    if hasattr(cls, "from_mapping"):
        return cls.from_mapping(data, prefix)
    hints = field_types(cls)
    values = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        if key not in hints or key.startswith("_"):
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"{full}: unknown key of {prefix or name or cls.__name__} (known: {known})")
        values[key] = coerce(full, value, hints[key])
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{prefix or name or cls.__name__}: {e}") from None


def parse_key_value(text: str) -> tuple[list[str], Any]:
    """'model.d_model=128' -> (['model', 'd_model'], 128); values are read as YAML scalars
    (so `[256,1024]` is a list, `true` a bool, `1e-3` a number)."""
    if "=" not in text:
        raise ConfigError(f"{text}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def set_path(data: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """data[path[0]][path[1]]... = value in place, making sections as needed; returns the
    innermost section."""
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value
    return node


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of the nested mapping `data` with each `key=value` set in it."""
    data = copy.deepcopy(data)
    for text in overrides:
        set_path(data, *parse_key_value(text))
    return data


def parse_settings(cls, overrides: list[str], base: dict[str, Any] | None = None, *, name: str):
    """Dataclass `cls` (called `name` in messages) from the mapping `base` (e.g. quick
    values) and `key=value` overrides, every key and type checked."""
    return from_dict(cls, apply_overrides(dict(base or {}), list(overrides)), name=name)
