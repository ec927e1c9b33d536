"""Finish reasons cross the wire and come back under the same name."""
from __future__ import annotations

from engine.request import FinishReason
from proto import generate_pb2 as pb
from proto.convert import finish_name_from_pb, finish_to_pb


def test_finish_reasons_round_trip() -> None:
    for name, reason in (("stop", FinishReason.STOP), ("length", FinishReason.LENGTH), ("abort", FinishReason.ABORT)):
        assert finish_to_pb(reason) == finish_to_pb(name)
        assert finish_name_from_pb(finish_to_pb(reason)) == name
    assert finish_to_pb(None) == pb.FINISH_REASON_UNSPECIFIED
    assert finish_name_from_pb(pb.FINISH_REASON_UNSPECIFIED) is None
