"""The regression gate on compiled programs: `LLM(model)`'s default configuration compiles at
most a committed number of step programs, all of them at warm-up, and nothing afterwards.

Raising `PROGRAM_BUDGET` is a decision (warm-up time grows with it): say why in the commit.
"""

from __future__ import annotations

from jax._src import monitoring

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import get_preset
from jaxinfer.engine.auto_config import Machine, auto_engine_options

# One program per token bucket, 8 to 1024 (CPU defaults): 8.
PROGRAM_BUDGET = 8

_compiles: list[str] = []


def _count(event: str, duration: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles.append(event)


monitoring.register_event_duration_secs_listener(_count)


def test_the_default_configuration_stays_within_the_program_budget():
    options = auto_engine_options(get_preset("tiny"), {}, Machine("cpu", 16 << 30))
    # The pool's size does not change the programs' count; a small one keeps the test light.
    llm = LLM("random:tiny", **{**options, "num_pages": 64, "max_model_len": 128})
    assert llm.engine.compilations <= PROGRAM_BUDGET
    warmed = len(_compiles)
    prompts = [{"prompt_token_ids": list(range(3, 3 + length))} for length in (5, 40, 90)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    llm.generate(prompts * 4, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1,
                                             logprobs=2, max_tokens=6, ignore_eos=True))
    assert len(_compiles) == warmed  # no XLA compile at all after warm-up
    assert llm.engine.compilations <= PROGRAM_BUDGET
