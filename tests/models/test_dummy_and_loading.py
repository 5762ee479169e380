"""Dummy weights and model resolution."""

from __future__ import annotations

import json

import pytest
import torch

from flexoff.checkpoint import load_model
from flexoff.dummy import CONFIGS, DummySource
from flexoff.errors import CheckpointError, ModelError
from flexoff.models import ModelSpec


@pytest.mark.parametrize("name,billions", [("opt-125m", 0.125), ("opt-1.3b", 1.3), ("opt-6.7b", 6.7),
                                           ("opt-13b", 13), ("opt-30b", 30), ("opt-66b", 66),
                                           ("opt-175b", 175), ("llama-7b", 6.7), ("llama-13b", 13),
                                           ("llama-70b", 69)])
def test_dummy_shapes_have_their_published_sizes(name, billions):
    spec = ModelSpec.from_config(name, CONFIGS[name])
    tied = spec.vocab_size * spec.hidden_size if spec.family == "opt" else 0  # OPT's head is the embedding
    assert abs((spec.num_params - tied) / 1e9 - billions) / billions < 0.05


def test_dummy_weights_are_seeded_varied_and_made_per_layer():
    m = load_model("dummy:llama-tiny")
    a = m.source.layer(3, m.spec.layers[3], torch.float32, torch.device("cpu"))
    b = DummySource().layer(3, m.spec.layers[3], torch.float32, torch.device("cpu"))
    c = DummySource(seed=1).layer(3, m.spec.layers[3], torch.float32, torch.device("cpu"))
    for name, t in a.items():
        assert torch.equal(t, b[name]) and not torch.equal(t, c[name])
        assert t.std() > 0 and not torch.all(t == 1)
    other = m.source.layer(1, m.spec.layers[1], torch.float32, torch.device("cpu"))
    assert not torch.equal(a["q_proj.weight"], other["q_proj.weight"])


def test_dummy_from_config_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["opt-tiny"]))
    m = load_model(f"dummy:{tmp_path / 'config.json'}")
    assert m.spec.hidden_size == 64 and m.tokenizer.decode(m.tokenizer.encode("héllo")[1:]) == "héllo"
    with pytest.raises(ModelError, match="unknown dummy model"):
        load_model("dummy:opt-7t")


def test_missing_tensor_is_reported(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((tiny["llama"].path / "config.json").read_text())
    sd = load_file(tiny["llama"].path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="up_proj"):
        load_model(str(folder))
