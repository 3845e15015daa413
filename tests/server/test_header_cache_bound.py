"""Parsed safetensors headers are cached for a fleet's adapters (which share them byte for
byte), but only small ones: a crafted header of up to 100 MB (a huge __metadata__) must not be
kept, 32 of them at a time, in host memory."""

from __future__ import annotations

import json
import struct

from loraplex.server import adapter_format
from loraplex.server.adapter_format import CACHED_HEADER_BYTES, read_safetensors_header


def write_safetensors(path, metadata_bytes: int) -> None:
    header = {"__metadata__": {"pad": "x" * metadata_bytes},
              "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)


def test_small_headers_are_cached_and_large_ones_are_not(tmp_path):
    adapter_format.checked_header.cache_clear()
    small, large = tmp_path / "small.safetensors", tmp_path / "large.safetensors"
    write_safetensors(small, 100)
    write_safetensors(large, CACHED_HEADER_BYTES + 1)
    assert set(read_safetensors_header(small)) == set(read_safetensors_header(large)) == {"w"}
    assert adapter_format.checked_header.cache_info().currsize == 1
    read_safetensors_header(large)
    assert adapter_format.checked_header.cache_info().currsize == 1
    read_safetensors_header(small)
    assert adapter_format.checked_header.cache_info().hits >= 1
