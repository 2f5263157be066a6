"""The demo model with a script after one prompt length, at any context length (for an agent's long prompt).

``tests/support/scripted.py`` adds a table with a row per position, which a
32k-token context makes too large to build; here the table has a row per
scripted token only, and a position outside the script reads a row of zeros:
the demo model's own output, unchanged. The script is written greedily after
a prompt of ``prompt_tokens`` tokens, and after no other prompt (a later turn,
longer, gets the demo model's word salad).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tests.support.scripted import SCRIPT_SCORE


def scripted_after_prompt(demo: Path, out: Path, *, prompt_tokens: int, script: Sequence[int], eos: int) -> Path:
    """A copy of the demo model folder ``demo`` in ``out`` that writes ``script`` then ``eos`` greedily after a
    prompt of exactly ``prompt_tokens`` tokens (the logits at position ``p`` choose the token at ``p + 1``)."""
    shutil.copytree(demo, out, ignore=shutil.ignore_patterns("endless"))
    config = json.loads((out / "config.json").read_text())
    model = onnx.load(str(out / "model.onnx"))
    rows = [*script, eos]
    # Row 0: no script; row i + 1: the i-th scripted token's score.
    table = np.zeros((len(rows) + 1, config["vocab_size"]), dtype=np.float32)
    for offset, token in enumerate(rows):
        table[offset + 1, token] = SCRIPT_SCORE
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["logits_unscripted" if name == "logits" else name for name in node.output]
    first = prompt_tokens - 1
    graph.initializer.extend(
        [
            numpy_helper.from_array(table, "script_table"),
            numpy_helper.from_array(np.array(first, dtype=np.int64), "script_first"),
            numpy_helper.from_array(np.array(len(rows), dtype=np.int64), "script_rows"),
            numpy_helper.from_array(np.array(0, dtype=np.int64), "script_zero"),
            numpy_helper.from_array(np.array(1, dtype=np.int64), "script_one"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Sub", ["position_ids", "script_first"], ["script_offset"]),
            helper.make_node("GreaterOrEqual", ["script_offset", "script_zero"], ["script_from"]),
            helper.make_node("Less", ["script_offset", "script_rows"], ["script_until"]),
            helper.make_node("And", ["script_from", "script_until"], ["script_inside"]),
            helper.make_node("Add", ["script_offset", "script_one"], ["script_row_inside"]),
            helper.make_node("Where", ["script_inside", "script_row_inside", "script_zero"], ["script_row"]),
            helper.make_node("Gather", ["script_table", "script_row"], ["script_scores"], axis=0),
            helper.make_node("Add", ["logits_unscripted", "script_scores"], ["logits"]),
        ]
    )
    for stale in out.glob("model.onnx*"):
        stale.unlink()
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx_data")
    return out
