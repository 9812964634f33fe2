"""Orbax round trips restore identical parameters, onto the same or another mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from checkpoints import restore_model, save_model
from checkpoints.orbax_io import read_config
from jaxinfer.config import get_preset
from jaxinfer.models import create_model
from jaxinfer.sharding import describe, make_mesh

CONFIG = get_preset("tiny").replace(num_heads=8, num_kv_heads=8, head_dim=8,
                                    param_dtype="bfloat16")


def _host_parameters(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(jax.device_get(variable.get_value()))
            for path, variable in nnx.to_flat_state(nnx.state(model))}


def _assert_identical(first, second) -> None:
    a, b = _host_parameters(first), _host_parameters(second)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_roundtrip_single_device(tmp_path):
    model = create_model(CONFIG, seed=11)
    save_model(model, tmp_path / "ckpt")
    assert read_config(tmp_path / "ckpt") == CONFIG
    restored = restore_model(tmp_path / "ckpt")
    _assert_identical(model, restored)


@pytest.mark.parametrize(("saved_shape", "restored_shape"), [((2, 4), (2, 4)), ((2, 4), (8, 1)),
                                                             ((1, 8), (4, 2))])
def test_roundtrip_onto_another_mesh(tmp_path, saved_shape, restored_shape):
    model = create_model(CONFIG, seed=12, mesh=make_mesh(saved_shape))
    save_model(model, tmp_path / "ckpt")
    target_mesh = make_mesh(restored_shape)
    restored = restore_model(tmp_path / "ckpt", mesh=target_mesh)
    _assert_identical(model, restored)
    for path, variable in nnx.to_flat_state(nnx.state(restored)):
        assert variable.get_value().sharding.mesh.shape == target_mesh.shape, path
    assert describe(nnx.state(restored))["layers.0.attention.q_proj"] == jax.sharding.PartitionSpec(
        None, "model", None)


def test_restore_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a jaxinfer checkpoint"):
        restore_model(tmp_path)
