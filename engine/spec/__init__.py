"""Speculative decoding: proposers (n-gram, a draft model), verification, and its cost model."""
