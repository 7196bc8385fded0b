"""Typed configuration schemas: dataclasses read as OmegaConf structured configs.

A schema is a dataclass whose annotations are OmegaConf's structured-config types (as
llm-foundry's configs are): ``int``, ``float``, ``bool``, ``str``, unions of those, ``X | None``,
``list[...]``, ``tuple[...]``, ``dict[str, ...]``, nested dataclasses and ``Any``.
:func:`from_dict` merges a mapping (plain, or an omegaconf ``DictConfig``) into
``OmegaConf.structured(cls)`` and builds the dataclass. It refuses, with a :class:`ConfigError`
whose message starts with the full dotted path of the offending key:

* a key the schema does not have, at any depth (OmegaConf's ``ConfigKeyError``; the message
  lists the allowed keys, with a guess when the key looks like a typo of one of them);
* a missing required key (a field without a default is OmegaConf's ``MISSING``);
* a value OmegaConf cannot convert to its field's type (``ValidationError``: ints become floats
  and strings become what YAML would read them as; a float is no int, a word no bool);
* a float that is not finite, a fixed-length tuple of another length;
* a value its field's ``check`` refuses (see :func:`setting` and the helpers :func:`positive`,
  :func:`in_range`, :func:`one_of`, ...);
* whatever the dataclass's ``__post_init__`` refuses (cross-field rules): it raises
  ``ConfigError("local_key", "...")`` with the key relative to its own dataclass, and
  :func:`from_dict` prefixes the dataclass's path.

OmegaConf has no ``Literal``: a field with a fixed set of values is a ``str`` with
``check=one_of(...)``. A field whose schema depends on a sibling key (a loader's ``dataset``, by
its ``name``) is annotated ``Any`` and typed by the class method ``config_field_types(data)``.

:func:`to_dict` turns a schema instance back into plain dicts and lists (to save it as YAML).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Union


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
    "one_of",
    "positive",
    "setting",
    "to_dict",
]

#: A value check: takes the (converted) value, returns None when it is fine, else what is wrong
#: (e.g. ``"must be > 0, got -1"``), without the key: the caller prefixes the path.
Check = Callable[[Any], "str | None"]

_MISSING = dataclasses.MISSING


def _omegaconf():
    """omegaconf, imported at the first configuration read rather than with this module (3 MB and
    50 ms that loading a model from a GGUF file or a bundle's weights does not need)."""
    import omegaconf
    import omegaconf.errors

    return omegaconf


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
        # a key that is a whole file's text (a file that is not a config) is not echoed whole
        shown = path if len(path) <= 100 else f"{path[:60]}... ({len(path)} characters)"
        super().__init__(f"{shown}: {message}" if path else message)

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


def one_of(*choices: Any) -> Check:
    """A check that the value is one of ``choices`` (None passes: make the field ``X | None`` or not)."""

    def check(value: Any) -> str | None:
        if value is None or any(type(value) is type(c) and value == c for c in choices):
            return None
        return f"expected one of {list(choices)}, {_got(value)}"

    return check


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


# ------------------------------------------------------------------------------- messages


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
    words = {bool: "a bool (true or false)", int: "an int", float: "a float", str: "a str", type(None): "null"}
    if tp in words:
        return words[tp]
    if tp is Any:
        return "anything"
    if origin in (Union, types.UnionType):
        alternatives = [_describe(alt) for alt in typing.get_args(tp)]
        return ", ".join(alternatives[:-1]) + " or " + alternatives[-1]
    if origin in (list, tuple) or tp in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {len(args)} values" if origin is tuple and args and args[-1] is not Ellipsis else "a list"
    if dataclasses.is_dataclass(tp) or origin is dict or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _without_none(tp: Any) -> Any:
    """``X`` for ``X | None`` (the annotation itself otherwise)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _lookup(data: Any, path: str) -> Any:
    """The value at a dotted ``path`` (``a.b[2]``) of plain ``data``, or None."""
    for part in re.findall(r"[^.\[\]]+", path):
        if isinstance(data, Mapping):
            data = data.get(part)
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def _annotation_at(cls: type, full_key: str) -> Any:
    """The annotation of the field at a dotted key below the dataclass ``cls``, or None."""
    tp: Any = cls
    for part in re.findall(r"[^.\[\]]+", full_key):
        tp = _without_none(tp)
        if dataclasses.is_dataclass(tp):
            tp = _type_hints(tp).get(part)
        elif typing.get_origin(tp) in (dict, list, tuple):
            args = typing.get_args(tp)
            if typing.get_origin(tp) is dict or len(args) == 1 or args[-1] is Ellipsis:
                tp = args[-1] if typing.get_origin(tp) is dict else args[0]
            else:
                tp = args[int(part)] if part.isdigit() and int(part) < len(args) else None
        else:
            return None
        if tp is None:
            return None
    return tp


def _omegaconf_error(err, root: type, data: Any, path: str) -> ConfigError:
    """One of OmegaConf's errors (an ``OmegaConfBaseException``) as a :class:`ConfigError` naming
    the key and what is allowed."""
    errors = _omegaconf().errors
    where = join_path(path, err.full_key) if err.full_key else path
    cls = err.object_type if dataclasses.is_dataclass(err.object_type) else None
    if isinstance(err, errors.ConfigKeyError) and cls is not None:
        allowed = _fields(cls)
        guess = difflib.get_close_matches(str(err.key), allowed, n=1, cutoff=0.6)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        return ConfigError(where, f"unknown key{hint}; allowed keys: {allowed}")
    if isinstance(err, errors.MissingMandatoryValue):
        return ConfigError(where, "missing required key")
    annotation = _annotation_at(root, err.full_key)
    if annotation is not None:
        value = _lookup(data, err.full_key)
        finite = "a finite float" if _without_none(annotation) is float and _looks_infinite(value) else None
        return ConfigError(where, f"expected {finite or _describe(annotation)}, {_got(value)}")
    return ConfigError(where, " ".join(str(err.msg).split()))


def _looks_infinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, str) and value.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity")


# ------------------------------------------------------------------------------ from_dict


def _to_plain(data: Any, path: str) -> Any:
    """``data`` with omegaconf containers turned into plain dicts and lists (interpolations resolved)."""
    omegaconf = sys.modules.get("omegaconf")  # not imported yet: data is no omegaconf container
    if omegaconf is not None and isinstance(data, (omegaconf.DictConfig, omegaconf.ListConfig)):
        try:
            return omegaconf.OmegaConf.to_container(data, resolve=True, throw_on_missing=True)
        except omegaconf.errors.OmegaConfBaseException as e:  # interpolation or missing values, naming the key
            raise ConfigError(path, " ".join(str(e).split())) from None
    return data


def _check_sections(cls: type, data: Mapping, path: str) -> None:
    """Refuse a non-mapping where the schema has a section (OmegaConf's merge error would not say
    where), at any depth."""
    hints = _type_hints(cls)
    for key, value in data.items():
        tp = _without_none(hints.get(key, Any))
        if value is None or tp is Any:
            continue
        key_path = join_path(path, key)
        if tp is float and _is_number(value) and abs(value) > sys.float_info.max:  # OmegaConf would overflow
            raise ConfigError(key_path, f"expected a finite float, {_got(value)}")
        items_type = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if dataclasses.is_dataclass(tp) or items_type is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(key_path, f"expected {_describe(hints[key])}, {_got(value)}")
        if dataclasses.is_dataclass(tp):
            _check_sections(tp, value, key_path)
        elif dataclasses.is_dataclass(items_type):
            for name, item in value.items():
                if not isinstance(item, Mapping):
                    raise ConfigError(join_path(key_path, str(name)), f"expected a mapping of keys to values, "
                                                                      f"{_got(item)}")
                _check_sections(items_type, item, join_path(key_path, str(name)))


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """An instance of the dataclass ``cls`` from the mapping ``data``, validated.

    ``data`` is merged into ``OmegaConf.structured(cls)`` (types, unknown and missing keys), then
    the dataclasses are built from the merged config, each field's ``check`` run in field order
    and every ``__post_init__`` called. ``path`` is the dotted path of ``data`` in a larger
    configuration (for messages). A ``ConfigError`` from ``__post_init__`` (with a path relative
    to its dataclass) gets ``path`` put in front; a plain ``ValueError`` becomes a
    :class:`ConfigError` at ``path.<field>`` when its message starts with a field's name, else at
    ``path``.

    Raises:
        ConfigError: see the module docstring; the message starts with the full dotted path.
        TypeError: if ``cls`` is not a dataclass OmegaConf can read (a bug in the schema, not in
            the configuration: e.g. a ``Literal`` annotation).
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    data = _to_plain(data, path)
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping of keys to values, {_got(data)}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be strings, got {_short_repr(key)} ({type(key).__name__})")
    omegaconf = _omegaconf()
    OmegaConf, OmegaConfBaseException = omegaconf.OmegaConf, omegaconf.errors.OmegaConfBaseException
    try:
        schema = OmegaConf.structured(cls)
    except OmegaConfBaseException as e:
        raise TypeError(f"{cls.__name__} is not an OmegaConf structured config: {str(e).splitlines()[0]}") from None
    _check_sections(cls, data, path)
    try:
        return _build(cls, OmegaConf.merge(schema, data), path)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, cls, data, path) from None


def _build(cls: type, node, path: str) -> Any:
    """The dataclass ``cls`` from its merged node (a ``DictConfig``, see :func:`from_dict`)."""
    hints = dict(_type_hints(cls))
    field_types = getattr(cls, "config_field_types", None)
    by_sibling = field_types(_omegaconf().OmegaConf.to_container(node)) if field_types is not None else {}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        field_path = join_path(path, f.name)
        if f.name in by_sibling:
            value = from_dict(by_sibling[f.name], node[f.name], field_path)
        else:
            value = _value(hints[f.name], node[f.name], field_path)
        check = f.metadata.get("check")
        problem = check(value) if check is not None else None
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
        key = match.group(0) if match and match.group(0) in _fields(cls) else None
        raise ConfigError(join_path(path, key) if key else path, message) from None


def _value(tp: Any, raw: Any, path: str) -> Any:
    """A merged node's value as the annotation ``tp`` wants it: dataclasses built, tuples of their
    length, floats finite, other containers plain."""
    tp = _without_none(tp)
    if raw is None:
        return None
    omegaconf = _omegaconf()
    OmegaConf = omegaconf.OmegaConf
    if isinstance(raw, omegaconf.DictConfig):
        if dataclasses.is_dataclass(tp):
            return _build(tp, raw, path)
        items_type = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if dataclasses.is_dataclass(items_type):
            return {key: _build(items_type, raw[key], join_path(path, str(key))) for key in raw}
        return OmegaConf.to_container(raw, resolve=True)
    if isinstance(raw, omegaconf.ListConfig):
        items = OmegaConf.to_container(raw, resolve=True)
        args = typing.get_args(tp)
        if typing.get_origin(tp) is tuple and args and args[-1] is not Ellipsis and len(items) != len(args):
            raise ConfigError(path, f"expected {len(args)} values, got {len(items)}: {_short_repr(items)}")
        for i, item in enumerate(items):
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(join_path(path, i), f"expected a finite float, {_got(item)}")
        return tuple(items) if typing.get_origin(tp) is tuple else items
    if isinstance(raw, float) and not math.isfinite(raw):
        raise ConfigError(path, f"expected a finite float, {_got(raw)}")
    return raw


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
