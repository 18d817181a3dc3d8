"""Stub of vllm for the CPU contract test (tests/test_sglang_contract.py) only.

sglang 0.5.23's RotaryEmbedding imports `rotary_embedding` from vllm._custom_ops when it is built on a host that is
neither CUDA nor HIP nor sglang's CPU engine (SGLANG_USE_CPU_ENGINE=1, which the harness leaves off so that the
weight loaders take the same branches as on a GPU). The kernel is kept for forward passes; weight updates never
call it. vllm is not installable here, so this module stands in.
"""
