"""Checks that a staged PEFT adapter directory is whole, with the standard library only.

The node agent does not load tensors; it only makes sure a server will not trip over a
file that is cut short or is not an adapter at all:

    adapter_config.json         a JSON object; peft_type "LORA" when given; r a positive int
    adapter_model.safetensors   8-byte little-endian header length n, n bytes of JSON
                                {name: {"dtype", "shape", "data_offsets": [begin, end]}},
                                then the data; every tensor's byte range fits its dtype and
                                shape, and the ranges tile the data to its last byte.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}


class InvalidAdapter(ValueError):
    """The directory is not a whole PEFT LoRA adapter; the message says which file and why."""


def check_config(path: Path) -> dict:
    raw = path.read_bytes()
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidAdapter(f"{CONFIG_FILE}: {len(raw)} bytes, more than {MAX_CONFIG_BYTES}")
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidAdapter(f"{CONFIG_FILE}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{CONFIG_FILE}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidAdapter(f"{CONFIG_FILE}: peft_type {peft_type!r}, not 'LORA'")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise InvalidAdapter(f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    return config


def check_safetensors(path: Path) -> int:
    """Validate the header against the file size; return the number of tensors."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: {size} bytes, shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: header of {n} bytes does not fit a {size}-byte file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidAdapter(f"{WEIGHTS_FILE}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise InvalidAdapter(f"{WEIGHTS_FILE}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    ranges = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            want = DTYPE_BYTES[dtype] * math.prod(int(d) for d in shape)
        except (KeyError, TypeError, ValueError):
            raise InvalidAdapter(f"{WEIGHTS_FILE}: tensor {name!r} has a malformed entry {info!r}") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_len):
            raise InvalidAdapter(
                f"{WEIGHTS_FILE}: tensor {name!r} bytes [{begin}, {end}) outside the {data_len} data bytes"
                " (file cut short?)"
            )
        if end - begin != want:
            raise InvalidAdapter(
                f"{WEIGHTS_FILE}: tensor {name!r} has {end - begin} bytes, {dtype} {shape} needs {want}")
        ranges.append((begin, end))
    ranges.sort()
    pos = 0
    for begin, end in ranges:
        if begin != pos:
            raise InvalidAdapter(f"{WEIGHTS_FILE}: tensor data has a gap or overlap at byte {pos}")
        pos = end
    if pos != data_len:
        raise InvalidAdapter(f"{WEIGHTS_FILE}: {data_len - pos} bytes after the last tensor")
    return len(ranges)


def check_adapter_dir(directory: Path) -> None:
    """Raise InvalidAdapter unless `directory` holds a whole adapter."""
    check_config(directory / CONFIG_FILE)
    if check_safetensors(directory / WEIGHTS_FILE) == 0:
        raise InvalidAdapter(f"{WEIGHTS_FILE}: no tensors")
