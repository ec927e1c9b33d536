"""Where FP8's cost in quality comes from, on a real model: the same teacher-forced measure as
benchmarks/engine/fp8_quality.py (each token's log-probability over a few thousand tokens of
ordinary text against the unquantized model: mean |delta log-prob|, greedy agreement), with
the rounding applied to transformers' model of the checkpoint piece by piece, so each source is
measured alone and against what better rounding would buy:

  weights          every projection's weight in e4m3, a scale per output channel (RTN)
  proj:NAME        one kind of projection only (q_proj ... down_proj)
  layer:N          one decoder layer's projections only
  noise:EPS        no FP8: the weights times (1 + EPS * N(0, 1)); e4m3's rounding is ~3.6 % RMS
  gptq             the weights in e4m3 with error compensation (GPTQ: each column's rounding
                   error spread over the columns not yet rounded, weighted by the inputs'
                   second moments), calibrated on --calibration (other text than the one measured)
  w8a8, gptq-w8a8  those weights with each projection's input in e4m3, a scale per token
  kv, k, v         keys and values (or one of them) in e4m3 after the rotary embedding, scale 1
                   (what `--kv-cache-dtype fp8` stores)
  kv-head          the same with a scale per KV head (absmax over the text)
  kv-prerope       keys and values rounded before the rotary embedding (k_proj / v_proj outputs)
  both, gptq-both  w8a8 (or gptq-w8a8) and kv together
  best             gptq-w8a8 and kv-prerope together: the least this script can make of both

    ./dev python -m benchmarks.engine.fp8_error_sources [--arms weights,gptq,kv,both] [--dtype float32]

One JSON line per arm: the config, and per text (the measured one and --text2) mean and max
|delta log-prob| and greedy agreement. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.checkpoints.gguf_checkpoint import resolve_model_dir  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ARMS = ("weights", "noise:0.03", "gptq", "w8a8", "gptq-w8a8", "kv", "k", "v", "kv-head", "kv-prerope", "both",
        "gptq-both", "best")
TEXTS = (Path("/usr/share/common-licenses/GPL-3"), Path("/usr/share/common-licenses/Apache-2.0"))


def rounded(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x through e4m3 and back at `scale` (values beyond the format's range saturate)."""
    return ((x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale).to(x.dtype)


def channel_scale(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # [out, 1]


def gptq(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """`w` [out, in] rounded to e4m3 column by column, each column's error moved onto the columns
    after it through the inverse of `hessian` [in, in] (2 X^T X of the layer's inputs)."""
    w, h = w.clone(), hessian.clone()
    scale = channel_scale(w)
    dead = torch.diag(h) == 0
    h[dead, dead], w[:, dead] = 1.0, 0.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0])
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.zeros_like(w)
    for a in range(0, w.shape[1], block):
        b = min(a + block, w.shape[1])
        part, errors, inv = w[:, a:b].clone(), torch.zeros(w.shape[0], b - a), inverse[a:b, a:b]
        for i in range(b - a):
            column = part[:, i:i + 1]
            out[:, a + i:a + i + 1] = q = rounded(column, scale)
            errors[:, i:i + 1] = e = (column - q) / inv[i, i]
            part[:, i:] -= e @ inv[i:i + 1, i:]
        w[:, b:] -= errors @ inverse[a:b, b:]
    return out


class Rounding:
    """transformers' model of a checkpoint with FP8 rounding switched on piece by piece."""

    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AttentionInterface, AutoModelForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def attention(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object,
                      **kw: object) -> object:  # k, v: [batch, kv_heads, tokens, head_dim], after the rotary
            return sdpa_attention_forward(module, q, self.keys(k), self.values(v), mask, **kw)

        AttentionInterface.register("fp8_rounding", attention)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                          attn_implementation="fp8_rounding").eval()
        self.dtype = dtype
        self.linears = {n: m for n, m in self.model.named_modules()
                        if n.endswith("proj") and isinstance(m, torch.nn.Linear)}
        self.original = {n: m.weight.detach().clone() for n, m in self.linears.items()}
        self.keys: Callable[[torch.Tensor], torch.Tensor] = lambda k: k
        self.values: Callable[[torch.Tensor], torch.Tensor] = lambda v: v
        self.inputs_in_fp8 = False
        self.prerope = False
        for name, m in self.linears.items():
            m.register_forward_pre_hook(self._input)
            if name.endswith(("k_proj", "v_proj")):
                m.register_forward_hook(self._projected)

    def _input(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor] | None:
        if not self.inputs_in_fp8:
            return None
        x = args[0]
        return (rounded(x, x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX),)

    def _projected(self, module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        return rounded(out, 1.0) if self.prerope else None

    def reset(self) -> None:
        with torch.no_grad():
            for n, m in self.linears.items():
                m.weight.copy_(self.original[n])
        self.keys = self.values = lambda x: x
        self.inputs_in_fp8 = self.prerope = False

    def set_weights(self, weight_of: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        with torch.no_grad():
            for n, m in self.linears.items():
                m.weight.copy_(weight_of(n, self.original[n].float()).to(self.dtype))

    def hessians(self, tokens: torch.Tensor, chunk: int = 1024) -> dict[str, torch.Tensor]:
        """2 X^T X / n of each projection's inputs over `tokens` (the unquantized model)."""
        sums: dict[str, torch.Tensor] = {}

        def hook(name: str) -> Callable[..., None]:
            def add(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
                sums[name] = sums.get(name, 0) + 2 * x.T @ x / tokens.shape[1]
            return add

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in self.linears.items()]
        with torch.no_grad():
            for i in range(0, tokens.shape[1], chunk):
                self.model(tokens[:, i:i + chunk])
        for h in handles:
            h.remove()
        return sums

    def logprobs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's log-probability after the ones before it, and the likeliest token there."""
        with torch.no_grad():
            logp = self.model(tokens).logits[0, :-1].float().log_softmax(-1)  # [tokens - 1, vocab]
        return logp.gather(1, tokens[0, 1:, None])[:, 0], logp.argmax(-1)


def rtn(name: str, w: torch.Tensor) -> torch.Tensor:
    return rounded(w, channel_scale(w))


def noisy(eps: float) -> Callable[[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return lambda name, w: w * (1 + eps * torch.randn(w.shape, generator=generator))


KINDS = {"weights", "gptq", "w8a8", "gptq-w8a8", "kv", "k", "v", "kv-head", "kv-prerope", "both", "gptq-both",
         "best", "proj", "layer", "noise"}


def apply(r: Rounding, arm: str, gptq_weights: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Switches on the rounding `arm` names (after `r.reset()`)."""
    kind, _, arg = arm.partition(":")
    if kind not in KINDS:
        raise SystemExit(f"unknown arm {arm!r}: one of {sorted(KINDS)} (proj, layer and noise take ':VALUE')")
    if kind in ("weights", "w8a8", "both"):
        r.set_weights(rtn)
    elif kind in ("gptq", "gptq-w8a8", "gptq-both", "best"):
        done = gptq_weights()
        r.set_weights(lambda name, w: done[name])
    elif kind == "proj":
        r.set_weights(lambda name, w: rtn(name, w) if name.endswith(arg) else w)
    elif kind == "layer":
        r.set_weights(lambda name, w: rtn(name, w) if f"layers.{int(arg)}." in name else w)
    elif kind == "noise":
        r.set_weights(noisy(float(arg)))
    r.inputs_in_fp8 = kind in ("w8a8", "gptq-w8a8", "both", "gptq-both", "best")
    if kind in ("kv", "k", "both", "gptq-both"):
        r.keys = lambda k: rounded(k, 1.0)
    if kind in ("kv", "v", "both", "gptq-both"):
        r.values = lambda v: rounded(v, 1.0)
    if kind == "kv-head":
        def per_head(x: torch.Tensor) -> torch.Tensor:  # [batch, kv_heads, tokens, head_dim]
            return rounded(x, x.float().abs().amax(dim=(0, 2, 3), keepdim=True).clamp(min=1e-12) / E4M3_MAX)
        r.keys = r.values = per_head
    r.prerope = kind in ("kv-prerope", "best")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model directory or .gguf file (default: the embedded one)")
    ap.add_argument("--text", default=str(TEXTS[0]), help="the text measured")
    ap.add_argument("--text2", default=str(TEXTS[1]), help="a second text measured")
    ap.add_argument("--calibration", default=str(Path(__file__).resolve().parents[2] / "docs"),
                    help="GPTQ's calibration text: a file, or a directory of .md files (default: this project's docs)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; also proj:NAME, layer:N, noise:EPS")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.model is None:
        from cluster.default_model import model_path

        args.model = model_path(None)
    model_dir = str(resolve_model_dir(args.model))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))

    def tokens_of(text: str, n: int) -> torch.Tensor:
        return torch.tensor([tokenizer.encode(text).ids[:n]])

    calibration = Path(args.calibration)
    calibration_text = "\n".join(p.read_text() for p in sorted(calibration.glob("*.md"))) if calibration.is_dir() \
        else calibration.read_text()
    texts = {Path(t).name: tokens_of(Path(t).read_text(), args.tokens) for t in (args.text, args.text2)}
    r = Rounding(model_dir, getattr(torch, args.dtype))
    base = {name: r.logprobs(t) for name, t in texts.items()}
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def gptq_weights() -> dict[str, torch.Tensor]:
        if not cache:
            hessians = r.hessians(tokens_of(calibration_text, args.calibration_tokens))
            cache.update({n: gptq(r.original[n].float(), hessians[n]) for n in r.linears})
        return cache

    config = {"model": Path(model_dir).name, "dtype": args.dtype, "tokens": args.tokens,
              "calibration": calibration.name, "calibration_tokens": args.calibration_tokens}
    for arm in args.arms.split(","):
        t0 = time.perf_counter()
        r.reset()
        apply(r, arm, gptq_weights)
        line: dict[str, object] = {"bench": "fp8_error_sources", "arm": arm, **config}
        for name, t in texts.items():
            logp, top = r.logprobs(t)
            delta = (logp - base[name][0]).abs()
            line[name] = {"mean_abs_delta_logprob": round(delta.mean().item(), 4),
                          "max_abs_delta_logprob": round(delta.max().item(), 3),
                          "greedy_agreement": round((top == base[name][1]).float().mean().item(), 4)}
        line["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
