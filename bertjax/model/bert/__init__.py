"""BERT (Google's, as HF's BertModel): its config, its Flax modules, its family object."""
