"""Which share of each tensor a tensor-parallel rank holds, and which splits are refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.model_config import ModelConfig
from engine.parallel.tensor_parallel import TensorParallel
from engine.types import UnsupportedModelError


def config(tiny_llama_dir: str, **changes: object) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_dir(tiny_llama_dir), **changes)


def test_heads_split_or_replicate_and_the_vocabulary_pads(tiny_llama_dir: str) -> None:
    c = config(tiny_llama_dir, num_heads=8, num_kv_heads=2, vocab_size=10)
    assert [TensorParallel(r, 2).kv_heads(c) for r in range(2)] == [range(0, 1), range(1, 2)]
    # 4 ranks, 2 KV heads: each rank's 2 query heads read one KV head, held by 2 ranks
    assert [TensorParallel(r, 4).q_heads(c) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [TensorParallel(r, 4).kv_heads(c) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [TensorParallel(r, 4).vocab_rows(10) for r in range(4)] == [range(0, 3), range(3, 6), range(6, 9),
                                                                       range(9, 10)]
    table = torch.arange(10.0)[:, None].repeat(1, 2)
    last = TensorParallel(3, 4).shard("model.embed_tokens.weight", table, c)
    assert last[:, 0].tolist() == [9.0, 0.0, 0.0]  # padded to the shard's 3 rows
    assert TensorParallel(3, 4).local_config(c).num_kv_heads == 1


def test_projections_take_their_rows_or_columns(tiny_llama_dir: str) -> None:
    c = config(tiny_llama_dir, num_heads=4, num_kv_heads=2, head_dim=2, intermediate_size=6, hidden_size=8)
    tp = TensorParallel(1, 2)
    q = torch.arange(8.0)[:, None]  # 4 heads x head_dim 2 rows
    assert tp.shard("model.layers.0.self_attn.q_proj.weight", q, c)[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    kv = torch.arange(4.0)[:, None]
    assert tp.shard("model.layers.0.self_attn.v_proj.bias", kv, c)[:, 0].tolist() == [2.0, 3.0]
    o = torch.arange(8.0)[None, :]
    assert tp.shard("model.layers.0.self_attn.o_proj.weight", o, c)[0].tolist() == [4.0, 5.0, 6.0, 7.0]
    gate_up = torch.arange(12.0)[:, None]  # Phi-3's fused [gate; up], 6 rows each
    assert tp.shard("model.layers.0.mlp.gate_up_proj.weight", gate_up, c)[:, 0].tolist() == [3, 4, 5, 9, 10, 11]
    down = torch.arange(6.0)[None, :]
    assert tp.shard("model.layers.0.mlp.down_proj.weight", down, c)[0].tolist() == [3.0, 4.0, 5.0]
    assert tp.shard("model.layers.0.mlp.down_proj.bias", torch.ones(8), c).sum() == 0  # rank 0 adds it
    norm = torch.ones(8)
    assert tp.shard("model.layers.0.input_layernorm.weight", norm, c) is norm


@pytest.mark.parametrize("changes,world,message", [
    ({"num_heads": 6}, 4, "6 attention heads do not split across 4"),
    ({"num_heads": 8, "num_kv_heads": 3}, 2, "3 KV heads do not split"),
    ({"intermediate_size": 130}, 4, "intermediate size of 130 does not split across 4"),
])
def test_shapes_that_do_not_split_are_refused_by_name(tiny_llama_dir: str, changes: dict, world: int,
                                                      message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        TensorParallel(0, world).local_config(config(tiny_llama_dir, **changes))


def test_experts_split_along_their_own_intermediate_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine.model.tiny_model import make_tiny_model

    moe = ModelConfig.from_dir(make_tiny_model(tmp_path, "qwen2_moe"))  # experts of 64, a shared one of 128
    assert moe.moe is not None and (moe.moe.intermediate_size, moe.moe.shared_intermediate_size) == (64, 128)
    local = TensorParallel(1, 2).local_config(moe)
    assert local.moe is not None and (local.moe.intermediate_size, local.moe.shared_intermediate_size) == (32, 64)
    tp = TensorParallel(1, 2)
    expert = torch.arange(64.0)[:, None].repeat(1, 4)  # [I, hidden]
    assert tp.shard("model.layers.1.mlp.experts.3.up_proj.weight", expert, moe)[:, 0].tolist() == list(range(32, 64))
    stacked = torch.arange(128.0)[None, :, None].repeat(2, 1, 3)  # [experts, 2 I, hidden]
    got = tp.shard("model.layers.1.mlp.experts.gate_up_proj", stacked, moe)
    assert got.shape == (2, 64, 3) and got[0, :, 0].tolist() == [*range(32, 64), *range(96, 128)]
    shared_down = torch.arange(128.0)[None, :]
    assert tp.shard("model.layers.1.mlp.shared_expert.down_proj.weight", shared_down, moe)[0, 0] == 64
    router = torch.ones(4, 8)
    assert tp.shard("model.layers.1.mlp.gate.weight", router, moe) is router  # every rank routes alike
    with pytest.raises(UnsupportedModelError, match="experts of intermediate size 64 \\(shared 128\\) do not split "
                                                    "across 3"):
        TensorParallel(0, 3).local_config(dataclasses.replace(moe, num_heads=6, num_kv_heads=3,
                                                              intermediate_size=129))
