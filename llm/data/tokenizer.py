"""Tokenizers for the corpus: byte-level BPE or characters, as Hugging Face fast tokenizers."""

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<unk>"
_MIN_BPE_VOCAB = 256 + 1  # every byte plus EOS_TOKEN


def _wrap(tokenizer: Tokenizer, **special_tokens: str) -> PreTrainedTokenizerFast:
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


def train_bpe_tokenizer(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE tokenizer on `text`; deterministic for the same text.

    The vocabulary holds the 256 byte tokens, `<|endoftext|>` (id 0: eos, bos and pad) and
    merges up to `vocab_size` entries (fewer if the text runs out of pairs to merge). Any
    string can be encoded, and `decode(encode(s)) == s`. Raises ValueError if `vocab_size`
    is below 257.
    """
    if vocab_size < _MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size must be at least {_MIN_BPE_VOCAB} (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    return _wrap(tokenizer)


def build_char_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per distinct character of `text`, in sorted order.

    Ids 0 and 1 are `<|endoftext|>` (eos, bos and pad) and `<unk>`, which any character not
    in `text` maps to. `decode(encode(s)) == s` for any `s` made of characters of `text`.
    """
    vocab = {token: i for i, token in enumerate([EOS_TOKEN, UNK_TOKEN, *sorted(set(text))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # `[\s\S]` rather than `.` so newlines are characters too.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([EOS_TOKEN, UNK_TOKEN])
    return _wrap(tokenizer, unk_token=UNK_TOKEN)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> None:
    """Save `tokenizer` to `directory` (created if needed) in Hugging Face format."""
    tokenizer.save_pretrained(directory)


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by `save_tokenizer`; it pads on the left, whatever the folder says.

    Raises FileNotFoundError if `directory` holds no `tokenizer.json`.
    """
    if not (Path(directory) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer in {directory} (expected tokenizer.json written by save_tokenizer)")
    return PreTrainedTokenizerFast.from_pretrained(directory, padding_side="left")
