"""Folding OSP's training-time parts away: the exported model is a plain Llama.

Outlier-Safe Pre-Training (METHODS.md section 3) trains with two architecture changes that
serving stacks do not know about: Single-Scale RMSNorm (one scalar gain per norm) and the
embedding projections (EmbProj: `R1` after the embedding lookup, `R2` between the final norm
and the LM head). Both are linear and fold exactly:

    embed(ids) @ R1            == (wte @ R1)[ids]          -> wte' = wte R1        [V, D]
    (norm(x) @ R2) @ W_head    == norm(x) @ (R2 W_head)    -> W_head' = R2 W_head  [D, V]
    normed * g (g a scalar)    == normed * (g * ones(D))   -> a per-channel gain  [D]

A tied model stops being tied once R1 != R2, so the folded model always has its own head.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.models import Transformer, abstract_model


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """A float32 product at full precision (the fold must not lose the 1e-5 parity)."""
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _broadcast_norms(tree: Any, size: int) -> Any:
    """Every `[1]` norm gain in a pure-dict parameter tree, broadcast to `[size]`."""
    if isinstance(tree, dict):
        return {key: _broadcast_norms(value, size) for key, value in tree.items()}
    if tree.ndim == 1 and tree.shape[0] == 1:
        return jnp.broadcast_to(tree, (size,))
    return tree


def fold_osp(model: Transformer) -> Transformer:
    """Returns the plain-Llama model computing the same function as an OSP-trained `model`.

    Args:
        model: A model whose config may have `norm_type="single_scale"` and/or
            `embedding_projection=True`.

    Returns:
        A model with `norm_type="rms"`, no embedding projections, untied if `model` had
        projections, in `model`'s parameter dtype; `model` itself is unchanged.
    """
    config = model.config
    if not config.uses_osp_parts:
        return model
    parameters = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    param_dtype = jnp.dtype(config.param_dtype)
    if config.norm_type == "single_scale":
        parameters = _broadcast_norms(parameters, config.hidden_size)
    folded_config = config.replace(norm_type="rms", embedding_projection=False)
    if config.embedding_projection:
        embedding = parameters["embed"]["weight"]  # [V, D]
        head = embedding.T if config.tie_word_embeddings else parameters["lm_head"]  # [D, V]
        input_projection = parameters.pop("input_projection")  # [D, D]
        output_projection = parameters.pop("output_projection")  # [D, D]
        parameters["embed"]["weight"] = _matmul(embedding, input_projection).astype(
            param_dtype)  # [V, D]
        parameters["lm_head"] = _matmul(output_projection, head).astype(param_dtype)  # [D, V]
        folded_config = folded_config.replace(tie_word_embeddings=False)
    folded = abstract_model(folded_config)
    state = nnx.state(folded, nnx.Param)
    nnx.replace_by_pure_dict(state, parameters)
    nnx.update(folded, state)
    return folded
