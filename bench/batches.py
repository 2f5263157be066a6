"""What accepting a batch costs: ``POST /files`` then ``POST /batches`` of a N-line file, in process.

The upload is streamed to disk through the multipart parser; the batch's
create reads, validates and translates every line and inserts one row per
line in one transaction (no task yet: the keeper sends them
LMSP_BATCH_ACTIVE_LINES at a time). Then one keeper round sends the first
lines. Prints the time of each step.

    .venv/bin/python bench/batches.py [--lines 10000] [--endpoint /v1/chat/completions] [--database-url URL]
"""

from __future__ import annotations

import argparse
import io
import json
import time

from scratch import demo_model_register, django_in_scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--endpoint", default="/v1/responses")
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()

    scratch = django_in_scratch("batches", database_url=args.database_url)
    from django.test import Client as HttpClient

    from tasks_app.openai.batches.keeper import batch_line_body
    from tasks_app.services.batches import batches_advance
    from tasks_app.services.clients import client_create

    demo_model_register(scratch)
    _, token = client_create(name=f"bench-{time.time_ns()}", scopes="responses,read")
    http = HttpClient(HTTP_AUTHORIZATION=f"Bearer {token}")
    chat = "chat" in args.endpoint
    lines = []
    for n in range(args.lines):
        if chat:
            body = {"model": "demo", "messages": [{"role": "user", "content": f"Say {n}"}], "max_tokens": 16}
        else:
            body = {"model": "demo", "input": f"Say {n}", "max_output_tokens": 16}
        lines.append(json.dumps({"custom_id": f"l{n}", "method": "POST", "url": args.endpoint, "body": body}))
    data = ("\n".join(lines) + "\n").encode()

    started = time.perf_counter()
    upload = io.BytesIO(data)
    upload.name = "bench.jsonl"
    reply = http.post("/lmsp/v1/files", {"purpose": "batch", "file": upload})
    assert reply.status_code == 200, reply.content
    uploaded = time.perf_counter()
    batch = http.post(
        "/lmsp/v1/batches",
        {"input_file_id": reply.json()["id"], "endpoint": args.endpoint, "completion_window": "24h"},
        content_type="application/json",
    )
    assert batch.status_code == 200 and batch.json()["status"] == "in_progress", batch.content
    created = time.perf_counter()
    batches_advance(render=batch_line_body)
    fed = time.perf_counter()
    read_started = time.perf_counter()
    for _ in range(100):
        http.get(f"/lmsp/v1/batches/{batch.json()['id']}")
    read = (time.perf_counter() - read_started) / 100
    print(f"{args.lines} lines, {len(data) / 1e6:.1f} MB, {args.endpoint}")
    print(f"  upload (POST /files):           {uploaded - started:6.2f} s")
    print(f"  validate + store (POST /batches): {created - uploaded:6.2f} s")
    print(f"  first keeper round (send lines): {fed - created:6.2f} s")
    print(f"  GET /batches/{{id}}:              {read * 1000:6.2f} ms")


if __name__ == "__main__":
    main()
