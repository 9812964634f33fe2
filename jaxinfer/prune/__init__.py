"""Pruning: structured (smaller dense models) and unstructured (masked weights)."""
