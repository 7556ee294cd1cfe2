"""The engine: the ``Service`` and its life cycle (``core``), the layer repository (``registry``), one batcher per
layer (``batcher``), one worker per device (``worker``), the kernels' batch calls (``ops``), and the engine
process of a multi-process server (``process``). It knows nothing of HTTP. docs/architecture.md has the picture.
"""
