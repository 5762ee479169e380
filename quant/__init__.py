"""Group-wise quantization: the format, its torch reference, and the compressed
weight and KV-cache formats the engine stores."""

from flexoff.quant.format import Compressed, QuantConfig, QuantError, compressed_bytes, dequantize, quantize

__all__ = ["QuantConfig", "Compressed", "QuantError", "quantize", "dequantize", "compressed_bytes"]
