"""FP8 weights end to end on CPU: checkpoints written in Hugging Face's FP8 layouts (AutoFP8's
fp8, Meta's fbgemm_fp8, llm-compressor's compressed-tensors) give the log-probabilities of the
same model with those weights dequantized; `--quantization fp8` of the embedded default model
keeps its greedy tokens; a split FP8 model gives the whole one's tokens; FP8 KV moves from a
prefill to a decode engine, and a pair that quantized differently is refused at the hello.

Tolerances, on a prompt token's log-probability: weights only, the same sums (1e-5); with
the inputs quantized to e4m3 too, each projection's input carries up to 1/16 relative error,
so the tiny random model's log-probabilities move by 0.02 nats on average and 0.09 at most
here: asserted at 0.05 mean and 0.25 at most."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from decode_worker.kv_receive import RemoteKV
from engine.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.model.tiny_model import FP8_CONFIGS, make_fp8_model
from kvfabric import ReceiverConfig
from kvfabric.pools import kv_allocator
from tests.integration.fabric_peer import Peer
from tests.integration.prefill_peer import prefill_main
from tests.integration.reference import engine_config, make_engine, random_prompts
from tests.integration.test_disaggregated_kv import run_decode
from tests.integration.test_tensor_parallel import PARAMS as TP_PARAMS
from tests.integration.test_tensor_parallel import TOLERANCE as TP_TOLERANCE
from tests.integration.test_tensor_parallel import make_engine_config, run_ranks

PROMPT_LOGPROBS = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1)
TEXT = ("The history of the bicycle begins in the early nineteenth century, when inventors in Germany and France "
        "built wooden machines that riders pushed along with their feet. Over the following decades, pedals, "
        "chains and air-filled tyres turned these curiosities into")


def prompt_logprobs(engine: LLMEngine, prompts: list[list[int]], top: bool = False):
    """Every prompt token's log-probability after the tokens before it, all prompts in a row;
    with `top`, also the likeliest token at each of those positions."""
    rows = [e for c in engine.generate(prompts, PROMPT_LOGPROBS) for e in c.prompt_logprobs]
    logprobs = torch.tensor([e.logprob for e in rows])
    return (logprobs, torch.tensor([e.top.token_ids[0] for e in rows])) if top else logprobs


@pytest.fixture(scope="module")
def fp8_dirs(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """kind -> (its FP8 checkpoint, the same model with those weights dequantized)."""
    root = tmp_path_factory.mktemp("fp8")
    return {kind: (str(make_fp8_model(tiny_llama_dir, root / kind, kind, root / f"{kind}-dequantized")),
                   str(root / f"{kind}-dequantized")) for kind in FP8_CONFIGS}


@pytest.mark.parametrize("kind", list(FP8_CONFIGS))
def test_an_fp8_checkpoint_gives_the_log_probabilities_of_its_weights_dequantized(
        fp8_dirs: dict[str, tuple[str, str]], kind: str) -> None:
    fp8_dir, reference_dir = fp8_dirs[kind]
    engine = make_engine(fp8_dir)
    model = engine.model
    assert model.config.fp8 is not None and engine.model_id == Path(fp8_dir).name  # served as it is: its own name
    weights_only = kind == "ct-weights-only"
    for layer in model.layers:  # every projection FP8 (weights only: dequantized once, 16-bit inputs)
        assert all((x.fp8 is None) == weights_only for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert model.lm_head.fp8 is None and model.native_layers is None  # the head ignored; no unscaled one-call decode
    prompts = random_prompts([40, 64, 33, 50], 512, seed=1)
    got, want = prompt_logprobs(engine, prompts), prompt_logprobs(make_engine(reference_dir), prompts)
    delta = (got - want).abs()
    if weights_only:
        assert float(delta.max()) < 1e-5
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        assert ([c.token_ids for c in engine.generate(prompts, params)]
                == [c.token_ids for c in make_engine(reference_dir).generate(prompts, params)])
    else:
        assert float(delta.mean()) < 0.05 and float(delta.max()) < 0.25, (float(delta.mean()), float(delta.max()))
        assert float(delta.mean()) > 1e-4  # the inputs are quantized: not the 16-bit product


def test_quantizing_the_embedded_model_at_load_keeps_its_greedy_choices(
        smollm2_dir: str, tmp_path: Path) -> None:
    """`--quantization fp8` is per-channel weights and per-token inputs: the same numbers as
    llm-compressor's FP8-dynamic checkpoint of the model; against the model with those weights
    dequantized (its 16-bit inputs are the only difference) the likeliest next token is the
    same at most positions of ordinary text (teacher-forced: 0.92 measured here, at 0.13
    nats mean |delta log-prob|: a 135M model is sensitive to the inputs' 3-bit mantissas)."""
    checkpoint = make_fp8_model(smollm2_dir, tmp_path / "fp8", "ct-channel-dynamic", tmp_path / "dequantized")
    small = dict(block_size=16, num_blocks=128, budget=256)
    at_load = LLMEngine(dataclasses.replace(engine_config(smollm2_dir, **small), quantization="fp8"))
    assert at_load.model_id == Path(smollm2_dir).resolve().name + "+fp8"  # its KV is not the checkpoint's
    tokens = at_load.tokenizer.encode(TEXT).ids
    mine, my_top = prompt_logprobs(at_load, [tokens], top=True)
    same, _ = prompt_logprobs(make_engine(str(checkpoint), **small), [tokens], top=True)
    assert float((mine - same).abs().max()) < 1e-5
    want, want_top = prompt_logprobs(make_engine(str(tmp_path / "dequantized"), **small), [tokens], top=True)
    delta = (mine - want).abs()
    assert float(delta.mean()) < 0.25, float(delta.mean())
    agreement = float((my_top == want_top).float().mean())
    assert agreement >= 0.85, agreement


def test_a_split_fp8_model_gives_the_whole_ones_tokens(fp8_dirs: dict[str, tuple[str, str]], tmp_path: Path) -> None:
    """Per-channel weight scales follow their rows to each rank (the column-parallel ones
    split, the row-parallel ones whole); with a static input scale each rank quantizes its part
    of an input as the whole model does, so only the sums' order differs."""
    fp8_dir = fp8_dirs["ct-channel-static"][0]
    prompts = random_prompts([5, 16, 23, 41], 512, seed=7)
    whole = LLMEngine(make_engine_config(fp8_dir)).generate(prompts, TP_PARAMS)
    rank0, _ = run_ranks(2, fp8_dir, prompts, tmp_path)
    assert rank0["tokens"] == [c.token_ids for c in whole]
    for got, want in zip(rank0["logprobs"], (c.logprobs for c in whole)):
        assert max(abs(a - b) for a, b in zip(got, want)) < TP_TOLERANCE
    assert rank0["in_use"] == 0


def test_fp8_weights_hand_kv_off_and_a_pair_quantized_apart_is_refused(
        fp8_dirs: dict[str, tuple[str, str]], tiny_llama_dir: str) -> None:
    fp8_dir = fp8_dirs["fp8-static"][0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = random_prompts([5, 23, 41], 512, seed=3)
    want = {f"r{i}": c.token_ids for i, c in enumerate(make_engine(fp8_dir).generate(prompts, params))}
    peer = Peer(prefill_main, fp8_dir, "shm", 16)
    allocator = kv_allocator("cpu")
    remote = RemoteKV(make_engine(fp8_dir, role="decode", allocator=allocator), allocator, ReceiverConfig())
    try:
        tickets = [remote.reserve(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        assert set(peer.call("attach", [t.to_wire() for t in tickets]).values()) == {None}
        reply = peer.call("prefill", [(p, t.request_id, 8) for p, t in zip(prompts, tickets)], timeout_s=60)
        assert all(error is None for _, _, error, _ in reply["done"]) and reply["in_use"] == 0
        tokens: dict[str, list[int]] = {rid: [] for rid in want}
        assert run_decode(remote, tokens, len(prompts)) == []
        assert tokens == want  # the monolithic FP8 engine's
        assert remote.engine.check_invariants().num_in_use == 0
    finally:
        peer.stop()
        remote.close()
    # the checkpoint as it is (prefill) and quantized at load (decode): other KV, refused by name
    peer = Peer(prefill_main, tiny_llama_dir, "shm", 16)
    allocator = kv_allocator("cpu")
    decode = LLMEngine(dataclasses.replace(engine_config(tiny_llama_dir, role="decode"), quantization="fp8"),
                       allocator=allocator)
    remote = RemoteKV(decode, allocator, ReceiverConfig())
    try:
        ticket = remote.reserve(prompts[0], params, request_id="x")
        [error] = peer.call("attach", [ticket.to_wire()]).values()
        assert error is not None and "model_id differs" in error and "+fp8" in error, error
        deadline = time.monotonic() + 10
        while remote.engine.check_invariants().num_in_use and time.monotonic() < deadline:
            remote.pump(timeout_s=0.05)
        remote.abort("x")
        assert remote.engine.check_invariants().num_in_use == 0
    finally:
        peer.stop()
        remote.close()


def test_speculation_over_fp8_weights_keeps_the_greedy_tokens_and_the_store_names_their_kv(
        tiny_llama_dir: str) -> None:
    """Each token's input is quantized on its own row, so verifying proposals in one forward
    gives the tokens one at a time gives; the KV store of a cluster quantizing at load names
    its blocks as the workers do (a store of the checkpoint's KV would not be theirs)."""
    from engine.config import SpeculativeConfig
    from kvstore.service import store_layout

    prompts = [[7, 8, 9, 10] * 6 + [7, 8], [5, 6] * 12]  # repetitive: prompt lookup proposes, some accepted
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    config = dataclasses.replace(engine_config(tiny_llama_dir), quantization="fp8")
    plain = LLMEngine(config)
    spec = LLMEngine(dataclasses.replace(config, speculative=SpeculativeConfig(method="ngram", priced=False)))
    assert ([c.token_ids for c in spec.generate(prompts, params)]
            == [c.token_ids for c in plain.generate(prompts, params)])
    assert spec.speculator.counters.num_accepted_tokens > 0
    layout = store_layout(tiny_llama_dir, "", 4, "float32", "fp8")
    assert layout.model_id == plain.model_id == Path(tiny_llama_dir).resolve().name + "+fp8"
    assert store_layout(tiny_llama_dir, "", 4, "float32").model_id == Path(tiny_llama_dir).resolve().name


def test_the_quantization_flags_reach_the_workers_and_the_store(tiny_llama_dir: str) -> None:
    from cluster.cli import _serve_config, build_parser

    from cluster.controller import Controller
    from control.worker_config import WorkerConfig

    args = build_parser().parse_args(["serve", "--model", tiny_llama_dir, "--device", "cpu", "--quantization", "fp8",
                                      "--kv-cache-dtype", "fp8", "--kv-store-mib", "64"])
    config = _serve_config(args)
    worker = dataclasses.replace(config.worker, cluster_secret=b"s")  # serve's controller makes the secret
    engine = worker.engine_config("decode")
    assert (engine.quantization, engine.cache.kv_cache_dtype) == ("fp8", "fp8")
    store = Controller._store_config(type("C", (), {"config": config})())  # what serve's store is started with
    assert (store.quantization, store.kv_cache_dtype) == ("fp8", "fp8")
    kv_store = build_parser().parse_args(["kv-store", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert (kv_store.quantization, kv_store.kv_cache_dtype) == ("fp8", "fp8")
    plain = build_parser().parse_args(["worker", "decode", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    assert (plain.quantization, plain.kv_cache_dtype) == ("fp8", "fp8")
    with pytest.raises(ValueError, match="kv-cache-dtype fp8 serves on CPU workers"):
        WorkerConfig(model_dir=tiny_llama_dir, device="cuda", kv_cache_dtype="fp8")
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["serve", "--quantization", "int4"])


def test_fp8_weights_and_kv_together_keep_speculation_exact_and_constraints_followed(tiny_llama_dir: str) -> None:
    """Both FP8 at once: ngram speculation gives the tokens one-at-a-time decoding gives (each
    token's input quantized on its own row, each KV element rounded on its own), and every
    kind of constraint holds (the grammar masks the FP8 model's logits as any other's)."""
    from engine.config import SpeculativeConfig
    from engine.core.request import Constraint
    from tests.integration.test_structured import CONSTRAINTS, valid

    config = dataclasses.replace(engine_config(tiny_llama_dir, block_size=16, kv_cache_dtype="fp8"),
                                 quantization="fp8")
    plain = LLMEngine(config)
    assert plain.kv_pool.fp8 and plain.model.layers[0].qkv.fp8 is not None
    assert plain.model_id.endswith("+fp8+kv-fp8")
    prompts = [[7, 8, 9, 10] * 6 + [7, 8], [5, 6] * 12]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    spec = LLMEngine(dataclasses.replace(config, speculative=SpeculativeConfig(method="ngram", priced=False)))
    assert ([c.token_ids for c in spec.generate(prompts, params)]
            == [c.token_ids for c in plain.generate(prompts, params)])
    assert spec.speculator.counters.num_accepted_tokens > 0
    for kind in ("json_schema", "regex", "choice", "grammar"):
        out = plain.generate([[5, 17, 33, 4]], SamplingParams(max_tokens=120, constraint=Constraint(
            kind, CONSTRAINTS[kind])))[0]
        assert valid(kind, out.text), (kind, out.text)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fp8_experts_give_the_log_probabilities_of_their_weights_dequantized_whole_and_split(
        arch: str, tmp_path: Path) -> None:
    """Each expert's projections (and Qwen2-MoE's shared expert) FP8, the routers not: the
    torch form quantizes each expert's input rows and scales its products, on one rank or
    split across two (their scales follow their rows); `--quantization fp8` quantizes the
    experts as it loads them, as llm-compressor's FP8-dynamic checkpoint of them holds."""
    from engine.model.tiny_model import make_tiny_model

    src = make_tiny_model(tmp_path / arch, arch)
    static = str(make_fp8_model(src, tmp_path / "static", "ct-channel-static", tmp_path / "static-dq"))
    engine = make_engine(static)
    moe = next(layer.moe for layer in engine.model.layers if layer.moe is not None)
    assert moe.fp8 is not None and moe.fp8.gate_up_input is not None and moe.router.dtype == torch.float32
    assert (moe.fp8.shared_gate_up is not None) == (arch == "qwen2_moe")
    prompts = random_prompts([40, 64, 33], 512, seed=9)
    delta = (prompt_logprobs(engine, prompts) - prompt_logprobs(make_engine(str(tmp_path / "static-dq")),
                                                                prompts)).abs()
    # (a token near a routing tie may take another expert than the reference: a larger move, 0.45 here)
    assert float(delta.mean()) < 0.05 and float(delta.max()) < 1.0, (float(delta.mean()), float(delta.max()))
    assert float(delta.mean()) > 1e-4
    dynamic = make_fp8_model(src, tmp_path / "dynamic", "ct-channel-dynamic")
    at_load = LLMEngine(dataclasses.replace(engine_config(str(src)), quantization="fp8"))
    assert float((prompt_logprobs(at_load, prompts) - prompt_logprobs(make_engine(str(dynamic)), prompts)
                  ).abs().max()) < 1e-5
    whole = LLMEngine(make_engine_config(static)).generate(prompts, TP_PARAMS)
    rank0, _ = run_ranks(2, static, prompts, tmp_path)
    assert rank0["tokens"] == [c.token_ids for c in whole]
    for got, want in zip(rank0["logprobs"], (c.logprobs for c in whole)):
        assert max(abs(a - b) for a, b in zip(got, want)) < TP_TOLERANCE


def test_quantizing_stacked_experts_at_load_gives_what_quantizing_them_apart_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A converted GGUF holds a mixture's experts stacked (`experts.gate_up_proj`); quantized
    as they load, per expert and output row, they give the numbers of the same experts
    quantized one by one from the checkpoint they were written from."""
    from engine.checkpoints.gguf_checkpoint import resolve_model_dir
    from engine.model.tiny_model import make_tiny_model
    from tests.gguf_writer import write_gguf

    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    source = make_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    converted = resolve_model_dir(write_gguf(source, tmp_path / "qwen3_moe.gguf"))
    from engine.checkpoints.weights import CheckpointReader

    assert CheckpointReader(converted).has("model.layers.0.mlp.experts.gate_up_proj")
    prompts = random_prompts([23, 40], 512, seed=10)
    stacked, apart = (LLMEngine(dataclasses.replace(engine_config(str(d)), quantization="fp8"))
                      for d in (converted, source))
    assert next(layer.moe for layer in stacked.model.layers if layer.moe is not None).fp8 is not None
    assert float((prompt_logprobs(stacked, prompts) - prompt_logprobs(apart, prompts)).abs().max()) < 1e-4
