"""Rope tables (engine/model/rope.py) against transformers' own frequency functions
(modeling_rope_utils), type by type: each position's angles are those transformers gives a
sequence ending at that position, and the attention factor is its."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model.model_config import ModelConfig
from engine.model.rope import RotaryTable, position_frequencies
from engine.model.tiny_model import model_config

SCALINGS = [
    dict(rope_type="linear", factor=2.0),
    dict(rope_type="dynamic", factor=4.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=16, mscale=1.0,
         mscale_all_dim=0.7),
    dict(rope_type="longrope", original_max_position_embeddings=64,
         short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)]),
    dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"] + ("-mscale" if "mscale" in s else ""))
def test_each_position_is_rotated_as_transformers_rotates_a_sequence_ending_there(scaling: dict) -> None:
    raw = dict(model_config("llama", "tiny"), rope_scaling=dict(scaling), rope_theta=10000.0,
               max_position_embeddings=64 if scaling["rope_type"] in ("linear", "dynamic") else 256)
    ours = ModelConfig.from_dict(raw)
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    table = position_frequencies(ours.rope, ours.head_dim, ours.max_position_embeddings)
    init = ROPE_INIT_FUNCTIONS[scaling["rope_type"]]
    for p in (0, 5, 63, 64, 65, 100, ours.max_position_embeddings - 1):
        seq_len = torch.tensor(p + 1) if scaling["rope_type"] == "dynamic" else p + 1  # as its forward passes it
        inv_freq, attention = init(hf, "cpu", seq_len=seq_len)
        # bit for bit, but dynamic's base, which transformers raises to each exponent as a scalar: 2 ulp
        rtol = 2.4e-7 if scaling["rope_type"] == "dynamic" else 0.0
        torch.testing.assert_close(table[p], p * inv_freq, rtol=rtol, atol=0.0)
        assert ours.rope.attention_factor == pytest.approx(attention, rel=1e-12)
    cos = RotaryTable(ours.rope, ours.head_dim, ours.max_position_embeddings, "cpu").cos
    assert cos[0, 0].item() == pytest.approx(ours.rope.attention_factor)  # cos 0, scaled
