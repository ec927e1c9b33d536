"""Shared model execution for every splitserve role.

Importing this package is cheap and torch-free: the bookkeeping modules
(`hashing`, `block_pool`, `kv_cache_manager`, `scheduler`, `request`) are used by
the router too. Modules that run the model (`model`, `model_runner`, `llm_engine`)
import torch and are imported explicitly.
"""
