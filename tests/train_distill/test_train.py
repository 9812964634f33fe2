"""The command line: multi-host flags parse into jax.distributed settings, partial ones fail."""

from __future__ import annotations

from jaxinfer.distributed import DistributedConfig, config_from_args
from train_distill.train import build_parser, main


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
