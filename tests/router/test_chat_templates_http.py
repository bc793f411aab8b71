"""Chat templates through the front door: request → prompt ids against transformers, the 400s over
HTTP, ``--chat-template``, and one real router with a real (simulated-GPU) worker on an HF folder."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.cli.main import build_parser
from pdrouter.cli.router_cmd import build_config
from pdrouter.core.errors import ConfigError
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.tokenizer import ByteTokenizer, load_tokenizer
from pdrouter.core.workers import WorkerRole
from pdrouter.router.frontdoor.http_api import HttpFrontdoor
from pdrouter.router.frontdoor.openai_schema import parse_openai_request, to_router_request
from pdrouter.router.frontdoor.served_models import FrontdoorConfig, ServedModel
from pdrouter.router.request import ModelInfo
from pdrouter.router.server import RouterProcess
from pdrouter.testing.echo import EchoDispatcher
from pdrouter.testing.http import serving

from ..core.hf_folders import FAMILIES, MISTRAL_TEMPLATE, write_hf_folder

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ARGUMENTS = {"city": "Paris", "unit": "°C"}
REQUESTS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "héllo 世界 😀"}]},
    "system and parts": {"messages": [
        {"role": "developer", "content": "you are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world 😀"}]},
        {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "the weather?"}]},
    "tool calls": {"tools": TOOLS, "tool_choice": "auto", "messages": [
        {"role": "user", "content": "what is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]},
}


def as_transformers_sees_it(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's messages as a transformers user would pass them: arguments as objects, parts
    joined by newlines, developer as system, a null assistant content as ``""``."""
    out = []
    for m in request["messages"]:
        m = dict(m)
        m["role"] = "system" if m["role"] == "developer" else m["role"]
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if m.get("content") is None:
            m["content"] = ""
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def info_for(folder: Path, name: str) -> ModelInfo:
    spec = ModelSpec.from_pretrained_dir(folder)
    return ModelInfo(name=name, max_context=spec.max_context, vocab_size=spec.vocab_size, block_size=16)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    made = {f: write_hf_folder(root / f, f, generation_eos=["<|eot_id|>", "</s>"]) for f in FAMILIES}
    made["bare"] = write_hf_folder(root / "bare", "llama3", template=None)
    return made


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return {f: transformers.AutoTokenizer.from_pretrained(str(folders[f])) for f in FAMILIES}


# -- request → prompt ids, without a server ----------------------------------------------------------


# The Mistral-style template refuses tool turns (tests/core checks that it does, as transformers does).
PAIRS = [(f, c) for f in FAMILIES for c in REQUESTS if f != "mistral" or c != "tool calls"]


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["generation-prompt", "no-generation-prompt"])
@pytest.mark.parametrize(("family", "case"), PAIRS, ids=[f"{f}-{c}" for f, c in PAIRS])
def test_the_router_sends_the_ids_transformers_gives(folders: dict[str, Path], reference: dict[str, Any],
                                                      family: str, case: str, add_generation_prompt: bool) -> None:
    body = {"model": family, "add_generation_prompt": add_generation_prompt, **REQUESTS[case]}
    parsed = parse_openai_request(json.dumps(body).encode(), True, FrontdoorConfig())
    served = ServedModel(info_for(folders[family], family), load_tokenizer(folders[family]))
    request = to_router_request(parsed, served, FrontdoorConfig())
    want = reference[family].apply_chat_template(as_transformers_sees_it(body), tools=body.get("tools"),
                                                 add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 return_dict=False)
    assert list(request.prompt_token_ids) == list(want)


def test_continue_final_message_over_the_front_door(folders: dict[str, Path], reference: dict[str, Any]) -> None:
    body = {"model": "llama3", "add_generation_prompt": False, "continue_final_message": True, "messages": [
        {"role": "user", "content": "the weather?"}, {"role": "assistant", "content": "It is "}]}
    parsed = parse_openai_request(json.dumps(body).encode(), True, FrontdoorConfig())
    served = ServedModel(info_for(folders["llama3"], "llama3"), load_tokenizer(folders["llama3"]))
    want = reference["llama3"].apply_chat_template(body["messages"], continue_final_message=True, tokenize=True,
                                                   return_dict=False)
    assert list(to_router_request(parsed, served, FrontdoorConfig()).prompt_token_ids) == list(want)


# -- the HTTP door: errors in OpenAI's shape ---------------------------------------------------------------


@pytest.fixture
async def door(folders: dict[str, Path]) -> AsyncIterator[str]:
    names = ("llama3", "mistral", "bare")
    fake = EchoDispatcher(models=[info_for(folders[n], n) for n in names])
    front = HttpFrontdoor(fake, {n: load_tokenizer(folders[n]) for n in names})
    async with serving(front.app) as (_, port):
        yield f"http://127.0.0.1:{port}"


async def chat(base: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(f"{base}/v1/chat/completions", json={"max_tokens": 4, **body})


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


USER = [{"role": "user", "content": "hello"}]


async def test_chat_errors_are_400s_in_openai_shape(door: str) -> None:
    ok = await chat(door, {"model": "llama3", "messages": USER})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 5
    alternation = error_of(await chat(door, {"model": "mistral", "messages": USER * 2}))
    assert alternation["message"] == "roles must alternate between user and assistant, starting with user"
    bare = error_of(await chat(door, {"model": "bare", "messages": USER}))
    assert "no chat template" in bare["message"] and "--chat-template" in bare["message"]
    both = error_of(await chat(door, {"model": "llama3", "messages": USER, "continue_final_message": True}))
    assert both["param"] == "continue_final_message"
    for body, param in [({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                        ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
                        ({"tools": "get_weather"}, "tools"),
                        ({"chat_template": "{{ messages }}"}, "chat_template"),
                        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
                         "messages[0].tool_calls"),
                        ({"messages": [{"role": "assistant", "tool_calls": [
                            {"function": {"name": "f", "arguments": "{not json"}}]}]},
                         "messages[0].tool_calls[0].function.arguments")]:
        assert error_of(await chat(door, {"model": "llama3", "messages": USER, **body}))["param"] == param
    async with httpx.AsyncClient() as client:
        completion = await client.post(f"{door}/v1/completions", json={"model": "bare", "prompt": "hi",
                                                                       "max_tokens": 2})
    assert completion.status_code == 200  # a model without a template still serves completions


@pytest.mark.parametrize("source", ["{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}"])
async def test_a_template_escaping_the_sandbox_is_a_400(folders: dict[str, Path], source: str) -> None:
    fake = EchoDispatcher(models=[info_for(folders["bare"], "bare")])
    front = HttpFrontdoor(fake, {"bare": load_tokenizer(folders["bare"])}, config=FrontdoorConfig(chat_template=source))
    async with serving(front.app) as (_, port):
        response = await chat(f"http://127.0.0.1:{port}", {"model": "bare", "messages": USER})
    assert "sandbox" in error_of(response)["message"]


async def test_chat_template_option_serves_a_folder_without_one(folders: dict[str, Path], tmp_path: Path,
                                                                reference: dict[str, Any]) -> None:
    (tmp_path / "t.jinja").write_text(MISTRAL_TEMPLATE)
    args = build_parser().parse_args(["router", "--model", str(folders["bare"]), "--workers", "127.0.0.1:1",
                                      "--chat-template", str(tmp_path / "t.jinja")])
    config = build_config(args).frontdoor
    assert config.chat_template == MISTRAL_TEMPLATE
    fake = EchoDispatcher(models=[info_for(folders["bare"], "bare")])
    front = HttpFrontdoor(fake, {"bare": load_tokenizer(folders["bare"])}, config=config)
    async with serving(front.app) as (_, port):
        response = await chat(f"http://127.0.0.1:{port}", {"model": "bare", "messages": USER})
    assert response.status_code == 200
    want = reference["llama3"].apply_chat_template(USER, chat_template=MISTRAL_TEMPLATE, tokenize=True,
                                                   return_dict=False)  # "bare" has the llama3 tokens
    assert list(fake.requests[-1].prompt_token_ids) == list(want)
    (tmp_path / "bad.jinja").write_text("{% if %}")
    for bad in ("bad.jinja", "missing.jinja"):
        args.chat_template = tmp_path / bad
        with pytest.raises(ConfigError, match="--chat-template"):
            build_config(args)


async def test_include_stop_str_in_output_over_http() -> None:
    front = HttpFrontdoor(EchoDispatcher(), {"echo": ByteTokenizer(512)})  # echoes the prompt back
    async with serving(front.app) as (_, port), httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{port}/v1/completions"
        texts = []
        for include, stream in [(False, False), (True, False), (True, True)]:
            response = await client.post(url, json={"model": "echo", "prompt": "one, two, three", "stop": [", th"],
                                                    "include_stop_str_in_output": include, "stream": stream})
            if stream:
                events = [json.loads(e[len("data: "):]) for e in response.text.split("\n\n")
                          if e.startswith("data: {")]
                choices = [e["choices"][0] for e in events]
            else:
                choices = response.json()["choices"]
            texts.append(("".join(c["text"] for c in choices), choices[-1]["finish_reason"]))
        bad = await client.post(url, json={"model": "echo", "prompt": "x", "include_stop_str_in_output": "yes"})
    assert texts == [("one, two", "stop"), ("one, two, th", "stop"), ("one, two, th", "stop")]
    assert error_of(bad)["param"] == "include_stop_str_in_output"


# -- a real router and a real worker ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_worker(folders: dict[str, Path]) -> Iterator[ManagedProcess]:
    proc = ManagedProcess("chat-worker", ["worker", "--model", str(folders["llama3"]), "--port", "0", "--backend",
                                          "sim", "--gpu", "h100", "--time-scale", "0", "--num-blocks", "256",
                                          "--log-level", "WARNING"])
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.mark.slow
async def test_a_real_router_renders_and_stops_on_an_hf_folder(folders: dict[str, Path], reference: dict[str, Any],
                                                                sim_worker: ManagedProcess, tmp_path: Path) -> None:
    (tmp_path / "mistral.jinja").write_text(MISTRAL_TEMPLATE)
    args = build_parser().parse_args(["router", "--model", str(folders["llama3"]), "--workers",
                                      sim_worker.address or "", "--mode", "colocated",
                                      "--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING",
                                      "--chat-template", str(tmp_path / "mistral.jinja")])
    router = RouterProcess(build_config(args))
    await router.start()
    try:
        assert router.pool is not None
        for _ in range(200):
            if router.pool.workers(WorkerRole.COLOCATED):
                break
            await asyncio.sleep(0.05)
        base = f"http://127.0.0.1:{router.http_port}"
        turns = [{"role": "user", "content": "héllo 😀"}, {"role": "assistant", "content": "hello"},
                 {"role": "user", "content": "the weather in Paris?"}]
        want = reference["llama3"].apply_chat_template(turns, chat_template=MISTRAL_TEMPLATE, tokenize=True,
                                                       add_generation_prompt=True, return_dict=False)
        texts = []
        for n in range(4):  # a simulated worker's greedy tokens are the same for the same prompt
            asked = [*turns[:-1], {"role": "user", "content": f"the weather in Paris? {n}"}]
            done = await chat(base, {"model": "llama3", "messages": asked, "max_tokens": 40, "temperature": 0})
            assert done.status_code == 200, done.text
            texts.append((asked, done.json()["choices"][0]["message"]["content"]))
        first = await chat(base, {"model": "llama3", "messages": turns, "max_tokens": 2, "temperature": 0})
        assert first.json()["usage"]["prompt_tokens"] == len(want)
        refused = error_of(await chat(base, {"model": "llama3", "messages": turns[:1] * 2}))
        assert refused["message"] == "roles must alternate between user and assistant, starting with user"
        asked, text = max(texts, key=lambda t: len(t[1]))
        assert len(text) >= 8
        stop = text[len(text) // 2:len(text) // 2 + 3]
        async with httpx.AsyncClient() as client:
            streamed = await client.post(f"{base}/v1/chat/completions", json={
                "model": "llama3", "messages": asked, "max_tokens": 40, "temperature": 0, "stream": True,
                "stop": [stop]})
        events = [json.loads(line[len("data: "):]) for line in streamed.text.split("\n\n")
                  if line.startswith("data: {")]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert content == text[:text.find(stop)]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        await router.stop(grace=1.0)
