"""HF-format model folders for tests: a small byte-fallback BPE trained here, and three chat families.

The tokenizer is trained on a few sentences with the ``tokenizers`` package (the Llama-2 / Mistral
shape: a ``▁`` metaspace normalizer, byte fallback, a decoder that strips the leading space), with
the special tokens of the three families added. Characters it never saw, like ``😀``, become
byte-fallback tokens (``<0xF0>`` …), so one character spans several tokens.

The templates are written for these tests in the form of the real families' templates: Llama-3
(header tokens, ``<|eot_id|>``, tools in the system turn, ``strftime_now``), Qwen2.5 / ChatML
(``<|im_start|>``, tools and tool calls, named ``default`` / ``tool_use`` templates) and Mistral
(``[INST]``, ``raise_exception`` when roles do not alternate).
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Any

SENTENCES = [
    "hello world, hello there",
    "héllo 世界 the quick brown fox jumps over the lazy dog",
    "what is the weather in Paris today? it is sunny and warm",
    "you are a helpful assistant. answer in one short sentence",
    "call the function get_weather with the city name",
    "system user assistant tool ipython",
]
SPECIALS = ["<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]
EXTRA_TOKEN = "<|python_tag|>"
"""Declared only in ``tokenizer_config.json``'s ``added_tokens_decoder`` (not in ``tokenizer.json``)."""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_text = messages[0].content | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = "" %}
    {%- set turns = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today: ' + date_string + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'You may call a function. Answer with {"name": function name, "parameters": arguments}.\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=2) }}
        {{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_text + '<|eot_id|>' }}
{%- for message in turns %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '<|python_tag|>{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim }}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_TEMPLATE = """\
{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CHATML_TOOLS_TEMPLATE = """\
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
    {{- messages[0].content }}
{%- else %}
    {{- 'You are a helpful assistant.' }}
{%- endif %}
{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nFunctions you may call:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor a call, reply <tool_call>{"name": ..., "arguments": ...}</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('roles must alternate between user and assistant, starting with user') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_text is defined %}
            {{- '[INST] ' + system_text + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('only user and assistant messages, after an optional system message') }}
    {%- endif %}
{%- endfor %}
"""

FAMILIES = ("llama3", "chatml", "mistral")


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The trained tokenizer, serialized (``tokenizer.json``); trained once per test process."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainee = Tokenizer(models.BPE(byte_fallback=True))
    trainee.normalizer = normalizer
    trainee.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=320, limit_alphabet=48,
                                                               show_progress=False))
    trained = json.loads(trainee.to_str())["model"]
    vocab: dict[str, int] = {}
    for token in [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)),
                  *sorted(trained["vocab"], key=trained["vocab"].get)]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return str(tok.to_str())


def _added(content: str, special: bool = True) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


def _token(content: str) -> dict[str, Any]:
    """A special token written as an AddedToken object, as some folders do."""
    return {"__type": "AddedToken", **_added(content)}


def write_hf_folder(out: Path, family: str | None, *, template: Any = "family",
                    template_file: bool | None = None, generation_eos: list[str] | None = None) -> Path:
    """A model folder in ``out``: geometry (``config.json``, the tiny preset), the trained tokenizer,
    ``tokenizer_config.json`` and ``generation_config.json`` for ``family`` (one of :data:`FAMILIES`).

    ``template``: ``"family"`` for the family's own (ChatML: named ``default`` and ``tool_use``
    templates), None for no template, or a template (a string, or a list of named ones) to write
    instead. ``template_file``: write it as ``chat_template.jinja`` (default: only for Mistral).
    ``generation_eos``: the tokens of ``generation_config.json``'s ``eos_token_id`` list."""
    from pdrouter.core.model_spec import get_model_preset
    from pdrouter.engine.model_folder import write_config_folder

    raw = tokenizer_json()
    vocab = json.loads(raw)["model"]["vocab"]
    size = max(vocab.values()) + 1
    write_config_folder(replace(get_model_preset("tiny"), name=out.name, vocab_size=size + 1), out)
    (out / "pdrouter_tokenizer.json").unlink()
    (out / "tokenizer.json").write_text(raw)
    ids = {s: vocab[s] for s in SPECIALS} | {EXTRA_TOKEN: size}
    bos, eos = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "chatml": (None, "<|im_end|>"),
                "mistral": ("<s>", "</s>"), None: ("<s>", "</s>")}[family]
    own = {"llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE,
           "chatml": [{"name": "default", "template": CHATML_TEMPLATE},
                      {"name": "tool_use", "template": CHATML_TOOLS_TEMPLATE}], None: None}[family]
    chosen = own if template == "family" else template
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "clean_up_tokenization_spaces": False,
        "bos_token": bos, "eos_token": _token(eos),
        "added_tokens_decoder": {str(i): _added(s, s != EXTRA_TOKEN) for s, i in ids.items()},
    }
    if template_file is None:
        template_file = family == "mistral"
    if chosen is not None and template_file:
        (out / "chat_template.jinja").write_text(chosen)
    elif chosen is not None:
        config["chat_template"] = chosen
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    model_config = json.loads((out / "config.json").read_text())
    model_config.update(bos_token_id=None if bos is None else ids[bos], eos_token_id=ids[eos])
    (out / "config.json").write_text(json.dumps(model_config, indent=2))
    if generation_eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[t] for t in generation_eos]}))
    return out
