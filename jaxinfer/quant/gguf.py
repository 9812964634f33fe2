"""GGUF models served with their Q8_0, Q4_0 and Q4_1 projections still quantized.

`checkpoints.gguf_io` reads a GGUF file (config, tensors, names). Here its quantized blocks
become `QuantizedLinear` layers of the weight-format registry, value for value, with no
float round trip:

    GGUF type  block of 32 weights         registry format    stored per 32 weights
    Q8_0       d (f16), q int8             "int8_grouped"     32 int8 + one f32 scale
               w = d * q                   value q, scale d
    Q4_0       d (f16), q in [0, 15]       "int4", symmetric  16 bytes + one f32 scale
               w = d * (q - 8)             value q - 8 (the signed nibble), scale d
    Q4_1       d, m (f16), q in [0, 15]    "int4", float      16 bytes + f32 scale and zero
               w = d * q + m               zeros: value q - 8, scale d, zero -8 - m / d

Q8_0 and Q4_0 dequantize to exactly GGUF's values (an fp16 scale times a small integer is
exact in float32). Q4_1's `(value - zero) * scale` differs from GGUF's `d * q + m` only by the
float32 rounding of `m / d` (a few ulps of the weight; a block with d = 0, all weights m, is
stored exactly as value -8, zero -9, scale m). Every other tensor type (F16, BF16, Q5_0,
Q5_1, the K-quants) and every tensor that is not a projection (norms, biases, the embedding
table, which is a gather) is dequantized to the model's parameter dtype by gguf-py. MoE
expert stacks stay float, as in quantized checkpoints.

A tied LM head whose table is of a served type (SmolLM2's Q8_0 `token_embd`) is served as
the file has it: the model gets an `lm_head` `QuantizedLinear` of the table (`[D, V]`, the
lookup keeps the float table), as llama.cpp multiplies by the quantized table. The head is
the largest matrix of a small model's decode step (28M of SmolLM2's 135M weights): in
float32 it read 113 MB per token, as Q8_0 it reads 30 MB.

The layers carry the float parameters' logical axes, so `load_gguf_model(path, mesh=...)`
splits them over tensor parallelism as `restore_quantized_model` does for our checkpoints.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from checkpoints.gguf_io import (
    GGUFMapping,
    GGUFTensor,
    TensorType,
    gguf_tensor_mappings,
    open_gguf,
    read_gguf_config,
)
from jaxinfer.config import ModelConfig
from jaxinfer.models import Transformer
from jaxinfer.models.layers import dtype_of
from jaxinfer.quant.checkpoint import ModelFiller
from jaxinfer.quant.linear import attach_tied_head, linear_sites
from pallas_kernels.quant_matmul import QuantizedWeight

# GGUF block types served as registry formats (the rest are dequantized).
SERVED_TYPES = {TensorType.Q8_0: "int8_grouped", TensorType.Q4_0: "int4",
                TensorType.Q4_1: "int4"}
BLOCK_SIZE = 32  # weights per block, along the input features, for all three
_INT4_OFFSET = 8  # GGUF's unsigned nibble q is our signed nibble q - 8
_EMBEDDING_PATH = "embed.weight"  # the token embedding table's parameter path


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """`[O, C, 16]` bytes of 32 nibbles (element j low, j + 16 high) -> `[O, C, 32]` q."""
    packed = blocks[..., start:start + BLOCK_SIZE // 2]  # [O, C, 16]
    return np.concatenate([packed & 0xF, packed >> 4], axis=-1)  # [O, C, 32] in [0, 15]


def _float16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte `start` of each block, as float32 `[O, C]`."""
    raw = np.ascontiguousarray(blocks[..., start:start + 2])  # [O, C, 2]
    return raw.view(np.float16)[..., 0].astype(np.float32)  # [O, C]


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Signed int4 `[I, O]` -> `[I // 2, O]` uint8, low nibble the even row (`pack_int4`)."""
    nibbles = (values.astype(np.int16) & 0xF).astype(np.uint8)  # [I, O] two's complement
    return nibbles[0::2] | (nibbles[1::2] << 4)  # [I // 2, O]


def gguf_quantized_weight(tensor: GGUFTensor) -> QuantizedWeight:
    """The registry weight of a Q8_0 / Q4_0 / Q4_1 `[O, I]` GGUF matrix, as `[I, O]`.

    Arrays are numpy, on the host; llama's q/k row permutation is undone first.

    Raises:
        ValueError: Another tensor type, or not a matrix.
    """
    if tensor.tensor_type not in SERVED_TYPES or len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: a {tensor.tensor_type.name} tensor of shape "
                         f"{tensor.shape} is not a Q8_0/Q4_0/Q4_1 matrix")
    o, i = tensor.shape
    blocks = np.asarray(tensor.rows()).reshape(o, i // BLOCK_SIZE, -1)  # [O, C, block bytes]
    scales = _float16_field(blocks, 0)  # [O, C] d
    if tensor.tensor_type == TensorType.Q8_0:
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(o, i)  # [O, I]
        return QuantizedWeight("int8_grouped", np.ascontiguousarray(values.T),
                               np.ascontiguousarray(scales.T), None, BLOCK_SIZE)
    if tensor.tensor_type == TensorType.Q4_0:
        levels = _halves(blocks, 2).astype(np.int8) - _INT4_OFFSET  # [O, C, 32] in [-8, 7]
        packed = _pack_nibbles(levels.reshape(o, i).T)  # [I // 2, O]
        return QuantizedWeight("int4", packed, np.ascontiguousarray(scales.T), None,
                               BLOCK_SIZE)
    minimums = _float16_field(blocks, 2)  # [O, C] m
    levels = _halves(blocks, 4).astype(np.int8) - _INT4_OFFSET  # [O, C, 32] in [-8, 7]
    # (q - 8 - z) * d = d * q + m  <=>  z = -8 - m / d.
    flat = scales == 0  # [O, C] blocks whose weights are all m
    with np.errstate(divide="ignore", invalid="ignore"):
        zeros = np.where(flat, -_INT4_OFFSET - 1.0,
                         -_INT4_OFFSET - minimums / scales).astype(np.float32)  # [O, C]
    levels = np.where(flat[..., None], np.int8(-_INT4_OFFSET), levels)  # [O, C, 32]
    scales = np.where(flat, minimums, scales)  # [O, C]: (-8 - -9) * m = m
    packed = _pack_nibbles(levels.reshape(o, i).T)  # [I // 2, O]
    return QuantizedWeight("int4", packed, np.ascontiguousarray(scales.T),
                           np.ascontiguousarray(zeros.T), BLOCK_SIZE)


def _placeholder_weight(tensor_type: TensorType, i: int, o: int) -> QuantizedWeight:
    """Zeros of the shapes and dtypes `gguf_quantized_weight` gives (to build the structure
    abstractly)."""
    groups = i // BLOCK_SIZE
    scales = jnp.zeros((groups, o), jnp.float32)  # [C, O]
    if tensor_type == TensorType.Q8_0:
        return QuantizedWeight("int8_grouped", jnp.zeros((i, o), jnp.int8), scales, None,
                               BLOCK_SIZE)
    zeros = jnp.zeros((groups, o), jnp.float32) if tensor_type == TensorType.Q4_1 else None
    return QuantizedWeight("int4", jnp.zeros((i // 2, o), jnp.uint8), scales, zeros,
                           BLOCK_SIZE)


def _served_tensor(mapping: GGUFMapping | None) -> GGUFTensor | None:
    """The mapping's single GGUF tensor when it is of a served type, else None."""
    if mapping is None or len(mapping.tensors) != 1:
        return None
    tensor, expert = mapping.tensors[0]
    served = expert is None and tensor.tensor_type in SERVED_TYPES
    return tensor if served and tensor.shape[1] % BLOCK_SIZE == 0 else None


def _tied_head_tensor(config: ModelConfig, by_path: dict[str, GGUFMapping]
                      ) -> GGUFTensor | None:
    """The embedding table's tensor when the model ties its LM head to it and the table is
    of a served type (so the head is served quantized), else None."""
    if not config.tie_word_embeddings:
        return None
    return _served_tensor(by_path.get(_EMBEDDING_PATH))


def _path_name(path: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in path)


def abstract_gguf_model(config: ModelConfig, mappings: list[GGUFMapping], *,
                        implementation: str = "auto") -> Transformer:
    """The model a GGUF file loads into, shapes only: a `QuantizedLinear` at every projection
    whose tensor is Q8_0 / Q4_0 / Q4_1, float parameters elsewhere."""
    by_path = {_path_name(mapping.param_path): mapping for mapping in mappings}

    def build() -> Transformer:
        model = Transformer(config, rngs=nnx.Rngs(0))
        for site in linear_sites(model):
            tensor = _served_tensor(by_path.get(site.path))
            if tensor is not None:
                i, o = site.float_matrix().shape
                site.quantize(_placeholder_weight(tensor.tensor_type, i, o), implementation)
        table = _tied_head_tensor(config, by_path)
        if table is not None:
            head = _placeholder_weight(table.tensor_type, config.hidden_size, config.vocab_size)
            attach_tied_head(model, head, implementation)
        return model

    return nnx.eval_shape(build)


def load_gguf_model(
    path: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    layout: str | tuple = "tensor_parallel",
    implementation: str = "auto",
    **config_overrides: Any,
) -> Transformer:
    """Loads a GGUF file, its Q8_0 / Q4_0 / Q4_1 projections as `QuantizedLinear` layers.

    Each tensor is converted on the host and put straight onto its devices (sharded on
    `mesh` under `layout`) before the next is read.

    Args:
        path: The `.gguf` file.
        mesh: Place the model on this mesh; None: the default device.
        layout: Sharding layout name or rules table.
        implementation: The quantized layers' `pallas_kernels.dispatch` choice.
        **config_overrides: ModelConfig fields, e.g. `param_dtype="bfloat16"` for the
            dequantized tensors (default float32).

    Raises:
        ConfigError, GGUFFormatError: As `checkpoints.gguf_io.read_gguf_config` and
            `gguf_tensor_mappings`.
    """
    file = open_gguf(path)
    config = read_gguf_config(file, **config_overrides)
    mappings = gguf_tensor_mappings(config, file)
    filler = ModelFiller(abstract_gguf_model(config, mappings, implementation=implementation),
                         mesh, layout)
    param_dtype = dtype_of(config.param_dtype)
    table = _tied_head_tensor(config, {_path_name(m.param_path): m for m in mappings})
    for mapping in mappings:
        key = mapping.param_path
        if key in filler:  # a float parameter
            filler.put(key, mapping.float_value().astype(param_dtype))
            if table is None or _path_name(key) != _EMBEDDING_PATH:
                continue
            key = ("lm_head",)  # the tied head, served from the same quantized table
        _put_quantized(filler, key, gguf_quantized_weight(_served_tensor(mapping)))
    return filler.model()


def _put_quantized(filler: ModelFiller, key: tuple[Any, ...], weight: QuantizedWeight) -> None:
    for field in ("values", "scales", "zeros"):
        array = getattr(weight, field)
        if array is not None:
            filler.put((*key, field), array)


def gguf_weight_bytes(model: Transformer) -> int:
    """Bytes of every array of the model (quantized values, scales, zero points, floats)."""
    leaves = jax.tree.leaves(nnx.state(model))
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)
