"""Constrainer: structured output inside an engine step (engine/structured/grammars.py has the grammars).

    LLMEngine._new_request: `start(request)` gives a constrained request its matcher, which
        takes the prompt's last `constraint_prefix` tokens (generated under it on an earlier try)
    Speculator.propose: `valid_proposals` cuts a request's proposals where the constraint
        would reject them
    after the model ran: `mask(logits, requests, num_spec)` sets every forbidden token's logit
        to -inf in each constrained request's rows (with proposals, row j under the state
        after the first j of them: consumed, masked, rolled back), so greedy, sampling and
        verification only ever pick allowed tokens
    after the scheduler appended tokens (a decode worker's first one too, from the prefill
        worker): `advance(request, tokens)`; True when the constraint is complete and allows
        nothing but the end (the request stops there)
"""
from __future__ import annotations

import torch

from engine.core.request import Request
from engine.structured.grammars import Grammars, consume
from engine.types import InvalidRequestError, RequestId


class Constrainer:
    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars

    def start(self, request: Request) -> None:
        c = request.params.constraint
        if c is None:
            return
        matcher = self.grammars.matcher(c)
        n = request.params.constraint_prefix
        if n > request.num_prompt_tokens:
            raise InvalidRequestError(f"constraint_prefix {n} is longer than the prompt "
                                      f"({request.num_prompt_tokens} tokens)")
        consume(matcher, request.prompt_token_ids[request.num_prompt_tokens - n:], "the prompt's constrained tokens")
        request.matcher = matcher

    @staticmethod
    def valid_proposals(request: Request, tokens: list[int]) -> list[int]:
        if request.matcher is None or not tokens:
            return tokens
        return tokens[: request.matcher.validate_tokens(tokens)]  # type: ignore[attr-defined]

    @torch.inference_mode()
    def mask(self, logits: torch.Tensor, requests: list[Request], num_spec: dict[RequestId, int]) -> None:
        plain: list[tuple[object, int]] = []  # (matcher, its row): one parallel mask computation
        row = 0
        for r in requests:
            k = num_spec.get(r.request_id, 0)
            if r.matcher is not None and not k:
                plain.append((r.matcher, row))
            elif r.matcher is not None:
                m = r.matcher
                for j in range(k + 1):
                    if j:
                        m.consume_token(r.spec_token_ids[j - 1])  # type: ignore[attr-defined]
                    self._forbid(logits[row + j], m)
                m.rollback(k)  # type: ignore[attr-defined]
            row += 1 + k
        if plain:
            allowed = torch.from_numpy(self.grammars.allowed_rows([m for m, _ in plain]))  # [n, vocab] bool
            rows = torch.tensor([i for _, i in plain], device=logits.device)
            v = allowed.shape[1]
            logits[rows, :v] = logits[rows, :v].masked_fill(~allowed.to(logits.device), float("-inf"))
            logits[rows, v:] = float("-inf")

    def _forbid(self, row: torch.Tensor, matcher: object) -> None:
        allowed = torch.from_numpy(self.grammars.allowed_rows([matcher])[0])  # type: ignore[list-item]
        row[: allowed.shape[0]].masked_fill_(~allowed.to(row.device), float("-inf"))
        row[allowed.shape[0]:] = float("-inf")

    @staticmethod
    def advance(request: Request, tokens: list[int]) -> bool:
        """The matcher takes the request's new tokens; True when the constraint is complete and
        nothing but the end may follow."""
        m = request.matcher
        if m is None or not tokens:
            return False
        consume(m, tokens, "sampled tokens")  # type: ignore[arg-type]
        return bool(m.is_stopped())  # type: ignore[attr-defined]
