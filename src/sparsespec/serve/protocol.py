"""The OpenAI wire format: request bodies into :class:`GenerationRequest` s, results into response objects.

Fields read: ``messages`` (chat) or ``prompt`` (completions), ``max_tokens`` / ``max_completion_tokens``,
``temperature``, ``top_p``, ``top_k`` (an extension), ``seed``, ``stop``, ``n`` (1 only), ``stream``,
``stream_options.include_usage``, ``ignore_eos`` (an extension, as vLLM's and llama.cpp's servers have it: go on
past end-of-sequence tokens to ``max_tokens``, for load tests), ``cache_salt`` (as vLLM's: a request resumes only
from cached text that a request with the same salt left). Every other field is ignored. Defaults are OpenAI's:
temperature 1, top_p 1.

Bodies are checked before anything reads them: JSON objects nested at most :data:`MAX_JSON_DEPTH` deep whose strings
are valid Unicode (no lone surrogates); prompts are measured in characters before they are tokenized and in tokens
after (:class:`PromptLimits`). A message's content is text: special tokens written in it are tokenized as text
(``Tokenizer.apply_chat_template``); a completions ``prompt`` is the model's raw input, special tokens included.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..sampling import SEED_RANGE, SamplingParams
from .worker import GenerationRequest

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadRequest(Exception):
    """A request the server cannot take; answered 400 with an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# How deeply a request body may nest arrays and objects (a chat request needs 4; Python's parser gives up near 1,000).
MAX_JSON_DEPTH = 64


def parse_body(raw: bytes) -> dict:
    """The request body as a checked JSON object (see the module's docstring); :class:`BadRequest` otherwise."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"The request body nests arrays or objects more than {MAX_JSON_DEPTH} deep.") from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    pending = [(body, 1, None)]
    while pending:
        value, depth, field = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"The request body nests arrays or objects more than {MAX_JSON_DEPTH} deep.", field)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(key, field or key)
                pending.append((item, depth + 1, field or key))
        elif isinstance(value, list):
            pending.extend((item, depth + 1, field) for item in value)
        elif isinstance(value, str):
            _check_unicode(value, field)
    return body


def _check_unicode(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"'{field}' holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text.",
                         field) from None


@dataclass(frozen=True)
class PromptLimits:
    """How long a prompt may be: ``tokens`` after tokenizing, and ``chars`` before (a prompt of more characters
    than ``tokens`` of the tokenizer's longest token could not fit, so it is refused without being tokenized)."""

    tokens: int
    chars: int

    @classmethod
    def for_tokenizer(cls, tokenizer, tokens: int) -> "PromptLimits":
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
        return cls(tokens, tokens * max(longest, 1))

    def check_chars(self, chars: int, field: str) -> None:
        if chars > self.chars:
            raise BadRequest(f"The prompt has {chars} characters; this server takes at most {self.tokens} tokens, "
                             f"which no text of more than {self.chars} characters fits in.", field)

    def check_tokens(self, ids: list[int], field: str) -> list[int]:
        if len(ids) > self.tokens:
            raise BadRequest(f"The prompt is {len(ids)} tokens long; this server takes at most {self.tokens} "
                             "(--max-prompt-tokens).", field)
        return ids


@dataclass(frozen=True)
class ParsedRequest:
    """A request body, checked: the prompt's token ids and how to generate."""

    prompt_ids: list[int]
    max_tokens: int | None  # None: the worker's default
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    cache_salt: str | None = None

    def generation(self, max_tokens: int) -> GenerationRequest:
        return GenerationRequest(self.prompt_ids, max_tokens, self.sampling, self.seed, self.stop, self.ignore_eos,
                                 self.cache_salt)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number from {low:g} to {high:g} (got {value!r}).", name)
    return float(value)


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadRequest(f"'{name}' must be an integer of at least {low} (got {value!r}).", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise BadRequest("'stop' must be a string or a list of strings.", "stop")


def parse_common(body, prompt_ids: list[int]) -> ParsedRequest:
    """The generation fields shared by both endpoints."""
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise BadRequest("Only n = 1 is supported.", "n")
    if body.get("logprobs"):
        raise BadRequest("logprobs are not supported.", "logprobs")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise BadRequest("'top_p' must be above 0.", "top_p")
    sampling = SamplingParams(_number(body, "temperature", 1.0, 0.0, 2.0), _integer(body, "top_k", 0) or 0, top_p)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer (got {seed!r}).", "seed")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    ignore_eos = body.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise BadRequest("'ignore_eos' must be true or false.", "ignore_eos")
    if ignore_eos and max_tokens is None:
        raise BadRequest("'ignore_eos' needs 'max_tokens': the answer would run to the end of the context.",
                         "ignore_eos")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string.", "cache_salt")
    return ParsedRequest(prompt_ids, max_tokens, sampling, None if seed is None else seed % SEED_RANGE, _stop(body),
                         stream, bool(options.get("include_usage")), ignore_eos, salt)


def _message_text(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content: only text parts are supported.", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"messages[{index}].content must be a string or a list of text parts.", "messages")


def chat_prompt_ids(body: dict, tokenizer, limits: PromptLimits) -> list[int]:
    """The ``messages`` rendered by the model's own chat template, ending with the assistant's turn opened."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list.", "messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] needs a 'role' among {', '.join(ROLES)}.", "messages")
        plain.append({"role": message["role"], "content": _message_text(message, i)})
    limits.check_chars(sum(len(message["content"]) for message in plain), "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("This model has no chat template; use /v1/completions.", "messages")
    try:
        ids = list(tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True))
    except Exception as exc:  # the template's own checks (e.g. roles that must alternate)
        raise BadRequest(f"The chat template rejected the messages: {exc}", "messages") from None
    return limits.check_tokens(ids, "messages")


def text_prompt_ids(body: dict, tokenizer, limits: PromptLimits) -> list[int]:
    """``prompt``: a string, a list holding one string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty.", "prompt")
        limits.check_chars(len(prompt), "prompt")
        return limits.check_tokens(tokenizer.encode(prompt, add_special_tokens=True), "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise BadRequest(f"'prompt' token ids must be in [0, {vocab}).", "prompt")
        return limits.check_tokens(list(prompt), "prompt")
    raise BadRequest("'prompt' must be a non-empty string, a list of one string, or a list of token ids.", "prompt")


class Responses:
    """Builds the response objects of one request (same id and timestamp throughout)."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def complete(self, text: str, finish_reason: str, usage: dict, extension: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        out = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        out.update(usage=usage, sparsespec=extension)
        return out

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *, first: bool = False) -> dict:
        """One streamed chunk: a piece of text, or (with ``finish_reason``) the last choice chunk."""
        if self.chat:
            delta = {} if finish_reason else {"content": text or ""}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage
        return out
