"""The persistent compilation cache, on by default.

Compiled programs are written under the user's cache directory and read back by the next process
that compiles the same program (the same model shapes, engine sizes, jax version and flags), so
a second start of the same engine skips XLA. `enable_compilation_cache` turns it on unless the
user already chose a directory; the directory is `$JAXINFER_COMPILATION_CACHE` (default
`$XDG_CACHE_HOME/jaxinfer/xla`, i.e. `~/.cache/jaxinfer/xla`), and
`JAXINFER_COMPILATION_CACHE=off` (or the engine option `compilation_cache="off"`) switches it
off.

On the CPU, the cache is turned on only where this host can load a program it compiled
itself (`host_loads_its_own_programs`). On some AVX-512 CPUs XLA:CPU's loader rejects every
cached program, because it takes LLVM's tuning attributes (`+prefer-no-gather`) for CPU
features the host lacks (jax-ml/jax#38445). There the cache never hit: each process compiled
everything anyway, and also wrote it, and read every entry back only to reject it.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from jaxinfer.host_allocator import OFF

logger = logging.getLogger(__name__)

# Programs that compile faster than this are not written to the persistent cache (jax's
# default is 1 s; the engine's small helper programs add up to seconds at start-up).
_CACHE_MIN_COMPILE_SECONDS = 0.2


def default_cache_dir() -> pathlib.Path | None:
    """Where compiled programs are cached: `$JAXINFER_COMPILATION_CACHE`, else
    `$XDG_CACHE_HOME/jaxinfer/xla` (`~/.cache/jaxinfer/xla`); None when switched off."""
    chosen = os.environ.get("JAXINFER_COMPILATION_CACHE")
    if chosen is not None:
        return None if chosen.lower() in OFF else pathlib.Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxinfer" / "xla"


def enable_compilation_cache(directory: str | os.PathLike[str] | None = None
                             ) -> pathlib.Path | None:
    """Turns jax's persistent compilation cache on (once per process).

    Args:
        directory: Where to keep compiled programs; None: `default_cache_dir()`; "off":
            leave the cache off.

    Returns:
        The directory in use, or None when the cache is off. A directory the user set
        through jax's own `jax_compilation_cache_dir` is kept and returned.
    """

    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return pathlib.Path(configured)
    if directory is not None and str(directory).lower() in OFF:
        return None
    path = pathlib.Path(directory).expanduser() if directory is not None else (
        default_cache_dir())
    if path is None:
        return None
    if jax.default_backend() == "cpu" and not host_loads_its_own_programs():
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _CACHE_MIN_COMPILE_SECONDS)
    return path


@functools.cache
def host_loads_its_own_programs() -> bool:
    """Whether a program compiled here can be serialized and loaded back here (once per
    process; a small elementwise program, tens of milliseconds). False, with a warning naming
    XLA's reason, where the loader refuses it (see the module docstring)."""
    try:
        compiled = jax.jit(lambda x: jnp.tanh(x) * 2.0 + 1.0).lower(
            jax.ShapeDtypeStruct((64,), jnp.float32)).compile()
        deserialize_and_load(*serialize(compiled))
    except Exception as error:  # XLA's loader raises its own runtime error types
        logger.warning("the persistent compilation cache stays off: this host cannot load "
                       "the programs it compiles (%s: %s)", type(error).__name__, error)
        return False
    return True
