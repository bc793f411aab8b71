"""``pdrouter bench`` on the command line: every default shown, bad points refused, errors that say what to do."""

from __future__ import annotations

import argparse

import pytest

from pdrouter.cli.main import build_parser, main


def bench_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    bench_sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return dict(bench_sub.choices)


@pytest.mark.parametrize("command", ["run", "sweep", "compare"])
def test_help_shows_every_default(command: str) -> None:
    parser = bench_parsers()[command]
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        help_text = parser._get_formatter()._get_help_string(action) or ""  # what --help prints for it
        if isinstance(action, argparse._StoreTrueAction):
            continue  # a flag: off unless given
        assert "default" in help_text, f"{command} {action.option_strings[0]}: {help_text!r}"
    if command != "compare":  # the comparison brings its clusters up without a key
        assert "OPENAI_API_KEY" in text


def test_the_api_key_is_read_at_run_time_and_never_shown_in_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-value")
    parser = bench_parsers()["run"]
    assert "sk-secret-value" not in parser.format_help()
    assert parser.parse_args([]).api_key is None


def test_a_missing_key_is_hinted_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    from pdrouter.bench.point import failure_hint

    hint = failure_hint("http_401", "a valid API key is required", "http://h:1/v1", "m")
    assert hint.startswith("http_401: a valid API key is required;") and "--api-key" in hint
    assert "check --url" not in hint
    assert "check --url" in failure_hint("connect", "", "http://h:1/v1", "m")
    refused = failure_hint("http_400", "the prompt has 9000 tokens; the context is 8192", "http://h:1/v1", "m")
    assert "9000 tokens" in refused and "context" in refused


def test_a_sweep_of_points_too_small_for_a_trace_is_refused(tmp_path: pytest.TempPathFactory,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    trace = Path(str(tmp_path)) / "t.jsonl"
    trace.write_text("".join(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n" for _ in range(30)))
    code = main(["bench", "sweep", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--workload", "jsonl",
                 "--dataset", str(trace), "--num-requests", "20", "--rates", "1,2", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "2 points need 40" in err and err.strip().count("\n") == 0


def test_timeout_is_in_simulated_seconds_like_every_other_time() -> None:
    from pdrouter.cli.bench_cmd import wall_timeout

    assert wall_timeout(argparse.Namespace(timeout=600.0, time_scale=8.0)) == 4800.0
    assert wall_timeout(argparse.Namespace(timeout=600.0, time_scale=0.0)) == 600.0  # instant: the clock's seconds
    assert wall_timeout(argparse.Namespace(timeout=30.0)) == 30.0  # no time scale: real engines
