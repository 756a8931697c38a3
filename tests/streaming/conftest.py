"""Fixtures shared by the streaming tests.

``server``: an in-process KV store server (streaming.store.server.KVStoreServer) over a
local-folder backend in the test's tmp_path, serving on a loopback port from a thread;
tests reach it with ``StoreClient(*server.address)`` and may reach into
``server.store.backend`` to inject faults. Shut down and closed after the test.
"""

from __future__ import annotations

import pytest

from streaming.store.folder import LocalFolderBackend
from streaming.store.server import KVStoreServer


@pytest.fixture
def server(tmp_path):
    """A started in-process KVStoreServer over LocalFolderBackend(tmp_path / "store")."""
    srv = KVStoreServer(LocalFolderBackend(tmp_path / "store"))
    srv.start_thread()
    yield srv
    srv.shutdown()
    srv.server_close()
