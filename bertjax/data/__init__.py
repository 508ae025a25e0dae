"""Input data: tokenizers, corpus sources, pretraining instances and masking, the TFRecord format,
the tf.data pretraining pipeline (multi-host, resumable) and per-host -> global batch assembly."""
