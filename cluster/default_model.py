"""The embedded default model: created on first use in a cache directory, no network."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

DEFAULT_ARCH = "llama"
DEFAULT_SIZE = "tiny"


def cache_dir() -> Path:
    root = os.environ.get("SPLITSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "splitserve"
    )
    return Path(root)


def default_model_dir(arch: str = DEFAULT_ARCH, size: str = DEFAULT_SIZE, seed: int = 0) -> Path:
    """Path of the embedded model, writing it first if it is not there yet."""
    from engine.tiny_model import make_tiny_model

    path = cache_dir() / "models" / f"{arch}-{size}-seed{seed}"
    if not (path / "config.json").is_file():
        # Write aside and rename, so a concurrent first use never sees half a checkpoint.
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, arch=arch, size=size, seed=seed)
        if path.exists():
            shutil.rmtree(tmp)
        else:
            tmp.replace(path)
    return path
