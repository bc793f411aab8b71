"""``pdrouter up --model DIR`` serves a user's own HF folder: its tokenizer, its chat template, its EOS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdrouter.core.tokenizer import load_tokenizer

from ..core.hf_folders import write_hf_folder


def test_up_serves_an_hf_folder_with_its_own_tokenizer(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "llama3", "llama3")
    done = subprocess.run([sys.executable, "-m", "pdrouter", "up", "--backend", "sim", "--time-scale", "0",
                           "--model", str(folder), "--http-port", "0", "--grpc-port", "0", "--once"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    body = json.loads(done.stdout[done.stdout.index("{"):done.stdout.rindex("}") + 1])
    tokenizer = load_tokenizer(folder)
    # The sample prompt was tokenized by the folder's own BPE, with its BOS (not the byte-level fallback,
    # which would give one id per byte plus its BOS).
    prompt = "The capital of France is"
    expected = len(tokenizer.encode(prompt))
    assert expected != len(prompt.encode()) + 1
    assert body["usage"]["prompt_tokens"] == expected
    assert 1 <= body["usage"]["completion_tokens"] <= 16
