"""A model whose output is known: the demo model with a script added to its logits, by position.

A test that must see what the service makes of a given output (text, then a
call in a family's format) needs a model that writes that output. This is
the demo model's graph with one more input to its logits: a table, indexed
by each token's position, that adds a large score to the script's token at
each position after the prompt (and to the end of sequence after it). The
session, the cache, the sampler and the grammar are all the real ones; under
greedy decoding the script's tokens win wherever the grammar allows them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Above any score the demo model gives: a token it never writes by itself has a bias of -1e4.
SCRIPT_SCORE = 1e6
# The copy's context: the table has a row per position, so it stays small.
CONTEXT = 1024


def scripted_model(demo: Path, out: Path, *, prompt_tokens: int, script: Sequence[int], eos: int) -> Path:
    """A copy of the demo model folder ``demo`` in ``out`` that writes ``script`` then ``eos`` greedily after a
    prompt of ``prompt_tokens`` tokens (the logits at position ``p`` choose the token at ``p + 1``)."""
    shutil.copytree(demo, out, ignore=shutil.ignore_patterns("endless"))
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (out / "config.json").write_text(json.dumps(config))
    model = onnx.load(str(out / "model.onnx"))
    vocab = config["vocab_size"]
    table = np.zeros((CONTEXT, vocab), dtype=np.float32)
    for offset, token in enumerate([*script, eos]):
        table[prompt_tokens - 1 + offset, token] = SCRIPT_SCORE
    graph = model.graph
    (logits,) = [output for output in graph.output if output.name == "logits"]
    for node in graph.node:
        node.output[:] = ["logits_unscripted" if name == "logits" else name for name in node.output]
    graph.initializer.append(numpy_helper.from_array(table, "script_table"))
    graph.node.extend(
        [
            helper.make_node("Gather", ["script_table", "position_ids"], ["script_scores"], axis=0),
            helper.make_node("Add", ["logits_unscripted", "script_scores"], ["logits"]),
        ]
    )
    assert logits.name == "logits"
    for stale in out.glob("model.onnx*"):
        stale.unlink()
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True, location="model.onnx_data")
    return out
