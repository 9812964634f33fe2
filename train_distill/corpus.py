"""An offline training corpus every machine can build: Python's own docs and sources.

Sources (no hub, no network):
    python-docs: the reStructuredText sources of the Python 3.11 documentation, as Debian's
        `python3.11-doc` package installs them (`/usr/share/doc/python3.11/html/_sources`).
        English prose about Python: the demo model's corpus.
    stdlib: the `.py` files of the running interpreter's standard library (tests, IDLE and
        vendored packages left out). Always present, so tests build their corpora from it.

Documents are split into train and validation by a hash of their relative path, so the split
of a document never depends on which other documents exist. The output directory holds
`train.txt`, `validation.txt` (documents separated by `DOCUMENT_SEPARATOR`) and
`manifest.json` (sources, counts and SHA-256 of each split).

    python -m train_distill.corpus --source python-docs --out data/corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

DOCS_DIRECTORY = Path("/usr/share/doc/python3.11/html/_sources")
_RECORD_SEPARATOR = "\x1e"  # ASCII record separator: absent from the sources
DOCUMENT_SEPARATOR = f"\n{_RECORD_SEPARATOR}\n"
SOURCES = ("python-docs", "stdlib")
_STDLIB_SKIPPED = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo",
                   "__pycache__", "ensurepip", "config-3.11-x86_64-linux-gnu")


def _docs_files(root: Path) -> Iterator[tuple[str, Path]]:
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root} not found: install Debian's python3.11-doc package "
            f"(`apt-get install python3.11-doc`, or `make corpus`)")
    for path in sorted(root.rglob("*.txt")):
        yield f"python-docs/{path.relative_to(root)}", path


def _stdlib_files(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in _STDLIB_SKIPPED for part in relative.parts):
            continue
        yield f"stdlib/{relative}", path


def iter_documents(sources: Sequence[str], docs_root: Path = DOCS_DIRECTORY,
                   stdlib_root: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yields `(name, text)` for every document of `sources`, in a fixed order."""
    for source in sources:
        if source == "python-docs":
            files = _docs_files(docs_root)
        elif source == "stdlib":
            files = _stdlib_files(stdlib_root or Path(sysconfig.get_paths()["stdlib"]))
        else:
            raise ValueError(f"unknown corpus source {source!r}; known: {SOURCES}")
        for name, path in files:
            text = path.read_text(encoding="utf-8", errors="replace").strip()
            if text and _RECORD_SEPARATOR not in text:
                yield name, text


def is_validation(name: str, validation_percent: float) -> bool:
    """Deterministic split: a document is held out when its name's hash falls low enough."""
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 10000
    return bucket < validation_percent * 100


def build_corpus(out: str | Path, sources: Sequence[str] = ("python-docs",),
                 validation_percent: float = 3.0, docs_root: Path = DOCS_DIRECTORY,
                 stdlib_root: Path | None = None, max_documents: int | None = None) -> dict:
    """Writes train.txt, validation.txt and manifest.json under `out`; returns the manifest.

    Args:
        out: Output directory (created).
        sources: Which of SOURCES to include, in order.
        validation_percent: Share of documents held out, by name hash.
        docs_root: Where the python-docs sources live.
        stdlib_root: The standard library to read; defaults to the running interpreter's.
        max_documents: Keep only the first N documents (small corpora for tests).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for index, (name, text) in enumerate(iter_documents(sources, docs_root, stdlib_root)):
        if max_documents is not None and index >= max_documents:
            break
        splits["validation" if is_validation(name, validation_percent) else "train"].append(
            text)
    manifest: dict = {"sources": list(sources), "validation_percent": validation_percent,
                      "python": sys.version.split()[0], "splits": {}}
    for split, documents in splits.items():
        body = DOCUMENT_SEPARATOR.join(documents)
        (out / f"{split}.txt").write_text(body, encoding="utf-8")
        manifest["splits"][split] = {
            "documents": len(documents), "characters": len(body),
            "sha256": hashlib.sha256(body.encode()).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def read_documents(path: str | Path) -> list[str]:
    """The documents of a split file written by `build_corpus`."""
    text = Path(path).read_text(encoding="utf-8")
    return [document for document in text.split(DOCUMENT_SEPARATOR) if document]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: build a corpus directory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", choices=SOURCES,
                        help="corpus source (repeatable); default python-docs")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--validation-percent", type=float, default=3.0)
    args = parser.parse_args(argv)
    manifest = build_corpus(args.out, args.source or ["python-docs"], args.validation_percent)
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
