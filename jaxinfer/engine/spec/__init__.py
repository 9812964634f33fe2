"""Speculative decoding: proposers (prompt lookup, a draft model) and exact verification."""
