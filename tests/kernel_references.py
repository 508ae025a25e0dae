"""The Pallas kernels' inputs and references, under the names the kernels' tests use: they live in
`bertjax.model.kernels.gpu.gpu_kernel_check`, whose check runs them on a card before a job trusts its kernels (and
bench/gpu_kernels.py at BERT-base shapes). Each `*_kernel_and_reference` returns the kernel's value and gradients
and the XLA reference's on the same inputs with the same dropout mask, run on JAX's default device."""
from bertjax.model.kernels.gpu.gpu_kernel_check import (  # noqa: F401
    LAYER_NORM_EPS,
    LAYER_NORM_RATE,
    attention_kernel_and_reference,
    layer_norm_inputs,
    layer_norm_kernel_and_reference,
    layer_norm_value_and_grads,
    pre_norm_sum_kernel_and_reference,
    stacked_attention_kernel_and_reference,
)
from bertjax.model.kernels.gpu.gpu_kernel_check import attention_inputs as _inputs  # noqa: F401
from bertjax.model.kernels.gpu.gpu_kernel_check import projection_biases as _biases  # noqa: F401
from bertjax.model.kernels.gpu.gpu_kernel_check import reference_with_mask as _reference  # noqa: F401
from bertjax.model.kernels.gpu.gpu_kernel_check import segment_ids_for as _segments  # noqa: F401
from bertjax.model.kernels.gpu.gpu_kernel_check import value_and_grads as _value_and_grads  # noqa: F401
