"""Optional parts of the package and the pip extras that bring them: ``pip install
'mosaicgpt-llm[train]'`` (Composer, MosaicML Streaming, Parquet, plots) and ``[serve]`` (the HTTP
server); the core (torch, tokenizers, safetensors, transformers' tokenizers, GGUF) runs models.
"""

from __future__ import annotations

import importlib

#: extra -> what it is for, in a message
EXTRAS = {"train": "training, evaluation and data preparation", "serve": "the HTTP server"}


class MissingExtra(ImportError):
    """A part of the package was imported without the pip extra that brings its libraries."""


def require(extra: str, *modules: str) -> None:
    """Import ``modules``, or say which extra to install.

    Raises:
        MissingExtra: naming the extra (``pip install 'mosaicgpt-llm[EXTRA]'``) and the missing module.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise MissingExtra(f"{EXTRAS[extra]} needs the {extra!r} extra: pip install 'mosaicgpt-llm[{extra}]' "
                               f"(missing {err.name or name})") from None
