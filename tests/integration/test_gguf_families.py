"""GGUF files of the families llama.cpp writes beside Llama (Qwen3, Qwen3-MoE, Qwen2-MoE),
written from tiny checkpoints with the `gguf` package's writer as llama.cpp lays them out,
then loaded as `serve --model FILE.gguf` loads them: the converted model's greedy tokens
equal transformers' on the checkpoint the file was written from (float32 tensors), and on
the dequantized weights (Q8_0). (Gemma 3's real GGUF: test_real_gemma3.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from engine.model import tiny_model
from engine.checkpoints.gguf_checkpoint import resolve_model_dir
from engine.model.model_config import ModelConfig
from engine.core.request import SamplingParams
from tests.gguf_writer import write_gguf
from tests.integration.reference import hf_greedy, make_engine, random_prompts

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _greedy_equal(converted: Path, reference: str | Path) -> None:
    engine = make_engine(str(converted), block_size=4, num_blocks=256, budget=16)  # prompts in chunks
    prompts = random_prompts([5, 23, 11], ModelConfig.from_dir(converted).vocab_size)
    got = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, c in zip(prompts, got, strict=True):
        assert c.token_ids == hf_greedy(str(reference), tuple(prompt), 10), f"prompt of {len(prompt)} tokens"
    assert engine.check_invariants().num_in_use == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_gguf_loads_with_the_architectures_own_shapes_and_equals_its_checkpoint(cache: Path, arch: str) -> None:
    """Qwen3's heads are wider than hidden / heads, and a mixture's experts narrower than its
    dense width: both come from the file's own hyperparameters (transformers' GGUF reading
    leaves them at its defaults)."""
    source = tiny_model.make_tiny_model(cache / arch, arch)
    converted = resolve_model_dir(write_gguf(source, cache / f"{arch}.gguf"))
    mc, want = ModelConfig.from_dir(converted), ModelConfig.from_dir(source)
    assert mc.architecture == want.architecture and mc.head_dim == want.head_dim == 32
    assert mc.moe == want.moe
    _greedy_equal(converted, source)


def test_a_quantized_qwen3_gguf_equals_transformers_on_its_dequantized_weights(cache: Path) -> None:
    source = tiny_model.make_tiny_model(cache / "qwen3", "qwen3")
    file = write_gguf(source, cache / "qwen3-q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    assert {t.tensor_type.name for t in gguf.GGUFReader(file).tensors} == {"F32", "Q8_0"}  # the norms stay F32
    converted = resolve_model_dir(file)
    _greedy_equal(converted, converted)


def test_a_qwen2_moe_gguf_with_its_shared_expert_equals_its_checkpoint(cache: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer a mixture (a GGUF names no dense layers among them), beside a shared expert
    behind its sigmoid gate."""
    arch_fields = tiny_model._arch_fields
    monkeypatch.setattr(tiny_model, "_arch_fields",
                        lambda arch, size, cfg: dict(arch_fields(arch, size, cfg), mlp_only_layers=[]))
    source = tiny_model.make_tiny_model(cache / "qwen2_moe", "qwen2_moe")
    assert json.loads((source / "config.json").read_text())["mlp_only_layers"] == []
    converted = resolve_model_dir(write_gguf(source, cache / "qwen2_moe.gguf"))
    assert ModelConfig.from_dir(converted).moe == ModelConfig.from_dir(source).moe
    _greedy_equal(converted, source)
