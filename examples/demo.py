"""`make demo`: generate text with the built-in demo model through the `jaxinfer` CLI.

The demo model (`builtin:demo`, 8.4M parameters) was trained by this repository's
`train_distill` on the Python 3.11 documentation and ships in
`jaxinfer/builtin_models/demo/`. Until the serving issue replaces this with the server, the
demo is one greedy generation from `jaxinfer generate`.
"""

from __future__ import annotations

import subprocess
import sys

PROMPTS = ("The list type is", "To open a file, use the")


def main() -> int:
    """Runs one generation per prompt and prints it."""
    for prompt in PROMPTS:
        command = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", "builtin:demo",
                   "--prompt", prompt, "--max-tokens", "48"]
        print(f"$ jaxinfer generate --model builtin:demo --prompt {prompt!r} --max-tokens 48",
              flush=True)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            print(result.stderr, file=sys.stderr)
            return result.returncode
        print(prompt + result.stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
