"""Checkpoints: safetensors weights, GGUF files, the reader that assembles a model's tensors,
and quantization configs (FP8 schemes; torch-free)."""
