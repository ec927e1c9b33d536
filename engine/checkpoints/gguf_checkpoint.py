"""GGUF checkpoints: a `.gguf` file becomes a Hugging Face-format directory the engine and the
router already read, once, in a cache.

    model.gguf --(gguf reader: architecture, tensor types checked)--> refused with a clear error,
               --(transformers' GGUF loading: dequantize, un-permute, rename; the widths it
                  leaves at its defaults taken from the file)--> config.json,
                 generation_config.json, model.safetensors (float32), tokenizer.json,
                 tokenizer_config.json, chat_template.jinja (from the GGUF's metadata)
               under <cache>/gguf/<key of path, size, mtime + converter>/<file stem>/

The directory's name is the file's stem, so the model id (block-hash key, served model name)
is the same on every machine. A conversion is written aside and renamed into place, so a
concurrent first use never sees half of one. The engine then casts the float32 weights to
the serving dtype as it loads them. Only `resolve_model_dir` converts; it imports torch and
transformers, so the router (torch-free) never calls it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.types import UnsupportedModelError

logger = logging.getLogger(__name__)

CONVERTER_VERSION = "2"
"""Part of the cache key: a change to what a conversion writes bumps it."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
"""GGUF `general.architecture` -> the Hugging Face architecture the engine runs. (A
mixture's experts come out of transformers' GGUF reading stacked per layer, the layout the
engine runs them in: engine/model/moe.py reads them so. Mixtral's GGUFs, "llama" with experts,
transformers does not read.)"""
MIXTURES = ("qwen2moe", "qwen3moe")
"""The architectures among them whose experts are read."""
MODEL_TYPES = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
"""A converted config's model_type, where it is not the GGUF architecture's name."""
FILLED_FIELDS = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}
"""GGUF hyperparameter (after the architecture's name) -> the config attribute it sets."""
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""Tensor types dequantized (by the gguf package, through transformers)."""


def cache_root() -> Path:
    """`$SPLITSERVE_CACHE`, else `$XDG_CACHE_HOME/splitserve`, else `~/.cache/splitserve`."""
    root = os.environ.get("SPLITSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "splitserve")
    return Path(root)


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself, or the only `.gguf` in a directory without config.json."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            raise UnsupportedModelError(f"{p} holds {len(found)} .gguf files ({', '.join(f.name for f in found)}); "
                                        "pass the one to serve")
        return found[0] if found else None
    return None


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory the engine reads: `path` itself, or for a GGUF file its converted
    directory in the cache (converting it first, which takes seconds to a minute)."""
    file = gguf_file(path)
    if file is None:
        return Path(path)
    out = cache_root() / "gguf" / _cache_key(file) / file.stem
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _one_reader(file):
            check_supported(file)
            logger.warning("converting %s (dequantizing to float32) into %s; later starts reuse it", file, out)
            _convert(file, tmp)
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_supported(file: Path) -> None:
    """Raises UnsupportedModelError naming the architecture or tensor types the engine cannot serve."""
    import gguf

    try:
        reader = gguf.GGUFReader(file)  # (while converting, the shared one: `_one_reader`)
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"{file} is not a readable GGUF file: {e}") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{file.name}: GGUF architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(ARCHITECTURES)}")
    experts = reader.fields.get(f"{arch}.expert_count")
    if arch not in MIXTURES and experts is not None and int(experts.contents()) > 0:
        raise UnsupportedModelError(f"{file.name}: a GGUF {arch!r} with {int(experts.contents())} experts (Mixtral's "
                                    "form) is not supported; serve its Hugging Face checkpoint instead")
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - set(TENSOR_TYPES))
    if unsupported:
        raise UnsupportedModelError(f"{file.name}: GGUF tensor types {', '.join(unsupported)} are not supported; "
                                    f"supported: {', '.join(TENSOR_TYPES)}")


def _cache_key(file: Path) -> str:
    """The file's identity (path, size, modification time) and the converter's version: every
    process that resolves the model (the driver, each worker) gets it without reading the file,
    and a file replaced in place gets a new conversion."""
    st = file.stat()
    ident = f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _convert(file: Path, out: Path) -> None:
    """Writes the Hugging Face-format directory of `file` into `out`."""
    import torch
    import transformers
    from safetensors.torch import save_file

    transformers.utils.logging.disable_progress_bar()
    directory, name = str(file.parent), file.name
    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    _fill_config(config, file)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config,
                                                              dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (config.tie_word_embeddings and k == "lm_head.weight")}  # tied: one tensor, not two
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict()
    raw["architectures"] = [ARCHITECTURES[MODEL_TYPES.get(raw["model_type"], raw["model_type"])]]
    raw["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(raw, indent=2, default=str))
    generation = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save_pretrained(str(out))  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    (out / "source.json").write_text(json.dumps({"gguf": str(file.resolve()), "converter": CONVERTER_VERSION}))


@contextlib.contextmanager
def _one_reader(file: Path) -> Iterator[None]:
    """While converting, the metadata of `file` is parsed once. Every `gguf.GGUFReader(file)`
    (transformers makes one for the config, the tokenizer and the weights; `check_supported`
    and `_fill_config` one each) is one reader, read-only, over a plain array view of its memory
    map (a memory map's own slicing runs Python code per slice: millions of slices for a
    vocabulary). transformers' parse of each metadata value (`_gguf_parse_value`, run over every
    field for each of its three reads) is kept per value of that reader: a value is an int, a
    float, a bool or a str. And the tensor name map of an architecture, asked for once per module
    of the model (hundreds of times) and only read (`get_name`), is made once per (architecture,
    layers). Other files get their own readers and parses, as before. Gemma 3's 262K-token
    vocabulary converts in well under half the time this way, the embedded model's too."""
    import gguf
    import numpy as np

    class PlainReader(gguf.GGUFReader):  # type: ignore[misc]
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)  # its base keeps the map open

    made, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    try:
        shared = PlainReader(file)
    except (ValueError, OSError) as e:
        raise UnsupportedModelError(f"{file} is not a readable GGUF file: {e}") from None
    key = os.path.realpath(file)

    def reader(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not args and not kwargs and os.path.realpath(path) == key:
            return shared
        return made(path, *args, **kwargs)

    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    parse = getattr(hf_gguf, "_gguf_parse_value", None)  # private: kept only where this version has it
    # the shared reader's value arrays live as long as it does: their ids name them
    ours = {id(part) for field in shared.fields.values() for part in field.parts} if parse is not None else set()
    parsed: dict[int, Any] = {}

    def parse_once(value, types):  # type: ignore[no-untyped-def]
        key = id(value)
        if key not in ours:
            return parse(value, types)
        if key not in parsed:
            parsed[key] = parse(value, types)
        return parsed[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    if parse is not None:
        hf_gguf._gguf_parse_value = parse_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = made, name_map
        if parse is not None:
            hf_gguf._gguf_parse_value = parse


def _fill_config(config, file: Path) -> None:  # type: ignore[no-untyped-def]
    """What transformers' GGUF reading leaves at its defaults for some architectures, from the
    file's own hyperparameters (Qwen3's head width: the default, 128, fits only some sizes;
    Qwen-MoE's expert widths)."""
    import gguf

    fields = gguf.GGUFReader(file).fields  # (the shared reader: `_one_reader`)
    arch = fields["general.architecture"].contents()
    for key, attribute in FILLED_FIELDS.items():
        field = fields.get(f"{arch}.{key}")
        if field is not None and hasattr(config, attribute):
            setattr(config, attribute, int(field.contents()))
