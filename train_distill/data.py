"""Tokenized, packed training data and a loader whose position survives checkpoints.

Packing: every document becomes `<s> tokens </s>`, the documents of a split are concatenated
into one stream, and the stream is cut into fixed-length windows of `sequence_length + 1`
tokens (inputs and next-token targets overlap by one). Documents may straddle windows, as in
GPT-style pre-training; BOS/EOS mark the seams.

Loading: epoch `e` visits the windows in the order of a permutation drawn from
`numpy.random.default_rng((seed, e))`; the loader's whole state is `(epoch, index)`, saved with
every checkpoint so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxinfer.tokenizer import Tokenizer, load_tokenizer
from train_distill.corpus import read_documents


def tokenize_split(corpus_directory: str | Path, split: str, tokenizer: Tokenizer) -> np.ndarray:
    """The token stream of one split, `<s> doc </s>` per document, as int32."""
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_ids[0]
    pieces: list[np.ndarray] = []
    for document in read_documents(Path(corpus_directory) / f"{split}.txt"):
        ids = tokenizer.encode(document, add_special_tokens=False)
        pieces.append(np.asarray([bos, *ids, eos], np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


def prepare_token_files(corpus_directory: str | Path, tokenizer_directory: str | Path,
                        out: str | Path) -> dict:
    """Tokenizes train and validation into `out/{split}.npy` (uint16 when the vocab fits).

    Returns:
        The written `out/tokens.json`: token counts per split and the vocabulary size.
    """
    tokenizer = load_tokenizer(tokenizer_directory)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max else np.int32
    summary: dict = {"vocab_size": tokenizer.vocab_size, "splits": {}}
    for split in ("train", "validation"):
        stream = tokenize_split(corpus_directory, split, tokenizer)
        np.save(out / f"{split}.npy", stream.astype(dtype))
        summary["splits"][split] = int(stream.size)
    (out / "tokens.json").write_text(json.dumps(summary, indent=2))
    return summary


def pack(stream: np.ndarray, sequence_length: int) -> np.ndarray:
    """Cuts a token stream into `[num_windows, sequence_length + 1]` overlapping-by-one windows.

    Window i covers stream[i*L : i*L + L + 1]; the tail that cannot fill a window is dropped.
    """
    count = (stream.size - 1) // sequence_length
    if count < 1:
        raise ValueError(f"a stream of {stream.size} tokens cannot fill one window of "
                         f"{sequence_length + 1}")
    starts = np.arange(count) * sequence_length  # [W]
    return stream[starts[:, None] + np.arange(sequence_length + 1)[None, :]].astype(np.int32)


@dataclasses.dataclass
class LoaderState:
    """Where the loader is: the epoch and the next window within its permutation."""

    epoch: int = 0
    index: int = 0


class PackedLoader:
    """Deterministically shuffled batches of packed windows."""

    def __init__(self, windows: np.ndarray, batch_size: int, seed: int,
                 state: LoaderState | None = None) -> None:
        if batch_size > len(windows):
            raise ValueError(f"batch_size {batch_size} exceeds the {len(windows)} windows")
        self.windows = windows  # [W, T + 1]
        self.batch_size = batch_size
        self.seed = seed
        self.state = state or LoaderState()
        self._order = self._permutation(self.state.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.windows))

    def next_batch(self) -> np.ndarray:
        """The next `[B, T + 1]` int32 batch; an epoch's ragged tail is skipped."""
        if self.state.index + self.batch_size > len(self.windows):
            self.state = LoaderState(self.state.epoch + 1, 0)
            self._order = self._permutation(self.state.epoch)
        picked = self._order[self.state.index:self.state.index + self.batch_size]
        self.state = LoaderState(self.state.epoch, self.state.index + self.batch_size)
        return self.windows[picked]

    def restore(self, state: LoaderState) -> None:
        """Continues from a saved position."""
        self.state = LoaderState(state.epoch, state.index)
        self._order = self._permutation(self.state.epoch)
