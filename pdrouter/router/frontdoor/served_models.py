"""What the front doors serve: each model's limits and tokenizer, and the context-window rules.

Both front doors resolve a model name through one :class:`ModelRegistry`, then ask the
:class:`ServedModel` to check the prompt and pick ``max_tokens``, so the HTTP and gRPC doors
accept and refuse exactly the same requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdrouter.core.chat_template import ChatMessage, ChatOptions, ChatTemplate
from pdrouter.core.errors import InvalidRequestError, ModelNotFoundError, PdRouterError, PromptTooLongError
from pdrouter.core.tokenizer import Tokenizer, apply_chat_template
from pdrouter.router.request import Dispatcher, ModelInfo


@dataclass(frozen=True)
class FrontdoorConfig:
    """Limits shared by the HTTP and gRPC front doors."""

    default_max_tokens: int = 256
    """``max_tokens`` when a request sends none: the context left after the prompt, capped at this."""
    max_stop_strings: int = 16
    max_body_bytes: int = 16 * 1024 * 1024
    """HTTP request bodies above this are refused with 400."""
    retry_after_s: int = 1
    """``Retry-After`` seconds sent with retryable errors (429, 503)."""
    request_timeout_s: float | None = None
    """Deadline given to HTTP requests (None: none); gRPC requests use the call's own deadline."""
    chat_template: str | None = None
    """Jinja source used instead of every served model's own chat template (``--chat-template``)."""

    def __post_init__(self) -> None:
        if self.default_max_tokens <= 0:
            raise ValueError(f"default_max_tokens must be > 0, got {self.default_max_tokens}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass(frozen=True)
class ServedModel:
    """A model the dispatcher serves, with the tokenizer the front doors use for it."""

    info: ModelInfo
    tokenizer: Tokenizer
    chat_template_override: ChatTemplate | None = None
    """Used instead of the tokenizer's own template (``--chat-template``)."""

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The template chat requests are rendered with: the override, else the model folder's."""
        if self.chat_template_override is not None:
            return self.chat_template_override
        return self.tokenizer.chat_template

    def chat_prompt(self, messages: Sequence[ChatMessage], options: ChatOptions) -> list[int]:
        """Prompt ids of a chat request; InvalidRequestError without a template or when it refuses."""
        template = self.chat_template
        if template is None:
            raise InvalidRequestError(
                f"model {self.name!r} has no chat template (its folder has no chat_template.jinja and no "
                f"chat_template in tokenizer_config.json); start the router with --chat-template FILE, or "
                f"send a /v1/completions request")
        return apply_chat_template(self.tokenizer, messages, options, template)

    def check_token_ids(self, token_ids: Sequence[int], field: str) -> None:
        """InvalidRequestError unless every id is in ``[0, vocab_size)``."""
        vocab = self.info.vocab_size
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab):
            return  # the common case, at C speed; the loop below names the first bad id
        for t in token_ids:
            if not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"{field}: token id {t} is outside the vocabulary of {self.name!r} [0, {vocab})")

    def max_tokens_for(self, prompt_len: int, requested: int | None, default_cap: int) -> int:
        """The ``max_tokens`` to run with; PromptTooLongError when the request cannot fit the context.

        ``requested`` None means the client left it out: the context left after the prompt,
        capped at ``default_cap``. A positive ``requested`` must fit with the prompt; values
        below 1 are left for ``SamplingParams`` to refuse with its own message.
        """
        if prompt_len <= 0:
            raise InvalidRequestError("prompt is empty")
        context = self.info.max_context
        room = context - prompt_len
        if requested is None:
            if room <= 0:
                raise PromptTooLongError(
                    f"prompt has {prompt_len} tokens, the context window of {self.name!r} is {context} "
                    f"tokens: no room for any completion")
            return min(room, default_cap)
        if requested > 0 and prompt_len + requested > context:
            raise PromptTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) = {prompt_len + requested} "
                f"exceeds the context window of {self.name!r} ({context} tokens); send at most "
                f"{max(room, 0)} max_tokens or a shorter prompt")
        return requested


class ModelRegistry:
    """Model name → :class:`ServedModel`, from the dispatcher's models and the router's tokenizers.

    The table is rebuilt from ``dispatcher.models()`` when a name is missing or on
    :meth:`refresh`, so models that appear later are picked up without a restart; the lookup on
    the hot path is one dict access. Models without a tokenizer are not served.

    ``chat_template`` (Jinja source) replaces every model's own template. The templates are
    compiled here, so one that does not compile is a ConfigError when the front door is built.
    """

    def __init__(self, dispatcher: Dispatcher, tokenizers: Mapping[str, Tokenizer],
                 chat_template: str | None = None) -> None:
        self._dispatcher = dispatcher
        self._tokenizers = dict(tokenizers)
        self._models: dict[str, ServedModel] = {}
        self._chat_template = None if chat_template is None else ChatTemplate(chat_template, "--chat-template")
        if self._chat_template is None:
            for tokenizer in self._tokenizers.values():
                _ = tokenizer.chat_template

    def refresh(self) -> list[ServedModel]:
        """Re-read the dispatcher's models; the served ones, in its order."""
        served = [ServedModel(info, self._tokenizers[info.name], self._chat_template)
                  for info in self._dispatcher.models() if info.name in self._tokenizers]
        self._models = {m.name: m for m in served}
        return served

    def get(self, name: str) -> ServedModel:
        """The served model called ``name``; ModelNotFoundError listing the served names otherwise."""
        found = self._models.get(name)
        if found is not None:
            return found
        self.refresh()
        found = self._models.get(name)
        if found is not None:
            return found
        if name in {info.name for info in self._dispatcher.models()}:
            raise PdRouterError(f"model {name!r} is served but the router has no tokenizer for it")
        raise ModelNotFoundError(f"model {name!r} does not exist; served models: {sorted(self._models)}")
