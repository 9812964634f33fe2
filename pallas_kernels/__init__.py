"""Kernels for LLM inference, each beside its pure-jnp reference.

Each kernel lives in its own subpackage whose `__init__` exposes the public op: the Pallas
kernel on TPU, a GPU variant where one exists, and the XLA reference elsewhere. This package
imports nothing from the rest of the project.
"""
