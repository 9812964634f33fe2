"""The `jaxinfer` command line.

    jaxinfer generate --model DIR (--prompt TEXT | --prompt-token-ids 1,2,3) [--max-tokens N]
                      [--temperature T] [--top-k K] [--top-p P] [--seed S] [--json]

With neither --prompt nor --prompt-token-ids the prompt text is read from stdin. With --json
one object `{"token_ids": [...], "text": "..."}` is printed for the generated part only;
`text` is null when the model directory has no tokenizer (then token ids are required).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


class CommandError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def _parse_token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids {text!r}: expected comma-separated integers like 1,2,3"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-token-ids is empty")
    return ids


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="continue one prompt with a model",
                                   description="Continue one prompt with a model.")
    parser.add_argument("--model", required=True,
                        help="HF checkpoint directory, jaxinfer checkpoint, builtin:demo "
                             "or random:PRESET")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (default: read stdin)")
    prompt.add_argument("--prompt-token-ids", type=_parse_token_ids,
                        help="prompt as comma-separated token ids; needs no tokenizer")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 disables top-p")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="parameter and compute dtype (default: the checkpoint's)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    # Imported here so that `jaxinfer --help` answers without initializing jax.
    from jaxinfer.generate import SamplingConfig, generate
    from jaxinfer.model_loading import load_model, resolve_model_path
    from jaxinfer.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(resolve_model_path(args.model))
    except FileNotFoundError:
        tokenizer = None
    if args.prompt_token_ids is not None:
        prompt_ids = args.prompt_token_ids
    else:
        text = args.prompt if args.prompt is not None else sys.stdin.read()
        if tokenizer is None:
            raise CommandError(f"{args.model} has no tokenizer files (tokenizer.json or "
                               f"tokenizer.model): pass --prompt-token-ids instead of text")
        if not text:
            raise CommandError("the prompt is empty (give --prompt, --prompt-token-ids or "
                               "text on stdin)")
        prompt_ids = tokenizer.encode(text)

    overrides = {"param_dtype": args.dtype, "dtype": args.dtype} if args.dtype else {}
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        model = load_model(args.model, **overrides)
        eos = () if args.ignore_eos else None  # None: the model's generation_config EOS
        [token_ids] = generate(model, [prompt_ids], max_new_tokens=args.max_tokens,
                               sampling=sampling, eos_token_ids=eos)
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise CommandError(str(error)) from None

    text = tokenizer.decode(token_ids) if tokenizer is not None else None
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text}, ensure_ascii=False))
    else:
        print(text if text is not None else " ".join(map(str, token_ids)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="jaxinfer",
                                     description="JAX/XLA inference for Llama-family models.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `jaxinfer` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except CommandError as error:
        print(f"jaxinfer {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
