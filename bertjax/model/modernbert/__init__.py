"""ModernBERT (as transformers' ModernBertModel): its config, its Flax modules, its family object."""
