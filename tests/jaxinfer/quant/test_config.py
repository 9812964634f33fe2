"""Quantization rules: first match wins, kept-float paths, JSON round trip, bad schemes."""

from __future__ import annotations

import json
import re

import pytest

from jaxinfer.quant import QuantizationConfig, QuantizationRule, WeightScheme


def test_first_matching_rule_wins_and_unmatched_paths_stay_float():
    int8 = WeightScheme(format="int8")
    int4 = WeightScheme(format="int4", bits=4, group_size=32, symmetric=False)
    config = QuantizationConfig(method="rtn", rules=(
        QuantizationRule(r"lm_head$", None),
        QuantizationRule(r"\.mlp\.down_proj$", int8),
        QuantizationRule(r"^layers\.", int4),
    ))
    assert config.scheme_for("layers.3.mlp.down_proj") == int8
    assert config.scheme_for("layers.3.mlp.up_proj") == int4
    assert config.scheme_for("layers.0.attention.o_proj") == int4
    assert config.scheme_for("lm_head") is None
    assert config.scheme_for("embed") is None  # no rule matches


def test_for_method_keeps_the_lm_head_and_picks_the_format():
    config = QuantizationConfig.for_method("gptq", bits=3, group_size=32, symmetric=False)
    scheme = config.scheme_for("layers.1.attention.q_proj")
    assert scheme == WeightScheme(format="int4", bits=3, group_size=32, symmetric=False)
    assert config.scheme_for("lm_head") is None
    assert config.scheme_for("layers.0.mlp.up_proj").group_size == 32
    assert QuantizationConfig.for_method("rtn").scheme_for("layers.0.mlp.up_proj").format == \
        "int8"
    assert QuantizationConfig.for_method("smoothquant").scheme_for(
        "layers.0.mlp.up_proj").format == "w8a8"
    assert QuantizationConfig.for_method("rtn", bits=4).scheme_for("layers.0.mlp.up_proj") \
        .group_size == 128


def test_head_int8_is_q8_0_groups_ahead_of_the_keep_float_rules():
    config = QuantizationConfig.for_method("rtn", bits=4, group_size=32, head="int8")
    assert config.scheme_for("lm_head") == WeightScheme(format="int8_grouped", group_size=32)
    assert config.scheme_for("layers.0.mlp.up_proj").format == "int4"
    assert QuantizationConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="head='int4'"):
        QuantizationConfig.for_method("rtn", head="int4")


def test_json_round_trip():
    config = QuantizationConfig.for_method("smoothquant", smoothquant_alpha=0.7)
    restored = QuantizationConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config
    config = QuantizationConfig.for_method("gptq", bits=4, group_size=64, gptq_act_order=False)
    assert QuantizationConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(format="int4", bits=5, group_size=32), "2 to 4 bits"),
    (dict(format="int4", bits=4, group_size=None), "even group_size"),
    (dict(format="int8", bits=4), "8-bit"),
    (dict(format="int8", symmetric=False), "symmetric only"),
    (dict(format="int8", group_size=32), "one scale per output channel"),
    (dict(format="fp6"), "unknown weight format"),
])
def test_bad_schemes_are_rejected(arguments, message):
    with pytest.raises(ValueError, match=message):
        WeightScheme(**arguments)


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="bits must be 8"):
        QuantizationConfig.for_method("smoothquant", bits=4)
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantizationConfig.for_method("awq")
    with pytest.raises(ValueError, match="unknown quantization config fields"):
        QuantizationConfig.from_dict({"method": "rtn", "rules": [], "colour": "red"})
    with pytest.raises(re.error):
        QuantizationRule(r"(unclosed", None)
