"""The committed gRPC stubs are exactly what serve/generate_protos.py makes from the protos.

Also pins JetStream's wire schema (names and field numbers), which JetStream's own clients
depend on and which nothing else would notice changing.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from serve import generate_protos


def _files(root):
    return sorted(path.relative_to(root) for path in root.rglob("*")
                  if path.is_file() and "__pycache__" not in path.parts)


def test_committed_stubs_equal_fresh_output(tmp_path):
    pytest.importorskip("grpc_tools")
    committed = generate_protos.GENERATED_DIR
    recorded = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'",
                         (committed / "jaxinfer/v1/inference_pb2_grpc.py").read_text())
    installed = importlib.metadata.version("grpcio-tools")
    if recorded is None or recorded.group(1) != installed:
        # Another protoc writes other (equally valid) code; only the same version must agree.
        pytest.skip(f"stubs were made by grpcio-tools {recorded and recorded.group(1)}, "
                    f"{installed} is installed")
    fresh = tmp_path / "generated"
    written = generate_protos.generate(fresh)
    assert _files(committed) == written
    stale = [str(path) for path in written
             if (committed / path).read_text() != (fresh / path).read_text()]
    assert not stale, f"stale stubs {stale}: run `python serve/generate_protos.py`"


def test_generate_refuses_to_wipe_a_foreign_directory(tmp_path):
    pytest.importorskip("grpc_tools")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="holds no generated stubs"):
        generate_protos.generate(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_jetstream_wire_schema():
    from google.protobuf import descriptor_pb2

    from serve.generated.jetstream_proto import jetstream_pb2 as js

    service = js.DESCRIPTOR.services_by_name["Orchestrator"]
    assert service.full_name == "jetstream_proto.Orchestrator"
    assert {method.name: (method.input_type.full_name, method.output_type.full_name)
            for method in service.methods} == {
        "Decode": ("jetstream_proto.DecodeRequest", "jetstream_proto.DecodeResponse"),
        "HealthCheck": ("jetstream_proto.HealthCheckRequest",
                        "jetstream_proto.HealthCheckResponse")}

    def numbers(message):
        return {field.name: field.number for field in message.DESCRIPTOR.fields}

    assert numbers(js.DecodeRequest) == {
        "max_tokens": 4, "text_content": 5, "token_content": 6, "metadata": 7,
        "num_samples": 8, "lora_adapter_id": 9, "has_bos": 10}
    assert {oneof.name: sorted(field.name for field in oneof.fields)
            for oneof in js.DecodeRequest.DESCRIPTOR.oneofs} == {
        "content": ["text_content", "token_content"], "metadata_optional": ["metadata"]}
    assert numbers(js.DecodeRequest.TextContent) == {"text": 1}
    assert numbers(js.DecodeRequest.TokenContent) == {"token_ids": 1}
    assert numbers(js.DecodeRequest.Metadata) == {"start_time": 1}
    assert numbers(js.DecodeResponse) == {"initial_content": 2, "stream_content": 3}
    assert numbers(js.DecodeResponse.StreamContent) == {"samples": 1}
    assert numbers(js.DecodeResponse.StreamContent.Sample) == {"text": 1, "token_ids": 2}
    assert numbers(js.HealthCheckResponse) == {"is_live": 1}

    def reserved(message):
        proto = descriptor_pb2.DescriptorProto()
        message.DESCRIPTOR.CopyToProto(proto)
        return sorted(number for span in proto.reserved_range
                      for number in range(span.start, span.end))

    assert reserved(js.DecodeRequest) == [1, 2, 3]
    assert reserved(js.DecodeResponse) == [1]
