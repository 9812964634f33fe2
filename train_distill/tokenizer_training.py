"""Trains the sentencepiece tokenizer of the corpus and writes an HF-style tokenizer directory.

The settings keep text exact: identity normalization, no whitespace cleanup, no dummy prefix,
and byte fallback for anything outside the learned pieces (newlines included: sentencepiece
trains line by line, so "\\n" is always encoded as its byte token). Whitespace-only pieces are
allowed so that indentation in code samples becomes a few tokens, not one per space.

    python -m train_distill.tokenizer_training --corpus data/corpus --vocab-size 4096 \
        --out data/tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import sentencepiece

from train_distill.corpus import read_documents

SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
                  "pad_token": "<pad>"}


def train_tokenizer(corpus_directory: str | Path, out: str | Path, vocab_size: int = 4096,
                    max_sentences: int = 2_000_000, seed: int = 0) -> Path:
    """Trains a BPE sentencepiece model on `train.txt` and writes `out/tokenizer.model` with
    its `tokenizer_config.json`.

    Args:
        corpus_directory: What `train_distill.corpus.build_corpus` wrote.
        out: The tokenizer directory (created).
        vocab_size: Pieces in the model, special and byte pieces included.
        max_sentences: Lines sampled for training (sentencepiece's input_sentence_size).
        seed: Sampling seed, so the same corpus gives the same model.

    Returns:
        The output directory, loadable by `jaxinfer.tokenizer.load_tokenizer`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    documents = read_documents(Path(corpus_directory) / "train.txt")
    with tempfile.TemporaryDirectory() as scratch:
        lines_path = Path(scratch) / "lines.txt"
        lines_path.write_text("\n".join(line for document in documents
                                        for line in document.split("\n") if line.strip()),
                              encoding="utf-8")
        # Seeds sentencepiece's line sampling and shuffling (a process-wide setting).
        sentencepiece.set_random_generator_seed(seed)
        sentencepiece.SentencePieceTrainer.train(
            input=str(lines_path),
            model_prefix=str(Path(scratch) / "spm"),
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=0.9995,
            byte_fallback=True,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            normalization_rule_name="identity",
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            seed_sentencepiece_size=1_000_000,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>",
            num_threads=2,
            minloglevel=2,
        )
        (out / "tokenizer.model").write_bytes((Path(scratch) / "spm.model").read_bytes())
    config = {**SPECIAL_TOKENS, "add_bos_token": True, "add_eos_token": False,
              "model_max_length": 4096, "tokenizer_class": "LlamaTokenizer"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: train the tokenizer of a corpus directory."""
    parser = argparse.ArgumentParser(description="Train the corpus' sentencepiece tokenizer.")
    parser.add_argument("--corpus", required=True, help="corpus directory")
    parser.add_argument("--out", required=True, help="tokenizer directory to write")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(train_tokenizer(args.corpus, args.out, args.vocab_size, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
