"""Cut the parts of the published Responses schemas that tests/test_response_schema.py validates against.

Run by hand from the two upstream OpenAPI documents (not by the tests):
``python tests/data/vendor_schemas.py OPENAI_OPENAPI_JSON OPENRESPONSES_OPENAPI_JSON``. Each output keeps
the named schemas and every schema they reference, unchanged, under ``components.schemas``, so the
``#/components/schemas/...`` references resolve inside the vendored file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent

OPENAI = {
    "file": "openai_responses.schema.json",
    "source": "https://github.com/openai/openai-openapi openapi.json (the spec the openai SDKs are generated from)",
    "commit": "f85dbe223d40e1a31cba812ab2d755c7e98a92a3",
    "licence": "MIT, Copyright (c) OpenAI",
    "roots": [
        "Response",
        "ResponseQueuedEvent",
        "ResponseCreatedEvent",
        "ResponseInProgressEvent",
        "ResponseOutputItemAddedEvent",
        "ResponseContentPartAddedEvent",
        "ResponseTextDeltaEvent",
        "ResponseTextDoneEvent",
        "ResponseContentPartDoneEvent",
        "ResponseOutputItemDoneEvent",
        "ResponseFunctionCallArgumentsDeltaEvent",
        "ResponseFunctionCallArgumentsDoneEvent",
        "ResponseCompletedEvent",
        "ResponseIncompleteEvent",
        "ResponseFailedEvent",
        "ResponseErrorEvent",
    ],
}
OPEN_RESPONSES = {
    "file": "openresponses.schema.json",
    "source": "https://github.com/openresponses/openresponses public/openapi/openapi.json (version 2026-04-24)",
    "commit": "92c12d96d7b61d6d15e2214daa5e9c6000ab6e1c",
    "licence": "Apache-2.0, the Open Responses authors",
    # The published document drops the empty schema of an `anyOf` (its inliner's doing): the component it was
    # built from, schema/components/schemas/JsonSchemaResponseFormat.json at the same commit, lets `schema` be
    # any value or null, not only null. Restored here, so an echoed JSON schema is not refused for being one.
    "patches": [
        (("JsonSchemaResponseFormat", "properties", "schema"), {"anyOf": [{}, {"type": "null"}]}),
    ],
    "roots": [
        "ResponseResource",
        "ResponseQueuedStreamingEvent",
        "ResponseCreatedStreamingEvent",
        "ResponseInProgressStreamingEvent",
        "ResponseOutputItemAddedStreamingEvent",
        "ResponseContentPartAddedStreamingEvent",
        "ResponseOutputTextDeltaStreamingEvent",
        "ResponseOutputTextDoneStreamingEvent",
        "ResponseContentPartDoneStreamingEvent",
        "ResponseOutputItemDoneStreamingEvent",
        "ResponseFunctionCallArgumentsDeltaStreamingEvent",
        "ResponseFunctionCallArgumentsDoneStreamingEvent",
        "ResponseCompletedStreamingEvent",
        "ResponseIncompleteStreamingEvent",
        "ResponseFailedStreamingEvent",
        "ErrorStreamingEvent",
    ],
}


def _refs(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                found.add(value.rsplit("/", 1)[-1])
            else:
                _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def cut(document: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    schemas = document["components"]["schemas"]
    kept: set[str] = set()
    todo = list(spec["roots"])
    while todo:
        name = todo.pop()
        if name in kept:
            continue
        kept.add(name)
        found: set[str] = set()
        _refs(schemas[name], found)
        todo.extend(found)
    kept_schemas = {name: schemas[name] for name in sorted(kept)}
    for path, value in spec.get("patches", ()):
        *parents, last = path
        node = kept_schemas
        for key in parents:
            node = node[key]
        node[last] = value
    return {
        "$comment": (
            f"Vendored from {spec['source']} at commit {spec['commit']}; licence {spec['licence']}. "
            "Only the listed roots and the schemas they reference, unchanged but for x-patches; "
            "cut by tests/data/vendor_schemas.py."
        ),
        "x-patches": [{"at": "/".join(path), "now": value} for path, value in spec.get("patches", ())],
        "x-source": spec["source"],
        "x-commit": spec["commit"],
        "x-licence": spec["licence"],
        "x-roots": spec["roots"],
        "components": {"schemas": kept_schemas},
    }


def main(openai_path: str, open_responses_path: str) -> None:
    for spec, path in ((OPENAI, openai_path), (OPEN_RESPONSES, open_responses_path)):
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        out = HERE / spec["file"]
        out.write_text(json.dumps(cut(document, spec), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(out, len(out.read_bytes()))


if __name__ == "__main__":
    main(*sys.argv[1:3])
