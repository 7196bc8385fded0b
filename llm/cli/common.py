"""What the command lines share: loading a YAML config with ``key=value`` overrides, one-line errors."""

from __future__ import annotations

from typing import Any


class CliError(ValueError):
    """A bad command-line input, printed as one line with exit status 2."""


def load_yaml_config(path: str, overrides: list[str]) -> dict[str, Any]:
    """The YAML file at ``path`` merged with omegaconf dotlist ``overrides`` (``a.b=1``), as a plain dict.

    Raises:
        CliError: for a missing or unreadable file, YAML that is not a mapping, or an override that
            is not ``key=value``.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    bad = [item for item in overrides if "=" not in item or item.startswith("=")]
    if bad:
        raise CliError(f"overrides must be key=value (e.g. max_duration=100ba), got {bad[0]!r}")
    try:
        base = OmegaConf.load(path)
    except FileNotFoundError:
        raise CliError(f"no config file {path}") from None
    except (OSError, YAMLError, OmegaConfBaseException, UnicodeDecodeError) as error:
        raise CliError(f"cannot read the config {path}: {' '.join(str(error).split())}") from None
    if not OmegaConf.is_dict(base):
        raise CliError(f"{path} must hold a mapping of config keys, not {type(OmegaConf.to_object(base)).__name__}")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, YAMLError) as error:
            raise CliError(f"bad override {item!r}: {' '.join(str(error).split())}") from None
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as error:
        raise CliError(f"bad override or interpolation: {' '.join(str(error).split())}") from None
