"""Chat templates on real-format model folders, checked token for token against transformers.

Each family's folder (``hf_folders``) is rendered by ``pdrouter.core.chat_template`` and tokenized by
the folder's tokenizer; ``transformers.AutoTokenizer.apply_chat_template(..., tokenize=True)`` on the
same folder is the reference.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from pdrouter.core.chat_template import ChatMessage, ChatOptions, ChatTemplate, read_folder_template
from pdrouter.core.errors import ConfigError, InvalidRequestError
from pdrouter.core.hf_tokenizer import HfTokenizer
from pdrouter.core.tokenizer import ByteTokenizer, Tokenizer, apply_chat_template, load_tokenizer

from .hf_folders import EXTRA_TOKEN, FAMILIES, SPECIALS, write_hf_folder

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather <now> & here, in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "user", "content": "héllo 世界 😀"}],
    "turns": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello world 😀"},
              {"role": "user", "content": "what is the weather in Paris today?"}],
    "system": [{"role": "system", "content": "you are a helpful assistant. "},
               {"role": "user", "content": "answer in one short sentence <|eot_id|> [INST]"}],
    "tool calls": [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "what is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 25°C"}],
}


def messages(conversation: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.from_mapping(m) for m in conversation]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: write_hf_folder(root / f, f, generation_eos=["<|eot_id|>", "<|im_end|>"]) for f in FAMILIES}


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> dict[str, Any]:
    """transformers' tokenizer of each folder (the reference implementation)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return {f: transformers.AutoTokenizer.from_pretrained(str(path)) for f, path in folders.items()}


def reference_ids(ref: Any, conversation: list[dict[str, Any]], **kw: Any) -> list[int]:
    return list(ref.apply_chat_template(conversation, tokenize=True, return_dict=False, **kw))


def reference_error(ref: Any, conversation: list[dict[str, Any]], **kw: Any) -> str:
    with pytest.raises(Exception) as raised:  # jinja2's TemplateError, as transformers raises it
        ref.apply_chat_template(conversation, tokenize=True, **kw)
    return str(raised.value)


# -- token-for-token parity --------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["generation-prompt", "no-generation-prompt"])
@pytest.mark.parametrize("case", list(CONVERSATIONS))
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_equal_transformers(folders: dict[str, Path], reference: dict[str, Any], family: str,
                                       case: str, add_generation_prompt: bool) -> None:
    conversation = CONVERSATIONS[case]
    tools = TOOLS if case == "tool calls" else None
    tok = load_tokenizer(folders[family])
    options = ChatOptions(add_generation_prompt, tools=None if tools is None else tuple(tools))
    if family == "mistral" and case == "tool calls":  # its template refuses tool turns, in both
        with pytest.raises(InvalidRequestError) as raised:
            apply_chat_template(tok, messages(conversation), options)
        assert raised.value.message == reference_error(reference[family], conversation, tools=tools,
                                                       add_generation_prompt=add_generation_prompt)
        return
    want = reference_ids(reference[family], conversation, tools=tools, add_generation_prompt=add_generation_prompt)
    assert apply_chat_template(tok, messages(conversation), options) == want


def test_special_tokens_in_the_rendered_text_are_their_ids(folders: dict[str, Path]) -> None:
    tok = load_tokenizer(folders["llama3"])
    assert isinstance(tok, HfTokenizer)
    ids = apply_chat_template(tok, messages(CONVERSATIONS["plain"]))
    vocab = json.loads((folders["llama3"] / "tokenizer.json").read_text())["model"]["vocab"]
    start, end, eot, bos = (vocab[t] for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                               "<|begin_of_text|>"))
    assert ids[:2] == [bos, start]
    assert ids.count(start) == ids.count(end) == 3 and ids.count(eot) == 2  # system, user, generation prompt
    assert ids.count(bos) == 1  # the template writes it; nothing is added around the text
    assert "<|start_header_id|>" not in tok.decode(ids) and "user" in tok.decode(ids)


@pytest.mark.parametrize("final", ["The weather in Paris is", "The weather in Paris is ", "sunny 😀"])
@pytest.mark.parametrize("family", FAMILIES)
def test_continue_final_message_equals_transformers(folders: dict[str, Path], reference: dict[str, Any],
                                                    family: str, final: str) -> None:
    conversation = [{"role": "user", "content": "what is the weather?"}, {"role": "assistant", "content": final}]
    want = reference_ids(reference[family], conversation, continue_final_message=True, add_generation_prompt=False)
    got = apply_chat_template(load_tokenizer(folders[family]), messages(conversation),
                              ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert got == want
    text = load_tokenizer(folders[family]).decode(got)
    assert text.rstrip().endswith(final.rstrip()) and not text.endswith("</s>")


def test_continue_final_message_and_a_generation_prompt_are_exclusive() -> None:
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        ChatOptions(add_generation_prompt=True, continue_final_message=True)


def test_template_kwargs_and_documents_reach_the_template(folders: dict[str, Path],
                                                          reference: dict[str, Any]) -> None:
    source = ("{%- for d in documents %}<|im_start|>doc {{ d.title }}\n{{ d.text }}<|im_end|>\n{%- endfor %}"
              "{%- if enable_thinking %}<think>{% endif %}{{ messages[-1].content }}{{ eos_token }}")
    documents = [{"title": "Paris", "text": "sunny"}, {"title": "Rome", "text": "rain"}]
    conversation = [{"role": "user", "content": "héllo"}]
    ref = reference["chatml"]
    want = reference_ids(ref, conversation, chat_template=source, documents=documents, enable_thinking=True)
    tok = load_tokenizer(folders["chatml"])
    options = ChatOptions(documents=tuple(documents), template_kwargs={"enable_thinking": True})
    assert apply_chat_template(tok, messages(conversation), options, ChatTemplate(source)) == want
    with pytest.raises(InvalidRequestError, match="messages"):
        ChatOptions(template_kwargs={"messages": []})


def test_named_templates_pick_tool_use_when_tools_are_sent(folders: dict[str, Path]) -> None:
    tok = load_tokenizer(folders["chatml"])
    assert tok.chat_template is not None and tok.chat_template.names == ("default", "tool_use")
    plain = tok.decode(apply_chat_template(tok, messages(CONVERSATIONS["plain"])), skip_special_tokens=False)
    with_tools = tok.decode(apply_chat_template(tok, messages(CONVERSATIONS["plain"]), ChatOptions(tools=tuple(TOOLS))),
                            skip_special_tokens=False)
    assert "<tools>" not in plain and "<tools>" in with_tools
    no_default = ChatTemplate({"a": "x", "b": "y"})
    with pytest.raises(InvalidRequestError, match="default"):
        no_default.render(messages(CONVERSATIONS["plain"]), ChatOptions(), {})


def test_template_files_win_over_tokenizer_config(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "m", "mistral", template_file=False)
    assert read_folder_template(folder, json.loads((folder / "tokenizer_config.json").read_text())) is not None
    (folder / "chat_template.jinja").write_text("file:{{ messages[0].content }}")
    (folder / "chat_templates").mkdir()
    (folder / "chat_templates" / "tool_use.jinja").write_text("tools:{{ messages[0].content }}")
    tok = load_tokenizer(folder)
    assert tok.chat_template is not None and tok.chat_template.names == ("default", "tool_use")
    assert tok.decode(apply_chat_template(tok, messages(CONVERSATIONS["plain"]))) == "file:héllo 世界 😀"


# -- what templates may not do ------------------------------------------------------------------


def test_raise_exception_is_an_invalid_request_with_its_message(folders: dict[str, Path],
                                                                 reference: dict[str, Any]) -> None:
    conversation = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError) as raised:
        apply_chat_template(load_tokenizer(folders["mistral"]), messages(conversation))
    assert raised.value.message == "roles must alternate between user and assistant, starting with user"
    assert raised.value.message == reference_error(reference["mistral"], conversation)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "{{ messages.append(messages[0]) }}",
    "{{ messages[0].update(role='system') }}",
], ids=["dunder attribute", "subclasses", "function globals", "namespace dunder", "list append", "dict update"])
def test_the_sandbox_refuses_escapes_and_mutation(source: str) -> None:
    with pytest.raises(InvalidRequestError, match="sandbox"):
        ChatTemplate(source).render(messages(CONVERSATIONS["plain"]), ChatOptions(), {})


def test_other_template_failures_are_invalid_requests() -> None:
    for source in ("{{ 1 / 0 }}", "{{ messages[0].content + 1 }}", "{{ undefined_thing.attr }}"):
        with pytest.raises(InvalidRequestError, match="chat template failed"):
            ChatTemplate(source).render(messages(CONVERSATIONS["plain"]), ChatOptions(), {})


def test_a_template_that_does_not_compile_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", "--chat-template x.jinja")
    folder = write_hf_folder(tmp_path / "broken", "llama3", template="{{ messages | no_such_filter }}")
    tok = load_tokenizer(folder)
    with pytest.raises(ConfigError, match="broken"):
        _ = tok.chat_template


# -- the environment: globals, filters, extensions ----------------------------------------------------


def test_tojson_keeps_html_and_key_order_and_indents() -> None:
    tools = ({"z": "<b>&'é", "a": [1, 2]},)
    text = ChatTemplate("{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}").render(
        [], ChatOptions(tools=tools), {})
    compact, indented = text.split("|")
    assert compact == '{"z": "<b>&\'é", "a": [1, 2]}'
    assert indented == json.dumps(tools[0], indent=2, ensure_ascii=False)


def test_globals_loop_controls_and_generation_blocks() -> None:
    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}"
              "{% continue %}{% endif %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
              "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ dict(a=1) | tojson }}"
              "{{ strftime_now('%Y') | length }}{{ bos_token }}{{ add_generation_prompt }}")
    msgs = messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     {"role": "user", "content": "v"}])
    assert ChatTemplate(source).render(msgs, ChatOptions(), {"bos_token": "<s>"}) == '[u]1{"a": 1}4<s>True'


def test_none_fields_are_left_out_and_tool_fields_pass_through() -> None:
    source = ("{% for m in messages %}{{ m.role }}:{{ m.content is defined }}:{{ m.name | default('-') }}:"
              "{{ m.tool_call_id | default('-') }}:{{ m.tool_calls | default([]) | tojson }};{% endfor %}"
              "{{ tools is none }}{{ documents is none }}")
    msgs = [ChatMessage("assistant", None, tool_calls=({"id": "1", "function": {"name": "f", "arguments": {}}},)),
            ChatMessage("tool", "r", name="f", tool_call_id="1")]
    assert ChatTemplate(source).render(msgs, ChatOptions(), {}) == (
        'assistant:False:-:-:[{"id": "1", "function": {"name": "f", "arguments": {}}}];tool:True:f:1:[];TrueTrue')


# -- tokenizer_config.json: special and added tokens --------------------------------------------------


def test_special_and_added_tokens_of_tokenizer_config(folders: dict[str, Path], reference: dict[str, Any]) -> None:
    tok = load_tokenizer(folders["llama3"])
    ref = reference["llama3"]
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert dict(tok.special_tokens) == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    extra = ref.convert_tokens_to_ids(EXTRA_TOKEN)  # declared only in added_tokens_decoder
    assert tok.encode_chat(f"x{EXTRA_TOKEN}y") == ref.encode(f"x{EXTRA_TOKEN}y", add_special_tokens=False)
    assert extra in tok.encode_chat(EXTRA_TOKEN)
    for special in SPECIALS:
        assert tok.encode_chat(special) == [ref.convert_tokens_to_ids(special)]
    chatml = load_tokenizer(folders["chatml"])
    assert chatml.bos_token_id is None and "bos_token" not in chatml.special_tokens  # bos_token: null
    assert chatml.encode("hi") == chatml.encode("hi", add_bos=False)


def test_an_added_token_at_a_wrong_id_is_a_config_error(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "m", "llama3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["9999"] = {"content": "<|new|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="<\\|new\\|>"):
        load_tokenizer(folder)


def test_a_folder_without_a_template_has_none(tmp_path: Path) -> None:
    tok: Tokenizer = load_tokenizer(write_hf_folder(tmp_path / "bare", "llama3", template=None))
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        apply_chat_template(tok, messages(CONVERSATIONS["plain"]))


def test_the_byte_tokenizer_has_its_own_template() -> None:
    tok = ByteTokenizer()
    ids = apply_chat_template(tok, [ChatMessage("user", "hé"), ChatMessage("assistant", "ok")],
                              ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert ids == [tok.token_id("<bos>"), tok.token_id("<|user|>"), *"hé".encode(), tok.token_id("<|end|>"),
                   tok.token_id("<|assistant|>"), *b"ok"]
    assert tok.encode_chat("a<eos><|user|>") == [97, tok.token_id("<eos>"), tok.token_id("<|user|>")]
    with pytest.raises(InvalidRequestError, match="tool"):
        apply_chat_template(tok, [ChatMessage("tool", "r")])
