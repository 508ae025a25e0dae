"""bertjax: BERT pretraining and fine-tuning in JAX/Flax."""
