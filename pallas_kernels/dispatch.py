"""Which implementation a public kernel op runs: the Pallas kernel, interpret mode, or XLA.

Every public op (`ragged_paged_attention`, `quantized_matmul`, the MoE grouped matmul) takes
`implementation=` with one of:

    "auto"       the Pallas TPU kernel on TPU, the XLA path everywhere else (the default)
    "xla"        force the XLA path
    "reference"  force the readable reference (the same as "xla" for ops with one jnp path)
    "pallas"     force the compiled Pallas kernel (fails off-TPU, where Mosaic cannot lower)
    "interpret"  the Pallas kernel in TPU interpret mode on any backend, with race detection
                 and NaN-filled uninitialized memory: the mode the CPU tests use

The model and the engine pass nothing, so a process-wide override decides for them:
`with force_implementation("interpret"): ...` or `JAXINFER_KERNELS=interpret`. The override
is read when a function is traced, so set it before the engine warms up.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from jax.experimental.pallas import tpu as pltpu

CHOICES = ("auto", "xla", "reference", "pallas", "interpret")
_ENVIRONMENT_VARIABLE = "JAXINFER_KERNELS"
_forced: list[str] = []


def _check(implementation: str) -> str:
    if implementation not in CHOICES:
        raise ValueError(f"unknown kernel implementation {implementation!r}; "
                         f"choose one of {', '.join(CHOICES)}")
    return implementation


@contextlib.contextmanager
def force_implementation(implementation: str) -> Iterator[None]:
    """Makes every op called with `implementation="auto"` run `implementation` inside."""
    _forced.append(_check(implementation))
    try:
        yield
    finally:
        _forced.pop()


def resolve(implementation: str = "auto") -> str:
    """The concrete implementation an op runs: "xla", "reference", "pallas" or "interpret".

    Args:
        implementation: One of `CHOICES`; "auto" takes the innermost `force_implementation`,
            else `$JAXINFER_KERNELS`, else the Pallas kernel on TPU and XLA elsewhere.

    Raises:
        ValueError: An unknown name (in the argument or the environment variable).
    """
    choice = _check(implementation)
    if choice == "auto":
        choice = _forced[-1] if _forced else _check(os.environ.get(_ENVIRONMENT_VARIABLE,
                                                                   "auto"))
    if choice == "auto":
        choice = "pallas" if jax.default_backend() == "tpu" else "xla"
    return choice


def interpret_mode(choice: str) -> bool | pltpu.InterpretParams:
    """The `interpret=` argument of `pallas_call` for a resolved choice."""
    if choice == "interpret":
        return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    return False
