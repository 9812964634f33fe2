"""Model configuration: one frozen, keyword-only dataclass for the Llama family.

`ModelConfig` describes every architecture jaxinfer runs (Llama 2/3, Mistral, Qwen2, Mixtral):
a decoder-only transformer with RMSNorm, RoPE, grouped-query attention and either a SwiGLU MLP
or a Mixtral-style mixture of experts. `ModelConfig.from_hf` reads a Hugging Face
`config.json` dict (both the transformers 4 spelling `rope_scaling` + `rope_theta` and the
transformers 5 spelling `rope_parameters`), and `to_hf` writes one back. `PRESETS` holds named
configurations, looked up by exact name with `get_preset`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
NORM_TYPES = ("rms", "single_scale")
# The config.json key of a HARP model (`ModelConfig.harp_alphas`), ours, not transformers':
# {"layers": [top block indices], "alphas": [one per layer]}. HF transformers ignores it and
# cannot run those layers (their q/k weights are absent from the safetensors).
HARP_CONFIG_KEY = "jaxinfer_harp"

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


class ConfigError(ValueError):
    """A model configuration field has a bad or unsupported value."""


def _fail(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config field {field!r} = {value!r}: {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as in transformers' `rope_parameters`.

    Attributes:
        rope_type: "default" (none), "linear" (positions divided by `factor`) or "llama3"
            (Llama 3.1's frequency-dependent scaling).
        factor: The scaling factor (linear, llama3).
        low_freq_factor: Llama 3 only: wavelengths above original_max / low_freq_factor are
            scaled by `factor`.
        high_freq_factor: Llama 3 only: wavelengths below original_max / high_freq_factor are
            kept; between the two bounds the frequencies are interpolated.
        original_max_position_embeddings: Llama 3 only: the context the model was trained on.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture and numerics of one decoder-only transformer.

    Attributes:
        model_type: One of SUPPORTED_MODEL_TYPES; decides the HF tensor names on export.
        vocab_size: Number of token ids (V).
        hidden_size: Model width (D).
        intermediate_size: MLP width (F), per expert for MoE models.
        num_layers: Number of decoder blocks (L).
        num_heads: Query heads (N).
        num_kv_heads: Key/value heads (K); N must be a multiple of K.
        head_dim: Per-head width (H); defaults to hidden_size // num_heads.
        rms_norm_eps: Epsilon inside RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: RoPE frequency scaling.
        max_position_embeddings: Longest context the model supports.
        sliding_window: If set, each query attends to at most this many keys (itself included).
        attention_bias: Whether q/k/v projections carry a bias (Qwen2).
        tie_word_embeddings: Whether the LM head reuses the embedding matrix.
        num_experts: Experts per MoE block (E); 0 means a dense MLP.
        num_experts_per_token: Experts each token is routed to (top-k).
        bos_token_id: Beginning-of-sequence id, if any.
        eos_token_ids: End-of-sequence ids (generation stops on any of them).
        param_dtype: Dtype parameters are stored in.
        dtype: Dtype activations are computed in (softmax and norms always run in float32).
        norm_type: "rms" (a per-channel RMSNorm gain, as every HF model) or "single_scale"
            (OSP's Single-Scale RMSNorm: one scalar gain per norm). Training-time only: the
            export folds it back to "rms".
        embedding_projection: OSP's EmbProj: learned `[D, D]` maps after the embedding lookup
            and between the final norm and the LM head. Training-time only, folded on export.
        harp_alphas: HARP (high-layer attention pruning with rescaling, `jaxinfer.prune.harp`):
            the rescaling factors alpha in [0, 1] of the top `len(harp_alphas)` blocks, in
            block order (the last entry is the top block's). Those blocks' attention has no
            q/k projections and no KV cache: each token attends only to itself, so the block
            adds `alpha * o_proj(v_proj(norm(h)))`; alpha = 0 skips the attention sub-block.
            Empty (the default): every block is a normal attention block. At least the
            bottom block keeps its attention, so every model has a KV cache.
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_token: int = 2
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    param_dtype: str = "float32"
    dtype: str = "float32"
    norm_type: str = "rms"
    embedding_projection: bool = False
    harp_alphas: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        if isinstance(self.eos_token_ids, int):
            object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "harp_alphas", tuple(float(a) for a in self.harp_alphas))
        self.validate()

    def validate(self) -> None:
        """Raises ConfigError naming the first field whose value is invalid."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise _fail("model_type", self.model_type, f"supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _fail(name, value, "must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise _fail("num_kv_heads", self.num_kv_heads,
                        f"must divide num_heads = {self.num_heads}")
        if self.head_dim % 2:
            raise _fail("head_dim", self.head_dim, "RoPE needs an even head dimension")
        if self.rms_norm_eps <= 0:
            raise _fail("rms_norm_eps", self.rms_norm_eps, "must be positive")
        if self.rope_theta <= 0:
            raise _fail("rope_theta", self.rope_theta, "must be positive")
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise _fail("rope_scaling.rope_type", self.rope_scaling.rope_type,
                        f"supported: {SUPPORTED_ROPE_TYPES}")
        if self.rope_scaling.factor <= 0:
            raise _fail("rope_scaling.factor", self.rope_scaling.factor, "must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise _fail("sliding_window", self.sliding_window, "must be positive or None")
        if self.num_experts < 0:
            raise _fail("num_experts", self.num_experts, "must be >= 0")
        if self.num_experts and not 1 <= self.num_experts_per_token <= self.num_experts:
            raise _fail("num_experts_per_token", self.num_experts_per_token,
                        f"must be in [1, num_experts = {self.num_experts}]")
        if self.norm_type not in NORM_TYPES:
            raise _fail("norm_type", self.norm_type, f"supported: {NORM_TYPES}")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in SUPPORTED_DTYPES:
                raise _fail(name, getattr(self, name), f"supported: {SUPPORTED_DTYPES}")
        if len(self.harp_alphas) >= self.num_layers:
            raise _fail("harp_alphas", self.harp_alphas,
                        f"at most num_layers - 1 = {self.num_layers - 1} HARP layers (the "
                        "bottom block keeps its attention and KV cache)")
        if any(not 0.0 <= alpha <= 1.0 for alpha in self.harp_alphas):
            raise _fail("harp_alphas", self.harp_alphas, "every alpha must be in [0, 1]")

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of every block is a mixture of experts."""
        return self.num_experts > 0

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (G)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_harp_layers(self) -> int:
        """Top blocks whose attention HARP pruned (no q/k projections, no KV cache)."""
        return len(self.harp_alphas)

    @property
    def num_cache_layers(self) -> int:
        """Blocks with a KV cache: the bottom `num_layers - num_harp_layers`. Block i < this
        reads and writes layer i of every cache (contiguous or paged), so a block's index is
        its cache layer's index; the HARP blocks above have no cache layer."""
        return self.num_layers - self.num_harp_layers

    def harp_alpha(self, layer: int) -> float | None:
        """Block `layer`'s HARP alpha, or None when it is a normal attention block."""
        if layer < self.num_cache_layers:
            return None
        return self.harp_alphas[layer - self.num_cache_layers]

    @property
    def uses_osp_parts(self) -> bool:
        """Whether the model has OSP's Single-Scale RMSNorm or embedding projections."""
        return self.norm_type != "rms" or self.embedding_projection

    def replace(self, **changes: Any) -> ModelConfig:
        """Returns a copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """All fields as JSON-ready values (the inverse of `from_dict`)."""
        fields = dataclasses.asdict(self)
        fields["eos_token_ids"] = list(self.eos_token_ids)
        fields["harp_alphas"] = list(self.harp_alphas)
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        """Rebuilds a config written by `to_dict`, naming any unknown field."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise _fail(unknown[0], fields[unknown[0]], "not a ModelConfig field")
        fields = dict(fields)
        if isinstance(fields.get("rope_scaling"), dict):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        if "eos_token_ids" in fields:
            fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
        if "harp_alphas" in fields:
            fields["harp_alphas"] = tuple(fields["harp_alphas"])
        return cls(**fields)

    # ------------------------------------------------------------------ HF conversion

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict.

        Args:
            hf_config: The parsed `config.json`.
            **overrides: Fields to set on top (e.g. `dtype="bfloat16"`).

        Returns:
            The equivalent ModelConfig.

        Raises:
            ConfigError: The model type, activation, RoPE type or another field is unsupported;
                the message names the field and its value.
        """
        model_type = hf_config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _fail("model_type", model_type, f"supported: {SUPPORTED_MODEL_TYPES}")
        activation = hf_config.get("hidden_act", "silu")
        if activation != "silu":
            raise _fail("hidden_act", activation, "only 'silu' (SwiGLU) is supported")
        if hf_config.get("mlp_bias"):
            raise _fail("mlp_bias", hf_config["mlp_bias"], "MLP biases are not supported")
        if hf_config.get("pretraining_tp", 1) not in (1, None):
            raise _fail("pretraining_tp", hf_config["pretraining_tp"], "only 1 is supported")
        for required in ("vocab_size", "hidden_size", "intermediate_size",
                         "num_hidden_layers", "num_attention_heads"):
            if required not in hf_config:
                raise _fail(required, None, "missing from the HF config")

        num_heads = hf_config["num_attention_heads"]
        rope_theta, rope_scaling = _rope_from_hf(hf_config)
        sliding_window = _sliding_window_from_hf(hf_config, model_type)

        attention_bias = bool(hf_config.get("attention_bias", False))
        if model_type == "qwen2":
            attention_bias = True  # Qwen2 always has q/k/v biases (and no o bias).

        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hf_config["hidden_size"],
            intermediate_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf_config.get("max_position_embeddings", 4096),
            sliding_window=sliding_window,
            attention_bias=attention_bias,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf_config.get("eos_token_id")),
        )
        if model_type == "mixtral":
            fields["num_experts"] = hf_config.get("num_local_experts", 8)
            fields["num_experts_per_token"] = hf_config.get("num_experts_per_tok", 2)
        if HARP_CONFIG_KEY in hf_config:
            fields["harp_alphas"] = _harp_alphas_from_hf(hf_config[HARP_CONFIG_KEY],
                                                         fields["num_layers"])
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
        if dtype in SUPPORTED_DTYPES:
            fields["param_dtype"] = dtype
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """Returns the Hugging Face `config.json` dict for this config.

        Raises:
            ConfigError: The config uses OSP training-time parts, which HF models lack; fold
                them first (`train_distill.osp.fold_osp`).
        """
        if self.uses_osp_parts:
            field = "norm_type" if self.norm_type != "rms" else "embedding_projection"
            raise _fail(field, getattr(self, field), "has no HF equivalent; fold the model "
                        "with train_distill.osp.fold_osp before exporting")
        rope: dict[str, Any] = {"rope_type": self.rope_scaling.rope_type,
                                "rope_theta": self.rope_theta}
        if self.rope_scaling.rope_type == "linear":
            rope["factor"] = self.rope_scaling.factor
        elif self.rope_scaling.rope_type == "llama3":
            rope.update(
                factor=self.rope_scaling.factor,
                low_freq_factor=self.rope_scaling.low_freq_factor,
                high_freq_factor=self.rope_scaling.high_freq_factor,
                original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
            )
        eos: int | list[int] | None
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        hf: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings, so that transformers 4 and 5 read the same RoPE.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": None if self.rope_scaling.rope_type == "default" else rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "dtype": self.param_dtype,
            "torch_dtype": self.param_dtype,
        }
        if self.model_type == "llama":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.model_type in ("mistral", "mixtral"):
            hf["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2":
            hf["use_sliding_window"] = self.sliding_window is not None
            hf["sliding_window"] = self.sliding_window
            hf["max_window_layers"] = 0
        if self.model_type == "mixtral":
            hf["num_local_experts"] = self.num_experts
            hf["num_experts_per_tok"] = self.num_experts_per_token
        if self.harp_alphas:
            hf[HARP_CONFIG_KEY] = {
                "layers": list(range(self.num_cache_layers, self.num_layers)),
                "alphas": list(self.harp_alphas),
            }
        return hf


def _harp_alphas_from_hf(entry: Any, num_layers: int) -> tuple[float, ...]:
    """The `harp_alphas` of a config.json's HARP_CONFIG_KEY entry, checked: its "layers"
    must be the top blocks in order, one alpha each."""
    key = HARP_CONFIG_KEY
    if not isinstance(entry, dict) or not isinstance(entry.get("alphas"), list):
        raise _fail(key, entry, 'must be an object {"layers": [...], "alphas": [...]}')
    alphas = entry["alphas"]
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in alphas):
        raise _fail(f"{key}.alphas", alphas, "must be numbers in [0, 1]")
    top = list(range(num_layers - len(alphas), num_layers))
    layers = entry.get("layers", top)
    if layers != top:
        raise _fail(f"{key}.layers", layers,
                    f"HARP layers must be the top {len(alphas)} of {num_layers}: {top}")
    return tuple(float(alpha) for alpha in alphas)


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(hf_config: dict[str, Any]) -> tuple[float, RopeScaling]:
    # transformers 5 folds the theta into `rope_parameters`; transformers 4 checkpoints keep
    # `rope_theta` at top level and put the scaling (or null) in `rope_scaling`.
    parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    field_name = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    theta = parameters.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _fail(f"{field_name}.rope_type", rope_type, f"supported: {SUPPORTED_ROPE_TYPES}")
    if hf_config.get("partial_rotary_factor", 1.0) != 1.0:
        raise _fail("partial_rotary_factor", hf_config["partial_rotary_factor"],
                    "only full rotary embeddings are supported")
    scaling = RopeScaling(rope_type=rope_type)
    if rope_type in ("linear", "llama3"):
        if "factor" not in parameters:
            raise _fail(f"{field_name}.factor", None, f"required for rope_type {rope_type!r}")
        scaling = dataclasses.replace(scaling, factor=float(parameters["factor"]))
    if rope_type == "llama3":
        try:
            scaling = dataclasses.replace(
                scaling,
                low_freq_factor=float(parameters["low_freq_factor"]),
                high_freq_factor=float(parameters["high_freq_factor"]),
                original_max_position_embeddings=int(
                    parameters["original_max_position_embeddings"]),
            )
        except KeyError as missing:
            raise _fail(f"{field_name}.{missing.args[0]}", None,
                        "required for rope_type 'llama3'") from None
    return float(theta), scaling


def _sliding_window_from_hf(hf_config: dict[str, Any], model_type: str) -> int | None:
    window = hf_config.get("sliding_window")
    if model_type == "llama":
        return None
    if model_type == "qwen2":
        if not hf_config.get("use_sliding_window", False):
            return None
        # Qwen2 slides only on layers >= max_window_layers; one window for all layers is what
        # we run, so only the all-layers case is exact.
        if hf_config.get("max_window_layers", 0) not in (0, None):
            raise _fail("max_window_layers", hf_config["max_window_layers"],
                        "per-layer sliding windows are not supported; need 0")
    return window if window else None


def _tiny() -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512,
    )


PRESETS: dict[str, ModelConfig] = {
    "tiny": _tiny(),
    "tiny-moe": _tiny().replace(model_type="mixtral", num_experts=4, num_experts_per_token=2),
    # The engine benchmark's target (`jaxinfer bench`): a 34M-parameter fp32 Llama, small
    # enough for random weights on a CPU, big enough that a step is compute, not dispatch.
    "bench-30m": ModelConfig(
        model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536,
        num_layers=8, num_heads=8, num_kv_heads=4, max_position_embeddings=2048),
    "llama-2-7b": ModelConfig(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, rms_norm_eps=1e-5,
        max_position_embeddings=4096, param_dtype="bfloat16", dtype="bfloat16"),
    "llama-2-70b": ModelConfig(
        model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=4096, param_dtype="bfloat16", dtype="bfloat16"),
    "llama-3-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009),
        param_dtype="bfloat16", dtype="bfloat16"),
    "llama-3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009), param_dtype="bfloat16", dtype="bfloat16"),
    # Llama-3-8B's drafter in speculative decoding: the same vocabulary, 1.2B parameters.
    "llama-3.2-1b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009), param_dtype="bfloat16", dtype="bfloat16"),
    "mistral-7b": ModelConfig(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, sliding_window=4096,
        max_position_embeddings=32768, param_dtype="bfloat16", dtype="bfloat16"),
    "qwen2-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
        attention_bias=True, max_position_embeddings=32768, bos_token_id=None,
        eos_token_ids=(151643, 151645), param_dtype="bfloat16", dtype="bfloat16"),
    "mixtral-8x7b": ModelConfig(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=1e6, num_experts=8,
        num_experts_per_token=2, max_position_embeddings=32768,
        param_dtype="bfloat16", dtype="bfloat16"),
}


def get_preset(name: str) -> ModelConfig:
    """Returns the preset called exactly `name`.

    Raises:
        KeyError: No preset has that name; the message lists the known ones.
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]
