"""Sharded models on 8 simulated CPU devices compute what the unsharded model computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models import create_model
from jaxinfer.sharding import (
    ShardingError,
    activate,
    constrain,
    describe,
    logical_to_spec,
    make_mesh,
)

# Every split dimension divides by 8: 16 query heads, 8 kv heads, vocab 256, MLP 128.
DENSE = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=16, num_kv_heads=8, head_dim=8,
                    attention_bias=True, max_position_embeddings=128)
MOE = DENSE.replace(model_type="mixtral", attention_bias=False, num_experts=4,
                    num_experts_per_token=2)
MESHES = [(1, 8), (2, 4), (8, 1)]


def _forward(model, token_ids, mesh=None, layout="tensor_parallel"):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, token_ids):
        return nnx.merge(graphdef, state)(token_ids)[0]

    with activate(mesh, layout):
        return np.asarray(run(state, token_ids))


def _token_ids(batch: int = 8, length: int = 12) -> jax.Array:
    return jax.random.randint(jax.random.key(3), (batch, length), 0, 256, dtype=jnp.int32)


def test_eight_devices_are_simulated():
    assert jax.device_count() == 8


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("layout", ["tensor_parallel", "fsdp_tp"])
@pytest.mark.parametrize("shape", MESHES, ids=[f"{a}x{b}" for a, b in MESHES])
def test_sharded_forward_equals_unsharded(config, layout, shape):
    token_ids = _token_ids()
    reference = _forward(create_model(config, seed=5), token_ids)
    mesh = make_mesh(shape)
    sharded_model = create_model(config, seed=5, mesh=mesh, layout=layout)
    sharded = _forward(sharded_model, token_ids, mesh, layout)
    error = np.abs(sharded - reference).max() / np.abs(reference).max()
    assert error < 1e-5, error


def _expected_tensor_parallel_spec(path: str, is_moe: bool) -> P:
    name = path.split(".")[-1] if not path.endswith("weight") else path.split(".")[-2]
    table = {
        "embed": P("model", None),
        "final_norm": P(None),
        "input_norm": P(None),
        "post_attention_norm": P(None),
        "q_proj": P(None, "model", None),
        "k_proj": P(None, "model", None),
        "v_proj": P(None, "model", None),
        "o_proj": P("model", None, None),
        "q_bias": P("model", None),
        "k_bias": P("model", None),
        "v_bias": P("model", None),
        "lm_head": P(None, "model"),
        "router": P(None, None),
    }
    if ".mlp." in path and name in ("gate_proj", "up_proj", "down_proj"):
        # MoE expert stacks lead with the expert axis, replicated on a 2-axis mesh.
        if name == "down_proj":
            return P(None, "model", None) if is_moe else P("model", None)
        return P(None, None, "model") if is_moe else P(None, "model")
    return table[name]


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_tensor_parallel_partition_spec_of_every_parameter(config):
    model = create_model(config, mesh=make_mesh((2, 4)), layout="tensor_parallel")
    specs = describe(nnx.state(model))
    expected_count = 3 + config.num_layers * (
        2 + 4 + (3 if config.attention_bias else 0) + (4 if config.is_moe else 3))
    assert len(specs) == expected_count
    for path, spec in specs.items():
        expected = _expected_tensor_parallel_spec(path, config.is_moe)
        # Compare as tuples padded with None: trailing Nones mean the same split.
        width = max(len(spec), len(expected))
        padded = [tuple(s) + (None,) * (width - len(s)) for s in (spec, expected)]
        assert padded[0] == padded[1], (path, spec, expected)


def test_expert_axis_shards_experts_when_the_mesh_has_one():
    mesh = make_mesh((2, 2, 2))  # ('data', 'expert', 'model')
    model = create_model(MOE, mesh=mesh, layout="tensor_parallel")
    specs = describe(nnx.state(model))
    assert tuple(specs["layers.0.mlp.gate_proj"]) == ("expert", None, "model")
    assert tuple(specs["layers.0.mlp.down_proj"]) == ("expert", "model", None)
    token_ids = _token_ids()
    reference = _forward(create_model(MOE), token_ids)
    sharded = _forward(model, token_ids, mesh)
    assert np.abs(sharded - reference).max() / np.abs(reference).max() < 1e-5


def test_indivisible_parameter_is_named():
    config = DENSE.replace(num_kv_heads=2)
    with pytest.raises(ShardingError, match=r"parameter layers\.0\.attention\.[kv]_.*'kv_heads', "
                       r"size 2\) does not divide over mesh axis 'model' of size 8"):
        create_model(config, mesh=make_mesh((1, 8)))


def test_mesh_larger_than_devices_is_rejected():
    with pytest.raises(ShardingError, match="needs 16 devices, but only 8"):
        make_mesh((2, 8))


def test_logical_to_spec_rules():
    rules = (("a", "model"), ("b", "model"), ("c", "expert"), ("d", None))
    assert logical_to_spec(("a", "b", "d", None), rules) == P("model", None, None, None)
    assert logical_to_spec(("c", "a"), rules, ("data", "model")) == P(None, "model")


def test_constrain_is_identity_without_mesh_and_pins_with_one():
    x = jnp.ones((8, 4, 16))
    assert constrain(x, ("batch", "length", "act_embed")) is x
    mesh = make_mesh((2, 4))

    @jax.jit
    def pinned(x):
        return constrain(x * 2, ("batch", None, "act_mlp"))

    with activate(mesh, "tensor_parallel"):
        out = pinned(x)
    assert out.sharding.spec == P("data", None, "model")
    with activate(mesh, "tensor_parallel"):  # 3 rows do not divide over 2 data shards
        odd = jax.jit(lambda y: constrain(y, ("batch", None, None)))(jnp.ones((3, 2, 2)))
    assert np.asarray(odd).shape == (3, 2, 2)
