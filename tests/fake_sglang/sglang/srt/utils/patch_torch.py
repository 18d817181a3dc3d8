"""Fake sglang.srt.utils.patch_torch: records that the producer patched torch's CUDA-IPC reductions."""
calls = 0


def monkey_patch_torch_reductions():
    global calls
    calls += 1
