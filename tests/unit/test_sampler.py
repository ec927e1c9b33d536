from __future__ import annotations

import pytest
import torch

from engine.core.request import Request, SamplingParams
from engine.model.sampler import Sampler, apply_top_k_top_p
from engine.types import InvalidRequestError, RequestId


def req(rid: str, **kw) -> Request:
    return Request(RequestId(rid), [1], SamplingParams(**kw), arrival_time=0.0)


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    out = Sampler(0, "cpu").sample(logits, [req("a", logprobs=True), req("b")])
    assert [t for t, _ in out] == [1, 0]
    assert out[0][1] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    assert out[1][1] is None


def test_top_k_and_top_p_masks() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    masked = apply_top_k_top_p(logits, [2, 0, 0], [1.0, 0.7, 0.85])
    keep = torch.isfinite(masked).tolist()
    assert keep[0] == [True, True, False, False]  # top-2
    assert keep[1] == [True, True, False, False]  # 0.5 + 0.3 reaches 0.7
    assert keep[2] == [True, True, True, False]  # 0.8 < 0.85 needs the third


def test_top_k_one_is_greedy_under_any_temperature() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler(0, "cpu").sample(logits, [req(f"r{i}", temperature=2.0, top_k=1) for i in range(4)])
    assert [t for t, _ in out] == logits.argmax(-1).tolist()


def test_seeded_sampling_ignores_batch_composition() -> None:
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(3, 100, generator=g) for _ in range(10)]
    alone, batched = Sampler(1, "cpu"), Sampler(2, "cpu")
    a, b = req("a", temperature=1.0, seed=42), req("b", temperature=1.0, seed=42)
    other = req("o", temperature=1.0)
    seq_alone, seq_batched = [], []
    for i, x in enumerate(steps):
        seq_alone.append(alone.sample(x[1:2], [a])[0][0])
        a.append_output(seq_alone[-1])
        seq_batched.append(batched.sample(x, [other, b, req(f"g{i}")])[1][0])
        b.append_output(seq_batched[-1])
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 3  # fresh noise at every position, not one draw repeated
    c = req("c", temperature=1.0, seed=43)
    assert [Sampler(1, "cpu").sample(x[1:2], [c])[0][0] for x in steps] != seq_alone


def test_seeded_sampling_depends_on_position_only_so_any_worker_can_continue() -> None:
    """Prefill on one worker samples token 0; a decode worker (a fresh sampler, the request
    rebuilt from prompt + first token) continues the very same sequence."""
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(1, 100, generator=g) for _ in range(6)]
    whole = req("w", temperature=1.0, seed=7)
    expected = []
    for x in steps:
        expected.append(Sampler(0, "cpu").sample(x, [whole])[0][0])
        whole.append_output(expected[-1])
    rebuilt = Request(RequestId("d"), [1, *expected[:2]], SamplingParams(temperature=1.0, seed=7), arrival_time=0.0)
    continued = []
    for x in steps[2:]:
        continued.append(Sampler(99, "cpu").sample(x, [rebuilt])[0][0])
        rebuilt.append_output(continued[-1])
    assert continued == expected[2:]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    sampler = Sampler(0, "cpu")
    logits = torch.log(probs).repeat(4000, 1)
    tokens = [t for t, _ in sampler.sample(logits, [req(f"r{i}", temperature=1.0) for i in range(4000)])]
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("kw, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(stop=("",)), "stop"),
])
def test_bad_params_name_the_field(kw, field) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw)
