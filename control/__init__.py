"""The control plane below the roles (torch-free): what workers tell routers through Redis.

  heartbeat.py      `Heartbeat`: a worker's address, state, incarnation, model facts and load
  kv_events.py      the KV event wire format (msgpack of engine `KVEvent`s)
  router_stats.py   `RouterStats` and `ControllerStatus`: what routers and the controller publish
  publisher.py      a worker's Redis writer thread (heartbeats, KV event stream)
  reader.py         async reads for routers and `splitserve status`
  worker_config.py  `WorkerConfig`: what both worker roles read
  worker_host.py    a worker's gRPC server, registry entry and state, shared by both roles

`router`, `prefill_worker` and `decode_worker` import this package, never each other
or `cluster`. Nothing here imports torch: the router process loads it.
"""
