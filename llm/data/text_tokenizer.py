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


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with special tokens, a chat template and a padding side.

    Args:
        backend: the ``tokenizers.Tokenizer`` (kept as ``backend_tokenizer``, not copied).
        chat_template: a Jinja chat template (transformers' conventions), or None.
        padding_side: ``"left"`` (where a batch of prompts for generation needs it) or ``"right"``.
        **special_tokens: ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``: token strings
            of the vocabulary, or None.

    Ids, decoding and chat prompts equal ``PreTrainedTokenizerFast(tokenizer_object=backend,
    clean_up_tokenization_spaces=False, **special_tokens)``'s (tested), for the methods here.
    """

    is_fast = True
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, backend, *, chat_template: str | None = None, padding_side: str = "left",
                 **special_tokens: str | None):
        unknown = set(special_tokens) - set(ROLES)
        if unknown:
            raise TypeError(f"unknown special token roles {sorted(unknown)}; the roles are {list(ROLES)}")
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.padding_side = padding_side
        self.name_or_path = ""
        for role in ROLES:
            setattr(self, role, special_tokens.get(role))
        # as transformers does: a special token not yet added to the vocabulary is added, as special
        added = {str(t) for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(self.special_tokens_map.values()) if t not in added]
        if missing:
            from tokenizers import AddedToken

            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])

    # -- vocabulary ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

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

    def convert_ids_to_tokens(self, ids: int | Sequence[int]):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def _id(self, role: str) -> int | None:
        token = getattr(self, role)
        return None if token is None else self.convert_tokens_to_ids(token)

    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))

    @property
    def unk_token_id(self) -> int | None:
        return None if self.unk_token is None else self.backend_tokenizer.token_to_id(self.unk_token)

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

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, padding: bool | str = False,
                 return_tensors: str | None = None, return_attention_mask: bool = True) -> BatchEncoding:
        """``input_ids`` (and ``attention_mask``) of one text (lists) or of several (lists of lists,
        padded with the pad token on ``padding_side`` when ``padding``); ``return_tensors="pt"``:
        int64 tensors (several texts of different lengths need ``padding``).

        Raises:
            ValueError: texts of different lengths as tensors without padding, padding without a
                pad token, or another ``return_tensors`` than ``"pt"`` / None.
        """
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        ids = [e.ids for e in self.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
        masks = [[1] * len(row) for row in ids]
        if padding and len(texts) > 1:
            if self.pad_token_id is None:
                raise ValueError("padding needs a pad token, and this tokenizer has none")
            width = max(map(len, ids))
            for row, mask in zip(ids, masks):
                pad = width - len(row)
                row[:0 if self.padding_side == "left" else len(row)] = [self.pad_token_id] * pad
                mask[:0 if self.padding_side == "left" else len(mask)] = [0] * pad
        out = {"input_ids": ids[0] if single else ids}
        if return_attention_mask:
            out["attention_mask"] = masks[0] if single else masks
        if return_tensors is not None:
            if return_tensors != "pt":
                raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
            if len({len(row) for row in ids}) > 1:
                raise ValueError("texts of different lengths make tensors only with padding=True")
            import torch

            out = {k: torch.tensor([v] if single else v, dtype=torch.long) for k, v in out.items()}
        return BatchEncoding(out)

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (an int, a list or a 0-d or 1-d tensor)."""
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    # -- chat ------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tokenize: bool = True, add_generation_prompt: bool = False,
                            return_tensors: str | None = None, chat_template: str | None = None,
                            continue_final_message: bool = False, **kwargs):
        """A conversation (a list of ``{"role", "content"}`` messages, or a list of them) rendered
        by the chat template as transformers renders it (the same sandboxed Jinja environment:
        ``trim_blocks``, ``lstrip_blocks``, ``tojson``, ``raise_exception``, ``strftime_now``; the
        special tokens and ``kwargs`` as variables); with ``tokenize`` its ids, without special tokens
        added (a template writes its own), as a list or, with ``return_tensors="pt"``, a (1, n)
        int64 tensor.

        Raises:
            ValueError: the tokenizer has no chat template and none is given; a template's
                ``raise_exception``.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template: pass chat_template=, or give the model's "
                             "tokenizer (its tokenizer_config.json or GGUF file names one)")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        variables = {"tools": None, "documents": None, **self.special_tokens_map, **kwargs}
        rendered = []
        for chat in conversation if batched else [conversation]:
            text = _compiled(template).render(messages=list(chat), add_generation_prompt=add_generation_prompt,
                                              **variables)
            if continue_final_message:
                final = chat[-1]["content"]
                text = text[:text.rindex(final) + len(final)]
            rendered.append(text)
        if not tokenize:
            return rendered if batched else rendered[0]
        if return_tensors is not None:
            return self(rendered if batched else rendered[0], add_special_tokens=False, padding=True,
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

    def add(self, ids: Sequence[int]) -> str:
        """Take new ids; return the text they complete ("" while a character is incomplete)."""
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        now = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def pending(self) -> str:
        """The text of the ids not given yet, as decoded now (it may end in an incomplete
        character's replacement mark): ``text + pending()`` is the whole list's text."""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        return self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)[len(before):]


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
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
