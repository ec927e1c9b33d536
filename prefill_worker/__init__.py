"""Prefill worker: the engine in prefill role plus the kvfabric sender."""
