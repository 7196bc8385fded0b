"""The HTTP API against the official ``openai`` client, on a real uvicorn server on 127.0.0.1
serving a tiny model: answers equal ``generate`` alone, streaming is token by token, errors are
OpenAI-shaped and leave the server up, concurrency, disconnects and back-pressure."""

import json
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from starlette.testclient import TestClient

from llm import GenerationConfig
from llm.data import build_char_tokenizer
from llm.serve import Engine
from llm.serve.http import Served, create_app
from tests.conftest import tiny_model

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_SEQ_LEN = 160


class Server:
    """A uvicorn server on a thread, serving a tiny model; ``engine`` and ``model`` for the checks."""

    def __init__(self, model=None, tokenizer=None, name="tiny", max_batch_size=4):
        if model is None:
            tokenizer = build_char_tokenizer(string.ascii_lowercase + " .,?\n<>")
            tokenizer.chat_template = TEMPLATE
            model = tiny_model("llama", vocab_size=len(tokenizer), max_seq_len=MAX_SEQ_LEN)
        self.model, self.tokenizer = model, tokenizer
        self.defaults = GenerationConfig(do_sample=True, temperature=1.0, eos_token_id=self.tokenizer.eos_token_id)
        self.engine = Engine(self.model, self.tokenizer, max_batch_size=max_batch_size, max_queue=16)
        served = Served(self.engine.start(), self.tokenizer, name, self.defaults, model.config.max_seq_len)
        config = uvicorn.Config(create_app(lambda: served), host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=30)
        while httpx.get(self.url + "/health").status_code != 200:
            time.sleep(0.01)

    def alone(self, text, max_tokens, chat=False, **options):
        """The completion ``generate`` gives alone: (text, finish_reason, completion tokens)."""
        if chat:
            text = self.tokenizer.apply_chat_template(text, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        if "temperature" in options and options["temperature"] == 0:
            options = dict(options, do_sample=False, temperature=1.0)
        config = self.defaults.update(max_new_tokens=max_tokens, **options)
        new = self.model.generate(ids, generation_config=config)[0, ids.shape[1]:].tolist()
        reason = "stop" if new[-1] == self.tokenizer.eos_token_id else "length"
        return self.tokenizer.decode(new, skip_special_tokens=True), reason, len(new)

    def gate(self, method="step"):
        """Hold the engine before its next ``method`` call until the returned event is set."""
        event, original = threading.Event(), getattr(self.engine, method)

        def held(*args):
            event.wait(10)
            return original(*args)

        setattr(self.engine, method, held)
        return event

    def ungate(self, method="step"):
        delattr(self.engine, method)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_a_completion_is_generate_alone_with_its_usage(server):
    out = server.client.completions.create(model="tiny", prompt="the cat sat", max_tokens=20, temperature=0)
    text, reason, new = server.alone("the cat sat", 20, temperature=0)
    assert out.choices[0].text == text and out.choices[0].finish_reason == reason
    assert out.usage.prompt_tokens == len("the cat sat") and out.usage.completion_tokens == new
    assert out.usage.total_tokens == len("the cat sat") + new and out.object == "text_completion"


def test_a_chat_completion_applies_the_chat_template(server):
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "who are you?"}]
    out = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=25, temperature=0)
    text, reason, new = server.alone(messages, 25, chat=True, temperature=0)
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == reason and out.usage.completion_tokens == new
    # a second turn reuses the first turn's positions from the prefix cache
    again = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens - 1


def test_seeded_sampling_gives_generates_draws_per_choice(server):
    out = server.client.completions.create(model="tiny", prompt="a dog", max_tokens=15, temperature=0.8, top_p=0.9,
                                           seed=5, n=2)
    for i, choice in enumerate(out.choices):
        text, _, _ = server.alone("a dog", 15, do_sample=True, temperature=0.8, top_p=0.9, seed=5 + i)
        assert choice.index == i and choice.text == text


def test_streamed_chunks_arrive_before_the_answer_is_complete(server):
    hold = server.gate("_decode_batch")  # the engine emits the first token at prefill, then waits
    try:
        stream = server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "once upon"}], max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True})
        first = next(stream)
        assert first.choices[0].delta.role == "assistant" and first.object == "chat.completion.chunk"
        second = next(stream)
        # text came while the engine is held before its second token: sent as soon as decoded
        assert second.choices[0].delta.content and second.choices[0].finish_reason is None
        hold.set()
        rest = list(stream)
    finally:
        server.ungate("_decode_batch")
        hold.set()
    chunks = [second] + rest
    chat_text, chat_reason, new = server.alone([{"role": "user", "content": "once upon"}], 12, chat=True,
                                               temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == new
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1


def test_stop_strings_end_the_text_before_them_streamed_or_not(server):
    text, _, _ = server.alone("the sea", 40, temperature=0)
    stop = text[6:8]
    expected = text[:text.find(stop)]
    out = server.client.completions.create(model="tiny", prompt="the sea", max_tokens=40, temperature=0,
                                           stop=[stop, "zzzz"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model="tiny", prompt="the sea", max_tokens=40, temperature=0,
                                                stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, None),
    (b"[1, 2]", 400, None, None),
    ({"prompt": 5}, 400, "prompt", None),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens", None),
    ({"prompt": "a", "temperature": -0.5}, 400, "temperature", None),
    ({"prompt": "a", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "a", "n": 0}, 400, "n", None),
    ({"prompt": "a", "stream": "yes"}, 400, "stream", None),
    ({"prompt": "a", "stop": [1]}, 400, "stop", None),
    ({"prompt": "a" * 150, "max_tokens": 20}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs", None),
    ({"prompt": "a", "logprobs": 2, "echo": True}, 400, "logprobs", None),
    ({"prompt": "a", "prompt_lookup_num_tokens": 0}, 400, "prompt_lookup_num_tokens", None),
    ({"prompt": "a", "presence_penalty": 0.5}, 400, "presence_penalty", None),
    ({"prompt": "a", "logit_bias": {"3": 5}}, 400, "logit_bias", None),
    ({"prompt": "a", "best_of": 3}, 400, "best_of", None),
    ({"prompt": "a", "seed": -5}, 400, "seed", None),
    ({"prompt": [-1], "max_tokens": 2}, 400, "prompt", None),
    ({"prompt": [[1, 2], [2**63]], "max_tokens": 2}, 400, "prompt", None),
    ({"prompt": [5, 999], "max_tokens": 2}, 400, "prompt", None),
    (b"[" * 100000 + b"]" * 100000, 400, None, None),
    (b"\xff\xfe{}", 400, None, None),
    (b'{"prompt": "x\\ud800y"}', 400, None, None),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, None, None),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code
    assert server.client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text is not None


def test_neutral_values_of_unserved_fields_pass_and_max_completion_tokens_wins(server):
    out = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, presence_penalty=0,
        frequency_penalty=0, tool_choice="none", max_tokens=3, max_completion_tokens=7)
    expected = server.alone([{"role": "user", "content": "hi"}], 7, chat=True, temperature=0)
    assert out.choices[0].message.content == expected[0] and out.usage.completion_tokens == expected[2]
    out = server.client.completions.create(model="tiny", prompt="hi", temperature=0, max_tokens=3,
                                           extra_body={"max_completion_tokens": 7})
    expected = server.alone("hi", 7, temperature=0)
    assert out.choices[0].text == expected[0] and out.usage.completion_tokens == expected[2]


def test_a_model_is_retrieved_by_id_and_browsers_may_call_from_other_origins(server):
    assert server.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("other")
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")


def test_chat_errors_go_through_the_client_as_its_exceptions(server):
    with pytest.raises(openai.BadRequestError, match="messages"):
        server.client.chat.completions.create(model="tiny", messages=[], max_tokens=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length is 160"):
        server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_completion_tokens=500)


def test_a_full_queue_answers_429_with_retry_after(server):
    hold = server.gate()
    try:
        time.sleep(0.05)
        fillers = server.engine.submit([([5, 6], GenerationConfig(max_new_tokens=2))] * 16)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        for sequence in fillers:
            sequence.cancel()
    finally:
        server.ungate()
        hold.set()
    assert server.client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_sixteen_concurrent_requests_each_equal_the_request_alone(server):
    prompts = [("the " + "abcdefghijklmnop"[i] * (1 + i % 5), 4 + 3 * i) for i in range(16)]

    def ask(i):
        prompt, n = prompts[i]
        if i % 3 == 0:
            messages = [{"role": "user", "content": prompt}]
            out = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=n,
                                                        temperature=0)
            return out.choices[0].message.content
        if i % 3 == 1:
            out = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0.7,
                                                   seed=i)
            return out.choices[0].text
        chunks = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    for i, answer in enumerate(answers):
        prompt, n = prompts[i]
        if i % 3 == 0:
            expected = server.alone([{"role": "user", "content": prompt}], n, chat=True, temperature=0)[0]
        elif i % 3 == 1:
            expected = server.alone(prompt, n, do_sample=True, temperature=0.7, seed=i)[0]
        else:
            expected = server.alone(prompt, n, temperature=0)[0]
        assert answer == expected, i


def test_a_request_that_joins_mid_way_is_unaffected_and_leaves_the_first_unaffected(server):
    long = server.client.completions.create(model="tiny", prompt="long story", max_tokens=120, temperature=0,
                                            stream=True)
    pieces = [next(long).choices[0].text for _ in range(3)]
    short = server.client.completions.create(model="tiny", prompt="quick", max_tokens=10, temperature=0)
    pieces += [c.choices[0].text for c in long]
    assert short.choices[0].text == server.alone("quick", 10, temperature=0)[0]
    assert "".join(pieces) == server.alone("long story", 120, temperature=0)[0]


def test_a_client_that_disconnects_frees_its_row(server):
    prompt = next(p for p in ("tell me", "once upon", "a tale", "more", "and then")
                  if server.alone(p, 140, temperature=0)[1] == "length")  # no eos before 140 tokens
    submitted, submit = [], server.engine.submit
    server.engine.submit = lambda *a, **kw: submitted.extend(submit(*a, **kw)) or submitted[-1:]
    hold = server.gate("_decode_batch")
    try:
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"prompt": prompt, "max_tokens": 140, "temperature": 0, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: ")
    finally:
        del server.engine.submit
        server.ungate("_decode_batch")
        hold.set()
    (sequence,) = submitted
    deadline = time.time() + 10
    while sequence.finish_reason != "cancelled" and time.time() < deadline:
        time.sleep(0.02)
    assert sequence.finish_reason == "cancelled" and len(sequence.tokens) < 140
    assert server.engine.running == 0


def test_a_client_that_leaves_a_request_that_does_not_stream_ends_its_handler(server):
    hold = server.gate("_decode_batch")
    try:
        with pytest.raises(httpx.TimeoutException):
            # greedy: a sampled first token could be the end of text, and the answer done before the gate
            httpx.post(server.url + "/v1/completions", json={"prompt": "more", "max_tokens": 140, "temperature": 0},
                       timeout=0.5)
    finally:
        server.ungate("_decode_batch")
        hold.set()
    tasks = server.server.server_state.tasks
    deadline = time.time() + 10
    while (tasks or server.engine.running) and time.time() < deadline:
        time.sleep(0.05)
    assert not tasks and server.engine.running == 0  # nothing left to keep a shutdown waiting


def test_health_is_503_while_the_model_loads():
    tokenizer = build_char_tokenizer("ab")
    model = tiny_model("alibi", vocab_size=len(tokenizer))
    loaded = threading.Event()

    def load():
        loaded.wait(10)
        return Served(Engine(model, tokenizer).start(), tokenizer, "m", GenerationConfig(), 96)

    with TestClient(create_app(load)) as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "ab"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        loaded.set()
        deadline = time.time() + 10
        while client.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.01)
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3}).status_code == 200


def test_a_model_that_fails_to_load_is_said_by_health():
    failures = []

    def load():
        raise FileNotFoundError("no model in /nowhere")

    with TestClient(create_app(load, on_failure=failures.append)) as client:
        deadline = time.time() + 10
        while not failures and time.time() < deadline:
            time.sleep(0.01)
        health = client.get("/health")
        assert health.status_code == 503 and "no model in /nowhere" in health.json()["error"]
    assert failures == ["FileNotFoundError: no model in /nowhere"]



def test_after_shutdown_requests_get_503_and_health_stays_up():
    tokenizer = build_char_tokenizer("ab")
    model = tiny_model("alibi", vocab_size=len(tokenizer))
    app = create_app(lambda: Served(Engine(model, tokenizer).start(), tokenizer, "m", GenerationConfig(), 96))
    with TestClient(app) as client:
        deadline = time.time() + 10
        while client.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.01)
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3}).status_code == 200
        app.state.shutdown()
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert client.get("/health").status_code == 200


def test_a_body_too_large_is_413_before_it_is_read_and_tokenizing_leaves_the_loop_free(server, monkeypatch):
    from llm.serve.http import max_body_bytes

    limit = max_body_bytes(MAX_SEQ_LEN)
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * limit + b'"}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a body sent without Content-Length is counted as it arrives
    r = httpx.post(server.url + "/v1/completions", content=iter([b'{"prompt": "', b"a" * limit, b'"}']))
    assert r.status_code == 413
    # while one request's prompt is being tokenized (off the event loop), /health answers
    held, release, original = threading.Event(), threading.Event(), type(server.tokenizer).__call__

    def slow(self, text, *args, **kwargs):
        if text.startswith("slow"):
            held.set()
            release.wait(10)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(server.tokenizer), "__call__", slow)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.url + "/v1/completions", json={"prompt": "slow one", "max_tokens": 2},
                              timeout=30)
        assert held.wait(10)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        release.set()
        assert pending.result().status_code == 200


def _metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus's text format (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_requests_tokens_and_latencies_in_prometheus_format(server):
    before = httpx.get(server.url + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    out = server.client.completions.create(model="tiny", prompt="metrics", max_tokens=6, temperature=0, n=2)
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="tiny", prompt="x", max_tokens=6, temperature=-1)
    after = httpx.get(server.url + "/metrics").text
    b = before.text
    generated = _metric(after, "llm:generation_tokens_total") - _metric(b, "llm:generation_tokens_total")
    assert generated == out.usage.completion_tokens
    assert (_metric(after, "llm:prompt_tokens_total") - _metric(b, "llm:prompt_tokens_total")) == out.usage.prompt_tokens
    route = {"route": "/v1/completions", "status": "200"}
    assert _metric(after, "llm:http_responses_total", **route) - _metric(b, "llm:http_responses_total", **route) == 1
    bad = {"route": "/v1/completions", "status": "400"}
    assert _metric(after, "llm:http_responses_total", **bad) - _metric(b, "llm:http_responses_total", **bad) == 1
    for reason in {c.finish_reason for c in out.choices}:
        n = sum(c.finish_reason == reason for c in out.choices)
        key = {"finished_reason": reason}
        assert _metric(after, "llm:request_success_total", **key) - _metric(b, "llm:request_success_total", **key) == n
    for histogram in ("llm:time_to_first_token_seconds", "llm:e2e_request_latency_seconds"):
        assert _metric(after, histogram + "_count") - _metric(b, histogram + "_count") == 1
    steps = out.usage.completion_tokens - 2  # every token after each choice's first
    assert (_metric(after, "llm:time_per_output_token_seconds_count")
            - _metric(b, "llm:time_per_output_token_seconds_count")) == steps
    assert _metric(after, "llm:num_requests_running") == 0


def test_lookup_speculation_in_the_server_gives_the_answers_without_it_and_counts_its_drafts():
    tokenizer = build_char_tokenizer(string.ascii_lowercase + " ")
    model = tiny_model("rope", vocab_size=len(tokenizer), max_seq_len=256)
    prompt = "the cat sat on the mat and the cat sat on the hat " * 2
    seen = {}
    for lookup in (None, 4):  # --speculative lookup --num-speculative-tokens 4 sets these defaults
        defaults = GenerationConfig(do_sample=False, prompt_lookup_num_tokens=lookup,
                                    max_matching_ngram_size=3 if lookup else None)
        app = create_app(lambda: Served(Engine(model, tokenizer).start(), tokenizer, "m", defaults, 256))
        with TestClient(app) as client:
            deadline = time.time() + 10
            while client.get("/health").status_code != 200 and time.time() < deadline:
                time.sleep(0.01)
            with ThreadPoolExecutor(3) as pool:  # rows verify their drafts together in the batch's steps
                answers = list(pool.map(lambda n: client.post("/v1/completions", json={
                    "prompt": prompt[n:], "max_tokens": 40, "logprobs": 1}).json()["choices"][0], range(3)))
            metrics = client.get("/metrics").text
        seen[lookup] = ([a["text"] for a in answers], [a["logprobs"]["token_logprobs"] for a in answers],
                        _metric(metrics, "llm:spec_decode_num_draft_tokens_total"),
                        _metric(metrics, "llm:spec_decode_num_accepted_tokens_total"))
    (plain, plain_logprobs, _, _), (fast, fast_logprobs, drafted, accepted) = seen[None], seen[4]
    assert fast == plain
    for fast_row, plain_row in zip(fast_logprobs, plain_logprobs, strict=True):
        assert fast_row == pytest.approx(plain_row, abs=1e-5)  # a float model: the rounding may differ
    assert drafted >= accepted > 0 and seen[None][2] == 0


def test_an_api_key_guards_the_v1_routes_and_leaves_health_and_metrics_open():
    tokenizer = build_char_tokenizer("ab")
    model = tiny_model("alibi", vocab_size=len(tokenizer))
    app = create_app(lambda: Served(Engine(model, tokenizer).start(), tokenizer, "m", GenerationConfig(), 96),
                     api_key="s3cret")
    with TestClient(app) as client:
        deadline = time.time() + 10
        while client.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.01)
        assert client.get("/metrics").status_code == 200
        for headers, message in (({}, "Missing API key"), ({"Authorization": "Bearer wrong"}, "Incorrect API key")):
            r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["message"].startswith(message)
            assert client.get("/v1/models", headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).status_code == 200


def _reference_logprobs(server, prompt_ids, new_ids):
    """log_softmax of the model's logits at each new token's position, one uncached forward."""
    ids = torch.tensor([prompt_ids + new_ids[:-1]])
    with torch.no_grad():
        logits = server.model(ids).logits[0, len(prompt_ids) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_are_the_models_and_the_same_alone_or_among_concurrent_requests(server):
    tokenizer = server.tokenizer

    def completion(prompt):
        return server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                logprobs=3)

    def chat(prompt):
        return server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)

    completion("the cat")
    alone = completion("the cat")
    lp = alone.choices[0].logprobs
    new = tokenizer(alone.choices[0].text, add_special_tokens=False).input_ids
    if alone.choices[0].finish_reason == "stop":
        new = new + [tokenizer.eos_token_id]
    assert len(lp.tokens) == len(new) == alone.usage.completion_tokens
    reference = _reference_logprobs(server, tokenizer("the cat", add_special_tokens=False).input_ids, new)
    assert torch.allclose(torch.tensor(lp.token_logprobs), reference[range(len(new)), new], atol=1e-5)
    for row, top in zip(reference, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(row.max().item(), abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    chat("hello")  # then every later "hello" prefills only what the prefix cache lacks, as the concurrent ones do
    chat_alone = chat("hello")
    content = chat_alone.choices[0].logprobs.content
    assert len(content) == chat_alone.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    # among concurrent requests (streamed too): the same tokens, logprobs equal to float rounding (a
    # batched step's matrix products round otherwise than one row's on torch's kernels)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(completion if i % 2 else chat, "the cat" if i % 2 else "hello") for i in range(8)]
        streamed = server.client.completions.create(model="tiny", prompt="the cat", max_tokens=12, temperature=0,
                                                    logprobs=3, stream=True)
        pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
        for i, future in enumerate(futures):
            out = future.result()
            if i % 2:
                assert out.choices[0].logprobs.tokens == lp.tokens
                assert out.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
                assert [list(t) for t in out.choices[0].logprobs.top_logprobs] == [list(t) for t in lp.top_logprobs]
            else:
                assert [c.token for c in out.choices[0].logprobs.content] == [c.token for c in content]
                assert ([c.logprob for c in out.choices[0].logprobs.content]
                        == pytest.approx([c.logprob for c in content], abs=1e-5))
    assert [x for p in pieces for x in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [x for p in pieces for x in p.text_offset] == lp.text_offset


def test_on_the_fast_path_a_greedy_answer_is_bit_identical_alone_and_among_16(cpu_kernels):
    # SmolLM2's GGUF as `llm serve` runs it (its own 4-bit blocks on our kernels): the same request's
    # tokens and logprobs, to the bit, alone and among 15 others sent at once, streamed or not
    from llm import MosaicGPT
    from llm.data.tokenizer import load_tokenizer
    from llm.utils.pretrained import pretrained_path

    if not pretrained_path("smollm2-135m-instruct").is_file():
        pytest.skip("SmolLM2 is fetched by make install (llm fetch smollm2-135m-instruct)")
    server = Server(MosaicGPT.from_pretrained("smollm2-135m-instruct"), load_tokenizer("smollm2-135m-instruct"),
                    "smollm2", max_batch_size=16)
    questions = ["What is the capital of France?", "Name three colours.", "Why do cats purr?", "Count to five.",
                 "What is tea?", "Say hello in Spanish.", "Is the sun a star?", "What do bees make?"]
    try:
        def chat(question, stream=False):
            out = server.client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0,
                logprobs=True, top_logprobs=2, stream=stream)
            content = [c for chunk in out for c in (chunk.choices[0].logprobs.content if chunk.choices and
                                                   chunk.choices[0].logprobs else [])] if stream else out.choices[0].logprobs.content
            return [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content]

        alone = chat(questions[0])
        assert len(alone) == 16 or alone[-1][0] == "<|im_end|>"
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(chat, questions[i % len(questions)], i % 4 == 1) for i in range(16)]
            together = [f.result() for f in futures]
        for i in range(0, 16, len(questions)):
            assert together[i] == alone
        assert together[1] == chat(questions[1])
    finally:
        server.close()


def test_a_json_schema_response_format_gives_json_that_matches_it(server):
    from llm.data import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer('{"ok": true, "kind": "cat", "n": 12} the quick brown fox ' * 20, 300)
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("rope", vocab_size=len(tokenizer), max_seq_len=256)
    defaults = GenerationConfig(do_sample=True, eos_token_id=tokenizer.eos_token_id)
    app = create_app(lambda: Served(Engine(model, tokenizer).start(), tokenizer, "m", defaults, 256))
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "kind", "n"],
              "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    with TestClient(app) as client:
        deadline = time.time() + 10
        while client.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.01)
        answers = []
        for seed in range(4):  # a random model: only the grammar makes these JSON
            r = client.post("/v1/completions", json={"prompt": "the", "max_tokens": 60, "seed": seed,
                                                     "response_format": response_format})
            answers.append(r.json()["choices"][0])
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a pet?"}],
                                                      "max_tokens": 60, "seed": 9, "response_format": response_format})
        answers.append({"text": r.json()["choices"][0]["message"]["content"],
                        "finish_reason": r.json()["choices"][0]["finish_reason"]})
        r = client.post("/v1/completions", json={"prompt": "the", "max_tokens": 30, "seed": 1,
                                                 "response_format": {"type": "json_object"}})
        # any object: a random model's keys and strings may run past max_tokens, but it is one
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{")
        bad = client.post("/v1/completions", json={"prompt": "the", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
        assert "Invalid type: nonsense" in bad.json()["error"]["message"]
    for answer in answers:
        value = json.loads(answer["text"])
        assert answer["finish_reason"] == "stop" and set(value) == {"ok", "kind", "n"}
        assert type(value["ok"]) is bool and value["kind"] in ("cat", "dog") and 0 <= value["n"] <= 99
    # the char-level test model's tokenizer is not one llguidance reads: a clear 400
    with pytest.raises(openai.BadRequestError, match="response_format needs a tokenizer llguidance can read"):
        server.client.completions.create(model="tiny", prompt="a", max_tokens=5,
                                         extra_body={"response_format": {"type": "json_object"}})
