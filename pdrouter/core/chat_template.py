"""Chat templates: a model's Jinja template, rendered as HF transformers renders it.

A model folder's template is ``chat_template.jinja`` (plus named ones in ``chat_templates/*.jinja``)
or else ``tokenizer_config.json``'s ``chat_template``: a string, or a list of named templates
``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``. With several, a request with
``tools`` uses ``tool_use`` when there is one, else ``default``.

Evaluation follows ``transformers``' ``apply_chat_template``, so a prompt is the same token for
token: Jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and a pass-through ``{% generation %}`` block; the globals
``raise_exception(message)``, ``strftime_now(format)``, a ``dict`` constructor and a ``namespace``
that refuses underscore names; a ``tojson`` filter that escapes no HTML and keeps key order. The
variables are the tokenizer's special tokens (``bos_token``, ``eos_token``…), then the request's
``chat_template_kwargs``, then ``messages``, ``tools``, ``documents`` and ``add_generation_prompt``.
Message keys whose value is None are left out, as transformers leaves them out.

Templates are data: whatever a template does while rendering a request, the request gets an
``InvalidRequestError`` (HTTP 400): ``raise_exception`` with its own message, a sandbox violation
(``''.__class__``…) or any other failure with what went wrong. A template that does not compile is
a ``ConfigError`` when it is loaded. jinja2 is imported when a template is compiled, not with this
module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pdrouter.core.errors import ConfigError, InvalidRequestError

TemplateSource = str | Mapping[str, str]
"""One template, or named templates (``default``, ``tool_use``…)."""

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATES_DIR = "chat_templates"
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""Variables set from the request's own fields; ``chat_template_kwargs`` may not set them."""

# Appended to the final message for continue_final_message; where it lands in the rendered text
# is where the prompt ends. The trailing space tells whether the template trimmed the content.
_CONTINUE_MARK = "PDROUTER_CONTINUE_FINAL_MESSAGE "


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a chat request, as the template sees it (``role``, ``content``…).

    ``tool_calls`` are OpenAI tool calls (``{"id", "type", "function": {"name", "arguments"}}``)
    with ``arguments`` already an object. Read-only: :meth:`template_data` gives fresh copies."""

    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: tuple[Mapping[str, Any], ...] | None = None
    tool_call_id: str | None = None

    @classmethod
    def from_mapping(cls, message: Mapping[str, Any]) -> ChatMessage:
        """A message from a plain dict (``{"role": "user", "content": "hi"}``)."""
        calls = message.get("tool_calls")
        return cls(role=str(message.get("role", "")), content=message.get("content"), name=message.get("name"),
                   tool_calls=None if calls is None else tuple(calls), tool_call_id=message.get("tool_call_id"))

    def template_data(self) -> dict[str, Any]:
        """The message as a dict of plain JSON values, keys whose value is None left out."""
        data: dict[str, Any] = {"role": self.role}
        if self.content is not None:
            data["content"] = self.content
        if self.name is not None:
            data["name"] = self.name
        if self.tool_calls is not None:
            data["tool_calls"] = [json.loads(json.dumps(call)) for call in self.tool_calls]
        if self.tool_call_id is not None:
            data["tool_call_id"] = self.tool_call_id
        return data


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How to render a chat: the OpenAI / vLLM request fields that reach the template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """End the prompt inside the final message (its content is the start of the answer)."""
    tools: tuple[Mapping[str, Any], ...] | None = None
    documents: tuple[Mapping[str, Any], ...] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Further template variables (``chat_template_kwargs``), e.g. ``{"enable_thinking": false}``."""

    def __post_init__(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt=false: the prompt "
                                      "either continues the final message or starts a new one")
        reserved = RESERVED_VARIABLES.intersection(self.template_kwargs)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {sorted(reserved)}; use the request's "
                                      f"own fields")


def template_source_from_config(value: Any, where: str) -> TemplateSource | None:
    """A ``chat_template`` value of ``tokenizer_config.json``: a string or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ConfigError(f"{where}: chat_template must be a string or a list of {{\"name\", \"template\"}} objects")


def read_folder_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> TemplateSource | None:
    """The chat template of a model folder (see the module docstring), None when it has none.

    Template files win over ``tokenizer_config.json``, as in transformers."""
    named: dict[str, str] = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        named["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / CHAT_TEMPLATES_DIR).is_dir():
        for path in sorted((folder / CHAT_TEMPLATES_DIR).glob("*.jinja")):
            named[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if named:
        return named["default"] if list(named) == ["default"] else named
    return template_source_from_config(tokenizer_config.get("chat_template"), str(folder / "tokenizer_config.json"))


def _raise_exception(message: Any) -> None:
    raise InvalidRequestError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


def _compile(templates: Mapping[str, str], origin: str) -> dict[str, Any]:
    """Compile each template in one sandboxed environment; ConfigError naming ``origin`` on a bad one."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}…{% endgeneration %}`` (marks the assistant's part for training): its body as is."""

        tags = {"generation"}  # noqa: RUF012

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class SafeNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses attributes starting with an underscore."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                SafeNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.sandbox.SecurityError(f"a namespace may not hold the attribute {name!r}")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_make_dict,
                       namespace=SafeNamespace)
    compiled: dict[str, Any] = {}
    for name, text in templates.items():
        try:
            compiled[name] = env.from_string(text)
        except jinja2.TemplateError as exc:
            which = origin if list(templates) == ["default"] else f"{origin} ({name!r})"
            line = getattr(exc, "lineno", None)
            raise ConfigError(f"{which}: the chat template does not compile"
                              f"{f' (line {line})' if line else ''}: {exc}") from None
    return compiled


class ChatTemplate:
    """A model's chat template(s), compiled once; :meth:`render` is pure and safe to call concurrently."""

    def __init__(self, source: TemplateSource, origin: str = "chat template") -> None:
        self._sources: dict[str, str] = {"default": source} if isinstance(source, str) else dict(source)
        if not self._sources:
            raise ConfigError(f"{origin}: no chat template")
        self.origin = origin
        self._compiled = _compile(self._sources, origin)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def _select(self, tools: bool) -> str:
        if tools and "tool_use" in self._sources:
            return "tool_use"
        if "default" in self._sources:
            return "default"
        raise InvalidRequestError(f"{self.origin} has several chat templates {sorted(self._sources)} and none "
                                  f"is called 'default'")

    def render(self, messages: Sequence[ChatMessage], options: ChatOptions,
               special_tokens: Mapping[str, str]) -> str:
        """The prompt text of ``messages``; InvalidRequestError for anything the template refuses."""
        name = self._select(options.tools is not None)
        chat = [m.template_data() for m in messages]
        final = ""
        if options.continue_final_message:
            final = self._mark_final_message(chat, self._sources[name])
        variables: dict[str, Any] = {**special_tokens, **options.template_kwargs}
        variables.update(
            messages=chat, add_generation_prompt=options.add_generation_prompt,
            tools=None if options.tools is None else [dict(t) for t in options.tools],
            documents=None if options.documents is None else [dict(d) for d in options.documents])
        text = _run(self._compiled[name].render, variables)
        return _cut_at_mark(text, final) if options.continue_final_message else text

    @staticmethod
    def _mark_final_message(chat: list[dict[str, Any]], source: str) -> str:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise InvalidRequestError("continue_final_message needs a final message with text content")
        if "content" not in source:
            raise InvalidRequestError("continue_final_message: this chat template never writes a message's content")
        final: str = chat[-1]["content"]
        chat[-1]["content"] = final + _CONTINUE_MARK
        return final


def _run(render: Callable[..., str], variables: Mapping[str, Any]) -> str:
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        return render(**variables)
    except InvalidRequestError:
        raise
    except SecurityError as exc:
        raise InvalidRequestError(f"the chat template was refused by the sandbox: {exc}") from None
    except TemplateError as exc:
        raise InvalidRequestError(f"the chat template failed on this request: {exc}") from None
    except Exception as exc:  # a template's own TypeError, ZeroDivisionError…: data, not a server fault
        raise InvalidRequestError(f"the chat template failed on this request ({type(exc).__name__}: {exc})"
                                  ) from None


def _cut_at_mark(text: str, final: str) -> str:
    """``text`` up to the mark appended to the final message (trailing whitespace too if the template trimmed)."""
    bare = _CONTINUE_MARK.strip()
    if bare not in text or final.strip() not in text:
        raise InvalidRequestError("continue_final_message: the chat template does not write the final message as "
                                  "it was sent, so the prompt cannot end inside it")
    at = text.rindex(bare)
    return text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
