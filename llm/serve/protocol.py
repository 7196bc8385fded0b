"""The OpenAI API's request and response shapes as pydantic models: request bodies checked
(:class:`CompletionRequest`, :class:`ChatCompletionRequest`) and turned into engine requests,
responses and stream chunks built (:class:`Completion`, :class:`ChatCompletion`,
:class:`ChatCompletionChunk`), new tokens turned into text.

Field names, defaults and error bodies are OpenAI's (``/v1/completions`` and
``/v1/chat/completions``, as vLLM and llama.cpp's ``llama-server`` serve them); our extra sampling
fields take their transformers names (``top_k``, ``min_p``, ``repetition_penalty``,
``prompt_lookup_num_tokens``). Unknown fields are ignored, as OpenAI's server does.
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llm.data.text_tokenizer import IncrementalText
from llm.generation.config import GenerationConfig

#: The most alternatives a token's logprobs entry may list (OpenAI's limit for chat).
MAX_LOGPROBS = 20

#: OpenAI's default max_tokens for /v1/completions (chat defaults to what the context leaves).
COMPLETIONS_MAX_TOKENS = 16


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: the HTTP status (400, 401, 404, 413, 429, 500, 503).
        message: what was wrong and what is allowed.
        param: the request field at fault, or None.
        code: a machine-readable code (OpenAI's where it has one), or None.
    """

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

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
        APIError: 400 for a body that is not UTF-8 JSON, not an object, or holds a lone surrogate.
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
    try:  # JSON's \ud800-style escapes can spell a lone UTF-16 surrogate, which no tokenizer encodes
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad(f"the request body holds a lone UTF-16 surrogate ({err.object[err.start]!r}), which is not "
                  "a character: escape pairs must be whole (\\ud83d\\ude00)") from None
    return body


class _Body(BaseModel):
    """A request body's fields, typed as JSON gives them: no strings for numbers, no booleans for
    integers (an integer is a number), finite numbers only; unknown fields are ignored, as OpenAI's
    server does; null is the same as absent."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = None


#: Chat roles served, as OpenAI names them -> the role given to the chat template (OpenAI's
#: "developer" messages are what "system" messages were).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ChatMessage(_Body):
    """One message of a chat request; ``content`` is a string or an array of text parts (joined)."""

    role: str
    content: Any = None

    @field_validator("role")
    @classmethod
    def _served_role(cls, role: str) -> str:
        if role not in _ROLES:
            served = "; tools are not served" if role in ("tool", "function") else ""
            raise ValueError(f"must be one of {', '.join(_ROLES)}, got {role!r}{served}")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("must be a string or an array of text parts")
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("must be a string or text parts ({'type': 'text', 'text': ...}), got a part "
                                 f"{json.dumps(part)[:80]}")
        return "".join(part["text"] for part in content)


def _neutral(*values):
    """A check that refuses a field this server does not implement unless it has a neutral value."""

    def check(cls, value):
        # by type too: 0 is not the neutral False of logprobs
        if value is not None and not any(type(value) is type(v) and value == v for v in values):
            raise ValueError(f"is not supported by this server (got {json.dumps(value)[:80]})")
        return value

    return check


class _Request(_Body):
    """The fields /v1/completions and /v1/chat/completions share (OpenAI's, plus transformers'
    names for our extra sampling fields). ``max_completion_tokens`` is the newer name of
    ``max_tokens`` (which OpenAI deprecates for chat) and wins over it on both routes."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    prompt_lookup_num_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Any = None
    # OpenAI fields that would change the answer and that this server does not implement: refused,
    # rather than answered as if they were not there (their neutral values pass).
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    response_format: Any = None
    tool_choice: Any = None

    _penalties = field_validator("presence_penalty", "frequency_penalty")(_neutral(0, 0.0))
    _bias = field_validator("logit_bias")(_neutral({}))
    _tool_choice = field_validator("tool_choice")(_neutral("none", "auto"))

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop) -> tuple[str, ...]:
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
            raise ValueError(f"must be a string or an array of strings, got {json.dumps(stop)[:80]}")
        return tuple(s for s in stop or () if s)

    @field_validator("response_format")
    @classmethod
    def _format(cls, value):
        """OpenAI's response_format as a JSON schema the answer must match (None: free text)."""
        if value is None:
            return None
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in (None, "text") and isinstance(value, dict):
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("json_schema needs {\"name\": ..., \"schema\": {a JSON schema}}")
            return schema
        raise ValueError(f"must be of type text, json_object or json_schema (got {json.dumps(value)[:80]})")


def _prompt_items(prompt) -> list:
    """OpenAI's four prompt forms as a list of strings and token-id lists."""
    def ids(item) -> bool:
        return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

    if isinstance(prompt, str) or (ids(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("must be a string, an array of strings, an array of token ids or an array of arrays "
                         "of token ids, and not empty")
    for item in prompt:
        if not (isinstance(item, str) or ids(item)):
            raise ValueError("must be a string, an array of strings, an array of token ids or an array of "
                             f"arrays of token ids; got an item {json.dumps(item)[:80]}")
    return prompt


class CompletionRequest(_Request):
    """The body of ``POST /v1/completions``; ``logprobs``: how many alternatives each token's
    entry lists (0 to :data:`MAX_LOGPROBS`)."""

    prompt: Any
    logprobs: Any = None

    @field_validator("logprobs")
    @classmethod
    def _alternatives(cls, value):
        if value is None or value is False:  # false: what chat clients send for none
            return None
        if type(value) is not int or not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"must be an integer from 0 to {MAX_LOGPROBS} (alternatives per token), "
                             f"got {json.dumps(value)[:80]}")
        return value
    echo: bool | None = None
    best_of: Any = None
    suffix: Any = None

    _prompt = field_validator("prompt")(lambda cls, value: _prompt_items(value))
    _best_of = field_validator("best_of")(_neutral(1))
    _suffix = field_validator("suffix")(_neutral(""))


class ChatCompletionRequest(_Request):
    """The body of ``POST /v1/chat/completions``; ``logprobs: true`` asks for each token's log
    probability, with ``top_logprobs`` (0 to :data:`MAX_LOGPROBS`) alternatives."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def _path(loc: tuple) -> str:
    """pydantic's error location as a dotted path: ``messages[1].role``, ``stream_options.include_usage``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


#: pydantic's type names -> JSON's, as a client writes its request
_JSON_NAMES = (("a valid list", "an array"), ("a valid dictionary", "an object"), ("a valid integer", "an integer"),
               ("a valid number", "a number"), ("a valid boolean", "a boolean"), ("a valid string", "a string"))


def _bad_body(err: ValidationError) -> APIError:
    """The first of pydantic's errors as one line naming the field, what is allowed and what came."""
    first = err.errors(include_url=False)[0]
    path = _path(first["loc"])
    if first["type"] == "missing":
        return bad(f"'{path}' is required", path)
    if first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        message = "must be an object"
    else:
        message = first["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        message = message.replace("List should have", "must have").replace(" after validation", "")
        for python, json_name in _JSON_NAMES:
            message = message.replace(python, json_name)
    got = "" if first["type"] == "value_error" else f", got {json.dumps(first.get('input'), default=str)[:80]}"
    return bad(f"'{path}' {message}{got}", path)


@dataclass
class Parsed:
    """A checked request: its prompts as token ids, and the options of each of its choices.

    Attributes:
        prompts: token ids per prompt; texts: the prompts as text (for ``echo``).
        choices: per choice, (prompt index, options); choice i of prompt p has index p * n + i.
        stop: the stop strings (the text ends before the first of them).
        logprobs: with logprobs asked for, how many alternatives each token's entry lists.
        grammar: with a ``json_object`` or ``json_schema`` response_format, the answer's grammar
            (llguidance's, from the schema); the engine lets only tokens that keep to it through.
    """

    prompts: list[list[int]]
    texts: list[str]
    choices: list[tuple[int, GenerationConfig]]
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: int | None = None  # alternatives per token's logprobs entry; None: no logprobs
    grammar: str | None = None  # llguidance's grammar of the answer (response_format); None: free text


def _prompts(request: CompletionRequest, tokenizer, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    ids, texts = [], []
    for item in request.prompt:
        if isinstance(item, str):
            ids.append(tokenizer(item, add_special_tokens=False).input_ids)
            texts.append(item)
            continue
        bad_ids = [t for t in item if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad(f"'prompt' holds token id {bad_ids[0]}, outside the vocabulary of {vocab_size} tokens "
                      f"(ids 0 to {vocab_size - 1})", "prompt")
        ids.append(list(item))
        texts.append(tokenizer.decode(item))
    return ids, texts


def _chat_prompt(request: ChatCompletionRequest, tokenizer) -> tuple[list[list[int]], list[str]]:
    turns = []
    for i, message in enumerate(request.messages):
        content = message.content
        if content is None:
            raise bad(f"messages[{i}] has no 'content' (a string or an array of text parts)", f"messages[{i}].content")
        turns.append({"role": _ROLES[message.role], "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's own checks (role order...) raise jinja errors
        raise bad(f"the chat template refused these messages: {err}", "messages") from None
    return [tokenizer(text, add_special_tokens=False).input_ids], [text]


def parse_request(body: dict, *, chat: bool, tokenizer, defaults: GenerationConfig, max_seq_len: int,
                  max_choices: int, vocab_size: int | None = None) -> Parsed:
    """Check a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body against
    :class:`CompletionRequest` / :class:`ChatCompletionRequest` and the model.

    Args:
        defaults: the model's generation config (its sampling defaults, eos id), under the
            request's fields.
        max_seq_len: the model's context: prompt + max_tokens may not exceed it.
        max_choices: the most sequences (prompts x n) one request may ask for.
        vocab_size: token ids given as prompts must be below it (default: the tokenizer's size).

    Raises:
        APIError: 400 naming the field (its dotted path as ``param``) for a missing or mistyped
            field, a value out of range (``max_tokens`` < 1, ``temperature`` < 0, ``top_p``
            outside (0, 1], ``n`` < 1...), a prompt that with its ``max_tokens`` exceeds the
            context, token ids outside the vocabulary, or a field this server does not implement
            with a value that would matter (penalties, ``logit_bias``, ``best_of``,
            ``suffix``, a forced ``tool_choice``); a ``response_format`` whose schema llguidance
            cannot compile.
    """
    try:
        request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as err:
        raise _bad_body(err) from None
    vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
    stop = request.stop or ()
    overrides = {}
    if request.temperature is not None:
        overrides.update(do_sample=request.temperature > 0,
                         temperature=request.temperature if request.temperature > 0 else 1.0)
    for name in ("top_p", "min_p", "repetition_penalty", "prompt_lookup_num_tokens"):
        if getattr(request, name) is not None:
            overrides[name] = getattr(request, name)
    if request.top_k is not None:
        overrides["top_k"] = request.top_k if request.top_k > 0 else None  # vLLM's -1 (and 0): no top-k
    if stop:
        overrides["stop_strings"] = stop
    # every parameter first, then the prompt (a chat template may be missing or refuse the messages)
    _options(defaults, overrides, body, max_new_tokens=1)
    echo = bool(not chat and request.echo)
    logprobs, grammar = _logprobs(request, chat, echo), _grammar(request)
    prompts, texts = _chat_prompt(request, tokenizer) if chat else _prompts(request, tokenizer, vocab_size)
    max_tokens = request.max_completion_tokens or request.max_tokens
    n = request.n or 1
    if n * len(prompts) > max_choices:
        asked = f"{len(prompts)} prompts" if len(prompts) > 1 else "1 prompt"
        raise bad(f"{asked} x n={n} ask for {n * len(prompts)} completions; this server makes at most {max_choices} "
                  "per request", "n" if n > 1 else "prompt")

    for ids in prompts:
        if not ids:
            raise bad("the prompt is empty: it must hold at least one token", "messages" if chat else "prompt")
        wanted = max_tokens if max_tokens is not None else (max_seq_len - len(ids) if chat else COMPLETIONS_MAX_TOKENS)
        if len(ids) + max(wanted, 1) > max_seq_len:
            raise bad(f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                      f"{len(ids) + max(wanted, 1)} tokens ({len(ids)} in the prompt, {max(wanted, 1)} in the "
                      "completion). Please reduce the prompt or the completion length.",
                      "messages" if chat else "prompt", "context_length_exceeded")

    seed = request.seed
    choices = []
    for p, ids in enumerate(prompts):
        wanted = max_tokens if max_tokens is not None else (max_seq_len - len(ids) if chat else COMPLETIONS_MAX_TOKENS)
        for i in range(n):
            index = p * n + i
            choices.append((p, _options(defaults, overrides, body, max_new_tokens=wanted,
                                        seed=seed + index if seed is not None else None)))
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return Parsed(prompts, texts, choices, stop, bool(request.stream), include_usage, echo,
                  logprobs=logprobs, grammar=grammar)


def _options(defaults: GenerationConfig, overrides: dict, body: dict, **more) -> GenerationConfig:
    """``defaults`` updated with the request's options; a 400 naming the field they refuse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # greedy requests may carry sampling fields
            return defaults.update(**overrides, **more)
    except (ValueError, TypeError) as err:
        name = str(err).split(" ", 1)[0]
        raise bad(str(err), name if name in body else None) from None


def _grammar(request) -> str | None:
    """llguidance's grammar of the answer a response_format asks for (None: free text)."""
    if request.response_format is None:
        return None
    from llguidance import LLMatcher

    try:
        # no whitespace beyond JSON's compact form, else a weak model may spend its tokens on it
        grammar = LLMatcher.grammar_from_json_schema(request.response_format,
                                                     defaults={"whitespace_flexible": False})
        error = LLMatcher.validate_grammar(grammar)
    except Exception as err:  # the compiler's own exceptions, by kind of schema
        error = str(err) or type(err).__name__
    if error:
        raise bad(f"response_format: the JSON schema cannot be used: {error}", "response_format")
    return grammar


def _logprobs(request, chat: bool, echo: bool) -> int | None:
    """How many alternatives each token's logprobs entry lists; None without logprobs."""
    if chat:
        if request.top_logprobs is not None and not request.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        wanted = (request.top_logprobs or 0) if request.logprobs else None
    else:
        wanted = request.logprobs
    if wanted is not None and echo:
        raise bad("logprobs with echo (the prompt's logprobs) is not supported", "logprobs")
    return wanted


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
        self._text = IncrementalText(tokenizer)  # decoded a window at a time, not whole at each step
        self.tokens: list[int] = self._text.ids
        self.sent = 0
        self.stopped = False

    def text(self) -> str:
        """All the text so far, cut before the first stop string."""
        text = self._text.text + self._text.pending()
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            text = text[:min(hits)]
        return text

    def add(self, tokens: list[int], final: bool = False) -> str:
        """Take new token ids; return the text they make sendable (all of the rest when ``final``)."""
        if self.stopped:
            return ""
        self._text.add(tokens)
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


class _Out(BaseModel):
    """A response object; dumped with ``exclude_unset`` so that a field is sent exactly when it is
    given (OpenAI sends ``usage`` in stream chunks only when asked, and deltas without content)."""


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None


class AssistantMessage(_Out):
    role: str = "assistant"
    content: str


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: dict | None
    finish_reason: str | None


class Delta(_Out):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: Delta
    logprobs: dict | None
    finish_reason: str | None


class _Response(_Out):
    id: str
    object: str
    created: int
    model: str


class Completion(_Response):
    """A ``text_completion``: the answer of /v1/completions, whole or one stream chunk."""

    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletion(_Response):
    """A ``chat.completion``: the whole answer of /v1/chat/completions."""

    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Response):
    """A ``chat.completion.chunk``: one event of a streamed /v1/chat/completions answer."""

    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


#: One new token's log probability: (token id, its logprob, [(id, logprob) of the most likely
#: tokens, most likely first]).
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


def logprobs_json(chat: bool, entries: list[TokenLogprob], tokenizer, offset: int = 0) -> dict:
    """OpenAI's ``logprobs`` of a choice (or a chunk's tokens): chat's ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs"}]}``, completions' ``{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}`` (offsets into the completion from ``offset``). A token's
    text is its own decoding (a piece of a multi-byte character decodes to U+FFFD)."""
    def text(token: int) -> str:
        return tokenizer.decode([token])

    if chat:
        def item(token, logprob):
            piece = text(token)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

        return {"content": [dict(item(t, lp), top_logprobs=[item(a, alp) for a, alp in top])
                            for t, lp, top in entries]}
    tokens = [text(t) for t, _, _ in entries]
    offsets = []
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(a): alp for a, alp in top} for _, _, top in entries], "text_offset": offsets}


def response(chat: bool, request_id: str, model: str, created: int, texts: list[str], reasons: list[str],
             usage_: Usage, logprobs: list[dict] | None = None) -> dict:
    """The whole answer of a request that did not stream, as JSON-ready dicts (``logprobs``:
    per choice, from :func:`logprobs_json`)."""
    logprobs = logprobs or [None] * len(texts)
    rows = enumerate(zip(texts, reasons, logprobs))
    if chat:
        out = ChatCompletion(id=request_id, object="chat.completion", created=created, model=model, usage=usage_,
                             choices=[ChatChoice(index=i, message=AssistantMessage(role="assistant", content=t),
                                                 logprobs=lp, finish_reason=r) for i, (t, r, lp) in rows])
    else:
        out = Completion(id=request_id, object="text_completion", created=created, model=model, usage=usage_,
                         choices=[CompletionChoice(index=i, text=t, logprobs=lp, finish_reason=r)
                                  for i, (t, r, lp) in rows])
    return out.model_dump(exclude_unset=True)


def chunk(chat: bool, request_id: str, model: str, created: int, index: int, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, include_usage: bool = False,
          logprobs: dict | None = None) -> dict:
    """One streamed chunk of choice ``index`` (OpenAI's ``chat.completion.chunk`` or a
    ``text_completion`` chunk), as JSON-ready dicts; ``"usage": null`` with ``include_usage``;
    ``logprobs``: of the tokens that came with this chunk (:func:`logprobs_json`)."""
    extra = {"usage": None} if include_usage else {}
    if chat:
        delta = Delta(role="assistant", content="") if role else (Delta(content=text) if text else Delta())
        out = ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created, model=model,
                                  choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                           finish_reason=finish_reason)], **extra)
    else:
        out = Completion(id=request_id, object="text_completion", created=created, model=model,
                         choices=[CompletionChoice(index=index, text=text or "", logprobs=logprobs,
                                                   finish_reason=finish_reason)], **extra)
    return out.model_dump(exclude_unset=True)


def usage_chunk(chat: bool, request_id: str, model: str, created: int, usage_: Usage) -> dict:
    """The last chunk of a stream that asked for usage: no choices, the usage."""
    cls = ChatCompletionChunk if chat else Completion
    return cls(id=request_id, object="chat.completion.chunk" if chat else "text_completion", created=created,
               model=model, choices=[], usage=usage_).model_dump(exclude_unset=True)
