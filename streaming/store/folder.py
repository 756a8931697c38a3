"""The local-folder backend of the KV store (LocalFolderBackend): one file per key, written
atomically, plus the key bound and the OSError classification it shares with the Redis
backend (which falls back to a folder when Redis is down).

Paper: CacheGen section 5 (encoded chunks are stored remotely and fetched on reuse). The
default backend is embedded (a local folder, nothing to install). It implements the
streaming.store.backend.StoreBackend protocol; open_backend there builds it from a path or
`file:///` URL. Not runnable by itself.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
from pathlib import Path
from typing import Iterator

from cachegen_common.files import atomic_write
from streaming.errors import StoreError, StoreFullError, StoreReadOnlyError, StoreTooLargeError

OBJ_MAGIC = b"CGOB"  # object file: magic, u32 key length, key (UTF-8), data
OBJ_HEAD = struct.Struct("<4sI")
MAX_KEY_BYTES = 4096


def _check_key(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError("store key must be a non-empty str")
    kb = key.encode("utf-8")
    if len(kb) > MAX_KEY_BYTES:
        raise ValueError(f"store key of {len(kb)} bytes exceeds {MAX_KEY_BYTES}")
    return kb


def classify_os_error(e: OSError, where: str, what: str) -> StoreError | OSError:
    """A classified StoreError for a file-system failure of a store folder (disk full ->
    StoreFullError, read-only / permission -> StoreReadOnlyError, file too large ->
    StoreTooLargeError), or `e` itself when it is none of these."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFullError(f"{where}: {what} failed, disk full ({why}): free space or use "
                              "another store folder")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StoreReadOnlyError(f"{where}: {what} failed, not writable ({why}): use a writable "
                                  "store folder or fix its permissions")
    if e.errno == errno.EFBIG:
        return StoreTooLargeError(f"{where}: {what} failed, file too large for this file system "
                                  f"({why}): store smaller chunks or use another file system")
    return e


class LocalFolderBackend:
    """Objects as files under `root/objects/<sha256[:2]>/<sha256(key)>`.

    Each file holds a small header with the key itself (so `keys()` can list keys and a
    hash collision is detected), then the data. Writes go to a temp file in the same
    folder, fsync, then os.replace: atomic on POSIX. Thread- and process-safe for
    concurrent readers and writers of distinct or identical keys (last writer wins).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.objects = self.root / "objects"
        try:
            self.objects.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise classify_os_error(e, f"store folder {self.root}", "creating it") from None

    def __repr__(self) -> str:
        return f"LocalFolderBackend({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        h = hashlib.sha256(_check_key(key)).hexdigest()
        return self.objects / h[:2] / h

    @staticmethod
    def _read_header(f) -> str | None:
        head = f.read(OBJ_HEAD.size)
        if len(head) != OBJ_HEAD.size:
            return None
        magic, klen = OBJ_HEAD.unpack(head)
        if magic != OBJ_MAGIC or klen > MAX_KEY_BYTES:
            return None
        kb = f.read(klen)
        if len(kb) != klen:
            return None
        try:
            return kb.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def get(self, key: str) -> bytes | None:
        """Return the stored bytes or None if absent (or the file is not one of ours)."""
        p = self._path(key)
        try:
            with open(p, "rb") as f:
                if self._read_header(f) != key:
                    return None
                return f.read()
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        """Store bytes atomically (temp file + fsync + rename). Raises StoreFullError (disk
        full), StoreReadOnlyError (not writable), StoreTooLargeError (file too large) or
        OSError."""
        try:
            self._put(key, data)
        except OSError as e:
            raise classify_os_error(e, f"store folder {self.root}", f"writing {len(data)} bytes") from None

    def _put(self, key: str, data: bytes) -> None:
        kb = _check_key(key)
        p = self._path(key)
        def write(f) -> None:
            f.write(OBJ_HEAD.pack(OBJ_MAGIC, len(kb)))
            f.write(kb)
            f.write(data)

        # mode 0600 as mkstemp makes it; the ".tmp-" prefix is what the store's sweeps skip
        atomic_write(p, write, binary=True, mode=0o600, prefix=".tmp-", suffix="")

    def compare_and_put(self, key: str, expected: bytes | None, data: bytes | None) -> bool:
        """Atomic compare-and-swap of one key across threads and processes: under an
        exclusive flock(2) on `root/locks/<sha256(key)>`, if the stored value equals
        `expected` (None = absent) store `data` (None = delete) and return True; else
        return False and change nothing. Errors as put."""
        import fcntl

        h = hashlib.sha256(_check_key(key)).hexdigest()
        locks = self.root / "locks"
        try:
            locks.mkdir(exist_ok=True)
            fd = os.open(locks / h, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise classify_os_error(e, f"store folder {self.root}", "locking a key") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.get(key) != expected:
                return False
            if data is None:
                self.delete(key)
            else:
                self.put(key, data)
            return True
        finally:
            os.close(fd)  # releases the lock

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        """Remove a key (no error if absent)."""
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Yield stored keys starting with prefix (order unspecified; skips temp files)."""
        for sub in sorted(self.objects.iterdir()) if self.objects.exists() else []:
            if not sub.is_dir():
                continue
            for p in sub.iterdir():
                if p.name.startswith(".tmp-"):
                    continue
                try:
                    with open(p, "rb") as f:
                        k = self._read_header(f)
                except OSError:
                    continue
                if k is not None and k.startswith(prefix):
                    yield k

