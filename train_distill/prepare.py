"""Builds everything training needs from scratch, offline: corpus, tokenizer, packed tokens.

    python -m train_distill.prepare --out data [--source python-docs] [--vocab-size 4096]

writes `data/corpus/`, `data/tokenizer/` and `data/tokens/` (deterministic for a given set of
source files; `data/corpus/manifest.json` records their checksums).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from train_distill.corpus import SOURCES, build_corpus
from train_distill.data import prepare_token_files
from train_distill.tokenizer_training import train_tokenizer


def prepare(out: str | Path, sources: Sequence[str] = ("python-docs",),
            vocab_size: int = 4096, max_documents: int | None = None,
            validation_percent: float = 3.0) -> dict:
    """Runs the three stages into `out/{corpus,tokenizer,tokens}`; returns a summary."""
    out = Path(out)
    manifest = build_corpus(out / "corpus", sources, validation_percent,
                            max_documents=max_documents)
    train_tokenizer(out / "corpus", out / "tokenizer", vocab_size)
    tokens = prepare_token_files(out / "corpus", out / "tokenizer", out / "tokens")
    return {"corpus": manifest, "tokens": tokens}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description="Build corpus, tokenizer and tokens.")
    parser.add_argument("--out", default="data")
    parser.add_argument("--source", action="append", choices=SOURCES)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    summary = prepare(args.out, args.source or ["python-docs"], args.vocab_size)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
