"""The engine's device side: the jitted step over the paged cache (runner) and the sampler."""
