"""Runs N train steps on fixed, seeded global batches and prints the losses as JSON (process 0).

Used by the multi-process test: under `launch/local.py` each process feeds only its rows of every global batch,
exactly as the multi-host input pipeline does, so 2 processes x 4 devices must reproduce 1 process x 8 devices.
"""
import argparse
import json

import jax
import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--coordinator")
parser.add_argument("--num-processes", type=int, default=1)
parser.add_argument("--process-id", type=int, default=0)
args = parser.parse_args()
if args.num_processes > 1:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

from bertjax import sharding  # noqa: E402
from bertjax.model.bert import model as model_lib  # noqa: E402  (after distributed init)
from bertjax.model.bert.config import BertConfig  # noqa: E402
from bertjax.pretraining import optim
from bertjax.pretraining import state as train_state
from bertjax.pretraining import step as train_step

config = BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=32)
mesh = sharding.make_mesh(data=-1, fsdp=2)
model = model_lib.BertForPreTraining(config)
optimizer, schedule = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=2), 100)
state, shardings, _ = train_state.make_sharded_state(jax.random.key(0), model=model, config=config,
                                                     optimizer=optimizer, mesh=mesh, seq_len=16, num_masked=3)
step, _ = train_step.compile_steps(model=model, optimizer=optimizer, schedule=schedule, grad_accum_steps=1,
                                   nsp_loss=True, state_shardings_tree=shardings, mesh=mesh)
rng = np.random.default_rng(0)
losses = []
rows = slice(args.process_id * 16 // args.num_processes, (args.process_id + 1) * 16 // args.num_processes)
with sharding.activate(mesh):
    for _ in range(args.steps):
        ids = rng.integers(5, 90, (16, 16)).astype(np.int32)
        positions = rng.integers(1, 16, (16, 3)).astype(np.int32)
        batch = dict(input_ids=ids, input_mask=np.ones_like(ids), segment_ids=np.zeros_like(ids),
                     masked_lm_positions=positions, masked_lm_ids=np.take_along_axis(ids, positions, 1),
                     masked_lm_weights=np.ones((16, 3), np.float32),
                     next_sentence_labels=rng.integers(0, 2, (16, 1)).astype(np.int32))
        state, metrics = step(state, sharding.global_batch({k: v[rows] for k, v in batch.items()}, mesh))
        losses.append(float(metrics["loss"]))
if jax.process_index() == 0:
    print("LOSSES " + json.dumps(losses), flush=True)
