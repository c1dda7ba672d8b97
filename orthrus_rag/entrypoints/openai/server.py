"""Running the app: `serve(cfg)` for `orthrus-rag serve` (blocking, uvicorn), and `ServerThread`, which runs the
same server in a background thread on a free loopback port (tests, notebooks, LangChain against a base URL)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import uvicorn

from orthrus_rag.config.app import KEEP_ALIVE_S
from orthrus_rag.engine.clients.protocol import EngineClient
from orthrus_rag.entrypoints.openai.api import build_app

logger = logging.getLogger(__name__)
API_KEY_ENV = "ORTHRUS_API_KEY"


def resolve_api_key(api_key: str | None) -> str | None:
    """The configured key, else the ORTHRUS_API_KEY environment variable, else none (no auth)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


def serve(cfg: Any) -> None:
    """`orthrus-rag serve`: build the engine from the composed config and serve it until interrupted."""
    from orthrus_rag.entrypoints.checks import validate
    from orthrus_rag.entrypoints.clients import build_client
    from orthrus_rag.memory import SERVING_SHAPE_CACHE_ENV, bound_shape_caches

    validate(cfg)
    # NOTE: before the engine loads (oneDNN reads them at its first primitive); Ray Serve's replicas inherit them
    bound_shape_caches(SERVING_SHAPE_CACHE_ENV)
    s = cfg.serve
    if cfg.deploy.mode not in ("engine", "ray"):
        raise ValueError(f"serve runs one co-scheduled engine (deploy=engine) or its replicas on Ray Serve "
                         f"(deploy=ray); deploy.mode={cfg.deploy.mode!r} is a benchmark baseline")
    if s.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: reachable from other machines%s", s.host,
                       "" if resolve_api_key(s.api_key) else " without an API key")
    if cfg.deploy.mode == "ray":
        _serve_on_ray(cfg)
        return
    _check_index(cfg)
    client = build_client(cfg)
    app = build_app(client, s.served_model_name, resolve_api_key(s.api_key), s.default_max_tokens,
                    index=open_live_index(cfg, client))
    uvicorn.Server(uvicorn_config(app, s.host, s.port, s.log_level, s.keep_alive_s)).run()


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "info", keep_alive_s: float = KEEP_ALIVE_S,
                   ) -> uvicorn.Config:
    """How the app is served over HTTP, by `serve` and `ServerThread` alike."""
    if not keep_alive_s > 0:
        raise ValueError(f"serve.keep_alive_s must be a positive number of seconds, got {keep_alive_s}")
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_keep_alive=keep_alive_s)


def _check_index(cfg: Any) -> None:
    """Before any model loads."""
    r = cfg.retriever
    if r.index_dir is None and cfg.serve.create_index:
        raise ValueError("serve.create_index=true needs retriever.index_dir=<folder> to make the index in")
    if r.index_dir is not None and r.kind != "dense":
        raise ValueError(f"a server's index is dense (FAISS) only, so that it can take documents while it serves "
                         f"(bm25s indexes take no adds); got retriever.kind={r.kind}")


def open_live_index(cfg: Any, client: EngineClient):  # -> LiveIndex | None
    """The index a server searches and ingests into: `retriever.index_dir` (with `serve.create_index`, made there
    empty when the folder holds none), or None (no `retriever.index_dir`: the document routes answer 404)."""
    from pathlib import Path

    from orthrus_rag.entrypoints.embedding import build_embedder
    from orthrus_rag.retrievers.live_index import LiveIndex
    from orthrus_rag.retrievers.store import MANIFEST_FILE

    _check_index(cfg)
    r = cfg.retriever
    if r.index_dir is None:
        return None
    embedder = build_embedder(cfg, client)
    folder = Path(r.index_dir)
    if not (folder / MANIFEST_FILE).is_file() and cfg.serve.create_index:
        logger.info("making an empty index in %s", folder)
        return LiveIndex.create(folder, embedder)
    return LiveIndex.open(folder, embedder, search={"nprobe": r.nprobe, "ef_search": r.ef_search})


def _serve_on_ray(cfg: Any) -> None:
    """`orthrus-rag serve deploy=ray`: deploy the replicas and the ingress, then wait until interrupted (Ctrl-C or
    SIGTERM; a local Ray this started stops with it)."""
    import signal
    import time

    from ray import serve as ray_serve

    from orthrus_rag.entrypoints.ray.app import application_of, start, stop

    s, d = cfg.serve, cfg.deploy
    url = start(application_of(cfg, resolve_api_key(s.api_key)), s.host, s.port, d.ray_address, d.ray_num_cpus,
                keep_alive_s=s.keep_alive_s)
    logger.info("serving %d engine replica(s) on Ray Serve at %s", d.replicas, url)

    def _interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # NOTE: else a terminated server would leave its local Ray running
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        import ray

        stop()
        ray_serve.shutdown()
        ray.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerThread:
    """The server for `client` (an `EngineClient`) in a daemon thread on `host:port` (port 0: a free one); `url` is its base URL
    (`.../v1`). `stop()` shuts it down, and closes the client."""

    def __init__(self, client: EngineClient, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 30.0, keep_alive_s: float = KEEP_ALIVE_S, **app_kwargs: Any) -> None:
        self.host, self.port = host, port or free_port(host)
        self.app = build_app(client, **app_kwargs)
        self.server = uvicorn.Server(uvicorn_config(self.app, self.host, self.port, "warning", keep_alive_s))
        self._thread = threading.Thread(target=self.server.run, name="orthrus-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
