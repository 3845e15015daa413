"""An adapter's weights in the serving dtype, converted once when the node agent stages it.

PEFT often saves adapters in float32. A server with bf16 slots then converts every tensor as
it reads the file from disk: 168 MB of F32 into 84 MB of bf16 for a rank-16 Llama-3-8B
adapter on all seven projections. On the H200 host a disk load of the F32 file took 43.5 ms,
of a bf16 file 14.6-18.0 ms, in separate calls (bench/results/cold_load_h200_notes.md); on a
2-core machine, 63.7 against 30.7 ms in one run (serving_copy_cpu_notes.md). Staging writes
the converted tensors beside the original as `adapter_model.<dtype>.safetensors`
(adapter_format.serving_weights_name), which a server of that dtype reads instead; the
original stays as it was fetched, so its digest still holds and a server of another dtype
still reads it.

float32 -> bfloat16 rounds to nearest even, as torch's `.to(torch.bfloat16)` does, so a
server's slots hold the same bits either way; float32 -> float16 is numpy's cast, also round
to nearest even. numpy only: the agent's image has no torch.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import numpy as np

from loraplex.server.adapter_format import SERVING_DTYPES, WEIGHTS_FILE, read_safetensors_header, serving_weights_name

__all__ = ["write_serving_copy", "float32_to_bfloat16_bits"]


def float32_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits of float32 `values`, rounded to nearest even; NaN -> 0x7FC0."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # a carry from a NaN's payload could make an infinity; torch writes this NaN
        rounded[nan] = 0x7FC0
    return rounded


def _convert(raw: bytes, dtype: str) -> bytes:
    values = np.frombuffer(raw, dtype="<f4")
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(values).astype("<u2").tobytes()
    return values.astype("<f2").tobytes()


def write_serving_copy(directory: str | Path, dtype: str) -> Path | None:
    """Write `adapter_model.<dtype>.safetensors` in `directory`: every F32 tensor of
    `adapter_model.safetensors` in `dtype` (bfloat16 or float16), the others as they are, the
    header's metadata kept. Returns its path; None (nothing written) when `dtype` is float32
    or the file has no F32 tensor. Written under a temporary name and renamed, so a reader
    never sees it half written."""
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(SERVING_DTYPES)}")
    directory = Path(directory)
    src = directory / WEIGHTS_FILE
    header = read_safetensors_header(src)  # checks every range against the file
    if dtype == "float32" or not any(info["dtype"] == "F32" for info in header.values()):
        return None
    with src.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(n)).get("__metadata__")
        data = f.read()
    out_header: dict = {"__metadata__": metadata} if metadata is not None else {}
    chunks, pos = [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        if info["dtype"] == "F32":
            raw, info = _convert(raw, dtype), {**info, "dtype": SERVING_DTYPES[dtype]}
        out_header[name] = {**info, "data_offsets": [pos, pos + len(raw)]}
        chunks.append(raw)
        pos += len(raw)
    head = json.dumps(out_header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    dst = directory / serving_weights_name(dtype)
    tmp = directory / f".{dst.name}.{uuid.uuid4().hex[:8]}"
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for raw in chunks:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    read_safetensors_header(dst)
    return dst
