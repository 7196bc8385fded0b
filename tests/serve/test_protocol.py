"""Request checks and the token-to-text stream of the OpenAI protocol layer."""

import re

import pytest
from transformers import AutoTokenizer

from llm import GenerationConfig
from llm.data.tokenizer import load_tokenizer
from llm.data import build_char_tokenizer
from llm.serve.protocol import APIError, TextStream, parse_request


@pytest.fixture(scope="module")
def chars():
    return build_char_tokenizer("abcdefghij .")


def parse(body, tokenizer, chat=False, max_seq_len=64):
    return parse_request(body, chat=chat, tokenizer=tokenizer, defaults=GenerationConfig(do_sample=True),
                         max_seq_len=max_seq_len, max_choices=8)


def test_stop_strings_are_held_back_until_decided_and_never_sent(chars):
    stream = TextStream(chars, stop=("dea", "ij"))
    ids = chars("abc de.dea h").input_ids
    sent = "".join(stream.add([t]) for t in ids)
    assert sent + stream.add([], final=True) == "abc de."
    assert stream.stopped


def test_without_stop_strings_every_token_is_sent_at_once(chars):
    stream = TextStream(chars)
    assert [stream.add([t]) for t in chars("ab c").input_ids] == ["a", "b", " ", "c"]


def test_an_incomplete_utf8_character_waits_for_its_last_byte():
    tokenizer = load_tokenizer("smollm2-135m-instruct") if _has_smollm2() else AutoTokenizer.from_pretrained("gpt2")
    ids = tokenizer("naïve 🙂 ok", add_special_tokens=False).input_ids
    stream = TextStream(tokenizer)
    pieces = [stream.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.add([], final=True) == "naïve 🙂 ok"


def _has_smollm2() -> bool:
    from llm.utils.pretrained import pretrained_path

    return pretrained_path("smollm2-135m-instruct").is_file()


def test_choices_of_several_prompts_get_their_seeds_and_defaults(chars):
    parsed = parse({"prompt": ["ab", [2, 3, 4]], "n": 2, "seed": 10, "max_tokens": 5}, chars)
    assert [p for p, _ in parsed.choices] == [0, 0, 1, 1]
    assert [o.seed for _, o in parsed.choices] == [10, 11, 12, 13]
    assert all(o.do_sample and o.max_new_tokens == 5 for _, o in parsed.choices)
    greedy = parse({"prompt": "ab", "temperature": 0, "top_k": -1}, chars).choices[0][1]
    assert greedy.greedy and greedy.top_k is None and greedy.max_new_tokens == 16


def test_chat_without_max_tokens_gets_what_the_context_leaves(chars):
    chars.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    parsed = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}, chars, chat=True)
    assert parsed.prompts == [chars("abc").input_ids] and parsed.choices[0][1].max_new_tokens == 64 - 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["ab", "cd"], "n": 5}, "n"),  # 10 completions, more than max_choices=8
    ({"prompt": "ab", "min_p": 2}, "min_p"),
    ({"prompt": "ab", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "ab", "seed": 1.5}, "seed"),
    ({"prompt": "ab", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": "ab", "temperature": True}, "temperature"),
    ({"prompt": "ab", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "ab", "top_p": float("nan")}, "top_p"),
    ({"prompt": "ab", "stop": ["a", 1]}, "stop"),
    ({"prompt": "ab", "logprobs": True}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [["a"]]}, "prompt"),
    ({"prompt": [[1, 99]]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_out_of_range_fields_name_themselves(chars, body, param):
    with pytest.raises(APIError) as err:
        parse(body, chars)
    assert err.value.status == 400 and err.value.param == param
    assert param in err.value.message


@pytest.mark.parametrize("body, message", [
    ({"prompt": "ab", "temperature": -1}, "'temperature' must be greater than or equal to 0, got -1"),
    ({"prompt": "ab", "n": True}, "'n' must be an integer, got true"),
    ({"prompt": "ab", "stream_options": 3}, "'stream_options' must be an object, got 3"),
    ({}, "'prompt' is required"),
    ({"prompt": "ab", "n": 9}, "1 prompt x n=9 ask for 9 completions; this server makes at most 8 per request"),
    ({"prompt": ["a"] * 9}, "9 prompts x n=1 ask for 9 completions"),
])
def test_errors_say_what_is_allowed_and_what_came(chars, body, message):
    with pytest.raises(APIError, match=re.escape(message)):
        parse(body, chars)


def test_null_fields_and_neutral_values_of_unserved_fields_pass(chars):
    parsed = parse({"prompt": "ab", "n": None, "temperature": None, "stop": None, "logprobs": False,
                    "presence_penalty": 0, "best_of": 1, "response_format": {"type": "text"}, "unknown": 1}, chars)
    assert len(parsed.choices) == 1 and parsed.stop == () and parsed.choices[0][1].do_sample


@pytest.mark.parametrize("message, match", [
    ({"role": "wizard", "content": "hi"}, "'messages[1].role' must be one of system, developer, user, assistant, "
                                          "got 'wizard'"),
    ({"role": "tool", "content": "42", "tool_call_id": "x"}, "tools are not served"),
    ({"content": "hi"}, "'messages[1].role' is required"),
    ({"role": "user", "content": [{"type": "image_url"}]}, "'messages[1].content' must be a string or text parts"),
    ({"role": "user"}, "messages[1] has no 'content'"),
    ({"role": "assistant", "content": None}, "messages[1] has no 'content'"),
    ("hi", "'messages[1]' must be an object"),
])
def test_chat_messages_need_a_served_role_and_content(chars, message, match):
    chars.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(APIError, match=re.escape(match)) as err:
        parse({"messages": [{"role": "user", "content": "ab"}, message]}, chars, chat=True)
    assert err.value.status == 400 and err.value.param.startswith("messages[1]")


def test_developer_messages_reach_the_template_as_system_messages(chars):
    chars.chat_template = "{% for m in messages %}{% if m['role'] == 'system' %}.{% endif %}{{ m['content'] }}{% endfor %}"
    parsed = parse({"messages": [{"role": "developer", "content": "a"}, {"role": "user", "content": "b"}]}, chars,
                   chat=True)
    assert parsed.prompts == [chars(".ab").input_ids]


@pytest.mark.parametrize("extra, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format")])
def test_a_chat_request_without_a_template_is_told_about_its_bad_parameters_first(extra, param):
    # the parameters are checked before the messages meet the (missing) chat template
    chars = build_char_tokenizer("abcdefghij .")
    assert not chars.chat_template
    body = {"messages": [{"role": "user", "content": "ab"}], **extra}
    with pytest.raises(APIError) as err:
        parse(body, chars, chat=True)
    assert err.value.param == param and "chat template" not in err.value.message and err.value.status == 400
    with pytest.raises(APIError, match="no chat template"):
        parse({"messages": [{"role": "user", "content": "ab"}], "temperature": 0.5}, chars, chat=True)
