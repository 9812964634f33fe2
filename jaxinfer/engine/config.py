"""Engine options, composed of one part per user, and the command-line flags made from them.

    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=32),
                          cache=CacheConfig(kv_cache_dtype="int8"))
    config = EngineConfig.from_options(max_num_seqs=32, kv_cache_dtype="int8")  # vLLM's flat names
    config = EngineConfig.from_file("engine.toml")  # the same names in a TOML or YAML file

Each part is handed whole to the piece that reads it: `CacheConfig` to the KV cache manager and
the page pool, `SchedulerConfig` to the scheduler, `ParallelConfig` to the engine factory,
`SpeculativeConfig` to the proposer and the verifying step, `CompileConfig` to the runner's
bucketing, `RequestLimits` to the input processor (and the servers' request checks). A field
name appears in exactly one part, so the flat spelling that `LLM(...)`, `jaxinfer serve` and
`jaxinfer bench` take (vLLM's names) maps to one place, and `add_engine_arguments` builds
every command's flags from these classes: a new option is one field here, with its help text
in the field's metadata. A config file (`read_config_file`: TOML, or YAML where PyYAML imports)
holds the same flat names; `jaxinfer serve --config FILE`, `EngineConfig.from_file` and
`LLM(model, config=FILE)` read it.

No jax here (the host scheduler imports this module).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.engine.limits import RequestLimits
from jaxinfer.kv_formats import KIVI_BITS, KV_CACHE_DTYPES

SPECULATIVE_METHODS = ("ngram", "draft_model")
PREEMPTION_MODES = ("recompute", "swap")


class SchedulerConfigError(ValueError):
    """A scheduler or cache configuration field has a bad value (the message names it)."""


class ParallelConfigError(ValueError):
    """A parallel layout the model or the machine cannot take; the message says why."""


def _help(text: str, **metadata: Any) -> dict[str, Any]:
    """Field metadata: the flag's help text (and optional `flag`/`choices` overrides)."""
    return {"help": text, **metadata}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _scheduler_error(field: str, value: Any, why: str) -> SchedulerConfigError:
    return SchedulerConfigError(f"scheduler config field {field!r} = {value!r}: {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        page_size: Tokens per KV-cache page (vLLM's block_size).
        num_pages: Pages in the pool, the null page included; None sizes it for
            `max_num_seqs` sequences of `max_model_len` tokens.
        enable_prefix_caching: Share the KV pages of identical full prompt blocks.
        cache_dtype: KV page dtype; None means the model's compute dtype.
        kv_cache_dtype: A quantized KV cache (`jaxinfer.kv_formats`): "int8", "fp8_e4m3" or
            "fp8_e5m2" (one byte an element, one float32 scale per token and KV head), or
            KIVI's "int4" / "int2" (keys per channel over a page, values per token in groups,
            the newest partly filled page in float32); None keeps `cache_dtype`.
        kv_offload_bytes: Host memory for the host KV tier (`jaxinfer.engine.host.
            host_block_pool`): prefix-cache blocks the device pool evicts are copied there and
            copied back on a later prefix hit instead of being recomputed. 0 turns it off.
        preemption_mode: What happens to a preempted request's KV pages. "recompute" (the
            default) frees them; the request recomputes what is not found in the prefix
            cache when it resumes (with the host tier on, its evicted full blocks still go
            to host memory and are mostly found there). "swap" (needs the host tier) copies
            its full blocks to host memory now and pins them there until it resumes, so it
            never recomputes more than its partial last block, at the price of host slots
            the prefix cache cannot use meanwhile. Recompute is the default because it
            reserves nothing: under heavy preemption pinned swaps could crowd the host
            tier's prefix cache out, and vLLM (v1) made the same choice.
    """

    page_size: int = dataclasses.field(default=16, metadata=_help("tokens per KV page"))
    num_pages: int | None = dataclasses.field(
        default=None, metadata=_help("KV pages, the null page included (default: "
                                     "max-num-seqs sequences of max-model-len tokens)"))
    enable_prefix_caching: bool = dataclasses.field(
        default=True, metadata=_help("share the KV pages of identical prompt prefixes"))
    cache_dtype: str | None = dataclasses.field(
        default=None, metadata=_help("KV page dtype (default: the model's compute dtype)",
                                     choices=("float32", "bfloat16")))
    kv_cache_dtype: str | None = dataclasses.field(
        default=None, metadata=_help(
            "quantize the KV cache: int8, fp8_e4m3, fp8_e5m2 (scale per token and head), or "
            "KIVI int4 / int2 (keys per channel, values per token, newest page in float32)",
            choices=KV_CACHE_DTYPES[1:]))
    kv_offload_bytes: int = dataclasses.field(
        default=0, metadata=_help("host memory (bytes) for KV blocks evicted from the device "
                                  "pool, copied back on a prefix hit (0: off)"))
    preemption_mode: str = dataclasses.field(
        default="recompute", metadata=_help(
            "a preempted request's pages: 'recompute' frees them, 'swap' copies them to the "
            "host KV tier until it resumes (needs kv-offload-bytes)",
            choices=PREEMPTION_MODES))

    def __post_init__(self) -> None:
        if not _positive_int(self.page_size):
            raise _scheduler_error("page_size", self.page_size, "must be a positive integer")
        if self.num_pages is not None and not _positive_int(self.num_pages):
            raise _scheduler_error("num_pages", self.num_pages, "must be a positive integer")
        if not isinstance(self.enable_prefix_caching, bool):
            raise _scheduler_error("enable_prefix_caching", self.enable_prefix_caching,
                                   "must be a bool")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _scheduler_error("kv_cache_dtype", self.kv_cache_dtype,
                                   f"must be None or one of {KV_CACHE_DTYPES[1:]}")
        if self.kv_cache_dtype is not None and self.cache_dtype is not None:
            raise _scheduler_error("kv_cache_dtype", self.kv_cache_dtype,
                                   f"give cache_dtype ({self.cache_dtype!r}) or "
                                   f"kv_cache_dtype ({self.kv_cache_dtype!r}), not both")
        if (not isinstance(self.kv_offload_bytes, int) or isinstance(self.kv_offload_bytes, bool)
                or self.kv_offload_bytes < 0):
            raise _scheduler_error("kv_offload_bytes", self.kv_offload_bytes,
                                   "must be an integer >= 0 (0 turns the host tier off)")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise _scheduler_error("kv_offload_bytes", self.kv_offload_bytes,
                                   "the host KV tier keeps evicted prefix-cache blocks, so it "
                                   "needs enable_prefix_caching")
        if self.kv_offload_bytes and self.is_kivi:
            # The host tier copies whole pages; a KIVI request's newest tokens live in its
            # float residual seat, which is not a page and is not carried to the host.
            raise _scheduler_error("kv_offload_bytes", self.kv_offload_bytes,
                                   f"the host KV tier does not carry KIVI's residual pages; "
                                   f"use it with kv_cache_dtype None, int8 or fp8, not "
                                   f"{self.kv_cache_dtype!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise _scheduler_error("preemption_mode", self.preemption_mode,
                                   f"must be one of {PREEMPTION_MODES}")
        if self.preemption_mode == "swap" and not self.kv_offload_bytes:
            raise _scheduler_error("preemption_mode", self.preemption_mode,
                                   "'swap' copies pages to the host KV tier, which "
                                   "kv_offload_bytes = 0 turns off")

    @property
    def page_dtype(self) -> str | None:
        """What the page pool stores: a `kv_cache_dtype` ("int8", "fp8_e4m3", "int4", ...),
        a float dtype, or None (the model's)."""
        return self.kv_cache_dtype or self.cache_dtype

    @property
    def is_kivi(self) -> bool:
        """Whether the pool is KIVI's (int4 / int2), with a float32 residual pool."""
        return self.kv_cache_dtype in KIVI_BITS

    def pages_per_sequence(self, max_model_len: int) -> int:
        """Pages one `max_model_len` sequence needs."""
        return -(-max_model_len // self.page_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    Attributes:
        max_num_batched_tokens: Token budget of one step (prefill chunks and decodes).
        max_num_seqs: Most requests running at once.
        max_model_len: Longest sequence (prompt plus outputs); None means the model's
            max_position_embeddings. A request stops with FINISHED_LENGTH when it gets there.
    """

    max_num_batched_tokens: int = dataclasses.field(
        default=256, metadata=_help("token budget of one step"))
    max_num_seqs: int = dataclasses.field(default=16,
                                          metadata=_help("most requests running at once"))
    max_model_len: int | None = dataclasses.field(
        default=None, metadata=_help("longest prompt + output (default: the model's)"))

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if not _positive_int(getattr(self, name)):
                raise _scheduler_error(name, getattr(self, name), "must be a positive integer")
        if self.max_model_len is not None:
            if not _positive_int(self.max_model_len):
                raise _scheduler_error("max_model_len", self.max_model_len,
                                       "must be a positive integer")
            if self.max_model_len < 2:
                raise _scheduler_error("max_model_len", self.max_model_len,
                                       "must be >= 2 (one prompt token and one output token)")
        # Below this, the requests past the budget would starve behind the ones before them.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise _scheduler_error(
                "max_num_batched_tokens", self.max_num_batched_tokens,
                f"must be >= max_num_seqs = {self.max_num_seqs}, so that every running "
                "request can decode in each step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Tensor, data and expert parallel sizes (`jaxinfer.engine.parallel` builds the meshes).

    Attributes:
        tensor_parallel_size: Devices one model's heads and MLP are split over.
        data_parallel_size: Independent engine replicas.
        expert_parallel_size: Devices a MoE model's experts are split over (within a replica).
    """

    tensor_parallel_size: int = dataclasses.field(
        default=1, metadata=_help("devices one model is split over (heads, MLP, vocabulary)",
                                  short="-tp"))
    data_parallel_size: int = dataclasses.field(
        default=1, metadata=_help("independent engine replicas, each on its own devices",
                                  short="-dp"))
    expert_parallel_size: int = dataclasses.field(
        default=1, metadata=_help("devices a MoE model's experts are split over",
                                  short="-ep"))

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ParallelConfigError(f"{name} = {value!r}: must be an integer >= 1")

    @property
    def devices_per_replica(self) -> int:
        """Devices one replica's mesh holds: TP x EP."""
        return self.tensor_parallel_size * self.expert_parallel_size

    @property
    def world_size(self) -> int:
        """Devices the whole engine uses: TP x EP x DP."""
        return self.devices_per_replica * self.data_parallel_size

    @property
    def is_single_device(self) -> bool:
        return self.world_size == 1

    def check_model(self, config: ModelConfig) -> None:
        """Fails with a message when the model cannot be split as asked.

        Raises:
            ParallelConfigError: Heads, KV heads, MLP width or vocabulary not divisible by
                the TP size; EP on a dense model or experts not divisible by the EP size.
        """
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        for what, size in (("attention heads (num_heads)", config.num_heads),
                           ("KV heads (num_kv_heads)", config.num_kv_heads),
                           ("MLP width (intermediate_size)", config.intermediate_size),
                           ("vocabulary (vocab_size)", config.vocab_size)):
            if size % tp:
                raise ParallelConfigError(
                    f"tensor_parallel_size = {tp} does not divide the model's {size} {what}; "
                    f"use a TP size that divides {math.gcd(config.num_heads, config.num_kv_heads)}"
                    " (the KV heads bound it: each device keeps whole KV heads)")
        if ep > 1:
            if not config.is_moe:
                raise ParallelConfigError(
                    f"expert_parallel_size = {ep}, but the model has no experts (dense)")
            if config.num_experts % ep:
                raise ParallelConfigError(
                    f"expert_parallel_size = {ep} does not divide the model's "
                    f"{config.num_experts} experts")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How the engine drafts tokens (`jaxinfer.engine.spec`).

    Attributes:
        method: "ngram" (prompt lookup) or "draft_model".
        num_tokens: R, the most draft tokens verified per request and step.
        max_ngram: Longest suffix prompt lookup tries to match.
        min_ngram: Shortest suffix it tries before giving up (no drafts that step).
        model: The drafter for "draft_model" (anything `load_model` takes, e.g.
            "builtin:demo-draft"); it must share the target's tokenizer.
        adaptive: Speculate only in the regimes (batch size, sampling) where speculation
            has measured faster than plain decoding (`jaxinfer.engine.spec.gate`), and there
            choose each step how many drafts (0 .. num_tokens) each request gets, from its
            measured acceptance and the measured cost of the step
            (`jaxinfer.engine.spec.controller`); False always drafts num_tokens.
        probe_fraction: With `adaptive`, the share of time spent re-measuring what was turned
            off: the gate's re-checks of the mode it did not choose, and the controller's
            probes (a draft for a request it turned off, to measure its acceptance again).
    """

    method: str
    num_tokens: int
    max_ngram: int = 3
    min_ngram: int = 1
    model: str | None = None
    adaptive: bool = True
    probe_fraction: float = 0.02

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method = {self.method!r}: must be one of "
                             f"{SPECULATIVE_METHODS}")
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"speculative {name} = {value!r}: must be a positive integer")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"speculative min_ngram = {self.min_ngram} exceeds max_ngram = "
                             f"{self.max_ngram}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative adaptive = {self.adaptive!r}: must be a bool")
        if (isinstance(self.probe_fraction, bool)
                or not isinstance(self.probe_fraction, int | float)
                or not 0.0 <= self.probe_fraction < 1.0):
            raise ValueError(f"speculative probe_fraction = {self.probe_fraction!r}: must be "
                             "a number in [0, 1)")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative 'model' is required for method 'draft_model' and "
                             f"only allowed there; got method {self.method!r}, model "
                             f"{self.model!r}")

    @classmethod
    def parse(cls, options: SpeculativeConfig | Mapping[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """Accepts a config, a dict of its fields, that dict as JSON text (the flag's form),
        or None.

        Raises:
            ValueError: Bad JSON, an unknown key or a bad value.
        """
        if options is None or isinstance(options, SpeculativeConfig):
            return options
        if isinstance(options, str):
            try:
                options = json.loads(options)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative = {options!r}: not JSON ({error})") from None
            if not isinstance(options, dict):
                raise ValueError(f"speculative = {options!r}: must be a JSON object")
        fields = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(f"unknown speculative options {unknown}; valid: {sorted(fields)}")
        return cls(**options)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """What the device step is compiled for.

    Attributes:
        min_token_bucket: The smallest padded token count of a step.
        bucket_growth: Ratio of consecutive token and sequence buckets (2 pads least; 4
            compiles fewer programs, so warm-up is faster).
        enable_prompt_logprobs: Allow requests to ask for prompt logprobs (their step
            variant is compiled per token bucket on first use); they are rejected without it.
        compilation_cache: Directory of the persistent compilation cache; None: the default
            (`jaxinfer.compilation_cache.default_cache_dir`); "off": no cache.
    """

    min_token_bucket: int = dataclasses.field(default=8,
                                              metadata=_help("smallest token bucket"))
    bucket_growth: int = dataclasses.field(
        default=2, metadata=_help("ratio of consecutive buckets (larger: fewer programs to "
                                  "compile, more padding)"))
    enable_prompt_logprobs: bool = dataclasses.field(
        default=True, metadata=_help("allow prompt logprobs (their step compiles on first use)",
                                     alias="--prompt-logprobs"))
    compilation_cache: str | None = dataclasses.field(
        default=None, metadata=_help("persistent compilation cache directory ('off': none; "
                                     "default: ~/.cache/jaxinfer/xla)"))

    def __post_init__(self) -> None:
        if not _positive_int(self.min_token_bucket):
            raise ValueError(f"min_token_bucket = {self.min_token_bucket!r}: must be >= 1")
        if not _positive_int(self.bucket_growth) or self.bucket_growth < 2:
            raise ValueError(f"bucket_growth = {self.bucket_growth!r}: must be >= 2")


# The parts, in the order the flags are listed; `speculative` is not a dataclass of flags but
# one JSON option, handled apart.
_PARTS: dict[str, type] = {"cache": CacheConfig, "scheduler": SchedulerConfig,
                           "parallel": ParallelConfig, "compile": CompileConfig,
                           "limits": RequestLimits}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """All engine options, one part per user.

    Attributes:
        cache: The paged KV cache.
        scheduler: The step's token and sequence limits.
        parallel: Tensor, data and expert parallel sizes.
        speculative: Speculative decoding, as a `SpeculativeConfig` or a dict of its fields
            (e.g. `{"method": "ngram", "num_tokens": 4, "max_ngram": 3}`); None turns it off.
        compile: Bucketing and program variants of the device step.
        limits: What one request may ask for (`jaxinfer.engine.limits`).
    """

    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        if self.cache.is_kivi and self.speculative is not None:
            # A rejected draft that filled a page would leave it quantized with the draft's
            # keys, and full KIVI pages are never rewritten.
            raise _scheduler_error("kv_cache_dtype", self.cache.kv_cache_dtype,
                                   "KIVI pools do not take speculative decoding")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, ignore: Collection[str] = (),
                  **options: Any) -> EngineConfig:
        """An EngineConfig from a TOML or YAML config file of flat options (`read_config_file`).

            max_num_seqs = 64
            kv_cache_dtype = "int8"
            [speculative]
            method = "ngram"
            num_tokens = 4

        Args:
            path: The file; its suffix (.toml, .yaml, .yml) says how to read it.
            ignore: Keys the file may hold for someone else (a server's `host`, ...).
            **options: Flat options that override the file's.

        Raises:
            ConfigFileError: An unreadable file or a key that is no engine option (naming
                both).
            ValueError: A bad value (or an unknown option among `options`).
        """
        file_options = read_config_file(path)
        check_config_keys(path, file_options, [*engine_option_names(), *ignore])
        engine = {name: value for name, value in file_options.items() if name not in ignore}
        return cls.from_options(**{**engine, **options})

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """An EngineConfig from vLLM's flat option names (`max_num_seqs=32`, ...).

        Raises:
            ValueError: An unknown option (the valid ones are listed) or a bad value.
        """
        by_part: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        owner = option_owners()
        speculative = options.pop("speculative", None) if "speculative" in options else None
        unknown = sorted(name for name in options if name not in owner)
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; valid: "
                             f"{sorted([*owner, 'speculative'])}")
        for name, value in options.items():
            by_part[owner[name]][name] = value
        return cls(**{part: _PARTS[part](**fields) for part, fields in by_part.items()},
                   speculative=speculative)

    def options(self) -> dict[str, Any]:
        """The flat options this config was made of (`from_options` inverts it)."""
        flat: dict[str, Any] = {}
        for part in _PARTS:
            flat.update(dataclasses.asdict(getattr(self, part)))
        flat["speculative"] = (None if self.speculative is None
                               else dataclasses.asdict(self.speculative))
        return flat

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with some flat options changed."""
        return EngineConfig.from_options(**{**self.options(), **options})

    @property
    def max_model_len(self) -> int:
        """The resolved longest sequence (call `resolved` first)."""
        if self.scheduler.max_model_len is None:
            raise ValueError("max_model_len is not resolved yet (EngineConfig.resolved)")
        return self.scheduler.max_model_len

    @property
    def num_pages(self) -> int:
        """The resolved page count, the null page included (call `resolved` first)."""
        if self.cache.num_pages is None:
            raise ValueError("num_pages is not resolved yet (EngineConfig.resolved)")
        return self.cache.num_pages

    def resolved(self, model_max_len: int) -> EngineConfig:
        """This config with the None sizes filled in for a model.

        Raises:
            SchedulerConfigError: The pool cannot hold one `max_model_len` sequence.
        """
        max_model_len = self.scheduler.max_model_len or model_max_len
        pages_per_sequence = self.cache.pages_per_sequence(max_model_len)
        num_pages = self.cache.num_pages or self.scheduler.max_num_seqs * pages_per_sequence + 1
        if num_pages - 1 < pages_per_sequence:
            # Otherwise a long request could wait forever for pages that never exist.
            raise _scheduler_error(
                "num_pages", num_pages,
                f"must be >= {pages_per_sequence + 1}: one max_model_len = {max_model_len} "
                f"sequence needs {pages_per_sequence} blocks of {self.cache.page_size} tokens, "
                "plus the null block")
        return dataclasses.replace(
            self, cache=dataclasses.replace(self.cache, num_pages=num_pages),
            scheduler=dataclasses.replace(self.scheduler, max_model_len=max_model_len))


def option_owners() -> dict[str, str]:
    """{flat option name: the part that holds it}."""
    return {field.name: part for part, cls in _PARTS.items()
            for field in dataclasses.fields(cls)}


def engine_option_names() -> list[str]:
    """Every flat option `from_options`, `LLM(...)` and the config files take."""
    return [*option_owners(), "speculative"]


# ---------------------------------------------------------------------- config files

# Suffix -> format. YAML is read only where PyYAML imports (flax and orbax depend on it, so it
# is there wherever jaxinfer's dependencies are; jaxinfer itself does not require it).
CONFIG_FILE_FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}


class ConfigFileError(ValueError):
    """A config file that cannot be read or holds an unknown key (the message names both)."""


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The options of a TOML or YAML config file: a flat table of option names.

    A key may be spelled with dashes (`max-num-seqs`, as vLLM's YAML files do) or underscores;
    it comes back with underscores. A table (`[speculative]`) is one option whose value is a
    dict. Which keys are valid is the caller's to check (`check_config_keys`).

    Raises:
        ConfigFileError: No such file, an unknown suffix, a syntax error, YAML without PyYAML,
            a top level that is not a table, or one key spelled twice.
    """
    path = Path(path)
    kind = CONFIG_FILE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ConfigFileError(f"config file {path}: unknown format {path.suffix!r}; use "
                              f"{', '.join(CONFIG_FILE_FORMATS)}")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigFileError(f"config file {path}: {error.strerror or error}") from None
    if kind == "TOML":
        try:
            data: Any = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise ConfigFileError(f"config file {path}: not valid TOML ({error})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigFileError(
                f"config file {path}: reading YAML needs PyYAML (pip install pyyaml), or "
                "write the file as TOML") from None
        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as error:
            raise ConfigFileError(f"config file {path}: not valid YAML ({error})") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path}: must hold a table of options "
                              f"(name = value), not a {type(data).__name__}")
    options: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in options:
            raise ConfigFileError(f"config file {path}: option {name!r} is given twice")
        options[name] = value
    return options


def check_config_keys(path: str | os.PathLike[str], keys: Iterable[str],
                      valid: Collection[str]) -> None:
    """Refuses a config file key that is not in `valid`.

    Raises:
        ConfigFileError: Naming the first unknown key, the file, and the nearest valid name.
    """
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, list(valid), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigFileError(f"config file {path}: unknown option {key!r}{hint}")


# ---------------------------------------------------------------------- command-line flags

# What a server runs with where it differs from the library's defaults: more sequences and a
# larger step budget for many clients (`jaxinfer serve`). One program per token bucket (8 to
# 512: 7 programs) compiles in seconds, so the buckets stay fine-grained.
SERVING_DEFAULTS: dict[str, Any] = {"max_num_seqs": 32, "max_num_batched_tokens": 512}

# What `jaxinfer bench` runs with where it differs from the library's defaults. The benchmark
# measures a throughput-oriented batch, not a server's: every request is submitted at once, so
# a large step budget and many sequences keep the device busy, and prefix caching is off so
# that a repeated prompt costs the same on the engine and on the peers it is compared with.
BENCH_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 1024, "max_num_seqs": 64,
                                  "enable_prefix_caching": False}


def _flag_type(hint: Any) -> type:
    """int, float, str or bool from a field's resolved type hint (`int | None` -> int)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def add_engine_arguments(parser: argparse.ArgumentParser,
                         defaults: Mapping[str, Any] | None = None, *,
                         exclude: Collection[str] = ()) -> None:
    """Adds one flag per engine option (`--max-num-seqs`, ...; vLLM's names), grouped by part.

    Booleans get `--name` / `--no-name`. `--speculative` takes the SpeculativeConfig as JSON.

    Args:
        parser: The command's parser.
        defaults: Option defaults that differ from the config classes' (e.g.
            `SERVING_DEFAULTS`).
        exclude: Options the command sets itself, which get no flag (a flag it ignored
            would mislead); `engine_options_from_args` leaves them out.

    Raises:
        ValueError: An unknown option name in `defaults` or `exclude`.
    """
    defaults = dict(defaults or {})
    valid = {*option_owners(), "speculative"}
    unknown = sorted(set(defaults) - valid)
    if unknown:
        raise ValueError(f"unknown engine options in defaults: {unknown}")
    unknown = sorted(set(exclude) - valid)
    if unknown:
        raise ValueError(f"unknown engine options in exclude: {unknown}")
    for part, cls in _PARTS.items():
        group = parser.add_argument_group(f"engine: {part} ({cls.__name__})")
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name in exclude:
                continue
            default = defaults.get(field.name, field.default)
            flag = "--" + field.name.replace("_", "-")
            names = [flag] + [field.metadata[key] for key in ("alias", "short")
                              if key in field.metadata]
            kind = _flag_type(hints[field.name])
            text = field.metadata.get("help", "")
            if "default" not in text:
                text = f"{text} (default: {default})"
            if kind is bool:
                group.add_argument(*names, dest=field.name, default=default,
                                   action=argparse.BooleanOptionalAction,
                                   help=text)
                continue
            group.add_argument(*names, dest=field.name, type=kind, default=default,
                               choices=field.metadata.get("choices"),
                               help=text)
    if "speculative" in exclude:
        return
    parser.add_argument_group("engine: speculative (SpeculativeConfig)").add_argument(
        "--speculative", "--speculative-config", dest="speculative",
        default=defaults.get("speculative"), type=_speculative_flag, metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_tokens": 4}\' or '
             '\'{"method": "draft_model", "model": "builtin:demo-draft", "num_tokens": 4}\'')


def _speculative_flag(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flat engine options a parser built by `add_engine_arguments` read (those it has
    flags for: excluded options are left to the command)."""
    return {name: getattr(args, name) for name in [*option_owners(), "speculative"]
            if hasattr(args, name)}
