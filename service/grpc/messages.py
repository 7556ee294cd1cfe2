"""The protobuf messages of the KServe v2 gRPC API (``inference.proto``), in a descriptor pool of their own.

``inference.proto`` (ours) declares the service and the messages this server serves, with tritonclient's package,
names and field numbers. ``protoc`` turns it into a descriptor set, ``inference.binpb``, committed beside it (the
command is in the .proto's header and docs/protocol.md, "gRPC"); this module loads that set into a private
``DescriptorPool`` and builds the message classes from it. Generated ``_pb2`` modules would register the
``inference.*`` names in protobuf's default pool, where tritonclient's generated modules register the same names
from different files: one process could not import both (``duplicate symbol``), and tests, benchmarks and
applications run the client beside the server code. Messages from a pool of their own are the same C (upb)
classes, with no such clash. The service needs no generated code either: ``service.grpc.server`` registers its
handlers by method name (``grpc.method_handlers_generic_handler``) with each method's message classes from here.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import ServiceDescriptor

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"
DESCRIPTOR_SET = "inference.binpb"


def _load() -> tuple[descriptor_pool.DescriptorPool, dict[str, Any]]:
    data = resources.files(__package__).joinpath(DESCRIPTOR_SET).read_bytes()
    files = descriptor_pb2.FileDescriptorSet.FromString(data).file
    pool = descriptor_pool.DescriptorPool()
    for file in files:
        pool.Add(file)
    return pool, message_factory.GetMessages(files, pool=pool)


POOL, _CLASSES = _load()


def message(name: str) -> Any:
    """The message class of ``inference.<name>`` (``"ModelInferRequest"``, ``"ModelInferResponse.InferOutputTensor"``
    for a nested one)."""
    outer, *nested = name.split(".")
    cls = _CLASSES[f"{PACKAGE}.{outer}"]
    for part in nested:
        cls = getattr(cls, part)
    return cls


def service() -> ServiceDescriptor:
    """The ``GRPCInferenceService`` descriptor: its methods and their input and output types."""
    return POOL.FindServiceByName(SERVICE)
