"""Typed configuration schemas: dataclasses validated once, up front, from nested mappings.

A schema is a dataclass whose annotations say what each key holds. :func:`from_dict` builds one
from a mapping (a YAML file loaded as plain dicts, or an omegaconf ``DictConfig``) and refuses,
with a :class:`ConfigError` whose message starts with the full dotted path of the offending key:

* a key the schema does not have, at any depth (listing the allowed keys, with a guess when the
  key looks like a typo of one of them);
* a missing required key (a field without a default);
* a value of the wrong type, by the annotation (see :func:`from_dict` for the rules);
* a value its field's ``check`` refuses (see :func:`setting` and the helpers :func:`positive`,
  :func:`non_negative`, :func:`in_range`, ...);
* whatever the dataclass's ``__post_init__`` refuses (cross-field rules): it raises
  ``ConfigError("local_key", "...")`` with the key relative to its own dataclass, and
  :func:`from_dict` prefixes the dataclass's path.

:func:`to_dict` turns a schema instance back into plain dicts and lists (to save it as YAML).

This module imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal, Union

__all__ = [
    "Check",
    "ConfigError",
    "all_of",
    "at_least",
    "each",
    "from_dict",
    "in_range",
    "join_path",
    "non_empty",
    "non_negative",
    "positive",
    "setting",
    "to_dict",
]

#: A value check: takes the (converted) value, returns None when it is fine, else what is wrong
#: (e.g. ``"must be > 0, got -1"``), without the key: the caller prefixes the path.
Check = Callable[[Any], "str | None"]

_MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A bad configuration value, ``"<path>: <message>"``.

    Attributes:
        path: the full dotted path of the offending key (``train_loader.dataset.split``, list
            items as ``sample_prompts[1]``), or ``""`` for the whole configuration.
        message: what is wrong and what is allowed, without the path.
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def with_prefix(self, prefix: str) -> "ConfigError":
        """The same error with ``prefix`` (a dataclass's path) put before its path."""
        if not prefix:
            return self
        return ConfigError(join_path(prefix, self.path) if self.path else prefix, self.message)

    def __reduce__(self):  # picklable (e.g. across processes), despite the two-argument constructor
        return (type(self), (self.path, self.message))


def join_path(prefix: str, key: str | int) -> str:
    """``prefix.key``, ``prefix[key]`` for a list index, or ``key`` alone at the top level."""
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    if not prefix:
        return key
    if key.startswith("["):
        return prefix + key
    return f"{prefix}.{key}"


# ----------------------------------------------------------------------------------- checks


def setting(
    default: Any = _MISSING,
    *,
    default_factory: Callable[[], Any] | Any = _MISSING,
    check: Check | None = None,
    doc: str | None = None,
) -> Any:
    """A dataclass field with a value ``check`` (and optional ``doc``) in its metadata.

    Without ``default`` and ``default_factory`` the key is required.
    """
    metadata = {}
    if check is not None:
        metadata["check"] = check
    if doc is not None:
        metadata["doc"] = doc
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def in_range(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_inclusive: bool = True,
    hi_inclusive: bool = True,
) -> Check:
    """A check that a number lies in ``[lo, hi]`` (brackets as the ``*_inclusive`` flags say).

    ``None`` leaves that side open. Values that are not numbers (``None``, a string such as
    ``"auto"``) pass, so the check combines with optional and union types.
    """
    if lo is None and hi is None:
        raise ValueError("in_range needs lo or hi")

    def check(value: Any) -> str | None:
        if not _is_number(value):
            return None
        low_ok = lo is None or (value >= lo if lo_inclusive else value > lo)
        high_ok = hi is None or (value <= hi if hi_inclusive else value < hi)
        if low_ok and high_ok:
            return None
        if hi is None:
            return f"must be {'>=' if lo_inclusive else '>'} {lo}, got {value!r}"
        if lo is None:
            return f"must be {'<=' if hi_inclusive else '<'} {hi}, got {value!r}"
        return (f"must be in {'[' if lo_inclusive else '('}{lo}, {hi}{']' if hi_inclusive else ')'}, "
                f"got {value!r}")

    return check


def at_least(lo: float) -> Check:
    """A check that a number is ``>= lo`` (non-numbers pass)."""
    return in_range(lo)


def positive(value: Any) -> str | None:
    """Check: a number must be > 0 (non-numbers pass)."""
    return in_range(0, lo_inclusive=False)(value)


def non_negative(value: Any) -> str | None:
    """Check: a number must be >= 0 (non-numbers pass)."""
    return in_range(0)(value)


def non_empty(value: Any) -> str | None:
    """Check: a string, list or mapping must not be empty (None passes)."""
    if isinstance(value, (str, Sequence, Mapping)) and len(value) == 0:
        return "must not be empty"
    return None


def each(check: Check) -> Check:
    """A check applying ``check`` to every item of a list or tuple (naming the item's index)."""

    def check_each(value: Any) -> str | None:
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                problem = check(item)
                if problem:
                    return f"item {i} {problem}"
        return None

    return check_each


def all_of(*checks: Check) -> Check:
    """A check that runs ``checks`` in order and reports the first problem."""

    def check_all(value: Any) -> str | None:
        for check in checks:
            problem = check(value)
            if problem:
                return problem
        return None

    return check_all


# ------------------------------------------------------------------------------ conversion


def _short_repr(value: Any, limit: int = 80) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _got(value: Any) -> str:
    if value is None:
        return "got null"
    return f"got {_short_repr(value)} ({type(value).__name__})"


def _describe(tp: Any) -> str:
    """What a type annotation accepts, in words."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "anything"
    if tp is type(None) or tp is None:
        return "null"
    if tp is bool:
        return "a bool (true or false)"
    if tp is int:
        return "an int"
    if tp is float:
        return "a float"
    if tp is str:
        return "a str"
    if origin is Literal:
        values = typing.get_args(tp)
        return repr(values[0]) if len(values) == 1 else f"one of {list(values)}"
    if origin in (Union, types.UnionType):
        return _describe_alternatives(typing.get_args(tp))
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values"
        return "a list"
    if dataclasses.is_dataclass(tp) or origin in (dict, Mapping) or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _describe_alternatives(alternatives: Sequence[Any]) -> str:
    words = [_describe(alt) for alt in alternatives]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _to_plain(data: Any, path: str) -> Any:
    """``data`` with omegaconf containers turned into plain dicts and lists (interpolations resolved)."""
    if type(data).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only when given an omegaconf object: no import otherwise

        try:
            return OmegaConf.to_container(data, resolve=True, throw_on_missing=True)
        except Exception as e:  # interpolation or missing-value errors, which name the key
            raise ConfigError(path, " ".join(str(e).split())) from None
    return data


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, value: Any, path: str, *, coerce: bool = True) -> Any:
    """``value`` checked against the annotation ``tp`` (and converted: int to float, tuples).

    ``coerce`` False (for a union's first pass) refuses ints for ``float``.

    Raises:
        ConfigError: ``value`` is of the wrong type, naming ``path`` and what is allowed.
    """
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(typing.get_args(tp), value, path)
    if tp is type(None) or tp is None:
        if value is None:
            return None
        raise ConfigError(path, f"expected null, {_got(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        raise ConfigError(path, f"expected {_describe(tp)}, {_got(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected a bool (true or false), {_got(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected an int, {_got(value)}")
    if tp is float:
        return _convert_float(value, path, coerce=coerce)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a str, {_got(value)}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return _convert_dict(tp, value, path)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return _convert_sequence(tp, value, path)
    raise TypeError(f"{path}: unsupported annotation {tp!r} in a config schema")


def _convert_float(value: Any, path: str, *, coerce: bool) -> float:
    if isinstance(value, float) or (coerce and isinstance(value, int) and not isinstance(value, bool)):
        try:
            result = float(value)
        except OverflowError:
            raise ConfigError(path, f"expected a finite float, {_got(value)}") from None
        if not math.isfinite(result):
            raise ConfigError(path, f"expected a finite float, {_got(value)}")
        return result
    if _looks_infinite(value):
        raise ConfigError(path, f"expected a finite float, {_got(value)}")
    raise ConfigError(path, f"expected a float, {_got(value)}")


def _is_mapping_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return dataclasses.is_dataclass(tp) or origin in (dict, Mapping) or tp in (dict, Mapping)


def _is_sequence_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return origin in (list, tuple, Sequence) or tp in (list, tuple)


def _convert_union(alternatives: Sequence[Any], value: Any, path: str) -> Any:
    # A mapping or list given where exactly one alternative takes one: its own (precise) errors.
    if isinstance(value, Mapping):
        structured = [alt for alt in alternatives if _is_mapping_type(alt)]
    elif isinstance(value, (list, tuple)):
        structured = [alt for alt in alternatives if _is_sequence_type(alt)]
    else:
        structured = []
    if len(structured) == 1:
        return _convert(structured[0], value, path)
    # Exact types first (so 3 stays an int in `float | int`), then with int -> float.
    for coerce in (False, True):
        for alt in alternatives:
            try:
                return _convert(alt, value, path, coerce=coerce)
            except ConfigError:
                pass
    problem = f"expected {_describe_alternatives(alternatives)}, {_got(value)}"
    if float in alternatives and _looks_infinite(value):
        problem += ": not a finite number"
    raise ConfigError(path, problem)


def _looks_infinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity")


def _convert_dict(tp: Any, value: Any, path: str) -> dict:
    value = _to_plain(value, path)
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping, {_got(value)}")
    args = typing.get_args(tp)
    key_type, value_type = args if args else (Any, Any)
    result = {}
    for key, item in value.items():
        if key_type is str and not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {_short_repr(key)} ({type(key).__name__})")
        item_path = join_path(path, str(key))
        result[_convert(key_type, key, item_path) if key_type is not str else key] = _convert(
            value_type, _to_plain(item, item_path), item_path
        )
    return result


def _convert_sequence(tp: Any, value: Any, path: str) -> list | tuple:
    value = _to_plain(value, path)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(path, f"expected {_describe(tp)}, {_got(value)}")
    origin = typing.get_origin(tp) or tp
    args = typing.get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(path, f"expected {len(args)} values, got {len(value)}: {_short_repr(list(value))}")
        return tuple(_convert(t, v, join_path(path, i)) for i, (t, v) in enumerate(zip(args, value)))
    item_type = args[0] if args else Any
    items = [_convert(item_type, v, join_path(path, i)) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


# ------------------------------------------------------------------------------ from_dict


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """An instance of the dataclass ``cls`` from the mapping ``data``, validated.

    ``data`` is a mapping (an omegaconf ``DictConfig`` too: it is resolved into plain containers;
    omegaconf is imported only then). ``path`` is where ``data`` sits in the whole configuration
    (``""`` at the top), the prefix of every error's path.

    Type rules, from ``cls``'s annotations (``typing.get_type_hints``):

    * ``int``: an int, not a bool; ``float``: an int (converted) or a float, finite (NaN and
      infinities refused); ``bool``: true or false only; ``str``; ``None``: null;
    * ``Literal[a, b]``: one of those values (the error lists them);
    * ``list[T]``; ``tuple[T, ...]``; ``tuple[T1, T2]`` (exactly that many values, else
      ``expected 2 values, got 1``); items are checked with paths ``key[i]``;
    * ``dict[str, T]``: a mapping, each value checked as ``T`` with path ``key.name`` (``T`` may
      be a dataclass); a dataclass: a mapping, converted recursively;
    * unions (``int | str | None``): the first alternative the value fits, exact types before
      int -> float; a mapping (or list) given where one alternative takes one is checked against
      it, for precise errors; ``Any``: anything.

    Then each field's ``metadata["check"]`` (see :func:`setting`) is run on the converted value,
    and the dataclass is constructed: a :class:`ConfigError` raised by its ``__post_init__``
    (with a path relative to it) gets ``path`` put in front; a plain ``ValueError`` becomes a
    :class:`ConfigError` at ``path.<field>`` when its message starts with a field's name, else at
    ``path``.

    An optional class method extends a schema:

    * ``config_field_types(data)`` (a classmethod): ``{field: type}`` overriding annotations for
      this mapping, e.g. to pick a section's schema from a sibling ``name`` key.

    Raises:
        ConfigError: see the module docstring; the message starts with the full dotted path.
        TypeError: if ``cls`` is not a dataclass or uses an unsupported annotation (a bug in the
            schema, not in the configuration).
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    data = _to_plain(data, path)
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping of keys to values, {_got(data)}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {_short_repr(key)} ({type(key).__name__})")

    init_fields = [f for f in dataclasses.fields(cls) if f.init]
    allowed = [f.name for f in init_fields]
    unknown = [key for key in data if key not in allowed]
    if unknown:
        key = unknown[0]
        guess = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        also = f"; also unknown: {unknown[1:]}" if len(unknown) > 1 else ""
        raise ConfigError(join_path(path, key), f"unknown key{hint}; allowed keys: {allowed}{also}")

    missing = [f.name for f in init_fields
               if f.name not in data and f.default is _MISSING and f.default_factory is _MISSING]
    if missing:
        also = f" (also missing: {missing[1:]})" if len(missing) > 1 else ""
        raise ConfigError(join_path(path, missing[0]), f"missing required key{also}")

    hints = dict(_type_hints(cls))
    field_types = getattr(cls, "config_field_types", None)
    if field_types is not None:
        hints.update(field_types(data))
    kwargs = {}
    for f in init_fields:
        if f.name not in data:
            continue
        field_path = join_path(path, f.name)
        value = _convert(hints[f.name], data[f.name], field_path)
        check = f.metadata.get("check")
        if check is not None:
            problem = check(value)
            if problem:
                raise ConfigError(field_path, problem)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.with_prefix(path) from None
    except ValueError as e:
        message = str(e)
        match = re.match(r"[A-Za-z_]\w*", message)
        key = match.group(0) if match and match.group(0) in allowed else None
        raise ConfigError(join_path(path, key) if key else path, message) from None


# -------------------------------------------------------------------------------- to_dict


def to_dict(instance: Any) -> dict[str, Any]:
    """A dataclass instance as plain dicts, lists and scalars (tuples become lists), e.g. for YAML.

    A dataclass with the class attribute ``config_omit_none = True`` leaves out its fields that
    are None (e.g. optional sections given by name, such as algorithms).
    """
    if not (dataclasses.is_dataclass(instance) and not isinstance(instance, type)):
        raise TypeError(f"to_dict needs a dataclass instance, got {instance!r}")
    return _plain(instance)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        omit_none = getattr(value, "config_omit_none", False)
        result = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if omit_none and item is None:
                continue
            result[f.name] = _plain(item)
        return result
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
