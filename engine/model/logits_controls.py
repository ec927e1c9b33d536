"""The sampling controls that change a request's logits before it samples: logit_bias,
min_tokens, and the repetition, frequency and presence penalties.

Order (vLLM's): bias first, then min_tokens (EOS and stop tokens at -inf while the output is
shorter), then the repetition penalty over the prompt's and the output's tokens (a positive
logit divided by it, a negative one multiplied), then frequency and presence over the output's
(logit -= frequency * count + presence * (count > 0)). A request's controls read only its
own tokens (`Request.all_token_ids`, `output_token_ids`, and the prompt's last
`output_prefix`, a retry's tokens already sent), so the first token drawn on a prefill worker
and the next ones on a decode worker, or on a retry, see the same controls. min_p is applied with the
temperature, in `Sampler.probs`. Log-probabilities are reported from the raw logits, as vLLM
reports them by default.
"""
from __future__ import annotations

import torch

from engine.core.request import Request


def controlled(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The logits [rows, vocab] with each row's request's controls applied (a new tensor;
    `logits` itself where no request has any)."""
    rows = [i for i, r in enumerate(requests) if r.params.controls_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        r, p = requests[i], requests[i].params
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype,
                                                device=row.device))
        if len(r.output_token_ids) < p.min_tokens:
            stops = [t for t in (*r.eos_token_ids, *p.stop_token_ids) if t < vocab]
            if stops:
                row[torch.tensor(stops, dtype=torch.long, device=row.device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.all_token_ids)), dtype=torch.long, device=row.device)
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        output = r.output_token_ids if not p.output_prefix else \
            r.prompt_token_ids[len(r.prompt_token_ids) - p.output_prefix:] + r.output_token_ids
        if (p.frequency_penalty or p.presence_penalty) and output:
            counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=row.device),
                                    minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def apply_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Each row's probabilities below min_p times its largest set to 0, the rest scaled to sum
    to 1 again (rows of min_p 0: unchanged)."""
    if not any(min_p):
        return probs
    cut = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None] * probs.amax(dim=-1, keepdim=True)
    kept = probs.masked_fill(probs < cut, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)
