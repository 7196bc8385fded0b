"""A tokenizer without transformers: a ``tokenizers.Tokenizer`` with its special tokens, chat template
and padding side, answering the part of transformers' ``PreTrainedTokenizerFast`` interface that
inference uses (:class:`TextTokenizer`).

A GGUF file's tokenizer (:func:`llm.data.gguf_tokenizer.gguf_tokenizer`) loads as one, so that
generating, chatting and serving a GGUF model never import transformers: its import and its copy
of the tokenizer cost a process about 0.6 s and 35 MiB. The ids, text and chat prompts are
transformers' own: a fast tokenizer calls the same ``tokenizers`` methods, and the chat template is
rendered in the same sandboxed Jinja environment. :meth:`TextTokenizer.to_transformers` gives the
transformers tokenizer where one is needed (saving a folder, llguidance).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from datetime import datetime

#: The special-token roles, in transformers' order (``SPECIAL_TOKENS_ATTRIBUTES``, the ones a
#: GGUF file can name).
ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")


class BatchEncoding(dict):
    """What calling a tokenizer returns, as transformers': a dict of ``input_ids`` and
    ``attention_mask`` whose keys are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def data(self) -> dict:
        return dict(self)

    def to(self, device) -> "BatchEncoding":
        """The tensors moved to ``device`` (transformers' ``BatchEncoding.to``)."""
        return BatchEncoding({k: v.to(device) if hasattr(v, "to") else v for k, v in self.items()})


#: transformers' ``VERY_LARGE_INTEGER``: the model_max_length of a tokenizer that names none.
_NO_LIMIT = int(1e30)


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with special tokens, a chat template and a padding side.

    Args:
        backend: the ``tokenizers.Tokenizer`` (kept as ``backend_tokenizer``, not copied).
        chat_template: a Jinja chat template (transformers' conventions), or None.
        padding_side: ``"left"`` (where a batch of prompts for generation needs it) or ``"right"``.
        **special_tokens: ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``: token strings
            of the vocabulary, or None.

    Ids, decoding and chat prompts equal ``PreTrainedTokenizerFast(tokenizer_object=backend,
    clean_up_tokenization_spaces=False, **special_tokens)``'s (tested), for the methods here;
    options these methods do not implement (truncation, text pairs, ``continue_final_message``,
    ``return_dict``, tools...) and any other attribute of that class are answered by it
    (:meth:`to_transformers`, which imports transformers).
    """

    is_fast = True
    model_input_names = ["input_ids", "attention_mask"]
    model_max_length = _NO_LIMIT

    def __init__(self, backend, *, chat_template: str | None = None, padding_side: str = "left",
                 **special_tokens: str | None):
        unknown = set(special_tokens) - set(ROLES)
        if unknown:
            raise TypeError(f"unknown special token roles {sorted(unknown)}; the roles are {list(ROLES)}")
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.padding_side = padding_side
        self.name_or_path = ""
        if backend.padding is not None:  # as transformers: a saved padding names the pad token
            special_tokens.setdefault("pad_token", backend.padding.get("pad_token"))
        for role in ROLES:
            setattr(self, role, special_tokens.get(role))
        # transformers sets padding and truncation at each call: none unless asked
        backend.no_padding()
        backend.no_truncation()
        # as transformers does: a special token not yet added to the vocabulary is added, as special
        added = {str(t) for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(self.special_tokens_map.values()) if t not in added]
        if missing:
            from tokenizers import AddedToken

            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        # and a top-level pre-tokenizer's add_prefix_space is set to transformers' default, False
        try:
            state = json.loads(backend.pre_tokenizer.__getstate__())
            if state.get("add_prefix_space", False):
                from tokenizers import pre_tokenizers

                kind = getattr(pre_tokenizers, state.pop("type"))
                backend.pre_tokenizer = kind(**{**state, "add_prefix_space": False})
        except Exception:  # no pre-tokenizer, or one that cannot be rebuilt (as transformers, left as it is)
            pass

    def __getattr__(self, name):
        # what this class does not implement, transformers' tokenizer answers
        if name.startswith("__") or "backend_tokenizer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.to_transformers(), name)

    # -- vocabulary ------------------------------------------------------------------------------
    def __len__(self) -> int:
        # get_vocab_size(with_added_tokens=True)'s number, the distinct strings of the model's
        # vocabulary and the added tokens, without building that vocabulary (9 ms for 49k tokens)
        # where the model's vocabulary is a map (BPE, WordLevel, WordPiece: no string twice; a
        # Unigram list may hold one twice)
        backend = self.backend_tokenizer
        if type(backend.model).__name__ not in ("BPE", "WordLevel", "WordPiece"):
            return backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder().values()
        return backend.get_vocab_size(with_added_tokens=False) + sum(
            1 for token in added if backend.model.token_to_id(token.content) is None)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        """id -> ``tokenizers.AddedToken`` of the tokens added to the vocabulary."""
        return self.backend_tokenizer.get_added_tokens_decoder()

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
        """The id of a token (the unknown token's id, or None, for one not in the vocabulary), or a
        list of them."""
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in special]

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without added tokens (transformers' ``vocab_size``)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def _id(self, role: str) -> int | None:
        token = getattr(self, role)
        return None if token is None else self.convert_tokens_to_ids(token)

    def _set_id(self, role: str, index: int | None) -> None:
        setattr(self, role, None if index is None else self.convert_ids_to_tokens(int(index)))

    bos_token_id = property(lambda self: self._id("bos_token"), lambda self, i: self._set_id("bos_token", i))
    eos_token_id = property(lambda self: self._id("eos_token"), lambda self, i: self._set_id("eos_token", i))
    pad_token_id = property(lambda self: self._id("pad_token"), lambda self, i: self._set_id("pad_token", i))

    @property
    def unk_token_id(self) -> int | None:
        return None if self.unk_token is None else self.backend_tokenizer.token_to_id(self.unk_token)

    @unk_token_id.setter
    def unk_token_id(self, index: int | None) -> None:
        self._set_id("unk_token", index)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """role -> token of the roles that have one (transformers' ``special_tokens_map``)."""
        return {role: getattr(self, role) for role in ROLES if getattr(self, role) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    # -- encoding and decoding -------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; with ``add_special_tokens`` the tokenizer's post-processor adds what
        it adds (a BOS, say)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], text_pair=None, add_special_tokens: bool = True,
                 padding: bool | str = False, return_tensors: str | None = None, return_attention_mask: bool = True,
                 **kwargs) -> BatchEncoding:
        """``input_ids`` (and ``attention_mask``) of one text (lists) or of several (lists of lists,
        padded with the pad token on ``padding_side`` when ``padding`` is True or ``"longest"``);
        ``return_tensors="pt"``: int64 tensors (several texts of different lengths need
        ``padding``). Other options (a text pair, truncation, ``"max_length"`` padding, other tensor
        types) are transformers' tokenizer's to answer.

        Raises:
            ValueError: texts of different lengths as tensors without padding, padding without a
                pad token.
        """
        if text_pair is not None or kwargs or return_tensors not in (None, "pt") or \
                padding not in (True, False, "longest", "do_not_pad"):
            return self.to_transformers()(text, text_pair, add_special_tokens=add_special_tokens, padding=padding,
                                          return_tensors=return_tensors, return_attention_mask=return_attention_mask,
                                          **kwargs)
        padding = padding not in (False, "do_not_pad")
        if padding and self.pad_token_id is None:
            raise ValueError("Asking to pad but the tokenizer does not have a padding token: set pad_token or "
                             "pass padding=False")
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        ids = [e.ids for e in self.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
        masks = [[1] * len(row) for row in ids]
        if padding and len(texts) > 1:
            width = max(map(len, ids))
            for row, mask in zip(ids, masks):
                pad = width - len(row)
                at = 0 if self.padding_side == "left" else len(row)
                row[at:at] = [self.pad_token_id] * pad
                mask[at:at] = [0] * pad
        out = {"input_ids": ids[0] if single else ids}
        if return_attention_mask:
            out["attention_mask"] = masks[0] if single else masks
        if return_tensors is not None:
            if len({len(row) for row in ids}) > 1:
                raise ValueError("texts of different lengths make tensors only with padding=True")
            import torch

            out = {k: torch.tensor([v] if single else v, dtype=torch.long) for k, v in out.items()}
        return BatchEncoding(out)

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        """The text of ``token_ids`` (an int, a list or a 0-d or 1-d tensor); with
        ``clean_up_tokenization_spaces`` transformers' clean-up of spaces before punctuation."""
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces:  # transformers' clean_up_tokenization
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                                  (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
                     ) -> list[str]:
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    # -- chat ------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tokenize: bool = True, add_generation_prompt: bool = False,
                            return_tensors: str | None = None, chat_template: str | None = None,
                            padding: bool | str = False, **kwargs):
        """A conversation (a list of ``{"role", "content"}`` messages, or a list of them) rendered
        by the chat template as transformers renders it (the same sandboxed Jinja environment:
        ``trim_blocks``, ``lstrip_blocks``, ``tojson``, ``raise_exception``, ``strftime_now``; the
        special tokens and ``kwargs`` as variables); with ``tokenize`` its ids, without special tokens
        added (a template writes its own), as a list or, with ``return_tensors="pt"``, a (1, n)
        int64 tensor. Options of transformers' that shape more than this (``continue_final_message``,
        ``return_dict``, ``tools``, ``documents``, truncation...) are its tokenizer's to answer.

        Raises:
            ValueError: the tokenizer has no chat template and none is given.
            jinja2.TemplateError: a template's ``raise_exception``, as transformers'.
        """
        if any(kwargs.get(k) not in (None, False, {}) for k in _TRANSFORMERS_CHAT_OPTIONS):
            return self.to_transformers().apply_chat_template(
                conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                return_tensors=return_tensors, chat_template=chat_template, padding=padding, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in _TRANSFORMERS_CHAT_OPTIONS}
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template: pass chat_template=, or give the model's "
                             "tokenizer (its tokenizer_config.json or GGUF file names one)")
        batched = isinstance(conversation, (list, tuple)) and bool(conversation) and \
            isinstance(conversation[0], (list, tuple))
        variables = {"tools": None, "documents": None, **self.special_tokens_map, **kwargs}
        rendered = [_compiled(template).render(messages=list(chat), add_generation_prompt=add_generation_prompt,
                                               **variables) for chat in (conversation if batched else [conversation])]
        if not tokenize:
            return rendered if batched else rendered[0]
        if return_tensors is not None:
            return self(rendered if batched else rendered[0], add_special_tokens=False, padding=padding,
                        return_tensors=return_tensors)["input_ids"]
        ids = [self.encode(text, add_special_tokens=False) for text in rendered]
        return ids if batched else ids[0]

    # -- transformers ----------------------------------------------------------------------------
    def to_transformers(self):
        """This tokenizer as a transformers ``PreTrainedTokenizerFast`` (imports transformers): a
        copy of the backend with the same special tokens, chat template and padding side."""
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=self.backend_tokenizer,
                                            model_input_names=list(self.model_input_names),
                                            padding_side=self.padding_side, clean_up_tokenization_spaces=False,
                                            **self.special_tokens_map)
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        return tokenizer

    def save_pretrained(self, directory: str | os.PathLike) -> tuple[str, ...]:
        """Save as a transformers tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``,
        ``special_tokens_map.json``): :meth:`to_transformers`'s ``save_pretrained``."""
        return self.to_transformers().save_pretrained(str(directory))

    def __repr__(self) -> str:
        return (f"TextTokenizer(vocab_size={len(self)}, special_tokens={self.special_tokens_map}, "
                f"padding_side={self.padding_side!r}, chat_template={'yes' if self.chat_template else 'no'})")


class IncrementalText:
    """The text of a growing list of token ids, each new piece decoded over a short window of ids
    rather than the whole list again (vLLM's incremental detokenization): a stream's decoding costs
    the same per token at token 2,000 as at token 10.

    Each piece is the text of the ids since the last piece, decoded together with the ids of the
    piece before (so a decoder that treats the first token of a text apart, SentencePiece's
    leading space, sees it as in the whole text), and held back while it ends in an incomplete
    UTF-8 character. The pieces join to the whole list's text (tested against ``decode`` of it).

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        skip_special_tokens: as ``decode``'s.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the pieces given so far
        self._prefix = self._read = 0  # the window's start, and where the ids not yet given start
        self._decoded: dict[tuple[int, int], str] = {}  # the window's two texts, decoded once each

    def _text(self, start: int, end: int) -> str:
        key = (start, end)
        if key not in self._decoded:
            if len(self._decoded) >= 4:  # only the current window's are asked for again
                self._decoded.clear()
            self._decoded[key] = self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip)
        return self._decoded[key]

    def add(self, ids: Sequence[int]) -> str:
        """Take new ids; return the text they complete ("" while a character is incomplete)."""
        self.ids.extend(ids)
        before, now = self._text(self._prefix, self._read), self._text(self._prefix, len(self.ids))
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def pending(self) -> str:
        """The text of the ids not given yet, as decoded now (it may end in an incomplete
        character's replacement mark): ``text + pending()`` is the whole list's text."""
        before = self._text(self._prefix, self._read)
        return self._text(self._prefix, len(self.ids))[len(before):]


#: apply_chat_template's options that only transformers' tokenizer implements (given, it answers).
_TRANSFORMERS_CHAT_OPTIONS = ("continue_final_message", "return_dict", "return_assistant_tokens_mask", "tools",
                              "documents", "truncation", "max_length", "tokenizer_kwargs")


def as_transformers(tokenizer):
    """``tokenizer`` as a transformers tokenizer: a :class:`TextTokenizer` converted, any other
    returned as it is."""
    return tokenizer.to_transformers() if isinstance(tokenizer, TextTokenizer) else tokenizer


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The chat template compiled in transformers' environment (``_compile_jinja_template``)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body (transformers marks
        the assistant's tokens there, for training masks, which inference does not need)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
