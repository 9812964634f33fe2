"""Recovery distillation of pruned students: a Wanda-pruned (2:4 or 50%) student distilled from
its dense teacher keeps every pruned entry exactly zero while its live weights learn and the KD
loss falls (also across a resume, and under Muon's dense updates); without `keep_sparsity` the
pruned entries revive; a structurally pruned student trains as a smaller dense model and
exports a checkpoint that loads with its smaller config."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from checkpoints import save_hf_checkpoint
from jaxinfer.config import get_preset
from jaxinfer.generate import generate
from jaxinfer.model_loading import load_model
from jaxinfer.prune import PruningConfig, prune_model
from jaxinfer.prune.structured import structured_prune
from jaxinfer.quant import linear_sites
from tests.jaxinfer.prune.texts import CALIBRATION
from train_distill.config import (
    DataConfig,
    DistillConfig,
    OptimizerConfig,
    RunConfig,
    TrainConfig,
    load_train_config,
)
from train_distill.sparsity import is_prunable
from train_distill.train import run
from train_distill.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SEQUENCE_LENGTH = 32
BATCH_SIZE = 8  # = the number of training windows: every step sees the same fixed batch


@pytest.fixture(scope="module")
def data_directory(tmp_path_factory):
    """Character-level tokens of English text (byte + 3, inside the tiny preset's 512): one
    batch of training windows and one of validation windows."""
    out = tmp_path_factory.mktemp("recovery_data")
    stream = np.frombuffer(CALIBRATION.encode(), np.uint8).astype(np.int32) + 3
    size = BATCH_SIZE * SEQUENCE_LENGTH + 1
    assert stream.size >= 2 * size
    (out / "tokens").mkdir()
    np.save(out / "tokens" / "train.npy", stream[:size])
    np.save(out / "tokens" / "validation.npy", stream[size:2 * size])
    return out


def _config(data_directory, out, *, steps: int, learning_rate: float, distill: DistillConfig,
            model=None, export_hf: bool = False) -> TrainConfig:
    data = DataConfig(tokens=str(data_directory / "tokens"),
                      tokenizer=str(data_directory / "tokenizer"),
                      sequence_length=SEQUENCE_LENGTH, batch_size=BATCH_SIZE, seed=0)
    return TrainConfig(
        model=model or get_preset("tiny"), data=data, distill=distill,
        optimizer=OptimizerConfig(learning_rate=learning_rate, warmup_steps=1,
                                  min_learning_rate_ratio=1.0),
        run=RunConfig(out=str(out), total_steps=steps, checkpoint_every=0, eval_every=0,
                      log_every=100, export_hf=export_hf, progress=False))


@pytest.fixture(scope="module")
def teacher_directory(data_directory, tmp_path_factory):
    """A tiny model trained on the batch until its predictions are far from uniform."""
    out = tmp_path_factory.mktemp("recovery_teacher")
    summary = run(_config(data_directory, out, steps=30, learning_rate=1e-2,
                          distill=DistillConfig(), export_hf=True))
    return summary["hf_directory"]


def _calibration_windows(data_directory) -> np.ndarray:
    return np.load(data_directory / "tokens" / "train.npy")[:-1].reshape(
        BATCH_SIZE, SEQUENCE_LENGTH)  # [B, T]


@pytest.fixture(scope="module", params=["2:4", "50%"])
def pruned_student(request, data_directory, teacher_directory, tmp_path_factory):
    """(target, directory) of the teacher Wanda-pruned to 2:4 or to 50% unstructured."""
    target = request.param
    config = (PruningConfig.for_method("wanda", pattern=(2, 4)) if target == "2:4"
              else PruningConfig.for_method("wanda", sparsity=0.5))
    pruned = prune_model(load_model(teacher_directory), config,
                         _calibration_windows(data_directory), progress=False)
    out = tmp_path_factory.mktemp("recovery_student")
    return target, save_hf_checkpoint(pruned, out)


def _block_linears(model) -> dict[str, np.ndarray]:
    """Every pruned-by-`jaxinfer prune` weight as `[I, O]`, by path."""
    return {site.path: np.asarray(site.float_matrix()) for site in linear_sites(model)
            if site.path != "lm_head"}


def _distill(student_directory, teacher_directory, **options) -> DistillConfig:
    # Pure KD (no CE term), so the logged loss is the divergence from the teacher.
    return DistillConfig(teacher=str(teacher_directory), kind="forward_kl", ce_weight=0.0,
                         student_checkpoint=str(student_directory), **options)


def test_pruned_entries_stay_zero_while_the_rest_recovers(data_directory, teacher_directory,
                                                          pruned_student, tmp_path):
    target, student_directory = pruned_student
    before = _block_linears(load_model(student_directory))
    config = _config(data_directory, tmp_path, steps=8, learning_rate=1e-3,
                     model=load_model(student_directory).config,
                     distill=_distill(student_directory, teacher_directory))
    config = dataclasses.replace(config, run=dataclasses.replace(config.run,
                                                                 checkpoint_every=4))
    trainer = Trainer(config, log=lambda line: None)
    # Every block linear is masked; norms, embeddings and the LM head never are.
    assert len(trainer.masks) == len(before)
    flat = jax.tree_util.tree_flatten_with_path(trainer.state.params)[0]
    masked = [path for path, _ in flat if jax.tree_util.keystr(path) in trainer.masks]
    assert all(is_prunable(path) for path in masked)
    history = trainer.train(steps=4)
    trainer.close()
    # A resumed run takes its masks from the student checkpoint again, not from the trained
    # weights, and goes on holding them.
    trainer = Trainer(config, log=lambda line: None)
    assert trainer.state.step == 4
    assert set(trainer.masks) == {jax.tree_util.keystr(path) for path in masked}
    history += trainer.train()
    after = _block_linears(trainer.model())
    trainer.close()

    for path, initial in before.items():
        final = after[path]
        pruned = initial == 0
        assert pruned.mean() >= 0.5, path  # Wanda zeroed half of each output's inputs
        assert np.all(final[pruned] == 0.0), path  # exactly zero, not merely small
        assert np.mean(final[~pruned] != initial[~pruned]) > 0.9, path  # the rest learned
        if target == "2:4":
            groups = final.reshape(-1, 4, final.shape[1])  # [I / 4, 4, O]
            assert np.all(np.sum(groups == 0, axis=1) >= 2), path
    losses = [record["divergence"] for record in history]
    assert losses[0] > 0 and losses[-1] < 0.9 * losses[0], losses


def test_without_keep_sparsity_pruned_entries_revive(data_directory, teacher_directory,
                                                     pruned_student, tmp_path):
    _, student_directory = pruned_student
    before = _block_linears(load_model(student_directory))
    config = _config(data_directory, tmp_path, steps=3, learning_rate=1e-3,
                     model=load_model(student_directory).config,
                     distill=_distill(student_directory, teacher_directory,
                                      keep_sparsity=False))
    trainer = Trainer(config, log=lambda line: None)
    assert trainer.masks == {}
    trainer.train()
    after = _block_linears(trainer.model())
    trainer.close()
    for path, initial in before.items():
        revived = after[path][initial == 0] != 0
        assert revived.mean() > 0.5, path


def test_muon_updates_cannot_revive_pruned_entries(data_directory, teacher_directory,
                                                    pruned_student, tmp_path):
    # Muon orthogonalizes the whole masked gradient matrix into a dense update, so only the
    # re-masking after the update keeps the pruned entries at zero.
    _, student_directory = pruned_student
    before = _block_linears(load_model(student_directory))
    config = dataclasses.replace(
        _config(data_directory, tmp_path, steps=2, learning_rate=1e-3,
                model=load_model(student_directory).config,
                distill=_distill(student_directory, teacher_directory)),
        optimizer=OptimizerConfig(name="osp", learning_rate=1e-3, warmup_steps=1))
    trainer = Trainer(config, log=lambda line: None)
    trainer.train()
    after = _block_linears(trainer.model())
    trainer.close()
    for path, initial in before.items():
        assert np.all(after[path][initial == 0] == 0.0), path
        assert np.mean(after[path][initial != 0] != initial[initial != 0]) > 0.9, path


def test_structurally_pruned_student_trains_and_exports_its_smaller_config(
        data_directory, teacher_directory, tmp_path):
    teacher = load_model(teacher_directory)
    smaller = structured_prune(teacher, "heads=0.5,mlp=0.5", _calibration_windows(data_directory))
    student_directory = save_hf_checkpoint(smaller, tmp_path / "student")
    assert smaller.config.intermediate_size == teacher.config.intermediate_size // 2

    # From a run file: the student's config comes from its checkpoint, so there is no [model].
    path = tmp_path / "recover.toml"
    path.write_text(f"""
[data]
tokens = "{data_directory / 'tokens'}"
tokenizer = "{data_directory / 'tokenizer'}"
sequence_length = {SEQUENCE_LENGTH}
batch_size = {BATCH_SIZE}
[optimizer]
learning_rate = 1e-3
warmup_steps = 1
min_learning_rate_ratio = 1.0
[run]
out = "{tmp_path / 'run'}"
total_steps = 8
checkpoint_every = 0
eval_every = 0
log_every = 100
progress = false
[distill]
teacher = "{teacher_directory}"
student_checkpoint = "{student_directory}"
ce_weight = 0.0
""")
    config = load_train_config(path)
    assert config.model == smaller.config
    summary = run(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["divergence"] < 0.9 * records[0]["divergence"]

    exported = load_model(summary["hf_directory"])
    assert exported.config == smaller.config
    assert exported.config.num_heads < teacher.config.num_heads
    # Training changed the weights, and the exported model runs.
    assert not np.array_equal(np.asarray(_block_linears(exported)["layers.0.mlp.up_proj"]),
                              np.asarray(_block_linears(smaller)["layers.0.mlp.up_proj"]))
    [tokens] = generate(exported, [[1, 50, 60]], max_new_tokens=4, eos_token_ids=())
    assert len(tokens) == 4

    path.write_text(path.read_text() + '\n[model]\npreset = "tiny"\n')
    with pytest.raises(ValueError, match="leave \\[model\\] out"):
        load_train_config(path)


def test_shipped_recovery_config_takes_the_students_config():
    # The file names a `jaxinfer prune` output; any checkpoint stands in for it here.
    config = load_train_config(ROOT / "train_distill" / "configs" / "demo_recover.toml",
                               ["distill.student_checkpoint=builtin:demo-draft"])
    assert config.model == load_model("builtin:demo-draft").config
    assert config.distill.keep_sparsity and config.distill.teacher == "builtin:demo"
