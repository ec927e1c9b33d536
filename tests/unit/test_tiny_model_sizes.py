"""The test checkpoints' sizes: llama3-8b has Llama-3.1-8B's shapes (checked from its config,
without writing 16 GB), and a checkpoint over the shard limit is written in shards with an
index that loads to the same tensors as one file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.model import tiny_model
from engine.checkpoints.weights import CheckpointReader


def num_parameters(cfg: dict) -> int:
    h, inter, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = 2 * h + 2 * h * h + 2 * h * kv + 3 * h * inter
    return v * h * (1 if cfg["tie_word_embeddings"] else 2) + h + layers * per_layer


def test_llama3_8b_has_the_real_shapes_and_is_written_in_bfloat16() -> None:
    cfg = tiny_model.model_config("llama", "llama3-8b")
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (4096, 14336, 32, 32, 8, 128256)
    assert num_parameters(cfg) == 8_030_261_248  # Llama-3.1-8B's count
    assert cfg["torch_dtype"] == "bfloat16" and cfg["rope_scaling"]["original_max_position_embeddings"] == 8192
    assert tiny_model.model_config("llama", "tiny")["torch_dtype"] == "float32"


def test_the_cli_offers_every_size() -> None:
    import argparse

    from cluster.make_model import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    [action] = [a for a in parser._subparsers._group_actions[0].choices["make-tiny-model"]._actions  # type: ignore[union-attr]
                if a.dest == "size"]
    assert tuple(action.choices) == tuple(tiny_model.SIZES)


def test_a_checkpoint_over_the_shard_limit_is_sharded_and_loads_the_same(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    one = tiny_model.make_tiny_model(tmp_path / "one", size="tiny", seed=5)
    monkeypatch.setattr(tiny_model, "SHARD_BYTES", 200_000)  # the tiny llama is about 0.5 MB
    sharded = tiny_model.make_tiny_model(tmp_path / "sharded", size="tiny", seed=5)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 2 and not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    a, b = CheckpointReader(one), CheckpointReader(sharded)
    assert sorted(a.names()) == sorted(b.names()) == sorted(index["weight_map"])
    for name in a.names():
        assert torch.equal(a.get(name, torch.float32, "cpu"), b.get(name, torch.float32, "cpu")), name
    assert (one / "config.json").read_text() == (sharded / "config.json").read_text()
