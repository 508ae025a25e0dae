"""Pallas GPU (Triton) kernels: attention with dropout, LayerNorm; which ones a job runs, their check on the card."""
