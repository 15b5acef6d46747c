"""Drafters for speculative decoding: DSpark/DFlash (BlockDrafter), EAGLE-3, n-gram; see docs/design/drafter.md."""
from specd.drafter.base import (BlockOut, Drafter, DrafterError, DraftOutput, SlotSampler, TargetHeads, build_drafter,
                                load_deepspec_state_dict, load_drafter, save_drafter)
from specd.drafter.config import DrafterConfig, DrafterConfigError, default_mask_token_id, default_target_layers
from specd.drafter.dspark import BlockDrafter
from specd.drafter.eagle3 import Eagle3Drafter
from specd.drafter.features import target_features
from specd.drafter.ngram import NgramDrafter

__all__ = [
    "BlockDrafter", "BlockOut", "DraftOutput", "Drafter", "DrafterConfig", "DrafterConfigError", "DrafterError",
    "Eagle3Drafter", "NgramDrafter", "SlotSampler", "TargetHeads", "build_drafter", "default_mask_token_id",
    "default_target_layers", "load_deepspec_state_dict", "load_drafter", "save_drafter", "target_features",
]
