"""Fine-tuning data: loss only on responses, and padding (left or right, any amount) never changes a
real token's loss or the gradients."""

import json
import string

import pytest
import torch

from llm.train.composer_model import ComposerMosaicGPT
from llm.data import build_char_tokenizer
from llm.data.finetune import IGNORE_INDEX, FinetuneDataset, PaddingCollator, load_jsonl, use_chat_template
from llm.data.tokenizer import CHATML_TEMPLATE
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(string.ascii_lowercase + " ?.\n")


def test_labels_cover_the_response_and_eos_only(tokenizer):
    item = FinetuneDataset([{"prompt": "who? ", "response": "me."}], tokenizer, 32)[0]
    n_prompt = len("who? ")
    assert (item["labels"][:n_prompt] == IGNORE_INDEX).all()
    assert item["labels"][n_prompt:].tolist() == item["input_ids"][n_prompt:].tolist()
    assert tokenizer.decode(item["input_ids"][n_prompt:]) == "me." + tokenizer.eos_token
    with pytest.raises(ValueError, match="example 0 has 9 tokens, more than max_seq_len=8"):
        FinetuneDataset([{"prompt": "who? ", "response": "me."}], tokenizer, 8)


def test_chatml_examples_are_a_user_turn_and_the_reply_that_ends_its_turn():
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " ?.\n")
    assert use_chat_template(tokenizer) == (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    item = FinetuneDataset([{"prompt": "who? ", "response": "me."}], tokenizer, 64, chat=True)[0]
    head = "<|im_start|>user\nwho? <|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer(head, add_special_tokens=False).input_ids
    assert item["input_ids"].tolist() == prompt + tokenizer("me.<|im_end|>\n", add_special_tokens=False).input_ids
    assert (item["labels"][: len(prompt)] == IGNORE_INDEX).all()  # the template's markers are not scored
    assert item["labels"][len(prompt):].tolist() == item["input_ids"][len(prompt):].tolist()
    # the prompt is what a chat route sends the model: the template's generation prompt
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "who? "}], add_generation_prompt=True)
    assert chat == prompt


def test_a_tokenizers_own_template_is_kept_and_none_trains_on_raw_text():
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " ?.\n[]:")
    tokenizer.chat_template = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}<|endoftext|>{% endfor %}"
                               "{% if add_generation_prompt %}[assistant]: {% endif %}")
    own = tokenizer.chat_template
    assert use_chat_template(tokenizer) == (tokenizer.eos_token_id,) and tokenizer.chat_template == own
    item = FinetuneDataset([{"prompt": "who?", "response": "me."}], tokenizer, 64, chat=True)[0]
    assert tokenizer.decode(item["input_ids"]) == "[user]: who?<|endoftext|>[assistant]: me.<|endoftext|>"
    assert use_chat_template(tokenizer, "none") == (tokenizer.eos_token_id,) and tokenizer.chat_template == own
    assert use_chat_template(tokenizer, "chatml")[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.chat_template == CHATML_TEMPLATE


def test_chatml_needs_its_tokens():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<e>": 1}, unk_token="a")),
                                   eos_token="<e>")
    with pytest.raises(ValueError, match=r"^chat_template chatml: ChatML needs the tokens <\|im_start\|> <\|im_end\|>, "
                                         r"which this tokenizer lacks .*or chat_template: none$"):
        use_chat_template(bare, "chatml")
    with pytest.warns(UserWarning, match="plain text"):  # auto: a tokenizer from before ChatML trains on raw text
        assert use_chat_template(bare) == (bare.eos_token_id,) and not bare.chat_template
    with pytest.raises(ValueError, match="chat_template must be one of"):
        use_chat_template(bare, "alpaca")


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n{oops\n")
    with pytest.raises(ValueError, match="d.jsonl:2: not JSON"):
        load_jsonl(path)
    path.write_text(json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ValueError, match='d.jsonl:1: each line must be {"prompt": str, "response": str}'):
        load_jsonl(path)
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "missing.jsonl")


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = model.loss(model(batch), batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scheme", ["learned", "alibi", "llama"])
def test_padding_never_changes_the_loss_or_the_gradients(tokenizer, scheme):
    model = ComposerMosaicGPT(tiny_model(scheme, vocab_size=len(tokenizer), attn_impl="sdpa"))
    data = FinetuneDataset([{"prompt": "what is the sea? ", "response": "blue and deep."},
                            {"prompt": "x", "response": "y" * 36}, {"prompt": "x" * 50, "response": "y"}],
                           tokenizer, 64)
    alone = PaddingCollator(tokenizer.pad_token_id)([data[0]])
    reference_loss, reference_grads = loss_and_grads(model, alone)
    for side in ("left", "right"):
        for longer in (data[1], data[2]):
            padded = PaddingCollator(tokenizer.pad_token_id, side)([data[0], longer])
            row = {k: v[:1] for k, v in padded.items()}
            assert row["input_ids"].shape[1] > alone["input_ids"].shape[1]
            loss, grads = loss_and_grads(model, row)
            torch.testing.assert_close(loss, reference_loss, atol=1e-6, rtol=1e-5)
            for name, grad in reference_grads.items():
                torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=f"{side} {name}")
