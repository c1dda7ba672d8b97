"""config/build.py: named options from a command line become typed engine settings."""

from __future__ import annotations

import pytest

from orthrus_rag.config.build import engine_config, parse_option


@pytest.mark.parametrize("text, expected", [
    ("cpu_decode_kernel=false", ("cpu_decode_kernel", False)),
    ("cuda_graphs=True", ("cuda_graphs", True)),
    ("max_num_batched_tokens=2048", ("max_num_batched_tokens", 2048)),
    ("step_time_target=0.05", ("step_time_target", 0.05)),
    ("step_time_target=null", ("step_time_target", None)),
    ("attention_backend=grouped", ("attention_backend", "grouped")),
    ("policy=hetero-fcfs", ("policy", "hetero-fcfs")),
])
def test_parse_option_types_the_value(text, expected):
    assert parse_option(text) == expected


@pytest.mark.parametrize("text", ["cpu_decode_kernel", "=1", ""])
def test_parse_option_without_name_and_value_is_refused(text):
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_option(text)


def test_parsed_options_build_an_engine_config():
    config = engine_config(**dict(map(parse_option, ["cpu_decode_kernel=false", "max_num_batched_tokens=512",
                                                     "policy=unified-homo"])))
    assert config.model.cpu_decode_kernel is False
    assert config.scheduler.max_num_batched_tokens == 512 and config.scheduler.policy == "unified-homo"
