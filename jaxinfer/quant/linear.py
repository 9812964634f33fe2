"""Quantized linear layers, where they sit in a model, and round-to-nearest quantization of it.

The model's projections are float linear parameters (`attention.q_proj` is a `[D, N, H]`
`jaxinfer.models.layers.LinearParam`, which the forward calls: `self.q_proj(x)`).
Quantizing one replaces that attribute with a `QuantizedLinear` module holding a
`pallas_kernels.quant_matmul.QuantizedWeight` of the flattened `[I, O]` matrix
(`[D, N * H]` for q_proj, `[N * H, D]` for o_proj); it takes the same call, so the forward
does not change, and it calls `quantized_matmul`, which looks the weight's format up in
the format registry and lets `pallas_kernels.dispatch` pick the Pallas kernel or the
reference for it like for every other op.

`linear_sites(model)` lists every linear weight of a dense Llama-family model in forward
order with its dotted path, which `QuantizationConfig` rules match against. MoE expert
stacks and the router are not listed (they stay in floating point), nor is the embedding
table (a lookup) or OSP's embedding projections (folded away at export).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxinfer.models import Transformer
from jaxinfer.models.layers import MLP, LinearParam, ReadInPlace, StackedLayer
from jaxinfer.quant.config import QuantizationConfig, WeightScheme
from jaxinfer.sharding import active_axis
from pallas_kernels import dispatch
from pallas_kernels.quant_matmul import QuantizedWeight, dequantize_weight, get_format
from pallas_kernels.quant_matmul import cpu as cpu_quant_matmul
from pallas_kernels.quant_matmul import quantized_matmul as quantized_matmul_op


class QuantizedArray(ReadInPlace, nnx.Variable):
    """Integer values, scales or zero points of a quantized layer (not a trainable Param).

    Inside a scan over stacked layers it holds a `StackedLayer` view (`jaxinfer.models.scan`):
    the layer multiplies its slice in place where the CPU kernel takes it, else slices.
    """


class QuantizedLinear(nnx.Module):
    """`x @ weight` for a quantized `[I, O]` weight, reshaped to the parameter it replaces.

    Under tensor parallelism the layer is split like the float parameter it replaces: its
    arrays carry logical axes (`logical_axes`, the float parameter's input and output axes
    flattened), so the engine's sharding rules place them, and the call runs the kernel per
    shard under `jax.shard_map` (a Pallas call cannot be split by the compiler, which would
    otherwise gather the whole weight onto every chip each step):
    - output split (q, k, v, gate, up): each shard computes its columns from the whole `x`;
    - input split (o, down): each shard multiplies its slice of `x` by its rows, and one
      all-reduce adds the partial sums, as for the float weight. W8A8 then quantizes each
      token per slice (a scale per token and shard), not over the whole row. Compressed 2:4
      sparse formats (`WeightFormat.sparse_2_4`) store the two halves of I side by side, so
      they are refused on input-split layers (ValueError at the call).

    A layer may hold an input permutation (GPTQ checkpoints quantized with act-order, whose
    groups are scattered over the input rows; `jaxinfer.quant.pre_quantized`): its weight's
    rows are stored in the permuted order, so each group is contiguous, and the call gathers
    the activations' features into the same order first, `x[..., perm] @ W[perm] = x @ W`.
    The permutation is replicated; an input-split layer gathers before its shard_map, so
    XLA fetches the features each shard needs.

    Args:
        weight: The quantized `[I, O]` matrix.
        output_shape: The output axes of the replaced parameter, whose product is O (e.g.
            `(N, H)` for q_proj); the layer's output is `[..., *output_shape]`.
        logical_axes: The logical axes of I and O (None: never split).
        implementation: `pallas_kernels.dispatch` choice; "auto" follows
            `force_implementation` and `JAXINFER_KERNELS`.
        input_permutation: `[I]` int32, or None: the weight's row `j` is the original
            matrix's row `input_permutation[j]` (see above).
        int8_activations: On the CPU kernel's decode path, whether activations are quantized
            to int8 per block of 32 features (llama.cpp's Q8 rule, faster on AVX2, not exact):
            None follows `$JAXINFER_CPU_INT8_ACTIVATIONS` (default "decode": products of at
            most 16 rows, see `pallas_kernels.quant_matmul.cpu.int8_activations_by_default`);
            False keeps them float32 everywhere.
        exact_top: With int8 activations, each row's `exact_top` largest outputs are
            recomputed with float32 activations (an LM head's argmax is where an activation
            rounding shows first; `pallas_kernels.quant_matmul.cpu.matmul`). 0: none.
    """

    def __init__(self, weight: QuantizedWeight, output_shape: Sequence[int], *,
                 logical_axes: tuple[str | None, str | None] = (None, None),
                 implementation: str = "auto",
                 input_permutation: jax.Array | None = None,
                 int8_activations: bool | None = None, exact_top: int = 0) -> None:
        if math.prod(output_shape) != weight.shape[1]:
            raise ValueError(f"output_shape {tuple(output_shape)} does not hold the "
                             f"{weight.shape[1]} output features of the quantized weight")
        rows, columns = logical_axes
        grouped = weight.scales is not None and weight.scales.ndim == 2
        # Group scales and zero points follow the rows they scale. eager_sharding=False:
        # placement is decided for the whole model by the loader, as for float parameters.
        self.values = QuantizedArray(weight.values,  # [I // rows_per_stored_row, O]
                                     out_sharding=(rows, columns), eager_sharding=False)
        self.scales = None if weight.scales is None else QuantizedArray(
            weight.scales,  # [O] or [C, O] float32
            out_sharding=(rows, columns) if grouped else (columns,), eager_sharding=False)
        self.zeros = None if weight.zeros is None else QuantizedArray(
            weight.zeros, out_sharding=(rows, columns), eager_sharding=False)  # [C, O]
        self.positions = None if weight.positions is None else QuantizedArray(
            weight.positions, out_sharding=(rows, columns), eager_sharding=False)  # [I // 8, O]
        if input_permutation is not None and input_permutation.shape != weight.shape[:1]:
            raise ValueError(f"input_permutation of shape {input_permutation.shape} does not "
                             f"fit the {weight.shape[0]} input features of the weight")
        self.input_permutation = None if input_permutation is None else QuantizedArray(
            input_permutation, out_sharding=(None,), eager_sharding=False)  # [I] int32
        self.format = weight.format
        self.group_size = weight.group_size
        self.bits = weight.bits
        self.output_shape = tuple(output_shape)
        self.logical_axes = (rows, columns)
        self.implementation = implementation
        self.int8_activations = int8_activations
        self.exact_top = exact_top

    def _arrays(self) -> list[jax.Array | StackedLayer | None]:
        # get_value(), not [...]: a StackedLayer view cannot be indexed.
        return [None if array is None else array.get_value()
                for array in (self.values, self.scales, self.zeros, self.positions)]

    @property
    def weight(self) -> QuantizedWeight:
        """The layer's `QuantizedWeight` (a pytree; traced arrays inside jit; inside a scan
        over stacked layers, this iteration's slices)."""
        values, scales, zeros, positions = (
            array.matrix() if isinstance(array, StackedLayer) else array
            for array in self._arrays())
        return QuantizedWeight(self.format, values, scales, zeros, self.group_size,
                               self.bits, positions)

    def _kernel_weight(self, x: jax.Array, out_dtype: jnp.dtype | None = None
                       ) -> tuple[tuple[jax.Array, jax.Array, jax.Array | None],
                                  jax.Array | None] | None:
        """`((values, scales, zeros), layer)` as the CPU kernel (`pallas_kernels.quant_matmul.
        cpu`) reads them, whole stacks and this scan iteration's layer inside a scan (layer
        None outside one), or None where the kernel does not apply (another backend or
        implementation, format or size, a sharded axis, a permuted input)."""
        values, scales, zeros, _ = self._arrays()
        stacked = isinstance(values, StackedLayer)
        stack = values.stack if stacked else values  # [(L,) I', O]
        if (out_dtype not in (None, jnp.float32) or dispatch.resolve(self.implementation) != "xla"
                or any(active_axis(name) is not None for name in self.logical_axes
                       if name is not None)
                or not cpu_quant_matmul.supports(x, self.format, stack)):
            return None
        if stacked:
            return ((stack, scales.stack, None if zeros is None else zeros.stack),
                    values.layer)
        return (values, scales, zeros), None

    def _cpu_kernel(self, x: jax.Array, out_dtype: jnp.dtype | None) -> jax.Array | None:
        """`x @ weight` by the CPU kernel, reading this layer of a stack in place inside a
        scan, or None where it does not apply (`_kernel_weight`)."""
        found = self._kernel_weight(x, out_dtype)
        if found is None:
            return None
        (values, scales, zeros), layer = found
        return cpu_quant_matmul.matmul(
            x, self.format, values, scales, zeros, self.group_size, layer=layer,
            int8_activations=self.int8_activations, exact_top=self.exact_top)  # [..., O]

    def call_together(self, x: jax.Array, layers: Sequence[object]) -> list[jax.Array] | None:
        """`[layer(x) for layer in layers]` (this layer first) in one CPU kernel call
        (`cpu_quant_matmul.matmul_many`: x quantized once, the threads started once), or None
        where the layers cannot share one: each must be a `QuantizedLinear` the kernel takes,
        of this one's format, group size, zero-point presence and activation setting, with no
        input permutation or exact top (`jaxinfer.models.layers.project_together` then calls
        them one by one)."""
        if not all(isinstance(layer, QuantizedLinear) for layer in layers):
            return None
        found = [layer._kernel_weight(x) if (
            layer.format == self.format and layer.group_size == self.group_size
            and (layer.zeros is None) == (self.zeros is None)
            and layer.int8_activations == self.int8_activations and layer.exact_top == 0
            and layer.input_permutation is None) else None for layer in layers]
        if any(weight is None for weight in found) or len({
                layer is None for _, layer in found}) != 1:
            return None
        outs = cpu_quant_matmul.matmul_many(
            x, self.format, [weights for weights, _ in found], self.group_size,
            layer=found[0][1], int8_activations=self.int8_activations)  # [..., O_i] each
        return [out.reshape(*x.shape[:-1], *layer.output_shape)
                for out, layer in zip(outs, layers, strict=True)]  # [..., *output_shape] each

    def __call__(self, x: jax.Array, *, out_dtype: jnp.dtype | None = None) -> jax.Array:
        """`[..., I]` activations to `[..., *output_shape]` (the `LinearParam` call).

        Args:
            x: `[..., I]` activations.
            out_dtype: Result dtype (the kernels accumulate in float32 and write it
                directly); default the activations' dtype.
        """
        if self.input_permutation is not None:
            permutation = self.input_permutation.get_value()  # [I] (a StackedLayer in a scan)
            if isinstance(permutation, StackedLayer):
                permutation = permutation.matrix()  # [I]
            x = jnp.take(x, permutation, axis=-1)  # [..., I] weight's row order
        rows, columns = (None if name is None else active_axis(name)
                         for name in self.logical_axes)
        if rows is None and columns is None:
            out = self._cpu_kernel(x, out_dtype)  # [..., O] or None
            if out is not None:
                return out.reshape(*x.shape[:-1], *self.output_shape)  # [..., *output_shape]
        weight = self.weight
        matmul = functools.partial(quantized_matmul_op, implementation=self.implementation,
                                   out_dtype=out_dtype)
        if rows is None and columns is None:
            out = matmul(x, weight)  # [..., O]
        else:
            out = _sharded_matmul(matmul, x, weight, rows, columns)  # [..., O]
        return out.reshape(*x.shape[:-1], *self.output_shape)  # [..., *output_shape]

    def dequantized(self) -> jax.Array:
        """The float32 `[I, O]` matrix the layer multiplies by (in the activations' feature
        order: a permuted layer's rows are put back)."""
        matrix = dequantize_weight(self.weight)  # [I, O] in the stored row order
        if self.input_permutation is None:
            return matrix
        return jnp.zeros_like(matrix).at[self.input_permutation[...]].set(matrix)  # [I, O]

    def nbytes(self) -> int:
        """Bytes of values, scales, zero points, positions and input permutation."""
        arrays = [self.values[...]]
        for optional in (self.scales, self.zeros, self.positions, self.input_permutation):
            if optional is not None:
                arrays.append(optional[...])
        return sum(array.size * array.dtype.itemsize for array in arrays)


def _sharded_matmul(matmul: Callable[[jax.Array, QuantizedWeight], jax.Array], x: jax.Array,
                    weight: QuantizedWeight, rows: str | None, columns: str | None
                    ) -> jax.Array:
    """`matmul(x, weight)` per shard, the weight split over mesh axis `rows` (input
    features: partial sums, all-reduced) or `columns` (output features)."""
    if rows is not None and columns is not None:
        raise ValueError(f"a quantized weight split on both its inputs ({rows!r}) and "
                         f"outputs ({columns!r}) is not supported")
    if rows is not None and get_format(weight.format).sparse_2_4:
        # The compressed layout stores the two halves of I side by side (`sparse24.py`): a
        # block of its rows is not one contiguous slice of the inputs.
        raise ValueError(f"a {weight.format} weight cannot be split on its inputs "
                         f"({rows!r}); keep input-split layers (o_proj, down_proj) in "
                         f"another format under tensor parallelism")
    lead = (None,) * (x.ndim - 1)
    grouped = weight.scales is not None and weight.scales.ndim == 2
    split = PartitionSpec(rows, columns)
    specs = QuantizedWeight(
        weight.format, split,
        None if weight.scales is None else split if grouped else PartitionSpec(columns),
        None if weight.zeros is None else split, weight.group_size, weight.bits,
        None if weight.positions is None else split)
    if columns is not None:
        return jax.shard_map(matmul, in_specs=(PartitionSpec(), specs),
                             out_specs=PartitionSpec(*lead, columns),
                             check_vma=False)(x, weight)  # [..., O]

    def partial_sums(x_shard: jax.Array, weight_shard: QuantizedWeight) -> jax.Array:
        return jax.lax.psum(matmul(x_shard, weight_shard), rows)  # [..., O]

    return jax.shard_map(partial_sums, in_specs=(PartitionSpec(*lead, rows), specs),
                         out_specs=PartitionSpec(), check_vma=False)(x, weight)  # [..., O]


@dataclasses.dataclass(frozen=True)
class LinearSite:
    """One linear weight of a model: where it lives and how it flattens to `[I, O]`.

    Attributes:
        path: Dotted path, e.g. `layers.0.attention.o_proj`.
        owner: The module holding the attribute.
        name: The attribute (`q_proj`, `down_proj`, `lm_head`, ...).
        input_axes: How many leading axes of the float parameter are input features
            (2 for o_proj's `[N, H, D]`, 1 elsewhere).
    """

    path: str
    owner: nnx.Module
    name: str
    input_axes: int

    @property
    def layer(self) -> LinearParam | QuantizedLinear:
        """The float parameter or the quantized layer now at this site."""
        return getattr(self.owner, self.name)

    @property
    def is_quantized(self) -> bool:
        """Whether the site already holds a `QuantizedLinear`."""
        return isinstance(self.layer, QuantizedLinear)

    def float_matrix(self) -> jax.Array:
        """The float parameter flattened to `[I, O]` (in its own dtype).

        Raises:
            ValueError: The site is already quantized.
        """
        if self.is_quantized:
            raise ValueError(f"{self.path} is already quantized")
        value = self.layer[...]  # [*inputs, *outputs]
        inputs = math.prod(value.shape[:self.input_axes])
        return value.reshape(inputs, -1)  # [I, O]

    def output_shape(self) -> tuple[int, ...]:
        """The output axes of the parameter (or the quantized layer's)."""
        if self.is_quantized:
            return self.layer.output_shape
        return tuple(self.layer[...].shape[self.input_axes:])

    def set_float_matrix(self, matrix: jax.Array) -> None:
        """Replaces the float parameter's value by `[I, O]` `matrix`, reshaped and recast."""
        value = self.layer[...]  # [*inputs, *outputs]
        self.layer[...] = matrix.reshape(value.shape).astype(value.dtype)

    def logical_axes(self) -> tuple[str | None, str | None]:
        """The logical axes of the flattened `[I, O]` matrix: of each side, the float
        parameter's leading axis (flattening is row-major, so only a split of the leading
        axis keeps each shard's features contiguous), or None when it has none."""
        if self.is_quantized:
            return self.layer.logical_axes
        axes = self.layer.get_metadata().get("out_sharding") or ()
        if not axes:
            return None, None
        return axes[0], axes[self.input_axes]

    def quantize(self, weight: QuantizedWeight, implementation: str = "auto",
                 input_permutation: jax.Array | None = None) -> None:
        """Puts a `QuantizedLinear` of `weight` (rows in `input_permutation`'s order, if
        given) in the parameter's place, with the float parameter's logical axes."""
        setattr(self.owner, self.name,
                QuantizedLinear(weight, self.output_shape(), logical_axes=self.logical_axes(),
                                implementation=implementation,
                                input_permutation=input_permutation))


def linear_sites(model: Transformer) -> list[LinearSite]:
    """Every linear weight of `model` in forward order: per block q, k, v, o (v, o only in
    a HARP block), gate, up, down (dense blocks only), then the untied LM head."""
    sites = []
    for index, block in enumerate(model.layers):
        prefix = f"layers.{index}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(block.attention, name):  # q/k of a HARP block
                continue
            sites.append(LinearSite(f"{prefix}.attention.{name}", block.attention, name,
                                    2 if name == "o_proj" else 1))
        if isinstance(block.mlp, MLP):
            for name in ("gate_proj", "up_proj", "down_proj"):
                sites.append(LinearSite(f"{prefix}.mlp.{name}", block.mlp, name, 1))
    if model.lm_head is not None:
        sites.append(LinearSite("lm_head", model, "lm_head", 1))
    return sites


def quantize_matrix(matrix: jax.Array, scheme: WeightScheme) -> QuantizedWeight:
    """Round-to-nearest quantization of a `[I, O]` matrix in `scheme`."""
    return get_format(scheme.format).quantize(matrix, scheme.bits, scheme.group_size,
                                              scheme.symmetric)


def copy_model(model: Transformer) -> Transformer:
    """New modules and variables over the same (immutable) arrays, safe to change in place.

    (`nnx.merge(*nnx.split(model))` would share the variables: a write through the copy
    would change the original.)
    """
    return nnx.clone(model)


Quantizer = Callable[[LinearSite, WeightScheme], QuantizedWeight]


def quantize_model(model: Transformer, config: QuantizationConfig, *,
                   quantizer: Quantizer | None = None,
                   implementation: str = "auto") -> Transformer:
    """A copy of `model` whose linear weights are quantized as `config`'s rules say.

    Args:
        model: A float model (left unchanged).
        config: Which weight gets which scheme.
        quantizer: Chooses each weight's quantized values; default round-to-nearest of the
            float weight (GPTQ and SmoothQuant bring their own).
        implementation: The layers' `pallas_kernels.dispatch` choice.

    Returns:
        The quantized model; weights whose scheme is None stay float parameters.

    Raises:
        ValueError: A weight's shape does not fit its scheme (e.g. I not a multiple of the
            group size); the message names the weight.
    """
    model = copy_model(model)
    for site in linear_sites(model):
        scheme = config.scheme_for(site.path)
        if scheme is None or site.is_quantized:
            continue
        try:
            weight = (quantizer or _round_to_nearest)(site, scheme)
        except ValueError as error:
            raise ValueError(f"{site.path}: {error}") from None
        site.quantize(weight, implementation)
    quantize_tied_head(model, config, implementation)
    return model


def quantize_tied_head(model: Transformer, config: QuantizationConfig,
                       implementation: str = "auto") -> None:
    """Where `model` ties its head to the embedding table and `config` has a scheme for
    `lm_head`, serves the head from a round-to-nearest copy of the table in that scheme (as
    llama.cpp's tied Q8_0 heads); calibrated quantizers (GPTQ) call this for tied heads too.

    Raises:
        ValueError: The table does not fit the scheme (e.g. D not a multiple of the group).
    """
    scheme = config.scheme_for("lm_head")
    if model.lm_head is not None or scheme is None:
        return
    table = model.embed.weight[...]  # [V, D]
    try:
        weight = quantize_matrix(table.T, scheme)  # [D, V]
    except ValueError as error:
        raise ValueError(f"lm_head (tied to the embedding table): {error}") from None
    attach_tied_head(model, weight, implementation)


# Logits per row a tied head recomputes exactly after its int8-activation product (on
# SmolLM2-135M the float argmax was always among the int8 product's top 3).
TIED_HEAD_EXACT_TOP = 8


def attach_tied_head(model: Transformer, weight: QuantizedWeight,
                     implementation: str = "auto") -> None:
    """Serves a tied model's LM head from `weight`, a quantized `[D, V]` copy of its table
    (the token lookup keeps the float table).

    The head takes int8 activations where the other layers do (the CPU kernel's decode
    rows), with each row's `TIED_HEAD_EXACT_TOP` largest logits recomputed from float32
    activations: int8 ones alone moved SmolLM2's greedy answer to "What is the capital of
    France?" off "Paris", and the float path over the whole head was 16% of a GGUF decode
    step.
    """
    vocab_size = model.config.vocab_size
    model.lm_head = nnx.data(QuantizedLinear(  # declared None (static) when tied
        weight, (vocab_size,), logical_axes=("embed", "vocab"),
        implementation=implementation, exact_top=TIED_HEAD_EXACT_TOP))


def _round_to_nearest(site: LinearSite, scheme: WeightScheme) -> QuantizedWeight:
    return quantize_matrix(site.float_matrix(), scheme)


def dequantize_model(model: Transformer) -> Transformer:
    """A float copy of a quantized model: every `QuantizedLinear` back to its dequantized
    parameter, in the model's parameter dtype (the reference the layers are tested against)."""
    model = copy_model(model)
    dtype = jnp.dtype(model.config.param_dtype)
    for site in linear_sites(model):
        if site.is_quantized:
            layer = site.layer
            k = layer.weight.shape[0]
            matrix = layer.dequantized()  # [I, O]
            input_shape = _input_shape(model, site, k)
            # [*input_shape, *output_shape]: the float parameter's own shape
            value = matrix.reshape(*input_shape, *layer.output_shape).astype(dtype)
            setattr(site.owner, site.name, LinearParam(value, input_axes=site.input_axes))
    return model


def _input_shape(model: Transformer, site: LinearSite, k: int) -> tuple[int, ...]:
    if site.input_axes == 2:  # o_proj: [N, H, D]
        return (model.config.num_heads, model.config.head_dim)
    return (k,)


def linear_weight_bytes(model: Transformer, pattern: str = r".") -> tuple[int, int]:
    r"""`(stored bytes, bf16 bytes)` of the linear weights whose path matches `pattern`.

    Stored bytes count quantized layers with their scales and zero points and float
    parameters at their dtype; the bf16 figure is the same weights at 2 bytes each.
    `pattern=r"^layers\."` counts the blocks' projections only (not the LM head).
    """
    stored = bf16 = 0
    for site in linear_sites(model):
        if not re.search(pattern, site.path):
            continue
        layer = site.layer
        if isinstance(layer, QuantizedLinear):
            stored += layer.nbytes()
            k = layer.weight.shape[0]
            bf16 += 2 * k * math.prod(layer.output_shape)
        else:
            value = layer[...]  # [*inputs, *outputs]
            stored += value.size * value.dtype.itemsize
            bf16 += 2 * value.size
    return stored, bf16
