"""DraftProposer: a smaller checkpoint with the target's tokenizer proposes k tokens greedily.

    Speculator.propose --propose([(request, k)])--> for each request a shadow Request over the
        draft's own paged KV (its own pool, block pool and runner, on the target's device):
        its "prompt" is the request's tokens so far; the KV it already holds is kept up to the
        first token that differs from them (what the target rejected is rolled back), then
        forward 1: every request's missing tokens (a new request's whole prompt, else its
            last token or the proposals accepted since), batched; greedy token = proposal 1
        forwards 2..k: the batch of requests still proposing, one token each
    --forget(live ids)--> the shadows of requests that left free their blocks

Proposals are greedy (a point mass for `verify`), so sampled requests stay exact. The draft's
pool has as many blocks as the target's: a shadow never needs more than its request's
tokens plus k. No prefix caching: a shadow lives as long as its request.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from engine.core.block_pool import BlockPool
from engine.checkpoints.gguf_checkpoint import resolve_model_dir
from engine.core.hashing import BlockHasher
from engine.core.kv_cache_manager import KVCacheManager
from engine.model.kv_pool import KVLayout, KVPool
from engine.model.decoder import LlamaForCausalLM
from engine.model.model_config import ModelConfig
from engine.model.model_runner import ModelRunner
from engine.kernels.native import NativeKernels
from engine.core.request import Request, RequestStatus
from engine.model.sampler import greedy
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.types import EngineError, RequestId


class DraftProposer:
    def __init__(self, model_dir: str | Path, target: ModelConfig, dtype: torch.dtype, device: str,
                 block_size: int, num_blocks: int, kernels: NativeKernels | None = None) -> None:
        resolved = resolve_model_dir(str(model_dir))
        config = ModelConfig.from_dir(resolved)
        if config.vocab_size != target.vocab_size:
            raise EngineError(f"draft model {model_dir} has a vocabulary of {config.vocab_size} tokens, the target "
                              f"{target.vocab_size}: a draft needs the target's tokenizer")
        self.model = LlamaForCausalLM.load(str(resolved), config, dtype, device, True, kernels)
        layout = KVLayout(config.num_layers, block_size, config.num_kv_heads, config.head_dim, dtype)
        self.pool = KVPool(layout, num_blocks, device)
        self.kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), BlockHasher(b"draft", "draft", block_size))
        self.runner = ModelRunner(self.model, self.pool, device)
        self.shadows: dict[RequestId, Request] = {}

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[RequestId, list[int]]:
        batch = [(self._sync(r), k) for r, k in wanted]
        batch = [(s, k) for s, k in batch if s is not None]
        out: dict[RequestId, list[int]] = {s.request_id: [] for s, _ in batch}
        want = {s.request_id: k for s, k in batch}
        step = [ScheduledRequest(s, s.num_tokens - s.num_computed_tokens) for s, _ in batch]
        while step:
            tokens = self._forward(step)
            for s, token in zip(step, tokens, strict=True):
                s.request.num_computed_tokens += s.num_new_tokens
                s.request.output_token_ids.append(token)
                out[s.request.request_id].append(token)
            step = [ScheduledRequest(s.request, 1) for s in step
                    if len(out[s.request.request_id]) < want[s.request.request_id]
                    and self.kv.allocate_slots(s.request, 1)]
        return {rid: tokens for rid, tokens in out.items() if tokens}

    def forget(self, live: set[RequestId]) -> None:
        for rid in [rid for rid in self.shadows if rid not in live]:
            self.kv.free(self.shadows.pop(rid))

    def _sync(self, request: Request) -> Request | None:
        """The request's shadow, its tokens the request's, its KV kept where they agree and
        room made for the missing ones; None if the draft's pool has no room."""
        tokens = request.all_token_ids
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = self.shadows[request.request_id] = Request(request.request_id, tokens, request.params, 0.0)
            shadow.status = RequestStatus.RUNNING
        else:
            known = shadow.all_token_ids
            same = next((i for i, (a, b) in enumerate(zip(known, tokens)) if a != b), min(len(known), len(tokens)))
            shadow.prompt_token_ids, shadow.output_token_ids = tokens, []
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, len(tokens) - 1)
            self.kv.roll_back(shadow)
        if not self.kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens):
            self.kv.free(self.shadows.pop(request.request_id))
            return None
        return shadow

    def _forward(self, step: list[ScheduledRequest]) -> list[int]:
        out = SchedulerOutput(step)
        requests, logits = self.runner.execute(out)
        assert [r.request_id for r in requests] == [s.request.request_id for s in step]
        return greedy(logits).tolist()
