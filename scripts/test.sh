#!/usr/bin/env bash
# Install pd-router with its dev extra into ./.venv (created if missing), then lint, type-check and
# run the whole test suite. Extra arguments go to pytest (e.g. `bash scripts/test.sh -k capacity`).
set -euo pipefail
cd "$(dirname "$0")/.."

# tests/deploy renders the Kubernetes manifests with kubectl (those tests skip without it).
if ! command -v kubectl >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q kubectl; } >/dev/null \
    || echo "warning: could not install kubectl with apt; the Kubernetes checks in tests/deploy will skip" >&2
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[dev]'

echo "== ruff"
ruff check .
echo "== mypy"
mypy pdrouter
echo "== import contract"
lint-imports --no-cache
echo "== pytest"
timeout --signal=INT --kill-after=60 45m python -m pytest -q -p no:cacheprovider --durations=15 "$@"
