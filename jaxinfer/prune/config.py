"""Which linear weights are pruned, how and how far: an ordered list of regex rules over
module paths, in the style of `jaxinfer.quant.config`.

A linear weight's path is its place in the model (`layers.3.attention.q_proj`,
`layers.0.mlp.down_proj`, `lm_head`). The first rule whose pattern matches the path (with
`re.search`) decides; a rule with no scheme keeps that weight dense, and so does a path no
rule matches. The embedding table is a lookup, not a linear site, so it is never pruned; the
default configs keep the LM head dense too.

    config = PruningConfig.for_method("wanda", sparsity=0.5)
    config.scheme_for("layers.0.mlp.up_proj")  # PruningScheme(method="wanda", sparsity=0.5)
    config.scheme_for("lm_head")                # None: kept dense
    PruningConfig.for_method("sparsegpt", pattern=(2, 4), bits=4, group_size=128)

A target is either a sparsity in [0, 1) (the fraction of each output's input weights
zeroed) or an N:M pattern: in every M consecutive inputs of one output, the N lowest-scoring
weights are zeroed (2:4 and 4:8 zero half).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from jaxinfer.quant.config import QuantizationConfig, QuantizationRule, WeightScheme

METHODS = ("magnitude", "wanda", "sparsegpt")

# Kept dense by every default config: the LM head (the pruning literature prunes the
# blocks' linear layers only).
KEEP_DENSE_PATTERNS = (r"(^|\.)lm_head$",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PruningScheme:
    """How one weight is pruned.

    Attributes:
        method: "magnitude" (|W|), "wanda" (|W| times the input's norm) or "sparsegpt"
            (OBS-style mask choice with the survivors updated).
        sparsity: Fraction of each output's inputs zeroed, in [0, 1); None with `pattern`.
        pattern: `(N, M)`: the N lowest of every M consecutive inputs are zeroed; None with
            `sparsity`.
    """

    method: str
    sparsity: float | None = None
    pattern: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown pruning method {self.method!r}; known: "
                             f"{', '.join(METHODS)}")
        if (self.sparsity is None) == (self.pattern is None):
            raise ValueError("a pruning scheme takes exactly one of sparsity and pattern")
        if self.sparsity is not None and not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"sparsity = {self.sparsity}: must be in [0, 1)")
        if self.pattern is not None:
            n, m = self.pattern
            if not 0 < n < m:
                raise ValueError(f"pattern {n}:{m}: needs 0 < N < M")
            object.__setattr__(self, "pattern", (int(n), int(m)))

    @property
    def fraction(self) -> float:
        """The fraction of weights zeroed."""
        if self.pattern is not None:
            return self.pattern[0] / self.pattern[1]
        return float(self.sparsity)


def parse_pattern(text: str) -> tuple[int, int]:
    """`"2:4"` -> `(2, 4)`.

    Raises:
        ValueError: Not two integers separated by a colon.
    """
    try:
        n, m = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"pattern {text!r}: expected N:M, e.g. 2:4") from None
    return n, m


@dataclasses.dataclass(frozen=True)
class PruningRule:
    """`pattern` (a regex searched in the weight's path) -> `scheme` (None: keep dense)."""

    pattern: str
    scheme: PruningScheme | None

    def __post_init__(self) -> None:
        re.compile(self.pattern)  # a bad pattern fails here, not at the first lookup


@dataclasses.dataclass(frozen=True, kw_only=True)
class PruningConfig:
    """Pruning rules and the settings of the methods and of OWL.

    Attributes:
        rules: First match wins; unmatched weights stay dense.
        owl: Non-uniform layer sparsities (OWL, `jaxinfer.prune.owl`): each decoder
            layer's unstructured sparsities move by the same offset in [-owl_lambda,
            owl_lambda], the offsets' mean 0, so every rule's sparsity is the mean over
            the layers.
        owl_threshold: OWL's M: an outlier's Wanda score exceeds M times the layer mean.
        owl_lambda: OWL's largest offset from the target sparsity.
        damping: SparseGPT's damping, a fraction of the Hessian's mean diagonal.
        block_size: SparseGPT's block of inputs (mask choice and lazy updates).
        quantization: SparseGPT only: quantize the survivors in the same pass (joint
            sparse + quantized weights in this format); None keeps them float.
    """

    rules: tuple[PruningRule, ...]
    owl: bool = False
    owl_threshold: float = 5.0
    owl_lambda: float = 0.08
    damping: float = 0.01
    block_size: int = 128
    quantization: WeightScheme | None = None

    def __post_init__(self) -> None:
        schemes = [rule.scheme for rule in self.rules if rule.scheme is not None]
        if self.quantization is not None and any(scheme.method != "sparsegpt"
                                                 for scheme in schemes):
            raise ValueError("quantizing while pruning is SparseGPT's joint pass: every "
                             "rule must use sparsegpt")
        if self.owl and any(scheme.pattern is not None for scheme in schemes):
            raise ValueError("OWL sets unstructured layer sparsities; it does not apply to "
                             "N:M patterns")
        if not 0.0 <= self.owl_lambda < 1.0:
            raise ValueError(f"owl_lambda = {self.owl_lambda}: must be in [0, 1)")

    @classmethod
    def for_method(cls, method: str, *, sparsity: float | None = None,
                   pattern: tuple[int, int] | None = None, owl: bool = False,
                   bits: int | None = None, group_size: int | None = None,
                   keep_dense: Sequence[str] = KEEP_DENSE_PATTERNS,
                   **options: object) -> PruningConfig:
        """The usual config: every linear weight pruned alike except `keep_dense` paths.

        Args:
            method: "magnitude", "wanda" or "sparsegpt".
            sparsity: Fraction zeroed per output (or give `pattern`).
            pattern: `(N, M)` (or give `sparsity`).
            owl: Non-uniform layer sparsities around `sparsity`.
            bits: SparseGPT only: also quantize the survivors, 8 (int8 per output channel)
                or 4, 3, 2 (group-wise nibbles); None keeps them float.
            group_size: Rows per scale for bits < 8 (default 128).
            keep_dense: Path patterns never pruned.
            **options: Further fields (`damping`, `block_size`, `owl_lambda`, ...).

        Raises:
            ValueError: A combination the methods or formats cannot hold.
        """
        scheme = PruningScheme(method=method, sparsity=sparsity, pattern=pattern)
        quantization = None
        if bits is not None:
            quantization = QuantizationConfig.for_method(
                "gptq", bits=bits, group_size=group_size).scheme_for("layers.0")
        rules = tuple(PruningRule(pattern, None) for pattern in keep_dense)
        return cls(rules=(*rules, PruningRule(r".", scheme)), owl=owl,
                   quantization=quantization, **options)

    def scheme_for(self, path: str) -> PruningScheme | None:
        """The scheme of the weight at `path`, or None to keep it dense."""
        for rule in self.rules:
            if re.search(rule.pattern, path):
                return rule.scheme
        return None

    def quantization_config(self) -> QuantizationConfig | None:
        """For a joint prune-and-quantize config, the `QuantizationConfig` that describes
        its output (every pruned weight in `quantization`, every other one float), to save
        beside it with `jaxinfer.quant.save_quantized_model`; None when nothing is
        quantized."""
        if self.quantization is None:
            return None
        return QuantizationConfig(method="sparsegpt", rules=tuple(
            QuantizationRule(rule.pattern, None if rule.scheme is None else self.quantization)
            for rule in self.rules))
