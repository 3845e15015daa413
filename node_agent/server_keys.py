"""The admin keys the agent sends to the servers it warms (prefetch, pin, unpin).

One key for every server (--server-api-key, or --server-api-key-file) means that every
BaseModel's servers take that key, whatever team runs them. A folder of keys
(--server-api-keys-dir, a Secret mounted whole: one file per data key) gives each
namespace, or each BaseModel, its own:

    <dir>/<namespace>.<base model>   the servers of that BaseModel
    <dir>/<namespace>                any other server of that namespace
    the one key for all              any other server (--server-api-key or its file; none: no key)

A namespace is a DNS label, with no dot in it, so the first dot of a file's name ends its
namespace. Each file holds one key (read_key_file) and is re-read when it changes
(WatchedFile), so a key rotates without a restart; a file taken out of the Secret stops being
sent at once (the next in the order above is). A file that does not hold one key is logged
and skipped, as if it were not there, until it does.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from pathlib import Path

from loraplex.server.api_keys import WatchedFile, read_key_file  # stdlib only

log = logging.getLogger(__name__)

# A namespace (a DNS label) or a BaseModel's name (a DNS subdomain): what may name a key's
# file. Anything else (a plan's base model with a slash, say) names none.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


class ServerKeys:
    """The key for a server: the keys folder's, else the one key for all (`default`)."""

    def __init__(self, default: str | WatchedFile | None = None, keys_dir: Path | str | None = None) -> None:
        self.default = default
        self.keys_dir = Path(keys_dir) if keys_dir is not None else None
        self._lock = threading.Lock()
        self._files: dict[str, WatchedFile] = {}  # file name -> its key, as read
        self._broken: dict[str, str] = {}  # file name -> why it holds no key (logged once)

    def key_for(self, namespace: str | None, base_model: str | None) -> str | None:
        """The key to send to a server of `base_model` in `namespace` (None: send none)."""
        if self.keys_dir is not None and namespace and _NAME.fullmatch(namespace) and "." not in namespace:
            names = ([f"{namespace}.{base_model}"] if base_model and _NAME.fullmatch(base_model) else []) + [namespace]
            for name in names:
                key = self._read(name)
                if key is not None:
                    return key
        default = self.default
        return default.get() if isinstance(default, WatchedFile) else default

    def _read(self, name: str) -> str | None:
        assert self.keys_dir is not None
        path = self.keys_dir / name
        with self._lock:
            if not path.is_file():
                # Taken out of the Secret (or never in it): a key once read is not sent on.
                self._files.pop(name, None)
                self._broken.pop(name, None)
                return None
            watched = self._files.get(name)
            if watched is None:
                try:
                    watched = WatchedFile(path, functools.partial(read_key_file, flag="--server-api-keys-dir"))
                except ValueError as e:
                    if self._broken.get(name) != str(e):
                        log.error("%s; its servers get the next key in line", e)
                        self._broken[name] = str(e)
                    return None
                self._files[name] = watched
                self._broken.pop(name, None)
        return watched.get()
