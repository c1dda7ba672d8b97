"""config/build.py: named options from a command line become typed engine settings."""

from __future__ import annotations

import pytest

from orthrus_rag.config.build import engine_config, parse_option


@pytest.mark.parametrize("text, expected", [
    ("enable_prefix_caching=false", ("enable_prefix_caching", False)),
    ("cost_budget=True", ("cost_budget", True)),
    ("max_num_batched_tokens=2048", ("max_num_batched_tokens", 2048)),
    ("step_time_target=0.05", ("step_time_target", 0.05)),
    ("step_time_target=null", ("step_time_target", None)),
    ("kernels=torch", ("kernels", "torch")),
    ('kernel_overrides={"layers": "fused"}', ("kernel_overrides", {"layers": "fused"})),
    ("policy=hetero-fcfs", ("policy", "hetero-fcfs")),
])
def test_parse_option_types_the_value(text, expected):
    assert parse_option(text) == expected


@pytest.mark.parametrize("text", ["kernels", "=1", ""])
def test_parse_option_without_name_and_value_is_refused(text):
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_option(text)


def test_parsed_options_build_an_engine_config():
    config = engine_config(**dict(map(parse_option, ['kernel_overrides={"decode_attention": "sdpa"}',
                                                     "max_num_batched_tokens=512", "policy=unified-homo"])))
    assert config.model.requested_kernels()["decode_attention"] == "sdpa"
    assert config.scheduler.max_num_batched_tokens == 512 and config.scheduler.policy == "unified-homo"


@pytest.mark.parametrize("options, message", [
    ({"kernels": "fast"}, "unknown kernels 'fast'; expected auto or torch"),
    ({"kernel_overrides": {"attn": "sdpa"}}, "unknown part 'attn'; parts: layers, linears, decode_linears, attention"),
    ({"kernel_overrides": {"sampler": "fast"}}, "unknown choice 'fast' for sampler; expected auto, cpp, torch"),
])
def test_a_bad_kernel_choice_names_the_valid_ones(options, message):
    with pytest.raises(ValueError, match=message):
        engine_config(**options)


def test_kernels_torch_asks_torch_of_every_part_and_overrides_pin_single_parts():
    from orthrus_rag.config.kernels import PARTS, TORCH

    assert set(TORCH) == set(PARTS) and all(TORCH[p] in PARTS[p] for p in PARTS)
    want = engine_config(kernels="torch", kernel_overrides={"layers": "fused"}).model.requested_kernels()
    assert want == {**TORCH, "layers": "fused"}
    assert set(engine_config().model.requested_kernels().values()) == {"auto"}
