"""KV blocks a request holds under a sliding window, against the same model attending to its
whole context (the tiny mistral of `make-tiny-model --arch mistral`: window 16, and a copy of
its checkpoint with `sliding_window` unset), in one process, the same prompts through both.

Each arm runs --requests prompts of --window-multiple times the window (4 by default), then
--new-tokens greedy tokens each, all at once, in 4-token blocks, and records after every step
the blocks in use (the pool's, less the null block a window keeps) over the requests running.
One JSON line per arm: peak and mean blocks held per running request, the peak over the
pool, the step count and output tokens/s; then one line with the ratios (window / full) and
whether the greedy tokens differ (they should: the models differ past the window). The
throughput compares two paths on CPU, not the window's cost: full attention is Llama's layers,
which the native one-call decode runs; the windowed model decodes layer by layer.

    ./dev python benchmarks/kv/sliding_window_kv.py [--requests 8] [--window-multiple 4]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.model.model_config import ModelConfig  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.tiny_model import SLIDING_WINDOW, make_tiny_model  # noqa: E402
from tests.integration.reference import make_engine, random_prompts  # noqa: E402


def run_arm(model_dir: str, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list[list[int]]]:
    engine = make_engine(model_dir, num_blocks=1024, budget=256)
    null = engine.kv.null_block is not None
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up, not counted
    ids = [engine.add_request(p, params) for p in prompts]
    per_request: list[float] = []
    peak = steps = 0
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    began = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
        running = len(engine.scheduler.running)
        in_use = engine.block_pool.usage().num_in_use - null
        peak = max(peak, in_use)
        if running:
            per_request.append(in_use / running)
    took = time.perf_counter() - began
    return {"kv_window": engine.model_config.kv_window, "peak_blocks_in_use": peak,
            "peak_blocks_per_request": round(max(per_request), 2),
            "mean_blocks_per_request": round(sum(per_request) / len(per_request), 2), "steps": steps,
            "output_tokens_per_s": round(len(prompts) * new_tokens / took, 1)}, [tokens[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--window-multiple", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="sliding-window-"))
    windowed = make_tiny_model(work / "window", arch="mistral")
    full = work / "full"
    shutil.copytree(windowed, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(full).kv_window == 0 and ModelConfig.from_dir(windowed).kv_window == SLIDING_WINDOW
    prompts = random_prompts([args.window_multiple * SLIDING_WINDOW] * args.requests, 512, seed=1)
    config = {"bench": "sliding_window_kv", "arch": "mistral", "window": SLIDING_WINDOW, "block_size": 4,
              "prompt_tokens": args.window_multiple * SLIDING_WINDOW, "new_tokens": args.new_tokens,
              "requests": args.requests}
    results = {}
    for name, model_dir in (("window", windowed), ("full", full)):
        results[name], tokens = run_arm(str(model_dir), prompts, args.new_tokens)
        results[name + "_tokens"] = tokens
        print(json.dumps({**config, "arm": name, **results[name]}), flush=True)
    w, f = results["window"], results["full"]
    print(json.dumps({**config, "compare": "window / full",
                      "peak_blocks_per_request": round(w["peak_blocks_per_request"] / f["peak_blocks_per_request"], 3),
                      "mean_blocks_per_request": round(w["mean_blocks_per_request"] / f["mean_blocks_per_request"], 3),
                      "peak_blocks_in_use": round(w["peak_blocks_in_use"] / f["peak_blocks_in_use"], 3),
                      "output_tokens_per_s": round(w["output_tokens_per_s"] / f["output_tokens_per_s"], 3),
                      "tokens_differ": results["window_tokens"] != results["full_tokens"]}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
