"""The OpenAI API's request and response shapes: request bodies checked and turned into engine
requests, responses and stream chunks built, new tokens turned into text.

Field names, defaults and error bodies are OpenAI's (``/v1/completions`` and
``/v1/chat/completions``, as vLLM and llama.cpp's ``llama-server`` serve them); our extra sampling
fields take their transformers names (``top_k``, ``min_p``, ``repetition_penalty``,
``prompt_lookup_num_tokens``). Unknown fields are ignored, as OpenAI's server does.
"""

from __future__ import annotations

import json
import math
import time
import uuid
import warnings
from dataclasses import dataclass, field

from llm.generation.config import GenerationConfig

#: OpenAI's default max_tokens for /v1/completions (chat defaults to what the context leaves).
COMPLETIONS_MAX_TOKENS = 16


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: the HTTP status (400, 404, 429, 500, 503).
        message: what was wrong and what is allowed.
        param: the request field at fault, or None.
        code: a machine-readable code (OpenAI's where it has one), or None.
    """

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def parse_body(raw: bytes) -> dict:
    """The request's JSON object.

    Raises:
        APIError: 400 for a body that is not UTF-8 JSON, or not an object.
    """
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise bad(f"the request body is not UTF-8: {err}") from None
    except json.JSONDecodeError as err:
        raise bad(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise bad("the request body nests JSON too deeply") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
          dict: "an object"}


def _field(body: dict, name: str, kind, default=None, *, minimum=None, maximum=None, above=None):
    """``body[name]`` checked: of ``kind`` (int accepted for float, bool never for numbers), within
    the bounds; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise bad(f"'{name}' must be {_NAMES[kind]}, got {json.dumps(value)}", name)
    if kind is float and not math.isfinite(value):
        raise bad(f"'{name}' must be a finite number, got {value}", name)
    if minimum is not None and value < minimum:
        raise bad(f"'{name}' must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise bad(f"'{name}' must be <= {maximum}, got {value}", name)
    if above is not None and value <= above:
        raise bad(f"'{name}' must be > {above}, got {value}", name)
    return value


@dataclass
class Parsed:
    """A checked request: its prompts as token ids, and the options of each of its choices.

    Attributes:
        prompts: token ids per prompt; texts: the prompts as text (for ``echo``).
        choices: per choice, (prompt index, options); choice i of prompt p has index p * n + i.
        stop: the stop strings (the text ends before the first of them).
    """

    prompts: list[list[int]]
    texts: list[str]
    choices: list[tuple[int, GenerationConfig]]
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def _token_ids(item: list, vocab_size: int) -> list[int]:
    bad_ids = [t for t in item if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(f"'prompt' holds token id {bad_ids[0]}, outside the vocabulary of {vocab_size} tokens "
                  f"(ids 0 to {vocab_size - 1})", "prompt")
    return list(item)


def _prompts(body: dict, tokenizer, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("'prompt' must be a string, an array of strings, an array of token ids or an array of arrays "
                  "of token ids, and not empty", "prompt")
    ids, texts = [], []
    for item in prompt:
        if isinstance(item, str):
            ids.append(tokenizer(item, add_special_tokens=False).input_ids)
            texts.append(item)
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids.append(_token_ids(item, vocab_size))
            texts.append(tokenizer.decode(ids[-1]))
        else:
            raise bad("'prompt' must be a string, an array of strings, an array of token ids or an array of "
                      f"arrays of token ids; got an item {json.dumps(item)[:80]}", "prompt")
    return ids, texts


def _content(message: dict, i: int) -> str | None:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                          f"supported, got {json.dumps(part)[:80]}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or an array of text parts", "messages")


#: Chat roles served, as OpenAI names them -> the role given to the chat template (OpenAI's
#: "developer" messages are what "system" messages were).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _chat_prompt(body: dict, tokenizer) -> tuple[list[list[int]], list[str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty array of {'role', 'content'} objects", "messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        role = message["role"]
        if role not in _ROLES:
            served = "; tools are not served" if role in ("tool", "function") else ""
            raise bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}{served}", "messages")
        content = _content(message, i)
        if content is None:
            raise bad(f"messages[{i}] has no 'content' (a string or an array of text parts)", "messages")
        turns.append({"role": _ROLES[role], "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's own checks (role order...) raise jinja errors
        raise bad(f"the chat template refused these messages: {err}", "messages") from None
    return [tokenizer(text, add_special_tokens=False).input_ids], [text]


#: OpenAI fields that would change the answer and that this server does not implement: refused,
#: rather than answered as if they were not there (their neutral values pass).
_UNSERVED = {
    "presence_penalty": lambda v: v not in (None, 0, 0.0), "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "logit_bias": lambda v: bool(v), "best_of": lambda v: v not in (None, 1), "suffix": lambda v: bool(v),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") not in (None, "text"),
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "logprobs": lambda v: v is not None and v is not False, "top_logprobs": lambda v: v is not None,
}


def parse_request(body: dict, *, chat: bool, tokenizer, defaults: GenerationConfig, max_seq_len: int,
                  max_choices: int, vocab_size: int | None = None) -> Parsed:
    """Check a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body.

    Args:
        defaults: the model's generation config (its sampling defaults, eos id), under the
            request's fields.
        max_seq_len: the model's context: prompt + max_tokens may not exceed it.
        max_choices: the most sequences (prompts x n) one request may ask for.
        vocab_size: token ids given as prompts must be below it (default: the tokenizer's size).

    Raises:
        APIError: 400 naming the field for a missing or mistyped field, a value out of range
            (``max_tokens`` < 1, ``temperature`` < 0, ``top_p`` outside (0, 1], ``n`` < 1...), a
            prompt that with its ``max_tokens`` exceeds the context, token ids outside the
            vocabulary, or a field this server does not implement with a value that would matter
            (``logprobs``, penalties, ``logit_bias``, ``best_of``, ``suffix``, ``response_format``
            other than text, a forced ``tool_choice``).
    """
    for name, matters in _UNSERVED.items():
        if matters(body.get(name)):
            raise bad(f"'{name}' is not supported by this server (got {json.dumps(body.get(name))[:80]})", name)
    vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
    prompts, texts = _chat_prompt(body, tokenizer) if chat else _prompts(body, tokenizer, vocab_size)
    # max_completion_tokens is the newer name of max_tokens (which OpenAI deprecates for chat): it wins
    max_tokens = _field(body, "max_tokens", int, None, minimum=1)
    if chat:
        max_tokens = _field(body, "max_completion_tokens", int, max_tokens, minimum=1)
    n = _field(body, "n", int, 1, minimum=1)
    if n * len(prompts) > max_choices:
        raise bad(f"{len(prompts)} prompts x n={n} asks for {n * len(prompts)} completions; this server takes "
                  f"at most {max_choices} per request", "n")
    temperature = _field(body, "temperature", float, None, minimum=0.0)
    top_p = _field(body, "top_p", float, None, maximum=1.0, above=0.0)
    top_k = _field(body, "top_k", int, None, minimum=-1)
    min_p = _field(body, "min_p", float, None, minimum=0.0, maximum=1.0)
    repetition_penalty = _field(body, "repetition_penalty", float, None, above=0.0)
    lookup = _field(body, "prompt_lookup_num_tokens", int, None, minimum=1)
    seed = _field(body, "seed", int, None, minimum=0, maximum=2**63 - 1)
    stream = _field(body, "stream", bool, False)
    stream_options = _field(body, "stream_options", dict, {})
    include_usage = _field(stream_options, "include_usage", bool, False)
    echo = False if chat else _field(body, "echo", bool, False)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise bad(f"'stop' must be a string or an array of strings, got {json.dumps(stop)[:80]}", "stop")
    stop = tuple(s for s in stop or () if s)

    for ids in prompts:
        if not ids:
            raise bad("the prompt is empty: it must hold at least one token", "messages" if chat else "prompt")
        wanted = max_tokens if max_tokens is not None else (max_seq_len - len(ids) if chat else COMPLETIONS_MAX_TOKENS)
        if len(ids) + max(wanted, 1) > max_seq_len:
            raise bad(f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                      f"{len(ids) + max(wanted, 1)} tokens ({len(ids)} in the prompt, {max(wanted, 1)} in the "
                      "completion). Please reduce the prompt or the completion length.",
                      "messages" if chat else "prompt", "context_length_exceeded")

    overrides = {}
    if temperature is not None:
        overrides.update(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0)
    for name, value in (("top_p", top_p), ("min_p", min_p), ("repetition_penalty", repetition_penalty),
                        ("prompt_lookup_num_tokens", lookup)):
        if value is not None:
            overrides[name] = value
    if top_k is not None:
        overrides["top_k"] = top_k if top_k > 0 else None  # vLLM's -1 (and 0): no top-k
    if stop:
        overrides["stop_strings"] = stop
    choices = []
    for p, ids in enumerate(prompts):
        wanted = max_tokens if max_tokens is not None else (max_seq_len - len(ids) if chat else COMPLETIONS_MAX_TOKENS)
        for i in range(n):
            index = p * n + i
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # greedy requests may carry sampling fields
                    options = defaults.update(**overrides, max_new_tokens=wanted,
                                              seed=seed + index if seed is not None else None)
            except (ValueError, TypeError) as err:
                name = str(err).split(" ", 1)[0]
                raise bad(str(err), name if name in body else None) from None
            choices.append((p, options))
    return Parsed(prompts, texts, choices, stop, stream, include_usage, echo)


class TextStream:
    """New tokens of one choice -> new text, safe to send: the text ends before the first stop
    string, and text that may still become part of one (or an incomplete UTF-8 character) is
    held back until the next tokens decide it.

    Args:
        tokenizer: decodes with ``skip_special_tokens=True``.
        stop: the stop strings.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0
        self.stopped = False

    def text(self) -> str:
        """All the text so far, cut before the first stop string."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            text = text[:min(hits)]
        return text

    def add(self, tokens: list[int], final: bool = False) -> str:
        """Take new token ids; return the text they make sendable (all of the rest when ``final``)."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self.text()
        end = len(text)
        if not (final or self.stopped):
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response(chat: bool, request_id: str, model: str, created: int, texts: list[str], reasons: list[str],
             usage_: dict) -> dict:
    """The whole answer of a request that did not stream."""
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_}


def chunk(chat: bool, request_id: str, model: str, created: int, index: int, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, include_usage: bool = False) -> dict:
    """One streamed chunk of choice ``index`` (OpenAI's ``chat.completion.chunk`` or a
    ``text_completion`` chunk)."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(chat: bool, request_id: str, model: str, created: int, usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_}
