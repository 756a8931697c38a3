"""Triton GPU kernels of the codec, bit-exact with the CPU backend (docs/gpu.md):
``kernels`` holds the kernel sources and their compilation, ``ops`` the Python wrappers
that launch them (quantize / dequantize, histograms, the rANS coder).

Importing this package needs neither Triton nor a GPU (``ops.available()`` says whether
the kernels can run). Run the tests (CPU, interpreter):
  TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/codec/test_codec_triton.py -q
"""
