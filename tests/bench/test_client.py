"""The load generator's client against a real HTTP server that streams chosen chunks."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from pathlib import Path

import pytest

from pdrouter.bench.client import CLIENT_IDLE_S, CompletionsClient, environment_for
from pdrouter.bench.workload import RequestSpec

GAP_S = 0.3
"""The server's pause after its first chunk: the first gap holds it, the time to first token does not."""


def _event(text: str, finish: str | None = None) -> bytes:
    body = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

    def chunk(data: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))

    chunk(_event(""))  # the first byte of a two-byte character: a token, no text yet
    await writer.drain()
    await asyncio.sleep(GAP_S)
    chunk(_event("é"))
    chunk(_event("!", "length"))
    usage = {"id": "c", "object": "text_completion", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    chunk(b"data: " + json.dumps(usage).encode() + b"\n\n" + b"data: [DONE]\n\n")
    chunk(b"")
    await writer.drain()
    writer.close()


async def test_a_chunk_with_empty_text_is_the_first_token() -> None:
    """As ``vllm bench serve`` times it: a chunk with a choice is a token step, its text empty or not."""
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = CompletionsClient(f"http://127.0.0.1:{port}/v1", "m")
    try:
        record = await client.send(RequestSpec(0, (1, 2, 3), 3), 0.0, 0.0)
    finally:
        await client.close()
        server.close()
    assert record.ok, record.detail
    assert record.output_tokens == 3
    assert len(record.itl_s) == 2  # three token chunks
    assert record.ttft_s is not None and record.e2e_s is not None
    assert record.itl_s[0] >= GAP_S > record.ttft_s  # the first token came before the pause, its text after


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)


async def _send_with(serve: object, **kwargs: float) -> tuple[object, int]:
    """One request to a server answering with ``serve``: the record, and the connections it accepted."""
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        try:
            await serve(reader, writer)  # type: ignore[operator]
        finally:
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = CompletionsClient(f"http://127.0.0.1:{port}/v1", "m", **kwargs)  # type: ignore[arg-type]
    try:
        record = await client.send(RequestSpec(0, (1, 2, 3), 3), 0.0, 0.0)
    finally:
        await client.close()
        server.close()
    return record, accepted


async def test_an_error_status_is_recorded_with_the_servers_message() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        body = json.dumps({"error": {"message": "too many requests: retry in 1 s", "type": "rate_limit"}}).encode()
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    record, _ = await _send_with(serve)
    assert (record.error, record.status, record.detail) == ("http_429", 429, "too many requests: retry in 1 s")


async def test_nothing_listening_is_a_connect_error() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    client = CompletionsClient(f"http://127.0.0.1:{port}/v1", "m")
    try:
        record = await client.send(RequestSpec(0, (1,), 1), 0.0, 0.0)
    finally:
        await client.close()
    assert record.error == "connect" and record.detail


async def test_a_stream_cut_before_done_is_a_protocol_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        data = _event("a")
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))  # the body ends, no [DONE]
        await writer.drain()

    record, _ = await _send_with(serve)
    assert record.error == "protocol" and "[DONE]" in (record.detail or "")
    assert record.output_tokens == 1 and record.ttft_s is not None


async def test_an_error_event_in_the_stream_is_recorded() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        data = b"data: " + json.dumps({"error": {"message": "the worker failed"}}).encode() + b"\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        await writer.drain()

    record, _ = await _send_with(serve)
    assert (record.error, record.detail) == ("stream_error", "the worker failed")


async def test_a_server_that_stops_sending_times_out() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)  # no token comes

    record, _ = await _send_with(serve, timeout_s=0.3)
    assert record.error == "timeout" and record.detail == "no data from the server for 0.3 s"
    silent_head = await _send_with(lambda reader, writer: asyncio.sleep(5), timeout_s=0.3)  # not even a head
    assert silent_head[0].error == "timeout"  # type: ignore[attr-defined]


async def test_a_slow_stream_whose_gaps_are_shorter_than_the_timeout_is_read_whole() -> None:
    """The timeout bounds each wait for the server's bytes, not the request: 1.2 s of tokens, each within 0.5 s."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for data in (_event("a"), _event("b"), _event("c"), _event("d", "length"), b"data: [DONE]\n\n"):
            await asyncio.sleep(0.3)
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    record, _ = await _send_with(serve, timeout_s=0.5)
    assert record.ok, record.detail
    assert record.output_tokens == 4 and record.e2e_s is not None and record.e2e_s > 0.5


async def test_a_request_cancelled_from_outside_is_cancelled_not_timed_out() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    client = CompletionsClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", "m", timeout_s=0.3)
    try:
        task = asyncio.ensure_future(client.send(RequestSpec(0, (1, 2, 3), 3), 0.0, 0.0))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.4)  # the request's timer was stopped with it: nothing fires later
    finally:
        await client.close()
        server.close()


async def test_requests_reuse_one_kept_alive_connection() -> None:
    """The body is read to its end after ``[DONE]``, so the connection goes back to the pool."""
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        try:
            while True:
                await _read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for data in (_event("a"), _event("b", "length"), b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = CompletionsClient(f"http://127.0.0.1:{port}/v1", "m")
    try:
        records = [await client.send(RequestSpec(i, (1, 2), 2), 0.0, 0.0) for i in range(3)]
    finally:
        await client.close()
        server.close()
    assert all(r.ok and r.output_tokens == 2 for r in records), [r.detail for r in records]
    assert accepted == 1


async def test_events_split_across_reads_and_a_last_line_without_newline_are_read() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        first, second = _event("a"), _event("b", "length")
        for piece in (first[:9], first[9:] + second[:20], second[20:], b"data: [DONE]"):  # no final newline
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.05)  # each piece its own read
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    record, _ = await _send_with(serve)
    assert record.ok, record.detail
    assert record.output_tokens == 2 and len(record.itl_s) == 1 and record.e2e_s is not None


async def test_a_line_that_never_ends_is_a_protocol_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"x" * (256 << 10)
        for _ in range(6):  # 1.5 MiB without a newline
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    record, _ = await _send_with(serve)
    assert record.error == "protocol" and "longer than" in (record.detail or "")


def test_the_environment_is_read_once_as_a_client_trusting_it_reads_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``environment_for``: the proxy for the URL's scheme unless NO_PROXY exempts its host, and the
    .netrc login for its host (none when a key was given, or without a file)."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY", "all_proxy",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    rc = tmp_path / "netrc"
    rc.write_text("machine gpu-box.internal login ops password s3cret\n")
    rc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(rc))
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    assert environment_for("http://gpu-box.internal:8000/v1/completions") == \
        ("http://proxy.internal:3128", "Basic " + base64.b64encode(b"ops:s3cret").decode())
    assert environment_for("http://gpu-box.internal:8000/v1/completions", with_login=False) == \
        ("http://proxy.internal:3128", None)
    assert environment_for("https://other.internal/v1/completions") == (None, None)  # no HTTPS proxy, no login
    monkeypatch.setenv("NO_PROXY", "gpu-box.internal")
    assert environment_for("http://gpu-box.internal:8000/v1/completions")[0] is None
    monkeypatch.setenv("NETRC", str(tmp_path / "absent"))
    assert environment_for("http://gpu-box.internal:8000/v1/completions") == (None, None)


def _stream_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


async def test_a_connection_closed_mid_stream_is_a_protocol_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_stream_head() + _chunked(_event("a")))  # then the connection closes: no last chunk
        await writer.drain()

    record, _ = await _send_with(serve)
    assert record.error == "protocol" and "closed the connection" in (record.detail or "")
    assert record.status == 200 and record.output_tokens == 1 and record.ttft_s is not None


async def test_a_response_that_is_not_http_is_a_protocol_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    record, _ = await _send_with(serve)
    assert record.error == "protocol" and "not HTTP" in (record.detail or "")


async def test_an_event_of_another_shape_is_a_protocol_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_stream_head() + _chunked(_event("a"), b"data: [1, 2, 3]\n\n", b"data: [DONE]\n\n", b""))
        await writer.drain()

    record, _ = await _send_with(serve)
    assert record.error == "protocol" and "AttributeError" in (record.detail or "")


async def test_a_connection_is_kept_after_an_error_status_and_dropped_when_the_server_closes_it() -> None:
    """An error answered whole leaves its connection reusable; one the server closed while idle is not
    reused, nor one idle for longer than the client keeps them."""
    accepted = 0
    close_after: set[int] = set()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        this = accepted
        answered = 0
        try:
            while True:
                await _read_request(reader)
                answered += 1
                if answered == 1 and this == 1:
                    body = b'{"error": {"message": "busy"}}'
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
                else:
                    writer.write(_stream_head() + _chunked(_event("a", "length"), b"data: [DONE]\n\n", b""))
                await writer.drain()
                if this in close_after:
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    client = CompletionsClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", "m")
    try:
        first = await client.send(RequestSpec(0, (1,), 1), 0.0, 0.0)
        second = await client.send(RequestSpec(1, (1,), 1), 0.0, 0.0)
        assert (first.error, first.detail, second.ok, accepted) == ("http_503", "busy", True, 1)
        close_after.add(1)
        assert (await client.send(RequestSpec(2, (1,), 1), 0.0, 0.0)).ok  # the server closes after it
        await asyncio.sleep(0.1)
        assert (await client.send(RequestSpec(3, (1,), 1), 0.0, 0.0)).ok and accepted == 2
        await asyncio.sleep(CLIENT_IDLE_S + 0.2)  # idle for longer than the client keeps a connection
        assert (await client.send(RequestSpec(4, (1,), 1), 0.0, 0.0)).ok and accepted == 3
    finally:
        await client.close()
        server.close()


async def test_https_is_verified_against_the_trusted_cas(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An https URL speaks TLS and checks the server's certificate against the default trust store
    (``SSL_CERT_FILE`` adds a CA): refused without its CA, answered with it."""
    from pdrouter.testing.pki import TestCa

    tls = TestCa(tmp_path).issue("server")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    assert tls.cert and tls.key and tls.ca
    context.load_cert_chain(tls.cert, tls.key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _read_request(reader)
            writer.write(_stream_head() + _chunked(_event("a", "length"), b"data: [DONE]\n\n", b""))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=context)
    url = f"https://localhost:{server.sockets[0].getsockname()[1]}/v1"
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    try:
        client = CompletionsClient(url, "m")
        refused = await client.send(RequestSpec(0, (1,), 1), 0.0, 0.0)
        await client.close()
        monkeypatch.setenv("SSL_CERT_FILE", tls.ca)
        client = CompletionsClient(url, "m")
        answered = await client.send(RequestSpec(1, (1,), 1), 0.0, 0.0)
        await client.close()
    finally:
        server.close()
    assert refused.error == "connect" and "CERTIFICATE_VERIFY_FAILED" in (refused.detail or "")
    assert answered.ok and answered.output_tokens == 1


async def test_through_a_proxy_requests_go_in_absolute_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the environment's HTTP proxy the request goes to the proxy, naming the server's URL."""
    lines: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines.append(head.split(b"\r\n")[0])
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(_stream_head() + _chunked(_event("a", "length"), b"data: [DONE]\n\n", b""))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    client = CompletionsClient("http://gpu-box.invalid:8000/v1", "m")
    try:
        record = await client.send(RequestSpec(0, (1,), 1), 0.0, 0.0)
    finally:
        await client.close()
        server.close()
    assert record.ok, record.detail
    assert lines == [b"POST http://gpu-box.invalid:8000/v1/completions HTTP/1.1"]


def test_a_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        CompletionsClient("ftp://example.invalid/v1", "m")


async def test_requests_that_found_every_connection_taken_are_counted() -> None:
    """Two connections, five requests at once: three wait for one (the wait is in their TTFT), and the
    figures say so; the same five with room for all wait for none."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await _read_request(reader)
                await asyncio.sleep(0.2)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for data in (_event("a", "length"), b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for cap, waited in ((2, 3), (8, 0)):
            client = CompletionsClient(f"http://127.0.0.1:{port}/v1", "m", max_connections=cap)
            try:
                records = await asyncio.gather(*(client.send(RequestSpec(i, (1, 2), 1), 0.0, 0.0) for i in range(5)))
            finally:
                await client.close()
            assert all(r.ok for r in records), [r.detail for r in records]
            assert client.figures.to_dict() == {"connections": cap, "peak_in_flight": min(cap, 5),
                                                "waited_for_a_connection": waited}
            slowest = max(r.ttft_s or 0.0 for r in records)
            assert (slowest >= 0.35) is (waited > 0), slowest  # a third wave of 0.2 s each, or one
    finally:
        server.close()


def test_the_soft_limit_on_open_files_is_raised_up_to_the_hard_one() -> None:
    import resource

    from pdrouter.core.net import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raise_open_file_limit(128)  # already enough: unchanged
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (256, hard)
        raise_open_file_limit(900)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (900 if hard == resource.RLIM_INFINITY
                                                                 else min(900, hard))
        if hard != resource.RLIM_INFINITY:
            raise_open_file_limit(hard + 1)  # never past the hard limit (not allowed without privilege)
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_run_commands_help_names_the_clients_connection_cap() -> None:
    """``bench run --help`` is built without importing the client (aiohttp), so it states the cap itself."""
    import argparse

    from pdrouter.bench.client import CLIENT_CONNECTIONS
    from pdrouter.cli.bench_cmd import add_run_args

    parser = argparse.ArgumentParser()
    add_run_args(parser)
    assert f"up to {CLIENT_CONNECTIONS:,}" in " ".join(parser.format_help().split())
