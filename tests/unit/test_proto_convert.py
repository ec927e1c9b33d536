"""Finish reasons, KV tickets and sampling parameters cross the wire and come back the same."""
from __future__ import annotations

from engine.core.request import FinishReason
from proto import generate_pb2 as pb
from proto.convert import finish_from_pb, finish_to_pb


def test_finish_reasons_round_trip() -> None:
    for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
        assert finish_from_pb(finish_to_pb(reason)) is reason
    assert finish_to_pb(None) == pb.FINISH_REASON_UNSPECIFIED
    assert finish_from_pb(pb.FINISH_REASON_UNSPECIFIED) is None


def test_a_kv_ticket_crosses_the_router_as_a_checked_protobuf_message() -> None:
    import pytest

    from engine.types import InvalidRequestError
    from kvfabric.address import FabricAddress, Ticket
    from proto.convert import ticket_from_pb, ticket_to_pb

    addr = FabricAddress("10.0.0.7", 5555, "h/b", "r1", "cuda", ("cuda_ipc", "nccl"), cuda_ipc_handle=b"\x00\x01" * 32,
                         gpu="0000:1b:00.0", pool_blocks=4096, local_name="splitserve-r1")
    ticket = Ticket(addr, 2**62 + 5, "req", (4, 5, 9), 1, 10.0)
    wire = ticket_to_pb(ticket).SerializeToString()
    assert ticket_from_pb(pb.KVTicket.FromString(wire)) == ticket
    cpu = Ticket(FabricAddress("127.0.0.1", 1, "h", "r", "cpu", ("shm", "tcp"), "splitserve-kv-1-ab", "n" * 32, 64),
                 1, "q", (0,), 0, 0.5)
    assert ticket_from_pb(ticket_to_pb(cpu)) == cpu  # unset optionals stay None
    split = Ticket(FabricAddress("127.0.0.1", 1, "h", "r", "cpu", ("shm", "tcp"), "splitserve-kv-1-ab", "n" * 32, 64,
                                 shm_ranks=(("splitserve-kv-2-cd", "m" * 32, 64), ("splitserve-kv-3-ef", "o" * 32, 64))),
                   1, "q", (0,), 0, 0.5)  # a decode worker split across 3 ranks: each rank's pool
    assert ticket_from_pb(pb.KVTicket.FromString(ticket_to_pb(split).SerializeToString())) == split
    bad_rank = ticket_to_pb(split)
    bad_rank.address.shm_ranks[1].nonce = ""
    with pytest.raises(InvalidRequestError, match="address.shm_ranks is missing or invalid"):
        ticket_from_pb(bad_rank)
    for broken, named in ((pb.KVTicket(), "no receiver address"),
                          (pb.KVTicket(address=pb.FabricAddress(host="h", port=70000, receiver_id="r", device="cpu",
                                                                transports=["carrier-pigeon"]), request_id="q",
                                       block_ids=[1], num_skip_blocks=2, lease_s=0),
                           "address.port, address.transports, num_skip_blocks, lease_s are missing or invalid")):
        with pytest.raises(InvalidRequestError, match=named):
            ticket_from_pb(broken)


def test_stop_strings_and_keeping_them_cross_the_wire_only_where_asked() -> None:
    """The router matches stop strings itself: what it sends a worker carries neither them nor
    include_stop_str_in_output; a client's request carries both."""
    from engine.core.request import SamplingParams
    from proto.convert import sampling_from_pb, sampling_to_pb

    params = SamplingParams(max_tokens=5, stop=("x", "yz"), include_stop_str_in_output=True)
    assert sampling_from_pb(sampling_to_pb(params)) == params
    to_worker = sampling_from_pb(sampling_to_pb(params, keep_stop_strings=False), keep_stop_strings=False)
    assert (to_worker.stop, to_worker.include_stop_str_in_output) == ((), False)
