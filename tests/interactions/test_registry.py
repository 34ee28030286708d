"""Interaction configs in verl's layout: verl's class names resolve to rlfoundry's, the ones not provided
are start-up errors naming them."""

from __future__ import annotations

import json

import pytest

from rlfoundry.interactions.gsm8k import Gsm8kInteraction
from rlfoundry.interactions.registry import InteractionConfigError, initialize_interactions_from_config


def _write(tmp_path, class_name: str):
    path = tmp_path / "interaction.yaml"
    path.write_text(json.dumps({"interaction": [{"name": "gsm8k", "class_name": class_name, "config": {}}]}))
    return path


def test_verls_gsm8k_interaction_loads_and_its_weather_demo_is_named_as_not_provided(tmp_path):
    loaded = initialize_interactions_from_config(_write(tmp_path, "verl.interactions.gsm8k_interaction.Gsm8kInteraction"))
    assert list(loaded) == ["gsm8k"] and type(loaded["gsm8k"]) is Gsm8kInteraction
    weather = _write(tmp_path, "verl.interactions.weather_interaction.WeatherInteraction")
    with pytest.raises(InteractionConfigError, match="WeatherInteraction' is not one of verl's interactions"):
        initialize_interactions_from_config(weather)
