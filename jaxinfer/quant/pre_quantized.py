"""Pre-quantized Hugging Face checkpoints: GPTQ, AWQ and compressed-tensors weights, repacked
exactly (no requantization) into the weight-format registry's formats.

A checkpoint's `config.json` says how it was quantized in `quantization_config`; its
quantized modules hold integer tensors in place of `weight`. Each is unpacked into integer
levels, scales and zero points and repacked into one of our formats
(`pallas_kernels.quant_matmul.formats`):

    GPTQ int4 (`quant_method: "gptq"`, `bits: 4`)       -> "int4", group-wise
        qweight int32 [I / 8, O]: eight 4-bit levels per word along I, row 8r + k in bits
        4k..4k+3; qzeros int32 [C, O / 8]: eight zero points per word along O, the same
        order; scales fp16 [C, O]; g_idx int32 [I]: each input row's group.
    AWQ int4 (`quant_method: "awq"`, `version: "gemm"`)  -> "int4", group-wise
        qweight int32 [I, O / 8] and qzeros int32 [C, O / 8]: eight levels per word along
        O in AWQ's interleaved order (nibble k holds column 8c + AWQ_ORDER[k]); scales
        fp16 [C, O].
    compressed-tensors int8 (`quant_method: "compressed-tensors"`, `num_bits: 8`)
        W8A16 -> "int8", W8A8 with dynamic per-token int8 activations -> "w8a8"
        weight int8 [O, I] ("int-quantized", "naive-quantized") or weight_packed int32
        [O, I / 4] ("pack-quantized": four levels + 128 per word along I, low byte
        first, with weight_shape [2]); weight_scale [O, 1] (strategy "channel") or [1]
        ("tensor", broadcast to every channel, exact).

Every dequantizes as `(level - zero) * scale`; GPTQ and AWQ store unsigned levels in
[0, 15], which shift by -8 (levels and zero points alike, so the difference is the same)
into our signed nibbles.

Zero points of GPTQ: the original AutoGPTQ format (`checkpoint_format: "gptq"`, the default
and what transformers/optimum write) stores `zero - 1`, and every reader (AutoGPTQ's and
vLLM's kernels, GPTQModel's v1-to-v2 conversion) adds the 1 back, so the zero is the stored
nibble + 1, in [1, 16]; `"gptq_v2"` (GPTQModel) stores the zero itself. A zero of 16 is 8
after the shift: our zero points are int8, so it is held exactly. With `sym: true` the zero
is 8 for every group (levels - 8 in [-8, 7], no zero point kept); a symmetric checkpoint
whose zeros say otherwise is refused.

Act-order (GPTQ `desc_act: true`): GPTQ quantized the input rows in a permuted order and
groups follow that order, so `g_idx` scatters each group over the rows. Our format needs
contiguous groups of `group_size` rows, so the rows are sorted by group (a stable argsort of
`g_idx`, which must give every group exactly `group_size` rows) and the layer keeps the
permutation and gathers its input features the same way (`QuantizedLinear`'s
`input_permutation`): `x[..., perm] @ W[perm] = x @ W` exactly, for one `[I]` gather of
the activations per call. The alternative that needs no gather, a scale per row (group
size 1), would store 8x the weight's bytes in scales; requantizing would not be exact.
With `desc_act: false` a `g_idx` must be the trivial `row // group_size`.

A group size of -1 (one group over all I) is stored as groups of `gcd(I, 128)` rows with the
scale repeated (exact), so an input-split layer still has whole groups on each shard.

Which modules are quantized is read from the tensors (`qweight` / `weight_scale` present);
the rest (the LM head, `modules_to_not_convert`, `ignore`) load as float. MoE expert weights
and other bit widths, versions and activation schemes are refused with a ValueError naming
the config key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

QUANTIZATION_CONFIG = "quantization_config"
# AWQ's GEMM packing: nibble k of a word holds column 8c + AWQ_ORDER[k] of its 8 columns.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Unsigned 4-bit levels [0, 15] minus this are our signed nibbles [-8, 7].
NIBBLE_OFFSET = 8
# Rows per group when a checkpoint has one group over all I (group_size -1), at most.
PER_CHANNEL_GROUP = 128
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")

ReadTensor = Callable[[str], np.ndarray]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreQuantizedScheme:
    """How a checkpoint's quantized modules are stored, and the format they become.

    Attributes:
        method: `quantization_config.quant_method`: "gptq", "awq" or "compressed-tensors".
        format: Our registry format: "int4", "int8" or "w8a8".
        group_size: Input rows per scale group (int4); -1 for one group over all rows;
            None for the per-channel int8 formats.
        symmetric: No zero points (int4: the zero is 8 for every group).
        act_order: GPTQ `desc_act`: every layer carries an input permutation.
        zero_offset: Added to stored zero points (1 for GPTQ's original format).
        packed: compressed-tensors "pack-quantized" (int8 levels in int32 words).
    """

    method: str
    format: str
    group_size: int | None = None
    symmetric: bool = True
    act_order: bool = False
    zero_offset: int = 0
    packed: bool = False

    def quantized_marker(self, prefix: str) -> str:
        """The tensor whose presence says that module `prefix` is quantized."""
        return f"{prefix}.qweight" if self.format == "int4" else f"{prefix}.weight_scale"


@dataclasses.dataclass(frozen=True)
class RepackedWeight:
    """One module's weight in our format, as host arrays (`QuantizedWeight`'s fields plus
    the layer's input permutation)."""

    format: str
    values: np.ndarray  # [I // 2, O] uint8 (int4) or [I, O] int8
    scales: np.ndarray  # [C, O] or [O] float32
    zeros: np.ndarray | None  # [C, O] int8
    input_permutation: np.ndarray | None  # [I] int32
    group_size: int | None
    bits: int


def _fail(key: str, value: Any, reason: str) -> ValueError:
    return ValueError(f"{QUANTIZATION_CONFIG}.{key} = {value!r}: {reason}")


def read_pre_quantized_scheme(hf_config: dict[str, Any]) -> PreQuantizedScheme | None:
    """The scheme of a checkpoint's `config.json` dict, or None when it is not quantized.

    Raises:
        ValueError: A method, bit width, version or option we cannot load exactly; the
            message names the `quantization_config` key.
    """
    config = hf_config.get(QUANTIZATION_CONFIG)
    if config is None:
        return None
    method = config.get("quant_method")
    if method == "gptq":
        return _gptq_scheme(config)
    if method == "awq":
        return _awq_scheme(config)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    raise _fail("quant_method", method, "supported: 'gptq', 'awq', 'compressed-tensors'")


def _group_size(config: dict[str, Any], key: str) -> int:
    group_size = config.get(key, 128)
    if not isinstance(group_size, int) or not (group_size == -1 or
                                               (group_size > 0 and group_size % 2 == 0)):
        raise _fail(key, group_size, "must be -1 or a positive even number")
    return group_size


def _gptq_scheme(config: dict[str, Any]) -> PreQuantizedScheme:
    if config.get("bits") != 4:
        raise _fail("bits", config.get("bits"), "only 4-bit GPTQ is supported")
    if config.get("is_marlin_format"):
        raise _fail("is_marlin_format", True, "Marlin-repacked weights are not supported")
    checkpoint_format = config.get("checkpoint_format") or config.get("format") or "gptq"
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise _fail("checkpoint_format", checkpoint_format, "supported: 'gptq', 'gptq_v2'")
    return PreQuantizedScheme(
        method="gptq", format="int4", group_size=_group_size(config, "group_size"),
        symmetric=bool(config.get("sym", True)), act_order=bool(config.get("desc_act")),
        zero_offset=1 if checkpoint_format == "gptq" else 0)


def _awq_scheme(config: dict[str, Any]) -> PreQuantizedScheme:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise _fail("bits", bits, "only 4-bit AWQ is supported")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail("version", config.get("version"), "only the GEMM packing is supported")
    if not config.get("zero_point", True):
        raise _fail("zero_point", False, "AWQ GEMM checkpoints without zero points are not "
                    "supported")
    key = "group_size" if "group_size" in config else "q_group_size"
    return PreQuantizedScheme(method="awq", format="int4", group_size=_group_size(config, key),
                              symmetric=False)


def _compressed_tensors_scheme(config: dict[str, Any]) -> PreQuantizedScheme:
    compression = config.get("format")
    if compression not in COMPRESSED_TENSORS_FORMATS:
        raise _fail("format", compression, f"supported: {COMPRESSED_TENSORS_FORMATS}")
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail("quantization_status", status, "only compressed checkpoints are supported")
    for key in ("kv_cache_scheme", "sparsity_config"):
        if config.get(key):
            raise _fail(key, config[key], "not supported")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _fail("config_groups", groups, "no quantization scheme given")
    formats = {_compressed_tensors_group(name, group, compression)
               for name, group in groups.items()}
    if len(formats) != 1:
        raise _fail("config_groups", sorted(groups), "groups with different schemes "
                    f"({sorted(formats)}) are not supported")
    return PreQuantizedScheme(method="compressed-tensors", format=formats.pop(),
                              packed=compression == "pack-quantized")


def _compressed_tensors_group(name: str, group: dict[str, Any], compression: str) -> str:
    """Checks one config group; returns "int8" (W8A16) or "w8a8"."""
    where = f"config_groups.{name}"
    if group.get("format") not in (None, compression):
        raise _fail(f"{where}.format", group["format"], f"must be {compression!r} like "
                    "the checkpoint's")
    weights = group.get("weights")
    if not weights:
        raise _fail(f"{where}.weights", weights, "weights are not quantized")
    required = {"num_bits": 8, "type": "int", "symmetric": True}
    for key, wanted in required.items():
        if weights.get(key, wanted) != wanted:
            raise _fail(f"{where}.weights.{key}", weights.get(key),
                        f"only {wanted!r} is supported (int8 symmetric weights)")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise _fail(f"{where}.weights.strategy", weights.get("strategy"),
                    "supported: 'channel', 'tensor' (int8 keeps one scale per channel)")
    if weights.get("dynamic"):
        raise _fail(f"{where}.weights.dynamic", True, "weights must be static")
    if weights.get("actorder"):
        raise _fail(f"{where}.weights.actorder", weights["actorder"], "not supported")
    if group.get("output_activations"):
        raise _fail(f"{where}.output_activations", group["output_activations"],
                    "not supported")
    activations = group.get("input_activations")
    if not activations:
        return "int8"
    for key, wanted in {**required, "strategy": "token", "dynamic": True}.items():
        if activations.get(key) != wanted:
            raise _fail(f"{where}.input_activations.{key}", activations.get(key),
                        f"only {wanted!r} is supported (dynamic per-token symmetric int8; "
                        "static activation scales are not)")
    return "w8a8"


def regrouped_size(group_size: int, input_features: int) -> int:
    """The group size stored for a checkpoint's `group_size` over `input_features` rows."""
    if group_size == -1:
        return math.gcd(input_features, PER_CHANNEL_GROUP)
    return group_size


def repacked_shapes(scheme: PreQuantizedScheme, input_features: int, output_features: int
                    ) -> RepackedWeight:
    """The layout `read_repacked_weight` gives an `[I, O]` module, known from the config
    alone (the abstract model is built from it before any tensor is read): its arrays are
    broadcast views of one zero, with the right shapes and dtypes and no memory."""
    k, n = input_features, output_features
    if scheme.format == "int4":
        group_size = regrouped_size(scheme.group_size, k)
        groups = k // group_size
        return RepackedWeight(
            "int4", _shaped((k // 2, n), np.uint8), _shaped((groups, n), np.float32),
            None if scheme.symmetric else _shaped((groups, n), np.int8),
            _shaped((k,), np.int32) if scheme.act_order else None, group_size, 4)
    return RepackedWeight(scheme.format, _shaped((k, n), np.int8), _shaped((n,), np.float32),
                          None, None, None, 8)


def _shaped(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A broadcast view of one zero with `shape` and `dtype` (no memory of that size)."""
    return np.broadcast_to(np.zeros((), dtype), shape)


def module_tensor_names(scheme: PreQuantizedScheme, prefix: str) -> tuple[str, ...]:
    """The tensors a quantized module `prefix` may hold (all consumed by
    `read_repacked_weight`)."""
    if scheme.method == "gptq":
        return tuple(f"{prefix}.{name}" for name in ("qweight", "qzeros", "scales", "g_idx"))
    if scheme.method == "awq":
        return tuple(f"{prefix}.{name}" for name in ("qweight", "qzeros", "scales"))
    weight = ("weight_packed", "weight_shape") if scheme.packed else ("weight",)
    return tuple(f"{prefix}.{name}" for name in (*weight, "weight_scale",
                                                  "weight_zero_point"))


def read_repacked_weight(scheme: PreQuantizedScheme, read: ReadTensor, has: Callable[[str], bool],
                         prefix: str, input_features: int, output_features: int
                         ) -> RepackedWeight:
    """Reads module `prefix`'s tensors and repacks them into our format.

    Args:
        scheme: The checkpoint's scheme.
        read: Reads a tensor by name.
        has: Whether the checkpoint holds a tensor.
        prefix: The HF module name, e.g. `model.layers.0.self_attn.q_proj`.
        input_features: I of the module (HF's `in_features`).
        output_features: O of the module (HF's `out_features`).

    Raises:
        ValueError: A tensor of the wrong shape, or values the config contradicts
            (zeros of a symmetric checkpoint, groups of the wrong size); the message names
            the tensor.
    """
    expected = repacked_shapes(scheme, input_features, output_features)
    if scheme.method == "gptq":
        repacked = _read_gptq(scheme, read, has, prefix, input_features, output_features)
    elif scheme.method == "awq":
        repacked = _read_awq(scheme, read, prefix, input_features, output_features)
    else:
        repacked = _read_compressed_tensors(scheme, read, has, prefix, input_features,
                                            output_features)
    for field in ("values", "scales", "zeros", "input_permutation"):
        got, wanted = getattr(repacked, field), getattr(expected, field)
        if (got is None) != (wanted is None) or (got is not None and (
                got.shape != wanted.shape or got.dtype != wanted.dtype)):
            raise AssertionError(f"{prefix}: repacked {field} does not match the planned "
                                 "layout")  # the unpacking above is ours: a bug
    return repacked


def _read_checked(read: ReadTensor, name: str, shape: tuple[int, ...],
                  dtypes: tuple[type, ...]) -> np.ndarray:
    tensor = read(name)
    if tensor.shape != shape or tensor.dtype not in tuple(np.dtype(d) for d in dtypes):
        raise ValueError(f"tensor {name!r} is {tensor.dtype} {tensor.shape}; the "
                         f"quantization config implies {shape} of "
                         f"{' or '.join(np.dtype(d).name for d in dtypes)}")
    return tensor


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words to their eight unsigned 4-bit fields (bits 4k..4k+3 is field k), laid
    out along `axis`: `[R / 8, O]` with axis 0 gives `[R, O]`, `[C, O / 8]` with axis 1
    gives `[C, O]`."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)  # [8]
    unsigned = words.view(np.uint32)
    if axis == 0:
        fields = (unsigned[:, None, :] >> shifts[None, :, None]) & 0xF  # [R / 8, 8, O]
        return fields.reshape(-1, words.shape[1]).astype(np.int8)  # [R, O]
    fields = (unsigned[:, :, None] >> shifts[None, None, :]) & 0xF  # [C, O / 8, 8]
    return fields.reshape(words.shape[0], -1).astype(np.int8)  # [C, O]


def _pack_nibbles(levels: np.ndarray) -> np.ndarray:
    """Signed `[I, O]` levels in [-8, 7] to our int4 storage `[I // 2, O]` uint8: row 2i in
    the low nibble, row 2i + 1 in the high one (`pallas_kernels.quant_matmul.reference.
    pack_int4`'s layout, done on the host so nothing lands on a device unsharded)."""
    nibbles = (levels.astype(np.int16) & 0xF).astype(np.uint8)  # [I, O]
    return nibbles[0::2] | (nibbles[1::2] << 4)  # [I // 2, O]


def _int4_weight(scheme: PreQuantizedScheme, prefix: str, levels: np.ndarray,
                 zeros: np.ndarray, scales: np.ndarray, permutation: np.ndarray | None
                 ) -> RepackedWeight:
    """Our int4 weight from unsigned `[I, O]` levels (rows in stored order), `[C, O]`
    zero points (with the offset added) and `[C, O]` float scales."""
    k = levels.shape[0]
    group_size = regrouped_size(scheme.group_size, k)
    repeat = (k // group_size) // scales.shape[0]  # > 1 only for group_size -1
    scales = np.repeat(scales.astype(np.float32), repeat, axis=0)  # [C, O]
    zeros = np.repeat(zeros.astype(np.int16), repeat, axis=0)  # [C, O]
    if scheme.symmetric:
        if np.any(zeros != NIBBLE_OFFSET):
            raise ValueError(f"{prefix}: the config says sym: true but the zero points are "
                             f"not all {NIBBLE_OFFSET} (found {np.unique(zeros)[:8]})")
        signed_zeros = None
    else:
        signed_zeros = (zeros - NIBBLE_OFFSET).astype(np.int8)  # [C, O] in [-8, 8]
    values = _pack_nibbles(levels.astype(np.int16) - NIBBLE_OFFSET)  # [I // 2, O]
    return RepackedWeight("int4", values, scales, signed_zeros, permutation, group_size, 4)


def _read_gptq(scheme: PreQuantizedScheme, read: ReadTensor, has: Callable[[str], bool],
               prefix: str, k: int, n: int) -> RepackedWeight:
    group_size = k if scheme.group_size == -1 else scheme.group_size
    if k % 8 or n % 8 or k % group_size:
        raise ValueError(f"{prefix}: GPTQ packing needs I and O multiples of 8 and I a "
                         f"multiple of group_size {group_size}; got I={k}, O={n}")
    groups = k // group_size
    qweight = _read_checked(read, f"{prefix}.qweight", (k // 8, n), (np.int32,))  # [I / 8, O]
    qzeros = _read_checked(read, f"{prefix}.qzeros", (groups, n // 8),
                           (np.int32,))  # [C, O / 8]
    scales = _read_checked(read, f"{prefix}.scales", (groups, n),
                           (np.float16, np.float32))  # [C, O]
    levels = _nibbles(qweight, axis=0)  # [I, O] in [0, 15]
    zeros = _nibbles(qzeros, axis=1).astype(np.int16) + scheme.zero_offset  # [C, O]
    trivial = np.arange(k, dtype=np.int32) // group_size  # [I]
    name = f"{prefix}.g_idx"
    g_idx = _read_checked(read, name, (k,), (np.int32, np.int64)) if has(name) else trivial
    permutation = None
    if scheme.act_order:
        permutation = np.argsort(g_idx, kind="stable").astype(np.int32)  # [I]
        if not np.array_equal(g_idx[permutation], trivial):
            raise ValueError(f"{name}: with desc_act, every group must hold exactly "
                             f"group_size = {group_size} rows")
        levels = levels[permutation]  # [I, O] rows grouped
    elif not np.array_equal(g_idx, trivial):
        raise ValueError(f"{name} is not row // group_size but the config says desc_act: "
                         "false")
    return _int4_weight(scheme, prefix, levels, zeros, scales, permutation)


def _read_awq(scheme: PreQuantizedScheme, read: ReadTensor, prefix: str, k: int, n: int
              ) -> RepackedWeight:
    group_size = k if scheme.group_size == -1 else scheme.group_size
    if n % 8 or k % group_size:
        raise ValueError(f"{prefix}: AWQ packing needs O a multiple of 8 and I a multiple "
                         f"of group_size {group_size}; got I={k}, O={n}")
    groups = k // group_size
    unorder = np.argsort(AWQ_ORDER)  # column j of a word is nibble unorder[j]

    def columns(words: np.ndarray) -> np.ndarray:  # [R, O / 8] -> [R, O]
        fields = _nibbles(words, axis=1).reshape(words.shape[0], -1, 8)  # [R, O / 8, 8]
        return fields[:, :, unorder].reshape(words.shape[0], -1)  # [R, O]

    levels = columns(_read_checked(read, f"{prefix}.qweight", (k, n // 8),
                                   (np.int32,)))  # [I, O] in [0, 15]
    zeros = columns(_read_checked(read, f"{prefix}.qzeros", (groups, n // 8),
                                  (np.int32,)))  # [C, O] in [0, 15]
    scales = _read_checked(read, f"{prefix}.scales", (groups, n),
                           (np.float16, np.float32))  # [C, O]
    return _int4_weight(scheme, prefix, levels, zeros, scales, None)


def _read_compressed_tensors(scheme: PreQuantizedScheme, read: ReadTensor,
                             has: Callable[[str], bool], prefix: str, k: int, n: int
                             ) -> RepackedWeight:
    if scheme.packed:
        shape = _read_checked(read, f"{prefix}.weight_shape", (2,),
                              (np.int32, np.int64))  # [2]: O, I
        if tuple(int(size) for size in shape) != (n, k):
            raise ValueError(f"tensor {prefix}.weight_shape is {shape.tolist()}, the model "
                             f"implies {[n, k]}")
        words = _read_checked(read, f"{prefix}.weight_packed", (n, -(-k // 4)),
                              (np.int32,))  # [O, I / 4]
        shifts = np.arange(0, 32, 8, dtype=np.uint32)  # [4]
        fields = (words.view(np.uint32)[:, :, None] >> shifts) & 0xFF  # [O, I / 4, 4]
        # The format stores level + 128 (unsigned) and pads I to a multiple of 4.
        weight = (fields.reshape(n, -1)[:, :k].astype(np.int16) - 128).astype(
            np.int8)  # [O, I]
    else:
        weight = _read_checked(read, f"{prefix}.weight", (n, k), (np.int8,))  # [O, I]
    scale = read(f"{prefix}.weight_scale")  # [O, 1] per channel or [1] per tensor
    if scale.size not in (1, n) or scale.squeeze().ndim > 1:
        raise ValueError(f"tensor {prefix}.weight_scale has shape {scale.shape}; per-channel "
                         f"[{n}, 1] or per-tensor [1] expected")
    scales = np.broadcast_to(scale.astype(np.float32).reshape(-1), (n,)).copy()  # [O]
    name = f"{prefix}.weight_zero_point"
    if has(name) and np.any(read(name)):
        raise ValueError(f"tensor {name} is not zero but the weights are symmetric")
    values = np.ascontiguousarray(weight.T)  # [I, O] int8
    return RepackedWeight(scheme.format, values, scales, None, None, None, 8)
