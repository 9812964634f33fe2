"""The trainer: resumes bit-for-bit, runs every optimizer and loss, exports a loadable model."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxinfer.config import get_preset
from jaxinfer.generate import generate
from jaxinfer.model_loading import load_model
from jaxinfer.sharding import ShardingError
from train_distill.config import (
    DataConfig,
    DistillConfig,
    MeshConfig,
    OptimizerConfig,
    RunConfig,
    TrainConfig,
    load_train_config,
)
from train_distill.prepare import prepare
from train_distill.train import run
from train_distill.trainer import Trainer, mesh_shape, training_rules


@pytest.fixture(scope="module")
def data_directory(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    prepare(out, sources=["stdlib"], vocab_size=512, max_documents=40,
            validation_percent=15.0)
    return out


def _config(data_directory, out, **sections) -> TrainConfig:
    data = DataConfig(tokens=str(data_directory / "tokens"),
                      tokenizer=str(data_directory / "tokenizer"), sequence_length=32,
                      batch_size=8, seed=0)
    run_config = RunConfig(out=str(out), total_steps=10, checkpoint_every=5, eval_every=5,
                           eval_batches=2, log_every=5, export_hf=False)
    defaults = dict(model=get_preset("tiny"), data=data, run=run_config,
                    optimizer=OptimizerConfig(learning_rate=3e-3, warmup_steps=2))
    return TrainConfig(**{**defaults, **sections})


def _quiet(config: TrainConfig) -> Trainer:
    return Trainer(config, log=lambda line: None)


@pytest.mark.parametrize("optimizer", ["adamw", "osp"])
def test_resumed_run_reproduces_the_uninterrupted_losses(data_directory, tmp_path, optimizer):
    sections = {"optimizer": OptimizerConfig(name=optimizer, learning_rate=3e-3,
                                             warmup_steps=2)}
    if optimizer == "osp":
        sections["model"] = get_preset("tiny").replace(norm_type="single_scale",
                                                       embedding_projection=True)
    straight = _quiet(_config(data_directory, tmp_path / "straight", **sections))
    full = [record["loss"] for record in straight.train()]
    straight.close()

    first = _quiet(_config(data_directory, tmp_path / "resumed", **sections))
    first.train(steps=5)
    first.close()
    second = _quiet(_config(data_directory, tmp_path / "resumed", **sections))
    assert second.state.step == 5
    rest = [record["loss"] for record in second.train()]
    second.close()
    np.testing.assert_allclose(rest, full[5:], rtol=0, atol=1e-6)
    assert full[-1] < full[0]


@pytest.mark.parametrize("optimizer", ["adamw", "osp"])
def test_each_optimizer_lowers_the_loss(data_directory, tmp_path, optimizer):
    model = get_preset("tiny")
    if optimizer == "osp":  # full OSP: Muon + AdamW, Single-Scale RMSNorm, EmbProj
        model = model.replace(norm_type="single_scale", embedding_projection=True)
    trainer = _quiet(_config(data_directory, tmp_path, model=model,
                             optimizer=OptimizerConfig(name=optimizer, learning_rate=3e-3,
                                                       warmup_steps=2)))
    history = trainer.train()
    trainer.close()
    assert history[-1]["loss"] < history[0]["loss"]
    assert np.isfinite(history[-1]["validation_ppl"])


@pytest.fixture(scope="module")
def teacher_directory(data_directory, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher")
    config = _config(data_directory, out, run=RunConfig(
        out=str(out), total_steps=8, checkpoint_every=0, eval_every=0, log_every=100,
        export_hf=True, progress=False))
    summary = run(config)
    return summary["hf_directory"]


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_each_distillation_loss_runs_against_a_teacher(data_directory, teacher_directory,
                                                       tmp_path, kind):
    student = get_preset("tiny").replace(num_layers=1, hidden_size=32, intermediate_size=64)
    short = RunConfig(out=str(tmp_path), total_steps=6, checkpoint_every=0, eval_every=0,
                      log_every=100, export_hf=False)
    trainer = _quiet(_config(data_directory, tmp_path, model=student, run=short,
                             distill=DistillConfig(teacher=teacher_directory, kind=kind,
                                                   temperature=2.0, ce_weight=0.3)))
    history = trainer.train()
    trainer.close()
    assert history[-1]["loss"] < history[0]["loss"]


def test_osp_run_exports_a_folded_plain_llama(data_directory, tmp_path):
    model = get_preset("tiny").replace(norm_type="single_scale", embedding_projection=True)
    config = _config(data_directory, tmp_path, model=model,
                     optimizer=OptimizerConfig(name="osp", learning_rate=3e-3, warmup_steps=2),
                     run=RunConfig(out=str(tmp_path), total_steps=3, checkpoint_every=0,
                                   eval_every=0, log_every=100, export_hf=True))
    summary = run(config)
    exported = load_model(summary["hf_directory"])
    assert not exported.config.uses_osp_parts
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "llama" and not hf_config["tie_word_embeddings"]


def test_exported_model_generates(teacher_directory):
    model = load_model(teacher_directory)
    [tokens] = generate(model, [[1, 50, 60]], max_new_tokens=5, eos_token_ids=())
    assert len(tokens) == 5


def test_config_file_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\nnum_layers = 1\n[optimizer]\nname = "adamw"\n'
                    '[run]\ntotal_steps = 3\n')
    config = load_train_config(path, ["optimizer.learning_rate=1e-4", "run.out=somewhere",
                                      "data.batch_size=4"])
    assert config.model.num_layers == 1 and config.optimizer.learning_rate == 1e-4
    assert config.run.out == "somewhere" and config.data.batch_size == 4
    assert json.dumps(config.to_dict())
    with pytest.raises(ValueError, match=r"\[run\] has no field 'steps'"):
        load_train_config(path, ["run.steps=3"])
    with pytest.raises(ValueError, match=r"expected section\.key=value"):
        load_train_config(path, ["learning_rate=3"])


def _q_proj(state) -> jax.Array:
    return state["layers"][0]["attention"]["q_proj"].get_value()


def test_checkpoint_from_one_mesh_resumes_on_another(data_directory, tmp_path):
    # Four kv heads so that every head axis divides over 4 'model' shards.
    model = get_preset("tiny").replace(num_kv_heads=4)
    run_config = RunConfig(out=str(tmp_path), total_steps=20, checkpoint_every=0,
                           eval_every=0, log_every=100, export_hf=False)

    def trainer(data: int, model_size: int) -> Trainer:
        return _quiet(_config(data_directory, tmp_path, model=model, run=run_config,
                              mesh=MeshConfig(data=data, model=model_size)))

    first = trainer(2, 4)
    # FSDP+TP on (2, 4): the q projection [D, N, H] splits D over 'data', N over 'model'.
    q_proj = _q_proj(first.state.params)
    assert dict(q_proj.sharding.mesh.shape) == {"data": 2, "model": 4}
    assert q_proj.sharding.spec == PartitionSpec("data", "model", None)
    assert q_proj.addressable_shards[0].data.shape == (32, 1, 16)
    # Adam's first moment of q_proj is split like q_proj; its step count is replicated.
    adam = first.state.opt_state[1][0]
    assert _q_proj(adam.mu).sharding.spec == PartitionSpec("data", "model", None)
    assert adam.count.sharding.spec == PartitionSpec()
    first.train(steps=3)
    first.save()
    expected = [record["loss"] for record in first.train(steps=3)]  # steps 4-6, not saved
    assert _q_proj(first.state.params).sharding.spec == PartitionSpec("data", "model", None)
    # The step's outputs keep the inputs' placement, so six steps compiled it once.
    assert first._train_step._cache_size() == 1
    first.close()

    second = trainer(8, 1)
    assert second.state.step == 3
    q_proj = _q_proj(second.state.params)
    assert dict(q_proj.sharding.mesh.shape) == {"data": 8, "model": 1}
    # Same spec (the 'model' axis has size 1 now), so each device holds all four heads.
    assert q_proj.sharding.spec == PartitionSpec("data", "model", None)
    assert q_proj.addressable_shards[0].data.shape == (8, 4, 16)
    assert _q_proj(second.state.opt_state[1][0].nu).addressable_shards[0].data.shape == (
        8, 4, 16)
    resumed = [record["loss"] for record in second.train(steps=3)]
    second.close()
    np.testing.assert_allclose(resumed, expected, rtol=1e-5)


def test_mesh_config_defaults_and_errors(data_directory, tmp_path):
    assert mesh_shape(MeshConfig(), 8) == (8, 1)
    assert mesh_shape(MeshConfig(model=2), 8) == (4, 2)
    assert mesh_shape(MeshConfig(data=2, model=2), 8) == (2, 2)
    with pytest.raises(ValueError, match="model = 3 does not divide the 8 devices"):
        mesh_shape(MeshConfig(model=3), 8)
    with pytest.raises(ValueError, match="need data >= 0"):
        MeshConfig(model=0)
    # tiny has 2 kv heads: 4 'model' shards cannot split them, and the error names the weight.
    with pytest.raises(ShardingError, match="k_proj"):
        _quiet(_config(data_directory, tmp_path, mesh=MeshConfig(data=2, model=4)))
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\n[mesh]\nmodel = 2\nlayout = "replicated"\n')
    config = load_train_config(path)
    assert config.mesh == MeshConfig(data=0, model=2, layout="replicated")
    with pytest.raises(ValueError, match=r"moved to \[mesh\] data"):
        load_train_config(path, ["run.data_parallel=4"])


def test_replicated_layout_still_splits_the_batch():
    rules = dict(training_rules("replicated"))
    assert rules["batch"] == "data" and rules["embed"] is None and rules["q_heads"] is None
    assert dict(training_rules("fsdp_tp"))["embed"] == "data"
