"""`bertjax compile --embedding`: the embedding fine-tune's train step compiled for a TPU slice or a GPU host, priced
per million pairs, and the largest global batch that fits, with and without cached gradients.

The step is the one `finetune embedding` trains with (`trainer.train_step_fn` over `embedding.embedding_loss_and_grads`:
contrastive.py's ranking loss over the global batch, the candidates all-gathered, in one pass or cached in chunks of
`cache_chunk` rows, then the optimizer update) on the Trainer's data-parallel mesh over the slice's compile-only
devices, lowered with abstract params (no weights: the model config alone). What it reports comes from the compiled
program as `compile.py`'s pretraining report does: the HBM need per chip, XLA's FLOPs, the step time as the
estimate (XLA:TPU's cycles, or each GPU kernel priced: an estimate, not a measurement), the collectives (the
candidates' all-gather among them), pairs per second and the price of a million pairs.
"""
from __future__ import annotations

import dataclasses
import math
import time

import flax.linen as nn
import jax
import numpy as np

from bertjax import sharding
from bertjax.cloud.compile import DEFAULT_VOCAB_SIZE, _range, estimate_step, is_gpu
from bertjax.cloud.topologies import GENERATIONS, Topology
from bertjax.finetune.contrastive import INPUT_KEYS, RankingLoss
from bertjax.finetune.embedding import embedding_loss_and_grads
from bertjax.finetune.settings import TrainSettings
from bertjax.finetune.trainer import scans_layers, train_step_fn
from bertjax.model import family
from bertjax.model.family import ModelConfig, init_params
from bertjax.model.model_options import ALL_PRESETS, ModelOptions, build_model_config
from bertjax.model.sentence_embedder import SentenceEmbedder
from bertjax.pretraining import metrics
from bertjax.pretraining.job import CompiledStep, compile_lowered
from bertjax.pretraining.optim import OptimizerConfig, make_optimizer
from bertjax.runtime.console import duration


@dataclasses.dataclass(frozen=True)
class EmbeddingStep:
    """The step priced: the encoder, the global batch of rows (anchor, positive[, hard negative]) and their length,
    the GradCache chunk (0: one pass) and the compute dtype."""
    model: ModelConfig
    batch_size: int
    max_seq_length: int
    hard_negatives: bool = False
    cache_chunk: int = 0
    dtype: str = "float32"

    @property
    def texts(self) -> int:
        return 3 if self.hard_negatives else 2


def model_config(name_or_path: str) -> ModelConfig:
    """The encoder of a model preset (`base`, `modernbert-base`; `bert-base` for `base`; BERT's 30,522-token
    vocabulary) or of a config JSON (HF's config.json, Google's bert_config.json, bertjax's own)."""
    preset = name_or_path[len("bert-"):] if name_or_path.startswith("bert-") else name_or_path
    if preset in ALL_PRESETS:
        return build_model_config(ModelOptions(preset=preset), DEFAULT_VOCAB_SIZE)
    if not name_or_path.endswith(".json"):
        raise ValueError(f"--init-config {name_or_path}: neither a model preset ({', '.join(ALL_PRESETS)}) nor a "
                         "config .json file")
    return family.config_from_json_file(name_or_path)


def check_step(step: EmbeddingStep, topology: Topology) -> None:
    """The batch and chunk the Trainer would refuse, refused before compiling."""
    chips = topology.chips
    if step.batch_size % chips:
        raise ValueError(f"--batch-size {step.batch_size} is not divisible by the {chips} data-parallel devices")
    if step.cache_chunk and (step.cache_chunk % chips or step.batch_size % step.cache_chunk):
        raise ValueError(f"--cache-chunk {step.cache_chunk} must divide --batch-size {step.batch_size} and be a "
                         f"multiple of the {chips} data-parallel devices")
    step.model.check_length(step.max_seq_length, "--max-seq-length")


def compile_embedding_step(step: EmbeddingStep, devices: list, num_slices: int = 1) -> CompiledStep:
    """Compiles `finetune embedding`'s train step for `devices` (a slice's or GPU host's compile-only ones), with
    the Trainer's defaults (AdamW, the seed's keys, a fixed scale of 20) on its data-parallel mesh; never runs it."""
    settings = TrainSettings(batch_size=step.batch_size, dtype=step.dtype)
    config = step.model.replace(dtype=step.dtype)
    if scans_layers(devices[0].platform):  # as the Trainer runs it on that platform
        config = config.replace(scan_layers=True)
    module = SentenceEmbedder(config)
    mesh = sharding.make_mesh(devices=devices, dcn_data=num_slices)
    init_key, dropout_key = jax.random.split(jax.random.PRNGKey(settings.seed))
    boxed = jax.eval_shape(lambda key: init_params(module, config, key), init_key)
    params = jax.tree_util.tree_map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
                                    nn.meta.unbox(boxed), sharding.param_shardings(boxed, mesh))
    optimizer, _ = make_optimizer(OptimizerConfig(
        learning_rate=settings.learning_rate, warmup_steps=0, weight_decay=settings.weight_decay,
        clip_norm=settings.max_grad_norm), 1000)
    train_step = train_step_fn(embedding_loss_and_grads(module, RankingLoss(), step.cache_chunk), optimizer)
    rows = sharding.batch_sharding(mesh)
    shape = (step.batch_size, step.texts, step.max_seq_length)
    batch = {**{key: jax.ShapeDtypeStruct(shape, np.int32, sharding=rows) for key in INPUT_KEYS},
             "weights": jax.ShapeDtypeStruct((step.batch_size,), np.float32, sharding=rows)}
    rng = jax.ShapeDtypeStruct(dropout_key.shape, dropout_key.dtype, sharding=sharding.replicated(mesh))
    with sharding.activate(mesh):
        opt_state = jax.eval_shape(jax.jit(optimizer.init), params)
        lowered = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, opt_state, batch, rng)
    return compile_lowered(lowered)


def report(step: EmbeddingStep, topology: Topology, compiled: CompiledStep,
           price_per_chip_hour: float | None = None) -> dict:
    """The fit and cost figures of one compiled embedding step (what `bertjax compile --embedding --json` prints)."""
    chips = topology.chips
    fits = compiled.fits and compiled.hbm_bytes_per_chip <= topology.usable_hbm_bytes_per_chip
    estimate = None if compiled.hlo_text is None else estimate_step(topology, compiled.hlo_text)
    # The encoder's forward and backward of every text (the cached step's second forward is XLA's, not the model's).
    model_flops = step.batch_size * step.texts * metrics.train_flops(step.model, step.max_seq_length,
                                                                     step.max_seq_length, 0, 0)
    seconds = None if estimate is None else estimate.seconds
    high = None if estimate is None else estimate.high_seconds

    def per_million(step_seconds):
        if step_seconds is None or price_per_chip_hour is None:
            return None
        return chips * price_per_chip_hour * step_seconds / 3600 / step.batch_size * 1e6

    collectives = {} if estimate is None else estimate.collectives_by_kind()
    chunks = step.batch_size // step.cache_chunk if step.cache_chunk and step.batch_size > step.cache_chunk else 1
    return {
        "task": "embedding", "topology": topology.topology, "accelerator_type": topology.accelerator_type,
        "chip": "GPU" if is_gpu(topology) else "chip", "num_slices": topology.num_slices, "chips": chips,
        "hosts": topology.hosts, "global_batch": step.batch_size, "per_chip_batch": step.batch_size / chips,
        "texts_per_row": step.texts, "seq_len": step.max_seq_length, "cache_chunk": step.cache_chunk,
        "dtype": step.dtype, "hidden_size": step.model.hidden_size, "layers": step.model.num_hidden_layers,
        "fits": fits, "hbm_capacity_bytes_per_chip": topology.usable_hbm_bytes_per_chip,
        "hbm_bytes_per_chip": compiled.hbm_bytes_per_chip,
        "argument_bytes_per_chip": compiled.argument_bytes_per_chip,
        "temp_bytes_per_chip": compiled.temp_bytes_per_chip,
        # Each device's anchors scored against the candidates of the whole batch: [B * (k - 1), H] float32 gathered.
        "candidates_bytes": step.batch_size * (step.texts - 1) * step.model.hidden_size * 4,
        "score_matrix_bytes_per_chip": step.batch_size // chips * step.batch_size * (step.texts - 1) * 4,
        "collectives": collectives,
        "all_gather_bytes_per_chip": collectives.get("all-gather", {}).get("bytes"),
        "model_flops_per_step": model_flops,
        # XLA's cost analysis counts a loop's body once: a cached step's is scaled by its chunks (which counts the
        # loss and the update, a small part of it, that many times too), as compile.py scales accumulation.
        "xla_flops_per_step": None if compiled.xla_flops_per_chip is None else
        compiled.xla_flops_per_chip * chips * chunks,
        "clock_hz": None if is_gpu(topology) else GENERATIONS[topology.generation].clock_hz,
        "step_time_source": "none" if estimate is None else "estimated",
        "estimated_step_seconds": seconds, "estimated_step_seconds_high": high,
        "estimated_communication_seconds": None if estimate is None else {
            "exposed": estimate.exposed_communication_seconds, "total": estimate.communication_seconds},
        "estimated_mfu": None if not seconds else model_flops / (chips * topology.peak_flops_per_chip * seconds),
        "pairs_per_second": None if not seconds else step.batch_size / seconds,
        "price_per_chip_hour": price_per_chip_hour,
        "usd_per_million_pairs": per_million(seconds), "usd_per_million_pairs_high": per_million(high),
        "detail": compiled.detail,
    }


def compile_for_topology(step: EmbeddingStep, topology: Topology, devices: list,
                         price_per_chip_hour: float | None = None) -> dict:
    """Compile `step` for `topology` and report it (see `report`)."""
    check_step(step, topology)
    return report(step, topology, compile_embedding_step(step, devices, topology.num_slices), price_per_chip_hour)


def fit_batch(step: EmbeddingStep, topology: Topology, devices: list, price_per_chip_hour: float | None = None,
              requested: dict | None = None, log=lambda line: None) -> dict:
    """The largest global batch (a multiple of the devices, and of the cache chunk when cached) whose step fits
    HBM, found by compiling: doubling from `step`'s batch (or halving, when it does not fit), then halving the
    interval until it is within an eighth of the batch found (memory grows with the batch: one pass holds every
    row's activations; cached, one chunk's and the [B, B * (k - 1)] scores). The report of the largest batch that
    fits (`fit_resolution`: the interval's width left), or of the smallest tried when none does (`fits` False).
    `requested`: `step`'s own report, if already compiled."""
    unit = math.lcm(topology.chips, step.cache_chunk or 1)
    results = {} if requested is None else {step.batch_size: requested}

    def compiled(batch: int) -> dict:
        if batch not in results:
            log(f"--fit-batch: compiling with a global batch of {batch:,} ...")
            started = time.perf_counter()
            candidate = dataclasses.replace(step, batch_size=batch)
            results[batch] = compile_for_topology(candidate, topology, devices, price_per_chip_hour)
            found = results[batch]
            log(f"--fit-batch: {batch:,} needs {found['hbm_bytes_per_chip'] / 2**30:.2f} GiB of "
                f"{found['hbm_capacity_bytes_per_chip'] / 2**30:.2f} per chip: "
                f"{'fits' if found['fits'] else 'does not fit'} "
                f"(compiled in {duration(time.perf_counter() - started)})")
        return results[batch]

    batch = max(unit, step.batch_size // unit * unit)
    if compiled(batch)["fits"]:
        low = batch
        while compiled(low * 2)["fits"]:
            low *= 2
        high = low * 2
    else:
        high = batch
        while True:
            if high == unit:  # not even one row a device
                return dict(results[unit], fit_resolution=0)
            candidate = max(unit, high // 2 // unit * unit)
            if compiled(candidate)["fits"]:
                low = candidate
                break
            high = candidate
    while high - low > max(unit, low // 8):  # low fits, high does not
        middle = (low + high) // 2 // unit * unit
        if middle in (low, high):
            break
        low, high = (middle, high) if compiled(middle)["fits"] else (low, middle)
    return dict(results[low], fit_resolution=high - low)


def describe(result: dict) -> str:
    """The report as lines for a person."""
    gib = 2**30
    where = (f"{result['accelerator_type']}: {result['chips']} GPU(s) on one host" if result["chip"] == "GPU" else
             f"{result['accelerator_type']} x{result['num_slices']} ({result['topology']}): {result['chips']} chips, "
             f"{result['hosts']} hosts")
    texts = "anchor, positive, hard negative" if result["texts_per_row"] == 3 else "anchor, positive"
    lines = [
        f"{where}; the embedding step, data parallel over every {result['chip']}",
        f"global batch {result['global_batch']:,} rows ({texts}; {result['per_chip_batch']:g} a {result['chip']}), "
        f"seq {result['seq_len']}, {result['dtype']}, "
        + (f"cached gradients in chunks of {result['cache_chunk']:,} rows" if result["cache_chunk"] else "one pass"),
        f"HBM per {result['chip']}: needs {result['hbm_bytes_per_chip'] / gib:.2f} GiB of "
        f"{result['hbm_capacity_bytes_per_chip'] / gib:.2f} GiB usable: "
        + ("fits" if result["fits"] else
           f"DOES NOT FIT (over by {(result['hbm_bytes_per_chip'] - result['hbm_capacity_bytes_per_chip']) / gib:.2f}"
           " GiB)"),
        f"each anchor against {result['global_batch'] * (result['texts_per_row'] - 1):,} candidates: "
        f"{result['candidates_bytes'] / 2**20:,.1f} MiB of them gathered, scores "
        f"{result['score_matrix_bytes_per_chip'] / 2**20:,.1f} MiB a {result['chip']}",
    ]
    for kind, entry in result["collectives"].items():
        lines.append(f"  {kind}: {entry['count']} per step, {entry['bytes'] / 2**20:,.1f} MiB per {result['chip']}; "
                     f"{entry['seconds'] * 1e3:.2f} ms, {entry['exposed_seconds'] * 1e3:.2f} ms not hidden")
    seconds = result["estimated_step_seconds"]
    if seconds is not None:
        high = result["estimated_step_seconds_high"]
        shown = _range(seconds * 1e3, high and high * 1e3, '{:.1f}')
        lines.append(f"step time, XLA's estimate (not a measurement): {shown}"
                     f" ms, {100 * result['estimated_mfu']:.1f}% MFU, {result['pairs_per_second']:,.0f} pairs/s")
        price = result["price_per_chip_hour"]
        usd = _range(result['usd_per_million_pairs'], result['usd_per_million_pairs_high'], '{:,.4f}')
        lines.append(f"cost: ${usd}"
                     f" per million pairs at ${price:g} per {result['chip']}-hour" if price is not None else
                     "cost: give --price-per-chip-hour USD for the price per million pairs")
    if "fit_resolution" in result:
        lines.append(f"largest global batch that fits: {result['global_batch']:,}"
                     + (f" (the next tried, {result['global_batch'] + result['fit_resolution']:,}, does not)"
                        if result["fit_resolution"] else ""))
    return "\n".join(lines)
