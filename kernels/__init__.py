"""Compute kernels: torch references (the CPU path) and Triton kernels (the CUDA path) behind one interface."""
