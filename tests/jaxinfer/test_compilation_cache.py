"""The persistent compilation cache."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax

from jaxinfer import compilation_cache


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXINFER_COMPILATION_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_cache_dir() == tmp_path / "jaxinfer" / "xla"
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", str(tmp_path / "mine"))
    assert compilation_cache.default_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", "off")
    assert compilation_cache.default_cache_dir() is None


# A fresh process builds a tiny engine and warms it up, reporting the cache directory in use,
# the programs warm-up compiled and how many the persistent cache answered.
_WARM_UP = """
import json, sys
import jax
from jax._src import monitoring
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == '/jax/compilation_cache/cache_hits'
    else None)
from jaxinfer.engine.factory import load_engine
engine = load_engine('random:tiny', max_num_seqs=4, max_num_batched_tokens=32,
                     max_model_len=64, compilation_cache=sys.argv[1])
engine.warm_up()
print(json.dumps({'dir': jax.config.jax_compilation_cache_dir,
                  'programs': engine.compilations, 'hits': len(hits)}))
"""


def _warm_up(cache: str) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key != "JAXINFER_COMPILATION_CACHE"}
    done = subprocess.run([sys.executable, "-c", _WARM_UP, cache], capture_output=True,
                          text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_step_programs_from_the_cache(tmp_path):
    first = _warm_up(str(tmp_path))
    assert first["dir"] == str(tmp_path) and first["programs"] > 0
    assert any(pathlib.Path(tmp_path).iterdir())
    second = _warm_up(str(tmp_path))
    assert second["hits"] >= second["programs"] == first["programs"]


def test_the_cache_can_be_switched_off(tmp_path):
    assert _warm_up("off")["dir"] in (None, "")


def test_a_host_that_cannot_load_its_own_programs_keeps_the_cache_off(monkeypatch, tmp_path,
                                                                      caplog):
    # This host's loader works (the probe passes); a loader that refuses, as XLA:CPU's does on
    # some AVX-512 CPUs (jax-ml/jax#38445), leaves the cache off with XLA's reason logged.
    assert compilation_cache.host_loads_its_own_programs()

    def refuse(*args, **kwargs):
        raise RuntimeError("Target machine feature +prefer-no-gather is not supported")

    monkeypatch.setattr(compilation_cache, "deserialize_and_load", refuse)
    compilation_cache.host_loads_its_own_programs.cache_clear()
    configured = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert compilation_cache.enable_compilation_cache(tmp_path / "xla") is None
        assert not (tmp_path / "xla").exists()
        assert "+prefer-no-gather" in caplog.text
    finally:
        jax.config.update("jax_compilation_cache_dir", configured)
        compilation_cache.host_loads_its_own_programs.cache_clear()
