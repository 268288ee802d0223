"""The parallel math: plain functions and autograd Functions over tensors.

Process groups are passed in explicitly; nothing here reads megatron's global parallel state.
"""
