"""Stub (see vllm/__init__.py): the one name sglang's RotaryEmbedding imports; calling it raises."""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("vllm._custom_ops.rotary_embedding is a stub in sglang_cpu_stubs: no forward on CPU")
