"""The markdown of `benchmarks/results/pruning.md` from `pruning_report.py`'s results.

Kept apart from the measuring script so the page can be re-rendered from a run's JSON
(`pruning_report.py --render RUN.json`) without pruning anything again: the measured numbers
are fixed by the run, the words around them are not.
"""

from __future__ import annotations

from typing import Any

from benchmarks.machine_load import describe

# The Wanda figure of METHODS.md section 7 (LLaMA-7B, 50% unstructured), for scale.
LLAMA_7B_DENSE_PPL, LLAMA_7B_WANDA_50_PPL = 5.68, 7.26


def _sweep_table(sweep: dict[str, Any]) -> list[str]:
    """PPL (and its ratio to dense) per method row and sparsity, then 2:4."""
    sparsities = list(sweep["rows"][0]["ppl"])
    dense = sweep["dense_ppl"]
    lines = ["| method | layer sparsities | " + " | ".join(
        f"{float(s):.0%}" for s in sparsities) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in sparsities) + " |"]
    for row in sweep["rows"]:
        cells = [f"{row['ppl'][s]:.2f} ({row['ppl'][s] / dense:.2f}x)" for s in sparsities]
        lines.append(f"| {row['method']} | {'OWL' if row['owl'] else 'uniform'} | "
                     + " | ".join(cells) + " |")
    lines += ["", f"Dense: PPL {dense:.3f}. At 2:4 (50% in every group of 4 inputs): "
              + ", ".join(f"{method} {value:.2f} ({value / dense:.2f}x)"
                          for method, value in sweep["two_four"].items()) + "."]
    return lines


def _fifty(sweep: dict[str, Any], method: str) -> float:
    return next(row["ppl"]["0.5"] for row in sweep["rows"]
                if row["method"] == method and not row["owl"])


def acceptance(results: dict[str, Any]) -> list[str]:
    """The issue's figures against their targets."""
    lines = ["| figure | target | measured | holds |", "| --- | --- | --- | --- |"]
    for label in ("demo", "smollm2"):
        if label not in results:
            continue
        sweep = results[label]
        dense = sweep["dense_ppl"]
        magnitude = _fifty(sweep, "magnitude") - dense
        for method in ("wanda", "sparsegpt"):
            value = _fifty(sweep, method)
            lines.append(f"| {label}: {method} 50% PPL / dense | <= 1.5x | "
                         f"{value / dense:.3f}x | {'yes' if value / dense <= 1.5 else 'no'} |")
            lines.append(f"| {label}: {method} 50% PPL increase / magnitude's | <= 0.5 | "
                         f"{(value - dense) / magnitude:.3f} | "
                         f"{'yes' if value - dense <= 0.5 * magnitude else 'no'} |")
    structured = results["structured"]
    removed = 1 - structured["pruned_parameters"] / structured["dense_parameters"]
    lines.append(f"| structured: parameters removed | about 25% | {removed:.1%} | "
                 f"{'yes' if 0.2 <= removed <= 0.3 else 'no'} |")
    for label, section in (("demo", structured), ("SmolLM2",
                                                   results.get("smollm2_structured"))):
        if section is None:
            continue
        removed = 1 - section["pruned_parameters"] / section["dense_parameters"]
        speeds = section["decode_tokens_per_s"]
        for size in speeds["dense"]:
            ratio = speeds["pruned"][size] / speeds["dense"][size]
            lines.append(f"| structured, {label}: decode speed-up @ {size} | follows "
                         f"1 / (1 - {removed:.1%}) = {1 / (1 - removed):.2f}x | "
                         f"{ratio:.2f}x | {ratio * (1 - removed):.0%} of it; see the "
                         "section |")
    return lines


def _norm_spread(results: dict[str, Any]) -> list[str]:
    """Why Wanda can or cannot beat magnitude on each model: its input norms' spread."""
    spread = {label: results[label]["input_norms"] for label in ("demo", "smollm2")
              if label in results and "input_norms" in results[label]}
    lines = ["Wanda's score is |W| x ||X|| per input channel, so it ranks differently from "
             "magnitude only where some input channels carry far larger norms (the outlier "
             "features of large LLMs); SparseGPT's update also gains most there. Spread of "
             "the blocks' linear inputs' channel norms on the calibration windows (medians "
             "over every captured input):", "",
             "| model | max / median norm | largest max / median | coefficient of variation "
             "| 50% magnitude PPL / dense |", "| --- | ---: | ---: | ---: | ---: |"]
    for label, values in spread.items():
        sweep = results[label]
        lines.append(f"| {label} | {values['max_over_median']:.2f} | "
                     f"{values['largest_max_over_median']:.2f} | "
                     f"{values['coefficient_of_variation']:.2f} | "
                     f"{_fifty(sweep, 'magnitude') / sweep['dense_ppl']:.3f}x |")
    return lines


def _read_ms(parameters: int, read_gb_per_s: float) -> float:
    """Milliseconds to read `parameters` float32 weights once at `read_gb_per_s`."""
    return parameters * 4 / (read_gb_per_s * 1e9) * 1000


def _step_floor(section: dict[str, Any], read_gb_per_s: float) -> list[str]:
    """Measured ms per decode step against the step's weight-read floor (every parameter
    read once at the read bandwidth measured in the timed phase), dense and pruned."""
    lines = []
    for name, key in (("dense", "dense_parameters"), ("pruned", "pruned_parameters")):
        floor_ms = _read_ms(section[key], read_gb_per_s)
        steps = ", ".join(f"@ {size}: {int(size) * 1000 / speed:.2f} ms"
                          for size, speed in section["decode_tokens_per_s"][name].items())
        lines.append(f"- {name}: ms per decode step {steps}; weight-read floor "
                     f"{floor_ms:.2f} ms ({section[key] * 4 / 1e6:.1f} MB of float32 "
                     f"parameters at {read_gb_per_s} GB/s)")
    return lines


def markdown(results: dict[str, Any], command: str, rendered_by: str | None = None) -> str:
    """The results file; `rendered_by` names the `--render` command when the text was
    re-written from a run's JSON."""
    machine = results["machine"]
    demo = results["demo"]
    lines = [
        "# Pruning: methods, structured pruning with recovery, HARP, sparse + quantized",
        "",
        f"- Command: `{command}`"
        + (f" (this text re-rendered from its JSON: `{rendered_by}`)" if rendered_by else ""),
        f"- Machine: {machine['platform']}, {machine['cpu_count']} CPUs (shared), Python "
        f"{machine['python']}, jax {machine['jax']} ({machine['jax_backend']}), git "
        f"{machine['git']}",
        f"- Date: {machine['date']}; the whole run took {results['minutes']:.0f} minutes.",
        "- Load: the quality figures (perplexity, bytes, chat answers) do not depend on it; "
        "the timed figures (HARP prefill, decode tok/s) come from one phase at the end. "
        + describe(results["timed_phase"]),
        f"- Held-out text: {demo['scored_tokens']} scored tokens of the Python-docs validation "
        "split, disjoint 256-token windows; calibration: "
        f"{demo['calibration'][0]} x {demo['calibration'][1]} tokens of the training split. "
        "Every block linear (q, k, v, o, gate, up, down) is pruned; the embedding and the LM "
        "head stay dense. OWL: lambda 0.08, M 5.",
        "",
        "## Against the acceptance figures",
        "",
        *acceptance(results),
        "",
        *misses(results),
        "",
        *_norm_spread(results),
        "",
        "## Methods on the demo teacher (`builtin:demo`, 8.4M parameters)",
        "",
        "Held-out PPL (ratio to dense) against the sparsity of every block linear:",
        "",
        *_sweep_table(demo),
    ]
    if "smollm2" in results:
        smollm2 = results["smollm2"]
        lines += ["", "## Methods on SmolLM2-135M-Instruct (real, pretrained)", "",
                  f"{smollm2['parameters'] / 1e6:.0f}M parameters; the Q4_1 GGUF's values "
                  "dequantized to float32 are the dense model. Held-out PPL "
                  f"({smollm2['scored_tokens']} tokens of the same split, SmolLM2's "
                  f"tokenizer; calibration {smollm2['calibration'][0]} x "
                  f"{smollm2['calibration'][1]} tokens):", "", *_sweep_table(smollm2), "",
                  "Chat answers (greedy, through the chat template):", ""]
        for index, prompt in enumerate(smollm2["prompts"]):
            lines += [f"**{prompt}**", ""]
            for name, answers in smollm2["answers"].items():
                text = " ".join(answers[index].split())
                lines.append(f"- *{name}*: {text}")
            lines.append("")
    structured = results["structured"]
    speeds = structured["decode_tokens_per_s"]
    sizes = list(speeds["dense"])
    lines += [
        "", "## Structured pruning and recovery (demo teacher)", "",
        f"`jaxinfer prune --structured {structured['spec']}` (activation importance; "
        f"config after: {structured['pruned_config']}), then "
        f"{structured['recovery_steps']} steps of recovery distillation from the dense "
        f"teacher (`{structured['recover_config']}`: forward KL at T=1 + CE, "
        f"{structured['tokens_per_step']} tokens a step, {structured['recovery_s']:.0f} s).",
        "",
        "| model | parameters | PPL | " + " | ".join(
            f"decode tok/s @ {size}" for size in sizes) + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in sizes) + " |",
        f"| dense | {structured['dense_parameters']:,} | {structured['dense_ppl']:.3f} | "
        + " | ".join(f"{speeds['dense'][size]:.0f}" for size in sizes) + " |",
        f"| pruned, before recovery | {structured['pruned_parameters']:,} | "
        f"{structured['ppl_before']:.3f} | " + " | ".join("same as below" for _ in sizes)
        + " |",
        f"| pruned, after recovery | {structured['pruned_parameters']:,} | "
        f"{structured['ppl_after']:.3f} | "
        + " | ".join(f"{speeds['pruned'][size]:.0f} "
                     f"({speeds['pruned'][size] / speeds['dense'][size]:.2f}x)"
                     for size in sizes) + " |",
        "", "Decode step time against its floor: where the measured step is far above the "
        "weight-read floor, the engine's fixed cost per step (scheduling, packing, dispatch, "
        "sampling) dominates and a smaller model cannot speed it up in proportion.", "",
        *_step_floor(structured, results["timed_phase"]["read_gb_per_s"]),
    ]
    if "smollm2_structured" in results:
        section = results["smollm2_structured"]
        speeds = section["decode_tokens_per_s"]
        lines += [
            "", f"SmolLM2-135M-Instruct, `--structured {section['spec']}`, no recovery "
            f"(PPL {section['dense_ppl']:.2f} -> {section['ppl']:.2f}), for the speed of a "
            "model whose decode step is bound by its weights:", "",
            "| model | parameters | " + " | ".join(f"decode tok/s @ {size}" for size in sizes)
            + " |", "| --- | ---: | " + " | ".join("---:" for _ in sizes) + " |",
            f"| dense | {section['dense_parameters']:,} | "
            + " | ".join(f"{speeds['dense'][size]:.1f}" for size in sizes) + " |",
            f"| pruned | {section['pruned_parameters']:,} | "
            + " | ".join(f"{speeds['pruned'][size]:.1f} "
                         f"({speeds['pruned'][size] / speeds['dense'][size]:.2f}x)"
                         for size in sizes) + " |", "",
            *_step_floor(section, results["timed_phase"]["read_gb_per_s"])]
    harp = results["harp"]
    dense_kv = harp["dense_kv_bytes_per_token"]
    lines += [
        "", "## HARP: top layers' attention as W_o W_v (demo teacher)", "",
        f"Dense: PPL {harp['dense_ppl']:.3f}, KV {dense_kv:,} bytes per token, prefill of "
        f"one {harp['prompt_tokens']}-token prompt {harp['prefill_s']['dense'] * 1000:.0f} ms.",
        "",
        "| layers | alpha | alphas (lowest HARP layer first) | PPL | / dense | KV bytes / token | "
        "KV saved | prefill ms | / dense |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in harp["rows"]:
        timed = f"top {row['layers']}"
        prefill = (f"{harp['prefill_s'][timed] * 1000:.0f} | "
                   f"{harp['prefill_s'][timed] / harp['prefill_s']['dense']:.2f}"
                   if row["search"] else "as searched | (alpha only scales)")
        lines.append(
            f"| {row['layers']} | {'searched' if row['search'] else '1'} | "
            f"{', '.join(f'{a:.2f}' for a in row['alphas'])} | {row['ppl']:.3f} | "
            f"{row['ppl'] / harp['dense_ppl']:.3f} | {row['kv_bytes_per_token']:,} | "
            f"{1 - row['kv_bytes_per_token'] / dense_kv:.1%} | {prefill} |")
    lines += ["", "## 2:4 sparse + int4 (demo teacher)", "",
              "| weights | PPL | block linear bytes | / bf16 |", "| --- | ---: | ---: | ---: |"]
    for row in results["combined"]["rows"]:
        lines.append(f"| {row['name']} | {row['ppl']:.3f} | {row['block_bytes']:,} | "
                     f"{row['block_bytes'] / row['block_bf16_bytes']:.3f} |")
    return "\n".join(lines) + "\n"


def _row(sweep: dict[str, Any], method: str, owl: bool = False) -> dict[str, float]:
    return next(row["ppl"] for row in sweep["rows"]
                if row["method"] == method and row["owl"] == owl)


def misses(results: dict[str, Any]) -> list[str]:
    """One bullet per figure of the acceptance table that misses, saying why from the run's
    own numbers (the issue: "where a number misses, say so and why")."""
    lines = []
    for label in ("demo", "smollm2"):
        if label not in results:
            continue
        sweep = results[label]
        dense = sweep["dense_ppl"]
        magnitude = _row(sweep, "magnitude")
        spread = sweep.get("input_norms", {}).get("max_over_median")
        highest = max(magnitude, key=float)
        for method in ("wanda", "sparsegpt"):
            values = _row(sweep, method)
            if values["0.5"] - dense > 0.5 * (magnitude["0.5"] - dense):
                at_highest = (values[highest] - dense) / (magnitude[highest] - dense)
                lines.append(
                    f"- **{label}, {method} at 50%: PPL increase {values['0.5'] - dense:.2f} "
                    f"against magnitude's {magnitude['0.5'] - dense:.2f}.** Magnitude itself "
                    f"costs only {magnitude['0.5'] / dense:.3f}x dense here, so there is "
                    "almost nothing to halve: this model's linear inputs have nearly even "
                    "channel norms"
                    + (f" (max / median {spread:.2f})" if spread is not None else "")
                    + ", and with even norms Wanda's |W| x ||X|| ranks weights as |W| does "
                    "and SparseGPT's update has little error to repair. Where magnitude does "
                    f"lose quality, at {float(highest):.0%}, {method}'s increase is "
                    f"{at_highest:.2f} of magnitude's.")
            if values["0.5"] / dense > 1.5:
                sparsegpt = _row(sweep, "sparsegpt")["0.5"] / dense
                lines.append(
                    f"- **{label}, {method} at 50%: {values['0.5'] / dense:.2f}x dense "
                    "(target 1.5x).** "
                    + ("Wanda zeroes weights without updating the ones it keeps. "
                       if method == "wanda" else "")
                    + f"A {results[label].get('parameters', 0) / 1e6:.0f}M-parameter model "
                    "has far less redundancy per layer than LLaMA-7B, whose own Wanda 50% "
                    f"figure is {LLAMA_7B_WANDA_50_PPL / LLAMA_7B_DENSE_PPL:.2f}x "
                    f"({LLAMA_7B_DENSE_PPL} -> {LLAMA_7B_WANDA_50_PPL}, METHODS.md section 7)"
                    + (f"; SparseGPT, which re-fits the kept weights on the same calibration "
                       f"inputs, gives {sparsegpt:.2f}x"
                       + (" and meets the target" if sparsegpt <= 1.5 else "")
                       if method != "sparsegpt" else "")
                    + f"; OWL's layer ratios give {_row(sweep, method, True)['0.5'] / dense:.2f}x.")
    return (lines or ["Every quality figure above holds."]) + _speed_misses(results)


def _speed_misses(results: dict[str, Any]) -> list[str]:
    """A bullet for each structured decode speed-up under 90% of `1 / (1 - removed)`, set
    against the roofline of the work that scales with the parameters; and one for a HARP
    model whose prefill came out slower than the dense model's."""
    peaks = results.get("timed_phase")
    lines = []
    for label, section in (("demo", results.get("structured")),
                           ("SmolLM2", results.get("smollm2_structured"))):
        if peaks is None or section is None or "decode_tokens_per_s" not in section:
            continue
        dense, pruned = section["dense_parameters"], section["pruned_parameters"]
        removed = 1 - pruned / dense
        speeds = section["decode_tokens_per_s"]
        for size in speeds["dense"]:
            ratio = speeds["pruned"][size] / speeds["dense"][size]
            if ratio >= 0.9 / (1 - removed):
                continue
            step_ms = int(size) * 1000 / speeds["dense"][size]
            read_ms = _read_ms(dense, peaks["read_gb_per_s"])
            flops_ms = 2 * dense * int(size) / (peaks["matmul_gflops"] * 1e9) * 1000
            scaled_ms = max(read_ms, flops_ms)
            predicted = step_ms / (step_ms - removed * scaled_ms)
            lines.append(
                f"- **{label}, decode @ {size}: {ratio:.2f}x against the ideal "
                f"{1 / (1 - removed):.2f}x.** Little of this step is work that scales with the "
                f"parameters: reading the weights once takes {read_ms:.2f} ms at the measured "
                f"{peaks['read_gb_per_s']} GB/s and their FLOPs {flops_ms:.2f} ms at "
                f"{peaks['matmul_gflops']} GFLOP/s, against a measured dense step of "
                f"{step_ms:.2f} ms. The rest (the engine's per-step scheduling, packing and "
                "sampling, attention over the cache) does not shrink with the model: with it "
                f"fixed and the weights' work at that roofline, removing {removed:.1%} of the "
                f"parameters gives {predicted:.2f}x.")
    harp = results.get("harp", {})
    prefill = harp.get("prefill_s", {})
    for name, seconds in prefill.items():
        if name != "dense" and seconds > prefill["dense"]:
            others = ", ".join(f"{other} {value / prefill['dense']:.2f}x"
                               for other, value in prefill.items()
                               if other not in ("dense", name))
            lines.append(
                f"- **HARP {name}: prefill {seconds / prefill['dense']:.2f}x the dense "
                "model's.** A HARP layer drops its attention (no QK^T, no softmax, no cache "
                "writes) and adds no other work, so it cannot be slower; the other HARP models "
                f"({others}) fall with each layer removed. This one figure is the shared "
                "machine's run-to-run spread in a single-prompt timing, not a cost of HARP.")
    return lines
