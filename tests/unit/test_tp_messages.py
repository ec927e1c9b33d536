"""The tensor-parallel leader's messages to its followers are typed (engine/parallel/tp_followers.py
`Op`): each crosses as msgpack and decodes to its own Struct; anything else is refused by
the decoder, before a follower acts on it."""
from __future__ import annotations

import msgpack
import msgspec
import pytest

from engine.parallel.tp_followers import CopyOp, ForwardOp, PoolOp, StopOp, _decode_op, _encode_op


@pytest.mark.parametrize("op", [PoolOp(512, True), ForwardOp([[1, 2], [0, 1]], [[], [2, 1, 3, 8, 1]], [0, 1]),
                                ForwardOp([[5]], [[]]), CopyOp(3, 9), StopOp()])
def test_each_message_crosses_as_itself(op: object) -> None:
    assert _decode_op(_encode_op(op)) == op


@pytest.mark.parametrize("raw", [
    {"op": "pool", "num_blocks": 4},  # the old untyped form
    {"type": "reset"},  # no such message
    {"type": "pool", "num_blocks": "4", "export": True},  # a field of the wrong type
    {"type": "copy", "src": 1},  # a field missing
    ["stop"],
])
def test_anything_else_is_refused_before_it_is_acted_on(raw: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        _decode_op(msgpack.packb(raw))
