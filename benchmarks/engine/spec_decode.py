"""Speculative decoding on the embedded real model (SmolLM2-135M-Instruct, float32, CPU), in one
process: speculation off, ngram (prompt lookup) and a draft model, arms alternating.

Workloads (chat prompts, greedy, max --max-tokens tokens each):
- copy: the model is asked to repeat, correct or continue a text it is given (a paragraph to
  fix, a file of our own source to reproduce), so its answer copies its prompt: what prompt
  lookup is for;
- free: open questions and stories, nothing to copy.
Each at --concurrency (1, 4, 32 by default): that many requests in flight,
`--requests-per-slot` each (closed loop: a finished request's slot takes the next;
benchmarks/serving/closed_loop.py). Per arm one JSON line: proposer, concurrency, workload,
output_tokens_per_s (while the loop was full: what a server under steady load sees),
run_tokens_per_s (the whole run, the drain of the last requests included), itl_p50_ms (the
time between a request's outputs over the tokens they carried: an output of 3 accepted
tokens is 3 inter-token gaps, not one fast one), acceptance_rate (accepted / proposed),
mean_accepted_tokens (per verification), speedup (the median over rounds of output
tokens/s over the off arm's of the same round), speedup_range (the lowest and highest of
those ratios), run_speedup (the same over whole runs: a fixed batch of equal lengths ends
in one step without speculation and spread out with it, so its drain favours the off arm)
and identical (greedy tokens equal to the off arm's, token for token).

The draft is the target's own first --draft-layers layers (`make-tiny-model --draft-of`): a
layer-skip draft, nothing trained (--proposers picks the arms beside off). --rounds repeats
every arm, alternating; this 2-core machine moves an arm's throughput by 10 % between rounds,
so a ratio is worth what its range says.

    ./dev python benchmarks/engine/spec_decode.py [--concurrency 1 4 32] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.serving.closed_loop import closed_loop  # noqa: E402
from cluster.default_model import model_path  # noqa: E402
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from engine.checkpoints.gguf_checkpoint import resolve_model_dir  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.tiny_model import make_draft_model  # noqa: E402
from router.chat_template import ChatTemplate  # noqa: E402

PARAGRAPH = (
    "The router sends each request to a prefill worker that computes the prompt's key-value cache and "
    "pushes its blocks to a decode worker, which streams the tokens back. Pools of workers grow and shrink "
    "with the load, and a request that loses its worker continues on another from the tokens it already sent.")
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n\n" + PARAGRAPH,
    "Fix the spelling in this text and return all of it:\n\n" + PARAGRAPH.replace("the", "teh").replace("worker", "wroker"),
    "Here is a Python file. Write it out again unchanged.\n\n```python\n{code}\n```",
    "Continue this list in the same format up to item 20:\n" + "\n".join(f"{i}. item number {i}" for i in range(1, 8)),
]
FREE_TASKS = [
    "Write a short story about a lighthouse keeper who finds a map.",
    "What are three good habits for learning a new language? Explain each.",
    "Describe the water cycle to a ten-year-old.",
    "Give advice to someone starting their first job as a software engineer.",
]


def prompts(workload: str, template: ChatTemplate) -> list[str]:
    code = (ROOT / "engine" / "fair_order.py").read_text()[:1200]
    tasks = [t.replace("{code}", code) for t in COPY_TASKS] if workload == "copy" else FREE_TASKS
    return [template.render([{"role": "user", "content": t}]) for t in tasks]


def run_arm(engine: LLMEngine, texts: list[str], concurrency: int, per_slot: int, max_tokens: int) -> dict:
    """`concurrency` requests in flight until concurrency * per_slot have run (benchmarks/serving/closed_loop.py)."""
    params = SamplingParams(max_tokens=max_tokens)
    spec = engine.speculator.counters if engine.speculator is not None else None
    before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0, 0)
    loop = closed_loop(engine, [(texts[i % len(texts)], params) for i in range(concurrency * per_slot)], concurrency)
    after = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0, 0)
    drafts, proposed, accepted = (a - b for a, b in zip(after, before, strict=True))
    return {"output_tokens_per_s": loop.full_tokens_per_s, "run_tokens_per_s": loop.output_tokens_per_s,
            "itl_p50_ms": loop.itl_p50_ms,
            "proposed_tokens": proposed, "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_tokens": accepted / drafts if drafts else 0.0, "tokens": loop.tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--workloads", nargs="+", default=["copy", "free"], choices=["copy", "free"])
    ap.add_argument("--proposers", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    ap.add_argument("--requests-per-slot", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--spec-max-batched-tokens", type=int, default=32)
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(resolve_model_dir(model_path(None)))
    draft = str(make_draft_model(model, Path(tempfile.mkdtemp()) / "draft", args.draft_layers))
    template = ChatTemplate.load(model)
    assert template is not None

    def engine(spec: SpeculativeConfig) -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=model, detokenize=False, speculative=spec,
                                      cache=CacheConfig(kv_cache_bytes=512 * 2**20),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=2048)))
    common = dict(num_speculative_tokens=args.num_speculative_tokens, max_batched_tokens=args.spec_max_batched_tokens)
    arms = {"off": engine(SpeculativeConfig())}
    if "ngram" in args.proposers:
        arms["ngram"] = engine(SpeculativeConfig(method="ngram", **common))  # type: ignore[arg-type]
    if "draft" in args.proposers:
        arms["draft"] = engine(SpeculativeConfig(method="draft", draft_model_dir=draft, **common))  # type: ignore[arg-type]
    config = {k: v for k, v in vars(args).items() if k not in ("concurrency", "workloads", "proposers")}
    for workload in args.workloads:
        texts = prompts(workload, template)
        for concurrency in args.concurrency:
            runs: dict[str, list[dict]] = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, eng in arms.items():  # alternating: every round runs each arm once
                    runs[name].append(run_arm(eng, texts, concurrency, args.requests_per_slot, args.max_tokens))
            for name, rs in runs.items():
                mid = sorted(rs, key=lambda r: r["output_tokens_per_s"])[len(rs) // 2]
                ratios = sorted(r["output_tokens_per_s"] / o["output_tokens_per_s"] for r, o in zip(rs, runs["off"]))
                print(json.dumps({
                    "bench": "spec_decode", "proposer": name, "concurrency": concurrency, "workload": workload,
                    **{k: round(v, 3) for k, v in mid.items() if k != "tokens"},
                    "speedup": round(statistics.median(ratios), 3),
                    "speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                    "run_speedup": round(statistics.median(
                        r["run_tokens_per_s"] / o["run_tokens_per_s"] for r, o in zip(rs, runs["off"])), 3),
                    "identical": all(r["tokens"] == o["tokens"] for r, o in zip(rs, runs["off"], strict=True)),
                    **config}), flush=True)


if __name__ == "__main__":
    main()
