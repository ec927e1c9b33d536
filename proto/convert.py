"""Hand-written: conversions between the proto messages and the engine's dataclasses (one place)."""
from __future__ import annotations

from engine.core.request import (MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, Constraint, FinishReason,
                            PromptLogprob, SamplingParams, TopLogprobs)
from engine.types import InvalidRequestError
from kvfabric.address import FabricAddress, Ticket
from kvfabric.config import TRANSPORTS
from proto import generate_pb2 as pb

_FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PB = {code: reason for reason, code in _FINISH_TO_PB.items()}


def sampling_from_pb(s: pb.SamplingParams, keep_stop_strings: bool = True) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; bad values raise InvalidRequestError (lists
    past the engine's limits before they are converted: a million logit_bias entries cost
    seconds to sort and check, their count nothing)."""
    for name, what, limit in (("stop", "stop strings", MAX_STOP_STRINGS),
                              ("stop_token_ids", "stop_token_ids", MAX_STOP_TOKEN_IDS),
                              ("logit_bias", "logit_bias tokens", MAX_LOGIT_BIAS)):
        if len(getattr(s, name)) > limit:
            raise InvalidRequestError(f"at most {limit} {what}, got {len(getattr(s, name))}")
    d = SamplingParams()
    return SamplingParams(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else d.max_tokens,
        temperature=s.temperature if s.HasField("temperature") else d.temperature,
        top_k=s.top_k if s.HasField("top_k") else d.top_k,
        top_p=s.top_p if s.HasField("top_p") else d.top_p,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        stop=tuple(s.stop) if keep_stop_strings else (),
        include_stop_str_in_output=s.include_stop_str_in_output and keep_stop_strings,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        constraint=Constraint(s.constraint.kind, s.constraint.value) if s.HasField("constraint") else None,
        constraint_prefix=s.constraint_prefix,
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else d.repetition_penalty,
        min_p=s.min_p,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
        output_prefix=s.output_prefix,
        top_logprobs=s.top_logprobs,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        n=s.n or 1,
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
        msg.include_stop_str_in_output = p.include_stop_str_in_output
    if not p.skip_special_tokens:
        msg.skip_special_tokens = False
    msg.presence_penalty, msg.frequency_penalty, msg.min_p = p.presence_penalty, p.frequency_penalty, p.min_p
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    msg.logit_bias.update(dict(p.logit_bias))
    msg.min_tokens, msg.output_prefix, msg.top_logprobs = p.min_tokens, p.output_prefix, p.top_logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.n > 1:
        msg.n = p.n
    return msg


def top_logprobs_to_pb(tops: list[TopLogprobs]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs) for t in tops]


def prompt_logprobs_to_pb(entries: list[PromptLogprob] | None) -> pb.PromptLogprobs | None:
    """None where the output carries none (not asked for, or not its first)."""
    if entries is None:
        return None
    return pb.PromptLogprobs(logprobs=[e.logprob for e in entries], ranks=[e.rank for e in entries],
                             top=top_logprobs_to_pb([e.top for e in entries]))


def finish_from_pb(code: int) -> FinishReason | None:
    """STOP, LENGTH or ABORT; None for FINISH_REASON_UNSPECIFIED (not finished)."""
    return _FINISH_FROM_PB.get(code)


def finish_to_pb(reason: FinishReason | None) -> int:
    return pb.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PB[reason]


def ticket_to_pb(t: Ticket) -> pb.KVTicket:
    a = t.address
    address = pb.FabricAddress(host=a.host, port=a.port, host_id=a.host_id, receiver_id=a.receiver_id,
                               device=a.device, transports=list(a.transports), shm_bytes=a.shm_bytes,
                               pool_blocks=a.pool_blocks,
                               shm_ranks=[pb.ShmPool(name=n, nonce=c, bytes=b) for n, c, b in a.shm_ranks])
    for name in ("shm_name", "shm_nonce", "cuda_ipc_handle", "gpu", "local_name"):
        if (value := getattr(a, name)) is not None:
            setattr(address, name, value)
    return pb.KVTicket(address=address, reservation_id=t.reservation_id, request_id=t.request_id,
                       block_ids=list(t.block_ids), num_skip_blocks=t.num_skip_blocks, lease_s=t.lease_s)


def ticket_from_pb(m: pb.KVTicket) -> Ticket:
    """The ticket a decode worker issued, checked field by field; InvalidRequestError names what is wrong."""
    if not m.HasField("address"):
        raise InvalidRequestError("the KV ticket has no receiver address")
    a = m.address
    bad = [name for name, ok in (
        ("address.host", bool(a.host)), ("address.port", 0 < a.port < 65536), ("address.receiver_id", bool(a.receiver_id)),
        ("address.device", a.device in ("cpu", "cuda")), ("address.transports", bool(a.transports) and
                                                           set(a.transports) <= set(TRANSPORTS)),
        ("address.shm_ranks", all(r.name and r.nonce and r.bytes for r in a.shm_ranks) and len(a.shm_ranks) < 256),
        ("request_id", bool(m.request_id)), ("block_ids", bool(m.block_ids)),
        ("num_skip_blocks", m.num_skip_blocks <= len(m.block_ids)), ("lease_s", m.lease_s > 0))
        if not ok]
    if bad:
        raise InvalidRequestError(f"the KV ticket's {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} missing or invalid")
    optional = {name: getattr(a, name) if a.HasField(name) else None
                for name in ("shm_name", "shm_nonce", "cuda_ipc_handle", "gpu", "local_name")}
    address = FabricAddress(a.host, a.port, a.host_id, a.receiver_id, a.device, tuple(a.transports),
                            shm_bytes=a.shm_bytes, pool_blocks=a.pool_blocks,
                            shm_ranks=tuple((r.name, r.nonce, r.bytes) for r in a.shm_ranks), **optional)
    return Ticket(address, m.reservation_id, m.request_id, tuple(m.block_ids), m.num_skip_blocks, m.lease_s)
