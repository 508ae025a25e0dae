"""The network: the encoder families (bert/, modernbert/: config, Flax modules, family object; `family.py` finds them
by model_type), the parts they share, and our Pallas kernels by platform (kernels/tpu, kernels/gpu)."""
