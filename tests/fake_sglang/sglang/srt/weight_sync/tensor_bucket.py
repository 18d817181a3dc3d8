"""Fake sglang.srt.weight_sync.tensor_bucket: the same flattening as sglang's (every tensor viewed as uint8 bytes,
concatenated; metadata records where each one lies), so mixed dtypes round-trip exactly."""
from dataclasses import dataclass

import torch


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    supports_multi_dtypes = True

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            self.metadata, parts, start = [], [], 0
            for name, tensor in named_tensors:
                flat = tensor.flatten().view(torch.uint8)
                self.metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start,
                                                             start + flat.numel(), flat.numel()))
                parts.append(flat)
                start += flat.numel()
            self.flattened_tensor = torch.cat(parts)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.metadata]
