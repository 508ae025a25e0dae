"""Fine-tuning on GLUE and SQuAD.

glue_data / squad_data read and featurize the official formats; glue_metrics / squad_metrics score them as the
official scripts do; squad_postprocess turns span logits into answers; trainer is the loop both jobs share;
glue / squad are the jobs; cli registers `bertjax finetune glue|squad` and `bertjax eval squad`.
"""
