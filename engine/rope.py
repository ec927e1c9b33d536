"""Rotary position embeddings: inverse frequencies (default, llama3) and a cos/sin table."""
from __future__ import annotations

import math

import torch

from engine.model_config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32, matching Hugging Face's computation bit for bit."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to max_positions, looked up per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: str) -> None:
        inv_freq = inv_frequencies(rope, head_dim).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos()
        sin = emb.sin()
        self.signed_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)
        self._tables = {torch.float32: (self.cos, self.signed_sin)}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] cos and signed sin (first half negated), broadcast over heads."""
        tables = self._tables.get(dtype)
        if tables is None:  # rounded once, not per step (the same values: rounding commutes with indexing)
            tables = self._tables[dtype] = (self.cos.to(dtype), self.signed_sin.to(dtype))
        cos, signed_sin = tables
        return cos[positions, None], signed_sin[positions, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim], any strides.

    Hugging Face's x * cos + cat(-x2, x1) * sin, bit for bit: the sign rides on the
    table, so the halves are swapped without a negation pass.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin
