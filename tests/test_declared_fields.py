"""Every sampling field is declared once, in SamplingParams (its default, help and bounds); the
OpenAI request models and the CLI's flags derive from the declarations. A field added there
appears in both, with its default and bounds."""

from __future__ import annotations

import argparse
from typing import Annotated

import msgspec
import pytest

from pagedllm.core.errors import InvalidParameter
from pagedllm.core.sampling_params import SamplingParams, declared, field_declarations
from pagedllm.entrypoints import sampling_fields
from pagedllm.entrypoints.cli import add_sampling_flags
from pagedllm.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, _RequestFields


class WithKnob(SamplingParams, kw_only=True, omit_defaults=True):
    knob: Annotated[float, declared("how far the knob is turned", lo=0.0, hi=2.0)] = 0.5


def test_a_field_added_to_sampling_params_appears_in_the_openai_models_and_the_cli():
    request_type = sampling_fields.openai_sampling_struct(_RequestFields, WithKnob)

    def params(body: bytes) -> WithKnob:
        return WithKnob(**sampling_fields.openai_values(msgspec.json.decode(body, type=request_type), WithKnob))

    assert params(b"{}").knob == 0.5  # its default
    assert params(b'{"knob": 1.5, "temperature": 0}').knob == 1.5
    assert params(b'{"knob": null}').knob == 0.5  # null is the default, as vLLM's server takes it
    with pytest.raises(InvalidParameter, match=r"knob: must be <= 2.0, got 3"):
        params(b'{"knob": 3}')

    parser = argparse.ArgumentParser()
    sampling_fields.add_sampling_flags(parser, WithKnob)
    text = " ".join(parser.format_help().split())
    assert "--knob KNOB how far the knob is turned; 0.0..2.0 (default: 0.5)" in text
    assert WithKnob(**sampling_fields.sampling_values(parser.parse_args([]), WithKnob)).knob == 0.5
    assert WithKnob(**sampling_fields.sampling_values(parser.parse_args(["--knob", "2"]), WithKnob)).knob == 2.0
    with pytest.raises(InvalidParameter, match=r"knob: must be >= 0.0, got -1.0"):
        WithKnob(**sampling_fields.sampling_values(parser.parse_args(["--knob", "-1"]), WithKnob))


def test_the_request_models_and_the_cli_carry_every_declared_field_with_its_default():
    parser = argparse.ArgumentParser()
    add_sampling_flags(parser)
    defaults = vars(parser.parse_args([]))
    for d in field_declarations():
        for model in (CompletionRequest, ChatCompletionRequest):
            if d.extra["openai"]:
                assert getattr(msgspec.json.decode(b'{"prompt": "x", "messages": []}', type=model), d.name) == d.default
        if d.extra["cli"] is not False:
            expected = d.default if d.extra["cli"] is True else d.extra["cli"]
            assert defaults[sampling_fields._dest(d)] == expected, d.name
    # where a default differs from the Python API's, it is said at the declaration
    assert defaults["temperature"] == 0.0 and defaults["max_tokens"] == 64
    assert SamplingParams().temperature == 1.0 and SamplingParams().max_tokens == 16


def test_sampling_bounds_come_from_the_declarations():
    for name, value, message in (
        ("top_p", 0.0, "must be > 0.0"),
        ("min_p", 1.5, "must be <= 1.0"),
        ("beam_width", 11, "must be <= 10"),
        ("n", 0, "must be >= 1"),
        ("priority", 2**63, "must be <= 9223372036854775807"),
    ):
        with pytest.raises(InvalidParameter, match=f"{name}: {message}"):
            SamplingParams(**{name: value})
