"""The app factory: ``create_app(settings)`` builds the FastAPI app (``service.http.asgi.App``) around one
``service.engine.core.Service``, whose life cycle the app's lifespan runs: started before the first request, drained and
stopped at shutdown.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI

from service.config import VERSION, Settings
from service.engine.core import Service
from service.errors import install_error_handlers
from service.http import routes, shm_routes
from service.http.asgi import App
from service.http.shm_regions import RegionTable


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the service before the first request; drain and stop it at shutdown, then close the shared-memory
    regions this process opened."""
    service: Service = app.state.service
    service.budget.publish()
    await service.start()
    try:
        yield
    finally:
        try:
            await service.stop()
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


def create_app(settings: Settings | None = None, service: Service | None = None,
               regions_dir: Path | None = None) -> App:
    """Build the app. ``settings`` default to ``service``'s, else to ``Settings()`` (the ``DECONV_*`` environment),
    read here.

    ``service``: the ``Service`` the app serves, by default a new one of ``settings``. An HTTP process of a
    multi-process server passes its ``service.http.frontend.FrontendService``, whose requests go to the engine process
    instead of batchers and workers of its own.

    ``regions_dir``: where the system shared-memory regions are kept for every HTTP process of a multi-process
    server (``service.http.shm_regions.DirectoryStore``); None keeps them in this process.
    """
    if settings is None:
        settings = service.settings if service is not None else Settings()
    logging.getLogger("deconv").setLevel(settings.log_level.upper())
    app = App(fast_routes=routes.match_inference, title="deconv", version=VERSION, description=DESCRIPTION,
              lifespan=lifespan)
    app.state.service = service if service is not None else Service(settings)
    app.state.regions = RegionTable(settings.system_shm_max_regions, settings.system_shm_max_bytes, regions_dir)
    install_error_handlers(app)
    app.include_router(routes.router)
    app.include_router(shm_routes.router)
    return app
