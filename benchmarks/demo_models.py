"""Evaluates the demo teacher and drafters on the held-out split; writes a Markdown report.

    python benchmarks/demo_models.py --tokens data/tokens --teacher runs/demo_teacher/hf \
        --draft runs/demo_draft/hf --scratch runs/demo_draft_scratch/hf \
        --out benchmarks/results/distill.md

Metrics, all on the same validation windows (length 256, every window of the split up to
--max-windows):
    validation PPL: exp of the mean next-token cross-entropy;
    top-1 agreement: how often a drafter's argmax equals the teacher's argmax at the same
        position, the proxy for greedy speculative acceptance;
    unigram baseline: PPL of the add-one-smoothed training-token frequencies, the floor any
        trained model must clear.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.model_loading import load_model
from train_distill.data import pack


def score_windows(model, windows: np.ndarray, batch_size: int = 8) -> tuple[np.ndarray, ...]:
    """Next-token NLL and argmax at every position of `[W, T + 1]` windows, `[W, T]` each.

    Pass the model a `jaxinfer.quant.simulate` block yields to score it with its activation
    and K/V quantization (the hooks belong to that model).
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, inputs, targets):
        logits, _ = nnx.merge(graphdef, state)(inputs)  # [B, T, V]
        log_probs = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V]
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return -picked, jnp.argmax(logits, axis=-1)  # [B, T], [B, T]

    losses, argmaxes = [], []
    for start in range(0, len(windows), batch_size):
        batch = jnp.asarray(windows[start:start + batch_size])  # [B, T + 1]
        loss, argmax = forward(state, batch[:, :-1], batch[:, 1:])
        losses.append(np.asarray(loss))
        argmaxes.append(np.asarray(argmax))
    return np.concatenate(losses), np.concatenate(argmaxes)


def evaluate(models: dict[str, str], windows: np.ndarray, batch_size: int = 8) -> dict:
    """Per model: validation PPL and (against the first model) top-1 agreement."""
    results: dict[str, dict] = {}
    teacher_argmax = None
    for index, (name, path) in enumerate(models.items()):
        model = load_model(path)
        losses, argmax = score_windows(model, windows, batch_size)
        count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(nnx.state(model)))
        results[name] = {"path": path, "parameters": count,
                         "validation_ppl": math.exp(float(losses.mean()))}
        if index == 0:
            teacher_argmax = argmax
        else:
            results[name]["top1_agreement"] = float((argmax == teacher_argmax).mean())
    return results


def unigram_ppl(train: np.ndarray, windows: np.ndarray, vocab_size: int) -> float:
    """PPL of add-one-smoothed unigram frequencies on the windows' targets."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return math.exp(-float(log_probs[windows[:, 1:]].mean()))


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="data/tokens")
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--max-windows", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/distill.md")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    tokens = Path(args.tokens)
    train = np.load(tokens / "train.npy").astype(np.int64)
    windows = pack(np.load(tokens / "validation.npy").astype(np.int32),
                   args.sequence_length)[: args.max_windows]
    results = evaluate({"teacher": args.teacher, "distilled drafter": args.draft,
                        "scratch drafter": args.scratch}, windows)
    vocab = json.loads((tokens / "tokens.json").read_text())["vocab_size"]
    baseline = unigram_ppl(train, windows, vocab)
    if args.json:
        print(json.dumps({"unigram_ppl": baseline, **results}, indent=2))

    command = "python " + " ".join(sys.argv)
    lines = [
        "# Demo models: teacher quality and distillation study",
        "",
        f"- Command: `{command}`",
        f"- Machine: {platform.machine()}, {jax.device_count()} {jax.default_backend()} "
        f"device(s), Python {platform.python_version()}, jax {jax.__version__}",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Held-out text: {len(windows)} validation windows of {args.sequence_length} tokens "
        f"({len(windows) * args.sequence_length} scored tokens) of the Python 3.11 docs "
        "corpus; documents split by name hash, never seen in training.",
        "",
        "| model | parameters | validation PPL | PPL / unigram | top-1 agreement with teacher |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| unigram baseline (add-one) | - | {baseline:.2f} | 1.000 | - |",
    ]
    for name, result in results.items():
        agreement = result.get("top1_agreement")
        lines.append(
            f"| {name} (`{result['path']}`) | {result['parameters'] / 1e6:.2f}M | "
            f"{result['validation_ppl']:.2f} | {result['validation_ppl'] / baseline:.3f} | "
            f"{'-' if agreement is None else f'{agreement:.3f}'} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
