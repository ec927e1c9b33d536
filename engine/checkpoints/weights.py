"""Lazy safetensors reading: single file or sharded (model.safetensors.index.json), mmapped."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.types import UnsupportedModelError


class CheckpointReader:
    """Opens shards on first use; each tensor is read only when asked for."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        single = self.model_dir / "model.safetensors"
        if index.is_file():
            self._file_of: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                self._file_of = {name: single.name for name in f.keys()}
        else:
            raise UnsupportedModelError(
                f"no model.safetensors or model.safetensors.index.json in {self.model_dir}"
            )
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str, dtype: torch.dtype, device: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name).to(device=device, dtype=dtype)  # type: ignore[attr-defined]

    def is_fp8(self, name: str) -> bool:
        """Whether the tensor is stored as FP8 e4m3 (without reading it)."""
        handle = self._handle(name) if self.has(name) else None
        return handle is not None and handle.get_slice(name).get_dtype() == "F8_E4M3"  # type: ignore[attr-defined]

    def _handle(self, name: str) -> object:
        if name not in self._file_of:
            raise UnsupportedModelError(f"checkpoint has no tensor named {name!r}")
        file = self._file_of[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(self.model_dir / file, framework="pt")
            self._handles[file] = handle
        return handle
