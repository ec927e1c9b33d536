"""WaitForecast (pure, injected clock): when the admitted requests give their tokens back,
and so when each queued request will be admitted.

    AdmissionQueue._admit --admitted(id, cost, new_tokens)--> Running (one per admitted request)
    servicer, per response --progress(id, num_generated)--> Running.first_at / last_at / num_generated
    AdmissionQueue.release --finished(id)--> calibration: the time from admission to the first
        token, the time per output token, the output really generated over what was charged (EMA)
    AdmissionQueue --admission_times(queue in service order, free tokens, ...)--> per queued
        request, the time the replay below admits it

A token budget frees in clumps: requests admitted together finish together, so a drain rate
measured from past releases swings between bursts and silence, and a queued request's wait
depends on *which* admitted requests finish before its turn, not on an average. So the
forecast replays the future instead: each running request finishes after its remaining
expected tokens; in order of finish time their tokens come back; the queue, in its service
order (head of line: a later small request never overtakes), is admitted as the tokens and
request slots allow, and each request admitted in the replay finishes in turn.

How long tokens take depends on the load, and a burst is exactly when the load is unlike
the recent past. So both times are fitted against load (`LinearFit`, recent samples weigh
most): the time per output token against the number of admitted requests streaming (the
decode batch), one sample per finished request (its mean over its life: a single response's
gap says more about the router's own loop than about the workers); the time from admission to the first token against
the number of admitted requests still waiting for theirs (the prefill queue ahead), from
every first token. The replay evaluates them at the load it has at each step. Until a
request that streamed two tokens finished nothing is calibrated and the forecast says None.

A line fitted on the small batches seen so far is a poor guide to a burst several times
larger. Where the decode workers report their step time (`set_step_model`: their start-up
profile over every batch size they may run, engine/step_profile.py, or else a + b·requests
+ c·KV tokens fitted on the decode steps they ran, engine/core/step_model.py), it gives the
time per token at each worker's share of the replay's requests and of their KV, and the
router's own samples give only its scale (what the router sees beyond the workers' steps):
the median, over the last `SCALE_SAMPLES` finished requests (those the model describes:
`SCALE_RANGE`), of what each measured over what the current model says at its load.
Recomputed whenever the model changes, the scale is there from the first model a worker
reports, and one slow request does not move it.

A second term was tried and measured worse: t ≈ α·model + β·requests streaming (each token
is a response the worker sends, the router relays and the client reads, a cost per request
no step profile holds), fitted in relative least squares on the same samples. Here (1 P +
1 D on 2 cores with the router and 200 client threads) that overhead grew from 1 to 16
requests faster than from 16 to 57 in some runs and slower in others; fitted between the
warm-up's 1 and 16, the slope overestimated each burst of 57 by 20-30 % (ratio <= 0.7 in 3
of 6 runs of benchmarks/hostile/admission_burst.py), where the single scale erred low by 15-50 % in
1 or 2 runs of 6.

So was the worker fitting the rest of its period over the profile (period = profile step +
a + b·requests, the step's own loop and sends): timed per step in that benchmark, the rest
is 0.16 ms a request at 16 and 0.08 at 56 (sends overlap the next forward), while the
forward itself ran 1.8x its profile in the burst (the prefill worker busy on the same
cores); the line from the warm-up overstated the burst by 30-45 % in 3 of 4 runs.
"""
from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.step_model import StepShape
from engine.core.fit import LinearFit

EMA_WEIGHT = 0.2
"""Weight of the newest finished request in the output-fraction average, once it has
1 / EMA_WEIGHT samples; before that, their mean (an average started at its prior of 1 and
moved a fifth of the way per sample still held a third of that prior after five: chats
charged the prior 256 tokens and stopping after 1-54 (mean 0.08 of the charge) were
forecast at 0.40 of it, a burst of 64 such chats at five times its real wait, and refused)."""
MAX_OUTPUT_FRACTION = 16.0
"""A finished request's output over what it was charged counts at most this much: charged
its expected output, a request may run far past it (its max_tokens bounds it anyway)."""
TOKEN_DECAY = 0.97
"""Per-token time samples (one per finished request): about the last 30 count."""
FIRST_TOKEN_DECAY = 0.97
"""First-token samples (one per request): about the last 30 count."""
SCALE_SAMPLES = 32
"""Finished requests the step model's scale is taken from."""
SCALE_RANGE = (1 / 16, 16.0)
"""A finished request's time per token over the step model's at its load, outside this range,
says the model does not describe that load, and the sample does not set the scale. The router
sees each token a worker's whole loop after the last (its step, sampling, sending) plus its
own relaying: 4.9-5.4 times an idle start-up profile's forward in benchmarks/hostile/admission_burst.py
here, more on a busier machine. A line fitted on a few steps can say a step at a load it has
not seen takes almost nothing (a negative intercept makes one request's step ~0): 5 ms
measured over that gave a scale of ~50,000, which the busier replay load turned into 200 s a
token and a queued request refused as 80,000 s from admission."""
MIN_STEP_S = 1e-5
"""A step model's time under this (no decode step is that short) is read as no answer: the
line was extrapolated past its steps."""


@dataclass
class Running:
    """One admitted request, as far as the forecast knows it."""

    cost_tokens: int
    new_tokens: int
    """The output tokens it is charged at admission (router/admission.py `expected_output`)."""
    admitted_at: float
    max_new_tokens: int = 0
    """The most it may generate (its max_tokens within the context)."""
    ahead: int = 0
    """Admitted requests still waiting for their first token when it was admitted."""
    num_generated: int = 0
    first_at: float | None = None
    last_at: float | None = None
    streaming_sum: int = 0
    """The requests streaming at each of its responses after the first, summed (its batch)."""
    kv_sum: int = 0
    """The admitted requests' KV tokens at each of those responses, summed."""
    num_responses: int = 0
    prompt_tokens: int = field(init=False)
    """Its uncached prompt (the cost at admission less the output charged)."""

    def __post_init__(self) -> None:
        self.prompt_tokens = max(self.cost_tokens - self.new_tokens, 0)


@dataclass(frozen=True)
class Queued:
    request_id: str
    cost_tokens: int
    new_tokens: int
    admit_by: float = float("inf")
    """Admitted later than this it is refused instead (its deadline or the queue's wait limit):
    the replay gives it no tokens, so the requests behind it move up."""

    @property
    def prompt_tokens(self) -> int:
        return max(self.cost_tokens - self.new_tokens, 0)


class WaitForecast:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.running: dict[str, Running] = {}
        self.first_token_s = LinearFit(FIRST_TOKEN_DECAY)
        """Admission to first token, against the requests ahead still waiting for theirs."""
        self.token_s = LinearFit(TOKEN_DECAY, floor=1e-4)
        """Time per output token after the first, against the number of requests streaming."""
        self.num_awaiting = 0
        """Admitted requests whose first token has not come yet."""
        self.output_fraction = 1.0
        """Output tokens generated over `new_tokens` (EMA): below 1 when requests stop early."""
        self._fraction_samples = 0
        self.kv_tokens = 0
        """The admitted requests' prompts and tokens generated so far."""
        self.step_model: StepShape | None = None
        self.num_decode_workers = 1
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=SCALE_SAMPLES)
        """The last finished requests' (requests streaming, KV tokens, seconds per token), means
        over their lives, the loads per decode worker."""
        self._model_scale: float | None = None
        """Measured time per token over the step model's at the same load (the samples' median)."""

    def set_step_model(self, model: StepShape | None, num_decode_workers: int) -> None:
        if (model, max(num_decode_workers, 1)) != (self.step_model, self.num_decode_workers):
            self.step_model, self.num_decode_workers = model, max(num_decode_workers, 1)
            self._rescale()

    def _rescale(self) -> None:
        low, high = SCALE_RANGE
        ratios = [t / model for n, kv, t in self._samples
                  if (model := self._model_s(n, kv, 1)) is not None and low <= t / model <= high]
        self._model_scale = statistics.median(ratios) if ratios else None

    @property
    def model_scale(self) -> float | None:
        """What the router measures per token over what the decode workers' model says (None:
        no model, or no finished request it describes)."""
        return self._model_scale

    def _model_s(self, num_streaming: float, kv_tokens: float, num_workers: int) -> float | None:
        """The step model's time at this load; None without one, or where it says under `MIN_STEP_S`."""
        if self.step_model is None:
            return None
        seconds = self.step_model.seconds(num_streaming / num_workers, kv_tokens / num_workers)
        return seconds if seconds >= MIN_STEP_S else None

    def per_token_s(self, num_streaming: float, kv_tokens: float) -> float:
        """The forecast time per output token with these requests streaming and KV tokens held:
        the step model's at this load times the scale, or else the router's own fit."""
        if self._model_scale is not None and \
                (model := self._model_s(num_streaming, kv_tokens, self.num_decode_workers)) is not None:
            return self._model_scale * model
        return self.token_s(num_streaming)

    @property
    def calibrated(self) -> bool:
        return self.first_token_s.ready and self.token_s.ready

    def admitted(self, request_id: str, cost_tokens: int, new_tokens: int, max_new_tokens: int = 0) -> None:
        r = self.running[request_id] = Running(cost_tokens, max(new_tokens, 1), self.clock(),
                                               max(max_new_tokens, new_tokens, 1), self.num_awaiting)
        self.num_awaiting += 1
        self.kv_tokens += r.prompt_tokens

    def charged(self, request_id: str, cost_tokens: int) -> None:
        """The request is charged `cost_tokens` now (it generated past its expected output):
        that is what it gives back when it ends."""
        r = self.running.get(request_id)
        if r is not None:
            r.cost_tokens = cost_tokens

    def progress(self, request_id: str, num_generated: int) -> None:
        """The request has sent `num_generated` output tokens so far."""
        r = self.running.get(request_id)
        if r is None or num_generated <= r.num_generated:
            return
        now = self.clock()
        if r.first_at is None:
            r.first_at = now
            self.num_awaiting -= 1
            self.first_token_s.add(r.ahead, now - r.admitted_at)
        else:
            r.streaming_sum += len(self.running) - self.num_awaiting
            r.kv_sum += self.kv_tokens
            r.num_responses += 1
        self.kv_tokens += num_generated - r.num_generated
        r.last_at, r.num_generated = now, num_generated

    def finished(self, request_id: str) -> None:
        """It left (however it ended): one that streamed two tokens or more is a sample of the
        time per token at its mean batch; how much of max_tokens it used is learnt too."""
        r = self.running.pop(request_id, None)
        if r is not None:
            self.kv_tokens -= r.prompt_tokens + r.num_generated
        if r is not None and r.first_at is None:
            self.num_awaiting -= 1
        if r is not None and r.num_responses and r.first_at is not None and r.last_at is not None:
            streaming, kv = r.streaming_sum / r.num_responses, r.kv_sum / r.num_responses
            per_token = (r.last_at - r.first_at) / (r.num_generated - 1)
            self.token_s.add(streaming, per_token)
            w = self.num_decode_workers
            self._samples.append((streaming / w, kv / w, per_token))
            self._rescale()
        if r is not None and r.num_generated >= 1:
            sample = min(r.num_generated / r.new_tokens, MAX_OUTPUT_FRACTION)
            self._fraction_samples += 1
            weight = max(EMA_WEIGHT, 1 / self._fraction_samples)
            self.output_fraction += weight * (sample - self.output_fraction)

    def _expected(self, new_tokens: int) -> int:
        return max(round(self.output_fraction * new_tokens), 1)

    def _expected_of(self, r: Running) -> int:
        """A running request's expected output: as a queued one's, and once it has generated
        more than half of that, twice what it has so far (it runs long: as long again is the
        guess), within what it may generate."""
        return max(self._expected(r.new_tokens), min(2 * r.num_generated, r.max_new_tokens))

    def _mean_context(self, queue: list[Queued]) -> float:
        """A request's mean KV over its life, averaged over the admitted and queued ones."""
        ctx = [r.prompt_tokens + self._expected_of(r) / 2 for r in self.running.values()]
        ctx += [q.prompt_tokens + self._expected(q.new_tokens) / 2 for q in queue]
        return sum(ctx) / len(ctx) if ctx else 0.0

    def finish_at(self, r: Running, now: float, per_token: float | None = None) -> float:
        """When this running request is expected to end, `per_token` seconds a token (default:
        at today's load, every admitted request streaming, as they soon will)."""
        if per_token is None:
            per_token = self.per_token_s(len(self.running), 0)
        if r.first_at is None:
            first = max(r.admitted_at + self.first_token_s(r.ahead), now)
            return first + (self._expected(r.new_tokens) - 1) * per_token
        return now + max(self._expected_of(r) - r.num_generated, 0) * per_token

    def admission_times(self, queue: list[Queued], free_tokens: int, budget_tokens: int,
                        free_slots: int) -> dict[str, float] | None:
        """When each queued request (in service order) is admitted in the replay; None before
        calibration. `free_tokens` may be negative (the budget shrank under what is admitted);
        `free_slots` is how many more requests may be admitted at once. A request the replay
        admits after its `admit_by` (or never: infinity) keeps that time but takes no tokens."""
        if not self.calibrated:
            return None
        now = self.clock()
        context = self._mean_context(queue)
        n = len(self.running)
        per_token = self.per_token_s(n, n * context)
        ends = [(self.finish_at(r, now, per_token), r.cost_tokens) for r in self.running.values()]
        heapq.heapify(ends)
        firsts = [max(r.admitted_at + self.first_token_s(r.ahead), now)
                  for r in self.running.values() if r.first_at is None]
        heapq.heapify(firsts)  # first tokens still to come: the prefill queue a new request joins
        times: dict[str, float] = {}
        t = now
        for q in queue:
            # a request over the whole budget is admitted alone, as AdmissionQueue._fits does
            need = min(q.cost_tokens, budget_tokens)
            while (free_tokens < need or free_slots < 1) and ends and ends[0][0] <= q.admit_by:
                t_end, tokens = heapq.heappop(ends)
                t = max(t, t_end)
                free_tokens += tokens
                free_slots += 1
            if free_tokens < need or free_slots < 1:  # not by its admit_by: refused, takes nothing
                times[q.request_id] = max(t, ends[0][0]) if ends else float("inf")
                continue
            times[q.request_id] = t
            if t > q.admit_by:
                continue
            free_tokens -= q.cost_tokens
            free_slots -= 1
            while firsts and firsts[0] <= t:
                heapq.heappop(firsts)
            first = t + self.first_token_s(len(firsts))
            heapq.heappush(firsts, first)
            n = len(ends) + 1
            end = first + (self._expected(q.new_tokens) - 1) * self.per_token_s(n, n * context)
            heapq.heappush(ends, (end, q.cost_tokens))
        return times
