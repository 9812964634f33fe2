"""What structured output costs: 32 concurrent requests, constrained against unconstrained.

    python benchmarks/structured_output.py [--rounds 5] [--out FILE]

One engine (`builtin:demo`, 32 sequences, warmed up), the same 32 prompts, greedy, 64 tokens each
with EOS ignored. Each round runs, back to back:
- **plain**: no constraint;
- **regex**: `[A-Za-z ,.]{1,2000}`, which the grammar cannot finish within 64 tokens, so every
  request emits exactly as many tokens as plain and the two differ only in the masking work;
- **json schema**: an object with an integer, an enum and a string, compact (the requests
  finish when the object closes, so its tok/s is over fewer tokens).

It reports output tokens per second per mode (best of the rounds), the median over rounds of
each mode's ratio to plain in the same round, and the programs compiled during the runs (0:
the bitmask is a fixed-shape input of every step).
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    "id": {"type": "integer"}, "kind": {"enum": ["list", "dict", "set"]},
    "name": {"type": "string", "maxLength": 40}}, "required": ["id", "kind", "name"],
    "additionalProperties": False}
PROMPTS = ("The list type is", "To open a file, use the", "A dictionary maps", "Python is",
           "A function returns", "The loop runs", "Strings are", "A class defines")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/structured_output.md"))
    args = parser.parse_args()

    import jsonschema

    from jaxinfer.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from jaxinfer.llm import LLM

    llm = LLM("builtin:demo", max_num_seqs=args.requests, max_num_batched_tokens=512,
              max_model_len=256, warm_up=True)
    prompts = [PROMPTS[index % len(PROMPTS)] for index in range(args.requests)]
    modes = {
        "plain": None,
        "regex": StructuredOutputsParams(regex="[A-Za-z ,.]{1,2000}"),
        "json schema": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    }

    def run(constraint: StructuredOutputsParams | None) -> tuple[float, list[str]]:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                ignore_eos=constraint is None or constraint.regex is not None,
                                structured_outputs=constraint)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        return tokens / seconds, [output.outputs[0].text for output in outputs]

    for constraint in modes.values():  # grammars compiled, caches warm
        run(constraint)
    compiled_before = llm.engine.compilations
    rates: dict[str, list[float]] = {name: [] for name in modes}
    texts: dict[str, list[str]] = {}
    for _ in range(args.rounds):
        for name, constraint in modes.items():
            rate, texts[name] = run(constraint)
            rates[name].append(rate)
    compiled = llm.engine.compilations - compiled_before
    valid = sum(1 for text in texts["json schema"] if _valid(text, jsonschema))
    ratios = {name: statistics.median(rates[name][i] / rates["plain"][i]
                                      for i in range(args.rounds)) for name in modes}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    lines = [f"## Structured output at {args.requests} concurrent requests "
             f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)", "",
             f"Command: `python benchmarks/structured_output.py --rounds {args.rounds} "
             f"--requests {args.requests} --max-tokens {args.max_tokens}`  ",
             f"Machine: {platform.platform()}; git {git}. Model `builtin:demo`, greedy.", "",
             "| mode | output tok/s (best of rounds) | median ratio to plain, same round |",
             "|---|---:|---:|"]
    for name in modes:
        lines.append(f"| {name} | {max(rates[name]):.0f} | {ratios[name]:.3f} |")
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
