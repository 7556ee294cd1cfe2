"""The KServe v2 gRPC front end (``inference.GRPCInferenceService``), one more adapter beside ``service.http`` on the
same engine: ``server.py`` (the service and its life cycle), ``messages.py`` (the messages of ``inference.proto``),
``frontend.py`` (an HTTP process of a multi-process server that serves gRPC too)."""
