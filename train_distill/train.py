"""Entry point: `python -m train_distill.train --config FILE.toml [section.key=value ...]`.

Trains (or resumes, if the run directory has checkpoints), reports validation perplexity, and
exports the final model as a Hugging Face directory `RUN/hf` with the tokenizer beside it
(OSP models are folded into a plain Llama first), loadable by `jaxinfer generate --model`.

Across hosts, start the same command once per process with the `jaxinfer.distributed` flags
(`--coordinator-address HOST:PORT --num-processes N --process-id I`, or `--distributed` on a
TPU pod / SLURM); `[mesh]` then spans every process's devices. Process 0 alone prints, writes
the JSON files and exports; orbax coordinates the checkpoint writes of all processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from checkpoints import save_hf_checkpoint
from jaxinfer import distributed
from jaxinfer.models import Transformer
from train_distill.config import TrainConfig, load_train_config
from train_distill.trainer import Trainer, describe_run, parameter_count


def export(model: Transformer, config: TrainConfig, out: Path) -> Path:
    """Writes `model` (folded to plain Llama if it uses OSP parts) as an HF directory."""
    if (getattr(model.config, "norm_type", "rms") != "rms"
            or getattr(model.config, "embedding_projection", False)):
        from train_distill.osp import fold_osp

        model = fold_osp(model)
    return save_hf_checkpoint(model, out, tokenizer_directory=config.data.tokenizer)


def run(config: TrainConfig) -> dict:
    """Trains `config` to the end; returns the final summary (also written to summary.json)."""
    trainer = Trainer(config)
    try:
        trainer.log(describe_run(config) +
                    f"; {parameter_count(trainer.state.params) / 1e6:.2f}M parameters")
        history = trainer.train()
        summary = {"step": trainer.state.step, "validation_ppl": trainer.evaluate(),
                   "parameters": parameter_count(trainer.state.params)}
        if history:
            summary["final_loss"] = history[-1]["loss"]
            tail = history[len(history) // 2:]
            summary["median_step_time"] = sorted(r["step_time"] for r in tail)[len(tail) // 2]
        if config.run.export_hf:
            model = trainer.model()  # a collective in a multi-process run: all must call it
            hf_directory = trainer.out / "hf"
            if distributed.is_leader():
                hf_directory = export(model, config, hf_directory)
            summary["hf_directory"] = str(hf_directory)
        if distributed.is_leader():
            (trainer.out / "summary.json").write_text(json.dumps(summary, indent=2))
        trainer.log(json.dumps(summary))
        return summary
    finally:
        trainer.close()


def build_parser() -> argparse.ArgumentParser:
    """The command line: a config file, overrides and the multi-host flags."""
    parser = argparse.ArgumentParser(description="Train or distill a jaxinfer model.")
    parser.add_argument("--config", required=True, help="TOML run config")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    distributed.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line."""
    args = build_parser().parse_args(argv)
    try:
        distributed_config = distributed.config_from_args(args)
        config = load_train_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as error:
        print(f"train: error: {error}", file=sys.stderr)
        return 2
    # Before anything touches a device: the Trainer's mesh must see every process's devices.
    distributed.initialize(distributed_config)
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
