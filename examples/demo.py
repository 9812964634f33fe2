"""`make demo`: build a checkpoint, then generate from it with the `jaxinfer` command line.

Until the built-in demo model (trained by `train_distill`) and the server land, the demo runs
the whole load-and-generate path on a randomly initialized `tiny` preset: it exports the
model as a Hugging Face checkpoint directory, then calls `jaxinfer generate` on it, which
loads the safetensors, prefills, decodes greedily and prints the tokens as JSON. The tokens
are those of a random model, so they carry no meaning; the path they travel is the real one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from checkpoints import save_hf_checkpoint
from jaxinfer.config import get_preset
from jaxinfer.models import create_model

DEMO_DIRECTORY = Path(".demo/tiny-random")


def main() -> int:
    """Exports the demo checkpoint if needed and runs one generation through the CLI."""
    if not (DEMO_DIRECTORY / "config.json").exists():
        print(f"writing a random 'tiny' checkpoint to {DEMO_DIRECTORY}/", flush=True)
        save_hf_checkpoint(create_model(get_preset("tiny"), seed=0), DEMO_DIRECTORY)
    command = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(DEMO_DIRECTORY),
               "--prompt-token-ids", "1,15,27,99", "--max-tokens", "16", "--json"]
    print("$ jaxinfer " + " ".join(command[3:]), flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
