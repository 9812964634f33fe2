"""One trainer for pre-training and distillation, on the same model code that serves.

The train step is one jitted function over (parameters, optimizer state, batch[, teacher]) on
a ('data', 'model') mesh (`[mesh]` in the run config): the batch `[B, T + 1]` is split over
'data', the parameters follow the chosen layout (by default "fsdp_tp": split along the model
width over 'data' and along heads / MLP / vocabulary over 'model'), and every optimizer buffer
that mirrors a parameter (Adam's moments, Muon's momentum) is split exactly like it. The step
pins its output shardings, so parameters never drift to another placement between steps.

Checkpoints (orbax, every N steps) hold the parameters, the optimizer state and, as JSON, the
step, the loader position and the RNG key, so a resumed run replays exactly the batches and
updates of an uninterrupted one. Arrays are restored straight onto the shardings of the
*current* mesh, so a run saved on one mesh shape resumes on another (same losses up to
reduction order). In a multi-process run (`jax.distributed`) every process runs this same
code on its shard of the global mesh; only process 0 logs and writes the run's JSON files.

The student starts from a random initialization or, with `[distill] student_checkpoint`, from
a saved model such as a `jaxinfer prune` output; the exact zeros of a pruned student's block
linears are then held at zero by every step (`train_distill.sparsity`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.distributed import is_leader
from jaxinfer.model_loading import load_model
from jaxinfer.models import Transformer, create_model
from jaxinfer.models.transformer import abstract_model
from jaxinfer.sharding import LogicalRules, activate, get_layout, make_mesh, parameter_shardings
from train_distill.config import MeshConfig, OptimizerConfig, TrainConfig
from train_distill.data import LoaderState, PackedLoader, pack
from train_distill.losses import cross_entropy, distillation_loss
from train_distill.sparsity import Masks, apply_masks, mask_summary, sparsity_masks


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to the peak, then cosine decay to `min_learning_rate_ratio` of it."""
    warmup = max(1, min(config.warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.learning_rate * config.min_learning_rate_ratio)


def build_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """Gradient clipping followed by AdamW, or by OSP's Muon + AdamW split."""
    schedule = learning_rate_schedule(config, total_steps)
    if config.name == "adamw":
        inner = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                            weight_decay=config.weight_decay)
    elif config.name == "osp":
        from train_distill.muon import osp_optimizer

        inner = osp_optimizer(schedule, weight_decay=config.weight_decay, b1=config.b1,
                              b2=config.b2, eps=config.eps)
    else:
        raise ValueError(f"optimizer.name = {config.name!r}: expected 'adamw' or 'osp'")
    return optax.chain(optax.clip_by_global_norm(config.gradient_clip), inner)


def training_rules(layout: str) -> LogicalRules:
    """The rules of `layout` with the batch split over 'data', whatever the layout says.

    "replicated" maps every activation name to None, which would make `constrain` gather the
    whole batch onto every device (each replica computing every row); training wants each
    data replica to run only its own rows. The parameter rules are the layout's own.
    """
    return tuple((name, "data" if name == "batch" else target)
                 for name, target in get_layout(layout))


def mesh_shape(config: MeshConfig, device_count: int) -> tuple[int, int]:
    """The (data, model) sizes of the mesh `config` asks for on `device_count` devices.

    Raises:
        ValueError: `data = 0` (all devices) but `model` does not divide the device count.
    """
    if config.data:
        return config.data, config.model
    if device_count % config.model:
        raise ValueError(f"[mesh] model = {config.model} does not divide the {device_count} "
                         f"devices; set mesh.data explicitly or pick a model size that does")
    return device_count // config.model, config.model


def _path_key(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(jax.tree_util.keystr((entry,)) for entry in path)


def abstract_optimizer_state(optimizer: optax.GradientTransformation, abstract_params: Any,
                             mesh: Mesh) -> Any:
    """The optimizer state's shapes and dtypes, each leaf carrying the sharding it must have.

    Optimizer states keep their per-parameter buffers (Adam's mu and nu, Muon's momentum) in
    trees shaped like the parameters, nested under their own fields (`...mu['layers'][0]...`,
    also inside `multi_transform`'s masked states). A state leaf whose key path ends with a
    parameter's key path and that has the parameter's shape takes the parameter's sharding,
    so FSDP splits the moments as it splits the weights; every other leaf (step counts) is
    replicated.

    Args:
        optimizer: The optax transformation.
        abstract_params: `jax.ShapeDtypeStruct` leaves with their `sharding` set.
        mesh: The mesh the replicated leaves go on.

    Returns:
        `jax.eval_shape(optimizer.init, ...)` with a `sharding` on every leaf.
    """
    by_path = {_path_key(path): leaf for path, leaf in
               jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        key = _path_key(path)
        sharding = replicated
        for start in range(len(key)):  # the longest suffix that names a parameter
            param = by_path.get(key[start:])
            if param is not None and param.shape == leaf.shape:
                sharding = param.sharding
                break
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(place, jax.eval_shape(optimizer.init,
                                                                  abstract_params))


def _shardings(abstract: Any) -> Any:
    return jax.tree.map(lambda leaf: leaf.sharding, abstract)


def _print_on_leader(line: str) -> None:
    if is_leader():
        print(line, flush=True)


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint holds."""

    step: int
    params: nnx.State
    opt_state: optax.OptState
    loader: LoaderState
    rng: jax.Array


class Trainer:
    """Runs a TrainConfig: init or resume, train, evaluate, checkpoint, export."""

    def __init__(self, config: TrainConfig, *, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.out = Path(config.run.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = log or _print_on_leader
        data_size, model_size = mesh_shape(config.mesh, jax.device_count())
        self.mesh = make_mesh((data_size, model_size))
        self.layout = config.mesh.layout
        self.rules = training_rules(config.mesh.layout)
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data", None))

        tokens = Path(config.data.tokens)
        self.train_windows = pack(np.load(tokens / "train.npy").astype(np.int32),
                                  config.data.sequence_length)  # [W, T + 1]
        self.validation_windows = pack(np.load(tokens / "validation.npy").astype(np.int32),
                                       config.data.sequence_length)  # [Wv, T + 1]
        if config.data.batch_size % data_size:
            raise ValueError(f"data.batch_size = {config.data.batch_size} must divide over "
                             f"{data_size} data-parallel devices")

        # Shapes and shardings first (no memory): a resumed run restores straight onto them
        # and never materializes a throw-away initialization next to the checkpoint.
        self.graphdef, abstract_params = nnx.split(abstract_model(config.model), nnx.Param)
        self.abstract_params = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                        sharding=sharding),
            abstract_params, parameter_shardings(abstract_params, self.mesh, self.rules))
        self.optimizer = build_optimizer(config.optimizer, config.run.total_steps)
        self.abstract_opt_state = abstract_optimizer_state(self.optimizer, self.abstract_params,
                                                           self.mesh)
        self.teacher_graphdef, self.teacher_params = None, None
        if config.distill.teacher:
            # The frozen teacher follows the student's layout, so it is split the same way.
            teacher = load_model(config.distill.teacher, mesh=self.mesh, layout=self.layout)
            if teacher.config.vocab_size != config.model.vocab_size:
                raise ValueError(f"teacher vocab {teacher.config.vocab_size} != student vocab "
                                 f"{config.model.vocab_size}: they must share a tokenizer")
            self.teacher_graphdef, self.teacher_params = nnx.split(teacher, nnx.Param)
        initial_params = self._load_student() if config.distill.student_checkpoint else None
        # Read from the student checkpoint on a resume too: the trained weights' zeros are
        # no record of the mask, the pruned checkpoint's are.
        self.masks: Masks = {}
        if initial_params is not None and config.distill.keep_sparsity:
            self.masks = sparsity_masks(initial_params)
            if self.masks:
                pruned, total = mask_summary(self.masks)
                self.log(f"keeping {pruned} pruned weights at zero ({pruned / total:.1%} of "
                         f"{len(self.masks)} masked linear weights)")
        self.manager = ocp.CheckpointManager(
            (self.out / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        if self.manager.latest_step() is not None:
            self._restore(self.manager.latest_step())
        else:
            if initial_params is not None:
                params = initial_params
            else:
                _, params = nnx.split(create_model(config.model, seed=config.run.seed,
                                                   mesh=self.mesh, layout=self.rules),
                                      nnx.Param)
            # Each buffer is created directly on its shards, as the parameters were.
            opt_state = jax.jit(self.optimizer.init,
                                out_shardings=_shardings(self.abstract_opt_state))(params)
            self.state = TrainState(step=0, params=params, opt_state=opt_state,
                                    loader=LoaderState(), rng=jax.random.key(config.run.seed))
        self.loader = PackedLoader(self.train_windows, config.data.batch_size, config.data.seed,
                                   self.state.loader)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._train_step = jax.jit(
            self._step, donate_argnums=(0, 1),
            out_shardings=(_shardings(self.abstract_params),
                           _shardings(self.abstract_opt_state), replicated))
        self._eval_step = jax.jit(self._evaluate_batch, out_shardings=replicated)
        if is_leader():
            (self.out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))

    def _load_student(self) -> nnx.State:
        """The parameters of `[distill] student_checkpoint`, on this run's shardings.

        Raises:
            ValueError: The checkpoint's config is not the run's `[model]` config.
        """
        path = self.config.distill.student_checkpoint
        student = load_model(path, mesh=self.mesh, layout=self.layout)
        if student.config != self.config.model:
            raise ValueError(f"student checkpoint {path} has config {student.config}, not the "
                             f"run's [model] {self.config.model}")
        _, params = nnx.split(student, nnx.Param)
        # The same placement the train step pins its outputs to, so it compiles once.
        return jax.device_put(params, _shardings(self.abstract_params))

    # ---------------------------------------------------------------- jitted pieces

    def _loss(self, params: nnx.State, batch: jax.Array,
              teacher_params: nnx.State | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T], [B, T]
        mask = jnp.ones(targets.shape, jnp.float32)  # [B, T]; packed windows are all real
        logits, _ = nnx.merge(self.graphdef, params)(inputs)  # [B, T, V]
        if teacher_params is None:
            loss = cross_entropy(logits, targets, mask)
            return loss, {"ce": loss}
        teacher_logits, _ = nnx.merge(self.teacher_graphdef, teacher_params)(inputs)
        distill = self.config.distill
        return distillation_loss(logits, teacher_logits, targets, mask, kind=distill.kind,
                                 temperature=distill.temperature, ce_weight=distill.ce_weight,
                                 beta=distill.beta)

    def _step(self, params: nnx.State, opt_state: optax.OptState, batch: jax.Array,
              teacher_params: nnx.State | None, masks: Masks
              ) -> tuple[nnx.State, optax.OptState, dict]:
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
            params, batch, teacher_params)
        # Pruned entries get no gradient (no momentum, no share of the clipping norm) and are
        # re-zeroed after the update, which no optimizer can then revive (empty masks: no-op).
        grads = apply_masks(grads, masks)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = apply_masks(optax.apply_updates(params, updates), masks)
        return params, opt_state, {**metrics, "loss": loss,
                                   "grad_norm": optax.tree.norm(grads)}

    def _evaluate_batch(self, params: nnx.State, batch: jax.Array) -> jax.Array:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits, _ = nnx.merge(self.graphdef, params)(inputs)  # [B, T, V]
        return cross_entropy(logits, targets, jnp.ones(targets.shape, jnp.float32))

    # ---------------------------------------------------------------- host loop

    def evaluate(self) -> float:
        """Validation perplexity over the first `eval_batches` batches (a fixed set)."""
        batch_size = self.config.data.batch_size
        count = min(self.config.run.eval_batches, len(self.validation_windows) // batch_size)
        if count == 0:
            raise ValueError("the validation split is smaller than one batch")
        losses = []
        with activate(self.mesh, self.rules):
            for index in range(count):
                batch = self.validation_windows[index * batch_size:(index + 1) * batch_size]
                losses.append(float(self._eval_step(self.state.params,
                                                    self._place_batch(batch))))
        return math.exp(float(np.mean(losses)))

    def _place_batch(self, batch: np.ndarray) -> jax.Array:
        """The global batch `[B, T + 1]` as one array with rows split over 'data'.

        Every process holds the same global batch (the loader is seeded), so each fills in
        the rows of its own devices; this works alike for one process and for many.
        """
        return jax.make_array_from_callback(batch.shape, self.batch_sharding,
                                            lambda index: batch[index])

    def train(self, steps: int | None = None) -> list[dict[str, float]]:
        """Trains until `run.total_steps` (or for `steps` more); returns the per-step logs."""
        run = self.config.run
        end = run.total_steps if steps is None else min(run.total_steps, self.state.step + steps)
        tokens_per_step = self.config.data.batch_size * self.config.data.sequence_length
        history: list[dict[str, float]] = []
        schedule = learning_rate_schedule(self.config.optimizer, run.total_steps)
        log_file = (self.out / "metrics.jsonl").open("a") if is_leader() else None
        try:
            while self.state.step < end:
                started = time.perf_counter()
                batch = self._place_batch(self.loader.next_batch())  # [B, T + 1]
                with activate(self.mesh, self.rules):
                    params, opt_state, metrics = self._train_step(
                        self.state.params, self.state.opt_state, batch, self.teacher_params,
                        self.masks)
                metrics = {key: float(value) for key, value in metrics.items()}
                elapsed = time.perf_counter() - started
                self.state = dataclasses.replace(
                    self.state, step=self.state.step + 1, params=params, opt_state=opt_state,
                    loader=self.loader.state)
                record = {"step": self.state.step, **metrics,
                          "learning_rate": float(schedule(self.state.step - 1)),
                          "step_time": elapsed, "tokens_per_second": tokens_per_step / elapsed}
                if run.eval_every and self.state.step % run.eval_every == 0:
                    record["validation_ppl"] = self.evaluate()
                history.append(record)
                if log_file is not None:
                    log_file.write(json.dumps(record) + "\n")
                if self.state.step % run.log_every == 0 or "validation_ppl" in record:
                    self._report(record, end)
                if run.checkpoint_every and self.state.step % run.checkpoint_every == 0:
                    self.save()
        finally:
            if log_file is not None:
                log_file.close()
        if self.state.step == run.total_steps:
            self.save()
        return history

    def _report(self, record: dict[str, float], end: int) -> None:
        done = record["step"] / end
        bar = "#" * int(done * 20)
        line = (f"[{bar:<20}] step {record['step']}/{end} loss {record['loss']:.4f} "
                f"lr {record['learning_rate']:.2e} {record['tokens_per_second']:.0f} tok/s "
                f"{record['step_time'] * 1000:.0f} ms/step")
        if "validation_ppl" in record:
            line += f" val_ppl {record['validation_ppl']:.2f}"
        self.log(line)

    # ---------------------------------------------------------------- checkpoints

    def save(self) -> None:
        """Writes a checkpoint of the current step (blocking)."""
        if self.manager.latest_step() == self.state.step:
            return
        extra = {"step": self.state.step, "loader": dataclasses.asdict(self.state.loader),
                 "rng": np.asarray(jax.random.key_data(self.state.rng)).tolist()}
        self.manager.save(self.state.step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(self.state.params),
            opt_state=ocp.args.StandardSave(self.state.opt_state),
            extra=ocp.args.JsonSave(extra)))
        self.manager.wait_until_finished()

    def _restore(self, step: int) -> None:
        # The targets carry this mesh's shardings, not the saving run's: orbax reads each
        # device's slice of every array, whatever mesh shape wrote the checkpoint.
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(self.abstract_params),
            opt_state=ocp.args.StandardRestore(self.abstract_opt_state),
            extra=ocp.args.JsonRestore()))
        extra = restored["extra"]
        self.state = TrainState(
            step=int(extra["step"]), params=restored["params"],
            opt_state=restored["opt_state"], loader=LoaderState(**extra["loader"]),
            rng=jax.random.wrap_key_data(jnp.asarray(extra["rng"], jnp.uint32)))
        self.log(f"resumed from step {self.state.step}")

    def model(self) -> Transformer:
        """The current parameters as a model.

        In a multi-process run the parameters are gathered, one at a time, into every
        process's memory (no process can read another's shards), so the model is usable on
        this host; that is a collective, which every process must call.
        """
        params = self.state.params
        if jax.process_count() > 1:
            params = jax.tree.map(jnp.asarray,
                                  multihost_utils.process_allgather(params, tiled=True))
        return nnx.merge(self.graphdef, params)

    def close(self) -> None:
        """Releases the checkpoint manager."""
        self.manager.close()


def describe_run(config: TrainConfig) -> str:
    """One line about the run, for the log's first line."""
    model = config.model
    data, model_size = mesh_shape(config.mesh, jax.device_count())
    return (f"model {model.model_type} L={model.num_layers} D={model.hidden_size} "
            f"V={model.vocab_size}; optimizer {config.optimizer.name}; "
            f"{config.run.total_steps} steps of {config.data.batch_size}x"
            f"{config.data.sequence_length} tokens; mesh data={data} x model={model_size} "
            f"({config.mesh.layout}); python {sys.version.split()[0]}")


def parameter_count(params: Any) -> int:
    """Number of scalars in a parameter tree."""
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
