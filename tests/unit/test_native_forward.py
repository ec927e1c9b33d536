"""decode_layers (engine/kernels/csrc/forward.c): a bfloat16 decode batch through all layers in one
native call gives the same logits, bit for bit, as the model's layer loop over the same
kernels, and writes the same K and V into the pool. Needs AVX-512 BF16 (the native matmul)."""
from __future__ import annotations

import pytest
import torch

from engine.model.attention import PagedGroup
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.model.tiny_model import make_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engine(request, kernels, tmp_path_factory) -> LLMEngine:
    if not kernels.has_linear:
        pytest.skip("this CPU has no AVX-512 BF16: decode_layers is not used here")
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny", seed=3)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="bfloat16", cache=CacheConfig(num_blocks=64)))


def test_a_decode_batch_gives_the_layer_loops_logits_and_kv_bit_for_bit(engine: LLMEngine) -> None:
    model = engine.model
    assert model.native_layers is not None
    for i, n in enumerate([5, 16, 17, 40, 3]):  # contexts inside, at and across block boundaries
        engine.add_request([7 + (13 * i + j) % 200 for j in range(n)], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):  # prefill, then decodes
        engine.step()
    batch = engine.runner.prepare(engine.scheduler.schedule())
    [group] = batch.meta.groups
    assert isinstance(group, PagedGroup) and group.in_order and group.batch == 5

    run = lambda: model.forward(batch.input_ids, batch.positions, engine.kv_pool, batch.meta,  # noqa: E731
                                batch.logits_index)
    fused = run()
    kv = engine.kv_pool.tensor.clone()
    engine.kv_pool.tensor[batch.meta.slot_blocks, :, :, batch.meta.slot_offsets] = 0  # the loop writes them again
    native_layers, model.native_layers = model.native_layers, None
    try:
        loop = run()
    finally:
        model.native_layers = native_layers
    assert torch.equal(fused, loop)
    assert torch.equal(engine.kv_pool.tensor, kv)


def test_an_out_of_range_slot_is_refused_before_anything_is_written(engine: LLMEngine) -> None:
    model = engine.model
    h = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)
    cos, sin = model.rotary.lookup(torch.tensor([0]), torch.bfloat16)
    pool = engine.kv_pool.tensor
    before = pool.clone()
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="decode_layers"):
        model.kernels.decode_layers(
            model.native_layers, h, cos, sin, pool, torch.tensor([pool.shape[0]]), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), one,
            (model.config.num_heads, model.config.num_kv_heads, model.layers[0].gate_up.out_features // 2),
            model.config.rms_norm_eps, model.scale, None)
    assert torch.equal(pool, before)
