"""Sampling: per-request counter-based noise, the PyTorch sampler and the fused CUDA kernel."""
