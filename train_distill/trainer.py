"""One trainer for pre-training and distillation, on the same model code that serves.

The train step is one jitted function over (parameters, optimizer state, batch[, teacher]):
the batch `[B, L + 1]` is sharded over the mesh's 'data' axis, parameters follow the chosen
layout (replicated by default: pure data parallel). Checkpoints (orbax, every N steps) hold
the parameters, the optimizer state and, as JSON, the step, the loader position and the RNG
key, so a resumed run replays exactly the batches and updates of an uninterrupted one.
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
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.model_loading import load_model
from jaxinfer.models import Transformer, create_model
from jaxinfer.sharding import activate, make_mesh
from train_distill.config import OptimizerConfig, TrainConfig
from train_distill.data import LoaderState, PackedLoader, pack
from train_distill.losses import cross_entropy, distillation_loss


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
        self.log = log or (lambda line: print(line, flush=True))
        devices = config.run.data_parallel or jax.device_count()
        self.mesh = make_mesh((devices, 1))
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data", None))

        tokens = Path(config.data.tokens)
        self.train_windows = pack(np.load(tokens / "train.npy").astype(np.int32),
                                  config.data.sequence_length)  # [W, L + 1]
        self.validation_windows = pack(np.load(tokens / "validation.npy").astype(np.int32),
                                       config.data.sequence_length)  # [Wv, L + 1]
        if config.data.batch_size % devices:
            raise ValueError(f"data.batch_size = {config.data.batch_size} must divide over "
                             f"{devices} data-parallel devices")

        model = create_model(config.model, seed=config.run.seed, mesh=self.mesh,
                             layout="replicated")
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.optimizer = build_optimizer(config.optimizer, config.run.total_steps)
        self.teacher_graphdef, self.teacher_params = None, None
        if config.distill.teacher:
            teacher = load_model(config.distill.teacher, mesh=self.mesh, layout="replicated")
            if teacher.config.vocab_size != config.model.vocab_size:
                raise ValueError(f"teacher vocab {teacher.config.vocab_size} != student vocab "
                                 f"{config.model.vocab_size}: they must share a tokenizer")
            self.teacher_graphdef, self.teacher_params = nnx.split(teacher, nnx.Param)
        # Parameters are replicated over the mesh; the optimizer state (scalar step counts
        # included) must live on the same devices for the jitted step to accept it.
        replicated = NamedSharding(self.mesh, PartitionSpec())
        opt_state = jax.device_put(self.optimizer.init(params), replicated)
        self.state = TrainState(step=0, params=params, opt_state=opt_state,
                                loader=LoaderState(), rng=jax.random.key(config.run.seed))
        self.manager = ocp.CheckpointManager(
            (self.out / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        if self.manager.latest_step() is not None:
            self._restore(self.manager.latest_step())
        self.loader = PackedLoader(self.train_windows, config.data.batch_size, config.data.seed,
                                   self.state.loader)
        self._train_step = jax.jit(self._step, donate_argnums=(0, 1))
        self._eval_step = jax.jit(self._evaluate_batch)
        (self.out / "config.json").write_text(json.dumps(config.to_dict(), indent=2))

    # ---------------------------------------------------------------- jitted pieces

    def _loss(self, params: nnx.State, batch: jax.Array,
              teacher_params: nnx.State | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, L], [B, L]
        mask = jnp.ones(targets.shape, jnp.float32)  # [B, L]; packed windows are all real
        logits, _ = nnx.merge(self.graphdef, params)(inputs)  # [B, L, V]
        if teacher_params is None:
            loss = cross_entropy(logits, targets, mask)
            return loss, {"ce": loss}
        teacher_logits, _ = nnx.merge(self.teacher_graphdef, teacher_params)(inputs)
        distill = self.config.distill
        return distillation_loss(logits, teacher_logits, targets, mask, kind=distill.kind,
                                 temperature=distill.temperature, ce_weight=distill.ce_weight,
                                 beta=distill.beta)

    def _step(self, params: nnx.State, opt_state: optax.OptState, batch: jax.Array,
              teacher_params: nnx.State | None) -> tuple[nnx.State, optax.OptState, dict]:
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
            params, batch, teacher_params)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**metrics, "loss": loss,
                                   "grad_norm": optax.tree.norm(grads)}

    def _evaluate_batch(self, params: nnx.State, batch: jax.Array) -> jax.Array:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits, _ = nnx.merge(self.graphdef, params)(inputs)  # [B, L, V]
        return cross_entropy(logits, targets, jnp.ones(targets.shape, jnp.float32))

    # ---------------------------------------------------------------- host loop

    def evaluate(self) -> float:
        """Validation perplexity over the first `eval_batches` batches (a fixed set)."""
        batch_size = self.config.data.batch_size
        count = min(self.config.run.eval_batches, len(self.validation_windows) // batch_size)
        if count == 0:
            raise ValueError("the validation split is smaller than one batch")
        losses = []
        with activate(self.mesh, "replicated"):
            for index in range(count):
                batch = self.validation_windows[index * batch_size:(index + 1) * batch_size]
                losses.append(float(self._eval_step(
                    self.state.params, jax.device_put(batch, self.batch_sharding))))
        return math.exp(float(np.mean(losses)))

    def train(self, steps: int | None = None) -> list[dict[str, float]]:
        """Trains until `run.total_steps` (or for `steps` more); returns the per-step logs."""
        run = self.config.run
        end = run.total_steps if steps is None else min(run.total_steps, self.state.step + steps)
        tokens_per_step = self.config.data.batch_size * self.config.data.sequence_length
        history: list[dict[str, float]] = []
        schedule = learning_rate_schedule(self.config.optimizer, run.total_steps)
        log_file = (self.out / "metrics.jsonl").open("a")
        try:
            while self.state.step < end:
                started = time.perf_counter()
                batch = jax.device_put(self.loader.next_batch(), self.batch_sharding)
                with activate(self.mesh, "replicated"):
                    params, opt_state, metrics = self._train_step(
                        self.state.params, self.state.opt_state, batch, self.teacher_params)
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
                log_file.write(json.dumps(record) + "\n")
                if self.state.step % run.log_every == 0 or "validation_ppl" in record:
                    self._report(record, end)
                if run.checkpoint_every and self.state.step % run.checkpoint_every == 0:
                    self.save()
        finally:
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
        abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)  # noqa: E731
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract(self.state.params)),
            opt_state=ocp.args.StandardRestore(abstract(self.state.opt_state)),
            extra=ocp.args.JsonRestore()))
        extra = restored["extra"]
        self.state = TrainState(
            step=int(extra["step"]), params=restored["params"],
            opt_state=restored["opt_state"], loader=LoaderState(**extra["loader"]),
            rng=jax.random.wrap_key_data(jnp.asarray(extra["rng"], jnp.uint32)))
        self.log(f"resumed from step {self.state.step}")

    def model(self) -> Transformer:
        """The current parameters as a model."""
        return nnx.merge(self.graphdef, self.state.params)

    def close(self) -> None:
        """Releases the checkpoint manager."""
        self.manager.close()


def describe_run(config: TrainConfig) -> str:
    """One line about the run, for the log's first line."""
    model = config.model
    return (f"model {model.model_type} L={model.num_layers} D={model.hidden_size} "
            f"V={model.vocab_size}; optimizer {config.optimizer.name}; "
            f"{config.run.total_steps} steps of {config.data.batch_size}x"
            f"{config.data.sequence_length} tokens; python {sys.version.split()[0]}")


def parameter_count(params: Any) -> int:
    """Number of scalars in a parameter tree."""
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
