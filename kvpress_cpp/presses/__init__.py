"""kvpress_cpp's presses: kvpress press classes backed by the kvcomp ops."""

from kvpress_cpp.presses.base import KVCompDecodingPress, KVCompPress
from kvpress_cpp.presses.gvote import GVotePress
from kvpress_cpp.presses.keepkv import KeepKVPress
from kvpress_cpp.presses.kvzap import KVzapPress, KVzapThresholdPress
from kvpress_cpp.presses.weightedkv import WeightedKVPress
from kvpress_cpp.presses.zsmerge import ZSMergePress
from kvpress_cpp import kvpress_adapters  # noqa: F401  (adapts kvpress's DMSPress, AdaKVPress; needs presses loaded)

__all__ = ["KVCompPress", "KVCompDecodingPress", "GVotePress", "KeepKVPress", "KVzapPress", "KVzapThresholdPress",
           "WeightedKVPress", "ZSMergePress"]
