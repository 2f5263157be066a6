"""The engine's helper graphs, written without ``onnx`` (workers/backends/onnx/graph_proto.py).

Each graph is checked three ways: ``onnx`` parses it into the very message
that ``onnx.helper`` builds for the same graph (the reference builders
below are the ones the engine used before), ``onnx.checker`` accepts it,
and ONNX Runtime runs it to the numbers numpy computes. The engine process
then loads and runs the demo model without importing ``onnx`` at all.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from tests.support.server import REPO
from workers.backends.onnx import graph_proto as g
from workers.backends.onnx.kv_batch import merge_graph, take_graph
from workers.backends.onnx.last_row import row_graph
from workers.backends.onnx.step_picks import picks_graph

pytestmark = pytest.mark.database_free

_OPSET = 13
_IR = 8


def _reference_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=_IR)


def _reference_row(fp16: bool) -> onnx.ModelProto:
    element = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    gathered = "row16" if fp16 else "row"
    nodes = [helper.make_node("Gather", ["logits", "last"], [gathered], axis=1)]
    if fp16:
        nodes.append(helper.make_node("Cast", [gathered], ["row"], to=TensorProto.FLOAT))
    graph = helper.make_graph(
        nodes,
        "last_logits_row",
        [helper.make_tensor_value_info("logits", element, [1, "sequence", "vocabulary"])],
        [helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, "vocabulary"])],
        initializer=[helper.make_tensor("last", TensorProto.INT64, [], [-1])],
    )
    return _reference_model(graph)


def _reference_picks(fp16: bool) -> onnx.ModelProto:
    element = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    last = "last16" if fp16 else "last"
    nodes = [helper.make_node("Gather", ["logits", "minus_one"], [last], axis=1)]
    if fp16:
        nodes.append(helper.make_node("Cast", [last], ["last"], to=TensorProto.FLOAT))
    nodes += [
        helper.make_node("ArgMax", ["last"], ["best"], axis=1, keepdims=0, select_last_index=0),
        helper.make_node("ReduceMax", ["last"], ["peak"], axes=[1], keepdims=0),
        helper.make_node("IsNaN", ["last"], ["nan_each"]),
        helper.make_node("Cast", ["nan_each"], ["nan_float"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", ["nan_float"], ["nan_any"], axes=[1], keepdims=0),
        helper.make_node("Cast", ["nan_any"], ["nan"], to=TensorProto.BOOL),
        helper.make_node("Gather", ["last", "full_rows"], ["rows"], axis=0),
        helper.make_node("TopK", ["last", "k"], ["top_values", "top_ids"], axis=1, largest=1, sorted=1),
        helper.make_node("GatherElements", ["last", "gather"], ["gathered"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "step_picks",
        [
            helper.make_tensor_value_info("logits", element, ["rows", "sequence", "vocabulary"]),
            helper.make_tensor_value_info("full_rows", TensorProto.INT64, ["full"]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("gather", TensorProto.INT64, ["rows", "gathered"]),
        ],
        [
            helper.make_tensor_value_info("best", TensorProto.INT64, ["rows"]),
            helper.make_tensor_value_info("peak", TensorProto.FLOAT, ["rows"]),
            helper.make_tensor_value_info("nan", TensorProto.BOOL, ["rows"]),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["full", "vocabulary"]),
            helper.make_tensor_value_info("top_values", TensorProto.FLOAT, ["rows", "k"]),
            helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["rows", "k"]),
            helper.make_tensor_value_info("gathered", TensorProto.FLOAT, ["rows", "gathered"]),
        ],
        initializer=[helper.make_tensor("minus_one", TensorProto.INT64, [], [-1])],
    )
    return _reference_model(graph)


def _cache_type(element: int, tag: str) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(element, [f"{tag}_rows", "heads", f"{tag}_length", "head_dim"])


def _reference_take(tensors: int, element: int, axis: int) -> onnx.ModelProto:
    index = helper.make_tensor_value_info("index", TensorProto.INT64, ["kept"])
    inputs = [helper.make_value_info(f"cache_{i}", _cache_type(element, "in")) for i in range(tensors)]
    outputs = [helper.make_value_info(f"out_{i}", _cache_type(element, "out")) for i in range(tensors)]
    nodes = [helper.make_node("Gather", [f"cache_{i}", "index"], [f"out_{i}"], axis=axis) for i in range(tensors)]
    return _reference_model(helper.make_graph(nodes, f"take_axis_{axis}", [*inputs, index], outputs))


def _reference_merge(tensors: int, element: int) -> onnx.ModelProto:
    pads = [helper.make_tensor_value_info(name, TensorProto.INT64, [8]) for name in ("pad_a", "pad_b")]
    inputs, outputs, nodes = [], [], []
    for i in range(tensors):
        inputs += [helper.make_value_info(f"a_{i}", _cache_type(element, "a"))]
        inputs += [helper.make_value_info(f"b_{i}", _cache_type(element, "b"))]
        outputs.append(helper.make_value_info(f"out_{i}", _cache_type(element, "out")))
        nodes.append(helper.make_node("Pad", [f"a_{i}", "pad_a"], [f"pa_{i}"]))
        nodes.append(helper.make_node("Pad", [f"b_{i}", "pad_b"], [f"pb_{i}"]))
        nodes.append(helper.make_node("Concat", [f"pa_{i}", f"pb_{i}"], [f"out_{i}"], axis=0))
    return _reference_model(helper.make_graph(nodes, "merge_rows", [*inputs, *pads], outputs))


CASES = {
    "last row, float32": (lambda: row_graph("tensor(float)"), lambda: _reference_row(False)),
    "last row, float16": (lambda: row_graph("tensor(float16)"), lambda: _reference_row(True)),
    "step picks, float32": (lambda: picks_graph("tensor(float)"), lambda: _reference_picks(False)),
    "step picks, float16": (lambda: picks_graph("tensor(float16)"), lambda: _reference_picks(True)),
    "take rows, 4 float32 tensors": (lambda: take_graph(4, g.FLOAT, 0), lambda: _reference_take(4, 1, 0)),
    "take columns, 56 float16 tensors": (lambda: take_graph(56, g.FLOAT16, 2), lambda: _reference_take(56, 10, 2)),
    "merge, 2 float32 tensors": (lambda: merge_graph(2, g.FLOAT), lambda: _reference_merge(2, 1)),
    "merge, 56 float16 tensors": (lambda: merge_graph(56, g.FLOAT16), lambda: _reference_merge(56, 10)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_helper_graph_is_the_message_onnx_helper_builds(case: str):
    ours, reference = CASES[case]
    written = ours()
    parsed = onnx.ModelProto.FromString(written)
    onnx.checker.check_model(parsed, full_check=True)
    assert parsed == reference()
    # Byte for byte too: the same fields in the same order, the int64 initializer packed as onnx packs it.
    assert written == reference().SerializeToString()


def _run(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_the_written_graphs_compute_what_numpy_does():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 4, 11)).astype(np.float16)

    (row,) = _run(row_graph("tensor(float16)"), {"logits": logits[:1]})
    assert row.dtype == np.float32 and np.array_equal(row, logits[:1, -1].astype(np.float32))

    best, peak, nan, rows, top_values, top_ids, gathered = _run(
        picks_graph("tensor(float16)"),
        {
            "logits": logits,
            "full_rows": np.array([2, 0], dtype=np.int64),
            "k": np.array([3], dtype=np.int64),
            "gather": np.array([[1, 5], [0, 0], [10, 2]], dtype=np.int64),
        },
    )
    last = logits[:, -1].astype(np.float32)
    assert np.array_equal(best, last.argmax(axis=1)) and np.array_equal(peak, last.max(axis=1))
    assert not nan.any() and np.array_equal(rows, last[[2, 0]])
    assert np.array_equal(top_values, -np.sort(-last, axis=1)[:, :3])
    assert np.array_equal(np.take_along_axis(last, top_ids, axis=1), top_values)
    assert np.array_equal(gathered, np.take_along_axis(last, np.array([[1, 5], [0, 0], [10, 2]]), axis=1))

    caches = [rng.standard_normal((3, 2, 5, 4)).astype(np.float32) for _ in range(2)]
    feeds = {f"cache_{i}": cache for i, cache in enumerate(caches)} | {"index": np.array([2, 0], dtype=np.int64)}
    taken = _run(take_graph(2, g.FLOAT, 0), feeds)
    assert all(np.array_equal(out, cache[[2, 0]]) for out, cache in zip(taken, caches, strict=True))

    a, b = caches[0][:1, :, :3], caches[1][:2]
    merged = _run(
        merge_graph(1, g.FLOAT),
        {
            "a_0": a,
            "b_0": b,
            "pad_a": np.array([0, 0, 0, 0, 0, 0, 2, 0], dtype=np.int64),
            "pad_b": np.zeros(8, dtype=np.int64),
        },
    )[0]
    assert np.array_equal(merged, np.concatenate([np.pad(a, [(0, 0), (0, 0), (0, 2), (0, 0)]), b]))


def test_negative_integers_are_written_as_protobuf_does():
    # int64 -1 is ten bytes of two's complement on the wire; a graph's other numbers are small.
    assert onnx.TensorProto.FromString(g.int64_scalar("x", -(2**63))) == helper.make_tensor(
        "x", TensorProto.INT64, [], [-(2**63)]
    )
    assert onnx.TensorProto.FromString(g.int64_scalar("y", 300)).int64_data == [300]


def test_the_engine_process_loads_and_runs_a_model_without_importing_onnx(demo_models_root):
    """``import onnx`` (and ml_dtypes with it) cost about a second of CPU at every engine process's start."""
    probe = (
        "import sys, pathlib;"
        "import workers.engine_process.host;"
        "from workers.backends import get_backend;"
        "from workers.backends.base import SamplingParams;"
        f"model = get_backend('onnxruntime').load(pathlib.Path({str(demo_models_root / 'demo')!r}));"
        "generation = model.generate([1, 2, 3], SamplingParams(max_output_tokens=4), should_stop=lambda: False);"
        "chunks = list(generation);"
        "print(generation.output_tokens > 0, sorted(m for m in ('onnx', 'ml_dtypes') if m in sys.modules))"
    )
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    shown = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stdout.strip() == "True []"
