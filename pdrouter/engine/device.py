"""Device and dtype resolution: the one place that turns config strings into torch objects."""

from __future__ import annotations

import torch

from pdrouter.core.errors import ConfigError
from pdrouter.core.model_spec import normalize_dtype

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config name (``bf16``, ``float32``…); ConfigError for unsupported ones."""
    canonical = normalize_dtype(name)
    if canonical not in TORCH_DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported by the engine; use one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[canonical]


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; ConfigError when CUDA is asked for but absent."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ConfigError(f"device {name!r} is not supported; use cpu or cuda[:N]")
    return device


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device; None for the CPU (its budget must be given explicitly)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None
