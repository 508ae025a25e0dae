"""The BERT model: its config, the Flax modules, attention backends, dropout, and features from a checkpoint."""
