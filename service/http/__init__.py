"""The HTTP side, the same code whichever engine it serves (``service.engine.interface.Engine``): the FastAPI app and
its lifespan (``app``), the routes of the native API (``native_routes``) and of KServe v2 (``kserve_routes``,
``model_routes``, ``shm_routes``), the inference routes' table (``routes``), the steps every inference request takes
(``inference``), the request and response models (``schemas``), the raw-ASGI fast path of the inference routes
(``asgi``), uvicorn run so that a shutdown drains (``server``), and the entry of an HTTP process of a multi-process
server (``frontend``). docs/architecture.md has the picture.
"""
