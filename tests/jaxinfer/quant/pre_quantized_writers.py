"""Tiny pre-quantized Llama checkpoints written by the tests, and a slow reader of them.

The writers quantize a float HF checkpoint's projections and pack them as each format's
reference code does (AutoGPTQ / GPTQModel, AutoAWQ's GEMM `WQLinear`, compressed-tensors'
compressors), with NumPy, so no GPU-only kernel is needed. The reader is deliberately
separate from `jaxinfer.quant.pre_quantized` and element by element: it decodes each
stored level, zero point and scale with the format's documented rule and writes the float
checkpoint the quantized one stands for, which our float loader then loads as the
reference. Nothing here imports the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np

from checkpoints.safetensors_io import SafetensorsFile, write_safetensors

PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclasses.dataclass(frozen=True)
class Case:
    """One checkpoint flavour: its `quantization_config` and how the writer packs it."""

    name: str
    method: str  # "gptq", "awq", "compressed-tensors"
    config: dict
    ignore: tuple[str, ...] = ()  # HF modules left float
    tensor_parallel: bool = True  # shapes that split over 2 shards


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    handle = SafetensorsFile(directory / "model.safetensors")
    tensors = {name: handle.read(name).copy() for name in handle.keys()}
    handle.close()
    return tensors


def _write(directory: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _pack_along(levels: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned `levels` packed 32 // bits per int32 word along `axis`; field j of a word
    (bits j*bits...) holds element `order[j]` of its run (default j)."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    moved = np.moveaxis(levels.astype(np.uint32), axis, -1)  # [..., R]
    words = np.zeros(moved.shape[:-1] + (moved.shape[-1] // per_word,), np.uint32)
    for field, element in enumerate(order):
        words |= moved[..., element::per_word] << np.uint32(bits * field)
    return np.moveaxis(words, -1, axis).view(np.int32)


def _gptq_module(weight: np.ndarray, config: dict, rng: np.random.Generator
                 ) -> dict[str, np.ndarray]:
    """AutoGPTQ's quantizer and packing of one `[O, I]` weight."""
    w = weight.T.astype(np.float64)  # [I, O]
    k, n = w.shape
    group_size = k if config["group_size"] == -1 else config["group_size"]
    # Act-order processes rows in a permuted order (by the Hessian; here random) and
    # groups follow that order.
    order = rng.permutation(k) if config["desc_act"] else np.arange(k)
    g_idx = np.empty(k, np.int32)
    g_idx[order] = np.arange(k) // group_size
    groups = k // group_size
    scales = np.zeros((groups, n), np.float16)
    zeros = np.zeros((groups, n), np.int64)
    levels = np.zeros((k, n), np.int64)
    for group in range(groups):
        rows = g_idx == group
        block = w[rows]
        if config["sym"]:
            scale, zero = 2 * np.abs(block).max(0) / 15, np.full(n, 8)
        else:
            low, high = np.minimum(block.min(0), 0), np.maximum(block.max(0), 0)
            scale = (high - low) / 15
            zero = np.round(-low / scale)
        scales[group] = scale.astype(np.float16)
        zeros[group] = zero
        levels[rows] = np.clip(np.round(block / scales[group]) + zero, 0, 15)
    if config["checkpoint_format"] == "gptq":
        stored = np.maximum(zeros - 1, 0)  # the original format's zero - 1
        if not config["sym"]:
            stored[0, :3] = 15  # a stored 15 reads as zero 16: the edge of the rule
    else:
        stored = zeros
    return {"qweight": _pack_along(levels, 4, 0), "qzeros": _pack_along(stored, 4, 1),
            "scales": scales, "g_idx": g_idx}


def _awq_module(weight: np.ndarray, config: dict, rng: np.random.Generator
                ) -> dict[str, np.ndarray]:
    """AutoAWQ's zero-point quantizer and `WQLinear_GEMM` packing of one `[O, I]` weight."""
    del rng
    w = weight.T.astype(np.float64)  # [I, O]
    k, n = w.shape
    group_size = config["group_size"]
    blocks = w.reshape(k // group_size, group_size, n)  # [C, group_size, O]
    low, high = blocks.min(1), blocks.max(1)  # [C, O]
    scales = np.maximum((high - low) / 15, 1e-5).astype(np.float16)  # [C, O]
    zeros = np.clip(np.round(-low / scales), 0, 15)  # [C, O]
    levels = np.clip(np.round(blocks / scales[:, None]) + zeros[:, None], 0, 15)
    return {"qweight": _pack_along(levels.reshape(k, n), 4, 1, AWQ_ORDER),
            "qzeros": _pack_along(zeros, 4, 1, AWQ_ORDER), "scales": scales}


def _compressed_tensors_module(weight: np.ndarray, config: dict, rng: np.random.Generator
                               ) -> dict[str, np.ndarray]:
    """compressed-tensors' symmetric per-channel int8 quantization of one `[O, I]` weight
    and its compressor's tensors."""
    del rng
    scale = (np.abs(weight).max(1, keepdims=True) / 127).astype(np.float32)  # [O, 1]
    levels = np.clip(np.round(weight / scale), -128, 127).astype(np.int8)  # [O, I]
    if config["format"] != "pack-quantized":
        return {"weight": levels, "weight_scale": scale.astype(np.float16)}
    # pack_to_int32: level + 128 as unsigned bytes, four per word along I, low byte first.
    return {"weight_packed": _pack_along((levels.astype(np.int16) + 128), 8, 1),
            "weight_shape": np.array(weight.shape, np.int64), "weight_scale": scale}


WRITERS = {"gptq": _gptq_module, "awq": _awq_module,
           "compressed-tensors": _compressed_tensors_module}


def write_quantized(base: Path, directory: Path, case: Case, seed: int = 0) -> Path:
    """`base` (a float HF checkpoint) with every block projection not in `case.ignore`
    quantized and packed as `case` says."""
    tensors = read_tensors(base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = case.config
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if PROJECTION.match(module) and module not in case.ignore:
            for field, array in WRITERS[case.method](tensor, case.config, rng).items():
                out[f"{module}.{field}"] = array
        else:
            out[name] = tensor
    return _write(directory, config, out)


# --- the slow reader -------------------------------------------------------------------------


def _field(word: np.ndarray, bits: int, index: int) -> np.ndarray:
    """Unsigned field `index` (bits index*bits...) of int32 words."""
    return (word.astype(np.int64) & 0xFFFFFFFF) >> (bits * index) & ((1 << bits) - 1)


def _read_gptq(tensors: dict, module: str, config: dict) -> np.ndarray:
    qweight, qzeros = tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"]
    scales, g_idx = tensors[f"{module}.scales"], tensors[f"{module}.g_idx"]
    offset = 1 if config.get("checkpoint_format", "gptq") == "gptq" else 0
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    weight = np.zeros((n, k), np.float32)
    for row in range(k):
        group = g_idx[row]
        level = _field(qweight[row // 8], 4, row % 8)  # [O]
        for column in range(n):
            zero = _field(qzeros[group, column // 8], 4, column % 8) + offset
            weight[column, row] = (level[column] - zero) * np.float32(scales[group, column])
    return weight


def _read_awq(tensors: dict, module: str, config: dict) -> np.ndarray:
    qweight, qzeros = tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"]
    scales = tensors[f"{module}.scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    weight = np.zeros((n, k), np.float32)
    for column in range(n):
        field = AWQ_ORDER.index(column % 8)
        level = _field(qweight[:, column // 8], 4, field)  # [I]
        for row in range(k):
            group = row // config["group_size"]
            zero = _field(qzeros[group, column // 8], 4, field)
            weight[column, row] = (level[row] - zero) * np.float32(scales[group, column])
    return weight


def _read_compressed_tensors(tensors: dict, module: str, config: dict) -> np.ndarray:
    scale = tensors[f"{module}.weight_scale"].astype(np.float32)  # [O, 1]
    if config["format"] != "pack-quantized":
        return tensors[f"{module}.weight"].astype(np.float32) * scale
    packed = tensors[f"{module}.weight_packed"]
    n, k = (int(size) for size in tensors[f"{module}.weight_shape"])
    weight = np.zeros((n, k), np.float32)
    for row in range(k):
        weight[:, row] = _field(packed[:, row // 4], 8, row % 4) - 128
    return weight * scale


READERS = {"gptq": _read_gptq, "awq": _read_awq, "compressed-tensors": _read_compressed_tensors}


def dequantized_weights(directory: Path, case: Case) -> dict[str, np.ndarray]:
    """HF module -> its float `[O, I]` weight, decoded from the quantized checkpoint."""
    tensors = read_tensors(directory)
    modules = sorted({name.rsplit(".", 1)[0] for name in tensors
                      if name.endswith((".qweight", ".weight_scale"))})
    return {module: READERS[case.method](tensors, module, case.config) for module in modules}


def write_dequantized(directory: Path, reference: Path, case: Case) -> Path:
    """The float checkpoint a quantized one stands for: its quantized modules replaced by
    their dequantized float32 weights, its config without `quantization_config`."""
    weights = dequantized_weights(directory, case)
    tensors = {name: tensor for name, tensor in read_tensors(directory).items()
               if name.rsplit(".", 1)[0] not in weights}
    tensors.update({f"{module}.weight": weight for module, weight in weights.items()})
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    if reference.exists():
        shutil.rmtree(reference)
    return _write(reference, config, tensors)
