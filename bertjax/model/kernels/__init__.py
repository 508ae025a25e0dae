"""Pallas kernels by platform (tpu/, gpu/), each with an XLA path beside it that the model runs elsewhere."""
