"""Named pretraining presets (`bertjax pretrain --config NAME`), installed as the package bertjax.configs."""
