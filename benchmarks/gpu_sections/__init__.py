"""The sections of ``benchmarks/gpu_check.py``, one module per group; ``common`` holds what they share."""
