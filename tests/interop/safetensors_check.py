"""The Python side of the safetensors interop test, with the `safetensors` package (PyPI).

    check FILE   loads a file concerto wrote and compares every tensor with the formulas below
                 (bf16 and f16 tensors against numpy's float32 -> bfloat16 (ml_dtypes) and float16 rounding)
    write FILE   writes the same tensors as F32, BF16 and F16 for concerto to read

The formulas are those of values.hpp, computed in float32. Exits 0 when all match.
"""
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file


def tensors():
    i = np.arange(3 * 5 * 7, dtype=np.int64)
    exact = (((i * 37) % 101 - 50).astype(np.float32) / np.float32(16)).reshape(3, 5, 7)
    j = np.arange(120, dtype=np.int64)
    sevenths = ((j + 1).astype(np.float32) / np.float32(7)).reshape(40, 3)
    return {"layers.0.exact": exact, "sevenths": sevenths}


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "write":
        out = {}
        for name, value in tensors().items():
            out[name + ".f32"] = value
            out[name + ".bf16"] = value.astype(ml_dtypes.bfloat16)
            out[name + ".f16"] = value.astype(np.float16)
        save_file(out, path, metadata={"format": "pt", "written_by": "safetensors " + __import__("safetensors").__version__})
        return 0
    loaded = load_file(path)
    for name, value in tensors().items():
        for suffix, want in ((".f32", value), (".bf16", value.astype(ml_dtypes.bfloat16)), (".f16", value.astype(np.float16))):
            got = loaded[name + suffix]
            if got.dtype != want.dtype or got.shape != want.shape:
                print(f"{name + suffix}: {got.dtype} {got.shape}, expected {want.dtype} {want.shape}")
                return 1
            if got.view(np.uint8).tobytes() != want.view(np.uint8).tobytes():
                bad = np.flatnonzero(got.astype(np.float32) != want.astype(np.float32))[0]
                print(f"{name + suffix}[{bad}]: {got.reshape(-1)[bad]}, expected {want.reshape(-1)[bad]}")
                return 1
    print(f"{3 * len(tensors())} tensors written by concerto equal numpy's, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
