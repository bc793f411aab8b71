"""Parity: a ``--backend vllm`` worker behind the router answers as vLLM's own OpenAI server does, token for token.

One worker of the session's pool, behind a router of its own (``--workers``: every request goes to
that worker, so both sides see the same requests in the same order, the same cache hits and the same
batches), against vLLM's server on the same model folder with the same block size, pool and context.
Each prompt starts with a tag no other test uses, so neither side holds any of its blocks before.

Per prompt length (including lengths on and around block boundaries):

* first (nothing cached on either side): the router's gRPC door gives the token ids of the
  completion; they must equal the ``token_ids`` vLLM's server returns;
* again (a prefix hit on both sides): the router's HTTP door against vLLM's server: the text, the
  finish reason and the usage, cached tokens included, must be equal.

Then sampling parameters (a seeded random sample with top-p and top-k, stop token ids, stop strings,
``ignore_eos``) and a chat request, each compared the same way.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from pdrouter.cli.local_cluster import ManagedProcess
from pdrouter.wire.v1 import common_pb2, router_pb2, router_pb2_grpc

from .conftest import BLOCK, MODEL, VllmPool, VllmServer, http_json, run

LENGTHS = [2, 31, 32, 33, 64, 65, 96, 200]
"""Prompt lengths in tokens, ``<bos>`` included (each ASCII character is one token)."""
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def router(vllm_pool: VllmPool) -> Iterator[ManagedProcess]:
    """A router whose only worker is ``vllm-a`` (a static list: no placement choice to make)."""
    proc = ManagedProcess("parity-router", [
        "router", "--model", str(vllm_pool.model), "--workers", vllm_pool.worker_address("vllm-a"),
        "--mode", "colocated", "--block-size", str(BLOCK), "--http-port", "0", "--grpc-port", "0",
        "--log-level", "WARNING"], env=vllm_pool.env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def prompt_text(tokens: int) -> str:
    """A text of ``tokens`` tokens with ``<bos>`` (one per ASCII character), unique to this run."""
    tag = uuid.uuid4().hex[:12]
    body = (f"{tag} the quick brown fox jumps over the lazy dog " * 20)[: tokens - 1]
    return body


def server_completion(server: VllmServer, prompt: str, **params: Any) -> dict[str, Any]:
    status, body = http_json(f"{server.url}/v1/completions",
                             {"model": MODEL, "prompt": prompt, "return_token_ids": True, **params})
    assert status == 200, body
    return body


def router_completion(router: ManagedProcess, prompt: str, **params: Any) -> dict[str, Any]:
    status, body = http_json(f"http://{router.address}/v1/completions", {"model": MODEL, "prompt": prompt, **params})
    assert status == 200, body
    return body


async def _grpc_tokens(address: str, prompt: str, sampling: common_pb2.SamplingParams) -> tuple[list[int], str]:
    ids: list[int] = []
    text = ""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        async for msg in stub.Generate(router_pb2.GenerateRequest(model=MODEL, text=prompt, sampling=sampling)):
            ids.extend(msg.token_ids)
            text += msg.text
    return ids, text


def router_tokens(router: ManagedProcess, prompt: str, **params: Any) -> list[int]:
    """The completion's token ids through the router's gRPC door."""
    assert router.grpc_address is not None
    sampling = common_pb2.SamplingParams(max_tokens=params.get("max_tokens", MAX_TOKENS),
                                         temperature=params.get("temperature", 0.0), top_p=params.get("top_p", 1.0),
                                         top_k=params.get("top_k", 0), stop_token_ids=params.get("stop_token_ids", ()),
                                         ignore_eos=params.get("ignore_eos", False))
    if "seed" in params:
        sampling.seed = params["seed"]
    ids, _ = run(_grpc_tokens(router.grpc_address, prompt, sampling))
    return ids


@pytest.fixture(scope="module")
def tokenizer(vllm_pool: VllmPool) -> Any:
    from pdrouter.core.tokenizer import load_tokenizer

    return load_tokenizer(vllm_pool.model)


def same_answer(ours: dict[str, Any], theirs: dict[str, Any], tokenizer: Any) -> None:
    """Two completion bodies agree: the router's text is the text of vLLM's token ids, the finish reason
    and the usage (cached tokens included) are the same.

    The text is compared with the full decode of vLLM's ``token_ids``, not with vLLM's text: vLLM's
    streaming detokenizer leaves out a trailing character whose bytes never completed (random models
    emit such bytes), where the router, as a full decode does, ends with U+FFFD."""
    a, b = ours["choices"][0], theirs["choices"][0]
    assert (a["text"], a["finish_reason"]) == (tokenizer.decode(b["token_ids"]), b["finish_reason"])
    usage = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: ours["usage"][k] for k in usage} == {k: theirs["usage"][k] for k in usage}
    cached = (theirs["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert ours["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


@pytest.mark.parametrize("tokens", LENGTHS)
def test_greedy_tokens_equal_vllms_own_server(router: ManagedProcess, vllm_server: VllmServer, tokenizer: Any,
                                               tokens: int) -> None:
    prompt = prompt_text(tokens)
    theirs = server_completion(vllm_server, prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert theirs["usage"]["prompt_tokens"] == tokens
    assert router_tokens(router, prompt) == theirs["choices"][0]["token_ids"]
    again = server_completion(vllm_server, prompt, max_tokens=MAX_TOKENS, temperature=0)
    ours = router_completion(router, prompt, max_tokens=MAX_TOKENS, temperature=0)
    same_answer(ours, again, tokenizer)
    if tokens > BLOCK:  # a whole block or more of the prompt was cached: a real prefix hit, on both sides
        assert ours["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK


def test_a_longer_prompt_reuses_the_cached_prefix(router: ManagedProcess, vllm_server: VllmServer,
                                                  tokenizer: Any) -> None:
    base = prompt_text(100)
    server_completion(vllm_server, base, max_tokens=1, temperature=0)
    router_completion(router, base, max_tokens=1, temperature=0)
    longer = base + " and then some more words to read"
    theirs = server_completion(vllm_server, longer, max_tokens=MAX_TOKENS, temperature=0)
    ours = router_completion(router, longer, max_tokens=MAX_TOKENS, temperature=0)
    same_answer(ours, theirs, tokenizer)
    assert ours["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK


@pytest.mark.parametrize("params", [
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1234},
    {"temperature": 0, "stop_token_ids": [101, 32, 97]},
    {"temperature": 0, "ignore_eos": True, "max_tokens": 40},
], ids=["seeded-sample", "stop-token-ids", "ignore-eos"])
def test_sampling_parameters_give_the_same_tokens(router: ManagedProcess, vllm_server: VllmServer, tokenizer: Any,
                                                  params: dict[str, Any]) -> None:
    params = {"max_tokens": MAX_TOKENS, **params}
    prompt = prompt_text(70)
    theirs = server_completion(vllm_server, prompt, **params)
    assert router_tokens(router, prompt, **params) == theirs["choices"][0]["token_ids"]
    same_answer(router_completion(router, prompt, **params), server_completion(vllm_server, prompt, **params),
                tokenizer)


def test_stop_strings_end_the_text_alike(router: ManagedProcess, vllm_server: VllmServer, tokenizer: Any) -> None:
    """The router matches stop strings on its own decoded text, vLLM's server inside vLLM: the same
    tokens, the same cut (with and without the stop string in the output), the same finish reason.

    The cut is what is compared, so the prompt is one both engines continue with the same greedy
    tokens: two bfloat16 engines of a random model can break a near tie apart (a token flipped, the
    stop string one byte earlier), which is not what this test is about."""
    for _ in range(5):
        prompt = prompt_text(50)
        first = server_completion(vllm_server, prompt, max_tokens=MAX_TOKENS, temperature=0)
        if router_tokens(router, prompt, max_tokens=MAX_TOKENS) == first["choices"][0]["token_ids"]:
            break
    else:
        pytest.fail("five prompts, and the router's engine never continued one as vLLM's server did")
    text = tokenizer.decode(first["choices"][0]["token_ids"])
    printable = [c for c in text[2:] if c.isascii() and c.isprintable()]
    stop = printable[0] if printable else "e"
    for include in (False, True):
        params = {"max_tokens": MAX_TOKENS, "temperature": 0, "stop": [stop], "include_stop_str_in_output": include}
        theirs = server_completion(vllm_server, prompt, **params)
        ours = router_completion(router, prompt, **params)
        full = tokenizer.decode(theirs["choices"][0]["token_ids"])
        at = full.find(stop)
        want = full if at < 0 else full[:at + len(stop)] if include else full[:at]
        assert (ours["choices"][0]["text"], ours["choices"][0]["finish_reason"]) == (
            want, theirs["choices"][0]["finish_reason"])
        assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]


def test_chat_through_the_folders_template(router: ManagedProcess, vllm_server: VllmServer, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": f"hello {uuid.uuid4().hex[:8]}, how are you?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, theirs = http_json(f"{vllm_server.url}/v1/chat/completions", {**body, "return_token_ids": True})
    assert status == 200, theirs
    status, ours = http_json(f"http://{router.address}/v1/chat/completions", body)
    assert status == 200, ours
    assert ours["choices"][0]["message"]["content"] == tokenizer.decode(theirs["choices"][0]["token_ids"])
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
