"""TextTokenizer (llm.data.text_tokenizer): the tokenizer of a GGUF file or of a plain transformers
folder without transformers, giving transformers' own ids, text and chat prompts: compared with the
PreTrainedTokenizerFast of the same tokenizer, method by method, over texts with special tokens,
unicode and spaces; and a process that loads one never imports transformers."""

import json
import subprocess
import sys

import jinja2
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from llm.data import load_tokenizer, train_bpe_tokenizer
from llm.data.text_tokenizer import TextTokenizer, as_transformers
from llm.data.tokenizer import CHATML_TEMPLATE, build_char_tokenizer, tokenizer_hash
from llm.utils.pretrained import REPO_ROOT, pretrained_path
from llm.utils.tokens import tokenizer_digest

GGUF = pretrained_path("smollm2-135m-instruct")
TEXTS = ["Hello, world!", "  leading spaces\n\nand 12345 digits\t", "<|im_start|>user\nhi<|im_end|>\n",
         "naïve café ✓ 日本語 — 'tis", "", "a" * 300, "<|endoftext|>x<|endoftext|>"]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And you?"}]]


def assert_same(ours, theirs):
    """Every method inference uses gives transformers' answer."""
    assert isinstance(ours, TextTokenizer) and isinstance(theirs, PreTrainedTokenizerFast)
    for text in TEXTS:
        for add in (True, False):
            assert ours(text, add_special_tokens=add)["input_ids"] == theirs(text, add_special_tokens=add)["input_ids"]
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add)
        ids = theirs(text)["input_ids"] + theirs.all_special_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
            assert ours.decode(torch.tensor(ids), skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.batch_decode([[5, 6], [7]]) == theirs.batch_decode([[5, 6], [7]])
    batch = ["a short one", "and a much longer text than that"]
    for side in ("right", "left"):
        ours.padding_side = theirs.padding_side = side
        mine, yours = ours(batch, padding=True, return_tensors="pt"), theirs(batch, padding=True, return_tensors="pt")
        assert torch.equal(mine.input_ids, yours["input_ids"]) and torch.equal(mine.attention_mask, yours["attention_mask"])
        assert ours(batch, padding=True) == theirs(batch, padding=True).data
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "special_tokens_map", "all_special_ids", "all_special_tokens", "chat_template",
                 "padding_side"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.convert_tokens_to_ids(["<|endoftext|>", "surely-not-a-token"]) == \
        theirs.convert_tokens_to_ids(["<|endoftext|>", "surely-not-a-token"])
    assert tokenizer_hash(ours) == tokenizer_hash(theirs) and tokenizer_digest(ours) == tokenizer_digest(theirs)
    if theirs.chat_template:
        for gen in (True, False):
            for chat in CHATS:
                assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == \
                    theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen) == \
                    theirs.apply_chat_template(chat, add_generation_prompt=gen)
                assert torch.equal(ours.apply_chat_template(chat, add_generation_prompt=gen, return_tensors="pt"),
                                   theirs.apply_chat_template(chat, add_generation_prompt=gen, return_tensors="pt"))
            assert ours.apply_chat_template(CHATS, add_generation_prompt=gen) == \
                theirs.apply_chat_template(CHATS, add_generation_prompt=gen)
        # options it leaves to transformers' tokenizer give transformers' answers
        chat = CHATS[1][:3]
        for options in ({"continue_final_message": True, "tokenize": False}, {"return_dict": True},
                        {"truncation": True, "max_length": 5}):
            assert ours.apply_chat_template(chat, **options) == theirs.apply_chat_template(chat, **options), options
    assert ours("a", "b")["input_ids"] == theirs("a", "b")["input_ids"]  # a text pair, answered by transformers
    assert ours(TEXTS[1], truncation=True, max_length=3)["input_ids"] == \
        theirs(TEXTS[1], truncation=True, max_length=3)["input_ids"]
    assert ours.vocab_size == theirs.vocab_size and ours.tokenize("hello world") == theirs.tokenize("hello world")


@pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} missing: run `make data`")
def test_a_gguf_files_tokenizer_is_transformers_own_without_transformers():
    ours = load_tokenizer(GGUF)
    assert_same(ours, ours.to_transformers())
    assert as_transformers(ours).__class__ is PreTrainedTokenizerFast


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_a_saved_tokenizer_folder_loads_as_transformers_loads_it(kind, tmp_path):
    text = "ROMEO: But soft, what light through yonder window breaks? 1234 naïve\n" * 20
    built = train_bpe_tokenizer(text, 300) if kind == "bpe" else build_char_tokenizer(text)
    built.chat_template = CHATML_TEMPLATE
    built.save_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    theirs = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    theirs.padding_side = "left"  # load_tokenizer's, whatever the folder says
    assert_same(ours, theirs)
    # saved again, it is the same folder for transformers
    ours.save_pretrained(tmp_path / "again")
    assert_same(load_tokenizer(tmp_path / "again"), theirs)


def test_its_length_counts_a_piece_a_unigram_list_holds_twice_once(tmp_path):
    """A Unigram vocabulary is a list, which may hold a piece twice: counted once, as the
    tokenizers library and transformers count it."""
    from tokenizers import Tokenizer, models

    pieces = [("<unk>", 0.0), ("▁a", -1.0), ("b", -2.0), ("▁a", -3.0), ("</s>", 0.0)]
    Tokenizer(models.Unigram(pieces, unk_id=0)).save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(tmp_path / "tokenizer.json")
    assert len(ours) == ours.backend_tokenizer.get_vocab_size(with_added_tokens=True) == 4


@pytest.mark.parametrize("kind", ["gguf", "bpe", "char"])
def test_its_length_counts_the_vocabulary_and_the_added_tokens_it_lacks(kind, tmp_path):
    """len() is the size of the whole vocabulary (the tokenizers library's, with added tokens),
    tokens added with strings the model's vocabulary has, lacks, or both, special or not."""
    from tokenizers import AddedToken

    if kind == "gguf":
        ours = load_tokenizer(GGUF)
    else:
        text = "ROMEO: But soft, what light through yonder window breaks?\n" * 20
        (train_bpe_tokenizer(text, 300) if kind == "bpe" else build_char_tokenizer(text)).save_pretrained(tmp_path)
        ours = load_tokenizer(tmp_path)
    backend = ours.backend_tokenizer
    known = next(t for t, i in sorted(backend.get_vocab(with_added_tokens=False).items(), key=lambda x: x[1])[5:])
    assert len(ours) == backend.get_vocab_size(with_added_tokens=True)
    for added in ([AddedToken(known, special=True)], [AddedToken("<|brand new|>", special=True)],
                  ["another new one", known, "another new one"]):
        before = len(ours)
        if isinstance(added[0], AddedToken):
            backend.add_special_tokens(added)
        else:
            backend.add_tokens(added)
        assert len(ours) == backend.get_vocab_size(with_added_tokens=True) == len(ours.get_vocab())
        assert len(ours) - before == len({a if isinstance(a, str) else a.content for a in added} - {known})


def test_folders_it_cannot_mirror_exactly_load_through_transformers(tmp_path):
    train_bpe_tokenizer("some text to learn from " * 50, 300).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for change in ({"clean_up_tokenization_spaces": True}, {"additional_special_tokens": ["<|im_start|>"]},
                   {"tokenizer_class": "GPT2TokenizerFast"}, {"mask_token": "<|im_start|>"}, {"add_prefix_space": True},
                   {"split_special_tokens": True}, {"model_input_names": ["input_ids", "token_type_ids"]},
                   {"added_tokens_decoder": {"0": {**config["added_tokens_decoder"]["0"], "lstrip": True}}}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert not isinstance(load_tokenizer(tmp_path), TextTokenizer), change


def test_the_chat_template_runs_in_transformers_environment(tmp_path):
    template = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{{ m | tojson }}{% generation %}{{ eos_token }}{% endgeneration %}\n{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}{% if tools is none %}no tools{% endif %}")
    built = train_bpe_tokenizer("some text to learn from " * 50, 300)
    built.save_pretrained(tmp_path)
    ours, theirs = load_tokenizer(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "naïve \"quotes\""}]
    assert ours.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
    with pytest.raises(jinja2.TemplateError, match="no bad roles"):
        ours.apply_chat_template([{"role": "bad", "content": ""}], chat_template=template)
    with pytest.raises(ValueError, match="has no chat template"):
        ours.apply_chat_template(chat)


@pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} missing: run `make data`")
def test_generating_from_a_gguf_file_imports_no_transformers():
    code = ("import sys, torch; from llm import MosaicGPT, load_tokenizer; tok = load_tokenizer(sys.argv[1]); "
            "model = MosaicGPT.from_pretrained(sys.argv[1]); "
            "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True, "
            "return_tensors='pt'); out = model.generate(ids, max_new_tokens=4, do_sample=False); "
            "print(tok.decode(out[0, ids.shape[1]:]) is not None, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(GGUF)], capture_output=True, text=True, timeout=300,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


@pytest.mark.parametrize("source", ["gguf", "bpe", "char"])
def test_incremental_text_joins_to_the_whole_lists_text(source, tmp_path):
    """Pieces of random id streams (special tokens, bytes of multi-byte characters, any chunking)
    join to ``decode`` of all the ids, and none ends in half a character."""
    from llm.data.text_tokenizer import IncrementalText

    if source == "gguf":
        if not GGUF.is_file():
            pytest.skip(f"{GGUF} missing: run `make data`")
        tok = load_tokenizer(GGUF)
    else:
        text = "ROMEO: naïve — 漢字 ✓ 😀 emoji, 1234\n" * 30
        tok = train_bpe_tokenizer(text, 320) if source == "bpe" else build_char_tokenizer(text)
    g = torch.Generator().manual_seed(len(source))
    for trial in range(40):
        ids = torch.randint(0, len(tok), (int(torch.randint(1, 120, (1,), generator=g)),), generator=g).tolist()
        cut = int(torch.randint(0, len(ids) + 1, (1,), generator=g))  # characters of several bytes, too
        ids = ids[:cut] + tok.encode("naïve 漢字 😀", add_special_tokens=False) + ids[cut:]
        for skip in (True, False):
            stream, pieces, at = IncrementalText(tok, skip_special_tokens=skip), [], 0
            while at < len(ids):
                n = int(torch.randint(1, 4, (1,), generator=g))
                pieces.append(stream.add(ids[at:at + n]))
                at += n
            whole = tok.decode(ids, skip_special_tokens=skip)
            assert stream.text + stream.pending() == whole, (trial, skip)
            assert all("\ufffd" not in p[-1:] for p in pieces if p)
            assert "".join(pieces) == stream.text and whole.startswith(stream.text), (trial, skip)
            if not whole.endswith("\ufffd"):
                assert stream.text == whole, (trial, skip)
