#!/usr/bin/env bash
# On a GPU node: the vLLM parity test with vLLM's own GPU wheel. A `--backend vllm` worker behind the
# router must give, token for token, what vLLM's own OpenAI server gives on the same model folder
# (tests/vllm/test_parity.py: prompt lengths on and around block boundaries, prefix hits, seeded
# sampling, stop ids and strings, chat), here with CUDA graphs on, as vLLM runs on a GPU.
#
# Needs: an NVIDIA GPU, and vLLM's GPU wheel in ./.venv (installed here when missing, which needs the
# package index). Three engines share the GPU (two workers and vLLM's server), a quarter of it each.
# About 5 minutes on an H200, most of it vLLM's start-up.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
if ! python -c 'import vllm' 2>/dev/null; then
  python -m pip install --quiet torch==2.13.0
  python -m pip install --quiet -e '.[dev,vllm]'
fi
python -c 'import torch, vllm; assert torch.cuda.is_available(), "no CUDA device"; print("vLLM", vllm.__version__, "on", torch.cuda.get_device_name(0))'
PDROUTER_VLLM_TEST_DEVICE=cuda timeout --signal=INT --kill-after=60 20m \
  python -m pytest -q -p no:cacheprovider -m vllm --durations=10 tests/vllm/test_parity.py "$@"
