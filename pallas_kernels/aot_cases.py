"""The kernel compile matrix: every Pallas kernel's case table, compiled for each TPU chip.

Each case describes one call of a public op by sizes only and compiles it, through
`pallas_kernels.aot.compile_for`, with the op forced to its Pallas kernel. `MATRIX` is the
whole table, 88 cases (`benchmarks/tpu_kernels.py` compiles it for every chip of
`aot.TOPOLOGIES`), and so does `make tpu-check`, in CI.

Ragged paged attention. The dimensions are KV dtype (bf16, int8; fp8 e4m3 and e5m2 and KIVI
int4 and int2 on the two base batches only), batch (decode-only, mixed
prefill), sliding window, soft-cap, GQA ratio (query heads per KV head: 1, 4, 8), head dim (64,
128, 256), page size (16, 32, 64, 128) and KV heads per chip (8, 2, 1). Their full product
is 1728 programs per chip, too many for CI, and the kernel's code paths do not interact that
way: each dimension changes block shapes or adds a masking/scaling step independently. So the
table covers instead of multiplying: a base case (GQA 4, head dim 128, pages of 16, 8 KV
heads, no window, no cap) in decode and mixed, bf16 and int8; then every other value of every
other dimension, one at a time, on the mixed base (it runs both prefill chunks and decodes),
in both bf16 and int8 (int8 pages take another copy path: four heads per program, a scale row
per page). The sizes: 64 sequences of up to 512 tokens, a pool of 16384 tokens; decode is 64
tokens, mixed 256. KV heads 1 and 2 stand for a
model's few KV heads split over tensor parallelism (Llama-3-8B at TP 8 holds one per chip).

Quantized matmul. Every registered weight format: int8 per channel, W8A8, int4 symmetric and
with zero points at group sizes 16, 32, 64, 96, 128, 256 and I (one group over all 4096 rows:
per-channel int4), int4 with float32 zero points and int8 with group-wise scales at group size
32 (GGUF's Q4_1 and Q8_0), fp8 (e4m3) per channel, compressed 2:4 sparse weights (bf16 values,
int8 per channel, int4 at group sizes 32 and 128), at M = 1 (decode) and M = 256, on a [4096,
14336] weight (Llama's MLP; 4608 rows for the group of 96, which must divide I). The kernel
takes any even group that divides I, in blocks holding whole groups in whole 128-lane tiles or
lying inside one group; the public op refuses, before compiling, the groups that would force
blocks of more than `quant_matmul.kernel.MAX_INT4_BLOCK_K` rows (a CPU test checks that). The
int4 storage also holds 3- and 2-bit grids; the kernel takes no bit width (only the stored
levels differ), so they compile to the same program and are not separate cases.

MoE grouped matmul. bf16 and int8 expert weights, 8 experts (Mixtral-8x7B's widths: D 4096,
F 14336), the gate/up shape `[rows, D] x [E, D, F]` and the down shape `[rows, F] x
[E, F, D]`, at 2 rows (one token, top-2) and 512 rows (256 tokens, top-2).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from pallas_kernels.aot import AotResult, compile_for

# ---- ragged paged attention -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """A ragged paged attention step, described by sizes only."""

    kernel: ClassVar[str] = "ragged_paged_attention"

    name: str
    num_tokens: int  # T, packed query tokens
    max_seqs: int  # Q
    num_kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    page_size: int = 16
    tokens_per_seq: int = 512  # pages_per_seq * page_size: the longest context
    pool_tokens: int = 16384  # P * Z: the page pool's capacity in tokens
    int8_kv: bool = False
    # "float8_e4m3fn" / "float8_e5m2": fp8 pages with the int8 pool's scales (same copy path).
    fp8_kv: str | None = None
    # 4 or 2: a KIVI pool (packed codes, its KiviPool and residual seats; `kivi_kernel.py`).
    kivi_bits: int | None = None
    # False: Mosaic cannot lower the kernel yet (KIVI's: "unsupported shape cast" on v4,
    # "Invalid vector type for load" on v5e-v6e); the op's "auto" then takes the XLA path on
    # TPU, and the AOT test checks both that the kernel still fails and that path compiles.
    mosaic_lowers: bool = True
    sliding_window: int | None = None
    soft_cap: float | None = None

    @property
    def pages_per_seq(self) -> int:
        return self.tokens_per_seq // self.page_size

    @property
    def num_pages(self) -> int:
        return self.pool_tokens // self.page_size

    @property
    def pages_bytes(self) -> int:
        """Bytes of the `[P, Z, 2K, H]` page pool."""
        if self.kivi_bits is not None:
            return (self.num_pages * self.page_size * 2 * self.num_kv_heads * self.head_dim
                    * self.kivi_bits // 8)
        return (self.num_pages * self.page_size * 2 * self.num_kv_heads * self.head_dim
                * (1 if self.scaled_kv else 2))

    @property
    def scaled_kv(self) -> bool:
        """Whether the pages are 8-bit with a float32 scale per token and head."""
        return self.int8_kv or self.fp8_kv is not None

    def arguments(self) -> list[jax.ShapeDtypeStruct]:
        """The public op's array arguments (kv_scales last, when int8 or fp8)."""
        import jax.numpy as jnp

        pages_dtype = jnp.int8 if self.int8_kv else jnp.bfloat16
        if self.fp8_kv is not None:
            pages_dtype = jnp.dtype(self.fp8_kv)
        arguments = [
            jax.ShapeDtypeStruct((self.num_tokens, self.num_kv_heads * self.group,
                                  self.head_dim), jnp.bfloat16),  # [T, N, H]
            jax.ShapeDtypeStruct((self.num_pages, self.page_size, 2 * self.num_kv_heads,
                                  self.head_dim), pages_dtype),  # [P, Z, 2K, H]
            jax.ShapeDtypeStruct((self.max_seqs,), jnp.int32),  # [Q]
            jax.ShapeDtypeStruct((self.max_seqs, self.pages_per_seq), jnp.int32),
            jax.ShapeDtypeStruct((self.max_seqs + 1,), jnp.int32),  # [Q + 1]
            jax.ShapeDtypeStruct((1,), jnp.int32),
        ]
        if self.scaled_kv:
            arguments.append(jax.ShapeDtypeStruct(
                (self.num_pages, self.page_size, 2 * self.num_kv_heads),
                jnp.float32))  # [P, Z, 2K]
        if self.kivi_bits is not None:
            pages, heads = (self.num_pages,), self.num_kv_heads
            groups = self.head_dim // min(32, self.head_dim)
            arguments[1] = jax.ShapeDtypeStruct(
                (*pages, self.page_size, 2 * heads, self.head_dim * self.kivi_bits // 8),
                jnp.uint8)  # [P, Z, 2K, H * bits / 8]
            arguments += [
                jax.ShapeDtypeStruct((*pages, heads, self.head_dim), jnp.float16),  # [P, K, H]
                jax.ShapeDtypeStruct((*pages, heads, self.head_dim), jnp.float16),
                jax.ShapeDtypeStruct((*pages, self.page_size, heads, groups),
                                     jnp.float16),  # [P, Z, K, H/g]
                jax.ShapeDtypeStruct((*pages, self.page_size, heads, groups), jnp.float16),
                jax.ShapeDtypeStruct((self.max_seqs, self.page_size, 2 * heads, self.head_dim),
                                     jnp.float32),  # [R, Z, 2K, H] residual seats
                jax.ShapeDtypeStruct((self.max_seqs,), jnp.int32),  # [Q] seats
            ]
        return arguments

    def compile(self, topology: str, implementation: str = "pallas") -> AotResult:
        """Compiles the public op (forced to the Pallas kernel, or to `implementation`) for
        `topology`."""
        function = _attention if self.kivi_bits is None else _kivi_attention
        return compile_for(topology, function, self.arguments(), static_kwargs=dict(
            sm_scale=self.head_dim ** -0.5, sliding_window=self.sliding_window,
            soft_cap=self.soft_cap, implementation=implementation))


def _kivi_attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, key_scales,
                    key_zeros, value_scales, value_zeros, residual, residual_slots, *,
                    sm_scale, sliding_window, soft_cap, implementation):
    from pallas_kernels.ragged_paged_attention import KiviPool, ragged_paged_attention

    return ragged_paged_attention(
        queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
        kv_scales=KiviPool(key_scales, key_zeros, value_scales, value_zeros, residual),
        residual_slots=residual_slots, implementation=implementation)


def _attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_scales=None,
               *, sm_scale, sliding_window, soft_cap, implementation):
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    return ragged_paged_attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  sm_scale=sm_scale, sliding_window=sliding_window,
                                  soft_cap=soft_cap, kv_scales=kv_scales,
                                  implementation=implementation)


# Decode-only: one token for each of 64 sequences; mixed: 256 tokens, prefill chunks and decodes.
_BATCHES = {"decode": dict(num_tokens=64, max_seqs=64), "mixed": dict(num_tokens=256, max_seqs=64)}
# Each dimension's values other than the base's, as (label, AttentionCase fields).
_ATTENTION_VARIATIONS: tuple[tuple[str, dict], ...] = (
    ("window128", dict(sliding_window=128)),
    ("softcap50", dict(soft_cap=50.0)),
    ("gqa1", dict(group=1)),
    ("gqa8", dict(group=8)),
    ("head64", dict(head_dim=64)),
    ("head256", dict(head_dim=256)),
    ("page32", dict(page_size=32)),
    ("page64", dict(page_size=64)),
    ("page128", dict(page_size=128)),
    ("kv1", dict(num_kv_heads=1)),
    ("kv2", dict(num_kv_heads=2)),
)


def _kv_label(int8: bool) -> str:
    return "int8" if int8 else "bf16"


ATTENTION_CASES: tuple[AttentionCase, ...] = (
    *(AttentionCase(f"{batch}-{_kv_label(int8)}", **_BATCHES[batch], int8_kv=int8)
      for batch in ("decode", "mixed") for int8 in (False, True)),
    *(AttentionCase(f"mixed-{_kv_label(int8)}-{label}", **_BATCHES["mixed"], int8_kv=int8,
                    **fields)
      for label, fields in _ATTENTION_VARIATIONS for int8 in (False, True)),
    # fp8 pages share int8's copy path and scales; only the widening differs.
    *(AttentionCase(f"{batch}-{label}", **_BATCHES[batch], fp8_kv=dtype)
      for batch in ("decode", "mixed")
      for label, dtype in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"))),
    # KIVI's own kernel (packed codes, per-page scales, a residual seat per sequence).
    *(AttentionCase(f"{batch}-int{bits}-kivi", **_BATCHES[batch], kivi_bits=bits,
                    mosaic_lowers=False)
      for batch in ("decode", "mixed") for bits in (4, 2)),
)


# ---- quantized matmul -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MatmulCase:
    """`quantized_matmul` of `[M, I]` bf16 activations by a quantized `[I, O]` weight."""

    kernel: ClassVar[str] = "quantized_matmul"

    name: str
    weight_format: str
    m: int
    k: int = 4096
    n: int = 14336
    group_size: int | None = None
    symmetric: bool = True
    float_zeros: bool = False

    def arguments(self) -> list[jax.ShapeDtypeStruct]:
        """x, then the `QuantizedWeight`'s values, scales and (asymmetric int4) zeros; for a
        2:4 sparse format, its non-None leaves (values, scales, positions) in pytree order."""
        import jax.numpy as jnp

        x = jax.ShapeDtypeStruct((self.m, self.k), jnp.bfloat16)  # [T, I]
        if self.sparse:
            return [x, *jax.tree.leaves(self._weight_shapes())]
        if self.group_size is not None:
            groups = self.k // self.group_size
            packed = self.weight_format == "int4"
            values = (jax.ShapeDtypeStruct((self.k // 2, self.n), jnp.uint8) if packed
                      else jax.ShapeDtypeStruct((self.k, self.n), jnp.int8))  # [I / 2 or I, O]
            arguments = [x, values,
                         jax.ShapeDtypeStruct((groups, self.n), jnp.float32)]  # [C, O]
            if not self.symmetric:
                zeros_dtype = jnp.float32 if self.float_zeros else jnp.int8
                arguments.append(jax.ShapeDtypeStruct((groups, self.n), zeros_dtype))  # [C, O]
            return arguments
        # Per channel: values (int8, or e4m3 for "fp8") and scales, as the quantizer makes them.
        weight = self._weight_shapes()
        return [x, weight.values, weight.scales]  # [I, O], [O]

    @property
    def sparse(self) -> bool:
        """Whether the format is a compressed 2:4 sparse one (positions among its arrays)."""
        from pallas_kernels.quant_matmul import get_format

        return get_format(self.weight_format).sparse_2_4

    def _weight_shapes(self):
        """The shapes and dtypes of the `[I, O]` weight, from its quantizer (traced: a 2:4
        format's check needs values and is skipped)."""
        import jax.numpy as jnp

        from pallas_kernels.quant_matmul import quantize_weight

        return jax.eval_shape(
            lambda w: quantize_weight(w, self.weight_format, group_size=self.group_size or 128),
            jax.ShapeDtypeStruct((self.k, self.n), jnp.bfloat16))

    def compile(self, topology: str) -> AotResult:
        """Compiles the public op (forced to the Pallas kernel) for `topology`."""
        if self.sparse:
            structure = jax.tree.structure(self._weight_shapes())
            return compile_for(topology, _sparse_matmul, self.arguments(),
                               static_kwargs=dict(structure=structure))
        return compile_for(topology, _matmul, self.arguments(), static_kwargs=dict(
            weight_format=self.weight_format, group_size=self.group_size))


def _sparse_matmul(x, *leaves, structure):
    from pallas_kernels.quant_matmul import quantized_matmul

    weight = jax.tree.unflatten(structure, leaves)
    return quantized_matmul(x, weight, implementation="pallas")


def _matmul(x, values, scales, zeros=None, *, weight_format, group_size):
    from pallas_kernels.quant_matmul import QuantizedWeight, quantized_matmul

    weight = QuantizedWeight(weight_format, values, scales, zeros, group_size)
    return quantized_matmul(x, weight, implementation="pallas")


def _matmul_label(weight_format: str, group_size: int | None, symmetric: bool,
                  float_zeros: bool = False) -> str:
    if group_size is None:
        return weight_format
    zeros = "fzp" if float_zeros else "zp"
    return f"{weight_format}-g{group_size}-{'sym' if symmetric else zeros}"


# (format, group_size, I, symmetric, float zeros): every format; int4 at each group size, with
# and without zero points (the group of all I takes the blocks-inside-a-group path); GGUF's
# Q4_1 (int4, float zero points) and Q8_0 (grouped int8) at their group of 32.
_MATMUL_LAYOUTS: tuple[tuple[str, int | None, int, bool, bool], ...] = (
    ("int8", None, 4096, True, False),
    ("w8a8", None, 4096, True, False),
    *(("int4", group_size, 4608 if group_size == 96 else 4096, symmetric, False)
      for group_size in (16, 32, 64, 96, 128, 256, 4096) for symmetric in (True, False)),
    ("int4", 32, 4096, False, True),
    ("int8_grouped", 32, 4096, True, False),
    ("fp8", None, 4096, True, False),
    ("sparse24", None, 4096, True, False),
    ("sparse24_int8", None, 4096, True, False),
    *(("sparse24_int4", group_size, 4096, True, False) for group_size in (32, 128)),
)

MATMUL_CASES: tuple[MatmulCase, ...] = tuple(
    MatmulCase(f"{_matmul_label(weight_format, group_size, symmetric, float_zeros)}-m{m}",
               weight_format, m, k=k, group_size=group_size, symmetric=symmetric,
               float_zeros=float_zeros)
    for weight_format, group_size, k, symmetric, float_zeros in _MATMUL_LAYOUTS
    for m in (1, 256))


# ---- MoE grouped matmul ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoeCase:
    """The MoE grouped matmul `[rows, I] x [E, I, O]` with bf16 rows, bf16 or int8 weights."""

    kernel: ClassVar[str] = "moe_grouped_matmul"

    name: str
    rows: int
    depth: int  # I
    width: int  # O
    experts: int = 8
    int8: bool = False

    def arguments(self) -> list[jax.ShapeDtypeStruct]:
        """lhs, rhs, group_sizes, then the int8 weights' scales."""
        import jax.numpy as jnp

        arguments = [
            jax.ShapeDtypeStruct((self.rows, self.depth), jnp.bfloat16),  # [rows, I]
            jax.ShapeDtypeStruct((self.experts, self.depth, self.width),
                                 jnp.int8 if self.int8 else jnp.bfloat16),  # [E, I, O]
            jax.ShapeDtypeStruct((self.experts,), jnp.int32),  # [E]
        ]
        if self.int8:
            arguments.append(jax.ShapeDtypeStruct((self.experts, self.width),
                                                  jnp.float32))  # [E, O]
        return arguments

    def compile(self, topology: str) -> AotResult:
        """Compiles the public op (forced to the Pallas kernel) for `topology`."""
        return compile_for(topology, _grouped_matmul, self.arguments())


def _grouped_matmul(lhs, rhs, group_sizes, scales=None):
    from pallas_kernels.moe import grouped_matmul

    return grouped_matmul(lhs, rhs, group_sizes, scales=scales, implementation="pallas")


_MIXTRAL_D, _MIXTRAL_F = 4096, 14336
MOE_CASES: tuple[MoeCase, ...] = tuple(
    MoeCase(f"{projection}-{'int8' if int8 else 'bf16'}-rows{rows}", rows, depth, width,
            int8=int8)
    for projection, depth, width in (("gate_up", _MIXTRAL_D, _MIXTRAL_F),
                                     ("down", _MIXTRAL_F, _MIXTRAL_D))
    for int8 in (False, True) for rows in (2, 512))


# ---- the matrix -----------------------------------------------------------------------------

Case = AttentionCase | MatmulCase | MoeCase
MATRIX: tuple[Case, ...] = (*ATTENTION_CASES, *MATMUL_CASES, *MOE_CASES)

