import dataclasses

import pytest

from specd.drafter import DrafterConfig, DrafterConfigError, default_mask_token_id, default_target_layers


def _qwen(arch: str, layers: int, hidden: int):
    from specd.models.config import ModelConfig
    return ModelConfig(arch=arch, vocab_size=151936, hidden_size=hidden, intermediate_size=4 * hidden,
                       num_layers=layers, num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                       rope_theta=1e6, qk_norm=arch == "qwen3")


def test_default_layers_match_deepspec_and_never_the_last():
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)        # DeepSpec Qwen3-8B
    assert default_target_layers(40, 5) == (1, 10, 19, 28, 37)       # DeepSpec Qwen3-14B
    assert default_target_layers(24, 5) == (1, 6, 11, 16, 21)        # Qwen2.5-0.5B
    assert default_target_layers(5, 5) == (0, 1, 2, 3)               # stories260K: fewer, all distinct
    assert default_target_layers(5, 3) == (1, 2, 3)


def test_for_target_method_defaults(target):
    model, _ = target
    dspark = DrafterConfig.for_target(model.config, "dspark")
    dflash = DrafterConfig.for_target(model.config, "dflash")
    eagle = DrafterConfig.for_target(model.config, "eagle3")
    assert (dspark.markov_rank, dspark.confidence, dspark.gamma) == (256, True, 7)
    assert (dflash.markov_rank, dflash.confidence) == (0, False)
    assert eagle.target_layers == (1, 2, 3) and eagle.num_layers == 1
    assert dspark.hidden_size == 64 and dspark.num_kv_heads == 4 and dspark.head_dim == 8
    assert DrafterConfig.from_dict(dspark.to_dict()) == dspark


def test_mask_ids():
    assert default_mask_token_id(_qwen("qwen3", 36, 128)) == 151669
    assert default_mask_token_id(_qwen("qwen2", 24, 128)) == 151665


def test_bad_configs_are_rejected(target):
    model, _ = target
    with pytest.raises(DrafterConfigError):
        DrafterConfig.for_target(model.config, "dspark", target_layers=(1, 4))      # last layer
    with pytest.raises(DrafterConfigError):
        DrafterConfig.for_target(model.config, "dspark", markov_rank=0)             # confidence needs W1
    with pytest.raises(DrafterConfigError):
        DrafterConfig.for_target(model.config, "medusa")
    good = DrafterConfig.for_target(model.config, "dflash")
    with pytest.raises(DrafterConfigError):
        dataclasses.replace(good, mask_token_id=512)
    with pytest.raises(DrafterConfigError):
        dataclasses.replace(good, target_layers=(2, 1))
