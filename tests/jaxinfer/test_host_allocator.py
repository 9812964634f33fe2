"""glibc malloc tuned at import, unless told not to."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_import_tunes_glibc_malloc_unless_told_not_to():
    probe = "import jaxinfer, jaxinfer.host_allocator as r; print(r._state['malloc'])"
    tuned = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           check=True, env={**os.environ, "JAXINFER_TUNE_MALLOC": "1"})
    left = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, env={**os.environ, "JAXINFER_TUNE_MALLOC": "0"})
    assert tuned.stdout.strip() == "True" and left.stdout.strip() == "False"
