import pytest
import torch

from llm.data import (
    EOS_TOKEN,
    UNK_TOKEN,
    build_char_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)


def test_char_tokenizer_vocab_and_ids():
    tok = build_char_tokenizer("ba\n a")
    assert tok.get_vocab() == {EOS_TOKEN: 0, UNK_TOKEN: 1, "\n": 2, " ": 3, "a": 4, "b": 5, "<|im_start|>": 6,
                               "<|im_end|>": 7}
    assert tok("ab\n\n  ab")["input_ids"] == [4, 5, 2, 2, 3, 3, 4, 5]
    assert tok("aZb")["input_ids"] == [4, 1, 5]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.unk_token_id) == (0, 0, 0, 1)


def test_char_tokenizer_roundtrip_real_text(char_tokenizer, validation_text):
    excerpt = validation_text[:20_000]
    ids = char_tokenizer(excerpt)["input_ids"]
    assert len(ids) == len(excerpt)
    assert char_tokenizer.unk_token_id not in ids
    assert char_tokenizer.decode(ids) == excerpt


def test_bpe_roundtrip_real_text(bpe_tokenizer, validation_text):
    assert len(bpe_tokenizer) == 512
    # Validation text is unseen by the tokenizer; bytes it never saw must still roundtrip.
    for text in (validation_text[:20_000], "  Hark! 'tis — naïve 漢字\n\n\tend "):
        ids = bpe_tokenizer(text)["input_ids"]
        assert bpe_tokenizer.decode(ids) == text
    # Even 255 merges compress: well under one token per character.
    assert len(bpe_tokenizer(validation_text[:20_000])["input_ids"]) < 0.6 * 20_000


def test_bpe_is_deterministic(bpe_tokenizer, train_text):
    again = train_bpe_tokenizer(train_text[:300_000], vocab_size=512)
    assert again.backend_tokenizer.to_str() == bpe_tokenizer.backend_tokenizer.to_str()
    assert bpe_tokenizer.convert_ids_to_tokens(0) == EOS_TOKEN
    assert bpe_tokenizer.eos_token_id == bpe_tokenizer.bos_token_id == bpe_tokenizer.pad_token_id == 0


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_load_roundtrip(kind, char_tokenizer, bpe_tokenizer, validation_text, tmp_path):
    tok = {"char": char_tokenizer, "bpe": bpe_tokenizer}[kind]
    save_tokenizer(tok, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    excerpt = validation_text[:5_000]
    assert loaded(excerpt)["input_ids"] == tok(excerpt)["input_ids"]
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == (EOS_TOKEN,) * 3
    batch = loaded(excerpt[:50], return_tensors="pt")
    assert set(batch) == {"input_ids", "attention_mask"}
    assert batch["input_ids"].dtype == torch.long
    assert loaded.batch_decode(batch["input_ids"]) == [excerpt[:50]]


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_left_padding(kind, char_tokenizer, bpe_tokenizer, tmp_path):
    save_tokenizer({"char": char_tokenizer, "bpe": bpe_tokenizer}[kind], tmp_path)
    tok = load_tokenizer(tmp_path)
    tok.padding_side = "left"
    texts = ["a", "To be, or not"]
    long_ids = tok(texts[1])["input_ids"]
    batch = tok(texts, padding=True, return_tensors="pt")
    n = len(long_ids)
    assert batch["input_ids"].tolist() == [[0] * (n - 1) + tok("a")["input_ids"], long_ids]
    assert batch["attention_mask"].tolist() == [[0] * (n - 1) + [1], [1] * n]
    assert tok.batch_decode(batch["input_ids"], skip_special_tokens=True) == texts
