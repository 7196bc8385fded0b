"""Tokenizer specs for data preparation: every form loads, trained ones stream, hashes survive saving."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from llm import MosaicGPT, MosaicGPTConfig
from llm.data import EOS_TOKEN, build_char_tokenizer, markdown_to_text, play_paths, train_bpe_tokenizer
from llm.data.sources import DataError
from llm.data.tokenizer import (
    INFO_FILE,
    eos_token_id,
    load_prepared_tokenizer,
    load_tokenizer,
    save_prepared_tokenizer,
    tokenizer_hash,
    train_tokenizer,
    trained_spec,
)
from llm.utils.pretrained import pretrained_path

GGUF = pretrained_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def text() -> str:
    return markdown_to_text(play_paths()["the-tempest"].read_text(encoding="utf-8"))[:30_000]


@pytest.fixture(scope="module")
def bpe(text):
    return train_bpe_tokenizer(text, vocab_size=400)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_same_tokenizer(a, b, text, same_specials=True):
    assert (tokenizer_hash(a) == tokenizer_hash(b)) == same_specials
    assert ids(a, text) == ids(b, text)
    assert eos_token_id(a) == eos_token_id(b)


def test_file_folder_and_bundle_specs(bpe, text, tmp_path):
    bpe.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    bpe.save_pretrained(str(tmp_path / "folder"))
    config = MosaicGPTConfig(vocab_size=len(bpe), max_seq_len=32, d_model=16, n_heads=2, n_layers=1)
    MosaicGPT(config).save_pretrained(tmp_path / "bundle", tokenizer=bpe)
    for spec in ("tokenizer.json", "folder", "bundle"):
        loaded = load_tokenizer(str(tmp_path / spec))
        # A bare tokenizer.json names no special tokens: eos is found, bos and pad stay unset.
        assert_same_tokenizer(loaded, bpe, text[:3000], same_specials=spec != "tokenizer.json")
        assert loaded.eos_token == EOS_TOKEN


def test_registered_and_gguf_specs(text, tmp_path):
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} is missing (make data)")
    registered = load_tokenizer("smollm2-135m-instruct")
    from_file = load_tokenizer(str(GGUF))
    assert_same_tokenizer(registered, from_file, text[:3000])
    assert registered.eos_token_id is not None and len(registered) == 49152
    info = save_prepared_tokenizer(registered, tmp_path / "tok", "smollm2-135m-instruct")
    again, again_info = load_prepared_tokenizer(tmp_path / "tok")
    assert info == again_info and info["hash"] == tokenizer_hash(registered)
    assert ids(again, text[:3000]) == ids(registered, text[:3000])


def test_trained_specs_stream_and_are_deterministic(text):
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    consumed = []

    def stream():
        for p in paragraphs:
            consumed.append(p)
            yield p

    bpe = train_tokenizer("bpe:500", stream())
    assert consumed == paragraphs
    assert len(bpe) == 500 and bpe.convert_ids_to_tokens(eos_token_id(bpe)) == EOS_TOKEN
    assert bpe.decode(ids(bpe, text[:5000])) == text[:5000]
    assert tokenizer_hash(train_tokenizer("bpe:500", iter(paragraphs))) == tokenizer_hash(bpe)
    char = train_tokenizer("char", iter(paragraphs))
    reference = build_char_tokenizer("".join(paragraphs))
    assert char.get_vocab() == reference.get_vocab()
    assert tokenizer_hash(char) == tokenizer_hash(reference)
    assert (trained_spec("char"), trained_spec("bpe:300"), trained_spec("smollm2-135m-instruct")) == (
        ("char", None), ("bpe", 300), None)


@pytest.mark.parametrize("spec", ["char", "bpe:300"])
def test_saved_tokenizer_keeps_its_hash(spec, text, tmp_path):
    tokenizer = train_tokenizer(spec, iter(text.split("\n\n")))
    info = save_prepared_tokenizer(tokenizer, tmp_path / "tok", spec)
    assert info == {"hash": tokenizer_hash(tokenizer), "spec": spec, "vocab_size": len(tokenizer),
                    "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN)}
    assert json.loads((tmp_path / "tok" / INFO_FILE).read_text()) == info
    loaded, loaded_info = load_prepared_tokenizer(tmp_path / "tok")
    assert loaded_info == info
    assert_same_tokenizer(loaded, tokenizer, text[:3000])
    # Loading the folder as a spec, then saving it again, keeps the hash.
    again = save_prepared_tokenizer(load_tokenizer(str(tmp_path / "tok")), tmp_path / "again", "x")
    assert again["hash"] == info["hash"]
    # A tokenizer changed after preparation is refused.
    definition = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    definition["model"]["vocab"]["EXTRA"] = len(definition["model"]["vocab"]) + 10
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(definition))
    with pytest.raises(DataError, match="changed after preparation"):
        load_prepared_tokenizer(tmp_path / "tok")


def test_bad_specs(tmp_path):
    message = (r"cannot load tokenizer 'no-such-model': no such file or folder, and not a registered name; "
               r"a tokenizer is a tokenizer\.json file, .*bpe:VOCAB_SIZE or char to train one")
    with pytest.raises(DataError, match=message):
        load_tokenizer("no-such-model")
    for spec in ("bpe", "bpe:100", "bpe:lots"):
        with pytest.raises(DataError, match=rf"tokenizer spec '{spec}': bpe needs an integer vocabulary size of at "
                                            "least 259"):
            trained_spec(spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"the folder holds no tokenizer \(tokenizer.json or tokenizer_config.json\)"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "broken.json").write_text("{not a tokenizer")
    with pytest.raises(DataError, match=r"cannot load tokenizer '.*broken\.json' \(Exception: .*a tokenizer is"):
        load_tokenizer(str(tmp_path / "broken.json"))
    # A tokenizer without an end-of-text token cannot separate documents.
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "noeos.json"))
    with pytest.raises(DataError, match=r"noeos\.json' has no end-of-text token"):
        load_tokenizer(str(tmp_path / "noeos.json"))
    with pytest.raises(DataError, match=f"no {INFO_FILE} in"):
        load_prepared_tokenizer(tmp_path / "empty")
    with pytest.raises(DataError, match="names a tokenizer to load, not one to train"):
        train_tokenizer(str(tmp_path / "noeos.json"), iter(["a"]))
    assert Path(tmp_path / "noeos.json").is_file()
