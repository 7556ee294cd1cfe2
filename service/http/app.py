"""The app factory: ``create_app(settings, engine)`` builds the FastAPI app (``service.http.asgi.App``) around one
``service.engine.interface.Engine``, whose life cycle the app's lifespan runs: started before the first request,
drained and stopped at shutdown. The app is the same whichever engine it is given: a ``LocalEngine`` (a server of
one process) or a ``RemoteEngine`` (each HTTP process of a multi-process server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from fastapi import FastAPI

from service.budget import Budget
from service.config import VERSION, Settings, inflight_limit
from service.engine.interface import Engine
from service.engine.local import LocalEngine
from service.errors import install_error_handlers
from service.http import kserve_routes, model_routes, native_routes, routes, shm_routes
from service.http.asgi import App
from service.http.bodies import BodyPool
from service.http.shm_regions import RegionTable

# Something that serves beside the app, on the same engine, regions and budget (the gRPC front end,
# ``service.grpc``): given the app, a context entered once the engine has started and left before it stops.
Companion = Callable[[App], AbstractAsyncContextManager[None]]


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine, then the app's companions, before the first request; at shutdown stop the companions,
    drain and stop the engine, then close the shared-memory regions this process opened."""
    engine: Engine = app.state.engine
    app.state.budget.publish()
    await engine.start()
    try:
        async with contextlib.AsyncExitStack() as companions:
            for companion in app.state.companions:
                await companions.enter_async_context(companion(app))  # type: ignore[arg-type]
            yield
    finally:
        try:
            await engine.stop()
        finally:
            app.state.regions.close()


DESCRIPTION = """\
Transposed-convolution (ConvTranspose2d) layers with dynamic batching: on NVIDIA GPUs they run on the deconv
CUDA kernels; a server without a GPU runs PyTorch's reference implementation on the CPU (the start-up log
says which).

* `POST /deconv?layer=NAME`: the body is one tensor `[N, C, H, W]` or `[C, H, W]` as `.npy`
  (`application/x-npy`) or safetensors (`application/vnd.safetensors`, also for bfloat16); the output comes back
  in the same format unless `Accept` names the other, with the same dtype.
* `GET /v1/layers`, `GET /v1/layers/{name}`: what each layer takes and returns.
* `/v2/...`: KServe v2 / Open Inference Protocol (JSON and binary tensors), for `tritonclient[http]`.
* Errors: `{"error": {"type": ..., "message": ...}}` (under `/v2`: `{"error": ..., "type": ...}`).
"""


def create_app(settings: Settings | None = None, engine: Engine | None = None,
               regions_dir: Path | None = None, companions: Sequence[Companion] = ()) -> App:
    """Build the app. ``settings`` default to ``engine``'s, else to ``Settings()`` (the ``DECONV_*`` environment),
    read here.

    ``engine``: the ``Engine`` the app serves, by default a new ``LocalEngine`` of ``settings`` (batchers and workers
    in this process). An HTTP process of a multi-process server passes a ``RemoteEngine``, whose requests go to the
    engine process.

    ``regions_dir``: where the system shared-memory regions are kept for every HTTP process of a multi-process
    server (``service.http.shm_regions.DirectoryStore``); None keeps them in this process.

    ``companions``: what serves beside the app while it runs (``Companion``).
    """
    if settings is None:
        settings = engine.settings if engine is not None else Settings()
    logging.getLogger("deconv").setLevel(settings.log_level.upper())
    engine = engine if engine is not None else LocalEngine(settings)
    app = App(fast_routes=routes.INFERENCE_ROUTES, title="deconv", version=VERSION, description=DESCRIPTION,
              lifespan=lifespan, engine=engine,
              budget=Budget(inflight_limit(settings), engine.metrics),  # bytes of requests in flight
              bodies=BodyPool(settings.body_pool_bytes))  # reused buffers for multi-megabyte request bodies
    app.state.json_parsing = asyncio.Semaphore(1)  # large KServe JSON inputs are parsed in a thread, one at a time
    app.state.regions = RegionTable(settings.system_shm_max_regions, settings.system_shm_max_bytes, regions_dir,
                                    settings.cuda_shm_max_regions)
    app.state.companions = tuple(companions)
    install_error_handlers(app)
    app.include_router(model_routes.router)  # first: /v2/models/stats before /v2/models/{name}
    app.include_router(native_routes.router)
    app.include_router(kserve_routes.router)
    app.include_router(shm_routes.router)
    return app
