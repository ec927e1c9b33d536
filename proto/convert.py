"""Hand-written: conversions between the proto messages and the engine's dataclasses (one place)."""
from __future__ import annotations

from engine.request import Constraint, FinishReason, SamplingParams
from proto import generate_pb2 as pb

_FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_FINISH_FROM_PB = {code: name for name, code in _FINISH_NAMES.items()}


def sampling_from_pb(s: pb.SamplingParams, keep_stop_strings: bool = True) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; bad values raise InvalidRequestError."""
    d = SamplingParams()
    return SamplingParams(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else d.max_tokens,
        temperature=s.temperature if s.HasField("temperature") else d.temperature,
        top_k=s.top_k if s.HasField("top_k") else d.top_k,
        top_p=s.top_p if s.HasField("top_p") else d.top_p,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        stop=tuple(s.stop) if keep_stop_strings else (),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        constraint=Constraint(s.constraint.kind, s.constraint.value) if s.HasField("constraint") else None,
        constraint_prefix=s.constraint_prefix,
    )


def sampling_to_pb(p: SamplingParams, keep_stop_strings: bool = True) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                            stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs)
    if p.seed is not None:
        msg.seed = p.seed
    if p.constraint is not None:
        msg.constraint.kind, msg.constraint.value = p.constraint.kind, p.constraint.value
        msg.constraint_prefix = p.constraint_prefix
    if keep_stop_strings:
        msg.stop.extend(p.stop)
    return msg


def finish_name_from_pb(code: int) -> str | None:
    """"stop" | "length" | "abort", or None for FINISH_REASON_UNSPECIFIED (not finished)."""
    return _FINISH_FROM_PB.get(code)


def finish_to_pb(reason: FinishReason | str | None) -> int:
    if reason is None:
        return pb.FINISH_REASON_UNSPECIFIED
    if isinstance(reason, str):
        return _FINISH_NAMES[reason]
    return _FINISH_TO_PB[reason]
