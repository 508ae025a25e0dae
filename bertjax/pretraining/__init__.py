"""The pretraining job: its config, train state, step, loop, optimizer, metrics and command line."""
