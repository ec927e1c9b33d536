"""The model runner and the models: the Llama-family decoder, its layers (attention's torch
reference, linears, experts, rope, FP8), the paged KV pool and its sizing, the sampler and
logits controls, CUDA graphs and overlapped steps, devices, the tiny test models."""
