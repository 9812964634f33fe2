"""PruningConfig rules: defaults prune every block linear and never the LM head; targets
are checked; the joint config describes its quantized output."""

from __future__ import annotations

import pytest

from jaxinfer.prune import PruningConfig, PruningRule, PruningScheme, parse_pattern
from jaxinfer.quant import QuantizationConfig


def test_default_rules_prune_block_linears_and_keep_the_head():
    config = PruningConfig.for_method("wanda", sparsity=0.5)
    assert config.scheme_for("layers.3.mlp.down_proj") == PruningScheme(method="wanda",
                                                                        sparsity=0.5)
    assert config.scheme_for("layers.0.attention.q_proj").fraction == 0.5
    assert config.scheme_for("lm_head") is None


def test_first_matching_rule_wins():
    config = PruningConfig(rules=(
        PruningRule(r"\.k_proj$", None),
        PruningRule(r"^layers\.0\.", PruningScheme(method="magnitude", pattern=(2, 4))),
        PruningRule(r"^layers\.", PruningScheme(method="magnitude", sparsity=0.6))))
    assert config.scheme_for("layers.0.attention.k_proj") is None
    assert config.scheme_for("layers.0.mlp.up_proj").pattern == (2, 4)
    assert config.scheme_for("layers.1.mlp.up_proj").sparsity == 0.6
    assert config.scheme_for("lm_head") is None


@pytest.mark.parametrize("options, message", [
    (dict(method="wanda"), "exactly one"),
    (dict(method="wanda", sparsity=0.5, pattern=(2, 4)), "exactly one"),
    (dict(method="wanda", sparsity=1.0), r"\[0, 1\)"),
    (dict(method="wanda", pattern=(4, 4)), "0 < N < M"),
    (dict(method="obs", sparsity=0.5), "unknown pruning method"),
])
def test_bad_schemes_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        PruningScheme(**options)


def test_parse_pattern():
    assert parse_pattern("2:4") == (2, 4)
    with pytest.raises(ValueError, match="N:M"):
        parse_pattern("2-4")


def test_joint_quantization_needs_sparsegpt_and_owl_needs_a_sparsity():
    with pytest.raises(ValueError, match="sparsegpt"):
        PruningConfig.for_method("wanda", sparsity=0.5, bits=4)
    with pytest.raises(ValueError, match="N:M"):
        PruningConfig.for_method("wanda", pattern=(2, 4), owl=True)


def test_joint_config_describes_its_quantized_output():
    config = PruningConfig.for_method("sparsegpt", pattern=(2, 4), bits=4, group_size=32)
    quantization = config.quantization_config()
    assert quantization.method == "sparsegpt"
    assert quantization.scheme_for("layers.1.mlp.up_proj") == config.quantization
    assert quantization.scheme_for("lm_head") is None
    assert QuantizationConfig.from_dict(quantization.to_dict()) == quantization
    assert PruningConfig.for_method("sparsegpt", sparsity=0.5).quantization_config() is None
