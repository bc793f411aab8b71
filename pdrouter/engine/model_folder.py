"""HF-format model folders without the weights: read the geometry and eos ids, or write a folder that has only those.

A folder holds ``config.json`` (an HF ``LlamaForCausalLM`` config), a tokenizer file and, for the
torch engine, ``*.safetensors`` weights (``pdrouter.engine.model_io``). The simulated engine needs
only what this module reads, so it never imports torch; :func:`write_config_folder` writes such a
weightless folder for any geometry (``pdrouter up --backend sim`` gives the router and the
simulated workers one folder to agree on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdrouter.core.errors import ConfigError
from pdrouter.core.hf_tokenizer import read_eos_token_ids
from pdrouter.core.model_spec import ModelSpec
from pdrouter.core.tokenizer import SPECIAL_TOKENS, ByteTokenizer


@dataclass(frozen=True)
class ModelFolder:
    """What an engine reads from a model folder, apart from the weights."""

    path: Path
    spec: ModelSpec
    eos_token_ids: tuple[int, ...]

    def weight_files(self) -> list[Path]:
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{self.path} holds no *.safetensors weights")
        return files


def _check_rope_scaling(config: dict[str, Any]) -> None:
    scaling = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    if kind != "default":
        raise ConfigError(f"rope scaling {kind!r} is not supported by the engine (only plain RoPE)")


def read_model_folder(path: str | Path) -> ModelFolder:
    """Parse ``config.json`` (geometry) and the eos ids; ConfigError for missing or unsupported configs.

    The eos ids are every id that ends a generation: ``config.json``'s, ``generation_config.json``'s
    and the tokenizer's ``eos_token`` (``pdrouter.core.tokenizer.read_eos_token_ids``)."""
    folder = Path(path)
    spec = ModelSpec.from_pretrained_dir(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"activation {config['hidden_act']!r} is not supported (Llama-family: silu)")
    if config.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported")
    _check_rope_scaling(config)
    return ModelFolder(path=folder, spec=spec, eos_token_ids=read_eos_token_ids(folder))


def write_config_folder(spec: ModelSpec, out: Path, hf_tokenizer: bool = False) -> Path:
    """Write ``config.json`` and the byte-level tokenizer for ``spec`` into ``out`` (no weights); returns ``out``.

    The special tokens of the byte-level tokenizer are the ``bos``/``eos``/``pad`` ids of the
    config, so every model folder the project writes agrees with its tokenizer. ``hf_tokenizer``:
    write it as an HF tokenizer and chat template too (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``; the same ids), so transformers and vLLM serve text and chat from the folder.
    """
    out.mkdir(parents=True, exist_ok=True)
    config = spec.to_hf_config()
    config.update(bos_token_id=SPECIAL_TOKENS["<bos>"], eos_token_id=SPECIAL_TOKENS["<eos>"],
                  pad_token_id=SPECIAL_TOKENS["<pad>"], initializer_range=0.02, pretraining_tp=1,
                  rope_scaling=None, attention_dropout=0.0)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = ByteTokenizer(spec.vocab_size)
    if hf_tokenizer:
        tokenizer.save_hf(out, model_max_length=spec.max_context)
    else:
        tokenizer.save(out)
    return out
