"""Triton kernels, each beside its plain torch reference behind one dispatch function.

The dispatch functions pick the Triton kernel on a CUDA device when Triton is
installed, and the torch reference otherwise; tests run the kernels on the CPU
under TRITON_INTERPRET=1 and compare them with the references.
"""
