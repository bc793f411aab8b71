"""OpenAI request bodies: parsed and validated into :class:`OpenAIRequest`, then a ``RouterRequest``.

Accepted (``/v1/completions`` and ``/v1/chat/completions``):

* ``model`` (required, at most :data:`MAX_MODEL_NAME_CHARS` characters), ``stream``,
  ``stream_options.include_usage``, ``temperature`` (default 1, in [0, 100]), ``top_p`` (default 1,
  in (0, 1]), ``seed`` (in [0, 2^63)), ``stop`` (a string or a list of at most
  ``FrontdoorConfig.max_stop_strings`` strings of at most :data:`MAX_STOP_CHARS` characters each,
  applied to the decoded text by the front door), ``user`` (ignored);
* ``max_tokens`` (or OpenAI's newer ``max_completion_tokens``, which wins; clients such as aiperf
  send it to ``/v1/completions`` too): at least 1, and with the
  prompt within the model's context. When absent: the context left after the prompt, capped at
  ``FrontdoorConfig.default_max_tokens`` (256 by default);
* extensions (vLLM's): ``stop_token_ids`` (at most ``MAX_STOP_TOKEN_IDS``, in the vocabulary),
  ``top_k`` (-1 or 0 disable it; at most ``MAX_TOP_K``), ``ignore_eos``, ``include_stop_str_in_output``,
  ``cache_salt`` (a non-empty string of at most ``MAX_CACHE_SALT_CHARS`` characters: the prompt
  shares cached blocks only with prompts of the same salt, and of the same tenant when its tenant
  keeps its cache apart, ``pdrouter.core.hashing.cache_salt_key``);
* completions: ``prompt`` as a string, a list of token ids, or a list holding exactly one of
  those; chat: ``messages`` with roles system / developer (read as system) / user / assistant /
  tool, ``content`` a string or a list of ``{"type": "text", "text": ...}`` parts (joined by
  newlines; null for an assistant message reads as ``""``), and ``name``, ``tool_calls`` (an
  assistant's; each ``function.arguments`` JSON text is parsed into an object, as templates
  expect), ``tool_call_id`` (a tool result's) passed to the template;
* chat, rendering (``pdrouter.core.chat_template``): ``add_generation_prompt`` (default true),
  ``continue_final_message`` (default false; needs ``add_generation_prompt`` false), ``tools``,
  ``documents``, ``chat_template_kwargs`` (further template variables); ``tool_choice`` ``none`` or
  ``auto`` (tool calls come back as the model's text: this server parses none).

Features this server does not implement (``n`` > 1, ``logprobs``, ``echo``, penalties, a
per-request ``chat_template``, forced tool choice…) are refused with 400 when set to anything but
their neutral value; unrecognised fields are ignored. Every refusal is an ``InvalidRequestError``
(a :class:`FieldError` when one field is to blame), which the HTTP door turns into OpenAI's error
body: a value of any type in any field is a 400, never a server error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdrouter.core.chat_template import RESERVED_VARIABLES, ChatMessage, ChatOptions
from pdrouter.core.errors import InvalidRequestError
from pdrouter.core.hashing import MAX_CACHE_SALT_CHARS, cache_salt_key
from pdrouter.core.ids import new_request_id
from pdrouter.core.sampling import MAX_TOP_K, SamplingParams
from pdrouter.core.tenants import Tenant
from pdrouter.router.frontdoor.served_models import FrontdoorConfig, ServedModel
from pdrouter.router.request import RouterRequest, prompt_ids


class FieldError(InvalidRequestError):
    """An invalid request with the offending field named (OpenAI's ``error.param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class OpenAIRequest:
    """A syntactically valid completion or chat request (not yet checked against a model).

    Read-only by convention; not frozen, because a frozen dataclass sets each of its fields through
    ``object.__setattr__`` (five times the cost, once per request)."""

    chat: bool
    model: str
    prompt: str | tuple[int, ...]
    """Completions: text or token ids. Chat: ``""`` (see ``messages``)."""
    messages: tuple[ChatMessage, ...]
    """Chat: the messages, roles normalised to system / user / assistant / tool."""
    chat_options: ChatOptions
    """Chat: how to render the template (completions: the defaults, unused)."""
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None = None


# Fields of features this server does not implement, with the values that mean "not used".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,),
    "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "response_format": ({"type": "text"},), "chat_template": ("",),
}
_NEUTRAL_KEYS = frozenset(_NEUTRAL)
_CHAT_FIELDS = frozenset({"tools"})
"""Of ``_NEUTRAL``, the fields chat requests do use."""
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_TOOL_CHOICES = (None, "none", "auto")
_NO_CHAT = ChatOptions()
_SAMPLING_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"})
MAX_MODEL_NAME_CHARS = 256
"""The longest model name a request may send (longer ones name no model: refused without a lookup)."""
MAX_STOP_CHARS = 1024
"""The longest stop string: each one held back costs its length per token streamed."""


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "a boolean", int: "an integer", float: "a number",
                                         str: "a string", list: "an array", dict: "an object"
                                         }.get(type(value), type(value).__name__)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)
"""What ``json.loads(text, parse_constant=_no_constant)`` uses, built once rather than per call."""
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""The start of a ``\\uD800``–``\\uDFFF`` escape: JSON's only way to a surrogate in a string."""


def load_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; InvalidRequestError for bad UTF-8, bad JSON, non-objects."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid UTF-8 (bad byte at offset {exc.start})"
                                  ) from None
    try:
        # json.loads refuses a leading BOM before decoding; let it, for the same message.
        data = json.loads(text, parse_constant=_no_constant) if text.startswith("\ufeff") else _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {_kind(data)}")
    if "\\u" in text and _SURROGATE_ESCAPE.search(text) is not None:
        _check_unicode(data)  # escaped surrogates: one left unpaired would fail the tokenizer
    return data


def _check_unicode(data: dict[str, Any]) -> None:
    """InvalidRequestError when a string of ``data`` (key or value) holds a lone surrogate."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("request body is not valid Unicode: a string holds an unpaired UTF-16 "
                                  "surrogate escape (\\ud800-\\udfff)") from None
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply") from None


def _int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None or type(value) is int:
        return value
    raise FieldError(key, f"{key} must be an integer, got {_kind(value)}")


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is float or type(value) is int:
        try:
            return float(value)
        except OverflowError:
            pass
    raise FieldError(key, f"{key} must be a number, got {_kind(value)}")


def _top_k(body: dict[str, Any]) -> int:
    """``top_k``, with vLLM's -1 (as 0) for "disabled"; FieldError outside -1..``MAX_TOP_K``."""
    top_k = _int(body, "top_k")
    if top_k is None or top_k in (-1, 0):
        return 0
    if not 0 < top_k <= MAX_TOP_K:
        raise FieldError("top_k", f"top_k must be -1 or 0 (no top-k filter) or in [1, {MAX_TOP_K}], got {top_k}")
    return top_k


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is bool:
        return value
    raise FieldError(key, f"{key} must be a boolean, got {_kind(value)}")


def _token_ids(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return tuple(value)
    return None


def _prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise FieldError("prompt", "prompt is required")
    if isinstance(prompt, str):
        return prompt
    ids = _token_ids(prompt)
    if ids is not None:
        return ids
    if isinstance(prompt, list) and len(prompt) == 1:
        only = prompt[0]
        if isinstance(only, str):
            return only
        ids = _token_ids(only)
        if ids is not None:
            return ids
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise FieldError("prompt", f"a batch of {len(prompt)} prompts is not supported; send one "
                                   f"prompt per request")
    raise FieldError("prompt", "prompt must be a string, a non-empty list of token ids, or a list "
                               "holding exactly one of those")


def _content(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise FieldError(f"{where}.content[{i}]", "only text content parts "
                                 '({"type": "text", "text": "..."}) are supported')
            texts.append(part["text"])
        return "\n".join(texts)
    raise FieldError(f"{where}.content", f"content must be a string or a list of text parts, "
                                         f"got {_kind(content)}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant's tool call, ``function.arguments`` parsed from its JSON text into a value."""
    if not isinstance(call, dict):
        raise FieldError(where, f"a tool call must be an object, got {_kind(call)}")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise FieldError(f"{where}.function", 'a tool call needs "function": {"name": ..., "arguments": ...}')
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise FieldError(f"{where}.function.arguments", "function.arguments must be JSON text") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _optional_str(message: dict[str, Any], key: str, where: str) -> str | None:
    value = message.get(key)
    if value is None or isinstance(value, str):
        return value
    raise FieldError(f"{where}.{key}", f"{key} must be a string, got {_kind(value)}")


def _message(message: Any, where: str) -> ChatMessage:
    if not isinstance(message, dict):
        raise FieldError(where, f"each message must be an object, got {_kind(message)}")
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise FieldError(f"{where}.role", f"role must be one of {sorted(_ROLES)}, got {role!r}")
    calls = message.get("tool_calls")
    tool_calls = None
    if calls is not None and calls != []:
        if role != "assistant" or not isinstance(calls, list):
            raise FieldError(f"{where}.tool_calls", "tool_calls must be an array, on an assistant message")
        tool_calls = tuple(_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls))
    return ChatMessage(role=_ROLES[role], content=_content(message.get("content"), where, role),
                       name=_optional_str(message, "name", where), tool_calls=tool_calls,
                       tool_call_id=_optional_str(message, "tool_call_id", where))


def _messages(body: dict[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", f"messages must be a non-empty array, got {_kind(messages)}")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _objects(body: dict[str, Any], key: str) -> tuple[dict[str, Any], ...] | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return tuple(value)
    raise FieldError(key, f"{key} must be an array of objects, got {_kind(value)}")


def _chat_options(body: dict[str, Any]) -> ChatOptions:
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final = _bool(body, "continue_final_message")
    if continue_final and add_generation_prompt:
        raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt: false "
                                                   "(the prompt continues the final message or starts a new one)")
    choice = body.get("tool_choice")
    if choice not in _TOOL_CHOICES:
        raise FieldError("tool_choice", f"tool_choice={choice!r} is not supported: use \"auto\" or \"none\" (tool "
                                        f"calls come back as the model's text)")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise FieldError("chat_template_kwargs", f"chat_template_kwargs must be an object, got {_kind(kwargs)}")
    reserved = RESERVED_VARIABLES.intersection(kwargs or ())
    if reserved:
        raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {sorted(reserved)}: use the "
                                                 f"request's own fields")
    return ChatOptions(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
                       tools=_objects(body, "tools"), documents=_objects(body, "documents"),
                       template_kwargs=kwargs or {})


def _stop(body: dict[str, Any], limit: int) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > limit:
            raise FieldError("stop", f"at most {limit} stop strings are supported, got {len(stop)}")
    else:
        raise FieldError("stop", f"stop must be a string or an array of strings, got {_kind(stop)}")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise FieldError("stop", f"stop strings may have at most {MAX_STOP_CHARS} characters")
    return tuple(stop)


def _check_unsupported(body: dict[str, Any], chat: bool) -> None:
    if _NEUTRAL_KEYS.isdisjoint(body):  # the common case: none of those fields is sent
        return
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and value not in neutral and not (chat and key in _CHAT_FIELDS):
            if key == "n":
                raise FieldError("n", f"n must be 1 (one choice per request), got {value!r}")
            if key == "chat_template":
                raise FieldError(key, "a per-request chat_template is not supported: the router renders the "
                                      "model's own template (or the one given with --chat-template)")
            raise FieldError(key, f"{key}={value!r} is not supported by this server")


def parse_openai_request(body: bytes, chat: bool, config: FrontdoorConfig) -> OpenAIRequest:
    """Validate a ``/v1/completions`` (``chat`` False) or ``/v1/chat/completions`` body."""
    data = load_json_object(body)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", f"model must be a non-empty string, got {_kind(model)}")
    if len(model) > MAX_MODEL_NAME_CHARS:
        raise FieldError("model", f"model names have at most {MAX_MODEL_NAME_CHARS} characters")
    _check_unsupported(data, chat)
    max_tokens = _int(data, "max_tokens")
    if data.get("max_completion_tokens") is not None:
        max_tokens = _int(data, "max_completion_tokens")
    stop_ids = data.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(type(t) is int for t in stop_ids)):
        raise FieldError("stop_token_ids", f"stop_token_ids must be an array of integers, got {_kind(stop_ids)}")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise FieldError("stream_options", f"stream_options must be an object, got {_kind(options)}")
    return OpenAIRequest(
        chat=chat, model=model,
        prompt="" if chat else _prompt(data),
        messages=_messages(data) if chat else (),
        chat_options=_chat_options(data) if chat else _NO_CHAT,
        max_tokens=max_tokens,
        temperature=_number(data, "temperature", 1.0),
        top_p=_number(data, "top_p", 1.0),
        top_k=_top_k(data),
        seed=_int(data, "seed"),
        stop=_stop(data, config.max_stop_strings),
        include_stop_str_in_output=_bool(data, "include_stop_str_in_output"),
        stop_token_ids=tuple(stop_ids or ()),
        ignore_eos=_bool(data, "ignore_eos"),
        stream=_bool(data, "stream"),
        include_usage=_bool(options, "include_usage") if options else False,
        cache_salt=check_cache_salt(data.get("cache_salt"), "cache_salt") if "cache_salt" in data else None,
    )


def check_cache_salt(value: Any, field: str) -> str | None:
    """A request's ``cache_salt`` (None when unset), as vLLM accepts it: a non-empty string; FieldError else."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise FieldError(field, f"{field} must be a non-empty string, got {_kind(value)}")
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise FieldError(field, f"{field} has at most {MAX_CACHE_SALT_CHARS} characters")
    return value


def to_router_request(req: OpenAIRequest, served: ServedModel, config: FrontdoorConfig,
                      deadline: float | None = None, label: str | None = None,
                      tenant: Tenant | None = None) -> RouterRequest:
    """Tokenize and size ``req`` for ``served``: context-window and vocabulary checks, sampling.
    The request gets a fresh id of the router's; ``label`` is the client's name for it; ``tenant``
    (its key's) gives its priority class and its part of the cache salt. A request that is not
    streamed and has no stop strings is ``whole``: taken in one piece, with no stop string to watch
    token by token, its worker sends the tokens at once (the same output, one message instead of
    one a token)."""
    ids: Sequence[int]
    if req.chat:
        ids = served.chat_prompt(req.messages, req.chat_options)
    elif isinstance(req.prompt, str):
        ids = served.tokenizer.encode_prompt(req.prompt)
    else:
        served.check_token_ids(req.prompt, "prompt")
        ids = list(req.prompt)
    served.check_token_ids(req.stop_token_ids, "stop_token_ids")
    try:
        max_tokens = served.max_tokens_for(len(ids), req.max_tokens, config.default_max_tokens)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, seed=req.seed, stop_token_ids=req.stop_token_ids,
                                  ignore_eos=req.ignore_eos)
    except FieldError:
        raise
    except InvalidRequestError as exc:
        if type(exc) is not InvalidRequestError:
            raise
        field = exc.message.split(" ", 1)[0]  # SamplingParams names the field first
        raise FieldError(field if field in _SAMPLING_FIELDS else None, exc.message) from None
    whole = not req.stream and not req.stop
    prompt = prompt_ids(ids)
    if tenant is None and req.cache_salt is None:
        return RouterRequest(new_request_id(), served.name, prompt, sampling, deadline, whole=whole, label=label)
    return RouterRequest(new_request_id(), served.name, prompt, sampling, deadline, whole=whole, label=label,
                         tenant=tenant,
                         priority=0 if tenant is None else tenant.priority,
                         cache_salt=cache_salt_key(None if tenant is None else tenant.salt_scope, req.cache_salt))
