"""The command line: multi-host flags parse into jax.distributed settings, partial ones fail;
two processes joined through them train like one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.distributed import DistributedConfig, config_from_args
from jaxinfer.model_loading import load_model
from train_distill.config import load_train_config
from train_distill.prepare import prepare
from train_distill.train import build_parser, main
from train_distill.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def test_multi_host_flags_parse_beside_config_and_overrides():
    args = build_parser().parse_args([
        "--config", "run.toml", "--coordinator-address", "10.0.0.1:1234", "--num-processes",
        "2", "--process-id", "1", "--heartbeat-timeout", "60", "run.total_steps=3",
        "mesh.model=2"])
    assert args.config == "run.toml"
    assert args.overrides == ["run.total_steps=3", "mesh.model=2"]
    config = config_from_args(args)
    assert config == DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2,
                                       process_id=1, heartbeat_timeout_seconds=60)
    assert config.enabled
    assert not config_from_args(build_parser().parse_args(["--config", "run.toml"])).enabled
    assert config_from_args(build_parser().parse_args(
        ["--config", "run.toml", "--distributed"])).auto_detect


def test_partial_multi_host_settings_are_a_usage_error(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\n[run]\ntotal_steps = 1\n')
    # A rank without the coordinator: refused before any device or file is touched.
    assert main(["--config", str(path), "--num-processes", "2", "--process-id", "0",
                 f"run.out={tmp_path / 'out'}"]) == 2
    assert "all-or-nothing" in capsys.readouterr().err
    assert main(["--config", str(path), "--coordinator-address", "localhost:1234",
                 "--num-processes", "2", "--process-id", "2"]) == 2
    assert "process_id = 2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    """Two processes of 4 CPU devices each run one (2, 4) mesh: the losses of one process."""
    prepare(tmp_path / "data", sources=["stdlib"], vocab_size=512, max_documents=40,
            validation_percent=15.0)
    path = tmp_path / "run.toml"
    path.write_text(f"""
[model]
preset = "tiny"
num_kv_heads = 4
[data]
tokens = "{tmp_path / 'data' / 'tokens'}"
tokenizer = "{tmp_path / 'data' / 'tokenizer'}"
sequence_length = 32
batch_size = 8
[optimizer]
learning_rate = 3e-3
warmup_steps = 2
[run]
total_steps = 3
checkpoint_every = 2
eval_every = 0
log_every = 1
export_hf = true
[mesh]
data = 2
model = 4
""")
    reference = Trainer(load_train_config(path, [f"run.out={tmp_path / 'one'}"]),
                        log=lambda line: None)
    expected = [record["loss"] for record in reference.train()]
    reference.close()

    port = _free_port()
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "train_distill.train", "--config", str(path),
         f"run.out={tmp_path / 'two'}", "--coordinator-address", f"localhost:{port}",
         "--num-processes", "2", "--process-id", str(rank)],
        cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)]
    outputs = [process.communicate(timeout=240)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    # Process 0 alone logs and writes the run's files; both wrote their checkpoint shards.
    assert "step 3/3" in outputs[0] and "step 3/3" not in outputs[1]
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").open()]
    np.testing.assert_allclose([record["loss"] for record in records], expected, rtol=1e-5)
    assert sorted(path.name for path in (tmp_path / "two" / "checkpoints").iterdir()) == [
        "2", "3"]
    assert load_model(tmp_path / "two" / "hf").config.num_kv_heads == 4
