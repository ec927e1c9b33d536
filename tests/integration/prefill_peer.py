"""A prefill engine with a kvfabric pusher, in a child process driven over a Pipe."""
from __future__ import annotations

from multiprocessing.connection import Connection

import torch

from engine.request import SamplingParams
from kvfabric import FabricError, SenderConfig, Ticket
from prefill_worker.kv_push import KVPusher
from tests.integration.reference import make_engine


def prefill_main(pipe: Connection, model_dir: str, transport: str, budget: int) -> None:
    torch.set_num_threads(1)
    engine = make_engine(model_dir, role="prefill", budget=budget)
    pusher = KVPusher(engine, SenderConfig(transport=transport, checksum=True))
    engine.handoff = pusher
    pipe.send(("ok", "ready"))
    while True:
        cmd, *args = pipe.recv()
        if cmd == "exit":
            pusher.close()
            pipe.send(("ok", None))
            return
        if cmd == "attach":  # [ticket wire] -> {request id: error or None}
            errors = {}
            for ticket_wire in args[0]:
                ticket = Ticket.from_wire(ticket_wire)
                try:
                    pusher.attach(ticket)
                    errors[ticket.request_id] = None
                except FabricError as e:
                    errors[ticket.request_id] = f"{type(e).__name__}: {e}"
            pipe.send(("ok", errors))
            continue
        # "prefill": [(prompt token ids, request id, max_tokens)] -> first tokens, pushes, errors
        for prompt, rid, max_tokens in args[0]:
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid)
        done = []
        while engine.has_unfinished():
            engine.step()
            for d in pusher.take_done():
                if d.error is None:
                    engine.release_handoff(d.request_id)
                else:
                    engine.abort(d.request_id)  # still prefilling, or handed off: either way freed
                done.append((d.request_id, d.first_token_id, d.error, d.num_pushes))
        pipe.send(("ok", {"done": done, "in_use": engine.check_invariants().num_in_use}))
