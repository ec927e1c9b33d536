"""The path a GPU worker takes at start, run on CPU: the KV pool sized by the profiled
forward (device memory stated by `StatedMemory` where only CUDA could answer), with the
speculator and the constrainer, and the choice of kernels. The first GPU run died on this
path (`'LLMEngine' object has no attribute 'speculator'`) because no CPU test took it."""
from __future__ import annotations

import logging

from engine.model.attention import ATTENTION_WORKSPACE_BYTES
from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.model.device_memory import StatedMemory
from engine.kernels.gpu_kernels import GpuKernels, select_kernels
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams

MIB = 2**20


def test_a_pool_sized_by_the_profile_serves_with_speculation(tiny_llama_dir: str, caplog) -> None:
    # share = 0.5 x (1 GiB workspace + 64 MiB) - (nothing held + the 1 GiB workspace) = 32 MiB... of the 1088
    total = ATTENTION_WORKSPACE_BYTES * 2 + 64 * MIB
    memory = StatedMemory(total_bytes=total, free_bytes=total)
    config = EngineConfig(model_dir=tiny_llama_dir, cache=CacheConfig(block_size=4, gpu_memory_utilization=0.5),
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2), role="decode")
    with caplog.at_level(logging.WARNING, logger="engine.llm_engine"):
        engine = LLMEngine(config, memory=memory)
    assert engine.kv_pool.num_blocks == 32 * MIB // engine.layout.block_bytes
    assert memory.calls[:3] == ["free_and_total", "synchronize", "reset_peak"]
    assert "release_cached" in memory.calls
    assert not [r for r in caplog.records if "smaller than the model's context" in r.message]  # the profile's own pool
    assert engine.speculator is not None and engine.scheduler.num_unfinished == 0
    assert engine.check_invariants().num_free == engine.kv_pool.num_blocks  # the profile left nothing behind

    plain = LLMEngine(EngineConfig(model_dir=tiny_llama_dir, cache=CacheConfig(block_size=4, num_blocks=256)))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids


def test_a_profile_that_leaves_no_room_says_so(tiny_llama_dir: str) -> None:
    import pytest

    memory = StatedMemory(total_bytes=ATTENTION_WORKSPACE_BYTES, free_bytes=ATTENTION_WORKSPACE_BYTES)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        LLMEngine(EngineConfig(model_dir=tiny_llama_dir), memory=memory)


def test_a_large_gpu_takes_an_8k_step_budget_and_a_set_one_stands(tiny_llama_dir: str) -> None:
    """The step's token budget by the device's memory, as vLLM's server sets it: 8,192 tokens
    from 70 GiB (an H100), 2,048 under it and on CPU; one the operator set is kept."""
    from engine.config import SchedulerConfig

    cache = CacheConfig(block_size=4, num_blocks=64)
    for total, want in ((80 * 2**30, 8192), (70 * 2**30 - 1, 2048)):
        engine = LLMEngine(EngineConfig(model_dir=tiny_llama_dir, cache=cache),
                           memory=StatedMemory(total_bytes=total, free_bytes=total))
        assert engine.config.scheduler.max_num_batched_tokens == want
        assert engine.scheduler.config.max_num_batched_tokens == want
    engine = LLMEngine(EngineConfig(model_dir=tiny_llama_dir, cache=cache,
                                    scheduler=SchedulerConfig(max_num_batched_tokens=512)),
                       memory=StatedMemory(total_bytes=80 * 2**30, free_bytes=80 * 2**30))
    assert engine.scheduler.config.max_num_batched_tokens == 512
    cpu = LLMEngine(EngineConfig(model_dir=tiny_llama_dir, cache=cache))
    assert cpu.scheduler.config.max_num_batched_tokens == 2048
    prompt = list(range(5, 40))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == cpu.generate([prompt], params)[0].token_ids


def test_a_cuda_worker_picks_the_triton_kernels_without_asking_cuda() -> None:
    kernels = select_kernels("cuda", True, triton_version="3.6.0", sms=132)
    assert isinstance(kernels, GpuKernels) and kernels.num_sms == 132 and kernels.device_type == "cuda"
    assert select_kernels("cuda", False, triton_version="3.6.0", sms=132) is None
    assert kernels.pack_linear(None) is None  # type: ignore[arg-type]  # matmuls stay cuBLAS


def test_the_workers_start_and_hand_off_with_the_gpu_kernels() -> None:
    """The disaggregated path with the kernels a GPU worker runs: the prefill worker (a child
    process with its pusher) and the decode worker (its receiver, its decode buffers) built
    around engines whose kernels are the Triton ones, run on CPU by Triton's interpreter.
    The first GPU run with them died here ('GpuKernels' object has no attribute
    'copy_stream': the pusher took any kernels for the native ones)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    # two requests of 19 and 18 tokens at a 16-token budget: pushes after a chunk, a cached prefix
    # not sent again, and the tokens of transformers (half the interpreted work of the five-prompt test)
    test = "tests/integration/test_disaggregated_kv.py::test_cached_prefix_on_decode_is_not_sent_again"
    # in one process (the suite's addopts would start two xdist workers for this one test)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                        f"{test}[shm]"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, (r.stdout + r.stderr)[-4000:]
