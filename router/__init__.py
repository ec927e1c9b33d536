"""The front door: gRPC server, tokenization, admission, cache-aware P/D selection, KV index."""
