"""LLMEngine: add_request / abort / step, and the hooks for the prefill and decode roles.

One step reads top-down: propose (speculative decoding, engine/speculator.py) -> schedule
-> run the model -> sample (and verify proposals) -> update requests -> outputs.
Role `prefill` finishes a request at its first token and hands its blocks to the
caller's `KVHandoff` (they stay in use until `release_handoff`); role `decode`
reserves blocks for prompts whose KV arrives from elsewhere (`add_remote_request`,
then `remote_kv_ready`).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence

import torch
from tokenizers import Tokenizer

from engine.decode_graphs import CudaGraph, DecodeGraphs, Graph
from engine.gpu_kernels import GpuKernels, Kernels, select_kernels
from engine.attention import ATTENTION_WORKSPACE_BYTES
from engine.block_pool import BlockPool, KVEvent, PoolUsage
from engine.config import EngineConfig
from engine.constrainer import Constrainer
from engine.detokenizer import IncrementalDetokenizer
from engine.device_memory import CudaMemory, DeviceMemory
from engine.draft_proposer import DraftProposer
from engine.hashing import BlockHasher
from engine.gguf_checkpoint import resolve_model_dir
from engine.kv_cache_manager import KVCacheManager
from engine.kv_pool import KVAllocator, KVLayout, KVPool
from engine.kv_sizing import DEFAULT_CPU_KV_BYTES, kv_pool_bytes, num_blocks_for
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Request, SamplingParams
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.speculator import SpecCounters, Speculator
from engine.step_model import StepModel
from engine.structured import Grammars
from engine.outputs import Completion, KVHandoff, Reservation, RequestOutput
from engine.types import BlockId, EngineLoad, InvalidRequestError, RequestId

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        """`memory`: how the device answers for its memory (engine/device_memory.py): on a GPU
        `CudaMemory` unless given; given on CPU (a test's `StatedMemory`), the pool is sized by
        the same profile as on a GPU. `graphs`: what each decode bucket is captured into
        (engine/decode_graphs.py); None: CUDA graphs on GPUs with the Triton kernels, none on CPU
        (a test's `EagerGraph` runs the bucketed path there)."""
        self.config = config
        self.clock = clock
        self.handoff = handoff
        model_dir = resolve_model_dir(config.model_dir)  # a GGUF file: its converted directory
        self.model_config = ModelConfig.from_dir(model_dir)
        mc = self.model_config
        dtype = _DTYPES[config.dtype]
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        cuda = config.device.startswith("cuda")
        self.memory = memory if memory is not None else CudaMemory(config.device) if cuda else None
        self._memory_at_start = (self.memory.free_and_total()[0], self.memory.reserved()) if self.memory else (0, 0)
        """The device's free memory and torch's reserved memory before this engine took any
        (KV sizing counts what it took since)."""
        kernels = select_kernels(config.device, config.native_kernels)
        self.model = LlamaForCausalLM.load(model_dir, mc, dtype, config.device, config.prepack_weights, kernels)
        self.model_id = config.model_id or model_dir.resolve().name
        self.hasher = BlockHasher(config.cache.cluster_secret, self.model_id, config.cache.block_size)
        self.layout = KVLayout(mc.num_layers, config.cache.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        self.sampler = Sampler(config.seed, config.device)
        tok_path = model_dir / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.is_file() else None
        self._model_dir = model_dir
        self._constrainer: Constrainer | None = None
        self.speculator: Speculator | None = None
        """Proposes and verifies tokens ahead (None: off, or a prefill worker, which stops at the
        first). Set before any step runs: sizing the pool on a GPU runs one (`_profile_kv_bytes`)."""
        self._reset_state()
        self._attach_pool(self._pool_blocks(), allocator)
        self._reset_state()  # a profiled forward's requests and counts are not the worker's
        self.speculator = self._speculator(dtype, kernels)
        self._capture_graphs(graphs if graphs is not None else self._cuda_graphs(kernels))

    @property
    def constrainer(self) -> Constrainer:
        """Structured output (engine/constrainer.py), built at the first constrained request."""
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

    def _cuda_graphs(self, kernels: Kernels | None) -> Callable[[], Graph] | None:
        if not (self.config.decode_graphs and isinstance(kernels, GpuKernels) and kernels.device_type == "cuda"):
            return None
        pool = torch.cuda.graph_pool_handle()
        return lambda: CudaGraph(pool)

    def _capture_graphs(self, graphs: Callable[[], Graph] | None) -> None:
        decode = self.runner.decode
        if graphs is None or decode is None:
            return
        decode.capture(graphs)

    # -- the KV pool -----------------------------------------------------------------
    def _attach_pool(self, num_blocks: int, allocator: KVAllocator | None, provisional: bool = False) -> None:
        """The pool and everything that counts its blocks: block pool, cache manager, scheduler, runner.
        `provisional`: the profile's own small pool, of which no operator need hear."""
        config = self.config
        self.kv_pool = KVPool(self.layout, num_blocks, config.device, allocator)
        self.block_pool = BlockPool(num_blocks, config.cache.enable_prefix_caching, config.cache.protected_fraction)
        self.kv = KVCacheManager(self.block_pool, self.hasher)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.clock)
        self.runner = ModelRunner(self.model, self.kv_pool, config.device, None if provisional else self._decode_graphs())
        if self.scheduler.context_limit < self.max_model_len and not provisional:
            logger.warning(
                "the KV pool (%d blocks of %d tokens) is smaller than the model's context (%d tokens): "
                "a sequence stops with finish reason length at %d tokens; raise kv_cache_bytes for more",
                num_blocks, config.cache.block_size, self.max_model_len, self.scheduler.context_limit)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Persistent decode buffers: on CPU, and on GPUs whose kernels let a graph read the
        block table in place (the Triton attention; the torch forms gather by it)."""
        kernels = self.model.kernels
        if not self.config.decode_graphs or self.config.role == "prefill":  # a prefill worker never decodes
            return None
        if self.config.device != "cpu" and not isinstance(kernels, GpuKernels):
            return None
        return DecodeGraphs(self.model, self.kv_pool, self.config.device, self.config.scheduler.max_num_seqs,
                            self.max_model_len)

    def _pool_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks:
            return cache.num_blocks
        if cache.kv_cache_bytes is not None or self.memory is None:
            return num_blocks_for(cache.kv_cache_bytes or DEFAULT_CPU_KV_BYTES, self.layout.block_bytes)
        return num_blocks_for(self._profile_kv_bytes(), self.layout.block_bytes)

    def _profile_kv_bytes(self) -> int:
        """GPU: one forward at the largest step on a provisional pool, then what memory is left
        of this engine's share and free on the device (engine/kv_sizing.py)."""
        memory = self.memory
        assert memory is not None  # _pool_blocks profiles only with one
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len - 1)
        profile_blocks = -(-(num_tokens + 1) // self.layout.block_size) + 1
        memory.synchronize()
        memory.reset_peak()
        self._attach_pool(profile_blocks, None, provisional=True)
        self.generate([[0] * num_tokens], SamplingParams(max_tokens=1, ignore_eos=True))
        memory.synchronize()
        peak = memory.peak_reserved() - profile_blocks * self.layout.block_bytes
        del self.kv_pool, self.runner, self.scheduler, self.kv, self.block_pool
        memory.release_cached()
        free, total = memory.free_and_total()
        free_at_start, reserved_at_start = self._memory_at_start
        reserved = memory.reserved()
        held = max(free_at_start - free, reserved - reserved_at_start)
        # the profiled step's activations, and what a decode batch's or a later chunk's
        # attention may materialise on top (engine/attention.py bounds it)
        transient = max(peak - reserved, 0) + ATTENTION_WORKSPACE_BYTES
        utilization = self.config.cache.gpu_memory_utilization
        pool_bytes = kv_pool_bytes(total, held + transient, utilization, free, transient)
        logger.info("KV pool sized from memory: %.2f GiB (%.2f of %.1f GiB less %.2f GiB held by this worker and "
                    "%.2f GiB of a %d-token forward's transient; %.2f GiB was free)", pool_bytes / 2**30, utilization,
                    total / 2**30, held / 2**30, transient / 2**30, num_tokens, free / 2**30)
        return pool_bytes

    def _reset_state(self) -> None:
        self.step_model = StepModel()
        """Decode step time against batch and KV read (heartbeats carry it to routers)."""
        self._decode_step: tuple[int, int, float] | None = None
        """The last step, when it was pure decode: (requests, KV tokens, its start)."""
        self._detok: dict[RequestId, IncrementalDetokenizer] = {}
        self._handed_off: dict[RequestId, list[BlockId]] = {}
        self.num_prompt_tokens = 0
        """Cumulative prompt tokens of requests that got their first token here."""
        self.num_cached_tokens = 0
        """Of those, the ones served from the prefix cache."""

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

    def add_remote_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> Reservation | None:
        """Decode role: reserve blocks for a prompt computed elsewhere; None if the pool is full."""
        request = self._new_request(prompt, params, request_id, priority, tenant, tenant_weight)
        if not self.scheduler.add_remote_request(request):
            self._detok.pop(request.request_id, None)
            return None
        return Reservation(request.request_id, list(request.block_ids), request.num_cached_tokens)

    def remote_kv_ready(self, request_id: RequestId, first_token_id: int) -> list[RequestOutput]:
        """Decode role: the reserved blocks hold the prompt's KV; the first token came with it."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise InvalidRequestError(f"unknown request {request_id}")
        self.scheduler.remote_kv_ready(request_id, first_token_id)
        self._stop_if_complete(request, 1)  # a constrained request's matcher takes the first token
        return [self._output_for(request)]

    def abort(self, request_id: str, hold_blocks: bool = False) -> bool:
        """Ends the request in any state and frees its blocks (also handed-off ones).

        With `hold_blocks` its blocks are kept out of use until `release_handoff`: the
        transfer layer's quarantine, while a one-sided writer may still write them.
        """
        rid = RequestId(request_id)
        request = self.scheduler.requests.get(rid)
        if hold_blocks:
            released = False
            if request is not None:
                self._handed_off.setdefault(rid, []).extend(self.kv.take_blocks(request))
        else:
            released = self.release_handoff(rid)
        aborted = self.scheduler.abort(rid)
        self._forget(rid)
        return aborted or released

    def release_handoff(self, request_id: RequestId) -> bool:
        """The transfer layer is done with the request's blocks (prefill hand-off or quarantine)."""
        block_ids = self._handed_off.pop(request_id, None)
        if block_ids is None:
            return False
        self.block_pool.free(reversed(block_ids))
        return True

    def _new_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None,
        request_id: str | None, priority: int, tenant: str, tenant_weight: float = 1.0,
    ) -> Request:
        params = params or SamplingParams()
        token_ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        request = Request(
            request_id=RequestId(request_id or uuid.uuid4().hex),
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=self.clock(),
            priority=priority,
            tenant=tenant,
            tenant_weight=tenant_weight,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
        )
        if params.constraint is not None:
            self.constrainer.start(request)
        if self.tokenizer is not None and self.config.detokenize:
            self._detok[request.request_id] = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop)
        elif params.stop:
            raise InvalidRequestError("stop strings need a tokenizer.json in the model directory"
                                      if self.tokenizer is None else "stop strings need detokenize=True")
        return request

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer.json in the model directory")
        return self.tokenizer.encode(prompt).ids

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self._decode_step is not None:  # the last step decoded and left requests running: its period ends
            num_seqs, kv_tokens, began = self._decode_step
            self.step_model.observe(num_seqs, kv_tokens, started - began)
            self._decode_step = None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        requests, logits = self.runner.execute(out)
        if any(r.matcher is not None for r in requests):
            num_spec = {s.request.request_id: s.num_spec_tokens for s in out.scheduled if s.num_spec_tokens}
            self.constrainer.mask(logits, requests, num_spec)
        sampled, verified = (self.speculator.sample(self.sampler, out, requests, logits) if self.speculator is not None
                             else (self.sampler.sample_by_id(logits, requests), {}))
        kv_tokens = sum(s.request.num_computed_tokens + 1 for s in out.scheduled)
        num_outputs = {s.request.request_id: len(s.request.output_token_ids) for s in out.scheduled}
        updated = self.scheduler.update_after_step(out, sampled, verified)
        for r in updated:
            self._stop_if_complete(r, len(r.output_token_ids) - num_outputs[r.request_id])
        if all(s.num_new_tokens == 1 for s in out.scheduled) and any(not r.is_finished for r in updated):
            self._decode_step = (len(out.scheduled), kv_tokens, started)  # the step model's sample, next step
        if self.config.role == "prefill" and self.handoff is not None:
            for s in out.scheduled:
                self.handoff.on_blocks_computed(s.request)
        if self.config.step_floor is not None:  # an emulated accelerator: the step lasts its stated time
            floor = self.config.step_floor.seconds(sum(s.num_new_tokens for s in out.scheduled), len(out.scheduled))
            time.sleep(max(started + floor - time.perf_counter(), 0.0))
        return [self._output_for(r, len(r.output_token_ids) - num_outputs[r.request_id]) for r in updated]

    def _stop_if_complete(self, request: Request, num_new: int) -> None:
        """A constrained request's matcher takes its new tokens; complete, the request stops."""
        if request.matcher is not None and not request.is_finished and \
                Constrainer.advance(request, request.output_token_ids[-num_new:]):
            self.scheduler.finish(request, FinishReason.STOP)

    def _output_for(self, request: Request, num_new: int = 1) -> RequestOutput:
        """The request's `num_new` last tokens (more than one: accepted proposals), detokenized;
        a stop string among them ends it there, the tokens after it dropped."""
        rid = request.request_id
        tokens = request.output_token_ids[-num_new:]
        if len(request.output_token_ids) == num_new:
            self.num_prompt_tokens += request.num_prompt_tokens
            self.num_cached_tokens += request.num_cached_tokens
        text, stopped = "", False
        detok = self._detok.get(rid)
        if detok is not None:
            for i, token in enumerate(tokens):
                piece, stopped = detok.append(token)
                text += piece
                if stopped and i + 1 < len(tokens):
                    drop = len(tokens) - i - 1
                    del request.output_token_ids[-drop:]
                    del request.output_logprobs[len(request.output_logprobs) - drop:]
                    tokens = tokens[: i + 1]
                if stopped:
                    break
        if stopped:
            self.scheduler.finish(request, FinishReason.STOP)
        elif not request.is_finished and self.config.role == "prefill":
            self._hand_off(request, tokens[-1])
        if request.is_finished and detok is not None and not stopped:
            text += detok.flush()
        out = RequestOutput(
            request_id=rid,
            new_token_ids=tokens,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            new_logprobs=request.output_logprobs[-len(tokens):] if request.params.logprobs else [],
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            num_prefill_chunks=request.num_prefill_chunks,
        )
        if request.is_finished:
            self._forget(rid)
        return out

    def _hand_off(self, request: Request, first_token_id: int) -> None:
        block_ids = self.kv.take_blocks(request)
        self.scheduler.finish(request, FinishReason.PREFILL_DONE, keep_blocks=True)
        self._handed_off[request.request_id] = block_ids
        if self.handoff is not None:
            self.handoff.on_prefill_finished(request, block_ids, first_token_id)

    def _forget(self, request_id: RequestId) -> None:
        self._detok.pop(request_id, None)

    # -- helpers ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_handed_off(self) -> int:
        """Requests whose blocks are held for the transfer layer."""
        return len(self._handed_off)

    def has_schedulable(self) -> bool:
        """Requests a step could advance (not those waiting for remote KV)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Offline: run all prompts to completion as one continuous batch."""
        per = params if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per, strict=True)]
        acc: dict[RequestId, Completion] = {}
        while self.has_unfinished():
            for o in self.step():
                c = acc.setdefault(o.request_id, Completion(o.request_id, [], "", None, o.num_prompt_tokens, o.num_cached_tokens, []))
                c.token_ids += o.new_token_ids
                c.text += o.new_text
                c.logprobs += o.new_logprobs
                c.finish_reason = o.finish_reason
        return [acc[i] for i in ids]

    def load(self) -> EngineLoad:
        """What the engine holds now, for heartbeats."""
        u = self.block_pool.usage()
        s = self.scheduler
        queued = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in [*s.waiting, *s.running])
        c = self.speculator.counters if self.speculator is not None else SpecCounters()
        return EngineLoad(u.num_total, u.num_free, u.num_cached, len(s.running), len(s.waiting), queued,
                          self.num_prompt_tokens, self.num_cached_tokens, s.num_preemptions, c.num_drafts,
                          c.num_draft_tokens, c.num_accepted_tokens, tuple(c.accepted_per_pos))

    def take_kv_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def check_invariants(self) -> PoolUsage:
        """Pool accounting holds, and every in-use block is held by a request or a hand-off."""
        return self.scheduler.check_invariants(self._handed_off.values())
