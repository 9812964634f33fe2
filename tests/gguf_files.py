"""Tiny GGUF files written inside the tests with gguf-py's `GGUFWriter` (nothing downloaded).

`write_tiny_llama(path, tensor_type)` writes a random two-block llama model whose projections
(and embedding table and LM head) are stored in `tensor_type`, as llama.cpp's converter lays
them out: Hugging Face `[out, in]` matrices with the query and key rows permuted per head.
Types gguf-py can quantize (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from
random float weights; for the K-quants, which gguf-py only dequantizes, the blocks are random
bytes whose fp16 scale fields are set to small finite values, which makes them valid blocks.
The widths are multiples of 256 so that K-quant rows hold whole super-blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

TensorType = gguf.GGMLQuantizationType

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320
HEAD_DIM = HIDDEN // HEADS

# Byte offsets of the fp16 scale fields in each K-quant block (ggml-common.h), and a scale
# that keeps the random weights small.
K_QUANT_SCALE_FIELDS = {
    TensorType.Q2_K: (80, 82),
    TensorType.Q3_K: (108,),
    TensorType.Q4_K: (0, 2),
    TensorType.Q5_K: (0, 2),
    TensorType.Q6_K: (208,),
}
K_QUANT_SCALE = 2e-4


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a llama query/key matrix's rows (`convert_hf_to_gguf.py`)."""
    per_head = weight.shape[0] // heads
    return (weight.reshape(heads, 2, per_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def random_k_quant_blocks(rng: np.random.Generator, rows: int, columns: int,
                          tensor_type: TensorType) -> np.ndarray:
    """`[rows, bytes]` valid random blocks of a K-quant type for a `[rows, columns]` matrix."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, (rows, columns // block_size, type_size), dtype=np.uint8)
    for offset in K_QUANT_SCALE_FIELDS[tensor_type]:
        scale = rng.uniform(0.5, 1.5, (rows, columns // block_size)) * K_QUANT_SCALE
        blocks[..., offset:offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def encode_tensor(rng: np.random.Generator, weight: np.ndarray,
                  tensor_type: TensorType) -> np.ndarray:
    """The bytes (or floats) GGUF stores for `weight` in `tensor_type`."""
    if tensor_type == TensorType.F32:
        return weight.astype(np.float32)
    if tensor_type in K_QUANT_SCALE_FIELDS:
        return random_k_quant_blocks(rng, *weight.shape, tensor_type)
    return gguf.quants.quantize(weight.astype(np.float32), tensor_type)


def write_tiny_llama(path: str | Path, tensor_type: TensorType, *, tied: bool = False,
                     seed: int = 0, name: str = "tiny llama",
                     metadata: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """Writes a random tiny llama GGUF whose matrices are in `tensor_type`; norms are F32.

    Args:
        path: The file to write.
        tensor_type: The type of every projection, the embedding table and the LM head.
        tied: Leave out `output.weight` (the LM head is the embedding table).
        seed: Seeds the weights.
        name: `general.name`.
        metadata: Adds more metadata (a tokenizer) to the writer.

    Returns:
        The path.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if metadata is not None:
        metadata(writer)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, (rows, columns)).astype(np.float32)

    def vector(size: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.1, size)).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"token_embd.weight": matrix(VOCAB, HIDDEN)}
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        tensors[f"{block}.attn_norm.weight"] = vector(HIDDEN)
        tensors[f"{block}.attn_q.weight"] = llama_cpp_permute(matrix(HEADS * HEAD_DIM, HIDDEN),
                                                              HEADS)
        tensors[f"{block}.attn_k.weight"] = llama_cpp_permute(
            matrix(KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS)
        tensors[f"{block}.attn_v.weight"] = matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[f"{block}.attn_output.weight"] = matrix(HIDDEN, HEADS * HEAD_DIM)
        tensors[f"{block}.ffn_norm.weight"] = vector(HIDDEN)
        tensors[f"{block}.ffn_gate.weight"] = matrix(INTERMEDIATE, HIDDEN)
        tensors[f"{block}.ffn_up.weight"] = matrix(INTERMEDIATE, HIDDEN)
        tensors[f"{block}.ffn_down.weight"] = matrix(HIDDEN, INTERMEDIATE)
    tensors["output_norm.weight"] = vector(HIDDEN)
    if not tied:
        tensors["output.weight"] = matrix(VOCAB, HIDDEN)
    for tensor_name, weight in tensors.items():
        if weight.ndim == 1:
            writer.add_tensor(tensor_name, weight)
            continue
        encoded = encode_tensor(rng, weight, tensor_type)
        raw_dtype = None if tensor_type == TensorType.F32 else tensor_type
        writer.add_tensor(tensor_name, encoded, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
