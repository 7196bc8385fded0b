"""What ties a tokenizer to a model: the digest of the tokenizer saved with its weights, and the check
that a tokenizer's ids fit a model's vocabulary; and the common prefix of two token id lists.
Standard library only, so that every layer (the cache, the tokenizer loader, the bundle, the
server) applies the same rule."""

from __future__ import annotations

import hashlib
import json

#: The weights' metadata key (``model.safetensors``) of the digest of the tokenizer saved with them.
TOKENIZER_DIGEST_KEY = "llm.tokenizer_sha256"


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two lists of token ids."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 (hex) of what decides a tokenizer's token ids.

    Args:
        tokenizer: a transformers fast tokenizer or a ``tokenizers.Tokenizer``.

    Returns:
        The digest of its ``tokenizer.json`` (vocabulary, merges, normalizer, pre-tokenizer,
        added tokens, post-processor) without the padding and truncation settings, which
        transformers rewrites whenever the tokenizer is called with other ones.
    """
    spec = json.loads(getattr(tokenizer, "backend_tokenizer", tokenizer).to_str())
    spec.pop("padding", None)
    spec.pop("truncation", None)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def tokenizer_misfit(tokenizer, vocab_size: int, saved_digest: str | None, name: str) -> str | None:
    """Why ``tokenizer`` is not the tokenizer of a model with ``vocab_size`` rows whose weights were
    saved with a tokenizer of ``saved_digest`` (None: none recorded), or None when it fits.

    It does not fit when its :func:`tokenizer_digest` differs from the saved one (another tokenizer
    copied into the folder), or when it makes ids past the vocabulary (more tokens than the model has
    rows, or a special token beyond them). A smaller tokenizer can be the model's (vocabularies padded
    to a multiple of 64, as GPT-2's). ``name``: how the user named it, for the message.
    """
    if saved_digest is not None and tokenizer_digest(tokenizer) != saved_digest:
        return (f"the tokenizer in {name} is not the one saved with its weights (another tokenizer copied into "
                f"the folder?): its token ids would mean other text to the model")
    size = len(tokenizer)
    if size > vocab_size:
        return (f"the tokenizer of {name} has {size} tokens, more than the model's vocabulary of {vocab_size}: "
                f"it is not this model's tokenizer")
    for role in ("eos_token", "bos_token", "pad_token", "unk_token"):
        index = getattr(tokenizer, role + "_id", None)
        if index is not None and not 0 <= index < vocab_size:
            return (f"the tokenizer of {name} gives its {role} the id {index}, outside the model's vocabulary of "
                    f"{vocab_size}: it is not this model's tokenizer")
    return None
