"""Which weights get which quantized format: an ordered list of regex rules over module paths.

A linear weight's path is its place in the model, dotted: `layers.3.attention.q_proj`,
`layers.0.mlp.down_proj`, `lm_head`. The first rule whose pattern matches the path (with
`re.search`) decides; a rule with no scheme keeps that weight in floating point, and a
weight no rule matches stays in floating point too. The embedding table is a lookup, not a
linear layer, so it is never quantized.

    config = QuantizationConfig.for_method("rtn", bits=4, group_size=32)
    config.scheme_for("layers.0.mlp.up_proj")  # WeightScheme(format="int4", bits=4, ...)
    config.scheme_for("lm_head")                # None: kept in floating point

The config is saved as JSON beside a quantized checkpoint (see `jaxinfer.quant.checkpoint`),
so it must hold everything needed to rebuild the quantized model's structure.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from pallas_kernels.quant_matmul import get_format

# "sparsegpt": joint SparseGPT pruning + quantization, made by `jaxinfer.prune` (not by
# `apply_method`); the name is recorded in its checkpoints.
METHODS = ("rtn", "gptq", "smoothquant", "sparsegpt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightScheme:
    """How one weight is stored.

    The format's registry entry (`pallas_kernels.quant_matmul.formats`) says which bits,
    group sizes and zero points it holds.

    Attributes:
        format: A registered format: "int8" (weight-only, per output channel), "fp8"
            (e4m3 values, per output channel), "int4"
            (group-wise, nibble-packed; also holds 3- and 2-bit grids), "w8a8" (int8
            weights and per-token int8 activations), the compressed 2:4 sparse "sparse24"
            (float values), "sparse24_int8" and "sparse24_int4" (which take weights already
            pruned to 2:4, see `pallas_kernels.quant_matmul.sparse24`), or one registered
            later.
        bits: 8 for the int8 formats; 4, 3 or 2 for "int4"; 16 (bf16) or 32 (f32) for
            "sparse24". None (the default): the format's default width.
        group_size: Input rows per scale for grouped formats ("int4"); None for the
            per-channel ones.
        symmetric: False stores zero points (formats that hold them: "int4").
    """

    format: str
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        weight_format = get_format(self.format)
        if self.bits is None:  # frozen dataclass: the default depends on the format
            object.__setattr__(self, "bits", weight_format.bits[0])
        weight_format.check_options(self.bits, self.group_size, self.symmetric)


@dataclasses.dataclass(frozen=True)
class QuantizationRule:
    """`pattern` (a regex searched in the weight's path) -> `scheme` (None: keep float)."""

    pattern: str
    scheme: WeightScheme | None

    def __post_init__(self) -> None:
        re.compile(self.pattern)  # a bad pattern fails here, not at the first lookup


# Kept in floating point by every default config: the LM head (the literature's W4/W8
# protocols keep it; on a 4096-token vocabulary it is also a large share of the error).
HEAD_PATTERN = r"(^|\.)lm_head$"
KEEP_FLOAT_PATTERNS = (HEAD_PATTERN,)
# `for_method(head=...)`: how the LM head is stored. "int8" is GGUF's Q8_0 (int8 levels, a
# scale per 32 input rows), which llama.cpp files give the tied head of small models: on
# SmolLM2-135M the float32 head is 113 MB of a 4-bit model's 183 MB read per token. A tied
# head gets its own quantized copy of the table (the lookup keeps the float table).
HEAD_SCHEMES = {"float": None, "int8": WeightScheme(format="int8_grouped", group_size=32)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
    """A quantization method and the rules that say which weight gets which scheme.

    Attributes:
        method: "rtn", "gptq", "smoothquant" or "sparsegpt" (how the quantized values were
            chosen; "sparsegpt" comes from `jaxinfer.prune.prune_model`).
        rules: First match wins; unmatched weights stay in floating point.
        smoothquant_alpha: SmoothQuant's migration strength `a` (method "smoothquant").
        gptq_damping: GPTQ's damping, a fraction of the Hessian's mean diagonal.
        gptq_block_size: GPTQ's lazy-batch block of columns.
        gptq_act_order: GPTQ processes columns by descending Hessian diagonal.
    """

    method: str
    rules: tuple[QuantizationRule, ...]
    smoothquant_alpha: float = 0.5
    gptq_damping: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; "
                             f"known: {', '.join(METHODS)}")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ValueError(f"smoothquant_alpha = {self.smoothquant_alpha}: must be in [0, 1]")

    @classmethod
    def for_method(cls, method: str, *, bits: int = 8, group_size: int | None = None,
                   symmetric: bool = True, weight_format: str | None = None,
                   keep_float: Sequence[str] = KEEP_FLOAT_PATTERNS,
                   head: str = "float", **options: Any) -> QuantizationConfig:
        """The usual config: every linear weight in one scheme except `keep_float` paths.

        Args:
            method: "rtn", "gptq" or "smoothquant" (which implies W8A8).
            bits: 8 gives per-channel int8 (W8A8 under SmoothQuant); 4, 3 or 2 give the
                group-wise nibble format.
            group_size: Rows per scale for bits < 8, or for a grouped `weight_format`
                (default 128).
            symmetric: False gives zero points (bits < 8 only).
            weight_format: A registered format name ("fp8", ...) that replaces the choice by
                `bits`; `bits` must then be one it holds.
            keep_float: Path patterns kept in floating point.
            head: "float" (the papers' protocol) or "int8" (`HEAD_SCHEMES`): the LM head's
                storage, ahead of `keep_float`; a tied head is quantized from the table.
            **options: Further fields (`smoothquant_alpha`, `gptq_damping`, ...).

        Raises:
            ValueError: A combination the formats cannot hold.
        """
        if method == "smoothquant":
            if bits != 8 or weight_format not in (None, "w8a8"):
                raise ValueError(f"SmoothQuant is W8A8: bits must be 8 and the format w8a8, "
                                 f"got bits={bits}, format={weight_format}")
            scheme = WeightScheme(format="w8a8")
        elif weight_format is not None:
            grouped = get_format(weight_format).grouped
            scheme = WeightScheme(format=weight_format, bits=bits,
                                  group_size=group_size or 128 if grouped else group_size,
                                  symmetric=symmetric)
        elif bits == 8:
            scheme = WeightScheme(format="int8", group_size=group_size, symmetric=symmetric)
        else:
            scheme = WeightScheme(format="int4", bits=bits, group_size=group_size or 128,
                                  symmetric=symmetric)
        if head not in HEAD_SCHEMES:
            raise ValueError(f"head={head!r}: must be one of {', '.join(HEAD_SCHEMES)}")
        rules = tuple(QuantizationRule(pattern, None) for pattern in keep_float)
        if HEAD_SCHEMES[head] is not None:
            rules = (QuantizationRule(HEAD_PATTERN, HEAD_SCHEMES[head]), *rules)
        return cls(method=method, rules=(*rules, QuantizationRule(r".", scheme)), **options)

    def scheme_for(self, path: str) -> WeightScheme | None:
        """The scheme of the weight at `path`, or None to keep it in floating point."""
        for rule in self.rules:
            if re.search(rule.pattern, path):
                return rule.scheme
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; `from_dict` inverts it."""
        data = dataclasses.asdict(self)
        data["rules"] = [{"pattern": rule.pattern,
                          "scheme": None if rule.scheme is None else
                          dataclasses.asdict(rule.scheme)} for rule in self.rules]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationConfig:
        """Rebuilds a config from `to_dict`'s output.

        Raises:
            ValueError: Unknown fields, or values the schemes reject.
        """
        data = dict(data)
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown quantization config fields {unknown}; known: "
                             f"{sorted(known)}")
        rules = tuple(QuantizationRule(rule["pattern"],
                                       None if rule["scheme"] is None else
                                       WeightScheme(**rule["scheme"]))
                      for rule in data.pop("rules"))
        return cls(rules=rules, **data)
