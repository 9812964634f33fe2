"""SparseGPT: the identity at 0%, exact sparsity and N:M, a lower layer output error than
magnitude and Wanda on the same calibration inputs, and joint pruning + quantization whose
pruned entries dequantize to exact zeros."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.prune import PruningScheme, input_norms, sparsegpt_prune, sparsegpt_prune_quantize
from jaxinfer.prune.masks import prune_matrix
from jaxinfer.prune.sparsegpt import SparseGPTMask
from jaxinfer.quant import WeightScheme, linear_sites
from jaxinfer.quant.calibration import INPUT_SITE, collect_block_inputs
from jaxinfer.quant.gptq import GridRounding, error_feedback_sweep, gptq_quantize, hessian
from pallas_kernels.quant_matmul import dequantize_weight

HALF = PruningScheme(method="sparsegpt", sparsity=0.5)
TWO_FOUR = PruningScheme(method="sparsegpt", pattern=(2, 4))


def _problem(seed: int, k: int = 64, n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(k, k)) * 0.3 + np.eye(k)  # correlated inputs
    x = rng.normal(size=(256, k)) @ mixing * rng.uniform(0.2, 3.0, size=k)  # [T, I]
    return rng.normal(size=(k, n)), x  # [I, O], [T, I]


def test_zero_sparsity_reproduces_the_weights():
    weight, x = _problem(0)
    pruned = sparsegpt_prune(weight, hessian(x), PruningScheme(method="sparsegpt",
                                                               sparsity=0.0), block_size=16)
    np.testing.assert_allclose(pruned, weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.7])
def test_unstructured_sparsity_is_exact_in_every_output(sparsity):
    weight, x = _problem(1, k=80)  # 80 inputs: blocks of 32, 32, 16
    pruned = sparsegpt_prune(weight, hessian(x), PruningScheme(method="sparsegpt",
                                                               sparsity=sparsity),
                             block_size=32)  # [I, O]
    assert np.all(np.sum(pruned == 0, axis=0) == round(sparsity * 80))


@pytest.mark.parametrize("pattern", [(2, 4), (4, 8)])
def test_n_m_pattern_is_exact(pattern):
    n, m = pattern
    weight, x = _problem(2)
    pruned = sparsegpt_prune(weight, hessian(x), PruningScheme(method="sparsegpt",
                                                               pattern=pattern),
                             block_size=16)  # [I, O]
    assert np.all(np.sum(pruned.reshape(64 // m, m, 24) == 0, axis=1) == n)


def test_n_m_must_fit_the_blocks():
    weight, x = _problem(3)
    with pytest.raises(ValueError, match="divide"):
        sparsegpt_prune(weight, hessian(x), PruningScheme(method="sparsegpt", pattern=(4, 8)),
                        block_size=12)


def _output_error(x: np.ndarray, weight: np.ndarray, pruned: np.ndarray) -> float:
    return float(np.linalg.norm(x @ weight - x @ pruned))


@pytest.mark.parametrize("scheme", [HALF, TWO_FOUR], ids=["50%", "2:4"])
def test_lower_output_error_than_magnitude_and_wanda_on_a_synthetic_layer(scheme):
    weight, x = _problem(4)
    errors = {}
    for method in ("magnitude", "wanda"):
        other = PruningScheme(method=method, sparsity=scheme.sparsity, pattern=scheme.pattern)
        errors[method] = _output_error(x, weight, prune_matrix(weight, other, input_norms(x)))
    errors["sparsegpt"] = _output_error(x, weight, sparsegpt_prune(weight, hessian(x), scheme,
                                                                   block_size=32))
    assert errors["sparsegpt"] < errors["wanda"] < errors["magnitude"], errors


def test_lower_output_error_than_magnitude_and_wanda_on_every_layer_of_a_model():
    model = create_model(get_preset("tiny"), seed=0)
    windows = np.random.default_rng(0).integers(3, 512, size=(8, 64))  # [B, T]
    per_block = collect_block_inputs(model, windows)
    worse = {}
    sites = [site for site in linear_sites(model) if site.path != "lm_head"]
    for site in sites:
        index = int(site.path.split(".")[1])
        x = np.asarray(per_block[index][INPUT_SITE[site.name]], np.float64)  # [T, I]
        weight = np.asarray(site.float_matrix(), np.float64)  # [I, O]
        errors = {method: _output_error(x, weight, prune_matrix(
            weight, PruningScheme(method=method, sparsity=0.5), input_norms(x)))
            for method in ("magnitude", "wanda")}
        errors["sparsegpt"] = _output_error(x, weight, sparsegpt_prune(weight, hessian(x),
                                                                       HALF))
        if not errors["sparsegpt"] < min(errors["magnitude"], errors["wanda"]):
            worse[site.path] = errors
    assert len(sites) == 14 and not worse, worse


INT4 = WeightScheme(format="int4", bits=4, group_size=16, symmetric=True)
INT4_ASYM = WeightScheme(format="int4", bits=4, group_size=16, symmetric=False)
INT8 = WeightScheme(format="int8")


@pytest.mark.parametrize("quantization", [INT4, INT4_ASYM, INT8], ids=["int4", "int4a", "int8"])
@pytest.mark.parametrize("scheme", [HALF, TWO_FOUR], ids=["50%", "2:4"])
def test_joint_prune_and_quantize_keeps_exact_zeros(scheme, quantization):
    weight, x = _problem(5)
    h = hessian(x)
    joint = sparsegpt_prune_quantize(weight, h, scheme, quantization, block_size=32)
    assert joint.format == quantization.format
    dequantized = np.asarray(dequantize_weight(joint))  # [I, O]
    # The same mask as pruning alone would not be guaranteed (rounding changes the updates),
    # but the sparsity and pattern are.
    if scheme.pattern is None:
        assert np.all(np.sum(dequantized == 0, axis=0) >= 32)
    else:
        assert np.all(np.sum(dequantized.reshape(16, 4, 24) == 0, axis=1) >= 2)
    # Quantizing the survivors costs little next to pruning itself.
    float_pruned = sparsegpt_prune(weight, h, scheme, block_size=32)
    relative = (np.linalg.norm(x @ dequantized - x @ weight)
                / np.linalg.norm(x @ float_pruned - x @ weight))
    assert relative < 1.5


@pytest.mark.parametrize("quantization", [INT4, INT4_ASYM, INT8], ids=["int4", "int4a", "int8"])
def test_joint_pass_at_zero_sparsity_is_gptq(quantization):
    weight, x = _problem(6)
    h = hessian(x)
    joint = sparsegpt_prune_quantize(weight, h, PruningScheme(method="sparsegpt",
                                                              sparsity=0.0),
                                     quantization, block_size=16)
    gptq = gptq_quantize(weight, h, quantization, block_size=16, act_order=False)
    np.testing.assert_array_equal(joint.values, gptq.values)
    np.testing.assert_array_equal(joint.scales, gptq.scales)


@pytest.mark.parametrize("quantization", [INT4, INT4_ASYM, INT8], ids=["int4", "int4a", "int8"])
def test_joint_masked_entries_are_exact_zeros_of_the_grid(quantization):
    weight, x = _problem(7)
    rounding = GridRounding(quantization, weight.shape)
    rule = SparseGPTMask(HALF, weight.shape, 32, rounding=rounding)
    error_feedback_sweep(weight, hessian(x), rule, block_size=32)
    joint = rounding.quantized_weight()
    keep = rule.keep.T  # [I, O]
    assert np.all(np.sum(~keep, axis=0) == 32)
    dequantized = np.asarray(dequantize_weight(joint))  # [I, O] float32, as kernels see it
    assert np.all(dequantized[~keep] == 0.0)
    # The survivors are GPTQ-rounded, not zeroed wholesale.
    assert np.mean(dequantized[keep] != 0.0) > 0.8
