"""Small helpers below every other layer, without torch.

* :mod:`llm.utils.config`: typed configuration schemas (dataclasses read as OmegaConf structured
  configs) validated up front, with errors that name the full dotted path of the offending key.
* :mod:`llm.utils.pretrained`: registered model names and where a name or path loads from.
* :mod:`llm.utils.gguf`: GGUF files' metadata and tensor index (numpy and ``gguf``).
* :mod:`llm.utils.home`: ``$LLM_HOME``, where built kernels and caches go.
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
    one_of,
    positive,
    setting,
    to_dict,
)

__all__ = [
    "ConfigError", "all_of", "at_least", "each", "from_dict", "in_range", "join_path", "non_empty",
    "non_negative", "one_of", "positive", "setting", "to_dict",
]
