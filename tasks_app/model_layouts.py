"""Which files of a model folder make which models: the layouts people download.

Read from file names (and ``genai_config.json``, which names its decoder)
alone, so the scan of a folder on disk and ``lmsp_models pull`` over a
repository's file list agree on what a model is and which files it uses:

- ``optimum``: ``model.onnx`` in the folder, as ``optimum-cli export onnx``
  writes it; ``model_<variant>.onnx`` beside it (``model_quantized.onnx``,
  as Optimum's quantizer writes it) is the tag ``<variant>``;
- ``onnx-community``: the graphs in ``onnx/`` (``model.onnx``,
  ``model_fp16.onnx``, ``model_q4.onnx``, ...), configs and tokenizer in the
  folder itself; each ``model_<variant>.onnx`` is the tag ``<variant>``;
- ``genai``: an onnxruntime-genai builder folder, ``genai_config.json``
  naming the decoder file (often a long name);
- ``optimum-merged``: a legacy Optimum export, ``decoder_model_merged.onnx``
  with its ``use_cache_branch`` input (also ``onnx/decoder_model_merged*.onnx``).

The older unmerged pair (``decoder_model.onnx`` + ``decoder_with_past_model.onnx``)
is refused with a message that says why and what to do.

A model's files are its graph, the graph's external data and the side files
the backend reads; a variant's digest covers exactly those, so a new fp16
file does not make the q4 model reload.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

LAYOUT_OPTIMUM = "optimum"
LAYOUT_ONNX_COMMUNITY = "onnx-community"
LAYOUT_GENAI = "genai"
LAYOUT_OPTIMUM_MERGED = "optimum-merged"

GENAI_CONFIG = "genai_config.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
# Every file the ONNX backend may read beside the graph, in the order it reads them.
SIDE_FILES = (
    CONFIG,
    GENAI_CONFIG,
    "generation_config.json",
    TOKENIZER,
    "tokenizer_config.json",
    "chat_template.jinja",
)
COMMUNITY_DIR = "onnx"

_TAG = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
NAME_RE = re.compile(rf"^{_TAG}$")
"""What a model folder's name (and a tag folder's) must look like: it becomes part of a model id."""
_GRAPH_RE = re.compile(rf"^(?P<stem>model|decoder_model_merged)(?:_(?P<variant>{_TAG}))?\.onnx$")
_LEGACY_PAIR = ("decoder_model.onnx", "decoder_with_past_model.onnx")

ReadJson = Callable[[str], Any]
"""Reads a file of the folder as JSON; raises ``ValueError`` (with a reason) when it is not readable JSON."""


@dataclass(frozen=True)
class LayoutModel:
    """One model a folder holds."""

    tag: str | None
    """The variant's tag, or None for the folder's default model (``model.onnx``)."""
    graph: str
    """The decoder graph's path relative to the folder."""
    layout: str
    files: tuple[str, ...]
    """Every file the model uses, relative to the folder: graph, external data, side files."""


@dataclass(frozen=True)
class FolderLayout:
    models: tuple[LayoutModel, ...]
    problems: tuple[str, ...]
    """Why (part of) the folder is not a model, each naming the file; empty when all is well."""


def external_data(graph: str, files: Collection[str]) -> list[str]:
    """The external data files of ``graph`` as exporters name them (``model.onnx_data``,
    ``model.onnx_data_1``, ``model.onnx.data``), in name order."""
    prefixes = (f"{graph}_data", f"{graph}.data")
    return sorted(f for f in files if f.startswith(prefixes) and "/" not in f[len(graph) :])


def folder_layout(files: Collection[str], *, read_json: ReadJson) -> FolderLayout:
    """The models in a folder whose files (POSIX paths relative to it) are ``files``."""
    present = set(files)
    problems = _side_file_problems(present, read_json)
    if problems:
        if GENAI_CONFIG not in present and not (_graphs(present, "") or _graphs(present, COMMUNITY_DIR)):
            problems.insert(0, _no_graph_problem(present))
        return FolderLayout(models=(), problems=tuple(problems))
    side = tuple(name for name in SIDE_FILES if name in present)
    if GENAI_CONFIG in present:
        return _genai(present, side, read_json)
    models: dict[str | None, LayoutModel] = {}
    shadowed: list[str] = []
    for directory, default_layout in (("", LAYOUT_OPTIMUM), (COMMUNITY_DIR, LAYOUT_ONNX_COMMUNITY)):
        for graph, tag, stem in _graphs(present, directory):
            layout = LAYOUT_OPTIMUM_MERGED if stem == "decoder_model_merged" else default_layout
            # model*.onnx sort before decoder_model_merged*.onnx of the same tag, and the
            # folder's own graphs before onnx/'s: the first one found keeps the tag, and
            # the other is named, not dropped in silence.
            if tag in models:
                what = f"the tag {tag!r}" if tag else "the default model"
                shadowed.append(f"{graph} is not registered: {models[tag].graph} already is {what}")
                continue
            graph_files = (graph, *external_data(graph, present))
            models[tag] = LayoutModel(tag=tag, graph=graph, layout=layout, files=graph_files + side)
    if models:
        return FolderLayout(models=tuple(models.values()), problems=tuple(shadowed))
    return FolderLayout(models=(), problems=(_no_graph_problem(present),))


def _side_file_problems(present: set[str], read_json: ReadJson) -> list[str]:
    problems = []
    if TOKENIZER not in present:
        problems.append(f"has no {TOKENIZER} (the backend needs a fast tokenizer file)")
    if CONFIG not in present and GENAI_CONFIG not in present:
        problems.append(f"has no {CONFIG} (nor an onnxruntime-genai {GENAI_CONFIG})")
    for name in SIDE_FILES:
        if name in present and name.endswith(".json"):
            try:
                data = read_json(name)
            except ValueError as exc:
                problems.append(f"{name} is not readable JSON: {exc}")
                continue
            if not isinstance(data, dict):
                problems.append(f"{name} is not a JSON object")
    return problems


def _graphs(present: set[str], directory: str) -> list[tuple[str, str | None, str]]:
    """(graph path, tag, stem) of the decoder graphs directly in ``directory``, model* first."""
    prefix = f"{directory}/" if directory else ""
    found = []
    for path in present:
        if not path.startswith(prefix) or "/" in path[len(prefix) :]:
            continue
        match = _GRAPH_RE.match(path[len(prefix) :])
        if match:
            found.append((path, match["variant"], match["stem"]))
    return sorted(found, key=lambda item: (item[2] != "model", item[0]))


def _genai(present: set[str], side: tuple[str, ...], read_json: ReadJson) -> FolderLayout:
    config = read_json(GENAI_CONFIG)
    try:
        graph = config["model"]["decoder"]["filename"]
    except (KeyError, TypeError):
        graph = None
    if not isinstance(graph, str) or not graph:
        return FolderLayout(models=(), problems=(f"{GENAI_CONFIG} names no model.decoder.filename",))
    if graph not in present:
        return FolderLayout(models=(), problems=(f"{GENAI_CONFIG} names the decoder {graph}, which is missing",))
    files = (graph, *external_data(graph, present), *side)
    return FolderLayout(models=(LayoutModel(tag=None, graph=graph, layout=LAYOUT_GENAI, files=files),), problems=())


def _no_graph_problem(present: set[str]) -> str:
    names = {path.rsplit("/", 1)[-1] for path in present}
    if set(_LEGACY_PAIR) & names:
        return (
            "holds the unmerged legacy Optimum pair (decoder_model.onnx + decoder_with_past_model.onnx), "
            "which this service does not load: export it again with a current optimum-cli "
            "(`optimum-cli export onnx --task text-generation-with-past`, which writes model.onnx) "
            "or merge the two with optimum's merge_decoders into decoder_model_merged.onnx"
        )
    graphs = sorted(path for path in present if path.endswith(".onnx"))
    if graphs:
        return (
            f"has ONNX files ({', '.join(graphs[:5])}) but none this service loads as a decoder: "
            "expected model.onnx, onnx/model*.onnx, decoder_model_merged.onnx or a genai_config.json"
        )
    return "has no model graph: expected model.onnx, onnx/model*.onnx, decoder_model_merged.onnx or genai_config.json"
