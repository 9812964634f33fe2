"""The serving step compiled ahead of time for a TPU slice that is described, not attached.

`pallas_kernels.aot` compiles single kernels for a TPU topology on a CPU machine. This module
does the same for the engine's whole jitted step on real model sizes: the model is built
abstractly (`nnx.eval_shape`: no weight is allocated), quantized abstractly where asked, and
handed to an `abstract` `ModelRunner` on the mesh `replica_meshes` builds from the topology's
devices, with the runner sizes `runner_config` derives from an `EngineConfig`: the same
program the engine would compile on that slice, lowered with the Pallas kernels forced on.

From the compiled program it reads:
- memory per chip: the weights and the KV page pool (the program's arguments, from their
  shardings), the temporaries and the generated code (`memory_analysis`);
- cost: FLOPs and bytes accessed (`cost_analysis`). The ragged paged attention kernel is a
  Mosaic custom call with no cost model, so the KV bytes a decode step reads (a function of
  the sequences' lengths, which the program does not know) are added analytically;
- collectives: all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute ops
  in the compiled HLO (`count_collectives`).

Needs libtpu (`make tpu-env`); everything here imports only jax at module level, so it loads
in the CPU environment too.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax

from jaxinfer.config import ModelConfig, get_preset
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.core import runner_config
from jaxinfer.engine.device.runner import ModelRunner
from jaxinfer.engine.device.step_io import STEP
from jaxinfer.engine.parallel import replica_meshes
from jaxinfer.models.transformer import Transformer, abstract_model
from jaxinfer.sharding import make_mesh

GIB = 1 << 30

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's published figures (Cloud TPU system architecture pages).

    Attributes:
        name: "v5e", ...
        hbm_bytes: HBM per chip (the published GiB figure).
        bf16_flops: Peak bf16 FLOP/s per chip.
        hbm_bandwidth: HBM bytes/s per chip.
    """

    name: str
    hbm_bytes: int
    bf16_flops: float
    hbm_bandwidth: float


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GIB, 275e12, 1200e9),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9),
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1640e9),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingCase:
    """A model served on a TPU slice: what to compile.

    Attributes:
        name: A label for tables.
        preset: The `jaxinfer.config.PRESETS` name of the model.
        topology: The slice, as `jax.experimental.topologies` names it ("v5e:2x4").
        tensor_parallel: TP of the replica.
        expert_parallel: EP of the replica (Mixtral).
        weights: "bf16", or "int8" (per-channel int8 block linears, LM head in bf16).
        kv_cache_dtype: None (the model's dtype) or "int8".
        num_layers: Override of the preset's depth (None: the real depth).
        options: Engine options (`EngineConfig.from_options` names) for the replica.
    """

    name: str
    preset: str
    topology: str
    tensor_parallel: int
    expert_parallel: int = 1
    weights: str = "bf16"
    kv_cache_dtype: str | None = None
    num_layers: int | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def chip(self) -> Chip:
        """The chip generation of the topology."""
        return CHIPS[self.topology.split(":")[0]]

    @property
    def model_config(self) -> ModelConfig:
        """The preset at this case's depth."""
        config = get_preset(self.preset)
        return config if self.num_layers is None else config.replace(num_layers=self.num_layers)

    def engine_config(self) -> EngineConfig:
        """The replica's engine config, resolved for the model."""
        options = dict(self.options, tensor_parallel_size=self.tensor_parallel,
                       expert_parallel_size=self.expert_parallel)
        if self.kv_cache_dtype is not None:
            options["kv_cache_dtype"] = self.kv_cache_dtype
        config = EngineConfig.from_options(**options)
        config.parallel.check_model(self.model_config)
        return config.resolved(self.model_config.max_position_embeddings)

    def replace(self, **changes: Any) -> ServingCase:
        """A copy with `changes`."""
        return dataclasses.replace(self, **changes)


def abstract_serving_model(config: ModelConfig, weights: str = "bf16") -> Transformer:
    """The model with shapes only, its block linears quantized abstractly for "int8"."""
    from flax import nnx

    from jaxinfer.quant.config import QuantizationConfig
    from jaxinfer.quant.linear import quantize_model

    if weights == "bf16":
        return abstract_model(config)
    if weights != "int8":
        raise ValueError(f"weights = {weights!r}: the AOT cases take 'bf16' or 'int8'")
    quantization = QuantizationConfig.for_method("rtn", bits=8)
    return nnx.eval_shape(lambda: quantize_model(Transformer(config, rngs=nnx.Rngs(0)),
                                                 quantization))


def _topology_devices(case: ServingCase, devices: Any) -> list[Any]:
    """`devices`, or the devices of `case`'s described TPU slice."""
    if devices is None:
        from pallas_kernels.aot import topology_devices

        devices = topology_devices(case.topology)
    return list(devices)


def abstract_runner(case: ServingCase, devices: Any = None, *,
                    scan_layers: bool = True) -> ModelRunner:
    """An abstract runner for `case` on the first replica mesh of the topology's devices
    (`scan_layers=False`: its step unrolls the layers, see `ModelRunner`)."""
    devices = _topology_devices(case, devices)
    config = case.engine_config()
    meshes = replica_meshes(config.parallel, devices=devices)
    # One chip still gets a (one-device) mesh: lowering under it tells Pallas which TPU the
    # kernels are for, where the engine would ask the attached device.
    mesh = make_mesh({"model": 1}, devices=devices[:1]) if meshes is None else meshes[0]
    return ModelRunner(abstract_serving_model(case.model_config, case.weights),
                       runner_config(config), mesh=mesh, abstract=True,
                       scan_layers=scan_layers)


def abstract_drafter_runner(case: ServingCase, devices: Any = None) -> ModelRunner | None:
    """The abstract runner of `case`'s draft model (speculative "draft_model" with a
    "random:PRESET" drafter), or None. The drafter runs on one device beside the target's
    first shard (`jaxinfer.engine.spec.draft_model`), with the target's page count."""
    from jaxinfer.engine.spec.draft_model import drafter_runner_config

    config = case.engine_config()
    speculative = config.speculative
    if speculative is None or speculative.method != "draft_model":
        return None
    if not str(speculative.model).startswith("random:"):
        raise ValueError(f"draft model {speculative.model!r}: the AOT cases take a "
                         "'random:PRESET' drafter (shapes only)")
    draft = get_preset(str(speculative.model).removeprefix("random:"))
    return ModelRunner(abstract_serving_model(draft), drafter_runner_config(
        runner_config(config)), mesh=make_mesh(
            {"model": 1}, devices=_topology_devices(case, devices)[:1]), abstract=True)


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op the compiled HLO has (async `-start` ops count once,
    their `-done` halves not at all)."""
    return {op: len(re.findall(rf"= [^=\n]*? {op}(?:-start)?\(", hlo_text))
            for op in COLLECTIVES}


def abstract_bytes_per_chip(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.shape if leaf.sharding is None else leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One compiled step program of a case.

    Attributes:
        num_tokens: T of the bucket.
        num_seqs: Q of the bucket (min(T, max_num_seqs)).
        compile_seconds: Lowering plus compiling.
        weight_bytes: Weights per chip (from the parameters' shardings).
        pool_bytes: KV pages and scales per chip.
        argument_bytes: Everything the program takes per chip (weights, pool, step inputs).
        temp_bytes: The compiler's temporaries per chip.
        code_bytes: Generated code.
        flops: Per chip, from `cost_analysis` (the attention kernel counts nothing).
        bytes_accessed: Per chip, from `cost_analysis` (likewise).
        collectives: Ops of each kind in the program.
    """

    num_tokens: int
    num_seqs: int
    compile_seconds: float
    weight_bytes: int
    pool_bytes: int
    argument_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    collectives: dict[str, int]

    @property
    def hbm_bytes(self) -> int:
        """HBM the program needs per chip: arguments, temporaries and code."""
        return self.argument_bytes + self.temp_bytes + self.code_bytes


def compile_step(runner: ModelRunner, num_tokens: int, kind: str = STEP) -> StepReport:
    """Compiles the runner's step for one token bucket (its Q follows) with the Pallas
    kernels; reports on it.

    Raises:
        Whatever the compiler raises (a kernel Mosaic rejects, a program that does not fit
        the chip's HBM).
    """
    from pallas_kernels.dispatch import force_implementation

    started = time.perf_counter()
    with force_implementation("pallas"):
        compiled = runner.lower(kind, num_tokens).compile()
    seconds = time.perf_counter() - started
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    return StepReport(
        num_tokens, runner.config.sequences_for(num_tokens), seconds,
        abstract_bytes_per_chip(runner.state),
        abstract_bytes_per_chip((runner.pages, runner.scales)),
        int(memory.argument_size_in_bytes), int(memory.temp_size_in_bytes),
        int(memory.generated_code_size_in_bytes), float(cost.get("flops", 0.0)),
        float(cost.get("bytes accessed", 0.0)), count_collectives(compiled.as_text()))


def page_bytes(runner: ModelRunner) -> int:
    """KV bytes one page takes on one chip (all layers, K and V, scales included)."""
    return abstract_bytes_per_chip((runner.pages, runner.scales)) // runner.config.num_pages


def largest_pool(report: StepReport, runner: ModelRunner, available_bytes: int) -> int:
    """The most pages whose pool fits beside the weights, inputs, temporaries and code of the
    step in `report` within `available_bytes` per chip (temporaries do not grow with the
    pool, which is donated and updated in place)."""
    fixed = report.hbm_bytes - report.pool_bytes
    return max(int((available_bytes - fixed) // page_bytes(runner)), 0)


def kv_read_bytes(runner: ModelRunner, num_seqs: int, context: int) -> int:
    """KV bytes per chip a step reads for `num_seqs` sequences of `context` tokens."""
    return page_bytes(runner) * num_seqs * math.ceil(context / runner.config.page_size)


def roofline_seconds(chip: Chip, flops: float, bytes_moved: float) -> float:
    """The roofline time of a step at bf16 peak (int8 weights are widened to bf16 in the
    matmul kernel, so they save bytes, not FLOPs): compute and memory overlap, so the
    slower one bounds."""
    return max(flops / chip.bf16_flops, bytes_moved / chip.hbm_bandwidth)
