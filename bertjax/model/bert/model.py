"""BERT in Flax (linen), exactly as Google's BERT / HF's BertModel: post-LayerNorm encoder and the standard heads.

Every parameter carries logical axis names (see `bertjax.sharding`) so that one set of rules maps the model onto
any (data, fsdp, tensor) mesh. Parameters are float32; matmuls run in `config.dtype`; LayerNorm, softmax and the
logits handed to losses are float32.

Call convention (all modules): `apply({"params": p}, input_ids, input_mask, segment_ids, ..., deterministic=True)`
with int32 [batch, length] inputs; pass `deterministic=False, rngs={"dropout": key}` to train with dropout.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from bertjax.model.attention import dot_product_attention
from bertjax.model.bert.config import BertConfig
from bertjax.model.dropout import Dropout
from bertjax.model.gelu import gated_gelu, gated_gelu_of_pair, gelu, gelu_with_bias
from bertjax.model.layer_norm import LayerNorm
from bertjax.model.norm_dropout import norm_then_dropout
from bertjax.sharding import target_platform

# TF BERT's truncated_normal_initializer(stddev=initializer_range): a normal of std `stddev` cut at +-2 std, whose
# own std is 0.8796 * stddev (0.0176 for 0.02). jax's truncated_normal takes the same untruncated `stddev`; scaling
# it by 0.8796 as well (as before 2026-11-23) gave std 0.0155, a smaller fresh head than BERT's or HF's.
_TRUNCATED_STD = 0.87962566103423978  # std of N(0, 1) cut at +-2


def _kernel_init(config: BertConfig, names: tuple[str | None, ...]):
    init = nn.initializers.truncated_normal(stddev=config.initializer_range)
    return nn.with_logical_partitioning(init, names)


def _zeros(names):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def activation(name: str):
    """The activation function named by `hidden_act`, with HF's meanings."""
    return {
        "gelu": functools.partial(gelu, approximate=False),
        "gelu_new": functools.partial(gelu, approximate=True),
        "gelu_pytorch_tanh": functools.partial(gelu, approximate=True),
        "gelu_fast": functools.partial(gelu, approximate=True),
        "relu": jax.nn.relu,
        "tanh": jnp.tanh,
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
    }[name]


# The GELUs by HF name: whether each is the tanh approximation (the activations with their own VJPs).
_GELU_APPROXIMATE = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}


def activation_with_bias(name: str):
    """`activation(name)(h + bias)` as f(h, bias): the GELUs take the bias into their own backward
    (`gelu_with_bias`), so the sum h + bias is not kept for it."""
    approximate = _GELU_APPROXIMATE.get(name)
    if approximate is None:
        return lambda h, bias: activation(name)(h + bias)
    return functools.partial(gelu_with_bias, approximate=approximate)


def gated_activation(name: str, of_pair: bool):
    """GeGLU-style `activation(name)(x) * gate`: as f(x, gate), or `of_pair` as f(y) of y [..., 2, width] = (x, gate);
    the GELUs keep their inputs, not gelu(x), for their own backward (`gated_gelu`, `gated_gelu_of_pair`)."""
    approximate = _GELU_APPROXIMATE.get(name)
    if approximate is None:
        gated = lambda x, gate: activation(name)(x) * gate
        return (lambda y: gated(y[..., 0, :], y[..., 1, :])) if of_pair else gated
    return functools.partial(gated_gelu_of_pair if of_pair else gated_gelu, approximate=approximate)


def _dtype(config: BertConfig):
    return jnp.dtype(config.dtype)


def _constrain(x, names):
    """Sharding hint for activations; a no-op outside a mesh with logical axis rules."""
    return nn.with_logical_constraint(x, names)


def small_table_lookup(table, ids):
    """table[ids] for a table of a few rows (token types), float32, without a gather.

    A gather's gradient is a scatter-add, which on GPU serialises its atomic adds when every token hits one of
    two rows (measured: 59 of 99 ms of a BERT-base step on an H100). Selecting rows makes the gradient a plain
    reduction; the forward value is exact (one row plus zeros).
    """
    hits = ids[..., None] == jnp.arange(table.shape[0])                     # [..., rows]
    return jnp.sum(jnp.where(hits[..., None], table.astype(jnp.float32), 0.0), axis=-2)


def summed_embeddings(word, positions, types, input_ids, segment_ids):
    """word[input_ids] + positions + types[segment_ids] in float32 (positions [1, L, H] or per row [B, L, H]).

    Off TPU, with positions [1, L, H], through `_summed_embeddings`, whose backward reduces the positions' and the
    token types' gradients over the major axis of the sum's gradient: differentiated as written, XLA:GPU
    transposed it to [H, B, L] for the token types' reduction (BERT-base on an H200: 0.2 GB a step, and a pass
    more; docs/performance-history.md)."""
    if target_platform() == "tpu" or positions.shape[0] != 1:
        return _summed(word, positions, types, input_ids, segment_ids)
    return _summed_embeddings(word, positions[0], types, input_ids, segment_ids)


def _summed(word, positions, types, input_ids, segment_ids):
    # Rows gathered from the float32 table, not from a bf16 copy of all of it: exact (as HF under autocast), and
    # XLA:TPU no longer converts the whole 30k-row table for the lookup (2-layer BERT-base, 16 sequences per
    # v5e chip: -11% of the step's estimated cycles).
    return (jnp.take(word, input_ids, axis=0) + positions.astype(jnp.float32)
            + small_table_lookup(types, segment_ids))


def table_gradient(table, ids, rows):
    """The gradient of `table[ids]` whose cotangent is `rows` [ids.size, H]: autodiff's scatter-add into a zeroed
    table, the zeros made only once `rows` exists. Differentiated as written, the zeros depend on nothing and
    XLA:CPU made them in the forward pass, so the whole table (ModernBERT's 50,368 x 768: 148 MiB) was held through
    the backward pass's peak; torch allocates it at the end of its backward. The zero is computed from a value of
    `rows` (an optimization barrier on a constant is folded away on XLA:CPU); +0.0 whatever that value is (NaN and
    infinities made finite first), and a float x * 0 XLA does not fold: the same bits as autodiff's zeros."""
    first = rows.reshape(-1)[0]
    zero = jnp.abs(jnp.nan_to_num(first, nan=0.0, posinf=0.0, neginf=0.0) * 0)
    return jnp.broadcast_to(zero, table.shape).astype(table.dtype).at[ids.reshape(-1)].add(rows)


def take_rows(table, ids):
    """`jnp.take(table, ids, axis=0)` (the same bits); off TPU its gradient is `table_gradient`'s (on TPU, as
    `summed_embeddings`, XLA:TPU is left its own differentiation)."""
    if target_platform() == "tpu":
        return jnp.take(table, ids, axis=0)
    return _take_rows(table, ids)


@jax.custom_vjp
def _take_rows(table, ids):
    return jnp.take(table, ids, axis=0)


def _take_rows_forward(table, ids):
    # The table itself (a param, in memory anyway) for its shape and dtype: a zeros residual would be written here.
    return jnp.take(table, ids, axis=0), (table, ids)


def _take_rows_backward(saved, dx):
    table, ids = saved
    return table_gradient(table, ids, dx.reshape(-1, dx.shape[-1]).astype(table.dtype)), None


_take_rows.defvjp(_take_rows_forward, _take_rows_backward)


@jax.custom_vjp
def _summed_embeddings(word, positions, types, input_ids, segment_ids):
    return _summed(word, positions, types, input_ids, segment_ids)


def _summed_embeddings_forward(word, positions, types, input_ids, segment_ids):
    # The table itself (a param, in memory anyway) for its shape: a zeros residual would be written here.
    return _summed(word, positions, types, input_ids, segment_ids), (word, types, input_ids, segment_ids)


def _summed_embeddings_backward(saved, dx):
    word, types, input_ids, segment_ids = saved
    rows = dx.reshape(-1, dx.shape[-1]).astype(word.dtype)
    dword = table_gradient(word, input_ids, rows)
    # Reductions over the major axis only: the positions' over the batch ([B, L * H] rows), each token type's
    # over all rows ([B * L, H]).
    dpositions = dx.reshape(dx.shape[0], -1).sum(0).reshape(dx.shape[1:])
    segment_rows = segment_ids.reshape(-1, 1)
    dtypes = jnp.stack([jnp.where(segment_rows == t, rows, 0.0).sum(0) for t in range(types.shape[0])])
    return dword, dpositions, dtypes.astype(types.dtype), None, None


_summed_embeddings.defvjp(_summed_embeddings_forward, _summed_embeddings_backward)


class NormThenDropout(nn.Module):
    """LayerNorm (params `scale` and `bias`, as `LayerNorm`'s) then hidden dropout, as one function with its own
    gradient off TPU (`model/norm_dropout.py`): the embeddings' tail."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, dropout_rng):
        c = self.config
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
                           (x.shape[-1],), jnp.float32)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                          (x.shape[-1],), jnp.float32)
        return norm_then_dropout(x, scale, bias, c.layer_norm_eps, _dtype(c), c.hidden_dropout_prob, dropout_rng)


class Embeddings(nn.Module):
    config: BertConfig

    def setup(self):
        c = self.config
        init = functools.partial(_kernel_init, c)
        self.word_embeddings = nn.Embed(c.vocab_size, c.hidden_size, embedding_init=init(("vocab", "embed")),
                                        param_dtype=jnp.float32, dtype=_dtype(c))
        self.position_embeddings = nn.Embed(c.max_position_embeddings, c.hidden_size,
                                            embedding_init=init((None, "embed")), param_dtype=jnp.float32,
                                            dtype=_dtype(c))
        self.token_type_embeddings = nn.Embed(c.type_vocab_size, c.hidden_size,
                                              embedding_init=init((None, "embed")), param_dtype=jnp.float32,
                                              dtype=_dtype(c))
        self.LayerNorm = NormThenDropout(c)
        self.dropout = Dropout(c.hidden_dropout_prob)  # draws the key (as when it dropped itself)

    def __call__(self, input_ids, segment_ids, position_ids, deterministic: bool):
        # Summed in float32, as the reference implementations do, before the LayerNorm.
        if position_ids is None:
            # Positions 0..L-1: a slice of the table, which shards better than a gather.
            positions = self.position_embeddings.embedding[None, : input_ids.shape[-1]]
        else:
            positions = self.position_embeddings(position_ids)
        x = summed_embeddings(self.word_embeddings.embedding, positions, self.token_type_embeddings.embedding,
                              input_ids, segment_ids)
        return self.LayerNorm(x, self.dropout.key(deterministic))

    def attend(self, x):
        """Logits against the word embeddings (the tied MLM decoder)."""
        return self.word_embeddings.attend(x)


class HeadProjection(nn.Module):
    """A Dense layer into or out of the attention heads, its kernel one 2-D matrix (TF's and HF's layout).

    `to_heads`: [B, L, H] -> [B, L, heads, head_dim] with kernel [H, heads * head_dim], bias [heads, head_dim];
    otherwise [B, L, heads, head_dim] -> [B, L, H] with kernel [heads * head_dim, H]. The merged axis is the
    logical "heads" axis (heads split over the tensor axis in whole heads while it divides them).
    `defer_bias`: return (x W, bias) for the caller to add the bias (attention adds q/k/v's itself, the GPU
    LayerNorm the output's).
    """

    config: BertConfig
    to_heads: bool
    defer_bias: bool = False

    @nn.compact
    def __call__(self, x):
        c = self.config
        # 2-D kernels, not [H, heads, head_dim]: XLA:TPU lays a 3-d kernel out with head_dim (64) in the 128
        # lanes, and with the update sharded it gathered the 3-d kernels synchronously and relaid them out for
        # the matmuls (BERT-base phase 1 on v5litepod-16: 14.76 -> 14.00 ms estimated, docs/performance-history.md).
        heads_width = c.num_attention_heads * c.head_dim
        if self.to_heads:
            kernel_shape, kernel_names = (c.hidden_size, heads_width), ("embed", "heads")
            bias_shape, bias_names = (c.num_attention_heads, c.head_dim), ("heads", "kv")
        else:
            kernel_shape, kernel_names = (heads_width, c.hidden_size), ("heads", "embed")
            bias_shape, bias_names = (c.hidden_size,), ("embed",)
        kernel = self.param("kernel", _kernel_init(c, kernel_names), kernel_shape, jnp.float32)
        bias = self.param("bias", _zeros(bias_names), bias_shape, jnp.float32)
        dtype = _dtype(c)
        if self.to_heads:
            y = (x.astype(dtype) @ kernel.astype(dtype)).reshape(x.shape[:-1] + bias_shape)
        else:
            y = x.reshape(x.shape[:-2] + (heads_width,)).astype(dtype) @ kernel.astype(dtype)
        return (y, bias) if self.defer_bias else y + bias.astype(dtype)


def bias_to_layer_norm() -> bool:
    """Whether a Dense before a residual LayerNorm hands its bias to it: on a GPU, whose LayerNorm kernels add it
    as they load x and sum its gradient (XLA adding it was a pass over memory of its own); elsewhere the Dense adds
    it (the CPU and TPU programs as they were)."""
    return target_platform() == "gpu"


class DenseBeforeLayerNorm(nn.Module):
    """nn.Dense(features): its params (`kernel` [in, features], `bias` [features]), their init and logical axes
    (`names`: the kernel's), its values; with `defer_bias` it returns (x W, bias) for the LayerNorm to add."""

    config: BertConfig
    features: int
    names: tuple[str | None, str | None]
    defer_bias: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", _kernel_init(self.config, self.names), (x.shape[-1], self.features),
                            jnp.float32)
        bias = self.param("bias", _zeros(self.names[-1:]), (self.features,), jnp.float32)
        # nn.Dense's operations, in its order (the programs of the Dense that adds its bias unchanged)
        x, cast_kernel, cast_bias = promote_dtype(x, kernel, bias, dtype=_dtype(self.config))
        y = jax.lax.dot_general(x, cast_kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if self.defer_bias:
            return y, bias
        return y + jnp.reshape(cast_bias, (1,) * (y.ndim - 1) + (-1,))


class SelfAttention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, hidden, input_mask, packing_ids, deterministic: bool):
        c = self.config
        # The biases go to the attention, which adds them: the fused dropout kernel sums their gradients itself.
        (query, bq), (key, bk), (value, bv) = (HeadProjection(c, to_heads=True, defer_bias=True, name=name)(hidden)
                                               for name in ("query", "key", "value"))
        query, key, value = (_constrain(t, ("activation_batch", "activation_length", "activation_heads",
                                            "activation_kv")) for t in (query, key, value))
        dropout_active = not deterministic and c.attention_probs_dropout_prob > 0
        context = dot_product_attention(
            query, key, value, input_mask, packing_ids, backend=c.attention_backend,
            dropout_rate=c.attention_probs_dropout_prob,
            dropout_rng=self.make_rng("dropout") if dropout_active else None, deterministic=deterministic,
            biases=(bq, bk, bv))
        return context


def _with_bias(out):
    """A Dense's (x W, bias) as it deferred its bias, or (x W + b, None)."""
    return out if isinstance(out, tuple) else (out, None)


class AttentionBlock(nn.Module):
    """Self-attention, output projection, dropout, residual, LayerNorm (HF: BertAttention)."""

    config: BertConfig

    @nn.compact
    def __call__(self, hidden, input_mask, packing_ids, deterministic: bool):
        c = self.config
        context = SelfAttention(c, name="self")(hidden, input_mask, packing_ids, deterministic)
        out, out_bias = _with_bias(HeadProjection(c, to_heads=False, defer_bias=bias_to_layer_norm(),
                                                  name="output_dense")(context))
        # Dropout_0 draws the key (as when it dropped itself); the LayerNorm applies the mask.
        rng = Dropout(c.hidden_dropout_prob).key(deterministic)
        return LayerNorm(c, name="output_LayerNorm")(out, hidden, rng, c.hidden_dropout_prob, out_bias)


class Intermediate(nn.Module):
    """The feed-forward block's first Dense and its activation: act(x W + b), params `kernel` [H, I] and `bias`
    [I] as nn.Dense names them. The bias is added inside the activation (`activation_with_bias`)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        kernel = self.param("kernel", _kernel_init(c, ("embed", "mlp")), (x.shape[-1], c.intermediate_size),
                            jnp.float32)
        bias = self.param("bias", _zeros(("mlp",)), (c.intermediate_size,), jnp.float32)
        dtype = _dtype(c)
        h = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())))
        return activation_with_bias(c.hidden_act)(h, bias.astype(dtype))


class Layer(nn.Module):
    """One encoder layer (HF: BertLayer): attention block, then the feed-forward block."""

    config: BertConfig

    @nn.compact
    def __call__(self, hidden, input_mask, packing_ids, deterministic: bool):
        c = self.config
        hidden = AttentionBlock(c, name="attention")(hidden, input_mask, packing_ids, deterministic)
        inner = Intermediate(c, name="intermediate")(hidden)
        inner = _constrain(inner, ("activation_batch", "activation_length", "activation_mlp"))
        out, out_bias = _with_bias(DenseBeforeLayerNorm(c, c.hidden_size, ("mlp", "embed"),
                                                        defer_bias=bias_to_layer_norm(), name="output")(inner))
        rng = Dropout(c.hidden_dropout_prob).key(deterministic)
        out = LayerNorm(c, name="output_LayerNorm")(out, hidden, rng, c.hidden_dropout_prob, out_bias)
        return _constrain(out, ("activation_batch", "activation_length", "activation_embed"))


# What each `config.remat` keeps for the backward pass; the rest of a layer is recomputed there.
_REMAT_POLICIES = {"dots": jax.checkpoint_policies.checkpoint_dots,
                   "full": jax.checkpoint_policies.nothing_saveable}


def remat_layer(config: BertConfig):
    """The encoder layer class, rematerialised as `config.remat` says (the same params and values either way)."""
    if config.remat == "none":
        return Layer
    # `deterministic` (argument 4, counting the module) is a Python bool that dropout branches on. Inside a scan
    # the loop already keeps XLA from merging the recomputation into the forward pass, so no CSE barrier is needed.
    return nn.remat(Layer, policy=_REMAT_POLICIES[config.remat], prevent_cse=not config.scan_layers,
                    static_argnums=(4,))


class BertModel(nn.Module):
    """Embeddings, encoder and pooler. Returns (sequence_output [B, L, H], pooled_output [B, H]).

    Every hidden state is also sown into the "intermediates" collection as `hidden_states`, a tuple of
    num_hidden_layers + 1 arrays numbered as transformers' `output_hidden_states` (0 = the embeddings' output,
    i = layer i's output). It is stored only when the caller asks for it (`mutable=["intermediates"]`); otherwise
    `sow` does nothing, so training and inference pay nothing for it.
    """

    config: BertConfig
    add_pooler: bool = True

    def setup(self):
        self.embeddings = Embeddings(self.config)
        layer = remat_layer(self.config)
        if self.config.scan_layers:
            self.layers = layer(self.config)  # params bert/layers/..., stacked by `_scan_layers`
        else:
            self.layers = [layer(self.config, name=f"layer_{i}") for i in range(self.config.num_hidden_layers)]
        if self.add_pooler:
            self.pooler = nn.Dense(self.config.hidden_size, dtype=_dtype(self.config), param_dtype=jnp.float32,
                                   kernel_init=_kernel_init(self.config, ("embed", "embed_out")),
                                   bias_init=_zeros(("embed_out",)))

    def __call__(self, input_ids, input_mask, segment_ids, *, packing_ids=None, position_ids=None,
                 pool_positions=None, deterministic: bool = True):
        """packing_ids/position_ids: packed rows (attention stays inside a packing id, positions restart);
        pool_positions [B, k]: pool there (each packed instance's [CLS]) -> pooled [B, k, H], else [B, H]."""
        hidden = self.embeddings(input_ids, segment_ids, position_ids, deterministic)
        hidden = _constrain(hidden, ("activation_batch", "activation_length", "activation_embed"))
        self.sow("intermediates", "hidden_states", hidden)
        if self.config.scan_layers:
            hidden = self._scan_layers(hidden, input_mask, packing_ids, deterministic)
        else:
            for layer in self.layers:
                hidden = layer(hidden, input_mask, packing_ids, deterministic)
                self.sow("intermediates", "hidden_states", hidden)
        if not self.add_pooler:
            return hidden, None
        first = hidden[:, 0] if pool_positions is None else gather_positions(hidden, pool_positions)
        return hidden, jnp.tanh(self.pooler(first))

    def _scan_layers(self, hidden, input_mask, packing_ids, deterministic: bool):
        """The encoder as one `nn.scan` over the layer axis of the stacked params (one layer to compile).

        Each layer draws its own params and dropout keys (`split_rngs`): other random bits than the unrolled
        model's per-layer streams (fresh weights and dropout masks differ, their distribution does not), the same
        values for the same params without dropout. Per-layer hidden states are collected as the scan's outputs
        only when the caller asks for them (`mutable=["intermediates"]`).
        """
        collect = self.is_mutable_collection("intermediates")

        def body(layer, carry, _):
            carry = layer(carry, input_mask, packing_ids, deterministic)
            return carry, (carry if collect else None)

        scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                       length=self.config.num_hidden_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        hidden, states = scan(self.layers, hidden, None)
        if collect:
            for i in range(self.config.num_hidden_layers):
                self.sow("intermediates", "hidden_states", states[i])
        return hidden

    def attend(self, x):
        return self.embeddings.attend(x)


class MaskedLMHead(nn.Module):
    """Transform (Dense -> act -> LayerNorm), then logits against the tied word embeddings plus a bias."""

    config: BertConfig

    @nn.compact
    def __call__(self, hidden, attend):
        c = self.config
        x = nn.Dense(c.hidden_size, dtype=_dtype(c), param_dtype=jnp.float32,
                     kernel_init=_kernel_init(c, ("embed", "embed_out")), bias_init=_zeros(("embed_out",)),
                     name="transform_dense")(hidden)
        x = LayerNorm(c, name="transform_LayerNorm")(activation(c.hidden_act)(x))
        bias = self.param("output_bias", _zeros(("vocab",)), (c.vocab_size,), jnp.float32)
        return attend(x).astype(jnp.float32) + bias


# Relative positions (a token's offset inside its span) the SBO head embeds; later offsets share the last
# embedding. Spans are at most 10 words, but merged spans can be longer (SpanBERT's code: 20 targets per span).
SBO_MAX_SPAN_TOKENS = 32


class SpanBoundaryHead(nn.Module):
    """SpanBERT's span boundary objective (Joshi et al. 2020, section 3.2): for a token x_i of the masked span
    (s, e), h0 = [x_{s-1}; x_{e+1}; p_{i-s+1}] (the encoder states of the two boundary tokens and a learned
    relative position embedding), h1 = LayerNorm(GeLU(W1 h0)), y_i = LayerNorm(GeLU(W2 h1)), and y_i is scored
    against the tied word embeddings plus its own output bias, like the MLM head. The position embedding has
    the hidden size (the paper gives none; SpanBERT's code uses 200 for H = 768/1024)."""

    config: BertConfig

    @nn.compact
    def __call__(self, left, right, relative_positions, attend):
        """left/right [B, P, H]: boundary states; relative_positions [B, P] int: i - s (0 = first token)."""
        c = self.config
        table = self.param("position_embeddings", _kernel_init(c, (None, "embed")),
                           (SBO_MAX_SPAN_TOKENS, c.hidden_size), jnp.float32)
        index = jnp.clip(relative_positions, 0, SBO_MAX_SPAN_TOKENS - 1)
        x = jnp.concatenate([left.astype(jnp.float32), right.astype(jnp.float32), table[index]], axis=-1)
        for i in (1, 2):
            x = nn.Dense(c.hidden_size, dtype=_dtype(c), param_dtype=jnp.float32,
                         kernel_init=_kernel_init(c, (None, "embed_out")), bias_init=_zeros(("embed_out",)),
                         name=f"dense_{i}")(x)
            x = LayerNorm(c, name=f"LayerNorm_{i}")(activation(c.hidden_act)(x))
        bias = self.param("output_bias", _zeros(("vocab",)), (c.vocab_size,), jnp.float32)
        return attend(x).astype(jnp.float32) + bias


def gather_positions(sequence, positions):
    """sequence [B, L, H] at positions [B, P] -> [B, P, H]."""
    return jnp.take_along_axis(sequence, positions[..., None].astype(jnp.int32), axis=1)


class BertForPreTraining(nn.Module):
    """BERT with the MLM head (computed only at `masked_lm_positions`) and the NSP head; with
    `span_boundary_objective`, also SpanBERT's SBO head (`span_boundary`) at the same positions.

    Returns {"mlm_logits": [B, P, vocab], "nsp_logits": [B, 2]} (packed rows, `nsp_positions` [B, k] given:
    [B, k, 2], one per instance's [CLS]), plus "sbo_logits" [B, P, vocab] with the SBO head, float32.
    """

    config: BertConfig
    span_boundary_objective: bool = False

    def setup(self):
        self.bert = BertModel(self.config)
        self.predictions = MaskedLMHead(self.config)
        self.seq_relationship = nn.Dense(2, dtype=jnp.float32, param_dtype=jnp.float32,
                                         kernel_init=_kernel_init(self.config, ("embed", None)),
                                         bias_init=_zeros((None,)))
        if self.span_boundary_objective:
            self.span_boundary = SpanBoundaryHead(self.config)

    def __call__(self, input_ids, input_mask, segment_ids, masked_lm_positions, *, packing_ids=None,
                 position_ids=None, nsp_positions=None, span_left_positions=None, span_right_positions=None,
                 deterministic: bool = True):
        """span_left/right_positions [B, P]: the tokens just outside each prediction's span (SBO only)."""
        sequence, pooled = self.bert(input_ids, input_mask, segment_ids, packing_ids=packing_ids,
                                     position_ids=position_ids, pool_positions=nsp_positions,
                                     deterministic=deterministic)
        mlm_logits = self.predictions(gather_positions(sequence, masked_lm_positions), self.bert.attend)
        nsp_logits = self.seq_relationship(pooled.astype(jnp.float32))
        outputs = {"mlm_logits": mlm_logits, "nsp_logits": nsp_logits}
        if self.span_boundary_objective:
            if span_left_positions is None or span_right_positions is None:
                raise ValueError("the span boundary objective needs span_left_positions and span_right_positions "
                                 "(batches of data.masking_scheme=span)")
            outputs["sbo_logits"] = self.span_boundary(
                gather_positions(sequence, span_left_positions), gather_positions(sequence, span_right_positions),
                masked_lm_positions - span_left_positions - 1, self.bert.attend)
        return outputs


class BertForSequenceClassification(nn.Module):
    """Pooled [CLS] -> dropout -> Dense(num_labels); num_labels=1 is regression (STS-B). Float32 logits."""

    config: BertConfig
    num_labels: int

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids, *, deterministic: bool = True):
        _, pooled = BertModel(self.config, name="bert")(input_ids, input_mask, segment_ids,
                                                          deterministic=deterministic)
        pooled = Dropout(self.config.hidden_dropout_prob)(pooled, deterministic=deterministic)
        return nn.Dense(self.num_labels, dtype=jnp.float32, param_dtype=jnp.float32,
                        kernel_init=_kernel_init(self.config, ("embed", None)), bias_init=_zeros((None,)),
                        name="classifier")(pooled.astype(jnp.float32))


class BertForMultipleChoice(nn.Module):
    """SWAG-style multiple choice (HF: BertForMultipleChoice): each choice is its own [CLS] context [SEP] ending
    [SEP] row; pooled [CLS] -> dropout -> Dense(1) scores it. Inputs [B, choices, L] give logits [B, choices]
    (a softmax across the choices is the loss's business); [B, L] gives [B]. The head is `classifier` with one
    output, as HF names it."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids, *, deterministic: bool = True):
        leading, length = input_ids.shape[:-1], input_ids.shape[-1]
        flat = [x.reshape(-1, length) for x in (input_ids, input_mask, segment_ids)]
        _, pooled = BertModel(self.config, name="bert")(*flat, deterministic=deterministic)
        pooled = Dropout(self.config.hidden_dropout_prob)(pooled, deterministic=deterministic)
        scores = nn.Dense(1, dtype=jnp.float32, param_dtype=jnp.float32,
                          kernel_init=_kernel_init(self.config, ("embed", None)), bias_init=_zeros((None,)),
                          name="classifier")(pooled.astype(jnp.float32))
        return scores.reshape(leading)


class BertForQuestionAnswering(nn.Module):
    """Per-token span start/end logits (SQuAD). Returns (start_logits, end_logits), each [B, L] float32."""

    config: BertConfig

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids, *, deterministic: bool = True):
        sequence, _ = BertModel(self.config, add_pooler=False, name="bert")(
            input_ids, input_mask, segment_ids, deterministic=deterministic)
        logits = nn.Dense(2, dtype=jnp.float32, param_dtype=jnp.float32,
                          kernel_init=_kernel_init(self.config, ("embed", None)), bias_init=_zeros((None,)),
                          name="qa_outputs")(sequence.astype(jnp.float32))
        return logits[..., 0], logits[..., 1]


class BertForTokenClassification(nn.Module):
    """Per-token labels (NER): sequence output -> dropout -> Dense(num_labels); no pooler, as HF's model.
    Returns [B, L, num_labels] float32 logits."""

    config: BertConfig
    num_labels: int

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids, *, deterministic: bool = True):
        sequence, _ = BertModel(self.config, add_pooler=False, name="bert")(
            input_ids, input_mask, segment_ids, deterministic=deterministic)
        sequence = Dropout(self.config.hidden_dropout_prob)(sequence, deterministic=deterministic)
        return nn.Dense(self.num_labels, dtype=jnp.float32, param_dtype=jnp.float32,
                        kernel_init=_kernel_init(self.config, ("embed", None)), bias_init=_zeros((None,)),
                        name="classifier")(sequence.astype(jnp.float32))


def init_params(module: nn.Module, config: BertConfig, rng, length: int = 8, num_masked: int = 2):
    """Initial (boxed, logically partitioned) params of any bertjax module, from dummy inputs."""
    ids = jnp.zeros((1, length), jnp.int32)
    args = (ids, jnp.ones_like(ids), ids)
    kwargs = {}
    if isinstance(module, BertForPreTraining):
        args += (jnp.zeros((1, num_masked), jnp.int32),)
        if module.span_boundary_objective:
            kwargs = {"span_left_positions": jnp.zeros((1, num_masked), jnp.int32),
                      "span_right_positions": jnp.zeros((1, num_masked), jnp.int32)}
    return module.init(rng, *args, **kwargs)["params"]
