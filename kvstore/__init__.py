"""A host's shared KV tier: full blocks by chained hash, below the workers' pools (kvstore/store.py)."""
