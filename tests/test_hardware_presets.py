"""Tests for hardware profiles, calibration, and model presets."""

import argparse
import dataclasses
import json

import pytest
import torch

from megacompile.cli.presets import (
    build_transformers_config,
    count_parameters,
    known_presets,
    load_model_config,
)
from megacompile.plan import calibrate as calibrate_mod
from megacompile.plan.hardware import (
    HardwareProfile,
    get_profile,
    known_profiles,
    profile_from_json,
    profile_to_json,
)

EXPECTED_PROFILES = {"h100-sxm", "h100-pcie", "h200", "gh200", "a100-80gb", "rtx-4090", "rtx-3090", "cpu-standin"}
EXPECTED_PRESETS = {"llama-3-8b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "dense-120b"}

# Published parameter counts (model cards); presets must land within 2%.
PUBLISHED_PARAMS = {
    "llama-3-8b": 8.03e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-14b": 14.7e9,
    "qwen2.5-32b": 32.8e9,
    "qwen2.5-72b": 72.7e9,
    "dense-120b": 120e9,  # ours: stated as ~120B
}

NUMERIC_FIELDS = (
    "device_flops_fp32", "device_flops_bf16", "hbm_bytes", "hbm_bandwidth",
    "h2d_bandwidth", "d2h_bandwidth", "host_memory_bandwidth", "host_cores",
)


# --- hardware profiles ---------------------------------------------------------


def test_known_profiles_complete():
    assert EXPECTED_PROFILES <= set(known_profiles())


@pytest.mark.parametrize("name", sorted(EXPECTED_PROFILES))
def test_profile_loads_with_positive_numbers(name):
    profile = get_profile(name)
    assert isinstance(profile, HardwareProfile)
    assert profile.name == name
    assert profile.description and profile.source
    for field in NUMERIC_FIELDS:
        assert getattr(profile, field) > 0, field
    assert profile.estimated_host_adamw_params_per_s() > 0
    # Sanity: tensor-core bf16 beats plain fp32 on every GPU, and the link is the
    # slowest path to device memory (the reason streaming needs planning at all).
    if name != "cpu-standin":
        assert profile.device_flops_bf16 > profile.device_flops_fp32
        assert profile.h2d_bandwidth < profile.hbm_bandwidth


def test_profile_spot_values():
    h100 = get_profile("h100-sxm")
    assert h100.device_flops_bf16 == pytest.approx(989e12, rel=0.01)
    assert h100.hbm_bandwidth == pytest.approx(3.35e12, rel=0.01)
    assert get_profile("gh200").h2d_bandwidth > 5 * get_profile("h200").h2d_bandwidth


def test_unknown_profile_lists_known_names():
    with pytest.raises(ValueError) as info:
        get_profile("tpu-v9")
    message = str(info.value)
    for name in EXPECTED_PROFILES:
        assert name in message


def test_missing_profile_file_is_value_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        get_profile(str(tmp_path / "nope.json"))


def test_profile_is_frozen_and_validated():
    profile = get_profile("h100-sxm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.hbm_bytes = 1
    with pytest.raises(ValueError, match="h2d_bandwidth"):
        dataclasses.replace(profile, h2d_bandwidth=0)


@pytest.mark.parametrize("name", sorted(EXPECTED_PROFILES))
def test_profile_json_round_trip(name):
    profile = get_profile(name)
    assert profile_from_json(profile_to_json(profile)) == profile


def test_profile_from_file_path(tmp_path):
    profile = dataclasses.replace(get_profile("rtx-4090"), name="my-box", host_adamw_params_per_s=None)
    path = tmp_path / "my-box.json"
    path.write_text(profile_to_json(profile))
    assert get_profile(str(path)) == profile


def test_profile_json_rejects_unknown_and_missing_fields():
    data = json.loads(profile_to_json(get_profile("h200")))
    with pytest.raises(ValueError, match="unknown hardware profile fields: hbm_typo"):
        profile_from_json(json.dumps({**data, "hbm_typo": 1}))
    del data["hbm_bytes"]
    with pytest.raises(ValueError, match="missing fields: hbm_bytes"):
        profile_from_json(json.dumps(data))


# --- calibration -----------------------------------------------------------------


def test_calibrate_quick_on_cpu():
    profile = calibrate_mod.calibrate(device="cpu", quick=True)
    for field in NUMERIC_FIELDS:
        assert getattr(profile, field) > 0, field
    assert profile.host_adamw_params_per_s > 0
    assert profile.name.startswith("calibrated-")
    assert "measured" in profile.source
    # The CPU stand-in's link is a host memcpy: one byte moved per byte copied,
    # while host bandwidth counts read + write.
    assert profile.h2d_bandwidth == pytest.approx(profile.host_memory_bandwidth / 2)
    assert profile_from_json(profile_to_json(profile)) == profile


def test_calibrate_rejects_bad_device():
    with pytest.raises(ValueError):
        calibrate_mod.calibrate(device="tpu")


def test_calibrate_cli_writes_profile(tmp_path, monkeypatch, capsys):
    # The CLI plumbing, with the measurements stubbed: the measurement itself is
    # covered above and need not run twice.
    fake = dataclasses.replace(get_profile("cpu-standin"), name="calibrated-test", source="measured (stub)")
    monkeypatch.setattr(calibrate_mod, "calibrate", lambda device="auto", quick=False: fake)
    parser = argparse.ArgumentParser()
    calibrate_mod.add_arguments(parser)
    out = tmp_path / "sub" / "profile.json"

    assert calibrate_mod.run(parser.parse_args(["--quick", "--out", str(out)])) == 0
    assert get_profile(str(out)) == fake
    assert "host AdamW" in capsys.readouterr().out

    assert calibrate_mod.run(parser.parse_args(["--out", str(out), "--json"])) == 0
    assert profile_from_json(capsys.readouterr().out) == fake


# --- model presets ---------------------------------------------------------------


def test_known_presets_complete():
    assert EXPECTED_PRESETS <= set(known_presets())


def test_unknown_preset_lists_known_names_and_mentions_paths():
    with pytest.raises(ValueError) as info:
        load_model_config("gpt-5")
    message = str(info.value)
    for name in EXPECTED_PRESETS:
        assert name in message
    assert "config.json" in message


def test_load_model_config_from_path(tmp_path):
    config = load_model_config("qwen2.5-7b")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_config(str(tmp_path / "config.json")) == config
    assert load_model_config(str(tmp_path)) == config  # a model directory works too


def test_load_model_config_returns_a_copy():
    load_model_config("llama-3-8b")["num_hidden_layers"] = 1
    assert load_model_config("llama-3-8b")["num_hidden_layers"] == 32


def _meta_param_count(config: dict) -> int:
    """Real parameter count of the transformers model, built without allocating."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(build_transformers_config(config))
    return sum(p.numel() for p in model.parameters())  # tied weights appear once


def _shrink(config: dict) -> dict:
    """Same architecture (GQA ratio, biases, tying) at toy size."""
    small = dict(config)
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    small.update(
        num_hidden_layers=2,
        num_key_value_heads=2,
        num_attention_heads=2 * group,
        hidden_size=2 * group * 8,  # head_dim 8
        intermediate_size=40,
        vocab_size=97,
        max_position_embeddings=64,
    )
    return small


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_count_parameters_matches_transformers_on_shrunk_preset(name):
    small = _shrink(load_model_config(name))
    assert count_parameters(small) == _meta_param_count(small)


@pytest.mark.parametrize(
    "config",
    [
        # Variants the presets do not exercise: tying, biases, explicit head_dim, MHA.
        dict(model_type="qwen2", tie_word_embeddings=True),
        dict(model_type="qwen2", head_dim=12),
        dict(model_type="llama", attention_bias=True, mlp_bias=True),
        dict(model_type="llama", head_dim=12),
        dict(model_type="llama", num_key_value_heads=None),
        dict(model_type="mistral", head_dim=12),
        dict(model_type="qwen3", head_dim=12, attention_bias=False),
        dict(model_type="qwen3", head_dim=8, attention_bias=True, tie_word_embeddings=True),
    ],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_count_parameters_matches_transformers_on_variants(config):
    full = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, tie_word_embeddings=False)
    full.update(config)
    if full["num_key_value_heads"] is None:
        del full["num_key_value_heads"]
    assert count_parameters(full) == _meta_param_count(full)


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_full_size_presets_match_published_totals(name):
    config = load_model_config(name)
    counted = count_parameters(config)
    assert counted == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02)
    # Building the real model on the meta device is cheap and checks the formula at scale.
    assert counted == _meta_param_count(config)


def test_count_parameters_of_other_architectures_builds_them_on_meta():
    """No analytic count: the causal LM transformers builds, counted on the meta device (tied
    weights once); a model type with no causal LM is refused, naming it."""
    import transformers

    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 97, "n_positions": 32}
    built = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{k: v for k, v in config.items()
                                                                    if k != "model_type"}))
    assert count_parameters(config) == sum(p.numel() for p in built.parameters())
    with pytest.raises(ValueError, match="'t5': transformers builds no causal LM"):
        count_parameters({"model_type": "t5", "d_model": 64, "num_layers": 2})


@pytest.mark.parametrize("model_type, key", [("qwen2", "num_key_value_heads"), ("mistral", "num_key_value_heads"),
                                             ("qwen3", "head_dim")])
def test_count_parameters_requires_keys_with_family_specific_defaults(model_type, key):
    config = dict(model_type=model_type, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=97)
    del config[key]
    with pytest.raises(ValueError, match=key):
        count_parameters(config)
