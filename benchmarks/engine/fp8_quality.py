"""FP8's cost in quality on a real model: each prompt token's log-probability (teacher-forced
over a few thousand tokens of ordinary text) under FP8 against the same model unquantized in
--dtype, in one run. Per arm: mean and max |delta log-prob| per token, and greedy agreement
(the share of positions whose likeliest next token is the same).

Arms: `fp8` (`--quantization fp8`: per-channel weights, per-token inputs, as vLLM's
`--quantization fp8` does), `fp8-weights` (the projections' weights in FP8, per tensor, the
inputs left in --dtype: what the inputs' quantization costs on top), `kv-fp8`
(`--kv-cache-dtype fp8`: the KV in e4m3, scale 1), `both` (`fp8` and `kv-fp8`), and `float32`
(the model in float32: the yardstick of a 16-bit dtype's own rounding). The text: --text, else the
GPL-3 licence Debian ships (plain English prose), else this project's README.

One JSON line per arm. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.checkpoints.gguf_checkpoint import resolve_model_dir  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.tiny_model import make_fp8_model  # noqa: E402

TEXTS = (Path("/usr/share/common-licenses/GPL-3"), Path(__file__).resolve().parents[2] / "README.md")
ARMS = ("fp8", "fp8-weights", "kv-fp8", "both", "float32")


def per_token(model_dir: str, dtype: str, tokens: list[int], quantization: str | None = None,
              kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability after the ones before it, and the likeliest token there."""
    config = EngineConfig(model_dir=model_dir, dtype=dtype, quantization=quantization,
                          cache=CacheConfig(block_size=16, num_blocks=len(tokens) // 16 + 8,
                                            kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512), max_model_len=len(tokens) + 16)
    engine = LLMEngine(config)
    [out] = engine.generate([tokens], SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1))
    logprobs = torch.tensor([e.logprob for e in out.prompt_logprobs])
    top = torch.tensor([e.top.token_ids[0] for e in out.prompt_logprobs])
    return logprobs, top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory or .gguf file (default: the embedded one)")
    ap.add_argument("--text", default=None, help="a text file (default: the GPL-3 licence, else the README)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.model is None:
        from cluster.default_model import model_path

        args.model = model_path(None)
    model_dir = str(resolve_model_dir(args.model))
    text_path = Path(args.text) if args.text else next(p for p in TEXTS if p.is_file())
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(text_path.read_text()).ids
    tokens = tokens[: args.tokens]
    base_lp, base_top = per_token(model_dir, args.dtype, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms.split(","):
            t0 = time.perf_counter()
            if arm == "fp8":
                lp, top = per_token(model_dir, args.dtype, tokens, "fp8")
            elif arm == "fp8-weights":
                lp, top = per_token(str(make_fp8_model(model_dir, Path(tmp) / "w8", "ct-weights-only")), args.dtype,
                                    tokens)
            elif arm == "kv-fp8":
                lp, top = per_token(model_dir, args.dtype, tokens, kv_cache_dtype="fp8")
            elif arm == "both":
                lp, top = per_token(model_dir, args.dtype, tokens, "fp8", "fp8")
            elif arm == "float32":
                lp, top = per_token(model_dir, "float32", tokens)
            else:
                sys.exit(f"--arms: one of {ARMS}, not {arm!r}")
            delta = (lp - base_lp).abs()
            print(json.dumps({
                "bench": "fp8_quality", "arm": arm, "baseline": args.dtype, "model": Path(model_dir).name,
                "text": text_path.name, "tokens": len(tokens),
                "mean_abs_delta_logprob": round(float(delta.mean()), 4),
                "max_abs_delta_logprob": round(float(delta.max()), 4),
                "p99_abs_delta_logprob": round(float(delta.quantile(0.99)), 4),
                "greedy_agreement": round(float((top == base_top).float().mean()), 4),
                "seconds": round(time.perf_counter() - t0, 1),
            }), flush=True)


if __name__ == "__main__":
    main()
