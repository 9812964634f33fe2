"""GGUF files (llama.cpp's single-file format) <-> jaxinfer model configs and tensors.

A GGUF file holds its hyper-parameters and tokenizer as metadata (`llama.block_count`,
`tokenizer.ggml.tokens`, ...) and its tensors under llama.cpp's names (`blk.0.attn_q.weight`),
each in one of the ggml tensor types: floats (F32, F16, BF16) or blocks of quantized values
(Q8_0, Q4_0, ..., the K-quants). It is read here through the maintained `gguf` package
(gguf-py) on a memory map, so opening a file reads only its header.

What this module gives its callers:

* `read_gguf_config(path)`: the `ModelConfig` from the metadata. Architectures: `llama`
  (Llama 2/3; Mistral files, which llama.cpp writes as llama, become "mistral" when the
  model's name says so; a llama file with experts is Mixtral) and `qwen2` (q/k/v biases).
  The LM head is tied when the file has no `output.weight`.
* `gguf_tensor_mappings(config, file)`: for every parameter of the model, the GGUF tensors
  it is made of. The mapping reuses `checkpoints.hf_mapping`'s layout transforms: once
  llama.cpp's reordering of the query and key rows of llama models is undone (its converter
  interleaves the two rotary halves of each head; `GGUFTensor.rows` reverses that, as
  transformers' GGUF loader does), a GGUF matrix is the Hugging Face `[out, in]` matrix,
  quantized in blocks along `in`.
* `open_gguf(path)`: the `GGUFFile`, parsed once per `shared_gguf_files()` block (config,
  tokenizer and weights of one load share it); metadata arrays are read by
  `FastArrayReader`, gguf-py's reader with a one-pass walk of string and number arrays.
* `load_gguf_checkpoint(path)`: a float model, every tensor dequantized with
  `gguf.quants.dequantize` to the config's parameter dtype (any tensor type gguf-py reads).
  `jaxinfer.quant.gguf.load_gguf_model` instead keeps Q8_0 / Q4_0 / Q4_1 projections
  quantized; it builds on the same mapping.

May import `jaxinfer.config` and `jaxinfer.models` only (see ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import struct
import sys
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from checkpoints.hf_mapping import TensorMapping, tensor_mappings
from jaxinfer.config import ConfigError, ModelConfig, RopeScaling
from jaxinfer.models import Transformer, abstract_model, model_shardings
from jaxinfer.models.layers import dtype_of
from jaxinfer.models.rope import inverse_frequencies

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
TensorType = gguf.GGMLQuantizationType


class GGUFFormatError(ValueError):
    """A GGUF file lacks something the model needs, or holds something we cannot load."""


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a file starting with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, undecoded.

    Attributes:
        name: The llama.cpp name, e.g. `blk.0.attn_q.weight`.
        tensor_type: Its ggml type (F32, Q8_0, Q4_K, ...).
        shape: The logical shape in numpy order, e.g. `(O, I)` for a matrix (ggml lists its
            dimensions the other way round).
        data: The memory-mapped contents: `[..., rows, bytes]` uint8 blocks for quantized
            types (each row quantized along its own elements), the values for float types.
        heads: For llama's query and key matrices, the head count whose row order llama.cpp
            permuted (None: rows as stored).
    """

    name: str
    tensor_type: TensorType
    shape: tuple[int, ...]
    data: np.ndarray
    heads: int | None = None

    @property
    def block_size(self) -> int:
        """Elements per quantization block along a row (1 for float types)."""
        return gguf.GGML_QUANT_SIZES[self.tensor_type][0]

    def rows(self) -> np.ndarray:
        """`data` with the rows in the Hugging Face order (llama.cpp's q/k permutation undone).

        Whole rows move, so this works on quantized blocks as on floats: `[O, bytes]` or
        `[O, I]`.
        """
        if self.heads is None:
            return self.data
        data = self.data  # [O, ...] rows in llama.cpp's order
        # Within a head, HF orders rows (half, pair) (rotate-half RoPE) and llama.cpp
        # (pair, half) (interleaved RoPE).
        per_head = data.shape[0] // self.heads
        grouped = data.reshape(self.heads, per_head // 2, 2, *data.shape[1:])
        return grouped.swapaxes(1, 2).reshape(data.shape)  # [O, ...] HF order

    def dequantize(self) -> np.ndarray:
        """The float32 tensor in HF row order, `shape`."""
        values = gguf.quants.dequantize(np.asarray(self.rows()), self.tensor_type)
        return values.astype(np.float32, copy=False).reshape(self.shape)


_ARRAY, _STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING


class FastArrayReader(gguf.GGUFReader):
    """gguf-py's `GGUFReader`, with metadata arrays (vocabulary, merges, token types) read in
    one pass.

    gguf-py builds every element of an array through `_get_field_parts`: a recursion and one
    or two memmap slices per element, so SmolLM2's 49,152 tokens, 48,900 merges and 49,152
    token types took 4.4 of the 4.6 s of its tokenizer load under cProfile (2.7 s without),
    most of it in numpy.memmap's per-slice bookkeeping. gguf-py (0.17 to 0.19) has no
    faster API, so this overrides that one hook for arrays of strings and of numbers: the
    rest of the header and the tensors stay gguf-py's. A string array cannot be split by
    one numpy operation (each element's offset follows from the previous length), so its
    uint64 length prefixes are walked with `struct` (about half a microsecond each); number
    arrays are viewed at once. Elements are sliced from a plain ndarray over the same
    mapping, and the result is the `parts`, `data` and `types` gguf-py's own walk gives
    (same values, dtypes and byte order; ndarrays rather than memmaps), so
    `ReaderField.contents()` and every other reader works unchanged. Should a gguf-py
    release rename the hook, its own (slow, correct) walk runs instead.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        if raw_type != _ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)  # [1]
        count = self._get(orig_offs + 4, np.uint64)  # [1]
        item_kind = gguf.GGUFValueType(int(item_type[0]))
        scalar = self.gguf_scalar_to_np.get(item_kind)
        if item_kind != _STRING and scalar is None:  # nested arrays: gguf-py's walk
            return super()._get_field_parts(orig_offs, raw_type)
        # A plain ndarray over the mapping: slicing it skips memmap's __array_finalize__.
        buffer = self.data.view(np.ndarray)  # [file bytes] uint8
        size = int(count[0])
        parts: list[np.ndarray] = [item_type, count]
        offset = orig_offs + 12
        if item_kind == _STRING:  # per element: uint64 length, then the UTF-8 bytes
            length_dtype = np.dtype(np.uint64).newbyteorder(self.byte_order)
            swapped = {"little": ">", "big": "<"}[sys.byteorder]
            unpack_length = struct.Struct(("=" if self.byte_order == "I" else swapped) + "Q")
            for _ in range(size):
                (length,) = unpack_length.unpack_from(buffer, offset)
                parts.append(buffer[offset:offset + 8].view(length_dtype))  # [1] length
                parts.append(buffer[offset + 8:offset + 8 + length])  # [length] bytes
                offset += 8 + length
            data = list(range(3, len(parts), 2))
        else:
            dtype = np.dtype(scalar).newbyteorder(self.byte_order)
            values = buffer[offset:offset + size * dtype.itemsize].view(dtype)  # [size]
            parts.extend(values[index:index + 1] for index in range(size))  # each [1]
            offset += size * dtype.itemsize
            data = list(range(2, len(parts)))
        types = [gguf.GGUFValueType.ARRAY]
        if size:  # as gguf-py: an empty array records no element type
            types.append(item_kind)
        return offset - orig_offs, parts, data, types


class GGUFFile:
    """An open GGUF file: metadata by key, tensors by name (memory-mapped, read lazily).

    Args:
        path: The `.gguf` file.

    Raises:
        GGUFFormatError: Not a GGUF file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not is_gguf_file(self.path):
            raise GGUFFormatError(f"{self.path} is not a GGUF file (no GGUF magic bytes)")
        self._reader = FastArrayReader(self.path, "r")

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every metadata value as Python (strings, numbers, lists)."""
        return {key: field.contents() for key, field in self._reader.fields.items()
                if not key.startswith("GGUF.")}

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` when the file has none."""
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        """`general.architecture`, e.g. "llama"."""
        return str(self.get("general.architecture", ""))

    def arch(self, key: str, default: Any = None) -> Any:
        """A hyper-parameter under the architecture's prefix (`llama.block_count`)."""
        return self.get(f"{self.architecture}.{key}", default)

    @cached_property
    def tensors(self) -> dict[str, GGUFTensor]:
        """Every tensor by name, with llama's q/k head permutation recorded."""
        tensors = {}
        for tensor in self._reader.tensors:
            shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))
            tensors[tensor.name] = GGUFTensor(tensor.name, TensorType(tensor.tensor_type),
                                              shape, tensor.data)
        return tensors

    def tensor(self, name: str, *, config: ModelConfig | None = None) -> GGUFTensor:
        """The tensor `name`; with `config`, a llama query/key matrix records its heads.

        Raises:
            GGUFFormatError: No such tensor.
        """
        if name not in self.tensors:
            raise GGUFFormatError(f"{self.path}: no tensor {name!r} in the file")
        tensor = self.tensors[name]
        if config is not None and self.architecture == "llama" and name.endswith(".weight"):
            if ".attn_q." in name:
                tensor = dataclasses.replace(tensor, heads=config.num_heads)
            elif ".attn_k." in name:
                tensor = dataclasses.replace(tensor, heads=config.num_kv_heads)
        return tensor


# The files `shared_gguf_files` keeps open, by resolved path; None outside such a block.
_SHARED_FILES: contextvars.ContextVar[dict[Path, GGUFFile] | None] = contextvars.ContextVar(
    "shared_gguf_files", default=None)


@contextlib.contextmanager
def shared_gguf_files() -> Iterator[None]:
    """Within this block `open_gguf` parses each file once and hands out that `GGUFFile`.

    Loading a model by path reads its config, its tokenizer and its weights through separate
    calls (`jaxinfer.LLM` reads the config twice more to size the engine); each used to
    parse the file's header and metadata again. The sharing is scoped to a block, not a
    process-wide cache, so a file rewritten between two loads is never served stale. Nested
    blocks share the outermost block's files.
    """
    if _SHARED_FILES.get() is not None:
        yield
        return
    token = _SHARED_FILES.set({})
    try:
        yield
    finally:
        _SHARED_FILES.reset(token)


def open_gguf(path: str | os.PathLike[str] | GGUFFile) -> GGUFFile:
    """The `GGUFFile` at `path`: the one already open inside a `shared_gguf_files` block,
    else a fresh one (an open `GGUFFile` is returned as is).

    Raises:
        GGUFFormatError: Not a GGUF file.
    """
    if isinstance(path, GGUFFile):
        return path
    shared = _SHARED_FILES.get()
    if shared is None:
        return GGUFFile(path)
    key = Path(path).resolve()
    if key not in shared:
        shared[key] = GGUFFile(path)
    return shared[key]


def _rope_scaling(file: GGUFFile, head_dim: int, rope_theta: float) -> RopeScaling:
    """RoPE scaling: linear from the metadata, or Llama 3's from a `rope_freqs` tensor."""
    scaling_type = file.arch("rope.scaling.type")
    if scaling_type in (None, "none"):
        scaling = RopeScaling()
    elif scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(file.arch("rope.scaling.factor")))
    else:
        raise ConfigError(f"config field 'rope.scaling.type' = {scaling_type!r}: only linear "
                          f"RoPE scaling (or Llama 3's rope_freqs) is supported")
    if "rope_freqs.weight" not in file.tensors:
        return scaling
    # llama.cpp writes Llama 3.1's frequency-dependent scaling as one divisor per frequency
    # pair. Our model takes it as parameters: accept the published Llama 3 ones when they
    # give exactly these divisors.
    divisors = file.tensor("rope_freqs.weight").dequantize()  # [H / 2]
    candidate = RopeScaling(rope_type="llama3", factor=float(divisors.max()),
                            original_max_position_embeddings=int(file.arch(
                                "rope.scaling.original_context_length", 8192)))
    probe = ModelConfig(vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                        num_heads=1, num_kv_heads=1, rope_theta=rope_theta,
                        rope_scaling=candidate)
    unscaled = ModelConfig(vocab_size=1, hidden_size=head_dim, intermediate_size=1,
                           num_layers=1, num_heads=1, num_kv_heads=1, rope_theta=rope_theta)
    implied = inverse_frequencies(unscaled) / inverse_frequencies(probe)  # [H / 2]
    if not np.allclose(implied, divisors, rtol=1e-5):
        raise ConfigError(f"{file.path}: its rope_freqs tensor is no Llama 3 RoPE scaling "
                          f"with factor {candidate.factor} (low 1, high 4); unsupported")
    return candidate


def read_gguf_config(path: str | os.PathLike[str] | GGUFFile, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes.

    Args:
        path: The file (or an open `GGUFFile`).
        **overrides: ModelConfig fields to set on top, e.g. `param_dtype="bfloat16"`
            (default float32: every dequantized tensor keeps its exact value).

    Raises:
        ConfigError: An unsupported architecture or hyper-parameter (named).
        GGUFFormatError: Not a GGUF file, or a required key is missing.
    """
    file = open_gguf(path)
    architecture = file.architecture
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"config field 'general.architecture' = {architecture!r}: "
                          f"supported: {SUPPORTED_ARCHITECTURES}")

    def required(key: str) -> Any:
        value = file.arch(key)
        if value is None:
            raise GGUFFormatError(f"{file.path}: metadata {architecture}.{key} is missing")
        return value

    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(file.arch("attention.key_length") or file.arch("rope.dimension_count")
                   or hidden_size // num_heads)
    rope_theta = float(file.arch("rope.freq_base", 10000.0))
    vocab_size = file.arch("vocab_size")
    if vocab_size is None:
        vocab_size = file.tensor("token_embd.weight").shape[0]
    num_experts = int(file.arch("expert_count", 0) or 0)
    model_type = architecture
    if architecture == "llama" and num_experts:
        model_type = "mixtral"
    elif architecture == "llama" and "mistral" in str(file.get("general.name", "")).lower():
        model_type = "mistral"  # as transformers: llama.cpp writes Mistral as llama
    eos = file.get("tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(required("feed_forward_length")),
        num_layers=int(required("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(file.arch("attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(file.arch("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(file, head_dim, rope_theta),
        max_position_embeddings=int(file.arch("context_length", 4096)),
        attention_bias=architecture == "qwen2",
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    if num_experts:
        fields["num_experts"] = num_experts
        fields["num_experts_per_token"] = int(file.arch("expert_used_count", 2))
    fields.update(overrides)
    return ModelConfig(**fields)


# HF name pieces -> llama.cpp's. Expert weights are one stacked tensor per layer in GGUF.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
_EXPERT_NAMES = {"w1": "ffn_gate_exps.weight", "w3": "ffn_up_exps.weight",
                 "w2": "ffn_down_exps.weight"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> tuple[str, int | None]:
    """The GGUF tensor (and expert index, for stacked experts) holding an HF tensor.

    Raises:
        GGUFFormatError: A name with no GGUF counterpart here.
    """
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name], None
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        layer, rest = parts[2], ".".join(parts[3:])
        if rest in _LAYER_NAMES:
            return f"blk.{layer}.{_LAYER_NAMES[rest]}", None
        if parts[3:5] == ["block_sparse_moe", "experts"] and parts[6] in _EXPERT_NAMES:
            return f"blk.{layer}.{_EXPERT_NAMES[parts[6]]}", int(parts[5])
    raise GGUFFormatError(f"no GGUF tensor name for {hf_name!r}")


@dataclasses.dataclass(frozen=True)
class GGUFMapping:
    """One jaxinfer parameter and the GGUF tensors it comes from.

    Attributes:
        mapping: The HF mapping: the parameter's path and the `[out, in]` -> ours transform.
        tensors: Per HF tensor, the GGUF tensor (q/k heads recorded) and the expert index
            within it (None for unstacked tensors).
    """

    mapping: TensorMapping
    tensors: tuple[tuple[GGUFTensor, int | None], ...]

    @property
    def param_path(self) -> tuple[str | int, ...]:
        """The parameter's NNX state path."""
        return self.mapping.param_path

    def float_value(self) -> np.ndarray:
        """The parameter in our layout, float32, dequantized from the file."""
        arrays = []
        for tensor, expert in self.tensors:
            value = tensor.dequantize()  # HF shape; [E, out, in] for stacked experts
            arrays.append(value if expert is None else value[expert])
        return self.mapping.to_param(arrays)


def gguf_tensor_mappings(config: ModelConfig, file: GGUFFile) -> list[GGUFMapping]:
    """Every parameter of a `config` model with its GGUF tensors, shapes checked.

    Raises:
        GGUFFormatError: A tensor is missing or has the wrong shape (both named).
    """
    mappings = []
    for mapping in tensor_mappings(config):
        tensors = []
        for hf_name, hf_shape in zip(mapping.hf_names, mapping.hf_shapes):
            name, expert = gguf_name(hf_name)
            tensor = file.tensor(name, config=config)
            shape = tensor.shape if expert is None else tensor.shape[1:]
            if shape != tuple(hf_shape):
                raise GGUFFormatError(f"{file.path}: tensor {name!r} has shape {shape}; the "
                                      f"config implies {tuple(hf_shape)}")
            tensors.append((tensor, expert))
        mappings.append(GGUFMapping(mapping, tuple(tensors)))
    return mappings


def load_gguf_checkpoint(
    path: str | os.PathLike[str],
    *,
    mesh: Mesh | None = None,
    layout: str | tuple = "tensor_parallel",
    **config_overrides: Any,
) -> Transformer:
    """Loads a GGUF file as a float model: every tensor dequantized to `param_dtype`.

    Tensors are dequantized one at a time and put straight onto their devices (sharded on
    `mesh` under `layout`), so host memory peaks near one float tensor.

    Args:
        path: The `.gguf` file.
        mesh: Place parameters on this mesh; None: the default device.
        layout: Sharding layout name or rules table.
        **config_overrides: ModelConfig fields, e.g. `param_dtype="bfloat16"`.

    Raises:
        ConfigError, GGUFFormatError: As `read_gguf_config` and `gguf_tensor_mappings`.
    """
    file = open_gguf(path)
    config = read_gguf_config(file, **config_overrides)
    graphdef, abstract_state = nnx.split(abstract_model(config))
    variables = dict(nnx.to_flat_state(abstract_state))
    shardings = (dict(nnx.to_flat_state(model_shardings(config, mesh, layout)))
                 if mesh is not None else {})
    param_dtype = dtype_of(config.param_dtype)
    loaded = {}
    for mapping in gguf_tensor_mappings(config, file):
        host = np.ascontiguousarray(mapping.float_value().astype(param_dtype))
        target = shardings[mapping.param_path].get_value() if shardings else None
        loaded[mapping.param_path] = jax.device_put(host, target)
        del host
    state = nnx.from_flat_state(
        [(path, variable.replace(loaded[path])) for path, variable in variables.items()])
    return nnx.merge(graphdef, state)
