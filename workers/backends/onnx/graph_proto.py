"""The engine's own small ONNX graphs, written as protobuf bytes without the ``onnx`` package.

The helper graphs (``last_row``, ``step_picks``, ``kv_batch``) are a few
nodes each, built once per loaded model. Building them with ``onnx.helper``
imported ``onnx`` and, through it, ``ml_dtypes``: about a second of CPU at
every engine process's start on a slow 2-core machine, more than ONNX
Runtime and numpy together (docs/decisions/0003). This module writes the
handful of ONNX messages those graphs use straight to protobuf's wire
format; ``tests/test_graph_proto.py`` checks that ``onnx`` parses each graph
into the very message ``onnx.helper`` builds, and that ONNX Runtime runs it.

Field numbers are onnx.proto's (ONNX 1.x, stable since IR 3).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# TensorProto.DataType
FLOAT = 1
INT64 = 7
BOOL = 9
FLOAT16 = 10

# AttributeProto.AttributeType
_ATTRIBUTE_INT = 2
_ATTRIBUTE_INTS = 7

_VARINT = 0
_BYTES = 2


def _varint(value: int) -> bytes:
    # A negative int64 is sent as its 64-bit two's complement: ten bytes.
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3 | _VARINT) + _varint(value)


def _bytes(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | _BYTES) + _varint(len(value)) + value


def _text(field: int, value: str) -> bytes:
    return _bytes(field, value.encode())


def _attribute(name: str, value: int | Sequence[int]) -> bytes:
    if isinstance(value, int):
        return _text(1, name) + _int(3, value) + _int(20, _ATTRIBUTE_INT)
    return _text(1, name) + b"".join(_int(8, item) for item in value) + _int(20, _ATTRIBUTE_INTS)


@dataclass(frozen=True)
class Node:
    """A NodeProto of the default domain, its attributes integers or lists of integers."""

    op_type: str
    inputs: Sequence[str]
    outputs: Sequence[str]
    attributes: dict[str, int | Sequence[int]]

    def encode(self) -> bytes:
        out = b"".join(_text(1, name) for name in self.inputs)
        out += b"".join(_text(2, name) for name in self.outputs)
        out += _text(4, self.op_type)
        # Sorted by name, as onnx.helper.make_node writes them.
        return out + b"".join(_bytes(5, _attribute(k, v)) for k, v in sorted(self.attributes.items()))


def node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attributes: int | Sequence[int]) -> Node:
    return Node(op_type, tuple(inputs), tuple(outputs), attributes)


def tensor_value(name: str, element: int, shape: Iterable[int | str]) -> bytes:
    """A ValueInfoProto: a tensor of ``element`` whose dimensions are sizes (int) or names (str)."""
    dims = b"".join(_bytes(1, _int(1, dim) if isinstance(dim, int) else _text(2, dim)) for dim in shape)
    tensor_type = _int(1, element) + _bytes(2, dims)
    return _text(1, name) + _bytes(2, _bytes(1, tensor_type))


def int64_scalar(name: str, value: int) -> bytes:
    """A TensorProto initializer: one int64, no dimensions."""
    return _int(2, INT64) + _bytes(7, _varint(value)) + _text(8, name)


def model(
    nodes: Sequence[Node],
    name: str,
    inputs: Sequence[bytes],
    outputs: Sequence[bytes],
    *,
    initializers: Sequence[bytes] = (),
    opset: int,
    ir_version: int,
) -> bytes:
    """A serialised ModelProto of one graph, on the default domain's ``opset``."""
    graph = b"".join(_bytes(1, item.encode()) for item in nodes)
    graph += _text(2, name)
    graph += b"".join(_bytes(5, item) for item in initializers)
    graph += b"".join(_bytes(11, item) for item in inputs)
    graph += b"".join(_bytes(12, item) for item in outputs)
    opset_import = _text(1, "") + _int(2, opset)
    return _int(1, ir_version) + _bytes(7, graph) + _bytes(8, opset_import)
