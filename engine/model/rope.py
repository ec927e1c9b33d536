"""Rotary position embeddings: inverse frequencies and a cos/sin table for every position.

Types as transformers defines them (modeling_rope_utils): default, linear (frequencies over
the factor), llama3 (a smooth per-wavelength blend), yarn (interpolated and extrapolated
frequencies ramped between two rotation counts, cos and sin scaled by an attention factor),
dynamic (NTK: the base grows with the sequence past the pretraining length) and longrope
(per-frequency divisors, short within the pretraining length, long past it, and an
attention factor).

transformers picks dynamic's base and longrope's divisors by the length of the sequence a
forward pass ends at, so a prompt prefilled at once has every token rotated for its full
length, and each token decoded after it for its own. A paged engine keeps K as it was
rotated and prefills in chunks of any length, so here each position is rotated as
transformers rotates a sequence ending there (length position + 1): the same as
transformers for every position within the pretraining length and for every token decoded
one at a time past it, and, unlike vLLM (which takes one choice per batch), the same
rotation for a token whatever batch or chunk it lands in. A prompt longer than the
pretraining length differs from transformers' prefill of it at once (its earlier tokens).
"""
from __future__ import annotations

import math

import torch

from engine.model.model_config import RopeConfig


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 for a sequence within the pretraining length, matching
    Hugging Face's computation bit for bit."""
    if rope.rope_type == "longrope":
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta**_exponents(head_dim))
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    inv_freq = 1.0 / (rope.theta**_exponents(head_dim))
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    elif rope.rope_type == "linear":
        inv_freq /= rope.factor
    return inv_freq


def position_frequencies(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim // 2] float32: the angle of each position at each frequency."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_frequencies(rope, head_dim)[None, :]
    if rope.rope_type == "dynamic":
        start = rope.base_max_position_embeddings
        if max_positions > start:
            seq = torch.arange(start, max_positions) + 1  # the length a sequence ends at (float32 math, as transformers')
            base = rope.theta * ((rope.factor * seq / start) - (rope.factor - 1)) ** (head_dim / (head_dim - 2))
            inv = 1.0 / (base[:, None] ** _exponents(head_dim)[None, :])
            freqs[start:] = positions[start:, None] * inv
    elif rope.rope_type == "longrope":
        start = rope.original_max_position_embeddings  # a sequence of start + 1 tokens is long
        if max_positions > start:
            inv = 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32) * rope.theta**_exponents(head_dim))
            freqs[start:] = positions[start:, None] * inv[None, :]
    return freqs


def _yarn(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolated = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


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
        freqs = position_frequencies(rope, head_dim, max_positions).to(device)  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos() * rope.attention_factor
        sin = emb.sin() * rope.attention_factor
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
