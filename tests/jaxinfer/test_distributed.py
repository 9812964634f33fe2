"""jaxinfer.distributed: the multi-host settings, and two local processes (4 CPU devices each)
joined by jax.distributed computing on one 8-device global mesh."""

from __future__ import annotations

import argparse
import json
import subprocess

import numpy as np
import pytest

from jaxinfer.distributed import (
    DistributedConfig,
    add_arguments,
    config_from_args,
    initialize,
)
from jaxinfer.models import create_model
from jaxinfer.sharding import make_mesh
from tests.jaxinfer import multihost_worker
from tests.jaxinfer.multihost_worker import SEED, TINY, greedy_tokens


@pytest.mark.parametrize("given", [
    {"coordinator_address": "10.0.0.1:1234"},
    {"num_processes": 2, "process_id": 0},
    {"coordinator_address": "10.0.0.1:1234", "num_processes": 2},
])
def test_explicit_settings_are_all_or_nothing(given):
    with pytest.raises(ValueError, match="all-or-nothing"):
        DistributedConfig(**given)


@pytest.mark.parametrize(("num_processes", "process_id", "match"), [
    (0, 0, "num_processes = 0"), (2, 2, "process_id = 2"), (2, -1, "process_id = -1")])
def test_ranks_are_checked(num_processes, process_id, match):
    with pytest.raises(ValueError, match=match):
        DistributedConfig(coordinator_address="h:1", num_processes=num_processes,
                          process_id=process_id)


def test_enabled_only_with_settings_or_auto_detection():
    assert not DistributedConfig().enabled
    assert DistributedConfig(auto_detect=True).enabled
    assert DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1).enabled


def test_flags_make_the_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(
        ["--coordinator-address", "10.0.0.1:9876", "--num-processes", "4", "--process-id", "3",
         "--heartbeat-timeout", "7"]))
    assert config == DistributedConfig(coordinator_address="10.0.0.1:9876", num_processes=4,
                                       process_id=3, heartbeat_timeout_seconds=7)
    assert config_from_args(parser.parse_args([])) == DistributedConfig()
    assert config_from_args(parser.parse_args(["--distributed"])).auto_detect


def test_initialize_without_settings_does_nothing():
    assert initialize(DistributedConfig()) is False


def test_two_processes_compute_on_eight_global_devices(tmp_path):
    processes = multihost_worker.start("compute", tmp_path)
    try:
        codes = [process.wait(timeout=120) for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        raise
    errors = [(tmp_path / f"{i}.err").read_text()[-3000:] for i in range(2)]
    assert codes == [0, 0], errors
    results = [json.loads((tmp_path / f"{i}.out").read_text().splitlines()[-1])
               for i in range(2)]
    leader, follower = results
    for index, result in enumerate(results):
        assert (result["devices"], result["local_devices"], result["processes"],
                result["index"]) == (8, 4, 2, index)
        for mesh in ("2x4", "1x8"):
            assert result[f"matmul_{mesh}_error"] < 1e-4
            assert result[f"local_data_sum_{mesh}"] == 4 * 1 + 4 * 2
    # The follower got exactly what the leader sent, message by message, shapes changing.
    assert follower["received"] == leader["received"]
    assert [message["kind"] for message in leader["received"]] == [
        "step", "prompt_step", "step", "prompt_step"]
    assert [message["count"] for message in leader["received"]] == [3, 50, 7, 1000]
    for message in leader["received"]:
        assert message["batch_type"] == "PagedBatch"
        np.testing.assert_allclose(message["projected"], message["expected"], rtol=1e-4,
                                   atol=1e-4)
    # The tiny model's greedy tokens across two processes are one process's tokens.
    single_tokens, single_logits = greedy_tokens(create_model(TINY, seed=SEED), None, None)
    mesh = make_mesh((1, 8))
    sharded_tokens, sharded_logits = greedy_tokens(create_model(TINY, seed=SEED, mesh=mesh),
                                                   mesh, None)
    assert leader["greedy"] == follower["greedy"] == single_tokens == sharded_tokens
    np.testing.assert_allclose(leader["greedy_logits"], sharded_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(leader["greedy_logits"], single_logits, rtol=1e-4, atol=1e-4)
