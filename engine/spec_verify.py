"""Speculative decoding, the verifying half: which proposed tokens the target model keeps.

    model logits [1 + k rows per speculating request] (the request's last token and its k
        proposals, computed as one chunk) --verify--> Verified: the tokens to append (the
        accepted proposals, then one of the target's own), how many proposals were kept

Row j is the target's distribution p_j for the token after the first j proposals. Greedy:
proposal j is kept while it equals argmax p_j, and the target's argmax at the first
mismatch (or after the last proposal) follows, so the output is token for token what
decoding one token a step gives. Sampling (rejection sampling, exact): proposal d_j drawn
from q_j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a
token is drawn from the residual max(p_j - q_j, 0), renormalised; if all are kept, one is
drawn from p_k. Every token then follows p exactly, whatever the proposer. A proposer that
is a lookup (n-gram) gives q_j all on d_j; a draft model may give its distributions.

The random numbers of the token at position t come from the request's stream for t
(`Sampler.generator_for`): a seeded request gets the same tokens from the same proposals
on whichever worker it runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.sampler import Sampler, greedy


@dataclass
class Verified:
    tokens: list[tuple[int, float | None]]
    """(token id, logprob or None) to append, in order: 1 + num_accepted of them."""
    num_accepted: int
    """Proposals kept."""


def verify(sampler: Sampler, logits: torch.Tensor, request: Request, proposals: list[int],
           proposal_probs: torch.Tensor | None = None) -> Verified:
    """logits: [1 + k, vocab] float32, the target's rows for this request; proposals: k tokens;
    proposal_probs: [k, vocab] the proposer's distributions (None: each all on its token)."""
    k = len(proposals)
    if request.params.greedy:
        target = greedy(logits).tolist()
        kept = 0
        while kept < k and proposals[kept] == target[kept]:
            kept += 1
        chosen = target[: kept + 1]
    else:
        chosen = _rejection_sample(sampler, logits, request, proposals, proposal_probs)
        kept = len(chosen) - 1
    logprobs: list[float | None] = [None] * len(chosen)
    if request.params.logprobs:
        rows = torch.log_softmax(logits[: len(chosen)], dim=-1)
        logprobs = rows.gather(1, torch.tensor(chosen, device=logits.device)[:, None])[:, 0].tolist()
    return Verified(list(zip(chosen, logprobs, strict=True)), kept)


def _rejection_sample(sampler: Sampler, logits: torch.Tensor, request: Request, proposals: list[int],
                      proposal_probs: torch.Tensor | None) -> list[int]:
    p = sampler.probs(logits, [request] * logits.shape[0])  # [1 + k, vocab]
    start = request.num_tokens  # the position of the first token this step adds
    out: list[int] = []
    for j, d in enumerate(proposals):
        gen = sampler.generator_for(request, start + j)
        u = torch.rand((), generator=gen, device=logits.device).item()
        q = None if proposal_probs is None else proposal_probs[j]
        q_d = 1.0 if q is None else float(q[d])
        if q_d > 0 and u * q_d < float(p[j, d]):
            out.append(d)
            continue
        residual = p[j].clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = (residual - q).clamp_min_(0.0)
        out.append(_draw(residual if float(residual.sum()) > 0 else p[j], gen))
        return out
    out.append(_draw(p[len(proposals)], sampler.generator_for(request, start + len(proposals))))
    return out


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """One token with probability proportional to `weights` (the exponential race, as the sampler)."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    return int((weights / noise).argmax())
