"""lm-evaluation-harness against a running cluster: a small multiple-choice task written from
local data, scored through `local-completions` (echo, logprobs, the prompt's tokens), and
each item's log-likelihood compared with transformers' on the same model.

The cluster is 1 prefill + 1 decode worker on the embedded default model (SmolLM2-135M-Instruct,
its GGUF as float32), disaggregated, so each log-likelihood comes from a prefill worker. The
task (--items questions, 4 choices each, written here) runs through lm-eval's own request
building, batching and parsing; the reference is transformers loading the same GGUF, scoring
each (context, continuation) lm-eval logged the way lm-eval's API models split them
(context tokens, then the rest of context + continuation's tokens). One JSON line: items,
the task's accuracy by both, the largest per-item log-likelihood difference, whether every
item's is_greedy agrees, and the wall time of the lm-eval run.

Needs the eval extra (heavy: datasets, pyarrow, pandas, scipy, scikit-learn):

    ./dev python -m pip install -e '.[eval]'
    ./dev python benchmarks/engine/lm_eval_check.py [--items 24]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cluster.config import ClusterConfig, RouterConfig, WorkerConfig  # noqa: E402
from cluster.default_model import model_path  # noqa: E402
from cluster.local import LocalCluster  # noqa: E402
from engine.checkpoints.gguf_checkpoint import resolve_model_dir  # noqa: E402
from router.policy import RoutingConfig  # noqa: E402

MODEL = "smollm2"
CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
            ("Greece", "Athens"), ("Russia", "Moscow"), ("China", "Beijing"), ("India", "New Delhi"),
            ("Poland", "Warsaw"), ("Chile", "Santiago"), ("Cuba", "Havana"), ("Ireland", "Dublin"),
            ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
            ("Thailand", "Bangkok"), ("Turkey", "Ankara")]
TASK = """task: capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""


def write_task(folder: Path, items: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for country, capital in CAPITALS[:items]:
        others = rng.sample([c for _, c in CAPITALS if c != capital], 3)
        choices = [f" {c}" for c in [capital, *others]]
        rng.shuffle(choices)
        rows.append({"country": country, "choices": choices, "label": choices.index(f" {capital}")})
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "capitals_mc.yaml").write_text(TASK.format(data=data))


def reference(model_dir: str, gguf: Path, samples: list[dict[str, Any]]) -> list[tuple[float, bool]]:
    """transformers' (log-likelihood, is_greedy) of each logged request, split as lm-eval splits it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    out = []
    for s in samples:
        for context, continuation in (a for a in s["arguments"]):
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            cont = whole[len(ctx):]
            with torch.inference_mode():
                lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
            rows = lp[len(whole) - len(cont) - 1:len(whole) - 1]
            picked = rows.gather(1, torch.tensor(cont)[:, None])[:, 0]
            out.append((float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=24, help=f"questions (at most {len(CAPITALS)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=4, help="lm-eval's: prompts per completions request")
    args = ap.parse_args()
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
    except ImportError:
        sys.exit("lm-eval is not installed: ./dev python -m pip install -e '.[eval]'")
    torch.set_num_threads(2)
    gguf = Path(model_path(None))
    model_dir = str(resolve_model_dir(gguf))
    folder = Path(tempfile.mkdtemp(prefix="lm-eval-task-"))
    write_task(folder, min(args.items, len(CAPITALS)), args.seed)
    config = ClusterConfig(worker=WorkerConfig(model_dir=str(gguf), block_size=16, kv_cache_bytes=128 * 2**20),
                           num_prefill=1, num_decode=1,
                           router=RouterConfig(port=0, http_port=0, served_model_name=MODEL, tokenizer_dir=model_dir,
                                               routing=RoutingConfig(mode="disaggregated")))
    with LocalCluster(config) as cluster:
        began = time.perf_counter()
        results = simple_evaluate(
            model="local-completions",
            model_args=f"model={MODEL},base_url=http://{cluster.info['http_address']}/v1/completions,"
                       f"tokenizer={model_dir},tokenizer_backend=huggingface,tokenized_requests=True,"
                       f"num_concurrent=1,max_retries=1",
            tasks=["capitals_mc"], batch_size=args.batch_size, log_samples=True,
            task_manager=TaskManager(include_path=str(folder)))
        took = time.perf_counter() - began
    samples = results["samples"]["capitals_mc"]
    ours = [tuple(r[0]) for s in samples for r in s["resps"]]  # (loglikelihood, is_greedy) per choice
    theirs = reference(model_dir, gguf, samples)
    diff = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs, strict=True))
    acc_ref = sum(max(range(len(s["arguments"])), key=lambda j, i=i: theirs[i + j][0]) == s["target"]
                  for i, s in zip(range(0, len(theirs), 4), samples, strict=True)) / len(samples)
    print(json.dumps({"bench": "lm_eval_check", "items": len(samples), "choices": len(ours),
                      "acc": results["results"]["capitals_mc"]["acc,none"], "acc_transformers": acc_ref,
                      "max_loglikelihood_diff": round(diff, 6),
                      "is_greedy_agrees": all(bool(a[1]) == b[1] for a, b in zip(ours, theirs, strict=True)),
                      "lm_eval_s": round(took, 1), "batch_size": args.batch_size, "model": "SmolLM2-135M-Instruct Q4_1",
                      "cluster": "1 prefill + 1 decode, disaggregated, CPU"}))


if __name__ == "__main__":
    main()
