"""Activation hooks: what simulated quantization does to, and calibration reads from, the
activations a model's linear layers and KV cache see.

The hooks travel with the model: `with_activation_hooks(model, hooks)` returns a copy whose
`Attention`, `MLP` and `MoEBlock` modules hold an `ActivationHooks` as a static attribute
(`activation_hooks`, None in every model built by `Transformer`). Being part of the
model's graph definition, they are part of every program traced from that copy, and of no
other: nothing global is read while tracing, and a function jitted on the plain model
never sees them.

Linear inputs have names, their sites, in forward order within a block:

    "attention_input"   [B, T, D]     -> q_proj, k_proj, v_proj
    "attention_output"  [B, T, N, H]  -> o_proj
    "mlp_input"         [B, T, D]     -> gate_proj, up_proj (or the MoE block)
    "mlp_hidden"        [B, T, F]     -> down_proj

With `capture=True`, each module `sow`s every linear input it sees as an `nnx.Intermediate`
named by its site, which `capture_linear_inputs` collects through `nnx.capture`
(`jaxinfer.quant.calibration` uses this for GPTQ and SmoothQuant).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx

SITES = ("attention_input", "attention_output", "mlp_input", "mlp_hidden")

ModelT = TypeVar("ModelT", bound=nnx.Module)


@dataclasses.dataclass(frozen=True)
class ActivationHooks:
    """Functions applied to activations inside a model's blocks.

    Attributes:
        linear_inputs: Applied to the input of every linear layer inside the blocks (q/k/v,
            o, gate/up, down; the MoE block's input), e.g. a quantize-dequantize.
        keys_values: Applied to the `[B, T, K, H]` keys (after RoPE) and values of every
            layer before they are cached and attended to.
        key_value_pair: Applied to the keys and values together, `(keys, values) -> (keys,
            values)`, after `keys_values`: a rounding that treats them differently (KIVI's
            keys per channel and values per token, `jaxinfer.quant.kv_cache.kivi_round_trip`).
        capture: Sow every linear input (after `linear_inputs`) as an `nnx.Intermediate`
            named by its site.
    """

    linear_inputs: Callable[[jax.Array], jax.Array] | None = None
    keys_values: Callable[[jax.Array], jax.Array] | None = None
    key_value_pair: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None
    capture: bool = False


CAPTURE = ActivationHooks(capture=True)


def linear_input(module: nnx.Module, site: str, x: jax.Array) -> jax.Array:
    """`x` as the linear layers at `site` of `module` see it: itself unless the module
    holds hooks, else transformed by `linear_inputs` and, when capturing, sown."""
    hooks: ActivationHooks | None = module.activation_hooks
    if hooks is None:
        return x
    if hooks.linear_inputs is not None:
        x = hooks.linear_inputs(x)
    if hooks.capture:
        module.sow(nnx.Intermediate, site, x)
    return x


def cached_key_value(module: nnx.Module, x: jax.Array) -> jax.Array:
    """A key or value as `module`'s KV cache holds it: itself, or `keys_values(x)`."""
    hooks: ActivationHooks | None = module.activation_hooks
    if hooks is None or hooks.keys_values is None:
        return x
    return hooks.keys_values(x)


def cached_keys_values(module: nnx.Module, keys: jax.Array, values: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
    """Keys and values `[B, T, K, H]` as `module`'s KV cache holds them: `keys_values` on
    each, then `key_value_pair` on both (each hook only if set)."""
    keys, values = cached_key_value(module, keys), cached_key_value(module, values)
    hooks: ActivationHooks | None = module.activation_hooks
    if hooks is None or hooks.key_value_pair is None:
        return keys, values
    return hooks.key_value_pair(keys, values)


def with_activation_hooks(model: ModelT, hooks: ActivationHooks | None) -> ModelT:
    """A copy of `model` (or of one block) whose forward applies `hooks` (None: removes
    them). The copy shares the model's arrays; the model itself is unchanged."""
    model = nnx.clone(model)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "activation_hooks"):
            module.activation_hooks = hooks
    return model


def capture_linear_inputs(module: nnx.Module, *args: Any, **kwargs: Any
                          ) -> tuple[Any, dict[str, jax.Array]]:
    """Calls `module(*args, **kwargs)` under `nnx.capture` and returns its output and what
    it sowed, site name -> linear input. The module must hold `CAPTURE` hooks (see
    `with_activation_hooks`); it is not changed.

    Raises:
        ValueError: A site was seen more than once (a module called twice).
    """
    out, sown = nnx.capture(module, nnx.Intermediate)(*args, **kwargs)
    captured = {}
    for path, variable in nnx.to_flat_state(sown):
        values = variable.get_value()  # the tuple `sow` appended to
        if len(values) != 1:
            raise ValueError(f"{'.'.join(map(str, path))} was captured {len(values)} times")
        captured[str(path[-1])] = values[0]
    return out, captured
