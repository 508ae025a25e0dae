"""ModernBERT in Flax (linen), as transformers' ModernBertModel and its task models compute it.

Pre-norm layers without biases (by default): x + Wo(attn(norm(x))), then x + Wo(act(x Wi_in) * x Wi_gate) (GeGLU);
rotary positions (a theta for global layers, another for sliding-window ones); attention over the whole row in
global layers and over a window of local_attention // 2 tokens each side in the others; a final norm. Heads: HF's
prediction head (dense, activation, norm) under every task, the MLM decoder tied to the token embeddings.

The same call convention and parts as `bert.py`'s modules: `apply({"params": p}, input_ids, input_mask,
segment_ids, ..., deterministic=True)` (segment ids are ignored: ModernBERT has no token types); packed rows take
`packing_ids` and `position_ids` (RoPE restarts at each packed sequence; attention keeps to it and to the window);
attention through `attention.dot_product_attention`, LayerNorm through `layer_norm.layer_norm`, dropout
through `dropout.Dropout`, logical axis names as BERT's, `remat` as BERT's. The encoder's params live under `bert`
(as BERT's do) so that every tool that reads a param tree by its layers (stacking, weight decay, sharding) reads
both families; each layer holds an attention norm, layer 0's unused (HF's is an Identity), so that all layers have
one tree: stacked, sliced, scanned alike. Import fills it with ones; export leaves it out.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.model import rope
from bertjax.model.kernels.tpu import rope_tpu
from bertjax.model.attention import (FUSED_DROPOUT_BACKENDS, FUSED_DROPOUT_MIN_LENGTH, dot_product_attention,
                                     resolve_backend, stacked_gpu_attention)
from bertjax.model.bert.model import activation, gated_activation, gather_positions, init_params as _init_params, take_rows
from bertjax.model.dropout import Dropout
from bertjax.model.layer_norm import layer_norm, sum_and_layer_norm
from bertjax.model.modernbert.config import ModernBertConfig
from bertjax.model.split_products import split_products
from bertjax.sharding import logical_axis_size, target_platform

_BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")


def _init(config: ModernBertConfig, std: float, names):
    """HF's ModernBERT init: a normal of std `std` cut at +-initializer_cutoff_factor std."""
    cutoff = config.initializer_cutoff_factor
    init = nn.initializers.truncated_normal(stddev=std, lower=-cutoff, upper=cutoff)
    return nn.with_logical_partitioning(init, names)


def _zeros(names):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _out_std(config: ModernBertConfig) -> float:
    """The std of the projections back to the residual stream (HF's "out")."""
    return config.initializer_range / (2.0 * config.num_hidden_layers) ** 0.5


def _constrain(x, names):
    return nn.with_logical_constraint(x, names)


class Norm(nn.Module):
    """LayerNorm over the last axis, its bias only with `norm_bias` (params `scale`, `bias`); float32 inside. Given a
    residual, of the residual stream residual + x: (that sum, its norm)."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x, residual=None):
        c = self.config
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
                           (x.shape[-1],), jnp.float32)
        bias = (self.param("bias", _zeros(("embed",)), (x.shape[-1],), jnp.float32) if c.norm_bias
                else jnp.zeros((x.shape[-1],), jnp.float32))
        if residual is None:
            return layer_norm(x, scale, bias, c.norm_eps, jnp.dtype(c.dtype))
        return sum_and_layer_norm(x, residual, scale, bias, c.norm_eps, jnp.dtype(c.dtype))


class Projection(nn.Module):
    """x W (+ b): a kernel [in, *out_shape] (HF's Linear weight [prod(out_shape), in], transposed), optional bias.

    A fused projection (out_shape (n, width): Wi) returns one product [..., n, width], or with `merged=True` (on
    TPU) [..., n * width], the n outputs side by side in the lanes: [..., n, width] puts n in XLA:TPU's sublanes,
    padded to 8 (4x the bytes for n = 2)."""

    config: ModernBertConfig
    out_shape: tuple[int, ...]
    names: tuple[str | None, ...]  # the kernel's logical axes
    std: float
    use_bias: bool
    merged: bool = False   # a fused projection's product as [..., n * width]

    @nn.compact
    def __call__(self, x):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        kernel = self.param("kernel", _init(c, self.std, self.names), (x.shape[-1], *self.out_shape), jnp.float32)
        bias = (self.param("bias", _zeros(self.names[1:]), self.out_shape, jnp.float32).astype(dtype)
                if self.use_bias else None)
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        if len(self.out_shape) == 1:
            return x @ kernel + (0 if bias is None else bias)
        if self.merged:
            width = self.out_shape[0] * self.out_shape[1]
            return x @ kernel.reshape(x.shape[-1], width) + (0 if bias is None else bias.reshape(width))
        return jnp.einsum("...h,hnw->...nw", x, kernel) + (0 if bias is None else bias)


class Embeddings(nn.Module):
    """Token embeddings (no positions, no token types), norm, dropout."""

    config: ModernBertConfig

    def setup(self):
        c = self.config
        self.tok_embeddings = self.param("tok_embeddings", _init(c, c.initializer_range, ("vocab", "embed")),
                                         (c.vocab_size, c.hidden_size), jnp.float32)
        self.norm = Norm(c)
        self.drop = Dropout(c.embedding_dropout)

    def __call__(self, input_ids, deterministic: bool):
        x = take_rows(self.tok_embeddings, input_ids)  # its gradient's zeroed table made late (`table_gradient`)
        return self.drop(self.norm(x), deterministic=deterministic)

    def attend(self, x):
        """Logits against the token embeddings (the tied decoder), in the compute dtype (BERT's `attend`, and
        transformers' decoder under autocast): in float32 the [tokens, vocab] logits were written at twice the
        bytes, and a GPU multiplies float32 at half its bfloat16 rate or less."""
        dtype = jnp.dtype(self.config.dtype)
        return jnp.einsum("...h,vh->...v", x.astype(dtype), self.tok_embeddings.astype(dtype))


class RotaryQKV(nn.Module):
    """HF's Wqkv (a Linear [3H, H], held as a kernel [H, 3, H]; its bias [3, H] with attention_bias) and the rotary
    positions on q and k: (q, k, v), each [B, L, H] with the heads side by side; or, `stacked` (for the GPU
    attention kernel, which adds the biases and rotates q and k as it loads them), (x W [B, L, 3, H], the bias or
    None) as one product.

    On TPU q and k are rotated by one Pallas kernel (`rope_tpu`: each head's halves moved in vector registers).
    XLA:TPU moved them through copies in layouts of 64 lanes padded to 128, so before the kernel the rotation came
    from the weights, rotate_half(x W + b) = x rotate_half(W) + rotate_half(b) (a signed permutation of the columns:
    exact), doubling q's and k's projections; shapes the kernel does not take still go that way (the priced steps
    of both: docs/performance.md). XLA:GPU moves lanes cheaply (there the doubled projections cost more than
    XLA's rotation of q and k): elsewhere XLA rotates them, where the GPU attention kernel does not (`stacked`:
    sequences shorter than its 128 tokens, a kernel that failed its check). The three products' gradients are one
    matmul each (`split_products`: XLA:TPU priced the sum of three input gradients at ~1.7x one matmul; XLA:GPU
    wrote q's and k's gradients, then summed three products in a pass of its own)."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x, rotary, stacked: bool = False):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        names = ("embed", None, "heads")
        kernel = self.param("kernel", _init(c, c.initializer_range, names), (x.shape[-1], 3, c.hidden_size),
                            jnp.float32).astype(dtype)
        bias = (self.param("bias", _zeros(names[1:]), (3, c.hidden_size), jnp.float32)
                if c.attention_bias else None)
        x = x.astype(dtype)
        if stacked:
            return jnp.einsum("...h,hnw->...nw", x, kernel), bias
        bias = None if bias is None else bias.astype(dtype)
        on_tpu = target_platform() == "tpu"
        in_kernel = on_tpu and rope_tpu.supported(c.hidden_size, c.head_dim, x.shape[1])
        outputs = list(split_products(x, kernel))
        for i in range(3):
            y = outputs[i] + (0 if bias is None else bias[i])
            if i < 2 and on_tpu and not in_kernel:   # q and k
                y_rot = (x @ rope.rotate_half(kernel[:, i], c.head_dim)
                         + (0 if bias is None else rope.rotate_half(bias[i], c.head_dim)))
                y = rope.rotate(y, y_rot, *rotary, c.head_dim)
            elif i < 2 and not on_tpu:
                y = rope.apply_rotary(y, *rotary, c.head_dim)
            outputs[i] = y
        if in_kernel:
            outputs[:2] = rope_tpu.rotate_qk_on_devices(*outputs[:2], *rotary, c.head_dim)
        return outputs


class Attention(nn.Module):
    """Fused q/k/v projection, rotary positions on q and k, attention (windowed in sliding layers), output
    projection and its dropout (HF's `out_drop`, at attention_dropout). With the GPU attention kernel, the
    projection's output goes to it stacked, as it is (`attention.stacked_gpu_attention`: the rotation and the
    biases in the kernels, the gradient of the three one array)."""

    config: ModernBertConfig
    layer: int | None   # None: a scanned layer, global or windowed as its `is_global` input says

    @nn.compact
    def __call__(self, x, input_mask, packing_ids, rotary, deterministic: bool, is_global=None):
        c = self.config
        heads, head_dim = c.num_attention_heads, c.head_dim
        dropout_active = not deterministic and c.attention_dropout > 0
        backend = c.attention_backend
        platform = target_platform()
        # The windows this layer may have: one, or in a scan both (a global layer's None, a windowed one's).
        windows = [None, c.window] if self.layer is None else [None if c.is_global(self.layer) else c.window]
        if backend == "auto" and platform in FUSED_DROPOUT_BACKENDS and x.shape[1] >= FUSED_DROPOUT_MIN_LENGTH:
            # Global layers too, the same kernel as the windowed ones: on TPU ours reads q/k/v in the projections'
            # [B, S, heads * 64] layout where splash wants [heads, S, 64] per example (transposes, 64 lanes padded to
            # 128) and declares no cost to price; on GPU cuDNN's fused attention takes no packed segments.
            backend = FUSED_DROPOUT_BACKENDS[platform]
        dropout = dict(dropout_rate=c.attention_dropout,
                       dropout_rng=self.make_rng("dropout") if dropout_active else None, deterministic=deterministic)
        stacked = all(resolve_backend(backend, dropout_active, platform, x.shape[1], window is not None)
                      == "flash_dropout_gpu" for window in windows)
        if stacked:
            qkv, bias = RotaryQKV(c, name="Wqkv")(x, rotary, stacked=True)
            qkv = _constrain(qkv.reshape(x.shape[:2] + (3, heads, head_dim)),
                             ("activation_batch", "activation_length", None, "activation_heads", "activation_kv"))
            biases = None if bias is None else tuple(bias.reshape(3, heads, head_dim))
            operands = (qkv,)

            def attend(window, qkv):
                return stacked_gpu_attention(qkv, input_mask, packing_ids, rotary=rotary, biases=biases,
                                             window=window, **dropout)
        else:
            query, key, value = RotaryQKV(c, name="Wqkv")(x, rotary)
            operands = tuple(_constrain(t.reshape(x.shape[:2] + (heads, head_dim)),
                                        ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
                             for t in (query, key, value))

            def attend(window, query, key, value):
                return dot_product_attention(query, key, value, input_mask, packing_ids, backend=backend,
                                             window=window, **dropout)
        if len(windows) == 1:
            context = attend(windows[0], *operands)
        else:   # only the attention itself branches: the projections, the same params either way, stay outside
            context = jax.lax.cond(is_global, lambda *ops: attend(None, *ops), lambda *ops: attend(c.window, *ops),
                                   *operands)
        context = context.reshape(x.shape[:2] + (c.hidden_size,))
        out = Projection(c, (c.hidden_size,), ("heads", "embed"), _out_std(c), c.attention_bias, name="Wo")(context)
        return Dropout(c.attention_dropout, name="out_drop")(out, deterministic=deterministic)


class GatedMLP(nn.Module):
    """Wo(drop(act(x Wi_input) * x Wi_gate)): HF's Wi [2 * intermediate, H] held as a kernel [H, 2, intermediate]."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        c = self.config
        # One product, so that its input gradient is one matmul (two, summed, cost XLA:TPU 1.8x their FLOPs). On
        # TPU its halves side by side in the lanes, sliced at a lane-tile boundary: XLA:TPU fuses the GELU's
        # backward into the matmul that writes its cotangent. Elsewhere [..., 2, intermediate], its gradient
        # written whole by the GELU's backward (`gated_gelu_of_pair`): XLA:GPU joined sliced halves' gradients
        # in concatenates of their own. With "mlp" split over devices, the pair's halves apart: both merge the
        # pair with the split axis (the kernel, the GELU's gradient), which XLA reshards (all-to-alls).
        mlp_split = logical_axis_size("mlp") > 1
        merged = target_platform() == "tpu" and not mlp_split
        wi = Projection(c, (2, c.intermediate_size), ("embed", None, "mlp"), c.initializer_range, c.mlp_bias,
                        merged=merged, name="Wi")(x)
        of_pair = not (merged or mlp_split)
        gated = gated_activation(c.hidden_activation, of_pair=of_pair)
        width = c.intermediate_size
        halves = (wi[..., :width], wi[..., width:]) if merged else (wi[..., 0, :], wi[..., 1, :])
        inner = gated(wi) if of_pair else gated(*halves)
        inner = _constrain(inner, ("activation_batch", "activation_length", "activation_mlp"))
        inner = Dropout(c.mlp_dropout, name="drop")(inner, deterministic=deterministic)
        return Projection(c, (c.hidden_size,), ("mlp", "embed"), _out_std(c), c.mlp_bias, name="Wo")(inner)


class Layer(nn.Module):
    """One pre-norm encoder layer (HF: ModernBertEncoderLayer); layer 0 skips its attention norm.

    Its input is hidden + branch (the previous layer's two parts; branch None: hidden alone), its output likewise
    (hidden, the feed-forward's output): each sum is taken by the norm that reads it (`Norm` with a residual: on a
    GPU one kernel writes the sum and the norm, the sum's gradient added in its backward).

    `layer` None: one layer of a scan, told which it is by `flags` (is_first, is_global) and given both rotary
    tables (global, local), picked by is_global; layer 0's branch comes in as zeros (hidden + 0 is hidden)."""

    config: ModernBertConfig
    layer: int | None

    @nn.compact
    def __call__(self, hidden, branch, input_mask, packing_ids, rotary, deterministic: bool, flags=None):
        c = self.config
        attn_norm = Norm(c, name="attn_norm")
        if branch is not None:
            hidden, normed = attn_norm(branch, hidden)
        else:
            normed = attn_norm(hidden)
        is_global = None
        if self.layer is None:
            is_first, is_global = flags
            normed = jnp.where(is_first, hidden, normed)
            rotary = tuple(jnp.where(is_global, g, l) for g, l in zip(*rotary))
        elif self.layer == 0:   # HF's layer 0 has no attention norm (its input is the embeddings' norm)
            normed = hidden
        attended = Attention(c, self.layer, name="attn")(normed, input_mask, packing_ids, rotary, deterministic,
                                                         is_global)
        hidden, normed = Norm(c, name="mlp_norm")(attended, hidden)
        return (_constrain(hidden, _BATCH_LENGTH_EMBED),
                _constrain(GatedMLP(c, name="mlp")(normed, deterministic), _BATCH_LENGTH_EMBED))


_REMAT_POLICIES = {"dots": jax.checkpoint_policies.checkpoint_dots,
                   "full": jax.checkpoint_policies.nothing_saveable}


def _layer_class(config: ModernBertConfig):
    if config.remat == "none":
        return Layer
    # `deterministic` (argument 6, counting the module) is a Python bool that dropout branches on. Inside a scan
    # the loop already keeps XLA from merging the recomputation into the forward pass (as BERT's).
    return nn.remat(Layer, policy=_REMAT_POLICIES[config.remat], prevent_cse=not config.scan_layers,
                    static_argnums=(6,))


class ModernBertModel(nn.Module):
    """Embeddings, layers, final norm: (sequence_output [B, L, H], None) as BertModel returns (no pooler).

    Hidden states are sown into "intermediates" as `hidden_states`, num_hidden_layers + 1 of them as transformers'
    `output_hidden_states` gives them: the embeddings' output, each layer's, the last one after the final norm."""

    config: ModernBertConfig

    def setup(self):
        c = self.config
        self.embeddings = Embeddings(c)
        layer = _layer_class(c)
        if c.scan_layers:
            self.layers = layer(c, None)   # params bert/layers/..., stacked by `_scan_layers`
        else:
            self.layers = [layer(c, i, name=f"layer_{i}") for i in range(c.num_hidden_layers)]
        self.final_norm = Norm(c)

    def __call__(self, input_ids, input_mask, segment_ids=None, *, packing_ids=None, position_ids=None,
                 deterministic: bool = True):
        c = self.config
        if position_ids is None:
            position_ids = jnp.arange(input_ids.shape[-1], dtype=jnp.int32)[None]
        rotary = {theta: rope.cos_sin(position_ids, c.head_dim, theta)
                  for theta in {c.global_rope_theta, c.local_rope_theta}}
        hidden = _constrain(self.embeddings(input_ids, deterministic), _BATCH_LENGTH_EMBED)
        self.sow("intermediates", "hidden_states", hidden)
        if c.scan_layers:
            hidden, branch = self._scan_layers(hidden, input_mask, packing_ids,
                                               (rotary[c.global_rope_theta], rotary[c.local_rope_theta]),
                                               deterministic)
        else:
            branch = None
            for i, layer in enumerate(self.layers):
                hidden, branch = layer(hidden, branch, input_mask, packing_ids, rotary[c.rope_theta(i)],
                                       deterministic)
                if i < c.num_hidden_layers - 1:
                    self.sow("intermediates", "hidden_states", hidden + branch)
        _, hidden = self.final_norm(branch, hidden)
        self.sow("intermediates", "hidden_states", hidden)
        return hidden, None

    def _scan_layers(self, hidden, input_mask, packing_ids, rotary, deterministic: bool):
        """The layers as one `nn.scan` over the stacked params (XLA compiles one layer, not N): each layer told by
        the scanned flags whether it is the first (no attention norm) and global (no window, the global rotary
        table), the attention alone branching (`lax.cond`). (hidden, branch) after the last layer. As BERT's scan:
        other dropout bits than the unrolled layers' (the same distribution), the same values without dropout."""
        c = self.config
        collect = self.is_mutable_collection("intermediates")
        layers = range(c.num_hidden_layers)
        flags = (jnp.asarray([i == 0 for i in layers]), jnp.asarray([c.is_global(i) for i in layers]))

        def body(layer, carry, flags):
            carry = layer(*carry, input_mask, packing_ids, rotary, deterministic, flags)
            return carry, (carry[0] + carry[1] if collect else None)

        scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                       length=c.num_hidden_layers, metadata_params={nn.PARTITION_NAME: "layers"})
        carry, states = scan(self.layers, (hidden, jnp.zeros_like(hidden)), flags)
        if collect:
            for i in range(c.num_hidden_layers - 1):
                self.sow("intermediates", "hidden_states", states[i])
        return carry

    def attend(self, x):
        return self.embeddings.attend(x)


class PredictionHead(nn.Module):
    """HF's ModernBertPredictionHead: norm(act(dense(x))), the head under every task model."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        x = Projection(c, (c.hidden_size,), ("embed", "embed_out"), _out_std(c), c.classifier_bias, name="dense")(x)
        return Norm(c, name="norm")(activation(c.classifier_activation)(x))


def _classifier(config: ModernBertConfig, outputs: int) -> nn.Dense:
    """A task's output layer (HF: `classifier`, a Linear with its bias), float32 logits; built inside a task
    model's compact call, so its params are the model's `classifier/{kernel, bias}`."""
    return nn.Dense(outputs, dtype=jnp.float32, param_dtype=jnp.float32,
                    kernel_init=_init(config, config.hidden_size ** -0.5, ("embed", None)), bias_init=_zeros((None,)),
                    name="classifier")


def with_compute_dtype(params, config: ModernBertConfig):
    """The params with every projection's kernel (each leaf "kernel" but a float32 classifier's) already in the
    compute dtype, which is what the layers cast them to: handed to a loop over microbatches, the casts happen once
    per step, not in every microbatch (XLA keeps them inside the loop: on an H200, ModernBERT-base's 90 casts took
    ~0.5 ms a microbatch, priced). The layers' values and the gradients, converted back, are the same bits."""
    dtype = jnp.dtype(config.dtype)

    def cast(path, x):
        names = [getattr(key, "key", "") for key in path]
        return x.astype(dtype) if names[-1] == "kernel" and "classifier" not in names else x

    return jax.tree_util.tree_map_with_path(cast, params)


class ModernBertForMaskedLM(nn.Module):
    """The encoder, the prediction head and the decoder (tied to the token embeddings unless
    tie_word_embeddings=False), scored only at `masked_lm_positions` [B, P] when given (pretraining), else at every
    token. Returns {"mlm_logits": [B, P or L, vocab]} float32."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids=None, masked_lm_positions=None, *, packing_ids=None,
                 position_ids=None, deterministic: bool = True, **unused):
        c = self.config
        encoder = ModernBertModel(c, name="bert")
        sequence, _ = encoder(input_ids, input_mask, packing_ids=packing_ids, position_ids=position_ids,
                              deterministic=deterministic)
        if masked_lm_positions is not None:
            sequence = gather_positions(sequence, masked_lm_positions)
        x = PredictionHead(c, name="head")(sequence)
        if c.tie_word_embeddings:
            logits = encoder.attend(x)
        else:
            logits = Projection(c, (c.vocab_size,), ("embed", "vocab"), _out_std(c), False, name="decoder")(x)
        logits = logits.astype(jnp.float32)
        if c.decoder_bias:
            logits = logits + self.param("decoder_bias", _zeros(("vocab",)), (c.vocab_size,), jnp.float32)
        return {"mlm_logits": logits}


def pool(sequence, input_mask, how: str):
    """[B, H] from [B, L, H]: the first real token ("cls"; right padding: position 0) or the mean over real
    tokens ("mean"), as HF's task models pool."""
    if how == "cls":
        first = jnp.argmax(input_mask, axis=-1)
        return jnp.take_along_axis(sequence, first[:, None, None], axis=1)[:, 0]
    weights = input_mask.astype(jnp.float32)[..., None]
    return (sequence.astype(jnp.float32) * weights).sum(1) / weights.sum(1)


class ModernBertForSequenceClassification(nn.Module):
    """Pooled (classifier_pooling) -> head -> dropout -> classifier(num_labels); num_labels=1 is regression."""

    config: ModernBertConfig
    num_labels: int

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids=None, *, deterministic: bool = True):
        c = self.config
        sequence, _ = ModernBertModel(c, name="bert")(input_ids, input_mask, deterministic=deterministic)
        pooled = PredictionHead(c, name="head")(pool(sequence, input_mask, c.classifier_pooling))
        pooled = Dropout(c.classifier_dropout)(pooled, deterministic=deterministic)
        return _classifier(c, self.num_labels)(pooled.astype(jnp.float32))


class ModernBertForMultipleChoice(nn.Module):
    """Each choice a row; pooled -> head -> dropout -> classifier(1). [B, choices, L] -> logits [B, choices]."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids=None, *, deterministic: bool = True):
        c = self.config
        leading, length = input_ids.shape[:-1], input_ids.shape[-1]
        ids, mask = input_ids.reshape(-1, length), input_mask.reshape(-1, length)
        sequence, _ = ModernBertModel(c, name="bert")(ids, mask, deterministic=deterministic)
        pooled = PredictionHead(c, name="head")(pool(sequence, mask, c.classifier_pooling))
        pooled = Dropout(c.classifier_dropout)(pooled, deterministic=deterministic)
        return _classifier(c, 1)(pooled.astype(jnp.float32)).reshape(leading)


def _per_token_logits(c: ModernBertConfig, num_labels: int, input_ids, input_mask, deterministic: bool):
    """The token-level tasks' path, inside their compact __call__: encoder -> head -> dropout -> classifier, float32."""
    sequence, _ = ModernBertModel(c, name="bert")(input_ids, input_mask, deterministic=deterministic)
    sequence = Dropout(c.classifier_dropout)(PredictionHead(c, name="head")(sequence), deterministic=deterministic)
    return _classifier(c, num_labels)(sequence.astype(jnp.float32))


class ModernBertForTokenClassification(nn.Module):
    """Every token -> head -> dropout -> classifier(num_labels): [B, L, num_labels] float32."""

    config: ModernBertConfig
    num_labels: int

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids=None, *, deterministic: bool = True):
        c = self.config
        return _per_token_logits(c, self.num_labels, input_ids, input_mask, deterministic)


class ModernBertForQuestionAnswering(nn.Module):
    """Every token -> head -> dropout -> classifier(2): (start_logits, end_logits), each [B, L] float32."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids=None, *, deterministic: bool = True):
        c = self.config
        logits = _per_token_logits(c, 2, input_ids, input_mask, deterministic)
        return logits[..., 0], logits[..., 1]


def init_params(module: nn.Module, config: ModernBertConfig, rng, length: int = 8, num_masked: int = 2):
    """Initial (boxed, logically partitioned) params of any ModernBERT module, from dummy inputs."""
    if isinstance(module, ModernBertForMaskedLM):
        ids = jnp.zeros((1, length), jnp.int32)
        return module.init(rng, ids, jnp.ones_like(ids), ids, jnp.zeros((1, num_masked), jnp.int32))["params"]
    return _init_params(module, config, rng, length, num_masked)
