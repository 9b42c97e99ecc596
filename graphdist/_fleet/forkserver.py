"""graphdist's own fork servers: processes that imported TensorFlow once and fork one child per
server.

graphdist does not share ``multiprocess``'s global fork server: that one may already be running
(started by the user's code without TensorFlow preloaded, or without graphdist's loopback shim),
and its environment is fixed when it starts. Each distinct start environment here (today: with or
without the ``LD_PRELOAD`` bind shim) gets its own fork server, started on first use. A child does
not re-run the owner's ``__main__`` either: a server needs nothing from it, and re-running a user's
script (or failing to, for a notebook) in every server would be slow and surprising.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any

from graphdist._fleet.loopback import with_preload

__all__ = ["PRELOAD", "process_class"]

PRELOAD = ["tensorflow", "graphdist._fleet.server", "graphdist._fleet.forkserver_exit"]
_lock = threading.Lock()
_env_lock = threading.Lock()
_servers: dict[str, Any] = {}  # LD_PRELOAD value ("" for none) -> ForkServer
_classes: dict[str, Any] = {}


def _fork_server(preload_library: str) -> Any:
    with _lock:
        server = _servers.get(preload_library)
        if server is None:
            server = _new_fork_server(preload_library)
            server.set_forkserver_preload(PRELOAD)
            _servers[preload_library] = server
        return server


def _new_fork_server(preload_library: str) -> Any:
    from multiprocess import forkserver

    class ForkServer(forkserver.ForkServer):  # type: ignore[misc]
        def ensure_running(self) -> None:
            # The fork server inherits os.environ when it is spawned: set LD_PRELOAD for that
            # moment only (the user's own entries kept), so this process and its other
            # children stay untouched.
            with _env_lock:
                saved = os.environ.pop("LD_PRELOAD", None)
                if preload_library:
                    os.environ["LD_PRELOAD"] = with_preload(preload_library, saved)
                try:
                    super().ensure_running()
                finally:
                    os.environ.pop("LD_PRELOAD", None)
                    if saved is not None:
                        os.environ["LD_PRELOAD"] = saved

    return ForkServer()


def process_class(preload_library: str = "") -> Any:
    """A ``multiprocess`` Process class whose ``start()`` forks from graphdist's fork server for
    ``preload_library`` (``""``: no ``LD_PRELOAD``)."""
    with _lock:
        cls = _classes.get(preload_library)
        if cls is not None:
            return cls
    from multiprocess import context, forkserver, popen_forkserver, reduction, spawn, util

    server = _fork_server(preload_library)

    class _Popen(popen_forkserver.Popen):  # type: ignore[misc]
        def _launch(self, process_obj: Any) -> None:
            # popen_forkserver.Popen._launch, with our fork server and without __main__.
            prep_data = spawn.get_preparation_data(process_obj._name)
            prep_data.pop("init_main_from_path", None)
            prep_data.pop("init_main_from_name", None)
            buf = io.BytesIO()
            context.set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                context.set_spawning_popen(None)
            self.sentinel, w = server.connect_to_new_process(self._fds)
            parent_w = os.dup(w)
            self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    class _Process(context.ForkServerProcess):  # type: ignore[misc]
        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return _Popen(process_obj)

    with _lock:
        _classes.setdefault(preload_library, _Process)
        return _classes[preload_library]
