"""The C++ quantized matmul of the XLA:CPU path against the formats' jnp references, and its
routing: float activations match `reference_matmul` to float32 summation order; int8
activations match `reference.int8_activation_matmul` (the rule they implement)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quant_matmul import (
    cpu,
    dequantize_weight,
    get_format,
    quantize_weight,
    quantized_matmul,
    reference,
)

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernel"),
    pytest.mark.skipif(not cpu.available(), reason="needs a C++ compiler and AVX2 + FMA"),
]

# (format, quantize_weight options): symmetric and zero-point int4 (int8 zeros from RTN),
# a wider group, per-channel int8 and Q8_0's grouped int8.
WEIGHTS = [("int4", dict(group_size=32)), ("int4", dict(group_size=32, symmetric=False)),
           ("int4", dict(group_size=64)), ("int8", {}), ("int8_grouped", dict(group_size=32))]
# Rows: 1 (a decode step), a row pair plus one, many; columns: whole 32-column blocks (the
# group-split walk) and a tail (the tile walk and its scalar columns, 200 = 6 x 32 + 8); two
# rows over more than one 2048-column chunk (int8 weights' streaming walk, 2112 = 2048 + 64).
# From `cpu.PANEL_ROWS` rows, float activations take the dequantized panel (16-column
# panels, rows six at a time): 13 = 2 x 6 + 1 rows over 48 columns (not whole 32-column
# blocks), 64 rows, and 5 rows over 200 columns (not whole panels: the walks again).
SHAPES = [(1, 128, 64), (3, 256, 200), (8, 64, 96), (64, 192, 32), (2, 128, 2112),
          (13, 128, 48), (5, 128, 200)]


def _case(weight_format, options, rows, depth, columns, seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((depth, columns)), jnp.float32)  # [K, N]
    x = jnp.asarray(rng.standard_normal((rows, depth)) * 3, jnp.float32)  # [M, K]
    return x, quantize_weight(w, weight_format, **options)


def _kernel(x, weight, int8_activations, layer=None):
    return jax.jit(lambda a, w: cpu.matmul(a, w.format, w.values, w.scales, w.zeros,
                                           w.group_size, int8_activations=int8_activations,
                                           layer=layer))(x, weight)


def _relative_error(got, want):
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(want)))


@pytest.mark.parametrize("weight_format,options", WEIGHTS)
@pytest.mark.parametrize("rows,depth,columns", SHAPES)
def test_float_activations_match_the_reference(weight_format, options, rows, depth, columns):
    x, weight = _case(weight_format, options, rows, depth, columns)
    want = get_format(weight_format).reference_matmul(x, weight, jnp.float32)  # [M, N]
    assert _relative_error(_kernel(x, weight, False), want) < 2e-6


@pytest.mark.parametrize("weight_format,options", WEIGHTS)
@pytest.mark.parametrize("rows,depth,columns", SHAPES)
def test_int8_activations_match_their_rule(weight_format, options, rows, depth, columns):
    x, weight = _case(weight_format, options, rows, depth, columns, seed=1)
    got = _kernel(x, weight, True)
    rule = reference.int8_activation_matmul(x, dequantize_weight(weight))  # [M, N]
    exact = get_format(weight_format).reference_matmul(x, weight, jnp.float32)  # [M, N]
    if columns % 32:  # not whole 32-column blocks: the kernel keeps float activations
        assert _relative_error(got, exact) < 2e-6
        return
    assert _relative_error(got, rule) < 2e-6
    # The rule is not exact: int8 activations move the product by ~0.5%.
    assert 1e-4 < _relative_error(got, exact) < 3e-2


@pytest.mark.parametrize("weight_format,options", [WEIGHTS[1], WEIGHTS[3], WEIGHTS[4]])
@pytest.mark.parametrize("layer", [None, 1])
def test_exact_top_recomputes_each_rows_largest_outputs_with_float_activations(
        weight_format, options, layer):
    rows, depth, columns, top = 3, 128, 256, 5
    x, weight = _case(weight_format, options, rows, depth, columns, seed=2)
    # An outlier feature per row: its block's other 31 features round to few int8 levels,
    # as in an LM head's hidden state, so the int8 product misorders close outputs.
    x = x.at[:, 7].mul(40.0)
    stack = None if layer is None else jax.tree.map(
        lambda a: None if a is None else jnp.stack([a * 0, a, a * 0]), weight)
    source = weight if layer is None else stack

    def product(exact_top):
        return jax.jit(lambda a: cpu.matmul(
            a, weight.format, source.values, source.scales, source.zeros, weight.group_size,
            layer=layer, int8_activations=True, exact_top=exact_top))(x)

    approximate, refined = np.asarray(product(0)), np.asarray(product(top))  # [M, N]
    exact = np.asarray(get_format(weight_format).reference_matmul(x, weight, jnp.float32))
    for row in range(rows):
        chosen = np.argsort(-approximate[row])[:top]  # the int8 product's top columns
        others = np.setdiff1d(np.arange(columns), chosen)
        np.testing.assert_allclose(refined[row, chosen], exact[row, chosen], rtol=2e-6,
                                   atol=2e-6 * np.abs(exact[row]).max())
        np.testing.assert_array_equal(refined[row, others], approximate[row, others])
    # The test can fail: the int8 product alone moves values by more than float rounding.
    assert _relative_error(approximate, exact) > 1e-4
    assert np.array_equal(refined.argmax(-1), exact.argmax(-1))


def test_exact_top_leaves_float_activations_alone():
    x, weight = _case("int8_grouped", dict(group_size=32), 2, 64, 96)
    plain = _kernel(x, weight, False)
    topped = jax.jit(lambda a, w: cpu.matmul(a, w.format, w.values, w.scales, w.zeros,
                                             w.group_size, int8_activations=False,
                                             exact_top=4))(x, weight)
    np.testing.assert_array_equal(np.asarray(topped), np.asarray(plain))


def test_float32_zero_points_of_gguf_q4_1_are_read_as_floats():
    x, weight = _case("int4", dict(group_size=32, symmetric=False), 2, 128, 64)
    offsets = weight.zeros.astype(jnp.float32) + 0.37  # [C, N] not whole steps
    weight = type(weight)("int4", weight.values, weight.scales, offsets, 32)
    want = get_format("int4").reference_matmul(x, weight, jnp.float32)
    assert _relative_error(_kernel(x, weight, False), want) < 2e-6


def test_a_stacked_weight_is_read_at_the_traced_layer():
    weights = [_case("int4", dict(group_size=32, symmetric=False), 3, 128, 96, seed=s)[1]
               for s in range(3)]
    x = _case("int4", {}, 3, 128, 96, seed=9)[0]
    values, scales, zeros = (jnp.stack([getattr(w, name) for w in weights])
                             for name in ("values", "scales", "zeros"))

    def per_layer(a):
        return jax.lax.map(lambda layer: cpu.matmul(a, "int4", values, scales, zeros, 32,
                                                    layer=layer, int8_activations=False),
                           jnp.arange(3))

    got = jax.jit(per_layer)(x)  # [L, M, N]
    for index, weight in enumerate(weights):
        want = get_format("int4").reference_matmul(x, weight, jnp.float32)
        assert _relative_error(got[index], want) < 2e-6
    # The layer stays a runtime operand: one custom call, no slice of the stack per layer.
    assert jax.jit(per_layer).lower(x).as_text().count("jaxinfer_QuantMatmul") == 1


def test_gradients_are_the_references():
    x, weight = _case("int4", dict(group_size=32, symmetric=False), 4, 64, 32)
    offsets = weight.zeros.astype(jnp.float32)  # [C, N]

    probe = jnp.asarray(np.random.default_rng(5).standard_normal((4, 32)), jnp.float32)

    def loss(matmul):  # linear in the product, so its gradients do not depend on its ulps
        return lambda a, s, z: jnp.sum(probe * matmul(a, s, z))

    def kernel(a, s, z):
        return cpu.matmul(a, "int4", weight.values, s, z, 32, int8_activations=False)

    def readable(a, s, z):
        w = type(weight)("int4", weight.values, s, z, 32)
        return get_format("int4").reference_matmul(a, w, jnp.float32)

    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(x, weight.scales, offsets)
    want = jax.grad(loss(readable), argnums=(0, 1, 2))(x, weight.scales, offsets)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_the_public_op_routes_decode_rows_to_the_kernel_and_prefill_to_xla():
    x, weight = _case("int4", dict(group_size=32), 1, 64, 32)
    decode = jax.jit(lambda a, w: quantized_matmul(a, w)).lower(x, weight).as_text()
    assert "jaxinfer_QuantMatmul" in decode
    long = jnp.zeros((cpu.MAX_ROWS + 1, 64), jnp.float32)
    prefill = jax.jit(lambda a, w: quantized_matmul(a, w)).lower(long, weight).as_text()
    assert "jaxinfer_QuantMatmul" not in prefill
    forced = jax.jit(lambda a, w: quantized_matmul(a, w, implementation="reference"))
    assert "jaxinfer_QuantMatmul" not in forced.lower(x, weight).as_text()
    with cpu.disabled():
        assert "jaxinfer_QuantMatmul" not in jax.jit(
            lambda a, w: quantized_matmul(a, w)).lower(x, weight).as_text()


def test_int8_activations_by_default_at_decode_rows_only(monkeypatch):
    monkeypatch.delenv("JAXINFER_CPU_INT8_ACTIVATIONS", raising=False)
    assert cpu.int8_activations_by_default(1)
    assert cpu.int8_activations_by_default(cpu.DECODE_ROWS)
    assert not cpu.int8_activations_by_default(cpu.DECODE_ROWS + 1)  # a prompt's prefill
    monkeypatch.setenv("JAXINFER_CPU_INT8_ACTIVATIONS", "on")
    assert cpu.int8_activations_by_default(cpu.MAX_ROWS)
    monkeypatch.setenv("JAXINFER_CPU_INT8_ACTIVATIONS", "0")
    assert not cpu.int8_activations_by_default(1)
    monkeypatch.setenv("JAXINFER_CPU_INT8_ACTIVATIONS", "sometimes")
    with pytest.raises(ValueError, match="JAXINFER_CPU_INT8_ACTIVATIONS='sometimes'"):
        cpu.int8_activations_by_default(1)


def test_a_decode_row_takes_int8_activations_and_a_prompt_keeps_floats(monkeypatch):
    monkeypatch.delenv("JAXINFER_CPU_INT8_ACTIVATIONS", raising=False)
    for rows, rule in ((1, True), (cpu.DECODE_ROWS + 8, False)):
        x, weight = _case("int4", dict(group_size=32, symmetric=False), rows, 128, 64)
        got = jax.jit(lambda a, w: cpu.matmul(a, w.format, w.values, w.scales, w.zeros,
                                              w.group_size))(x, weight)
        np.testing.assert_allclose(got, _kernel(x, weight, int8_activations=rule), rtol=1e-6,
                                   atol=1e-5)


def test_activation_quantization_rule_by_hand():
    x = jnp.asarray([[0.0] * 32 + [127.0, -63.5] + [0.25] * 30], jnp.float32)  # [1, 64]
    levels, scales = reference.quantize_activations_per_block(x)
    np.testing.assert_array_equal(np.asarray(scales), [[0.0, 1.0]])
    np.testing.assert_array_equal(np.asarray(levels[0, :32]), 0)  # a block of zeros
    # 127 / 1 -> 127; -63.5 -> -64 (half to even); 0.25 -> 0.
    np.testing.assert_array_equal(np.asarray(levels[0, 32:35]), [127, -64, 0])


# Several weights of one x in one call (`matmul_many`): q, k and v at SmolLM2's column ratio
# (3 : 1 : 1, here 96 / 32 / 32), and a set with a column count off the 32-column blocks.
MANY_COLUMNS = [(96, 32, 32), (64, 40)]


@pytest.mark.parametrize("weight_format,options", WEIGHTS)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("columns", MANY_COLUMNS)
@pytest.mark.parametrize("int8_activations", [True, False])
def test_many_weights_in_one_call_equal_one_call_each(weight_format, options, rows, columns,
                                                      int8_activations):
    x = _case(weight_format, options, rows, 128, 32, seed=3)[0]
    weights = [_case(weight_format, options, rows, 128, n, seed=10 + i)[1]
               for i, n in enumerate(columns)]
    arrays = [(w.values, w.scales, w.zeros) for w in weights]
    got = jax.jit(lambda a: cpu.matmul_many(a, weight_format, arrays, weights[0].group_size,
                                            int8_activations=int8_activations))(x)
    for out, weight in zip(got, weights, strict=True):
        want = _kernel(x, weight, int8_activations)  # [M, N]
        # The same walk and the same activation side: equal bit for bit, except where one of
        # the weights keeps float activations (then all do: columns off the 32-column blocks).
        if int8_activations and any(n % 32 for n in columns):
            want = _kernel(x, weight, False)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_many_weights_read_the_traced_layer_of_their_stacks_in_one_custom_call():
    cases = [[_case("int4", dict(group_size=32, symmetric=False), 1, 128, n, seed=20 + s)[1]
              for s in range(3)] for n in (64, 32)]  # two weights, three layers each
    x = _case("int4", {}, 1, 128, 32, seed=9)[0]
    stacks = [tuple(jnp.stack([getattr(w, name) for w in layers])
                    for name in ("values", "scales", "zeros")) for layers in cases]

    def per_layer(a):
        return jax.lax.map(lambda layer: tuple(cpu.matmul_many(a, "int4", stacks, 32,
                                                               layer=layer)), jnp.arange(3))

    got = jax.jit(per_layer)(x)  # ([L, M, 64], [L, M, 32])
    for weight_index, layers in enumerate(cases):
        for layer, weight in enumerate(layers):
            want = _kernel(x, weight, True)
            np.testing.assert_array_equal(np.asarray(got[weight_index][layer]), np.asarray(want))
    assert jax.jit(per_layer).lower(x).as_text().count("jaxinfer_QuantMatmulMany") == 1


def test_many_weights_gradients_are_each_weights_summed():
    x, first = _case("int4", dict(group_size=32, symmetric=False), 2, 64, 32)
    second = _case("int4", dict(group_size=32, symmetric=False), 2, 64, 64, seed=4)[1]
    probes = [jnp.asarray(np.random.default_rng(6 + i).standard_normal((2, n)), jnp.float32)
              for i, n in enumerate((32, 64))]

    def together(a):
        outs = cpu.matmul_many(a, "int4", [(w.values, w.scales, w.zeros) for w in
                                           (first, second)], 32, int8_activations=False)
        return sum(jnp.sum(p * o) for p, o in zip(probes, outs, strict=True))

    def apart(a):
        return sum(jnp.sum(p * cpu.matmul(a, "int4", w.values, w.scales, w.zeros, 32,
                                          int8_activations=False))
                   for p, w in zip(probes, (first, second), strict=True))

    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(together))(x)),
                               np.asarray(jax.jit(jax.grad(apart))(x)), rtol=1e-5, atol=1e-6)


def test_many_weights_refuse_a_mix_of_zero_points():
    x, with_zeros = _case("int4", dict(group_size=32, symmetric=False), 1, 64, 32)
    without = _case("int4", dict(group_size=32), 1, 64, 32)[1]
    with pytest.raises(ValueError, match="zero points"):
        cpu.matmul_many(x, "int4", [(w.values, w.scales, w.zeros) for w in (with_zeros, without)],
                        32)
