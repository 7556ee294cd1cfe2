"""The HTTP side: the FastAPI app and its lifespan (``app``), the routes (``routes``), the raw-ASGI fast path of
the inference routes (``asgi``), uvicorn run so that a shutdown drains (``server``), and an HTTP process's link to
the engine process of a multi-process server (``frontend``). docs/architecture.md has the picture.
"""
