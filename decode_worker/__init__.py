"""Decode worker: the engine in decode role plus the kvfabric receiver."""
