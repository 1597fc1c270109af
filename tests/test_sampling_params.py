"""SamplingParams: vLLM's defaults, normalisation of `stop`, and validation that names the
offending parameter (the server turns it into OpenAI's 400 with `param`)."""
from __future__ import annotations

import pytest

from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams


def test_defaults_match_vllm():
    # vLLM's SamplingParams defaults (vllm/sampling_params.py).
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k in (0, -1)  # both mean "no limit" in vLLM
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.include_stop_str_in_output is False
    assert p.ignore_eos is False
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.repetition_penalty == 1.0
    assert p.logprobs is None
    assert p.skip_special_tokens is True
    assert not p.greedy
    assert not p.has_penalties


def test_stop_string_becomes_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_top_k_minus_one_means_no_limit():
    assert SamplingParams(top_k=-1).top_k in (0, -1)
    assert SamplingParams(top_k=-1).top_k == SamplingParams().top_k


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(n=0), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=2.1), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_values_raise_with_param(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert str(err.value)  # a human-readable message
    assert isinstance(err.value, ValueError)  # callers that catch ValueError still work


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0),
    dict(top_p=1.0),
    dict(top_p=1e-6),
    dict(top_k=1),
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(max_tokens=1),
    dict(max_tokens=None, min_tokens=100),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(repetition_penalty=1e-3),
    dict(logprobs=0),
    dict(logprobs=20),
    dict(min_tokens=16, max_tokens=16),
    dict(n=4, seed=0),
    dict(stop=["\n\n", "END"], stop_token_ids=[0, 2]),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)
