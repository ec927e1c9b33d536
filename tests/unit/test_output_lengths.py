"""Admission by expected use (router/output_lengths.py, router/admission.py): what a request is
charged for its output, learnt from finished requests, and the charge following what it
really holds when it runs past that."""
from __future__ import annotations

import pytest

from control.heartbeat import ModelFacts
from router.admission import AdmissionConfig, AdmissionQueue, admission_cost
from router.output_lengths import MAX_KEYS, MIN_SAMPLES, WINDOW, OutputLengths

PRIOR_TOKENS = 256


def test_the_prior_until_enough_requests_ended_then_their_high_quantile_within_max_tokens() -> None:
    lengths = OutputLengths(0.9, PRIOR_TOKENS)
    assert lengths.expected("a", "chat", 10_000) == PRIOR_TOKENS
    assert lengths.expected("a", "chat", 40) == 40  # never over what the request may generate
    assert lengths.expected("a", "chat", 0) == 0
    for n in range(1, MIN_SAMPLES):  # 1..7: one short of a quantile
        lengths.observe("a", "chat", n)
    assert lengths.expected("a", "chat", 10_000) == PRIOR_TOKENS
    for n in range(MIN_SAMPLES, 21):  # 1..20 in all
        lengths.observe("a", "chat", n)
    assert lengths.expected("a", "chat", 10_000) == 19  # the 0.9 quantile of 1..20
    assert lengths.expected("a", "chat", 12) == 12


def test_a_tenant_and_route_of_its_own_else_the_tenant_else_the_route_else_everyone() -> None:
    lengths = OutputLengths(1.0, PRIOR_TOKENS)
    for _ in range(MIN_SAMPLES):
        lengths.observe("a", "chat", 10)
        lengths.observe("b", "completion", 500)
    assert lengths.expected("a", "chat", 10_000) == 10
    assert lengths.expected("a", "completion", 10_000) == 10  # tenant a's own, on any route
    assert lengths.expected("c", "completion", 10_000) == 500  # a new tenant: the route's
    assert lengths.expected("c", "generate", 10_000) == 500  # nothing of either: everyone's (max at q=1)
    assert lengths.samples("", "") == 2 * MIN_SAMPLES and lengths.samples("a", "chat") == MIN_SAMPLES


def test_the_window_forgets_the_oldest_and_made_up_tenants_are_bounded() -> None:
    lengths = OutputLengths(0.5, PRIOR_TOKENS)
    for _ in range(WINDOW):
        lengths.observe("a", "chat", 1000)
    for _ in range(WINDOW // 2):
        lengths.observe("a", "chat", 10)
    assert lengths.expected("a", "chat", 10_000) == 1000 and lengths.samples("a", "chat") == WINDOW
    lengths.observe("a", "chat", 10)  # 129 of 256 now: the oldest lengths left
    assert lengths.expected("a", "chat", 10_000) == 10
    for i in range(MAX_KEYS):
        lengths.observe(f"t{i}", "chat", 5)
    assert len(lengths._windows) <= MAX_KEYS
    assert lengths.samples("t0", "chat") == 0 and lengths.samples(f"t{MAX_KEYS - 1}", "chat") == 1


def test_eight_ordinary_chats_fit_a_small_pool_charged_as_expected_and_not_as_max(clock) -> None:
    """The issue's scenario in numbers: 5,825 tokens of KV, chats of 20 prompt tokens that may
    run to the end of an 8,192-token context and answer in about 10."""
    worst = AdmissionQueue(AdmissionConfig(charge_output="max"), clock)
    expected = AdmissionQueue(AdmissionConfig(), clock)
    for q in (worst, expected):
        q.set_capacity(5825)
    limit = 8192 - 20
    assert worst.expected_output("", "chat", limit) == limit
    assert [worst.offer(f"r{i}", 0, 20 + limit, None, "", limit) for i in range(8)].count(True) == 1
    out = expected.expected_output("", "chat", limit)
    assert out == PRIOR_TOKENS
    assert [expected.offer(f"r{i}", 0, 20 + out, None, "", out) for i in range(8)] == [True] * 8
    for i in range(8):
        expected.release(f"r{i}")
        expected.lengths.observe("", "chat", 9 + i % 2)
    assert expected.expected_output("", "chat", limit) == 10  # learnt: now charged 30 tokens each
    assert expected.expected_output("", "chat", limit, known=True) == limit  # nothing can stop it early


def test_a_request_past_its_charge_is_charged_what_it_holds(clock) -> None:
    q = AdmissionQueue(AdmissionConfig(max_inflight_tokens=100), clock)
    assert q.offer("a", 0, 30, None, "t", 10) is True  # 20 prompt tokens + 10 expected
    assert q.offer("b", 0, 60, None, "t", 10) is True
    assert q.offer("c", 0, 20, None, "t", 10) is False  # 90 + 20 > 100
    q.progress("a", 10)
    assert q.charged_tokens == 90 and q.used_tokens == 20 + 10 + 50
    q.progress("a", 15)  # 5 past its charge
    assert q.charged_tokens == 95 and q.tenant_tokens() == {"t": 95}
    assert q.release("b") == ["c"]
    assert q.charged_tokens == 35 + 20
    assert q.release("a") == [] and q.charged_tokens == 20  # it gave back all it was charged


@pytest.mark.parametrize("bad", [{"charge_output": "worst"}, {"expected_quantile": 0.0},
                                 {"expected_prior_tokens": 0}])
def test_admission_charge_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(**bad)


def test_under_a_sliding_window_a_request_is_never_charged_past_what_it_can_hold(clock) -> None:
    """A model that slides a 30-key window on every layer, 16-token blocks: a sequence holds at
    most 3 blocks (48 tokens), however long it grows, and is charged no more."""
    q = AdmissionQueue(AdmissionConfig(max_inflight_tokens=100), clock)
    held = ModelFacts("m", 16, 1000, 4096, 64, kv_window=30).max_held_tokens
    assert held == 48 and ModelFacts("m", 16, 1000, 4096, 64).max_held_tokens is None
    q.set_capacity(0, held)
    assert admission_cost(1000, 200, 0, held) == 48 and admission_cost(20, 10, 0, held) == 30
    assert q.offer("a", 0, 30, None, "t", 10) is True  # 20 prompt tokens + 10 expected
    q.progress("a", 25)  # holds 45
    assert q.charged_tokens == 45
    q.progress("a", 400)  # would hold 420 without the window: 48
    assert q.charged_tokens == 48 and q.release("a") == [] and q.charged_tokens == 0
