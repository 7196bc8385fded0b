"""Tokenizers: one way to load one (:func:`load_tokenizer`), to build or train one (``char``,
``bpe:VOCAB_SIZE``), to save one next to prepared shards with a hash of its definition (so corpora
prepared separately with the same tokenizer can be recognised as mixable), and to encode batches of
documents on parallel threads.

:func:`load_tokenizer` takes a ``tokenizer.json`` file, a transformers tokenizer folder, a model
bundle written by ``MosaicGPT.save_pretrained(dir, tokenizer=...)``, a prepared dataset folder (its
tokenizer), a registered pretrained name or a ``.gguf`` file
(:func:`llm.data.gguf_tokenizer.gguf_tokenizer`). A GGUF file's tokenizer, a bare ``tokenizer.json``
and a plain ``PreTrainedTokenizerFast`` folder (what ``save_pretrained`` writes for ours) load as a
:class:`~llm.data.text_tokenizer.TextTokenizer`, without importing transformers; other folders
through transformers. Built tokenizers are Hugging Face fast tokenizers with one token as eos, bos
and pad (as GPT-2), padding on the left (where a batch of prompts for generation needs it).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from llm.data.gguf_tokenizer import gguf_tokenizer
from llm.data.text_tokenizer import ROLES, TextTokenizer
from llm.data.sources import DataError
from llm.io import atomic_write
from llm.utils.pretrained import PRETRAINED, resolve
from llm.utils.tokens import TOKENIZER_DIGEST_KEY, tokenizer_misfit

if TYPE_CHECKING:  # transformers loads when a tokenizer is made: a second of `import llm` otherwise
    from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<unk>"
#: ChatML's turn markers, which every tokenizer trained here reserves (last ids) for fine-tuning on chats.
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
#: ChatML (as SmolLM2 and Qwen write it, without a default system message): each message is
#: ``<|im_start|>ROLE\nCONTENT<|im_end|>\n``; a generation prompt opens the assistant's turn.
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")
_MIN_BPE_VOCAB = 256 + 1 + len(CHATML_TOKENS)  # every byte, EOS_TOKEN and the ChatML markers
INFO_FILE = "llm_tokenizer.json"
LOAD_FORMS = ("a tokenizer.json file, a transformers tokenizer folder, a model bundle folder, a prepared "
              f"dataset folder, a registered name ({', '.join(PRETRAINED)}) or a .gguf file")
SPEC_FORMS = f"{LOAD_FORMS}; or bpe:VOCAB_SIZE or char to train one while preparing data"
# A bare tokenizer.json names no eos token: the first of these in its vocabulary is taken as one.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
_SPECIAL_ROLES = ("eos_token", "bos_token", "pad_token", "unk_token")
T = TypeVar("T")
_PARALLELISM = "TOKENIZERS_PARALLELISM"
_UMASK = os.umask(0)
os.umask(_UMASK)


class TokenizerNotFoundError(DataError, FileNotFoundError):
    """:func:`load_tokenizer` found no tokenizer where it was pointed (both a ``ValueError`` and a
    ``FileNotFoundError``)."""


def _wrap(tokenizer: Tokenizer, **special_tokens: str) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    # One token serves as eos, bos and pad, as in GPT-2; no cleanup so decode inverts encode;
    # no token_type_ids, which a decoder-only model does not take; padding on the left, where a
    # batch of prompts for generation needs it (transformers' default is the right).
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        model_input_names=["input_ids", "attention_mask"],
        padding_side="left",
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        **special_tokens,
    )


def build_char_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per distinct character of `text`, in sorted order.

    Ids 0 and 1 are `<|endoftext|>` (eos, bos and pad) and `<unk>`, which any character not
    in `text` maps to; the last two are :data:`CHATML_TOKENS`. `decode(encode(s)) == s` for any
    `s` made of characters of `text`.
    """
    vocab = {token: i for i, token in enumerate([EOS_TOKEN, UNK_TOKEN, *sorted(set(text)), *CHATML_TOKENS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # `[\s\S]` rather than `.` so newlines are characters too.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([EOS_TOKEN, UNK_TOKEN, *CHATML_TOKENS])
    return _wrap(tokenizer, unk_token=UNK_TOKEN)


def train_bpe_tokenizer(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE tokenizer on `text`: :func:`train_tokenizer` with
    ``bpe:{vocab_size}``.

    The vocabulary holds the 256 byte tokens, `<|endoftext|>` (id 0: eos, bos and pad), merges
    and, last, :data:`CHATML_TOKENS`, up to `vocab_size` entries (fewer merges if the text runs
    out of pairs to merge). Any
    string can be encoded, and `decode(encode(s)) == s`. Raises ValueError (DataError) if
    `vocab_size` is below 259.
    """
    return train_tokenizer(f"bpe:{vocab_size}", [text])


def trained_spec(spec: str) -> tuple[str, int | None] | None:
    """``("bpe", vocab_size)`` for ``bpe:VOCAB_SIZE``, ``("char", None)`` for ``char``, None for
    a spec to load. Raises DataError for ``bpe`` without a valid size (at least 257)."""
    if spec == "char":
        return "char", None
    if spec == "bpe" or spec.startswith("bpe:"):
        size = spec.partition(":")[2]
        if not size.isdigit() or int(size) < _MIN_BPE_VOCAB:
            raise DataError(f"tokenizer spec {spec!r}: bpe needs an integer vocabulary size of at least "
                            f"{_MIN_BPE_VOCAB} (256 bytes, {EOS_TOKEN} and {' '.join(CHATML_TOKENS)}), as in bpe:8192")
        return "bpe", int(size)
    return None


def load_tokenizer(name_or_path: str | os.PathLike) -> PreTrainedTokenizerFast | TextTokenizer:
    """The tokenizer ``name_or_path`` names (any of :data:`LOAD_FORMS`, see the module doc), padding
    on the left whatever its folder says: a :class:`~llm.data.text_tokenizer.TextTokenizer` where
    that gives transformers' own ids and text without transformers (see the module doc), else a
    transformers fast tokenizer.

    An existing path wins over a registered name. A bare ``tokenizer.json`` takes as eos token
    the first of :data:`EOS_CANDIDATES` in its vocabulary.

    Raises:
        TokenizerNotFoundError: (a FileNotFoundError and a DataError) no such file or folder and
            not a registered name, or a folder with no tokenizer in it.
        FileNotFoundError: a registered name whose file is not fetched yet.
        DataError: naming it and the allowed forms, for a tokenizer that cannot be loaded; or, for
            a model folder, naming why its tokenizer is not the model's (another tokenizer copied in:
            :func:`~llm.utils.tokens.tokenizer_misfit`).
    """
    spec, path = str(name_or_path), Path(name_or_path)
    if not path.exists() and spec not in PRETRAINED:
        raise TokenizerNotFoundError(f"cannot load tokenizer {spec!r}: no such file or folder, and not a registered "
                                     f"name; a tokenizer is {SPEC_FORMS}")
    try:
        if path.is_file() and path.suffix.lower() == ".json":
            tokenizer = _from_tokenizer_file(path)
        elif path.is_dir():
            tokenizer = _from_folder(path / "tokenizer" if (path / "llm_data.json").is_file() else path)
            _check_bundle_fit(tokenizer, path)
        else:  # a .gguf file or a registered name
            tokenizer = gguf_tokenizer(resolve(spec)[1])
    except (DataError, FileNotFoundError):
        raise
    except Exception as e:  # transformers, tokenizers and gguf raise many kinds: all mean a bad spec
        reason = " ".join(str(e).split())[:300]
        raise DataError(f"cannot load tokenizer {spec!r} ({type(e).__name__}: {reason}); a tokenizer is "
                        f"{SPEC_FORMS}") from None
    tokenizer.padding_side = "left"
    return tokenizer


def _check_bundle_fit(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """In a model bundle (``config.yaml`` and ``model.safetensors``), raise DataError when the tokenizer
    is not the model's: another digest than the one saved with the weights, or ids past its vocabulary."""
    weights, config = folder / "model.safetensors", folder / "config.yaml"
    if not (weights.is_file() and config.is_file()):
        return
    from safetensors import safe_open

    from llm.config import MosaicGPTConfig

    try:
        vocab_size = MosaicGPTConfig.load(config).vocab_size
        with safe_open(str(weights), framework="numpy") as f:
            saved = (f.metadata() or {}).get(TOKENIZER_DIGEST_KEY)
    except Exception:  # not one of our bundles, or a damaged one: loading the model says what is wrong
        return
    problem = tokenizer_misfit(tokenizer, vocab_size, saved, str(folder))
    if problem is not None:
        raise DataError(problem)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | os.PathLike) -> None:
    """Save `tokenizer` to `directory` (created if needed) in Hugging Face format."""
    tokenizer.save_pretrained(str(directory))


def _from_tokenizer_file(path: Path) -> TextTokenizer:
    backend = Tokenizer.from_file(str(path))
    vocab = backend.get_vocab(with_added_tokens=True)
    eos = next((token for token in EOS_CANDIDATES if token in vocab), None)
    if eos is None:
        raise DataError(f"tokenizer {str(path)!r} has no end-of-text token: a bare tokenizer.json names "
                        f"none and none of {list(EOS_CANDIDATES)} is in its vocabulary; pass its "
                        "transformers folder (whose tokenizer_config.json names eos_token) instead")
    return TextTokenizer(backend, padding_side="right", eos_token=eos)


def _from_folder(path: Path) -> PreTrainedTokenizerFast | TextTokenizer:
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise TokenizerNotFoundError(f"cannot load tokenizer {str(path)!r}: the folder holds no tokenizer "
                                     f"(tokenizer.json or tokenizer_config.json); a tokenizer is {SPEC_FORMS}")
    plain = _plain_folder(path)
    if plain is not None:
        return plain
    from transformers import PreTrainedTokenizerFast

    if _plain_fast_class(path):
        # What AutoTokenizer does for this config, without importing it: AutoTokenizer's imports
        # (accelerate, sympy, ...) would add some 180 MB to the memory of a preparing process.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), _from_auto=True)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise DataError(f"tokenizer folder {str(path)!r} gives a slow (Python) tokenizer, "
                        f"{type(tokenizer).__name__}; preparation needs a fast one (with tokenizer.json)")
    return tokenizer


def _plain_folder(path: Path) -> TextTokenizer | None:
    """The folder's tokenizer as a :class:`TextTokenizer`, without transformers, where transformers
    would give exactly that: a ``PreTrainedTokenizerFast`` folder (no remote code) whose config
    names the four special tokens we know as strings or none, and no other, no extra special
    tokens, no clean-up of decoded spaces, no ``add_prefix_space``, no split special tokens, the
    default model inputs and one chat template or none, with a ``tokenizer.json`` holding every
    added token the config lists exactly as listed, each special token among them as special
    (what ``save_pretrained`` of our tokenizers writes); else None, for transformers to load."""
    config = _config(path)
    others = ("additional_special_tokens", "extra_special_tokens", "mask_token", "sep_token", "cls_token",
              "split_special_tokens")
    if not (config.get("tokenizer_class") == "PreTrainedTokenizerFast" and "auto_map" not in config
            and config.get("clean_up_tokenization_spaces") is False and (path / "tokenizer.json").is_file()
            and not any(config.get(k) not in (None, {}, []) for k in others) and "add_prefix_space" not in config
            and config.get("model_input_names", TextTokenizer.model_input_names) == TextTokenizer.model_input_names
            and not (path / "chat_template.json").is_file() and not (path / "additional_chat_templates").exists()):
        return None
    specials = {role: config[role] for role in ROLES if config.get(role) is not None}
    if not all(isinstance(v, str) for v in specials.values()):
        return None
    # transformers reads the legacy map too: it must agree (its entries may be AddedToken dicts, whose
    # flags do not matter for a token tokenizer.json holds already, as checked below)
    legacy = _config(path, "special_tokens_map.json")
    if any((v.get("content") if isinstance(v, dict) else v) != specials.get(k) for k, v in legacy.items()):
        return None
    template = config.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        return None
    backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    added = {str(i): t for i, t in backend.get_added_tokens_decoder().items()}
    flags = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
    for i, listed in (config.get("added_tokens_decoder") or {}).items():
        token = added.get(str(i))
        if not isinstance(listed, dict) or token is None or any(
                listed.get(f) != (str(token) if f == "content" else getattr(token, f)) for f in flags):
            return None
    special = {str(t) for t in added.values() if t.special}
    if not all(v in special for v in specials.values()):
        return None
    tokenizer = TextTokenizer(backend, chat_template=template, padding_side=config.get("padding_side", "right"),
                              **specials)
    tokenizer.name_or_path = str(path)
    if isinstance(config.get("model_max_length"), int):
        tokenizer.model_max_length = config["model_max_length"]
    return tokenizer


def _config(path: Path, name: str = "tokenizer_config.json") -> dict:
    """A folder's JSON file as a dict ({} when absent or not a JSON object)."""
    try:
        config = json.loads((path / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _plain_fast_class(path: Path) -> bool:
    """Whether the folder's ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` and no
    ``auto_map`` (remote code): then ``AutoTokenizer`` just calls that class's ``from_pretrained``."""
    config = _config(path)
    return config.get("tokenizer_class") == "PreTrainedTokenizerFast" and "auto_map" not in config


def train_tokenizer(spec: str, texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """Train the tokenizer ``spec`` asks for (``bpe:VOCAB_SIZE`` or ``char``) on ``texts``,
    consumed once as a stream; nothing holds the whole corpus.

    ``bpe:N`` is a GPT-2 style byte-level BPE trained with ``Tokenizer.train_from_iterator``;
    ``char`` is :func:`build_char_tokenizer` over the set of characters seen. Both have ``<|endoftext|>`` as eos (and bos and pad)
    and reserve :data:`CHATML_TOKENS` (the last ids) for fine-tuning on chats.
    Deterministic for the same texts in the same order. Raises DataError for another spec.
    """
    kind = trained_spec(spec)
    if kind is None:
        raise DataError(f"tokenizer spec {spec!r} names a tokenizer to load, not one to train (bpe:N or char)")
    if kind[0] == "char":
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return build_char_tokenizer("".join(sorted(chars)))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=kind[1] - len(CHATML_TOKENS), special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens(list(CHATML_TOKENS))
    return _wrap(tokenizer)


def eos_token_id(tokenizer: PreTrainedTokenizerFast, spec: str = "") -> int:
    """The id of the tokenizer's end-of-text token (its ``eos_token``), which ends every document.

    Raises DataError (naming ``spec``) if it has none."""
    token = tokenizer.special_tokens_map.get("eos_token")
    index = tokenizer.convert_tokens_to_ids(token) if token is not None else None
    if index is None:
        raise DataError(f"tokenizer {spec!r} has no end-of-text (eos) token, which preparation puts after "
                        "every document; use a tokenizer that defines eos_token, or bpe:N / char")
    return int(index)


def tokenizer_hash(tokenizer: PreTrainedTokenizerFast) -> str:
    """SHA-256 (hex) of the tokenizer's canonical definition: the backend tokenizer's JSON
    (``to_str()``, keys sorted, without its padding and truncation settings, which belong to a call
    rather than to the vocabulary) and its eos / bos / pad / unk tokens.

    Two tokenizers with the same hash give the same ids for any text, so their data can be mixed."""
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    definition.pop("padding", None)
    definition.pop("truncation", None)
    specials = {role: tokenizer.special_tokens_map.get(role) for role in _SPECIAL_ROLES}
    canonical = json.dumps({"tokenizer": definition, "special_tokens": specials}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def save_prepared_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | os.PathLike, spec: str) -> dict:
    """Save ``tokenizer`` to ``directory`` as a transformers folder plus :data:`INFO_FILE`
    ``{"hash", "spec", "vocab_size", "eos_token_id"}``, and return that dict.

    The hash is that of the tokenizer read back from ``directory``, so it is what anyone loading
    the folder (e.g. ``--tokenizer DIR/tokenizer``) gets."""
    directory = Path(directory)
    tokenizer.save_pretrained(str(directory))
    saved = _from_folder(directory)
    info = {"hash": tokenizer_hash(saved), "spec": spec, "vocab_size": len(saved),
            "eos_token_id": eos_token_id(saved, spec)}
    atomic_write(directory / INFO_FILE, lambda tmp: _write_info(Path(tmp), info))
    return info


def _write_info(path: Path, info: dict) -> None:
    path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    os.chmod(path, 0o666 & ~_UMASK)  # atomic_write's temporary files are private (0600)


def load_prepared_tokenizer(directory: str | os.PathLike) -> tuple[PreTrainedTokenizerFast, dict]:
    """The tokenizer saved by :func:`save_prepared_tokenizer` in ``directory`` and its info dict.

    Raises:
        DataError: if ``directory`` holds no :data:`INFO_FILE`, or the tokenizer's hash differs
            from the recorded one (it was changed after preparation).
    """
    directory = Path(directory)
    info_file = directory / INFO_FILE
    if not info_file.is_file():
        raise DataError(f"no {INFO_FILE} in {directory}: not a tokenizer saved by data preparation")
    info = json.loads(info_file.read_text(encoding="utf-8"))
    tokenizer = _from_folder(directory)
    if tokenizer_hash(tokenizer) != info["hash"]:
        raise DataError(f"the tokenizer in {directory} changed after preparation: its hash differs from "
                        f"the one in {INFO_FILE}")
    return tokenizer, info


class BatchEncoder:
    """Encodes batches of texts into token ids, each text followed by the tokenizer's eos id, on
    ``workers`` threads, always in the order given.

    Each thread encodes a batch of its own with ``encode_batch_fast`` on one CPU (tokenizers' own
    Rust thread pool is off while the encoder is entered, so ``workers`` is the number of CPUs
    encoding); the encoding itself runs without the GIL, so the threads overlap with each other
    and with the reading and writing in the calling thread. Use it as a context manager: entering
    starts the threads, leaving stops them. The backend tokenizer encodes without special tokens
    and without any saved padding or truncation.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, workers: int = 1):
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        # Padding or truncation settings saved with a tokenizer would change the ids of a batch.
        backend.no_padding()
        backend.no_truncation()
        self._definition, self._eos = backend.to_str(), eos_token_id(tokenizer)
        self._local = threading.local()
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._previous: str | None = None

    def __enter__(self) -> "BatchEncoder":
        # One Rust thread per worker: tokenizers reads this variable at every call.
        self._previous = os.environ.get(_PARALLELISM)
        os.environ[_PARALLELISM] = "false"
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="encode")
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            if self._previous is None:
                os.environ.pop(_PARALLELISM, None)
            else:
                os.environ[_PARALLELISM] = self._previous

    def map(self, batches: Iterable[tuple[tuple[list[str], list[bool] | None], T]]) -> Iterator[tuple[np.ndarray, T]]:
        """For each ``((texts, ends), tag)`` of ``batches``, ``(ids, tag)``: ``ids`` a 1-D uint32 array
        of every text's tokens, each followed by eos where ``ends`` says (``None``: after every text).
        At most two batches per worker are in flight, so memory stays bounded."""
        if self._pool is None:  # not entered: encode here
            for (texts, ends), tag in batches:
                yield self.encode(texts, ends), tag
            return
        window: deque = deque()
        for (texts, ends), tag in batches:
            window.append((self._pool.submit(self.encode, texts, ends), tag))
            if len(window) > 2 * self.workers:
                result, tag = window.popleft()
                yield result.result(), tag
        while window:
            result, tag = window.popleft()
            yield result.result(), tag

    def encode(self, texts: list[str], ends: list[bool] | None = None) -> np.ndarray:
        """Every text's ids, each followed by eos where ``ends`` is True (``None``: all), as one uint32
        array (in the calling thread). A text whose ``ends`` is False is a piece of a document that
        the next text continues (:class:`llm.data.sources.Document`)."""
        backend = getattr(self._local, "backend", None)
        if backend is None:  # one tokenizer per thread: no sharing of its cache between threads
            backend = self._local.backend = Tokenizer.from_str(self._definition)
        # encode_batch_fast: encode_batch's ids without computing character offsets (about 1.5x faster).
        encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
        eos = np.array([self._eos], dtype=np.uint32)
        ends = [True] * len(texts) if ends is None else ends
        # One small array per text is faster than extending one list with every id.
        return np.concatenate([part for encoding, end in zip(encodings, ends)
                               for part in (np.array(encoding.ids, dtype=np.uint32), eos[:end])] or [eos[:0]])
