"""The sizes `LLM(model)` picks from the model and the machine."""

from __future__ import annotations

import pytest

from jaxinfer.config import get_preset
from jaxinfer.engine.auto_config import Machine, auto_engine_options
from jaxinfer.engine.config import EngineConfig
from jaxinfer.memory_plan import kv_bytes_per_token

GIB = 1 << 30


def test_cpu_defaults_fill_what_the_user_left_out():
    model = get_preset("bench-30m")
    options = auto_engine_options(model, {}, Machine("cpu", 16 * GIB))
    assert options["max_num_seqs"] == 64 and options["max_num_batched_tokens"] == 1024
    pages_per_sequence = -(-model.max_position_embeddings // 16)
    assert options["num_pages"] == 64 * pages_per_sequence + 1  # 16 GiB holds all of them
    EngineConfig.from_options(**options)  # a valid config
    mine = auto_engine_options(model, {"max_num_seqs": 8, "num_pages": 100},
                               Machine("cpu", 16 * GIB))
    assert mine == {"max_num_seqs": 8, "num_pages": 100, "max_num_batched_tokens": 1024}


def test_the_pool_takes_a_share_of_free_memory_and_shortens_the_context_if_it_must():
    model = get_preset("llama-3-8b").replace(dtype="bfloat16", param_dtype="bfloat16")
    token = kv_bytes_per_token(model, "bf16")
    free = 40 * GIB
    options = auto_engine_options(model, {}, Machine("gpu", free))
    assert options["max_num_seqs"] == 256 and options["max_num_batched_tokens"] == 2048
    assert options["num_pages"] == int(free * 0.8) // (token * 16)
    tight = auto_engine_options(model, {}, Machine("cpu", 2 * GIB))
    budget = int(2 * GIB * 0.25) // (token * 16)
    assert tight["num_pages"] == budget
    assert tight["max_model_len"] == (budget - 1) * 16 < model.max_position_embeddings
    EngineConfig.from_options(**tight).resolved(model.max_position_embeddings)


def test_more_sequences_than_the_default_step_raise_the_step():
    options = auto_engine_options(get_preset("tiny"), {"max_num_seqs": 2048},
                                  Machine("cpu", 16 * GIB))
    assert options["max_num_batched_tokens"] == 2048


def test_harp_layers_leave_room_for_more_pages():
    dense = get_preset("llama-3-8b").replace(dtype="bfloat16", param_dtype="bfloat16")
    harp = dense.replace(harp_alphas=(1.0,) * 8)  # 24 of 32 layers keep a cache
    machine = Machine("gpu", 40 * GIB)
    pages = [auto_engine_options(model, {}, machine)["num_pages"] for model in (dense, harp)]
    assert pages == [int(40 * GIB * 0.8) // (kv_bytes_per_token(model, "bf16") * 16)
                     for model in (dense, harp)]
    assert pages[1] == pytest.approx(pages[0] * 32 / 24, abs=1)
