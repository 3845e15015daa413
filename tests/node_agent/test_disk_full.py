"""A disk that fills up at any write of a staging is DiskFull (507, retried), counted under
that reason, and leaves nothing that could look like a whole adapter: no part file in .tmp,
no version in .store, no name; the budget given back. Real downloads (a local directory and
a real HTTP object store on 127.0.0.1); the disk's ENOSPC raised by the file written."""

from __future__ import annotations

import errno
import os
import pathlib
import tempfile

import aiohttp
import pytest

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.node_agent.store import META_FILE, AdapterRef, AdapterStore, StoreError
from loraplex.node_agent.warmer import RETRYABLE

from .helpers import make_adapter


class _FullAfter:
    """A file opened for writing that takes `room` bytes, then raises ENOSPC."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        if len(data) > self._room:
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _fill_up(monkeypatch, root: pathlib.Path, filename: str, room: int) -> None:
    real_open = pathlib.Path.open

    def opened(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        if "w" in mode and self.name == filename and (root / ".tmp") in self.parents:
            return _FullAfter(f, room)
        return f

    monkeypatch.setattr(pathlib.Path, "open", opened)


def _assert_nothing_left(store: AdapterStore, root: pathlib.Path) -> None:
    assert list((root / ".tmp").iterdir()) == []
    assert list((root / ".store").iterdir()) == []
    assert not os.path.lexists(root / "a") and store.get("a") is None
    assert store.used_bytes == 0 and store._reserved == 0
    assert store.metrics.failures.labels("DiskFull")._value.get() == 1
    assert store.metrics.failures.labels("DiskError")._value.get() == 0


@pytest.mark.parametrize("where", ["weights-mid-body", "config", "meta", "tmp-dir"])
@pytest.mark.parametrize("over", ["local", "http"])
async def test_a_full_disk_anywhere_in_a_staging_is_disk_full(tmp_path, object_store, monkeypatch, where, over):
    if over == "http":
        src = object_store.add("a", tmp_path)
        sha = object_store.adapters["a"].sha256
    else:
        sha = make_adapter(tmp_path / "src" / "a")
        src = str(tmp_path / "src" / "a")
    root = tmp_path / "cache"
    async with aiohttp.ClientSession() as session:
        store = AdapterStore(root, 10**9, session=session)
        if where == "weights-mid-body":
            _fill_up(monkeypatch, root, WEIGHTS_FILE, room=1000)
        elif where == "config":
            _fill_up(monkeypatch, root, CONFIG_FILE, room=0)
        elif where == "meta":
            _fill_up(monkeypatch, root, META_FILE, room=0)
        else:
            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(tempfile, "mkdtemp", full)
        with pytest.raises(StoreError) as err:
            await store.stage(AdapterRef("a", src, sha))
        assert err.value.reason == "DiskFull" and err.value.status == 507 and "DiskFull" in RETRYABLE
        assert "no space left" in str(err.value).lower()
        _assert_nothing_left(store, root)
        monkeypatch.undo()
        assert (await store.stage(AdapterRef("a", src, sha))).sha256 == sha  # room again: staged


@pytest.mark.parametrize("when", ["at-staging", "added-later"])
async def test_a_full_disk_while_writing_the_serving_copy_leaves_the_adapter_without_it(tmp_path, monkeypatch, when):
    """The copy in the server's dtype is an extra: the disk full while it is written, the
    adapter is staged without it (a server converts as it reads), and no part of the copy is
    left to be read as one."""
    sha = make_adapter(tmp_path / "src" / "a")
    root = tmp_path / "cache"
    store = AdapterStore(root, 10**9)
    real_open = pathlib.Path.open

    def opened(self, mode="r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return _FullAfter(f, 100) if "w" in mode and self.name.startswith(".adapter_model.bfloat16") else f

    if when == "added-later":
        await store.stage(AdapterRef("a", str(tmp_path / "src" / "a"), sha))
    monkeypatch.setattr(pathlib.Path, "open", opened)
    staged = await store.stage(AdapterRef("a", str(tmp_path / "src" / "a"), sha, "bfloat16"))
    files = sorted(p.name for p in pathlib.Path(staged.path).iterdir())
    assert files == sorted([CONFIG_FILE, WEIGHTS_FILE, META_FILE])
    assert staged.bytes == sum(pathlib.Path(staged.path, f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE))
    assert store._reserved == 0 and list((root / ".tmp").iterdir()) == []
    monkeypatch.undo()
    again = await store.stage(AdapterRef("a", str(tmp_path / "src" / "a"), sha, "bfloat16"))
    assert pathlib.Path(again.path, "adapter_model.bfloat16.safetensors").is_file()  # room again: written
