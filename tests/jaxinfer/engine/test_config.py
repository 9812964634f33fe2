"""EngineConfig: flat options in and out, each part's checks, resolved sizes, the
command-line flags built from the parts, and config files (TOML, YAML). No jax."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import pytest
import yaml

from jaxinfer.config import get_preset
from jaxinfer.engine.config import (
    SERVING_DEFAULTS,
    CacheConfig,
    CompileConfig,
    ConfigFileError,
    EngineConfig,
    ParallelConfig,
    ParallelConfigError,
    SchedulerConfig,
    SchedulerConfigError,
    SpeculativeConfig,
    add_engine_arguments,
    engine_options_from_args,
    option_owners,
    read_config_file,
)
from jaxinfer.engine.limits import RequestLimits

# Every flat option set away from its default (and valid together), except the host KV tier's,
# which needs the prefix caching turned off here (tests/jaxinfer/engine/device/test_kv_offload.py
# round-trips them).
CHANGED = dict(page_size=8, num_pages=100, enable_prefix_caching=False, cache_dtype=None,
               kv_cache_dtype="int8", kv_offload_bytes=0, preemption_mode="recompute",
               max_num_batched_tokens=64, max_num_seqs=4,
               max_model_len=256, tensor_parallel_size=2, data_parallel_size=3,
               expert_parallel_size=1, min_token_bucket=4, bucket_growth=4,
               enable_prompt_logprobs=False, compilation_cache="off",
               max_n=8, max_stop_strings=4, max_stop_string_chars=32, max_stop_token_ids=8,
               max_logit_bias_entries=10, max_logit_bias=5.0, max_temperature=2.0,
               max_repetition_penalty=3.0, max_prompts_per_request=2, max_prompt_chars=1000,
               speculative={"method": "ngram", "num_tokens": 3, "max_ngram": 4,
                            "min_ngram": 2, "model": None, "adaptive": False,
                            "probe_fraction": 0.05})


def test_from_options_round_trips_through_options():
    config = EngineConfig.from_options(**CHANGED)
    assert config.options() == CHANGED
    assert EngineConfig.from_options(**config.options()) == config
    assert config.cache.page_size == 8 and config.scheduler.max_num_seqs == 4
    assert config.parallel.data_parallel_size == 3 and config.compile.bucket_growth == 4
    assert config.speculative == SpeculativeConfig(method="ngram", num_tokens=3, max_ngram=4,
                                                   min_ngram=2, adaptive=False,
                                                   probe_fraction=0.05)
    default = EngineConfig()
    assert EngineConfig.from_options(**default.options()) == default
    assert EngineConfig.from_options() == default


def test_every_option_belongs_to_one_part():
    owners = option_owners()
    parts = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
             "compile": CompileConfig, "limits": RequestLimits}
    names = [field.name for cls in parts.values() for field in dataclasses.fields(cls)]
    assert len(names) == len(set(names)) == len(owners)
    assert set(EngineConfig().options()) == {*owners, "speculative"}


def test_replace_changes_only_what_it_names():
    config = EngineConfig.from_options(**CHANGED)
    changed = config.replace(max_num_seqs=2, speculative=None)
    assert changed.options() == {**CHANGED, "max_num_seqs": 2, "speculative": None}
    assert config.scheduler.max_num_seqs == 4  # frozen: the original is untouched


def test_unknown_options_are_listed_with_the_valid_ones():
    with pytest.raises(ValueError) as raised:
        EngineConfig.from_options(max_num_seq=4, block_size=16, page_size=8)
    message = str(raised.value)
    assert "unknown engine options ['block_size', 'max_num_seq']" in message
    assert "'max_num_seqs'" in message and "'speculative'" in message


@pytest.mark.parametrize(("options", "error", "fragment"), [
    # cache
    (dict(page_size=0), SchedulerConfigError, "'page_size' = 0"),
    (dict(page_size=2.5), SchedulerConfigError, "'page_size' = 2.5"),
    (dict(num_pages=True), SchedulerConfigError, "'num_pages' = True"),
    (dict(enable_prefix_caching="yes"), SchedulerConfigError,
     "'enable_prefix_caching' = 'yes': must be a bool"),
    (dict(kv_cache_dtype="fp8"), SchedulerConfigError, "'kv_cache_dtype' = 'fp8'"),
    (dict(kv_cache_dtype="int8", cache_dtype="bfloat16"), ValueError,
     "give cache_dtype ('bfloat16') or kv_cache_dtype ('int8'), not both"),
    # scheduler
    (dict(max_num_batched_tokens=0), SchedulerConfigError, "'max_num_batched_tokens' = 0"),
    (dict(max_num_seqs=-1), SchedulerConfigError, "'max_num_seqs' = -1"),
    (dict(max_num_seqs=True), SchedulerConfigError, "'max_num_seqs' = True"),
    (dict(max_model_len=1), SchedulerConfigError, "'max_model_len' = 1: must be >= 2"),
    (dict(max_model_len=64.0), SchedulerConfigError, "'max_model_len' = 64.0"),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), SchedulerConfigError,
     "'max_num_batched_tokens' = 8: must be >= max_num_seqs = 16"),
    # parallel
    (dict(tensor_parallel_size=0), ParallelConfigError, "tensor_parallel_size = 0"),
    (dict(data_parallel_size=1.0), ParallelConfigError, "data_parallel_size = 1.0"),
    (dict(expert_parallel_size=-2), ParallelConfigError, "expert_parallel_size = -2"),
    # compile
    (dict(min_token_bucket=0), ValueError, "min_token_bucket = 0"),
    (dict(bucket_growth=1), ValueError, "bucket_growth = 1: must be >= 2"),
    # speculative
    (dict(speculative={"method": "medusa", "num_tokens": 2}), ValueError,
     "speculative method = 'medusa'"),
    (dict(speculative={"method": "ngram", "num_tokens": 0}), ValueError,
     "speculative num_tokens = 0"),
    (dict(speculative={"method": "ngram", "num_tokens": 2, "min_ngram": 3, "max_ngram": 2}),
     ValueError, "speculative min_ngram = 3 exceeds max_ngram = 2"),
    (dict(speculative={"method": "draft_model", "num_tokens": 2}), ValueError,
     "'model' is required for method 'draft_model'"),
    (dict(speculative={"method": "ngram", "num_tokens": 2, "model": "builtin:demo-draft"}),
     ValueError, "only allowed there"),
    (dict(speculative={"method": "ngram", "num_tokens": 2, "k": 3}), ValueError,
     "unknown speculative options ['k']"),
    (dict(speculative="{not json"), ValueError, "not JSON"),
    (dict(speculative="[1, 2]"), ValueError, "must be a JSON object"),
])
def test_each_part_names_its_bad_field(options, error, fragment):
    with pytest.raises(error) as raised:
        EngineConfig.from_options(**options)
    assert fragment in str(raised.value)


def test_speculative_takes_a_config_a_dict_or_json():
    spec = SpeculativeConfig(method="draft_model", num_tokens=3, model="builtin:demo-draft")
    as_dict = {"method": "draft_model", "num_tokens": 3, "model": "builtin:demo-draft"}
    as_json = '{"method": "draft_model", "num_tokens": 3, "model": "builtin:demo-draft"}'
    for given in (spec, as_dict, as_json):
        assert EngineConfig(speculative=given).speculative == spec
    assert EngineConfig(speculative=None).speculative is None


def test_resolved_fills_the_sizes_from_the_model():
    config = EngineConfig.from_options(page_size=16, max_num_seqs=4,
                                       max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="not resolved"):
        _ = config.max_model_len
    with pytest.raises(ValueError, match="not resolved"):
        _ = config.num_pages
    resolved = config.resolved(100)
    # ceil(100 / 16) = 7 pages per sequence, for 4 sequences, plus the null page.
    assert (resolved.max_model_len, resolved.num_pages) == (100, 4 * 7 + 1)
    assert resolved.resolved(100) == resolved
    assert resolved.replace(max_model_len=None, num_pages=None) == config
    explicit = config.replace(max_model_len=32, num_pages=3).resolved(100)
    assert (explicit.max_model_len, explicit.num_pages) == (32, 3)
    with pytest.raises(SchedulerConfigError, match="'num_pages' = 2: must be >= 3"):
        config.replace(max_model_len=32, num_pages=2).resolved(100)


def test_parallel_sizes_and_model_checks():
    parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=3)
    assert (parallel.devices_per_replica, parallel.world_size) == (2, 6)
    assert not parallel.is_single_device and ParallelConfig().is_single_device
    tiny = get_preset("tiny")  # 4 heads, 2 KV heads, a dense MLP
    parallel.check_model(tiny)
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size = 4 does not divide "
                                                  "the model's 2 KV heads"):
        ParallelConfig(tensor_parallel_size=4).check_model(tiny)
    with pytest.raises(ParallelConfigError, match="no experts"):
        ParallelConfig(expert_parallel_size=2).check_model(tiny)
    moe = get_preset("tiny-moe")  # 4 experts
    ParallelConfig(expert_parallel_size=2).check_model(moe)
    with pytest.raises(ParallelConfigError, match="does not divide the model's 4 experts"):
        ParallelConfig(expert_parallel_size=3).check_model(moe)


# ---------------------------------------------------------------------- flags


def _parser(defaults=None):
    parser = argparse.ArgumentParser(prog="jaxinfer-test", exit_on_error=False)
    add_engine_arguments(parser, defaults)
    return parser


def _config(argv, defaults=None):
    return EngineConfig.from_options(**engine_options_from_args(_parser(defaults).parse_args(
        argv)))


def test_every_option_has_a_flag():
    flags = _parser()._option_string_actions
    for name in [*option_owners(), "speculative"]:
        assert flags["--" + name.replace("_", "-")].dest == name


def test_no_flags_give_the_library_defaults():
    assert _config([]) == EngineConfig()


def test_serving_defaults_are_applied_and_flags_override_them():
    served = _config([], SERVING_DEFAULTS)
    assert served == EngineConfig.from_options(**SERVING_DEFAULTS)
    assert served.scheduler.max_num_seqs == SERVING_DEFAULTS["max_num_seqs"] != (
        SchedulerConfig().max_num_seqs)
    assert _config(["--max-num-seqs", "3"], SERVING_DEFAULTS).scheduler.max_num_seqs == 3
    assert f"(default: {SERVING_DEFAULTS['max_num_seqs']})" in " ".join(
        _parser(SERVING_DEFAULTS).format_help().split())


def test_unknown_defaults_are_refused():
    with pytest.raises(ValueError, match=r"unknown engine options in defaults: \['max_seqs'\]"):
        _parser({"max_seqs": 4})


def test_every_flag_sets_its_option():
    argv = ["--page-size", "8", "--num-pages", "100", "--no-enable-prefix-caching",
            "--kv-cache-dtype", "int8", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
            "--max-model-len", "256", "-tp", "2", "--data-parallel-size", "3", "-ep", "1",
            "--min-token-bucket", "4", "--bucket-growth", "4", "--no-enable-prompt-logprobs",
            "--compilation-cache", "off", "--max-n", "8", "--max-stop-strings", "4",
            "--max-stop-string-chars", "32", "--max-stop-token-ids", "8",
            "--max-logit-bias-entries", "10", "--max-logit-bias", "5", "--max-temperature", "2",
            "--max-repetition-penalty", "3", "--max-prompts-per-request", "2",
            "--max-prompt-chars", "1000",
            "--speculative", '{"method": "ngram", "num_tokens": 3, "max_ngram": 4, '
                             '"min_ngram": 2, "adaptive": false, "probe_fraction": 0.05}']
    assert _config(argv).options() == CHANGED


@pytest.mark.parametrize(("argv", "name", "expected"), [
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--enable-prompt-logprobs"], "enable_prompt_logprobs", True),
    (["--no-enable-prompt-logprobs"], "enable_prompt_logprobs", False),
    (["--prompt-logprobs"], "enable_prompt_logprobs", True),  # the short alias
    (["--no-prompt-logprobs"], "enable_prompt_logprobs", False),
    (["-dp", "2"], "data_parallel_size", 2),
    (["--cache-dtype", "bfloat16"], "cache_dtype", "bfloat16"),
])
def test_boolean_and_alias_flags(argv, name, expected):
    # Start from the opposite default, so a flag that did nothing would fail.
    defaults = {name: not expected} if isinstance(expected, bool) else None
    assert engine_options_from_args(_parser(defaults).parse_args(argv))[name] == expected


def test_speculative_flag_parses_json():
    spec = SpeculativeConfig(method="draft_model", num_tokens=2, model="builtin:demo-draft")
    text = '{"method": "draft_model", "num_tokens": 2, "model": "builtin:demo-draft"}'
    assert _config(["--speculative", text]).speculative == spec
    assert _config(["--speculative-config", text]).speculative == spec
    assert _config([]).speculative is None


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--speculative", "{not json"], "not JSON"),
    (["--speculative", "[1]"], "must be a JSON object"),
    (["--speculative", '{"method": "medusa", "num_tokens": 2}'], "must be one of"),
    (["--max-num-seqs", "many"], "invalid int value"),
    (["--kv-cache-dtype", "fp8"], "invalid choice"),
    (["--max-seqs", "4"], "unrecognized arguments"),
])
def test_bad_flags_are_argparse_errors(capsys, argv, fragment):
    parser = argparse.ArgumentParser(prog="jaxinfer-test")
    add_engine_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == 2
    assert fragment in capsys.readouterr().err


def test_excluded_options_get_no_flag_and_are_left_out():
    parser = argparse.ArgumentParser(prog="jaxinfer-test")
    add_engine_arguments(parser, exclude=("max_model_len", "speculative"))
    options = engine_options_from_args(parser.parse_args([]))
    assert set(options) == set(option_owners()) - {"max_model_len"}
    assert "--max-model-len" not in parser._option_string_actions
    assert "--speculative" not in parser._option_string_actions
    with pytest.raises(ValueError, match=r"unknown engine options in exclude: \['max_len'\]"):
        add_engine_arguments(argparse.ArgumentParser(), exclude=("max_len",))


# ---------------------------------------------------------------------- config files


def toml_text(options, tables=()):
    """Flat options as TOML: scalars and lists as `key = value`, dicts inline unless named in
    `tables` (then a `[key]` table). None is left out (TOML has no null; None is the default
    of every option that takes it)."""

    def value(item):
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, dict):
            return "{" + ", ".join(f"{key} = {value(inner)}" for key, inner in item.items()
                                   if inner is not None) + "}"
        if isinstance(item, list | tuple):
            return "[" + ", ".join(value(inner) for inner in item) + "]"
        return json.dumps(item)  # numbers, and strings in TOML's basic (JSON) escapes

    lines = [f"{key} = {value(item)}" for key, item in options.items()
             if item is not None and key not in tables]
    for key in tables:
        lines += [f"[{key}]", *(f"{inner} = {value(item)}" for inner, item in
                                options[key].items() if item is not None)]
    return "\n".join(lines) + "\n"


def test_from_file_reads_every_option_from_toml_and_yaml(tmp_path):
    toml_file = tmp_path / "engine.toml"
    toml_file.write_text(toml_text(CHANGED, tables=("speculative",)))
    yaml_file = tmp_path / "engine.yaml"
    yaml_file.write_text(yaml.safe_dump(CHANGED))
    assert EngineConfig.from_file(toml_file).options() == CHANGED
    assert EngineConfig.from_file(yaml_file).options() == CHANGED
    inline = tmp_path / "inline.toml"  # `speculative = {...}` as well as a [speculative] table
    inline.write_text(toml_text(CHANGED))
    assert EngineConfig.from_file(inline).options() == CHANGED


def test_from_file_keywords_override_the_file_and_dashes_read_as_underscores(tmp_path):
    path = tmp_path / "engine.yml"
    path.write_text("max-num-seqs: 4\nmax_num_batched_tokens: 64\nkv-cache-dtype: int8\n")
    config = EngineConfig.from_file(path, max_num_seqs=8)
    assert config.scheduler == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    assert config.cache.kv_cache_dtype == "int8"
    assert read_config_file(path) == {"max_num_seqs": 4, "max_num_batched_tokens": 64,
                                      "kv_cache_dtype": "int8"}


def test_from_file_refuses_an_unknown_key_naming_it_and_the_file(tmp_path):
    path = tmp_path / "engine.toml"
    path.write_text("max_num_seq = 4\nhost = '0.0.0.0'\n")
    message = f"{path}: unknown option 'max_num_seq' (did you mean 'max_num_seqs'?)"
    with pytest.raises(ConfigFileError, match=re.escape(message)):
        EngineConfig.from_file(path)
    path.write_text("max_num_seqs = 4\nhost = '0.0.0.0'\n")
    with pytest.raises(ConfigFileError, match="unknown option 'host'"):
        EngineConfig.from_file(path)
    # A server's own keys, skipped where the caller says so.
    assert EngineConfig.from_file(path, ignore=("host",)).scheduler.max_num_seqs == 4


@pytest.mark.parametrize(("name", "text", "fragment"), [
    ("engine.json", "{}", "unknown format '.json'; use .toml, .yaml, .yml"),
    ("engine.toml", "max_num_seqs = ", "not valid TOML"),
    ("engine.yaml", "max_num_seqs: [4", "not valid YAML"),
    ("engine.yaml", "- max_num_seqs\n", "must hold a table of options"),
    ("engine.yaml", "max_num_seqs: 4\nmax-num-seqs: 8\n", "'max_num_seqs' is given twice"),
])
def test_bad_files_are_config_file_errors(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    pattern = f"config file {re.escape(str(path))}: .*{re.escape(fragment)}"
    with pytest.raises(ConfigFileError, match=pattern):
        read_config_file(path)


def test_a_missing_file_and_bad_values(tmp_path):
    with pytest.raises(ConfigFileError, match=r"no-such\.toml: No such file"):
        EngineConfig.from_file(tmp_path / "no-such.toml")
    path = tmp_path / "engine.toml"
    path.write_text("max_num_seqs = 0\n")
    with pytest.raises(SchedulerConfigError, match="max_num_seqs"):
        EngineConfig.from_file(path)
    path.write_text("[speculative]\nmethod = 'medusa'\nnum_tokens = 2\n")
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig.from_file(path)


def test_yaml_without_pyyaml_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    path = tmp_path / "engine.yaml"
    path.write_text("max_num_seqs: 4\n")
    with pytest.raises(ConfigFileError, match=r"reading YAML needs PyYAML .* write the file "
                                              "as TOML"):
        read_config_file(path)
    toml = tmp_path / "engine.toml"
    toml.write_text("max_num_seqs = 4\n")
    assert EngineConfig.from_file(toml).scheduler.max_num_seqs == 4
