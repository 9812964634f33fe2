"""The ahead-of-time serving step on the CPU: an abstract runner lowers the very program the
real runner runs, the per-chip byte counts follow the shardings and the memory plan, and the
collectives counter finds a tensor-parallel layer's two all-reduces.

The TPU compiles themselves are in `test_aot_tpu.py` (`make tpu-check`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer import memory_plan
from jaxinfer.config import get_preset
from jaxinfer.engine import aot
from jaxinfer.engine.device.runner import ModelRunner, RunnerConfig
from jaxinfer.engine.device.step_io import STEP
from jaxinfer.models import create_model
from jaxinfer.sharding import make_mesh

SIZES = dict(num_pages=16, page_size=4, max_num_batched_tokens=16, max_num_seqs=4,
             max_model_len=32, enable_prompt_logprobs=False)


@pytest.mark.parametrize("devices", [1, 2], ids=["one-device", "tp2"])
def test_an_abstract_runner_lowers_the_real_runners_program(devices):
    config = get_preset("tiny")
    mesh = None if devices == 1 else make_mesh({"model": devices},
                                               devices=jax.devices()[:devices])
    real = ModelRunner(create_model(config, seed=0, mesh=mesh), RunnerConfig(**SIZES),
                       mesh=mesh)
    abstract = ModelRunner(aot.abstract_serving_model(config), RunnerConfig(**SIZES),
                           mesh=mesh, abstract=True)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct)
               for leaf in jax.tree.leaves((abstract.state, abstract.pages)))
    assert real.lower(STEP, 16).as_text() == abstract.lower(STEP, 16).as_text()
    # What one device holds is what the real arrays put on it.
    on_device = sum(shard.data.nbytes for leaf in jax.tree.leaves(real.state)
                    for shard in leaf.addressable_shards if shard.device == jax.devices()[0])
    assert aot.abstract_bytes_per_chip(abstract.state) == on_device


def test_lower_takes_only_the_runners_buckets():
    abstract = ModelRunner(aot.abstract_serving_model(get_preset("tiny")),
                           RunnerConfig(**SIZES), abstract=True)
    with pytest.raises(ValueError, match="not a token bucket"):
        abstract.lower(STEP, 12)
    with pytest.raises(ValueError, match="unknown step kind"):
        abstract.lower("nope", 16)


def test_collectives_per_tensor_parallel_layer_on_cpu():
    mesh = make_mesh({"model": 2}, devices=jax.devices()[:2])

    def collectives(layers: int, scan_layers: bool) -> dict[str, int]:
        config = get_preset("tiny").replace(num_layers=layers)
        runner = ModelRunner(aot.abstract_serving_model(config), RunnerConfig(**SIZES),
                             mesh=mesh, abstract=True, scan_layers=scan_layers)
        return aot.count_collectives(runner.lower(STEP, 16).compile().as_text())

    one, two = collectives(1, False), collectives(2, False)
    per_layer = {op: two[op] - one[op] for op in aot.COLLECTIVES}
    # Attention's output projection and the MLP's down projection each end in one.
    assert per_layer == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0,
                         "all-to-all": 0, "collective-permute": 0}
    # Scanned, the program holds the block once at any depth: one layer's collectives.
    assert collectives(3, True) == one


def test_count_collectives_reads_sync_and_async_ops():
    hlo = "\n".join([
        "  %all-reduce.1 = f32[8]{0} all-reduce(f32[8]{0} %x), to_apply=%add",
        "  %ars = (f32[8]{0}, f32[8]{0}) all-reduce-start(f32[8]{0} %y), to_apply=%add",
        "  %ard = f32[8]{0} all-reduce-done((f32[8]{0}, f32[8]{0}) %ars)",
        "  %ag = bf16[4,8]{1,0} all-gather(bf16[1,8]{1,0} %z), dimensions={0}",
        "  %fusion = f32[8]{0} fusion(f32[8]{0} %ard), calls=%all-reduce-like",
    ])
    assert aot.count_collectives(hlo) == {"all-reduce": 2, "all-gather": 1,
                                          "reduce-scatter": 0, "all-to-all": 0,
                                          "collective-permute": 0}


@pytest.mark.parametrize("preset, tp, weights", [
    ("llama-3-8b", 8, "bf16"), ("llama-3-8b", 4, "int8"), ("llama-2-70b", 8, "int8"),
    ("mixtral-8x7b", 4, "bf16"), ("mixtral-8x7b", 4, "int8")])
def test_abstract_weights_per_chip_match_the_memory_plan(preset, tp, weights):
    """Real sizes, abstractly sharded on 8 CPU devices (nothing allocated): the sharded
    parameters' bytes per chip are the plan's W / TP to within 0.5% (norms are counted
    whole by the plan, split by the model's layout where they can be)."""
    config = get_preset(preset)
    mesh = make_mesh({"model": tp}, devices=jax.devices()[:tp])
    runner = ModelRunner(aot.abstract_serving_model(config, weights),
                         RunnerConfig(num_pages=64, page_size=16, max_num_batched_tokens=64,
                                      max_num_seqs=8, max_model_len=1024), mesh=mesh,
                         abstract=True)
    planned = memory_plan.weight_bytes(config, weights) / tp
    assert aot.abstract_bytes_per_chip(runner.state) == pytest.approx(planned, rel=5e-3)
    assert aot.page_bytes(runner) == runner.config.page_size * (
        memory_plan.kv_bytes_per_token(config, "bf16", tp))


def test_roofline_takes_the_slower_of_compute_and_memory():
    chip = aot.CHIPS["v5e"]
    assert aot.roofline_seconds(chip, 197e12, 1.0) == pytest.approx(1.0)
    assert aot.roofline_seconds(chip, 1.0, 819e9) == pytest.approx(1.0)
    assert np.isclose(aot.roofline_seconds(chip, 197e12, 2 * 819e9), 2.0)


def test_the_drafter_runner_of_a_speculative_case():
    speculative = {"method": "draft_model", "model": "random:tiny", "num_tokens": 2}
    case = aot.ServingCase(name="spec", preset="tiny", topology="cpu", tensor_parallel=2,
                           options=dict(SIZES, speculative=speculative))
    target = aot.abstract_runner(case, devices=jax.devices())
    drafter = aot.abstract_drafter_runner(case, devices=jax.devices())
    assert target.config.num_speculative_tokens == 2 and target.config.draft_distributions
    assert drafter.config.return_probabilities and drafter.config.num_speculative_tokens == 0
    assert drafter.config.num_pages == target.config.num_pages
    assert drafter.mesh.size == 1 and target.mesh.size == 2
    assert aot.count_collectives(drafter.lower(STEP, 16).compile().as_text()) == dict.fromkeys(
        aot.COLLECTIVES, 0)
    assert aot.abstract_drafter_runner(case.replace(options=SIZES)) is None
    with pytest.raises(ValueError, match="random:PRESET"):
        aot.abstract_drafter_runner(case.replace(options=dict(
            SIZES, speculative=dict(speculative, model="/some/checkpoint"))),
            devices=jax.devices())
