"""The engine: what the HTTP side serves, through one interface (``interface``: ``Engine``, ``LayerQueue``) with two
implementations: ``local`` (``LocalEngine``: this process's batchers and workers) and ``remote`` (``RemoteEngine``:
frames to the engine process). Below them the layer repository (``registry``), one batcher per layer (``batcher``),
worker threads on each device (``worker``), the kernels' batch calls (``ops``), and the engine process of a
multi-process server (``process``), which runs a ``LocalEngine``. It knows nothing of HTTP. docs/architecture.md has
the picture.
"""
