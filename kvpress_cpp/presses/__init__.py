"""kvpress_cpp's presses: kvpress press classes backed by the kvcomp ops."""

from kvpress_cpp.presses.base import KVCompDecodingPress, KVCompPress

__all__ = ["KVCompPress", "KVCompDecodingPress"]
