"""The route table of the inference routes (``POST /deconv`` and KServe's infer), which ``service.http.asgi.App``
answers itself; the app's other routes are FastAPI's, on the routers of ``service.http.native_routes``,
``service.http.kserve_routes``, ``service.http.model_routes`` and ``service.http.shm_routes``.

Every inference request, native or KServe, takes the same path (``service.http.inference``): read the body
(size-checked), decode it without copies, validate it against the layer, submit it to the layer's queue in the
engine (``Engine.queues``), wait for its result while watching for the client going away and for its deadline,
encode the output. Their handlers (``deconv_call``, ``v2_infer_call``) take a ``service.http.asgi.Call``, admitted
before they run (``service.http.asgi.admit``: the API key, the query parameters the route's model requires, the
deadline header). ``INFERENCE_ROUTES`` declares their routes once: the paths ``App`` matches, and the pydantic models
of their parameters, bodies and errors (``service.http.schemas``), from which their OpenAPI operations are
generated.
"""

from __future__ import annotations

from pydantic import BaseModel

from service import codec
from service.engine.kserve import MODEL_VERSION
from service.http.asgi import Body, FastRoute, FastRoutes
from service.http.kserve_routes import v2_infer_call
from service.http.native_routes import deconv_call
from service.http.schemas import (
    ERROR_TYPES,
    DeadlineHeader,
    ErrorBody,
    KServeError,
    KServeInferRequest,
    KServeInferResponse,
    LayerQuery,
    ModelPath,
    VersionedModelPath,
)


def _error_bodies(model: type[BaseModel]) -> dict[int, Body]:
    """The error responses of an inference route, each a JSON body of ``model``."""
    return {code: Body(d, {"application/json": model}) for code, d in ERROR_TYPES.items()}


_TENSOR_FILE: dict[str, type[BaseModel] | None] = {codec.NPY: None, codec.SAFETENSORS: None}
_KSERVE_REQUEST = Body("A KServe v2 inference request. With the binary tensor extension the JSON is followed by the "
                       "input's raw little-endian bytes; the header Inference-Header-Content-Length gives the JSON's "
                       "length and the input's parameters.binary_data_size the bytes'.",
                       {"application/json": KServeInferRequest, "application/octet-stream": None})
_KSERVE_RESPONSE = Body("A KServe v2 inference response. When binary output is asked for "
                        "(parameters.binary_data_output, or the output's parameters.binary_data) the JSON is followed "
                        "by the output's raw little-endian bytes; the header Inference-Header-Content-Length gives the "
                        "JSON's length and the output's parameters.binary_data_size the bytes'. Headers: "
                        "X-Deconv-Batch-Size, X-Deconv-Queue-Ms.",
                        {"application/json": KServeInferResponse, "application/octet-stream": None})
_KSERVE_DESCRIPTION = "Run layer ``name`` on input ``input``; the output ``output`` comes back as JSON data or binary."

# The inference routes, which service.http.asgi.App answers itself: their one declaration, for matching and OpenAPI.
INFERENCE_ROUTES = FastRoutes([
    FastRoute(
        "deconv", "/deconv", deconv_call, summary="Run one layer on one tensor",
        description="Run layer ``layer`` on the tensor in the body and return the output in the negotiated format.",
        tags=["inference"], parameters={"query": LayerQuery, "header": DeadlineHeader},
        body=Body("One tensor [N, C_in, H, W] or [C_in, H, W] in the layer's dtype, as .npy or safetensors "
                  "(bfloat16: safetensors only).", _TENSOR_FILE),
        responses={200: Body("The output tensor [N, C_out, H_out, W_out] (or [C_out, H_out, W_out]) in the request's "
                             "format (or the one Accept names), same dtype. Headers: X-Deconv-Batch-Size, "
                             "X-Deconv-Queue-Ms.", _TENSOR_FILE),
                   **_error_bodies(ErrorBody)}),
    FastRoute(
        "v2_infer", "/v2/models/{name}/infer", v2_infer_call, summary="Inference (KServe v2)",
        description=_KSERVE_DESCRIPTION, tags=["kserve"],
        parameters={"path": ModelPath, "header": DeadlineHeader}, body=_KSERVE_REQUEST,
        responses={200: _KSERVE_RESPONSE, **_error_bodies(KServeError)}),
    FastRoute(
        "v2_infer_version", "/v2/models/{name}/versions/{version}/infer", v2_infer_call,
        summary="Inference (versioned)", tags=["kserve"],
        description=f"As ``/v2/models/{{name}}/infer``; the only version is ``{MODEL_VERSION}``.",
        parameters={"path": VersionedModelPath, "header": DeadlineHeader}, body=_KSERVE_REQUEST,
        responses={200: _KSERVE_RESPONSE, **_error_bodies(KServeError)}),
])
