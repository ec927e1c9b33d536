"""`splitserve make-tiny-model`: a deterministic test checkpoint, or a speculative-decoding draft
of any checkpoint (its first N layers)."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("make-tiny-model", help="write a deterministic HF-format test checkpoint")
    p.add_argument("dir")
    p.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "mistral", "gemma3",
                                           "phi3", "gemma2"),
                   default="llama",
                   help="(engine.model.tiny_model.ARCHS)")
    p.add_argument("--size", choices=("tiny", "small", "llama3-8b"), default="tiny",
                   help="llama3-8b: Llama-3.1-8B shapes, random bfloat16 weights (16 GB) for GPU measurements")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-of", metavar="MODEL",
                   help="instead, write a speculative-decoding draft of MODEL (a directory, a .gguf file, or "
                        "`default`: the embedded model): its first --draft-layers layers")
    p.add_argument("--draft-layers", type=int, default=1)
    p.set_defaults(func=_make_tiny_model)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from engine.model.tiny_model import make_draft_model, make_tiny_model

    if args.draft_of:
        from cluster.default_model import model_path

        try:
            target = model_path(None if args.draft_of == "default" else args.draft_of)
            out = make_draft_model(target, args.dir, args.draft_layers)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote a {args.draft_layers}-layer draft of {args.draft_of} to {out} "
              f"(serve it with --speculative draft:{out})")
        return 0
    out = make_tiny_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} checkpoint (seed {args.seed}) to {out}")
    return 0
