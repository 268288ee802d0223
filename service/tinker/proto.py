"""The protobuf messages of Tinker's ``forward_backward``, defined here, wire-compatible.

The SDK posts ``ForwardBackwardRequest`` as protobuf and reads ``ForwardBackwardOutput`` back
as protobuf. Rather than depend on the SDK's generated module, the gateway declares the same
messages (same package, names, field numbers and wire types) and builds their classes at
import time. Only what the gateway reads is declared: a field it does not know (provenance
spans) is skipped by the parser. Image and audio chunks are declared as opaque bytes, enough
to see them and refuse them; a dtype enum travels as the varint it is.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"

DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
DTYPE_BFLOAT16 = 4

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "bool": _F.TYPE_BOOL,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "double": _F.TYPE_DOUBLE,
}

# message -> [(field, number, type, repeated)]; a type that is not a scalar names a message,
# "map<K,V>" a map. Numbers and types are Tinker's (tinker_public.proto).
_MESSAGES: dict[str, list[tuple[str, int, str, bool]]] = {
    "EncodedTextChunk": [("tokens", 1, "bytes", False)],  # int32 little-endian
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", False),
        ("image", 2, "bytes", False),  # an ImageChunk message, not read
        ("dmel", 3, "bytes", False),  # a DmelChunk message, not read
    ],
    "Tensor": [
        ("dense", 1, "bytes", False),
        ("sparse_csr", 2, "bytes", False),  # a SparseCsr message, not read: refused
        ("dtype", 3, "int32", False),
        ("shape", 4, "int64", True),
    ],
    "Datum": [
        ("model_input", 1, "Chunk", True),
        ("loss_fn_inputs", 2, "map<string,Tensor>", False),
    ],
    "LossConfigValue": [("number", 1, "double", False), ("text", 2, "string", False)],
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", False),
        ("seq_id", 2, "int32", False),
        ("data", 3, "Datum", True),
        ("loss_fn", 4, "string", False),
        ("loss_fn_config", 5, "map<string,double>", False),
        ("forward_only", 6, "bool", False),
        ("loss_fn_config_v2", 7, "map<string,LossConfigValue>", False),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes", False),
        ("offsets", 2, "bytes", False),  # int64 byte offsets, one per datum and one more
        ("dtype", 3, "int32", False),
        ("trailing_shape", 4, "int64", True),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", False),
        ("fields", 2, "map<string,BatchedTensor>", False),
        ("num_datums", 3, "int64", False),
    ],
    "SampledSequence": [
        ("stop_reason", 1, "int32", False),  # an enum: 0 stop, 1 length (a varint either way)
        ("tokens", 2, "bytes", False),  # int32 little-endian
        ("logprobs", 3, "bytes", False),  # float32 little-endian
    ],
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", True),
        ("prompt_logprobs", 2, "bytes", False),  # float32, NaN where none (the first token)
        ("prompt_cache_hit_tokens", 4, "int32", False),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", False),
        ("loss_fn_outputs", 2, "ArrayRecord", True),
        ("metrics", 3, "map<string,double>", False),
    ],
}


_ONEOFS = {"LossConfigValue": "value"}
"""A message whose fields are all one ``oneof`` (so that which one is set can be asked)."""


def _set_type(field: Any, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{type_name}"


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(
        name="trainctl_tinker_wire.proto", package=PACKAGE, syntax="proto3"
    )
    for name, fields in _MESSAGES.items():
        msg = f.message_type.add(name=name)
        if name in _ONEOFS:
            msg.oneof_decl.add(name=_ONEOFS[name])
        for field_name, number, type_name, repeated in fields:
            field = msg.field.add(name=field_name, number=number)
            if name in _ONEOFS:
                field.oneof_index = 0
            if type_name.startswith("map<"):
                key, value = type_name[4:-1].split(",")
                entry = msg.nested_type.add(name=f"{field_name.title().replace('_', '')}Entry")
                entry.options.map_entry = True
                _set_type(entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL), key)
                _set_type(entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL), value)
                field.label = _F.LABEL_REPEATED
                field.type = _F.TYPE_MESSAGE
                field.type_name = f".{PACKAGE}.{name}.{entry.name}"
            else:
                field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
                _set_type(field, type_name)
    return f


_pool = descriptor_pool.DescriptorPool()
_pool.Add(_file())


def _cls(name: str) -> Any:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ForwardBackwardRequest = _cls("ForwardBackwardRequest")
ForwardBackwardOutput = _cls("ForwardBackwardOutput")
SampleResponse = _cls("SampleResponse")
