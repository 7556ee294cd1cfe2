"""``service/grpc/inference.proto`` is the wire format tritonclient.grpc speaks: every method and every field we
declare agrees with tritonclient's own generated definitions (name, number, type, cardinality), and the committed
descriptor set is the one the .proto generates. Also: every error status has a gRPC status code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from service import errors
from service.grpc import messages

from ..conftest import REPO_ROOT

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")


def _theirs(full_name: str) -> Descriptor:
    return service_pb2.DESCRIPTOR.pool.FindMessageTypeByName(full_name)


def _shape(field: FieldDescriptor) -> tuple[object, ...]:
    kind = field.message_type.full_name if field.message_type else (
        field.enum_type.full_name if field.enum_type else field.type)
    oneof = field.containing_oneof.name if field.containing_oneof else None
    return field.name, field.number, field.type, kind, field.is_repeated, oneof


def _messages(descriptor: Descriptor) -> list[Descriptor]:
    return [descriptor, *(m for nested in descriptor.nested_types for m in _messages(nested))]


def test_every_field_matches_tritonclient() -> None:
    ours = messages.POOL.FindFileContainingSymbol(messages.SERVICE)
    checked = 0
    for top in ours.message_types_by_name.values():
        for mine in _messages(top):
            theirs = _theirs(mine.full_name)
            for field in mine.fields:
                assert _shape(field) == _shape(theirs.fields_by_name[field.name]), f"{mine.full_name}.{field.name}"
                checked += 1
    for enum in ours.enum_types_by_name.values():
        theirs_enum = service_pb2.DESCRIPTOR.pool.FindEnumTypeByName(enum.full_name)
        assert {v.name: v.number for v in enum.values} == {v.name: v.number for v in theirs_enum.values}
    assert checked > 150


def test_every_method_matches_tritonclient() -> None:
    theirs = {m.name: m for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    mine = messages.service()
    assert mine.full_name == "inference.GRPCInferenceService"
    for method in mine.methods:
        other = theirs[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            other.input_type.full_name, other.output_type.full_name)
        assert not method.client_streaming
        assert not method.server_streaming
    assert {"ModelInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex", "SystemSharedMemoryRegister",
            "CudaSharedMemoryRegister"} <= {m.name for m in mine.methods}


def test_the_committed_descriptor_set_is_the_proto_s(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    out = tmp_path / "inference.binpb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "service/grpc", f"--descriptor_set_out={out}",
                    "service/grpc/inference.proto"], cwd=REPO_ROOT, check=True)
    committed = (REPO_ROOT / "service" / "grpc" / messages.DESCRIPTOR_SET).read_bytes()
    assert out.read_bytes() == committed, "regenerate service/grpc/inference.binpb (docs/protocol.md, 'gRPC')"


def test_every_error_status_has_a_grpc_code() -> None:
    statuses = {cls.status for cls in vars(errors).values()
                if isinstance(cls, type) and issubclass(cls, errors.ServiceError)}
    for status in statuses:
        error = errors.ServiceError("x")
        error.status = status
        assert status in errors.GRPC_CODES
        assert grpc.StatusCode[errors.grpc_code(error)] is not grpc.StatusCode.OK
    assert errors.grpc_code(errors.UnauthorizedError("x")) == "UNAUTHENTICATED"
    assert errors.grpc_code(errors.UnknownLayerError("x")) == "NOT_FOUND"
    assert errors.grpc_code(errors.InvalidInputError("x")) == "INVALID_ARGUMENT"
    assert errors.grpc_code(errors.DeadlineExceededError("x")) == "DEADLINE_EXCEEDED"


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16384, (1 << 21) + 5])
def test_an_answer_s_output_bytes_are_its_raw_output_contents(size: int) -> None:
    """The answer is serialized with the output's bytes appended as raw_output_contents (field, tag and length
    written by hand): tritonclient's message reads them back, with the other fields."""
    from service.grpc.server import _Answer, _serialize_answer

    response = messages.message("ModelInferResponse")(model_name="up", model_version="1", id="r")
    response.outputs.add(name="output", datatype="FP32", shape=[size])
    response.parameters["deconv_batch_size"].int64_param = 3
    data = bytes(i % 251 for i in range(size))
    wire = _serialize_answer(_Answer(response, memoryview(data)))
    theirs = service_pb2.ModelInferResponse.FromString(wire)
    assert list(theirs.raw_output_contents) == [data]
    assert (theirs.model_name, theirs.id, list(theirs.outputs[0].shape)) == ("up", "r", [size])
    assert theirs.parameters["deconv_batch_size"].int64_param == 3
    assert _serialize_answer(_Answer(response, None)) == response.SerializeToString()


@pytest.mark.parametrize("size", [10, (64 << 10) + 3, 1 << 21])
def test_a_request_s_inputs_are_read_as_the_message_holds_them(size: int) -> None:
    """Large requests have their raw_input_contents taken as views of the received bytes, the other fields parsed:
    the same values as protobuf's own parser reads, whatever the fields' order."""
    from service.grpc.server import _parse_request

    theirs = service_pb2.ModelInferRequest(model_name="up", model_version="1", id="r7")
    theirs.inputs.add(name="input", datatype="FP32", shape=[1, 4, 3, 3]).parameters["p"].int64_param = 5
    theirs.outputs.add(name="output")
    theirs.parameters["timeout"].int64_param = 1234
    data = bytes(i % 253 for i in range(size))
    fields = theirs.SerializeToString()
    raw = service_pb2.ModelInferRequest(raw_input_contents=[data]).SerializeToString()
    theirs.raw_input_contents.append(data)
    wire = theirs.SerializeToString()
    assert wire == fields + raw
    for message in (wire, raw + fields):  # the inputs' bytes last (as protobuf writes them), or first
        parsed = _parse_request(message)
        assert [bytes(b) for b in parsed.raw] == [data]
        mine = parsed.message
        assert (mine.model_name, mine.model_version, mine.id) == ("up", "1", "r7")
        assert list(mine.inputs[0].shape) == [1, 4, 3, 3]
        assert mine.inputs[0].parameters["p"].int64_param == 5
        assert mine.parameters["timeout"].int64_param == 1234
        assert [o.name for o in mine.outputs] == ["output"]
    if size >= 64 << 10:
        assert isinstance(_parse_request(wire).raw[0], memoryview)
        with pytest.raises(DecodeError):
            _parse_request(wire[:-1])  # the input's bytes cut short
