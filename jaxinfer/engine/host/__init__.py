"""The engine's host side: requests, the KV-cache block pool and manager, the scheduler.

Pure Python and NumPy, no jax (an import-linter contract checks it), so its tests run in
milliseconds.
"""
