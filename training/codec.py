"""One JSON codec for the project's records: dataclasses to JSON-ready data and back.

Every record that crosses a file or a process goes through it: the run config (from
TOML), the training job's file, the job's summary and metrics records, and the
commands' `--json` reports. Decoding checks each field against its type hint and says
which key is wrong in one line (`training.batch_size: expected int, got str 'big'`).

- A bool is never a number, an int is taken for a float, a JSON list for a tuple.
- Dict keys are text in JSON; an `int`-keyed dict gets them back as integers.
- `X | Y` takes the first type the value fits; `Literal` values are checked.
- A class may define `normalised(raw) -> raw` (a classmethod), applied to its JSON form
  before the fields are checked: how a config turns what people write (ISO dates, "auto")
  into the values it holds, so the frozen dataclass never rewrites its own fields.
- A dict field with `metadata=FLATTENED` is written into its parent's object, and takes
  back the keys that are no field of the parent; one with `metadata=NOT_IN_JSON` is not
  written (text for people that the JSON form gives as data).

A record whose class derives from `Checked` is checked the same way when it is built: a
producer that hands a field the wrong type (an MLflow version number as an int where the
report says text) fails where it builds the record, in its tests, not later in front of a
user who decodes the JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

T = TypeVar("T")
FLATTENED = {"codec": "flattened"}
NOT_IN_JSON = {"codec": "not in JSON"}


class SchemaError(ValueError):
    """A record that does not match its dataclass: names the key and what is wrong."""


def encode(value: Any) -> Any:
    """`value` as JSON-ready data: dataclasses as objects (fields in order), tuples as
    lists, dict keys as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for field in dataclasses.fields(value):
            if field.metadata == NOT_IN_JSON:
                continue
            item = encode(getattr(value, field.name))
            if field.metadata == FLATTENED:
                out.update(item)
            else:
                out[field.name] = item
        return out
    if isinstance(value, Mapping):
        return {str(key): encode(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    return value


def dumps(value: Any, indent: int | None = None) -> str:
    return json.dumps(encode(value), indent=indent)


def loads(cls: type[T], text: str, where: str, strict: bool = False) -> T:
    """Decode `text` (one JSON object) as `cls`; `where` names it in errors (a file)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise SchemaError(f"{where}: not JSON ({error})") from None
    return decode(cls, data, where, strict=strict)


def decode(cls: type[T], data: Any, where: str = "", strict: bool = False) -> T:
    """An instance of dataclass `cls` from its JSON form, every field checked.

    `strict`: a key that is no field is an error (a config: a typo); otherwise it is
    ignored (a record: a newer writer may add some). Fields with a default may be left out.
    A `ValueError` of the class's own checks comes back as a `SchemaError` naming the key.
    """
    try:
        return _dataclass(cls, data, "", strict)
    except SchemaError as error:
        raise SchemaError(f"{where}: {error}" if where else str(error)) from None


def _dataclass(cls: type[T], data: Any, prefix: str, strict: bool) -> T:
    if not isinstance(data, dict):
        raise SchemaError(f"{prefix.rstrip('.') or cls.__name__}: expected a table, got {type(data).__name__}")
    normalise = getattr(cls, "normalised", None)
    if normalise is not None:
        try:
            data = normalise(dict(data))
        except ValueError as error:
            raise SchemaError(f"{prefix}{error}") from None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    spill = next((name for name, f in fields.items() if f.metadata == FLATTENED), None)
    unknown = sorted(set(data) - set(fields))
    if unknown and strict:
        raise SchemaError(f"{prefix}{unknown[0]}: unknown key (known keys here: {', '.join(sorted(fields))})")
    missing = [name for name, f in fields.items() if name not in data and name != spill and _required(f)]
    if missing:
        owner = f"{prefix.rstrip('.')}: " if prefix else ""
        raise SchemaError(f"{owner}{cls.__name__} is missing field(s) {', '.join(missing)}")
    values = {name: _value(hints[name], data[name], f"{prefix}{name}", strict)
              for name in fields if name in data and name != spill}  # fmt: skip
    if spill is not None:
        values[spill] = _value(hints[spill], {k: data[k] for k in unknown}, f"{prefix}{spill}", strict)
    try:
        return cls(**values)
    except ValueError as error:
        if isinstance(error, SchemaError):
            raise
        raise SchemaError(f"{prefix}{error}") from None


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _value(hint: Any, value: Any, key: str, strict: bool) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, value, f"{key}.", strict)  # type: ignore[arg-type]
    if hint is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise SchemaError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(typing.get_args(hint), value, key, strict)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise SchemaError(f"{key}: expected a table, got {type(value).__name__} {value!r}")
        return {_key(key_hint, name, key): _value(value_hint, item, f"{key}.{name}", strict)
                for name, item in value.items()}  # fmt: skip
    if origin in (tuple, list):
        item_hint = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        items = [_value(item_hint, item, f"{key}[{i}]", strict) for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    return _scalar(hint, value, key)


def _union(options: tuple[Any, ...], value: Any, key: str, strict: bool) -> Any:
    if value is None and type(None) in options:
        return None
    errors = []
    for option in (o for o in options if o is not type(None)):
        try:
            return _value(option, value, key, strict)
        except SchemaError as error:
            errors.append(error)
    raise errors[0] if len(errors) == 1 else SchemaError(f"{key}: {value!r} is none of {_names(options)}")


def _names(options: tuple[Any, ...]) -> str:
    """The types a value may take, for people: a `Literal`'s own values (`int | 'auto'`)."""
    return " | ".join(" | ".join(repr(v) for v in typing.get_args(o)) if typing.get_origin(o) is Literal
                      else getattr(o, "__name__", str(o)) for o in options)  # fmt: skip


def _key(hint: Any, name: Any, key: str) -> Any:
    """A dict key from JSON text: an integer back for an `int`-keyed dict."""
    if hint is int and isinstance(name, str):
        try:
            return int(name)
        except ValueError:
            raise SchemaError(f"{key}: key {name!r} is not an integer") from None
    return name


def _scalar(hint: type, value: Any, key: str) -> Any:
    # bool is a subclass of int in Python: `batch_size = true` must not pass as 1.
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, hint) and not (hint in (int, float) and isinstance(value, bool)):
        return value
    raise SchemaError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")


class Checked:
    """A dataclass mixin: every field is checked against its type hint when the record is
    built (no conversion: an int where text is due is a `SchemaError` naming the field)."""

    def __post_init__(self) -> None:
        cls = type(self)
        for name, hint in _field_hints(cls).items():
            problem = _mismatch(hint, getattr(self, name))
            if problem:
                raise SchemaError(f"{cls.__name__}.{name}: {problem}")


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def _mismatch(hint: Any, value: Any) -> str:
    """"" when `value` fits `hint` as built (a tuple or a list for either), else what is wrong."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return ""
    if dataclasses.is_dataclass(hint):
        return "" if isinstance(value, hint) else f"expected {hint.__name__}, got {type(value).__name__}"  # type: ignore[arg-type]
    if origin is Literal:
        return "" if value in typing.get_args(hint) else f"must be one of {list(typing.get_args(hint))}, got {value!r}"
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if any(not _mismatch(option, value) for option in options):
            return ""
        return f"expected {_names(options)}, got {type(value).__name__} {value!r}"
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            return f"expected a dict, got {type(value).__name__} {value!r}"
        for key, item in value.items():
            problem = _mismatch(key_hint, key) or _mismatch(value_hint, item)
            if problem:
                return f"[{key!r}]: {problem}"
        return ""
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return f"expected a list, got {type(value).__name__} {value!r}"
        item_hint = typing.get_args(hint)[0]
        for i, item in enumerate(value):
            problem = _mismatch(item_hint, item)
            if problem:
                return f"[{i}]: {problem}"
        return ""
    if hint is type(None):
        return "" if value is None else f"expected None, got {type(value).__name__} {value!r}"
    try:
        _scalar(hint, value, "")
    except SchemaError:
        return f"expected {hint.__name__}, got {type(value).__name__} {value!r}"
    return ""
