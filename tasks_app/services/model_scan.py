"""The models table: what lies under LMSP_MODELS_DIR, with content digests.

Model files never enter the database. A folder ``<dir>/<name>/`` holding
``model.onnx`` registers as ``name``; ``<dir>/<name>/<tag>/`` as ``name:tag``.
Digests are recomputed only for files whose size or mtime changed, and
hashing happens outside any transaction so a scan of large files never holds
the SQLite write lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from tasks_app.models import ModelRecord

logger = logging.getLogger(__name__)

ONNX_BACKEND = "onnxruntime"
MODEL_FILE = "model.onnx"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_CHUNK = 1024 * 1024


@dataclass
class ScanReport:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    hashed_files: int = 0


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _model_folders(root: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    if not root.is_dir():
        return found
    for name_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not _NAME_RE.match(name_dir.name):
            continue
        if (name_dir / MODEL_FILE).is_file():
            found[name_dir.name] = name_dir
        for tag_dir in sorted(p for p in name_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if _NAME_RE.match(tag_dir.name) and (tag_dir / MODEL_FILE).is_file():
                found[f"{name_dir.name}:{tag_dir.name}"] = tag_dir
    return found


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _capabilities(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    # Our ONNX backend resumes a decoder-only model by re-prefilling prompt
    # plus generated ids, which any causal LM with a tokenizer supports.
    decoder = bool(config) and (folder / "tokenizer.json").is_file()
    return {"resumable_snapshots": decoder, "chat_template": _has_chat_template(folder)}


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return "chat_template" in json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _file_entries(folder: Path, previous: dict[str, Any], report: ScanReport) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
        stat = path.stat()
        old = previous.get(path.name)
        if old and old.get("size") == stat.st_size and old.get("mtime_ns") == stat.st_mtime_ns:
            entries[path.name] = old
            continue
        report.hashed_files += 1
        entries[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256_file(path)}
    return entries


def model_digest(files: dict[str, Any]) -> str:
    """One digest for the whole folder, over the sorted per-file digests."""
    manifest = "".join(f"{name}\0{entry['sha256']}\n" for name, entry in sorted(files.items()))
    return "sha256:" + hashlib.sha256(manifest.encode("utf-8")).hexdigest()


def model_scan(*, models_dir: Path | None = None) -> ScanReport:
    """Register every model folder, refresh changed ones, drop vanished ones."""
    root = Path(models_dir or settings.LMSP_MODELS_DIR)
    report = ScanReport()
    existing = {m.name: m for m in ModelRecord.objects.all()}
    scanned: dict[str, dict[str, Any]] = {}
    for name, folder in _model_folders(root).items():
        previous = existing[name].files if name in existing else {}
        try:
            files = _file_entries(folder, previous, report)
        except OSError as exc:
            logger.warning("skipping model %s: %s", name, exc)
            report.skipped.append(name)
            continue
        config = _read_config(folder)
        scanned[name] = {
            "path": str(folder.relative_to(root)),
            "backend": ONNX_BACKEND,
            "size_bytes": sum(entry["size"] for entry in files.values()),
            "digest": model_digest(files),
            "files": files,
            "capabilities": _capabilities(folder, config),
            "config": {
                key: config[key]
                for key in ("model_type", "max_position_embeddings", "vocab_size", "num_hidden_layers")
                if key in config
            },
        }

    with transaction.atomic():
        for name, values in scanned.items():
            record = existing.get(name)
            if record is None:
                ModelRecord.objects.create(name=name, **values)
                report.added.append(name)
            elif any(getattr(record, key) != value for key, value in values.items()):
                for key, value in values.items():
                    setattr(record, key, value)
                record.save(update_fields=[*values.keys(), "updated_at"])
                report.updated.append(name)
            else:
                report.unchanged.append(name)
        gone = sorted(set(existing) - set(scanned) - set(report.skipped))
        if gone:
            ModelRecord.objects.filter(name__in=gone).delete()
        report.removed.extend(gone)
    return report
