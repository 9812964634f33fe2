"""TPU interpret mode for the kernel tests: the parameters the acceptance asks for, and the
race detector's verdict."""

from __future__ import annotations

from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

# Race detection on; uninitialized VMEM reads as NaN, so a kernel that uses memory it never
# wrote gives NaNs instead of passing by luck.
INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def races_found() -> bool:
    """Whether the interpreter's race detector saw a race since the last reset.

    The detector state is a module global of the interpreter (its documented way to report:
    `InterpretParams.detect_races`); it lives in `jax._src` as there is no public accessor.
    """
    races = interpret_pallas_call.races
    return bool(races is not None and races.races_found)
