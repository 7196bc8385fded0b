"""llm.utils.config: OmegaConf structured configs through from_dict: type rules, value checks, path
prefixing, to_dict."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pytest

from llm.utils.config import (
    ConfigError,
    all_of,
    at_least,
    each,
    from_dict,
    in_range,
    join_path,
    non_empty,
    non_negative,
    one_of,
    positive,
    setting,
    to_dict,
)


@dataclass
class Inner:
    x: int
    y: float = setting(1.0, check=positive)

    def __post_init__(self) -> None:
        if self.x > 100:
            raise ConfigError("x", "must be at most 100 when y is given")


@dataclass
class Outer:
    name: str
    count: int = 0
    ratio: float = 0.5
    flag: bool = False
    mode: str = setting("a", check=one_of("a", "b"))
    maybe: int | None = None
    either: int | str | None = None
    anything: Any = None
    items: list[str] = field(default_factory=list)
    numbers: tuple[float, ...] = ()
    pair: tuple[float, float] = (0.0, 1.0)
    table: dict[str, int] = field(default_factory=dict)
    inners: dict[str, Inner] = field(default_factory=dict)
    inner: Inner | None = None


# Module level: with postponed annotations, get_type_hints resolves names in the module.
@dataclass
class Legacy:
    width: int = 1

    def __post_init__(self) -> None:
        if self.width > 5:
            raise ValueError(f"width must be <= 5, got {self.width}")
        if self.width == 0:
            raise ValueError("something global is wrong")


@dataclass
class Holder:
    legacy: Legacy


@dataclass
class A:
    a: int = 0


@dataclass
class B:
    b: int = 0


@dataclass
class Switch:
    kind: str = setting("a", check=one_of("a", "b"))
    body: Any = None

    @classmethod
    def config_field_types(cls, data):
        return {"body": {"a": A, "b": B}.get(data.get("kind", "a"), A)}


def error(cls, data) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_dict(cls, data)
    return info.value


def test_valid_mapping_converts_and_fills_defaults():
    got = from_dict(Outer, {"name": "n", "ratio": 2, "numbers": [1, 2.5], "pair": [0.1, 0.2],
                            "inner": {"x": 3}, "inners": {"k": {"x": 1, "y": 3}}, "either": "auto"})
    assert got.ratio == 2.0 and isinstance(got.ratio, float)
    assert got.numbers == (1.0, 2.5) and got.pair == (0.1, 0.2)
    assert got.inner == Inner(x=3) and got.inners == {"k": Inner(x=1, y=3.0)}
    assert got.either == "auto" and got.items == [] and got.mode == "a"


def test_unknown_key_names_full_path_allowed_keys_and_a_guess():
    e = error(Outer, {"name": "n", "inner": {"x": 1, "yy": 2}})
    assert e.path == "inner.yy"
    assert str(e).startswith("inner.yy: unknown key (did you mean 'y'?); allowed keys: ['x', 'y']")
    e = error(Outer, {"name": "n", "inners": {"k": {"x": 1, "z": 2}}})
    assert str(e).startswith("inners.k.z: unknown key; allowed keys: ['x', 'y']")
    assert error(Outer, {"nam": "n"}).path == "nam"


def test_missing_required_key_is_named():
    e = error(Outer, {})
    assert str(e) == "name: missing required key"
    assert str(error(Outer, {"name": "n", "inner": {}})) == "inner.x: missing required key"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"count": True}, "count: expected an int, got True (bool)"),
        ({"count": 1.5}, "count: expected an int, got 1.5 (float)"),
        ({"count": "three"}, "count: expected an int, got 'three' (str)"),
        ({"ratio": "fast"}, "ratio: expected a float, got 'fast' (str)"),
        ({"ratio": True}, "ratio: expected a float, got True (bool)"),
        ({"ratio": math.nan}, "ratio: expected a finite float, got nan (float)"),
        ({"ratio": -math.inf}, "ratio: expected a finite float, got -inf (float)"),
        ({"ratio": "nan"}, "ratio: expected a finite float, got nan (float)"),
        ({"ratio": 10**400}, "ratio: expected a finite float"),
        ({"flag": "maybe"}, "flag: expected a bool (true or false), got 'maybe' (str)"),
        ({"flag": 1.5}, "flag: expected a bool (true or false), got 1.5 (float)"),
        ({"mode": "c"}, "mode: expected one of ['a', 'b'], got 'c' (str)"),
        ({"maybe": "x"}, "maybe: expected an int or null, got 'x' (str)"),
        ({"either": 1.5}, "either: expected an int, a str or null, got 1.5 (float)"),
        ({"items": "abc"}, "items: expected a list, got 'abc' (str)"),
        ({"numbers": [1, "x"]}, "numbers[1]: expected a float, got 'x' (str)"),
        ({"numbers": [1, math.inf]}, "numbers[1]: expected a finite float, got inf (float)"),
        ({"pair": [0.9]}, "pair: expected 2 values, got 1"),
        ({"pair": [1, 2, 3]}, "pair: expected 2 values, got 3"),
        ({"pair": 0.5}, "pair: expected a list of 2 values, got 0.5 (float)"),
        ({"table": {"a": "x"}}, "table.a: expected an int, got 'x' (str)"),
        ({"table": [1]}, "table: expected a mapping, got [1] (list)"),
        ({"inner": 3}, "inner: expected a mapping or null, got 3 (int)"),
        ({"inner": {"x": "one"}}, "inner.x: expected an int, got 'one' (str)"),
        ({"inners": {"k": {"x": "one"}}}, "inners.k.x: expected an int, got 'one' (str)"),
        ({"inners": {"k": None}}, "inners.k: expected a mapping of keys to values, got null"),
        ({"inners": {"k": {"x": 1, "z": 2}}}, "inners.k.z: unknown key; allowed keys: ['x', 'y']"),
    ],
)
def test_type_rules(data, message):
    assert str(error(Outer, {"name": "n", **data})).startswith(message)


def test_strings_and_numbers_convert_as_yaml_reads_them():
    """OmegaConf's conversions: a command line's ``key=value`` and YAML give strings and ints."""
    got = from_dict(Outer, {"name": 3, "count": "4", "ratio": 2, "flag": "true", "items": ["a", 2]})
    assert (got.name, got.count, got.ratio, got.flag, got.items) == ("3", 4, 2.0, True, ["a", "2"])
    assert isinstance(got.ratio, float)


def test_a_schema_omegaconf_cannot_read_is_a_type_error():
    @dataclass
    class L:
        v: Literal[1, "x"] = 1

    with pytest.raises(TypeError, match="not an OmegaConf structured config"):
        from_dict(L, {})
    assert one_of(1, "x")(True) == "expected one of [1, 'x'], got True (bool)"
    assert one_of(1, "x")(None) is None and one_of(1, "x")("x") is None


def test_union_keeps_the_given_type_and_any_takes_anything():
    @dataclass
    class U:
        a: float | int = 0
        b: int | float = 0
        c: Any = None

    got = from_dict(U, {"a": 3, "b": 2.5, "c": {"k": [1]}})
    assert got.a == 3 and isinstance(got.a, int)
    assert got.b == 2.5
    assert got.c == {"k": [1]}


def test_value_checks_and_post_init_errors_get_the_dataclass_path():
    assert str(error(Outer, {"name": "n", "inner": {"x": 1, "y": 0}})) == "inner.y: must be > 0, got 0.0"
    assert str(error(Outer, {"name": "n", "inner": {"x": 101}})) == "inner.x: must be at most 100 when y is given"
    e = error(Outer, {"name": "n", "inners": {"k": {"x": 101}}})
    assert e.path == "inners.k.x"
    # at the top level the local path is the whole path
    assert str(error(Inner, {"x": 101})) == "x: must be at most 100 when y is given"


def test_plain_value_error_in_post_init_becomes_a_config_error_at_the_field_it_names():
    assert str(error(Holder, {"legacy": {"width": 7}})) == "legacy.width: width must be <= 5, got 7"
    assert error(Holder, {"legacy": {"width": 0}}).path == "legacy"


def test_field_type_hook():
    assert from_dict(Switch, {"kind": "b", "body": {"b": 2}}).body == B(b=2)
    assert str(error(Switch, {"kind": "b", "body": {"a": 2}})).startswith("body.a: unknown key; allowed keys: ['b']")


def test_from_dict_path_argument_and_non_mappings():
    assert str(error(Inner, [1])) == "expected a mapping of keys to values, got [1] (list)"
    with pytest.raises(ConfigError, match=r"^sec\.x: expected an int"):
        from_dict(Inner, {"x": "one"}, "sec")
    with pytest.raises(ConfigError, match="keys must be strings"):
        from_dict(Inner, {1: 2})
    with pytest.raises(TypeError, match="dataclass"):
        from_dict(dict, {})


def test_omegaconf_containers_are_resolved():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"name": "n", "count": "${inner.x}", "inner": {"x": 4}})
    got = from_dict(Outer, cfg)
    assert got.count == 4 and got.inner == Inner(x=4)
    bad = omegaconf.OmegaConf.create({"name": "n", "count": "${nowhere}"})
    with pytest.raises(ConfigError, match="nowhere"):
        from_dict(Outer, bad)


def test_check_helpers():
    assert positive(1) is None and positive(0) == "must be > 0, got 0"
    assert positive(None) is None and positive("auto") is None and positive(True) is None
    assert non_negative(0) is None and non_negative(-1) == "must be >= 0, got -1"
    assert at_least(-1)(-1) is None and at_least(-1)(-2) == "must be >= -1, got -2"
    assert in_range(0, 1, hi_inclusive=False)(1.0) == "must be in [0, 1), got 1.0"
    assert in_range(0, 1, lo_inclusive=False)(0) == "must be in (0, 1], got 0"
    assert in_range(hi=3)(4) == "must be <= 3, got 4"
    assert in_range(0, 1)(0.5) is None
    assert each(positive)([1, 0]) == "item 1 must be > 0, got 0"
    assert all_of(non_empty, each(positive))([]) == "must not be empty"
    assert non_empty("") == "must not be empty" and non_empty(None) is None
    with pytest.raises(ValueError):
        in_range()


def test_config_error_prefix_and_pickle():
    e = ConfigError("t_warmup", "bad")
    assert isinstance(e, ValueError) and str(e) == "t_warmup: bad"
    assert str(e.with_prefix("scheduler")) == "scheduler.t_warmup: bad"
    assert str(ConfigError("", "bad").with_prefix("scheduler")) == "scheduler: bad"
    copy = pickle.loads(pickle.dumps(e))
    assert (copy.path, copy.message, str(copy)) == ("t_warmup", "bad", "t_warmup: bad")
    assert join_path("", "a") == "a" and join_path("a", "b") == "a.b" and join_path("a", 2) == "a[2]"


def test_to_dict_gives_plain_containers():
    @dataclass
    class Sparse:
        on: Inner | None = None
        off: Inner | None = None
        config_omit_none: ClassVar[bool] = True

    got = from_dict(Outer, {"name": "n", "pair": [1, 2], "inners": {"k": {"x": 1}}})
    plain = to_dict(got)
    assert plain["pair"] == [1.0, 2.0] and plain["inners"] == {"k": {"x": 1, "y": 1.0}} and plain["inner"] is None
    assert from_dict(Outer, plain) == got
    assert to_dict(Sparse(on=Inner(x=1))) == {"on": {"x": 1, "y": 1.0}}
    with pytest.raises(TypeError):
        to_dict(Outer)


def test_module_imports_no_heavy_library():
    # Import the module file directly, without the llm package's __init__ (which loads torch).
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('cfg', 'llm/utils/config.py'); "
            "m = importlib.util.module_from_spec(spec); sys.modules['cfg'] = m; spec.loader.exec_module(m); "
            "print([n for n in ('torch', 'composer', 'numpy') if n in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"
