"""Checkpoint interop: our Orbax checkpoints, HF directories and Google's original TF checkpoints (`load` reads any
of them; `hf` and `tf` convert, driven by the one tensor-name table in `names`)."""
