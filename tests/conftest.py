"""Test session setup: 8 simulated CPU devices, so sharding tests run on any machine.

XLA reads the flag when jax initializes its backends, so it is set here, before any test
module imports jax. Unsharded code runs on device 0 as usual.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
