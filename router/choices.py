"""The output side of a request of n choices (`SamplingParams.n`; engine/core/forks.py forks them):
one `Responses` a choice, each with its own detokenizer and stop strings.

Every choice's replies carry its index (`Reply.choice`); each choice's last one
carries its finish reason and usage, the prompt's tokens counted on choice 0 only, so summed
usage counts the prompt once. Choice 0 counts in the request's progress (admission, metrics,
the route); the others in copies of it. A choice a stop string ended here sends nothing more,
whatever its worker still sends; the request is over when every choice is.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.request import FinishReason
from proto import generate_pb2 as pb
from router.attempt import Prepared, Progress
from router.frontend import ItlWindow, Responses
from router.reply import Reply


class Choices:
    def __init__(self, prep: Prepared, progress: Progress, detoks: Sequence[IncrementalDetokenizer | None],
                 itl: ItlWindow | None = None) -> None:
        self.outs = [Responses(prep, progress if i == 0 else dataclasses.replace(progress, token_ids=[]), d,
                               itl if i == 0 else None) for i, d in enumerate(detoks)]
        self.done = [False] * len(self.outs)

    @property
    def finished(self) -> bool:
        return all(self.done)

    @property
    def started(self) -> bool:
        """Some choice has sent tokens."""
        return any(o.progress.num_sent for o in self.outs)

    def tokens(self, choice: int, token_ids: list[int], logprobs: list[float], reason: FinishReason | None,
               top: Sequence[pb.TopLogprobs] = (), prompt: pb.PromptLogprobs | None = None) -> list[Reply]:
        """The replies to send for new tokens of `choice`: one with them (cut at a stop string)
        if any, and its final one when it ends; none once it has ended."""
        if not 0 <= choice < len(self.outs) or self.done[choice]:
            return []
        out = self.outs[choice]
        reply, done = out.tokens(token_ids, logprobs, reason, top, prompt if choice == 0 else None)
        reply.choice = choice
        sent = [reply] if reply.token_ids or done else []
        if done:
            self.done[choice] = True
            final = out.final(reply.finish_reason)
            final.choice = choice
            if choice:  # the prompt counts once, on choice 0; the times are the request's
                assert final.usage is not None
                final.usage = dataclasses.replace(final.usage, prompt_tokens=0, cached_tokens=0)
                final.timing = self.outs[0].timing()
            sent.append(final)
        return sent
