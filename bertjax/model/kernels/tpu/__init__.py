"""Pallas TPU (Mosaic) kernels: attention with dropout, RoPE on q and k."""
