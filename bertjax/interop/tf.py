"""Google's original TF BERT checkpoints (bert_model.ckpt.{index,data-*} + bert_config.json + vocab.txt)."""
from __future__ import annotations

import numpy as np

from bertjax.runtime.errors import first_line
from bertjax.interop import convert
from bertjax.model import family

# Optimizer slots and bookkeeping that continued-training checkpoints hold next to the weights.
_SKIPPED_SUFFIXES = ("/adam_m", "/adam_v", "/Momentum", "/lamb_m", "/lamb_v")
_SKIPPED_NAMES = ("global_step", "good_steps", "loss_scale", "current_loss_scale")


def read_tf_checkpoint(prefix: str) -> dict[str, np.ndarray]:
    """Every weight variable of a TF checkpoint, without optimizer slots or step counters."""
    import tensorflow as tf

    try:
        reader = tf.train.load_checkpoint(prefix)
    except (tf.errors.OpError, ValueError) as error:
        raise FileNotFoundError(f"cannot read TF checkpoint {prefix!r}: {first_line(error)}") from None
    tensors = {}
    for name in reader.get_variable_to_shape_map():
        if name in _SKIPPED_NAMES or name.endswith(_SKIPPED_SUFFIXES):
            continue
        try:
            tensors[name] = np.asarray(reader.get_tensor(name))
        except tf.errors.OpError as error:  # e.g. the .data file missing or cut: the index alone reads fine
            raise ValueError(f"TF checkpoint {prefix!r}: cannot read tensor {name!r} ({first_line(error)}); are "
                             f"all its {prefix}.data-* files there and complete?") from None
    return tensors



def load_tf(prefix: str, config_path: str):
    """(params, config) from an original TF checkpoint prefix and its bert_config.json."""
    config = family.config_from_json_file(config_path)
    params = convert.params_from_tensors(read_tf_checkpoint(prefix), config, "tf", origin=prefix,
                                         config_name=config_path)
    return params, config


def write_tf_checkpoint(tensors: dict[str, np.ndarray], prefix: str) -> str:
    """Writes `tensors` as a TF checkpoint with exactly these variable names (as Google's release has)."""
    import tensorflow as tf

    # tf.compat.v1 Saver keeps the plain variable names (TF2's object-based Checkpoint would rename them).
    with tf.Graph().as_default():
        graph_vars = [tf.compat.v1.Variable(value, name=name) for name, value in tensors.items()]
        saver = tf.compat.v1.train.Saver(var_list={v.op.name: v for v in graph_vars})
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            path = saver.save(session, prefix, write_meta_graph=False)
    return path
