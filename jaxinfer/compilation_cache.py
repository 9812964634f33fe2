"""The persistent compilation cache, on by default.

Compiled programs are written under the user's cache directory and read back by the next process
that compiles the same program (the same model shapes, engine sizes, jax version and flags), so
a second start of the same engine skips XLA. `enable_compilation_cache` turns it on unless the
user already chose a directory; the directory is `$JAXINFER_COMPILATION_CACHE` (default
`$XDG_CACHE_HOME/jaxinfer/xla`, i.e. `~/.cache/jaxinfer/xla`), and
`JAXINFER_COMPILATION_CACHE=off` (or the engine option `compilation_cache="off"`) switches it
off.
"""

from __future__ import annotations

import os
import pathlib

import jax

from jaxinfer.host_allocator import OFF

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
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _CACHE_MIN_COMPILE_SECONDS)
    return path
