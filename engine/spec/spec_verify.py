"""Speculative decoding, the verifying half: which proposed tokens the target model keeps.

    model logits [1 + k rows per speculating request] (the request's last token and its k
        proposals, computed as one chunk) --verify--> Verified: the tokens to append (the
        accepted proposals, then one of the target's own), how many proposals were kept

Row j is the target's distribution p_j for the token after the first j proposals. Greedy:
proposal j is kept while it equals argmax p_j, and the target's argmax at the first
mismatch (or after the last proposal) follows, so the output is token for token what
decoding one token a step gives.

Sampling, proposals that are single tokens (n-gram lookup, a greedy draft: q_j all on d_j):
the token at each position is drawn exactly as without speculation (the sampler's
exponential race on the request's random stream for that position), and proposal d_j is
kept when the draw is d_j. That is rejection sampling with q a point mass (d_j is kept with
probability p_j(d_j), and otherwise the draw follows p_j without d_j, renormalised), and
since it is the very draw a plain step makes, a seeded request gets the same tokens with
speculation or without, however many tokens are proposed and on whichever worker it runs.

Sampling, proposals with distributions q_j (a draft model that samples): d_j is kept with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token is drawn from the
residual max(p_j - q_j, 0), renormalised; if all are kept, one is drawn from p_k. Every
token follows p exactly either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.request import Logprob, Request, TopLogprobs
from engine.model.logits_controls import controlled
from engine.model.sampler import Sampler, greedy


@dataclass
class Verified:
    tokens: list[tuple[int, float | Logprob | None]]
    """(token id, logprob or None) to append, in order: 1 + num_accepted of them."""
    num_accepted: int
    """Proposals kept."""


def verify(sampler: Sampler, logits: torch.Tensor, request: Request, proposals: list[int],
           proposal_probs: torch.Tensor | None = None) -> Verified:
    """logits: [1 + k, vocab] float32, the target's rows for this request; proposals: k tokens;
    proposal_probs: [k, vocab] the proposer's distributions (None: each all on its token)."""
    k = len(proposals)
    assert not request.params.reads_history  # such a request never speculates (Speculator.propose)
    raw, logits = logits, controlled(logits, [request] * logits.shape[0])  # its logit_bias: the same at every row
    if request.params.greedy:
        target = greedy(logits).tolist()
        kept = 0
        while kept < k and proposals[kept] == target[kept]:
            kept += 1
        chosen = target[: kept + 1]
    else:
        chosen = _rejection_sample(sampler, logits, request, proposals, proposal_probs)
        kept = len(chosen) - 1
    logprobs: list[float | Logprob | None] = [None] * len(chosen)
    if request.params.logprobs:
        rows = torch.log_softmax(raw[: len(chosen)], dim=-1)
        logprobs = rows.gather(1, torch.tensor(chosen, device=logits.device)[:, None])[:, 0].tolist()
        if k_top := request.params.top_logprobs:
            values, ids = rows.topk(k_top, dim=-1)
            logprobs = [Logprob(lp, TopLogprobs(tuple(i), tuple(v)))  # type: ignore[misc]
                        for lp, i, v in zip(logprobs, ids.tolist(), values.tolist(), strict=True)]
    return Verified(list(zip(chosen, logprobs, strict=True)), kept)


def _rejection_sample(sampler: Sampler, logits: torch.Tensor, request: Request, proposals: list[int],
                      proposal_probs: torch.Tensor | None) -> list[int]:
    p = sampler.probs(logits, [request] * logits.shape[0])  # [1 + k, vocab]
    start = request.num_tokens  # the position of the first token this step adds
    out: list[int] = []
    if proposal_probs is None:  # the plain draw at each position; kept while it is the proposal
        for j in range(len(proposals) + 1):
            out.append(_draw(p[j], sampler.generator_for(request, start + j)))
            if j == len(proposals) or out[-1] != proposals[j]:
                return out
    assert proposal_probs is not None
    for j, d in enumerate(proposals):
        gen = sampler.generator_for(request, start + j)
        u = torch.rand((), generator=gen, device=logits.device).item()
        q = proposal_probs[j]
        q_d = float(q[d])
        if q_d > 0 and u * q_d < float(p[j, d]):
            out.append(d)
            continue
        residual = (p[j] - q).clamp_min_(0.0)
        out.append(_draw(residual if float(residual.sum()) > 0 else p[j], gen))
        return out
    out.append(_draw(p[len(proposals)], sampler.generator_for(request, start + len(proposals))))
    return out


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """One token with probability proportional to `weights` (the exponential race, as the sampler)."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    return int((weights / noise).argmax())
