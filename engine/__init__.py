"""Shared model execution for every splitserve role.

Importing this package is cheap and torch-free: the bookkeeping modules are too
(`request`, `hashing`, `block_pool`'s KV events for the router; `scheduler`,
`kv_cache_manager`, `block_pool`, `roles` for the simulator, which runs them on a virtual clock). Modules that run the model (`model`, `model_runner`, `llm_engine`)
import torch and are imported explicitly.
"""
