"""OSP study: an AdamW baseline against full OSP, same data, steps, size and seed.

    python -m train_distill.train --config train_distill/configs/demo_draft_scratch.toml
    python -m train_distill.train --config train_distill/configs/osp_study_osp.toml
    python benchmarks/osp_study.py --out benchmarks/results/osp.md

Both runs are read from their exported HF directories (the OSP model folded to a plain
Llama, which computes the same function). Reported per model, on held-out validation text:
excess kurtosis in both variants (length-1 tokens, as the paper's script, and in context),
max|h| / RMS(h) of every hidden state, validation PPL in full precision and under simulated
W8A8 and W4A4KV4 round-to-nearest quantization (jaxinfer.quant.simulate), and the train
step's time for both recipes measured side by side, interleaved, in this process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from demo_models import score_windows
from flax import nnx

from jaxinfer.model_loading import load_model
from jaxinfer.models import create_model
from jaxinfer.quant import PROTOCOLS, simulate
from train_distill.config import load_train_config
from train_distill.data import pack
from train_distill.losses import cross_entropy
from train_distill.outliers import outlier_statistics
from train_distill.trainer import build_optimizer


def quantized_perplexities(model, windows: np.ndarray) -> dict[str, float]:
    """Validation PPL in full precision and under each simulated protocol."""
    losses, _ = score_windows(model, windows)
    result = {"full": math.exp(float(losses.mean()))}
    for name, protocol in PROTOCOLS.items():
        with simulate(model, protocol) as quantized:
            losses, _ = score_windows(quantized, windows)
        result[name] = math.exp(float(losses.mean()))
    return result


def step_times(config_paths: dict[str, str], batch: np.ndarray, repeats: int) -> dict:
    """Median train-step seconds per recipe, the recipes interleaved step by step."""
    steps, states = {}, {}
    for name, path in config_paths.items():
        config = load_train_config(path)
        graphdef, params = nnx.split(create_model(config.model, seed=0), nnx.Param)
        optimizer = build_optimizer(config.optimizer, config.run.total_steps)

        def loss(params, batch, graphdef=graphdef):
            logits, _ = nnx.merge(graphdef, params)(batch[:, :-1])  # [B, T, V]
            return cross_entropy(logits, batch[:, 1:], jnp.ones(batch[:, 1:].shape))

        def step(params, opt_state, batch, loss=loss, optimizer=optimizer):
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        steps[name] = jax.jit(step)
        states[name] = (params, optimizer.init(params))
    device_batch = jnp.asarray(batch)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(repeats + 2):
        for name, step in steps.items():
            started = time.perf_counter()
            params, opt_state, value = step(*states[name], device_batch)
            value.block_until_ready()
            states[name] = (params, opt_state)
            if repeat >= 2:  # the first two calls compile and warm up
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="data/tokens")
    parser.add_argument("--adam", default="runs/demo_draft_scratch")
    parser.add_argument("--osp", default="runs/osp_study_osp")
    parser.add_argument("--adam-config",
                        default="train_distill/configs/demo_draft_scratch.toml")
    parser.add_argument("--osp-config", default="train_distill/configs/osp_study_osp.toml")
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--max-windows", type=int, default=96)
    parser.add_argument("--kurtosis-windows", type=int, default=8)
    parser.add_argument("--timing-repeats", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/osp.md")
    args = parser.parse_args()

    windows = pack(np.load(Path(args.tokens) / "validation.npy").astype(np.int32),
                   args.sequence_length)[: args.max_windows]  # [W, T + 1]
    kurtosis_tokens = jnp.asarray(windows[: args.kurtosis_windows, :-1])  # [Wk, T]
    runs = {"adam": Path(args.adam), "osp": Path(args.osp)}
    results = {}
    for name, run in runs.items():
        model = load_model(str(run / "hf"))
        summary = json.loads((run / "summary.json").read_text())
        results[name] = {
            "ppl": quantized_perplexities(model, windows),
            "kurtosis": {variant: outlier_statistics(model, kurtosis_tokens, variant)
                         for variant in ("length_one", "in_context")},
            "steps": summary["step"], "parameters": summary["parameters"]}
    timing = step_times({"adam": args.adam_config, "osp": args.osp_config}, windows[:16],
                        args.timing_repeats)
    print(json.dumps({"results": results, "step_seconds": timing}, indent=1)[:2000])

    adam, osp = results["adam"], results["osp"]
    command = "python " + " ".join(sys.argv)
    lines = [
        "# OSP study: AdamW baseline vs full OSP (Muon + SSNorm + EmbProj)",
        "",
        f"- Command: `{command}` (after the two training runs named in the script's docstring)",
        f"- Machine: {platform.machine()}, {jax.device_count()} {jax.default_backend()} "
        f"device(s), Python {platform.python_version()}, jax {jax.__version__}",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Models: Llama, 4 layers, D=128, 4 heads (2 KV), F=384, vocab 4096; "
        f"{adam['parameters'] / 1e6:.2f}M (Adam) / {osp['parameters'] / 1e6:.2f}M (OSP, with "
        f"its two 128x128 projections before folding) parameters; {adam['steps']} steps of "
        "16x256 tokens of the Python-docs corpus, same data order and seed; lr 2e-3, warm-up "
        "100, cosine to 10%. OSP: Muon for block matrices and EmbProj, AdamW for embedding, "
        "head and the (single-scale) norm gains.",
        f"- Held-out text: {len(windows)} validation windows x {args.sequence_length} tokens "
        f"for PPL; {args.kurtosis_windows} windows for the outlier metrics.",
        "- Quantization is simulated round-to-nearest (jaxinfer.quant.fake_quant): W8A8 = int8 "
        "per-channel weights, int8 per-token asymmetric activations at every block linear; "
        "W4A4KV4 = 4-bit weights (MSE clip search), 4-bit activations, K/V 4-bit asymmetric in "
        "groups of 128. Embedding and LM head stay full precision.",
        "",
        "| metric | Adam | OSP | paper Adam | paper OSP |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for variant in ("length_one", "in_context"):
        lines.append(f"| excess kurtosis ({variant}) | "
                     f"{adam['kurtosis'][variant]['excess_kurtosis']:.3f} | "
                     f"{osp['kurtosis'][variant]['excess_kurtosis']:.3f} | "
                     + ("1818.56 | 0.04 |" if variant == "length_one" else "- | - |"))
    lines.append(f"| validation PPL, full precision | {adam['ppl']['full']:.2f} | "
                 f"{osp['ppl']['full']:.2f} | - | - |")
    for protocol in PROTOCOLS:
        paper = ("8e4 | 19.6 |" if protocol == "W4A4KV4" else "- | - |")
        lines.append(f"| PPL {protocol} (ratio to full) | {adam['ppl'][protocol]:.2f} "
                     f"({adam['ppl'][protocol] / adam['ppl']['full']:.3f}x) | "
                     f"{osp['ppl'][protocol]:.2f} "
                     f"({osp['ppl'][protocol] / osp['ppl']['full']:.3f}x) | {paper}")
    lines.append(f"| train step time (ratio to Adam) | 1.000 | "
                 f"{timing['osp'] / timing['adam']:.3f} | 1 | ~1.02 |")
    lines += ["", "max|h| / RMS(h) per hidden state (in context; state 0 = embedding output, "
              "1..L = block outputs, last = final norm output):", "",
              "| state | Adam | OSP | Adam kurtosis | OSP kurtosis |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    adam_context, osp_context = adam["kurtosis"]["in_context"], osp["kurtosis"]["in_context"]
    for index, (a, o) in enumerate(zip(adam_context["max_over_rms_per_state"],
                                       osp_context["max_over_rms_per_state"], strict=True)):
        lines.append(f"| {index} | {a:.1f} | {o:.1f} | "
                     f"{adam_context['kurtosis_per_state'][index]:.2f} | "
                     f"{osp_context['kurtosis_per_state'][index]:.2f} |")
    lines += ["", f"Step time, median of {args.timing_repeats} interleaved steps: Adam "
              f"{timing['adam'] * 1000:.0f} ms, OSP {timing['osp'] * 1000:.0f} ms."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
