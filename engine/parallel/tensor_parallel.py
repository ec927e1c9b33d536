"""Tensor parallelism, Megatron's way: one model over `world` processes, each holding its
share of every layer, two all-reduces a layer.

    q, k, v       column-parallel by head: rank r holds query heads [r h/w, (r+1) h/w) and
                  the KV heads they read (KV heads replicated where w > KV heads)
    o             row-parallel: the columns of its query heads; outputs summed (all-reduce)
    gate, up      column-parallel: rows [r I/w, (r+1) I/w) of each
    down          row-parallel: those columns; outputs summed (all-reduce)
    embedding     vocabulary-parallel: rank r holds rows [r V'/w, (r+1) V'/w) (V' the
                  vocabulary padded to a multiple of w); a token another rank holds reads
                  zeros here, and the all-reduce sums the one rank's row in
    LM head       vocabulary-parallel: each rank's logits over its rows, all-gathered
    norms         replicated

Each rank's model is the same code as one device's (engine/model/decoder.py) with a config of its
local heads (`local_config`), so the attention, the KV pool (its local KV heads) and every
kernel are unchanged; `TensorParallel` adds the collectives (torch.distributed: gloo on
CPU, NCCL on GPUs), and `shard` picks a checkpoint tensor's share by its name. A mixture of
experts splits each expert (and a shared one) as a dense MLP splits, along its own
intermediate size: the router is whole on every rank, so every rank routes each token to the
same experts, and the block's output is summed as the MLP's is.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.model_config import ModelConfig
from engine.types import UnsupportedModelError

_Q, _KV = re.compile(r"\.q_proj\.(weight|bias)$"), re.compile(r"\.[kv]_proj\.(weight|bias)$")
_COLUMN = re.compile(r"\.(gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_ROW_BIAS = re.compile(r"\.(o_proj|down_proj)\.bias$")
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")
_EXPERT = re.compile(r"\.experts\.\d+\.(\w+)\.weight$")
_STACKED_GATE_UP, _STACKED_DOWN = re.compile(r"\.experts\.gate_up_proj$"), re.compile(r"\.experts\.down_proj$")
_SHARED = re.compile(r"\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_QKV, _FUSED_GATE_UP = re.compile(r"\.qkv_proj\.(weight|bias)$"), re.compile(r"\.gate_up_proj\.(weight|bias)$")


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int
    group: Any = None
    """The torch.distributed process group of the worker's ranks (None: the default group)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"tensor-parallel rank {self.rank} outside a world of {self.world}")

    # -- what each rank holds ----------------------------------------------------------------
    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as one rank runs it: its query and KV heads (the rest unchanged); refuses
        a model whose shapes do not split `world` ways, naming the shape."""
        w, h, kvh = self.world, config.num_heads, config.num_kv_heads
        moe = config.moe
        if moe is not None and (moe.intermediate_size % w or moe.shared_intermediate_size % w):
            raise UnsupportedModelError(f"experts of intermediate size {moe.intermediate_size} (shared "
                                        f"{moe.shared_intermediate_size}) do not split across {w} ranks")
        if h % w:
            raise UnsupportedModelError(f"{h} attention heads do not split across {w} tensor-parallel ranks")
        if kvh % w and (w % kvh or (h // kvh) % (h // w)):
            raise UnsupportedModelError(f"{kvh} KV heads do not split across (or replicate over) {w} ranks")
        if config.intermediate_size % w:
            raise UnsupportedModelError(f"an intermediate size of {config.intermediate_size} does not split "
                                        f"across {w} ranks")
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // w,
                                      shared_intermediate_size=moe.shared_intermediate_size // w)
        return dataclasses.replace(config, num_heads=h // w, num_kv_heads=max(kvh // w, 1), moe=moe)

    def q_heads(self, config: ModelConfig) -> range:
        n = config.num_heads // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, config: ModelConfig) -> range:
        """The KV heads this rank's query heads read: its share, or the one head its query
        heads' group shares when ranks outnumber KV heads (replicated)."""
        kvh = config.num_kv_heads
        if kvh >= self.world:
            n = kvh // self.world
            return range(self.rank * n, (self.rank + 1) * n)
        group = config.num_heads // kvh
        first = self.q_heads(config).start // group
        return range(first, first + 1)

    def kv_shards(self, config: ModelConfig) -> tuple[int, ...]:
        """The first KV head of each rank's pool, in rank order (kvfabric's `FabricLayout.shards`)."""
        return tuple(TensorParallel(r, self.world).kv_heads(config).start for r in range(self.world))

    def vocab_rows(self, vocab_size: int) -> range:
        """This rank's rows of the embedding and the LM head (the vocabulary padded to a
        multiple of the world)."""
        n = -(-vocab_size // self.world)
        return range(self.rank * n, min((self.rank + 1) * n, vocab_size))

    # -- a checkpoint tensor's share -----------------------------------------------------------
    def shard(self, name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's share of the checkpoint tensor `name` (the full model's `config`)."""
        d, inter = config.head_dim, config.intermediate_size
        if config.moe is not None and (part := self._expert_share(name, t, config)) is not None:
            return part
        if _Q.search(name):
            return _heads(t, self.q_heads(config), d)
        if _KV.search(name):
            return _heads(t, self.kv_heads(config), d)
        if _FUSED_QKV.search(name):  # Phi-3: [q; k; v] rows
            h, kvh = config.num_heads * d, config.num_kv_heads * d
            q, k, v = t[:h], t[h:h + kvh], t[h + kvh:]
            return torch.cat([_heads(q, self.q_heads(config), d), _heads(k, self.kv_heads(config), d),
                              _heads(v, self.kv_heads(config), d)])
        if _COLUMN.search(name):
            return _slice(t, 0, self.rank, inter // self.world)
        if _FUSED_GATE_UP.search(name):  # Phi-3: [gate; up] rows
            n = inter // self.world
            return torch.cat([_slice(t[:inter], 0, self.rank, n), _slice(t[inter:], 0, self.rank, n)])
        if _ROW.search(name):
            if ".o_proj." in name:
                heads = self.q_heads(config)
                return t[:, heads.start * d:heads.stop * d].contiguous()
            return _slice(t, 1, self.rank, inter // self.world)
        if _ROW_BIAS.search(name):  # added once, after the sum: rank 0 holds it
            return t if self.rank == 0 else torch.zeros_like(t)
        if _VOCAB.search(name):
            rows = self.vocab_rows(config.vocab_size)
            out = t[rows.start:rows.stop]
            pad = -(-config.vocab_size // self.world) - len(rows)
            return torch.cat([out, out.new_zeros(pad, *out.shape[1:])]) if pad else out.contiguous()
        return t  # norms: every rank holds them

    def _expert_share(self, name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor | None:
        """A mixture's tensors: each expert (and the shared one) split as a dense MLP is, along
        its own intermediate size; the router and the shared expert's gate whole."""
        moe = config.moe
        assert moe is not None
        _, gate, up, down = moe.checkpoint_names
        if m := _EXPERT.search(name):
            n = moe.intermediate_size // self.world
            if m[1] in (gate, up):
                return _slice(t, 0, self.rank, n)
            return _slice(t, 1, self.rank, n) if m[1] == down else None
        if _STACKED_GATE_UP.search(name):  # [experts, 2 I, hidden]: gate rows, then up rows
            i, n = moe.intermediate_size, moe.intermediate_size // self.world
            return torch.cat([_slice(t[:, :i], 1, self.rank, n), _slice(t[:, i:], 1, self.rank, n)], dim=1)
        if _STACKED_DOWN.search(name):  # [experts, hidden, I]
            return _slice(t, 2, self.rank, moe.intermediate_size // self.world)
        if m := _SHARED.search(name):
            n = moe.shared_intermediate_size // self.world
            return _slice(t, 1 if m[1] == "down_proj" else 0, self.rank, n)
        return None

    # -- the collectives ---------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, table: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rows of the vocabulary-parallel embedding: each rank its own, summed."""
        rows = self.vocab_rows(vocab_size)
        local = ids - rows.start
        mine = (local >= 0) & (local < len(rows))
        h = table[torch.where(mine, local, torch.zeros_like(local))]
        h[~mine] = 0
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, V'/w] from each rank -> [n, vocab_size]."""
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def _heads(t: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    return t[heads.start * head_dim:heads.stop * head_dim].contiguous()


def _slice(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    return t.narrow(dim, rank * n, n).contiguous()
