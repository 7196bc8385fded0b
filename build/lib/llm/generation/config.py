"""GenerationConfig: every decoding option of ``generate``, under transformers' names, validated once.

A config is frozen: it is checked when it is built (``GenerationConfig(...)``, ``update``,
``from_dict`` / ``from_json_file``) and cannot be changed afterwards, so a config that reaches the
decoding loop is always valid. Files are JSON named ``generation_config.json``, as transformers'.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm.io import atomic_write

GENERATION_CONFIG_FILE = "generation_config.json"

# Keys transformers writes that are no options: ignored when reading its files.
_METADATA = {"transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash"}
# transformers options that never change what a decoder-only generate from given ids returns.
_INERT = {"bos_token_id", "decoder_start_token_id", "use_cache"}

# While set, building a config does not warn about ignored sampling options (``update`` warns
# about the options it was given, not about those it inherits).
_quiet = contextvars.ContextVar("quiet", default=False)


@dataclass(frozen=True)
class GenerationConfig:
    """The decoding options of :func:`llm.generate`, with transformers' names and meanings.

    Attributes:
        max_new_tokens: the most tokens to add per row; an integer >= 1.
        do_sample: sample (True) or decode greedily (False).
        temperature: a finite number >= 0; 0 is greedy decoding (even with ``do_sample=True``);
            None reads as 1.0, as in transformers' files.
        top_k: keep the k most likely tokens; an integer >= 0 (0 or None: off).
        top_p: nucleus sampling, keep the smallest set reaching this probability; in (0, 1].
        min_p: keep tokens with at least min_p times the top token's probability; in [0, 1].
        repetition_penalty: > 0 and finite (1.0 or None: none); divides the positive logits
            (multiplies the negative ones) of every token already in the sequence, greedy or not.
        eos_token_id: an id >= 0 or a non-empty list of them (stored as a tuple); a row stops at
            the first.
        pad_token_id: an id >= 0 that fills finished rows (default: the first eos id, else 0).
        stop_strings: a non-empty string or strings (stored as a tuple) that stop a row once its
            new text contains one; ``generate`` then needs ``tokenizer=``.
        seed: an integer in [0, 2**64): decoding draws from a generator of its own, seeded.
        prompt_lookup_num_tokens: reference (prompt lookup) decoding with drafts of up to this
            many tokens; an integer >= 1, or None: off.
        max_matching_ngram_size: the longest n-gram prompt lookup matches (>= 1; None: 2).
        num_assistant_tokens: draft length of draft-model decoding (>= 1; None: 5).
        num_assistant_tokens_schedule: ``"heuristic"`` (the draft length adapts, drafting only
            while it pays) or ``"constant"``.
        return_dict_in_generate: ``generate`` returns a :class:`~llm.generation.GenerateOutput`.

    Raises:
        ValueError: at construction, for any value outside its range (NaN and infinities
            included), naming the option, the value and the allowed range.

    Warns:
        UserWarning: when decoding is greedy (``do_sample=False``, or ``temperature=0``) but
            sampling options are set (a temperature other than 0 or 1, ``top_k``, ``top_p`` < 1,
            ``min_p``): they would be ignored, as transformers' ``GenerationConfig.validate`` warns.
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float | None = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    stop_strings: str | tuple[str, ...] | None = None
    seed: int | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str = "heuristic"
    return_dict_in_generate: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        for name in ("do_sample", "return_dict_in_generate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _int(self, "max_new_tokens", 1, none=False)
        _int(self, "top_k", 0, "an integer >= 0 (0 or None: no top-k)")
        _int(self, "pad_token_id", 0)
        _int(self, "seed", 0, "an integer in [0, 2**64)", below=2**64)
        for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens"):
            _int(self, name, 1)
        set_("temperature", _float(self, "temperature", "a finite number >= 0 (0: greedy)", lambda v: v >= 0,
                                   default=1.0))
        set_("top_p", _float(self, "top_p", "a number in (0, 1]", lambda v: 0 < v <= 1))
        set_("min_p", _float(self, "min_p", "a number in [0, 1]", lambda v: 0 <= v <= 1))
        set_("repetition_penalty", _float(self, "repetition_penalty", "a finite number > 0 (1.0: no penalty)",
                                          lambda v: v > 0))
        set_("eos_token_id", _token_ids(self.eos_token_id))
        set_("stop_strings", _stop_strings(self.stop_strings))
        if self.num_assistant_tokens_schedule not in ("heuristic", "constant"):
            raise ValueError(f"num_assistant_tokens_schedule must be 'heuristic' or 'constant', "
                             f"got {self.num_assistant_tokens_schedule!r}")
        if not _quiet.get():
            _warn_ignored(self, self.ignored_sampling_options(), stacklevel=4)  # the caller of __init__

    # -- consistency -------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy: ``do_sample=False``, or ``temperature=0``."""
        return not self.do_sample or self.temperature == 0

    def ignored_sampling_options(self) -> dict[str, Any]:
        """The sampling options that greedy decoding ignores, with their values ({} when sampling)."""
        if not self.greedy:
            return {}
        ignored = {}
        if self.temperature not in (0.0, 1.0):
            ignored["temperature"] = self.temperature
        if self.top_k:
            ignored["top_k"] = self.top_k
        if self.top_p is not None and self.top_p < 1:
            ignored["top_p"] = self.top_p
        if self.min_p:
            ignored["min_p"] = self.min_p
        return ignored

    def update(self, **options) -> "GenerationConfig":
        """A new validated config with ``options`` changed (this one is unchanged).

        Warns (UserWarning) only about the given options that greedy decoding would ignore, not
        about sampling settings inherited from this config (a model's recommended sampling
        settings stay quiet when a call asks for greedy decoding).

        Raises:
            TypeError: for a name that is not an option (with the closest option names).
            ValueError: as the constructor.
        """
        _check_names(options)
        token = _quiet.set(True)
        try:
            new = dataclasses.replace(self, **options)
        finally:
            _quiet.reset(token)
        ignored = new.ignored_sampling_options()
        _warn_ignored(new, {k: v for k, v in ignored.items() if k in options}, stacklevel=3)
        return new

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every option, JSON-ready (tuples as lists)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "GenerationConfig":
        """Build from a dict of options, ours or a transformers ``generation_config.json``'s.

        transformers' metadata (``transformers_version``, ...) and options that cannot change the
        output here (``bos_token_id``, ``decoder_start_token_id``, ``use_cache``) are ignored; any
        other transformers option is accepted only at transformers' default value. A sampling
        transformers file (it carries ``transformers_version``) without ``top_k`` means
        transformers' default top_k=50, so it samples here as it does there.

        Raises:
            ValueError: for an option we do not support set to a non-default value (e.g.
                ``num_beams=4``), an unknown key, or a value out of range.
        """
        if not isinstance(options, dict):
            raise ValueError(f"a generation config must be a JSON object, got {type(options).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in options.items() if k in names}
        foreign = {k: v for k, v in options.items() if k not in names and k not in _METADATA | _INERT}
        if foreign:
            defaults = _transformers_defaults()
            for key, value in foreign.items():
                if key not in defaults:
                    raise ValueError(f"unknown generation option {key!r}{_suggest(key)}")
                if value != defaults[key]:
                    raise ValueError(f"generation option {key}={value!r} is not supported (only transformers' "
                                     f"default {defaults[key]!r}); supported options: {sorted(names)}")
        if "transformers_version" in options and "top_k" not in options and options.get("do_sample"):
            ours["top_k"] = 50
        return cls(**ours)

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write every option as JSON (keys sorted), atomically; transformers can read the file."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "GenerationConfig":
        """Read a file written by :meth:`to_json_file` or by transformers.

        Raises:
            FileNotFoundError: if ``path`` is missing.
            ValueError: for a file that is not JSON, or options as :meth:`from_dict`, naming ``path``.
        """
        try:
            options = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a JSON generation config ({err})") from err
        try:
            return cls.from_dict(options)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err


# -- checks -------------------------------------------------------------------------------------
def _int(config, name: str, minimum: int, allowed: str | None = None, *, none: bool = True,
         below: int | None = None) -> None:
    value = getattr(config, name)
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (below and value >= below):
        raise ValueError(f"{name} must be {allowed or f'an integer >= {minimum}'}, got {value!r}")


def _float(config, name: str, allowed: str, in_range, default=None) -> float | None:
    value = getattr(config, name)
    if value is None:
        return default
    # NaN fails every comparison and +inf passes ">= 0": refuse both by name
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not in_range(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _token_ids(value) -> int | tuple[int, ...] | None:
    ok = lambda i: isinstance(i, int) and not isinstance(i, bool) and i >= 0  # noqa: E731
    if value is None or ok(value):
        return value
    ids = tuple(value) if isinstance(value, (list, tuple)) else ()
    if not ids or not all(ok(i) for i in ids):
        raise ValueError(f"eos_token_id must be a token id >= 0 or a non-empty list of them, got {value!r}")
    return ids


def _stop_strings(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    strings = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else ()
    if not strings or any(not isinstance(s, str) or not s for s in strings):
        raise ValueError(f"stop_strings must be a non-empty string or a non-empty list of them, got {value!r}")
    return strings


def _warn_ignored(config: GenerationConfig, ignored: dict[str, Any], stacklevel: int) -> None:
    if not ignored:
        return
    why = "do_sample=False" if not config.do_sample else "temperature=0"
    listed = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
    warnings.warn(f"decoding is greedy ({why}), so these sampling options are ignored: {listed}; "
                  f"set do_sample=True (and a temperature > 0) or unset them", UserWarning, stacklevel=stacklevel)


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(GenerationConfig)], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_names(options: dict) -> None:
    names = {f.name for f in dataclasses.fields(GenerationConfig)}
    for key in options:
        if key not in names:
            raise TypeError(f"unknown generation option {key!r}{_suggest(key)}")


def _transformers_defaults() -> dict[str, Any]:
    from transformers import GenerationConfig as TransformersConfig  # lazy: only for foreign keys

    return TransformersConfig().to_dict()


#: Registered name (:data:`llm.utils.pretrained.PRETRAINED`) -> the generation settings its
#: authors recommend, the model's ``generation_config`` when loaded by that name (what
#: transformers keeps in a model's generation_config.json). SmolLM2: "temperature=0.2, top_p=0.9"
#: with sampling (the SmolLM2-135M-Instruct model card). At the CLI's general default (temperature
#: 0.8, no truncation) 4 of 12 seeds missed "Berlin" for "What is the capital of Germany?"; with
#: these, none did.
GENERATION_DEFAULTS = {
    "smollm2-135m-instruct": GenerationConfig(do_sample=True, temperature=0.2, top_p=0.9),
}


def load_generation_config(name_or_path: str | os.PathLike) -> GenerationConfig | None:
    """The generation defaults that come with a model: a bundle directory's
    ``generation_config.json``, else a registered name's :data:`GENERATION_DEFAULTS`; None for neither.

    Raises:
        ValueError: for a ``generation_config.json`` that is not a valid config (naming it).
    """
    path = Path(name_or_path)
    if (path / GENERATION_CONFIG_FILE).is_file():
        return GenerationConfig.from_json_file(path / GENERATION_CONFIG_FILE)
    if not path.exists() and isinstance(name_or_path, str):
        return GENERATION_DEFAULTS.get(name_or_path)
    return None
