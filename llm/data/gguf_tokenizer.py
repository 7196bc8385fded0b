"""The tokenizer stored in a GGUF file (llama.cpp's ``tokenizer.ggml.*`` metadata), rebuilt as a
:class:`~llm.data.text_tokenizer.TextTokenizer` (:func:`gguf_tokenizer`), without transformers."""

from __future__ import annotations

import os

from llm.data.text_tokenizer import TextTokenizer
from llm.utils.gguf import field as _field
from llm.utils.gguf import read_gguf
from llm.utils.memory import collector_paused, release_freed_memory

# Names of tokenizer.ggml.pre (llama.cpp's pre-tokenizer types) that we reproduce with the
# `tokenizers` library, grouped by llama.cpp's regexes (llama-vocab.cpp).
_GPT2_REGEX_PRE = ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion")
# Each digit on its own, then GPT-2's regex.
_DIGITS_GPT2_REGEX_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE_TOKENIZERS = _GPT2_REGEX_PRE + _DIGITS_GPT2_REGEX_PRE + _LLAMA3_PRE

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4


@collector_paused()
def gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in a GGUF file, as a :class:`~llm.data.text_tokenizer.TextTokenizer`
    (transformers' ``PreTrainedTokenizerFast`` interface for inference, without importing
    transformers; ``to_transformers()`` converts it).

    It pads on the left and carries the vocabulary, merges, special tokens (bos / eos / unk / pad
    from ``tokenizer.ggml.*_token_id``), whether to prepend BOS / append EOS
    (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``) and the chat template
    (``tokenizer.chat_template``). Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``:
    SmolLM, Llama 3, ...) are rebuilt here with llama.cpp's pre-tokenizer regexes; SentencePiece
    ones (``"llama"``: Llama 2, Mistral, ...) go through transformers' GGUF converter.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_gguf`; ValueError for a file without a
            tokenizer or with a tokenizer model / pre-tokenizer that is not supported.
    """
    reader = read_gguf(path)
    kind = _field(reader, "tokenizer.ggml.model", None)
    if kind is None or "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"GGUF file {reader.path} holds no tokenizer (no tokenizer.ggml.model / tokens)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", None)

    def token(key):
        index = _field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"GGUF file {reader.path}: {key}_token_id {index} is outside the vocabulary")
        return tokens[int(index)]

    specials = {f"{key}_token": token(tid) for key, tid in
                (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    specials = {k: v for k, v in specials.items() if v is not None}
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))

    if kind == "gpt2":
        backend = _byte_level_bpe(reader, tokens, types)
    elif kind == "llama":
        backend = _sentencepiece_bpe(reader, tokens, types)
    else:
        raise ValueError(f"GGUF file {reader.path}: tokenizer model {kind!r} is not supported; supported: "
                         f"['gpt2', 'llama']")
    _set_post_processor(backend, specials.get("bos_token") if add_bos else None,
                        specials.get("eos_token") if add_eos else None)
    # padding on the left, where a batch of prompts for generation needs it
    tokenizer = TextTokenizer(backend, chat_template=_field(reader, "tokenizer.chat_template", None),
                              padding_side="left", **specials)
    del reader, tokens, types  # the metadata parsed (tens of MB for a large vocabulary): give it back
    release_freed_memory()
    return tokenizer


def _added_tokens(tokens, types):
    from tokenizers import AddedToken

    if types is None:
        return [], []
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    return special, user


def _byte_level_bpe(reader, tokens, types):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")
    # ByteLevel's own regex is GPT-2's; llama.cpp's "digits" group splits digits off first.
    add_prefix_space = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    if pre in _GPT2_REGEX_PRE:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)]
    elif pre in _DIGITS_GPT2_REGEX_PRE:
        steps = [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)]
    elif pre in _LLAMA3_PRE:
        steps = [pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)]
    else:
        raise ValueError(f"GGUF file {reader.path}: pre-tokenizer {pre!r} is not supported; supported: "
                         f"{sorted(SUPPORTED_PRE_TOKENIZERS)}")
    merges = [merge.split(" ") for merge in _field(reader, "tokenizer.ggml.merges", [])]
    bad = next((pair for pair in merges if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"GGUF file {reader.path}: malformed merge {' '.join(bad)!r}")
    merges = list(map(tuple, merges))
    # a token listed twice keeps its first id: the later assignment, walking backwards
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    special, user = _added_tokens(tokens, types)
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend


def _sentencepiece_bpe(reader, tokens, types):
    from transformers.integrations.ggml import convert_gguf_tokenizer

    info = {"tokenizer_type": "llama", "tokens": tokens}
    for key, ours in (("scores", "scores"), ("token_type", "token_type"), ("merges", "merges"),
                      ("unknown_token_id", "unk_token_id"), ("bos_token_id", "bos_token_id"),
                      ("eos_token_id", "eos_token_id"), ("add_space_prefix", "add_prefix_space")):
        value = _field(reader, f"tokenizer.ggml.{key}", None)
        if value is not None:
            info[ours] = value
    backend, _ = convert_gguf_tokenizer("llama", info)
    return backend


def _set_post_processor(backend, bos: str | None, eos: str | None) -> None:
    """Prepend BOS / append EOS exactly as the file asks (transformers' GGUF converter does not)."""
    from tokenizers import processors

    if bos is None and eos is None:
        if backend.post_processor is not None:
            backend.post_processor = processors.Sequence([])
        return
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = single + " " + " ".join([*([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
