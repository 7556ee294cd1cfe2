"""Python client of the deconv service: run served ConvTranspose2d layers on numpy arrays or torch tensors.

    import numpy as np
    from deconv_client import Client

    with Client("http://127.0.0.1:8000") as client:
        print([layer.name for layer in client.layers()])
        y = client.deconv("demo", np.random.rand(2, 16, 32, 32).astype(np.float32))  # numpy in, numpy out

:class:`Client` (blocking, thread-safe) and :class:`AsyncClient` (asyncio) have the same methods. Errors form one
tree under :class:`DeconvError` (see :mod:`deconv_client.errors`); retries are set with :class:`Retry`.
"""

from ._version import __version__
from .client import DEFAULT_TIMEOUT, DEFAULT_URL, AsyncClient, Client
from .errors import (
    APIError,
    BadRequestError,
    CodecError,
    DeadlineExceededError,
    DeconvError,
    InvalidInputError,
    MalformedBodyError,
    NotReadyError,
    OverloadedError,
    PayloadTooLargeError,
    ServerError,
    TransportError,
    UnauthorizedError,
    UnknownLayerError,
    UnsupportedMediaTypeError,
)
from .layers import LayerInfo
from .retry import Retry

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_URL",
    "APIError",
    "AsyncClient",
    "BadRequestError",
    "Client",
    "CodecError",
    "DeadlineExceededError",
    "DeconvError",
    "InvalidInputError",
    "LayerInfo",
    "MalformedBodyError",
    "NotReadyError",
    "OverloadedError",
    "PayloadTooLargeError",
    "Retry",
    "ServerError",
    "TransportError",
    "UnauthorizedError",
    "UnknownLayerError",
    "UnsupportedMediaTypeError",
    "__version__",
]
