"""`splitserve` command line.

  splitserve make-tiny-model DIR [--arch llama|qwen2] [--size tiny|small] [--seed N]
  splitserve generate PROMPT [--model DIR] [--max-tokens N] [--temperature T] ...

Until the cluster exists, `generate` runs the engine offline in this process and
streams the completion to the terminal.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time


def _make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} checkpoint (seed {args.seed}) to {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from cluster.default_model import default_model_dir
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams
    from engine.types import EngineError

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(default_model_dir())
    try:
        engine = LLMEngine(EngineConfig(model_dir=model_dir, dtype=args.dtype,
                                        cache=CacheConfig(block_size=args.block_size)))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        start = time.perf_counter()
        request_id = engine.add_request(args.prompt, params)
    except (EngineError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    num_tokens, reason = 0, None
    print(args.prompt, end="", flush=True)
    while engine.has_unfinished():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            num_tokens += len(out.new_token_ids)
            reason = out.finish_reason
    elapsed = time.perf_counter() - start
    print(f"\n[{request_id}] {num_tokens} tokens in {elapsed:.2f} s, finish reason "
          f"{reason.value if reason else None}, model {model_dir}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a deterministic HF-format test checkpoint")
    p.add_argument("dir")
    p.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--size", choices=("tiny", "small"), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_model)

    g = sub.add_parser("generate", help="stream a completion (offline engine for now)")
    g.add_argument("prompt")
    g.add_argument("--model", help="model directory (default: the embedded tiny model)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    g.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
