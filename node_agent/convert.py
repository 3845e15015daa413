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

__all__ = ["write_serving_copy", "serving_copy_size", "float32_to_bfloat16_bits"]


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


def _layout(src: Path, dtype: str) -> tuple[bytes, list[tuple[int, int, bool]]] | None:
    """The copy's header bytes and, in file order, each tensor's (begin, end) in the original's
    data and whether it is converted; None when there is nothing to convert."""
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(SERVING_DTYPES)}")
    header = read_safetensors_header(src)  # checks every range against the file
    if dtype == "float32" or not any(info["dtype"] == "F32" for info in header.values()):
        return None
    with src.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(n)).get("__metadata__")
    out_header: dict = {"__metadata__": metadata} if metadata is not None else {}
    pieces, pos = [], 0
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        convert = info["dtype"] == "F32"
        size = (end - begin) // 2 if convert else end - begin  # F32 -> a 2-byte dtype
        if convert:
            info = {**info, "dtype": SERVING_DTYPES[dtype]}
        out_header[name] = {**info, "data_offsets": [pos, pos + size]}
        pieces.append((begin, end, convert))
        pos += size
    head = json.dumps(out_header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return head, pieces


def serving_copy_size(directory: str | Path, dtype: str) -> int | None:
    """The bytes `write_serving_copy(directory, dtype)` would write (None: it writes nothing),
    so that the room for it can be found before a byte of it is on disk."""
    layout = _layout(Path(directory) / WEIGHTS_FILE, dtype)
    if layout is None:
        return None
    head, pieces = layout
    return 8 + len(head) + sum((e - b) // 2 if c else e - b for b, e, c in pieces)


# Bytes of F32 data converted at a time (a multiple of 4): the copy holds this much of the
# file in memory, with its converted half and numpy's temporaries, whatever the adapter's size.
BLOCK_BYTES = 1 << 20


def write_serving_copy(directory: str | Path, dtype: str) -> Path | None:
    """Write `adapter_model.<dtype>.safetensors` in `directory`: every F32 tensor of
    `adapter_model.safetensors` in `dtype` (bfloat16 or float16), the others as they are, the
    header's metadata kept. Returns its path; None (nothing written) when `dtype` is float32
    or the file has no F32 tensor. Written under a temporary name and renamed, so a reader
    never sees it half written; read and written BLOCK_BYTES at a time."""
    directory = Path(directory)
    src = directory / WEIGHTS_FILE
    layout = _layout(src, dtype)
    if layout is None:
        return None
    head, pieces = layout
    dst = directory / serving_weights_name(dtype)
    tmp = directory / f".{dst.name}.{uuid.uuid4().hex[:8]}"
    try:
        with src.open("rb") as f_in, tmp.open("wb") as f:
            (n,) = struct.unpack("<Q", f_in.read(8))
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for begin, end, convert in pieces:
                f_in.seek(8 + n + begin)
                for at in range(begin, end, BLOCK_BYTES):
                    raw = f_in.read(min(BLOCK_BYTES, end - at))
                    if not raw:
                        raise ValueError(f"{src.name}: cut short while it was converted")
                    f.write(_convert(raw, dtype) if convert else raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    read_safetensors_header(dst)
    return dst
