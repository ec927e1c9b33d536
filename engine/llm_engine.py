"""LLMEngine: add_request / abort / step; KV that moves in or out goes through its connector.

One step reads top-down: propose (speculative decoding, engine/spec/speculator.py) -> schedule
-> run the model (engine/model/model_runner.py, which owns the device buffers) -> sample (and
verify proposals) -> update requests -> the role's turn -> outputs (engine/core/output_builder.py).
The parts beside the core: the role (engine/core/roles.py: role `prefill` finishes a request at
its first token and hands its blocks to the caller's `KVHandoff`; they stay held in the KV
cache manager until the connector's `give_back`), the connector (engine/kv_connector.py: the
one seam through which the P/D hand-off and the KV tier borrow blocks, reserve them for KV
computed elsewhere and hear what landed or failed), and the pool's size from a profiled
forward on GPUs (engine/model/kv_profile.py).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from tokenizers import Tokenizer

from engine.model.decode_graphs import Graph, capture_graphs, decode_buffers
from engine.kernels.gpu_kernels import Kernels, select_kernels
from engine.core.block_pool import BlockPool, KVEvent, PoolUsage
from engine.config import EngineConfig
from engine.structured.constrainer import Constrainer
from engine.model.device_memory import CudaMemory, DeviceMemory
from engine.spec.draft_proposer import DraftProposer
from engine.core.hashing import BlockHasher
from engine.checkpoints.gguf_checkpoint import resolve_model_dir
from engine.core.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector
from engine.model.kv_pool import KVAllocator, KVLayout, KVPool, kv_dtype
from engine.model.kv_profile import profiled_pool_bytes
from engine.model.kv_sizing import DEFAULT_CPU_KV_BYTES, num_blocks_for
from engine.model.decoder import DTYPES, LlamaForCausalLM
from engine.model.model_config import ModelConfig
from engine.checkpoints.quant_config import kv_model_id
from engine.model.model_runner import ModelRunner
from engine.parallel.tp_followers import Channel, CopyOp, PoolOp, StopOp
from engine.core.output_builder import OutputBuilder
from engine.core.forks import Forks, check_id, first_rows
from engine.core.request import MAX_CHOICES, FinishReason, Logprob, Request, SamplingParams
from engine.core.roles import Role, role_for
from engine.model.sampler import Sampler
from engine.model.overlap import Overlap
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.spec.spec_verify import Verified
from engine.spec.speculator import Speculator
from engine.core.step_model import PrefillCost, StepModel
from engine.structured.grammars import Grammars
from engine.core.outputs import Completion, KVHandoff, RequestOutput
from engine.types import EngineLoad, InvalidRequestError, RequestId, choice_id

logger = logging.getLogger(__name__)



class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        handoff: KVHandoff | None = None,
        allocator: KVAllocator | None = None,
        memory: DeviceMemory | None = None,
        graphs: Callable[[], Graph] | None = None,
    ) -> None:
        """`memory`: how the device answers for its memory (engine/model/device_memory.py): on a GPU
        `CudaMemory` unless given; given on CPU (a test's `StatedMemory`), the pool is sized by
        the same profile as on a GPU. `graphs`: what each decode bucket is captured into
        (engine/model/decode_graphs.py); None: CUDA graphs on GPUs with the Triton kernels, none on CPU
        (a test's `EagerGraph` runs the bucketed path there)."""
        self.config = config
        self.clock = clock
        self.role: Role = role_for(config.role, handoff)
        model_dir = resolve_model_dir(config.model_dir)  # a GGUF file: its converted directory
        self.model_config = ModelConfig.from_dir(model_dir, config.quantization)
        mc = self.model_config
        dtype = DTYPES[config.dtype]
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        cuda = config.device.startswith("cuda")
        self.memory = memory if memory is not None else CudaMemory(config.device) if cuda else None
        free, total = self.memory.free_and_total() if self.memory else (0, None)
        self._memory_at_start = (free, self.memory.reserved() if self.memory else 0)
        """The device's free memory and torch's reserved memory before this engine took any
        (KV sizing counts what it took since)."""
        self.config = config = replace(config, scheduler=config.scheduler.resolved(total))  # the step budget
        kernels = select_kernels(config.device, config.native_kernels)
        self.model = LlamaForCausalLM.load(model_dir, mc, dtype, config.device, config.prepack_weights, kernels,
                                           config.tensor_parallel)
        self.model_id = kv_model_id(config.model_id or model_dir.resolve().name, mc.fp8, config.cache.kv_cache_dtype)
        """The name the model and its KV are known by (block hashes, kvfabric, the routers):
        the configured one or the directory's, marked "+fp8" when quantized at load (that KV
        is not the checkpoint's) and "+kv-fp8" when its KV is FP8."""
        self.hasher = BlockHasher(config.cache.cluster_secret, self.model_id, config.cache.block_size)
        local = self.model.config  # its heads on this rank (all of them without tensor parallelism)
        self.layout = KVLayout(mc.num_layers, config.cache.block_size, local.num_kv_heads, mc.head_dim,
                               kv_dtype(config.cache.kv_cache_dtype, dtype))
        self.sampler = Sampler(config.seed, config.device)
        tok_path = model_dir / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.is_file() else None
        self._model_dir = model_dir
        self._constrainer: Constrainer | None = None
        self.speculator: Speculator | None = None
        """Proposes and verifies tokens ahead (None: off, or a prefill worker, which stops at the
        first). Set before any step runs: sizing the pool on a GPU runs one (`_profile_kv_bytes`)."""
        self.followers: Channel | None = None if config.tensor_parallel is None else Channel(config.tensor_parallel)
        """Rank 0 of a tensor-parallel model: the other ranks follow its steps (engine/parallel/tp_followers.py)."""
        tp = config.tensor_parallel
        self.kv_shards: tuple[int, ...] = tp.kv_shards(mc) if tp is not None else (0,)
        """The first of the model's KV heads in each rank's pool (rank 0's is `kv_pool`)."""
        self.follower_pools: list[dict[str, Any]] = []
        """The other ranks' pools as each exported them (their allocator's `export()`; {}: not exported)."""
        self._reset_state()
        self._attach_pool(self._pool_blocks(), allocator)
        self._reset_state()  # a profiled forward's requests and counts are not the worker's
        self.speculator = self._speculator(dtype, kernels)
        self.forks = Forks(self.scheduler, self.kv, self._copy_block, self._start, shadows=config.role == "prefill")
        """Requests of n choices forked into them (engine/core/forks.py)."""
        self.connector = KVConnector(self)
        """The seam for KV that moves in or out: the P/D hand-off and the KV tier (engine/kv_connector.py)."""
        capture_graphs(self.runner.decode, config.device, graphs)

    def release_followers(self) -> None:
        """A tensor-parallel leader's last word: the other ranks stop following (they return)."""
        if self.followers is not None:
            self.followers.send(StopOp())
            self.followers = None

    @property
    def constrainer(self) -> Constrainer:
        """Structured output (engine/structured/constrainer.py), built at the first constrained request."""
        if self._constrainer is None:
            mc = self.model_config
            self._constrainer = Constrainer(Grammars.for_model(self._model_dir, mc.vocab_size, mc.eos_token_ids))
        return self._constrainer

    def _speculator(self, dtype: torch.dtype, kernels: Kernels | None) -> Speculator | None:
        spec = self.config.speculative
        if not spec.enabled or self.config.role == "prefill":
            return None
        proposer = None
        if spec.method == "draft":
            assert spec.draft_model_dir is not None  # SpeculativeConfig checks it
            proposer = DraftProposer(spec.draft_model_dir, self.model_config, dtype, self.config.device,
                                     self.layout.block_size, self.kv_pool.num_blocks, kernels)
        return Speculator(spec, self.scheduler.context_limit, proposer)

    # -- the KV pool -----------------------------------------------------------------
    def _attach_pool(self, num_blocks: int, allocator: KVAllocator | None, provisional: bool = False) -> None:
        """The pool and everything that counts its blocks: block pool, cache manager, scheduler, runner.
        `provisional`: the profile's own small pool, of which no operator need hear."""
        config = self.config
        self.kv_pool = KVPool(self.layout, num_blocks, config.device, allocator, self.model.kv_scales)
        self.block_pool = BlockPool(num_blocks, config.cache.enable_prefix_caching, config.cache.protected_fraction)
        self.kv = KVCacheManager(self.block_pool, self.hasher, self.model_config.kv_window)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.clock)
        leads = self.followers
        decode = None if provisional or leads else decode_buffers(config, self.model, self.kv_pool, self.max_model_len)
        if leads is not None:
            leads.send(PoolOp(num_blocks, not provisional))
            if not provisional:
                self.follower_pools = leads.gather({})[1:]
        self.runner = ModelRunner(self.model, self.kv_pool, config.device, decode, leads.send if leads else None)
        self.overlap = Overlap(self.runner, self.sampler, self.scheduler, self.kv, not provisional and config.overlaps)
        if self.scheduler.context_limit < self.max_model_len and not provisional:
            logger.warning(
                "the KV pool (%d blocks of %d tokens) is smaller than the model's context (%d tokens): "
                "a sequence stops with finish reason length at %d tokens; raise --kv-cache-mib (kv_cache_bytes) for more",
                num_blocks, config.cache.block_size, self.max_model_len, self.scheduler.context_limit)

    def _pool_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks:
            return cache.num_blocks
        if cache.kv_cache_bytes is not None or self.memory is None:
            return num_blocks_for(cache.kv_cache_bytes or DEFAULT_CPU_KV_BYTES, self.layout.block_bytes)
        return num_blocks_for(self._profile_kv_bytes(), self.layout.block_bytes)

    def _profile_kv_bytes(self) -> int:
        """GPU: one forward at the largest step on a provisional pool (engine/model/kv_profile.py)."""
        assert self.memory is not None  # _pool_blocks profiles only with one
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len - 1)
        profile_blocks = -(-(num_tokens + 1) // self.layout.block_size) + 2  # and a window's null block

        def run() -> None:
            self._attach_pool(profile_blocks, None, provisional=True)
            self.generate([[0] * num_tokens], SamplingParams(max_tokens=1, ignore_eos=True))

        def drop() -> None:
            del self.kv_pool, self.runner, self.scheduler, self.kv, self.block_pool

        return profiled_pool_bytes(self.memory, self._memory_at_start, profile_blocks * self.layout.block_bytes,
                                   run, drop, self.config.cache.gpu_memory_utilization, num_tokens)

    def _reset_state(self) -> None:
        self.step_model = StepModel()
        """Decode step time against batch and KV read (heartbeats carry it to routers)."""
        self.prefill_cost = PrefillCost()
        """Seconds per prompt token computed (the KV tier's fetches are priced against it)."""
        self._decode_step: tuple[int, int, int, float] | None = None
        """The last step, when it was decodes (some verifying): (requests, rows, KV tokens, its start)."""
        self.outputs = OutputBuilder(self.tokenizer, self.config.detokenize)
        """Builds each step's outputs (detokenized, stop strings); counts prompt and cached tokens."""

    @property
    def handoff(self) -> KVHandoff | None:
        """Prefill role: who hears of computed blocks and finished prefills (kvfabric's pusher)."""
        return self.role.handoff

    @handoff.setter
    def handoff(self, handoff: KVHandoff | None) -> None:
        self.role.handoff = handoff

    @property
    def num_prompt_tokens(self) -> int:
        """Cumulative prompt tokens of requests that got their first token here."""
        return self.outputs.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Of those, the ones served from the prefix cache."""
        return self.outputs.num_cached_tokens

    # -- requests ------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> RequestId:
        request = self._new_request(prompt, params, request_id, priority, tenant, tenant_weight)
        self.scheduler.add_request(request)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Ends the request in any state and frees its blocks (also handed-off ones), except
        while a transfer borrowed them (the connector's `lend`, or its quarantine of a failed
        transfer): then they are held until the connector's `give_back`."""
        rid = RequestId(request_id)
        for i in range(1, MAX_CHOICES):  # its other choices, forked from it (engine/core/forks.py)
            if self.scheduler.abort(choice_id(rid, i)):
                self.outputs.forget(choice_id(rid, i))
        aborted = self.scheduler.abort(rid)
        released = self.kv.release(rid)  # held for a hand-off no transfer uses any more
        self.outputs.forget(rid)
        self.overlap.drain_if_idle()  # its last request gone, a step in flight lands now (its held blocks back)
        return aborted or released

    def _new_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None,
        request_id: str | None, priority: int, tenant: str, tenant_weight: float = 1.0,
    ) -> Request:
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        check_id(request_id, params.n, self.scheduler.requests)
        token_ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        request = Request(
            request_id=RequestId(request_id),
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=self.clock(),
            priority=priority,
            tenant=tenant,
            tenant_weight=tenant_weight,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
        )
        if params.stop and (self.tokenizer is None or not self.config.detokenize):
            raise InvalidRequestError("stop strings need a tokenizer.json in the model directory"
                                      if self.tokenizer is None else "stop strings need detokenize=True")
        self._start(request)
        return request

    def _start(self, request: Request) -> None:
        """A new request's constraint and detokenizer (a forked choice's too: engine/core/forks.py)."""
        if request.params.constraint is not None:
            self.constrainer.start(request)
        if self.tokenizer is not None and self.config.detokenize:
            self.outputs.start(request)

    def _copy_block(self, src: int, dst: int) -> None:
        """A block's KV into another (a forked choice's copy of the partial last block), on
        every tensor-parallel rank (each its own heads)."""
        self.kv_pool.tensor[dst].copy_(self.kv_pool.tensor[src])
        if self.followers is not None:
            self.followers.send(CopyOp(src, dst))

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer.json in the model directory")
        return self.tokenizer.encode(prompt).ids

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self._observe_last_step(started)
        if self.overlap.current is None:
            if self.speculator is not None:
                self.speculator.propose(self.scheduler)
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
            if not self.overlap.accepts(out):
                return self._run(out, started)
            self.overlap.start(out.scheduled)
        out, sampled = self.overlap.collect()  # the next step, where there is one, runs meanwhile
        outputs = self._apply(out, sampled, {}, started)
        self.overlap.drain_if_idle()
        return outputs

    def _observe_last_step(self, now: float) -> None:
        """The last step decoded and left requests running: its period ends now."""
        if self._decode_step is None:
            return
        num_seqs, rows, kv_tokens, began = self._decode_step
        if rows == num_seqs:
            self.step_model.observe(num_seqs, kv_tokens, now - began)
        if self.speculator is not None:
            self.speculator.observe(rows, kv_tokens, rows > num_seqs, now - began)
        self._decode_step = None

    def _run(self, out: SchedulerOutput, started: float) -> list[RequestOutput]:
        """A step run and sampled here and now."""
        requests, logits = self.runner.execute(out)
        shadows: list[Request] = []
        if rows := first_rows(requests):  # requests of n choices at their first token (engine/core/forks.py)
            requests, logits, shadows = self.forks.in_step(out, requests, logits, rows)
        if any(r.matcher is not None for r in requests):
            num_spec = {s.request.request_id: s.num_spec_tokens for s in out.scheduled if s.num_spec_tokens}
            self.constrainer.mask(logits, requests, num_spec)
        sampled, verified = (self.speculator.sample(self.sampler, out, requests, logits) if self.speculator is not None
                             else (self.sampler.sample_by_id(logits, requests), {}))
        if shadows:  # a prefill worker sends every choice's first token; the decode worker forks
            self.forks.drawn(requests, shadows, sampled)
        outputs = self._apply(out, sampled, verified, started)
        tokens = sum(s.num_new_tokens for s in out.scheduled)
        if self.config.step_floor is not None:  # an emulated accelerator: the step lasts its stated time
            floor = self.config.step_floor.seconds(tokens, len(out.scheduled))
            time.sleep(max(started + floor - time.perf_counter(), 0.0))
        if not out.decodes_only:  # a prompt's chunk in it
            self.prefill_cost.observe(tokens, time.perf_counter() - started)
        return outputs

    def _apply(self, out: SchedulerOutput, sampled: Mapping[RequestId, tuple[int, float | Logprob | None]],
               verified: Mapping[RequestId, Verified], started: float) -> list[RequestOutput]:
        """A step's tokens to its requests (stops), the role's turn, the outputs."""
        # KV each row reads: a verifying request's rows see one more token each
        kv_tokens = sum(s.num_new_tokens * (s.request.num_computed_tokens + 1) + s.num_new_tokens * (s.num_new_tokens - 1) // 2
                        for s in out.scheduled)
        num_outputs = {s.request.request_id: len(s.request.output_token_ids) for s in out.scheduled}
        updated = self.scheduler.update_after_step(out, sampled, verified)
        for r in updated:
            self.stop_if_complete(r, len(r.output_token_ids) - num_outputs[r.request_id])
        if out.decodes_only and any(not r.is_finished for r in updated):
            # decodes, some verifying proposals: a sample of the step model (plain decodes) and
            # of the speculator's step cost (rows, KV read), taken at the next step
            self._decode_step = (len(out.scheduled), sum(s.num_new_tokens for s in out.scheduled), kv_tokens, started)
        self.role.after_step(out.scheduled)
        return [self.outputs.output(r, self.scheduler, self.role, len(r.output_token_ids) - num_outputs[r.request_id])
                for r in updated]

    def stop_if_complete(self, request: Request, num_new: int) -> None:
        """A constrained request's matcher takes its new tokens; complete, the request stops."""
        if request.matcher is not None and not request.is_finished and \
                Constrainer.advance(request, request.output_token_ids[-num_new:]):
            self.scheduler.finish(request, FinishReason.STOP)

    # -- helpers ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_handed_off(self) -> int:
        """Requests whose blocks are held for the transfer layer."""
        return self.kv.num_held

    def has_schedulable(self) -> bool:
        """Requests a step could advance (not those waiting for remote KV)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Offline: run all prompts to completion as one continuous batch; a prompt of n
        choices gives n completions in a row (choice 0 first)."""
        per = params if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [choice_id(rid, i) for p, sp in zip(prompts, per, strict=True)
               for rid in [self.add_request(p, sp)] for i in range((sp or SamplingParams()).n)]
        acc: dict[RequestId, Completion] = {}
        while self.has_unfinished():
            for o in self.step():
                c = acc.setdefault(o.request_id, Completion(o.request_id, [], "", None, o.num_prompt_tokens, o.num_cached_tokens, []))
                c.token_ids += o.new_token_ids
                c.text += o.new_text
                c.logprobs += o.new_logprobs
                c.top_logprobs += o.new_top_logprobs
                c.prompt_logprobs = o.prompt_logprobs if o.prompt_logprobs is not None else c.prompt_logprobs
                c.finish_reason = o.finish_reason
        return [acc[i] for i in ids]

    def load(self) -> EngineLoad:
        """What the engine holds now, for heartbeats."""
        load = self.scheduler.load(self.num_prompt_tokens, self.num_cached_tokens)
        if self.speculator is None:
            return load
        c = self.speculator.counters
        return replace(load, spec_num_drafts=c.num_drafts, spec_num_draft_tokens=c.num_draft_tokens,
                       spec_num_accepted_tokens=c.num_accepted_tokens, spec_accepted_per_pos=tuple(c.accepted_per_pos))

    def take_kv_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def check_invariants(self) -> PoolUsage:
        """Pool accounting holds, and every in-use block is held by a request or a hand-off."""
        return self.scheduler.check_invariants()
