"""Fake sglang.srt.utils: MultiprocessingSerializer as in sglang (ForkingPickler dump, base64 when output_str)."""
import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str=False):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        output = buf.getvalue()
        return base64.b64encode(output).decode("utf-8") if output_str else output

    @staticmethod
    def deserialize(data):
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return pickle.loads(data)
