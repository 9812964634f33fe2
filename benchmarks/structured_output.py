"""What structured output costs: 32 concurrent requests, constrained against unconstrained.

    python benchmarks/structured_output.py [--rounds 5] [--model builtin:demo] [--out FILE]

One engine (32 sequences, warmed up), the same 32 prompts, greedy, EOS ignored where the mode
allows. Each round runs, back to back:
- **plain**: no constraint, 64 tokens each;
- **regex**: `[A-Za-z ,.]{1,2000}` (a request may still end early: the grammar allows the
  end of the output after any character, and a model may take it);
- **json schema**: an object with an integer, an enum and a string, compact; each request
  stops when its object closes;
- **plain, regex lengths** and **plain, json lengths**: no constraint, each request cut to
  the length its constrained answer had, so that each constrained mode is compared with the
  same tokens (the same prefill share) and differs only by the constraint's work.

It reports output tokens per second per mode (best of the rounds), the median over rounds of
each constrained mode's ratio to its unconstrained peer in the same round, and the programs
compiled during the runs (0: the bitmask is a fixed-shape input of every step). `--model`
takes any model `LLM` loads, a GGUF file included (e.g. the real SmolLM2-135M-Instruct that
`make smollm2-gguf` fetches).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "kind": {"enum": ["list", "dict", "set"]},
    "name": {"type": "string", "maxLength": 40}}, "required": ["id", "kind", "name"],
    "additionalProperties": False}
PROMPTS = ("The list type is", "To open a file, use the", "A dictionary maps", "Python is",
           "A function returns", "The loop runs", "Strings are", "A class defines")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="builtin:demo")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/structured_output.md"))
    args = parser.parse_args()

    import jsonschema

    from jaxinfer.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from jaxinfer.llm import LLM

    llm = LLM(args.model, max_num_seqs=args.requests, max_num_batched_tokens=512,
              max_model_len=256, warm_up=True)
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(args.requests)]
    modes = {
        "plain": None,
        "regex": StructuredOutputsParams(regex="[A-Za-z ,.]{1,2000}"),
        "json schema": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    }

    # Per constraint kind: the share of each run's wall time the engine thread spent on the
    # constraint itself (advancing matchers, taking masks, waits for the worker included).
    constraint_share: dict[str | bool, list[float]] = {}
    # Per kind: the mask computation's own CPU seconds over the machine's (wall x cores): a
    # floor under the cost on a machine whose "device" is these same cores.
    mask_share: dict[str | bool, list[float]] = {}

    def run(constraint: StructuredOutputsParams | None,
            lengths: list[int] | None = None) -> tuple[float, list[str], list[int]]:
        params = [SamplingParams(
            temperature=0.0, max_tokens=length, structured_outputs=constraint,
            ignore_eos=constraint is None or constraint.regex is not None)
            for length in lengths or [args.max_tokens] * len(prompts)]
        engine = llm.engine
        grammars = engine.input_processor.grammars
        work_before = engine.seconds["grammars"] + engine.runner.seconds["masks"]
        masks_before = grammars.mask_seconds
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        work = engine.seconds["grammars"] + engine.runner.seconds["masks"] - work_before
        kind = constraint is not None and constraint.kinds[0]
        constraint_share.setdefault(kind, []).append(work / seconds)
        mask_share.setdefault(kind, []).append(
            (grammars.mask_seconds - masks_before) / (seconds * (os.cpu_count() or 1)))
        counts = [len(output.outputs[0].token_ids) for output in outputs]
        return sum(counts) / seconds, [output.outputs[0].text for output in outputs], counts

    # Each constrained mode's peer: plain requests cut to the lengths that mode's answers had
    # (greedy: the same every round), so both run the same tokens with the same prefill share.
    peers = {"plain": "plain", "regex": "plain, regex lengths",
             "json schema": "plain, json lengths"}
    lengths = {}
    for name, constraint in modes.items():  # grammars compiled, caches warm
        lengths[name] = run(constraint)[2]
        if name != "plain":
            run(None, lengths[name])
    names = ["plain", "regex", "plain, regex lengths", "json schema", "plain, json lengths"]
    compiled_before = llm.engine.compilations
    rates: dict[str, list[float]] = {name: [] for name in names}
    texts: dict[str, list[str]] = {}
    for _ in range(args.rounds):
        for name in names:
            if name.startswith("plain, "):
                mode = next(mode for mode, peer in peers.items() if peer == name)
                rate, texts[name], _ = run(None, lengths[mode])
            else:
                rate, texts[name], _ = run(modes[name])
            rates[name].append(rate)
    compiled = llm.engine.compilations - compiled_before
    valid = sum(1 for text in texts["json schema"] if _valid(text, jsonschema))
    peers.update({name: name for name in names if name not in peers})
    ratios = {name: statistics.median(rates[name][i] / rates[peers[name]][i]
                                      for i in range(args.rounds)) for name in names}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    model = Path(args.model).name if args.model.endswith(".gguf") else args.model
    lines = [f"## Structured output at {args.requests} concurrent requests, {model} "
             f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)", "",
             f"Command: `python benchmarks/structured_output.py --rounds {args.rounds} "
             f"--requests {args.requests} --max-tokens {args.max_tokens} --model "
             f"{args.model if model == args.model else 'PATH/' + model}`  ",
             f"Machine: {platform.platform()}, {os.cpu_count()} CPUs; git {git}. "
             f"Greedy.", "",
             "| mode | output tok/s (best of rounds) | median ratio to its peer, same round |",
             "|---|---:|---:|"]
    for name in names:
        peer = "" if peers[name] == name else f" (to {peers[name]})"
        lines.append(f"| {name} | {max(rates[name]):.0f} | {ratios[name]:.3f}{peer} |")
    shares = {kind: statistics.median(values[-args.rounds:])
              for kind, values in constraint_share.items() if kind}
    lines += ["", "Engine-thread time spent on the constraint itself (advancing the matchers, "
              "taking the masks, waits for the mask worker included), median share of the "
              "run's wall time: " + ", ".join(f"{kind} {100 * share:.1f}%"
                                               for kind, share in shares.items()) + "."]
    cpu_shares = {kind: statistics.median(values[-args.rounds:])
                  for kind, values in mask_share.items() if kind}
    lines += ["", f"CPU time of the mask computation alone, median share of the machine "
              f"({os.cpu_count()} cores x the run's wall time): " + ", ".join(
                  f"{kind} {100 * share:.1f}%" for kind, share in cpu_shares.items()) + "."]
    lines += ["", f"JSON outputs that parse and validate against the schema: {valid} / "
              f"{len(texts['json schema'])}. Programs compiled during the timed runs: "
              f"{compiled}.", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    if not out.exists():
        out.write_text("# Structured output: what the constraint costs\n\n")
    with out.open("a") as handle:
        handle.write(text + "\n")
    return 0


def _valid(text: str, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
