"""Small helpers with no heavy dependencies (standard library only).

* :mod:`llm.utils.config`: typed configuration schemas (dataclasses) validated up front, with
  errors that name the full dotted path of the offending key.
"""

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
    positive,
    setting,
    to_dict,
)

__all__ = [
    "ConfigError", "all_of", "at_least", "each", "from_dict", "in_range", "join_path", "non_empty",
    "non_negative", "positive", "setting", "to_dict",
]
