"""Structured output on the embedded real model (SmolLM2-135M-Instruct, float32, CPU), in one
process: output tokens/s and ITL p50 with and without a JSON-schema constraint, arms
alternating, at --concurrency (1 and 16), and what compiling a constraint costs.

Workload: chat prompts asking for a record as JSON; the constrained arm sends the schema as
`SamplingParams.constraint`, the free arm nothing (greedy, --max-tokens), closed loop:
--requests-per-slot requests pass through each of the --concurrency slots, so the batch stays
full while requests of different lengths come and go. Per arm one JSON line:
constrained, concurrency, output_tokens_per_s, itl_p50_ms, valid (the fraction of outputs
that parse and follow the schema: constrained outputs must all), ratio (tokens/s over the
free arm). The free arm generates exactly as many tokens per request as the constrained arm
of the same round did (ignore_eos), so the two differ only by the constraint's work. Then one line of compile times: a small and a large schema (the
large: 200 properties with enums), first compile and cached (a second request with the same
schema: the cache's copy of the compiled matcher), in ms.

    ./dev python benchmarks/engine/structured.py [--concurrency 1 16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.serving.closed_loop import closed_loop  # noqa: E402
from cluster.default_model import model_path  # noqa: E402
from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.checkpoints.gguf_checkpoint import resolve_model_dir  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import Constraint, SamplingParams  # noqa: E402
from engine.structured.grammars import Grammars  # noqa: E402
from router.chat_template import ChatTemplate  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "city": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}
ASKS = ["Invent a person and describe them as JSON with name, age, city and hobbies.",
        "Give me a JSON record for a fictional scientist: name, age, city, hobbies.",
        "Describe a made-up chef as JSON (name, age, city, hobbies).",
        "Create a JSON profile of an imaginary pilot with name, age, city and hobbies."]


def run_arm(engine: LLMEngine, texts: list[str], concurrency: int, per_slot: int, max_tokens: int,
            constraint: Constraint | None, lengths: list[int] | None = None) -> dict:
    """`concurrency` requests in flight until concurrency * per_slot have run (benchmarks/serving/closed_loop.py).
    `lengths`: request i generates exactly lengths[i] tokens (ignore_eos)."""
    n = concurrency * per_slot
    params = ([SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths] if lengths else
              [SamplingParams(max_tokens=max_tokens, constraint=constraint)] * n)
    loop = closed_loop(engine, [(texts[i % len(texts)], params[i]) for i in range(n)], concurrency)
    assert engine.tokenizer is not None
    texts_out = [engine.tokenizer.decode(t) for t in loop.tokens]
    return {"output_tokens_per_s": loop.output_tokens_per_s, "itl_p50_ms": loop.itl_p50_ms,
            "valid": sum(_valid(t) for t in texts_out) / len(texts_out), "lengths": [len(t) for t in loop.tokens]}


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def compile_ms(model: str, vocab_size: int, eos: tuple[int, ...]) -> dict:
    grammars = Grammars.for_model(model, vocab_size, eos)
    large = {"type": "object", "properties": {f"field_{i}": {"enum": [f"v{i}_{j}" for j in range(20)]}
                                              for i in range(200)}, "required": [f"field_{i}" for i in range(50)]}
    out = {}
    for name, schema in (("small", SCHEMA), ("large", large)):
        c = Constraint("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        grammars.matcher(c)
        t1 = time.perf_counter()
        grammars.matcher(c)
        t2 = time.perf_counter()
        out[f"compile_{name}_first_ms"] = round(1000 * (t1 - t0), 3)
        out[f"compile_{name}_cached_ms"] = round(1000 * (t2 - t1), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(resolve_model_dir(model_path(None)))
    template = ChatTemplate.load(model)
    assert template is not None
    texts = [template.render([{"role": "user", "content": a}]) for a in ASKS]
    engine = LLMEngine(EngineConfig(model_dir=model, detokenize=False, cache=CacheConfig(kv_cache_bytes=512 * 2**20),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=2048)))
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    config = {"max_tokens": args.max_tokens, "rounds": args.rounds, "threads": args.threads,
              "requests_per_slot": args.requests_per_slot}
    for concurrency in args.concurrency:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            # the constrained arm, then the free one generating the same number of tokens per request
            # (ignore_eos): the two differ only by the constraint's work, not by how long answers are
            runs[True].append(run_arm(engine, texts, concurrency, args.requests_per_slot, args.max_tokens, constraint))
            runs[False].append(run_arm(engine, texts, concurrency, args.requests_per_slot, args.max_tokens, None,
                                       runs[True][-1]["lengths"]))
        base = statistics.median(r["output_tokens_per_s"] for r in runs[False])
        for constrained, rs in sorted(runs.items()):
            tps = statistics.median(r["output_tokens_per_s"] for r in rs)
            print(json.dumps({"bench": "structured", "constrained": constrained, "concurrency": concurrency,
                              "output_tokens_per_s": round(tps, 2),
                              "itl_p50_ms": round(statistics.median(r["itl_p50_ms"] for r in rs), 2),
                              "valid": min(r["valid"] for r in rs), "ratio": round(tps / base, 3), **config}),
                  flush=True)
    mc = engine.model_config
    print(json.dumps({"bench": "structured_compile", **compile_ms(model, mc.vocab_size, mc.eos_token_ids)}), flush=True)


if __name__ == "__main__":
    main()
