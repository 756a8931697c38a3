"""Quantization of the codec: the reference quantizers (``reference``: CacheGen's layer-wise
bins, Liu et al., SIGCOMM 2024, section 5.2), the low-bit baselines (``lowbit``: KIVI, FP8),
the outlier-channel rule (``outliers``), the fused numba quantize / dequantize paths
(``fused``) and the table decoders of the baselines (``tables``).

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_quant.py tests/codec/test_codec_fused.py -q
"""
