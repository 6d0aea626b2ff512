"""One name from the config to the strategy class, and every engine has the endpoints of each
strategy the config lets it take (the protocols of rollout/base.py)."""

from __future__ import annotations

import typing

import pytest

from megatron_entropy.config import WeightSyncConfig
from megatron_entropy.config.validation import SYNCED_BY
from megatron_entropy.rollout.base import GeneratesAhead
from megatron_entropy.rollout.inprocess import InProcessEngine
from megatron_entropy.rollout.server.engine import ServerEngine
from megatron_entropy.rollout.server.sglang import SGLangEngine
from megatron_entropy.rollout.server.vllm import VLLMEngine
from megatron_entropy.settings import choices, field_types
from megatron_entropy.weight_sync import STRATEGIES

ENGINES = {"inprocess": InProcessEngine, "vllm": VLLMEngine, "sglang": SGLangEngine}


def _missing(cls: type, protocol: type) -> list[str]:
    """The methods of ``protocol`` that ``cls`` does not define."""
    wanted = [name for name, value in vars(protocol).items()
              if callable(value) and not name.startswith("_")]
    return [name for name in wanted if not callable(getattr(cls, name, None))]


def test_the_config_names_the_registry():
    names = set(choices(field_types(WeightSyncConfig)["strategy"])) - {"auto"}
    assert names == set(STRATEGIES)
    assert {s for allowed in SYNCED_BY.values() for s in allowed} == names


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_each_engine_has_the_endpoints_of_its_strategies(engine):
    for strategy in SYNCED_BY[engine]:
        endpoints = STRATEGIES[strategy].ENDPOINTS
        assert typing.get_origin(endpoints) is None and endpoints.__module__.endswith("base")
        assert _missing(ENGINES[engine], endpoints) == [], (engine, strategy)


def test_server_engines_generate_ahead():
    assert _missing(ServerEngine, GeneratesAhead) == []
    assert _missing(InProcessEngine, GeneratesAhead) != []  # the check can fail
