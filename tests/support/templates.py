"""Real chat templates of tool-calling model families, as test data (fetched, never committed).

The templates ship in the model folders users download; llama.cpp keeps
copies of them under ``models/templates/`` (its source, and so the
llama-cpp-python sdist on PyPI, carries them), and vLLM ships its templates
for models whose own template has no tools (``examples/``, in its sdist).
Each sdist is fetched once per machine, checked against its sha256, and
only the named templates are kept, in ``LMSP_TEST_CACHE`` (default
``~/.cache/lmsp-tests``).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock


@dataclass(frozen=True)
class Source:
    url: str
    sha256: str
    prefix: str
    """The folder of the templates inside the archive."""


LLAMA_CPP = Source(
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    "llama_cpp_python-0.3.36.tar.gz",
    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/",
)
VLLM = Source(
    "https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/"
    "vllm-0.34.0.tar.gz",
    "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    "vllm-0.34.0/examples/",
)

# The template of each family the tests run, by the file its source names it.
FAMILY_TEMPLATES: dict[str, tuple[Source, str]] = {
    "qwen2.5": (LLAMA_CPP, "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "qwen3": (LLAMA_CPP, "Qwen-Qwen3-0.6B.jinja"),
    "hermes3": (LLAMA_CPP, "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"),
    "llama3.1": (LLAMA_CPP, "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "llama3.2": (LLAMA_CPP, "meta-llama-Llama-3.2-3B-Instruct.jinja"),
    "mistral-nemo": (LLAMA_CPP, "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "mistral-small-3.2": (LLAMA_CPP, "Mistral-Small-3.2-24B-Instruct-2506.jinja"),
    "phi4-mini-vllm": (VLLM, "tool_chat_template_phi4_mini.jinja"),
}


def _cache() -> Path:
    root = Path(os.environ.get("LMSP_TEST_CACHE") or Path.home() / ".cache" / "lmsp-tests")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _extract(source: Source, names: list[str], into: Path) -> None:
    archive = into / Path(source.url).name
    if not archive.exists():
        partial = archive.with_suffix(".part")
        with urllib.request.urlopen(source.url, timeout=300) as answer, partial.open("wb") as out:
            while block := answer.read(1 << 20):
                out.write(block)
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        if digest != source.sha256:
            partial.unlink()
            raise RuntimeError(f"{source.url}: sha256 {digest}, expected {source.sha256}")
        partial.rename(archive)
    wanted = {source.prefix + name: name for name in names}
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.name in wanted:
                data = tar.extractfile(member)
                assert data is not None
                (into / wanted[member.name]).write_bytes(data.read())


def family_template(family: str) -> str:
    """The text of ``family``'s real chat template (see ``FAMILY_TEMPLATES``)."""
    source, name = FAMILY_TEMPLATES[family]
    root = _cache() / "templates"
    root.mkdir(exist_ok=True)
    path = root / name
    with FileLock(str(root / ".lock")):
        if not path.exists():
            names = [n for s, n in FAMILY_TEMPLATES.values() if s == source]
            _extract(source, names, root)
    return path.read_text(encoding="utf-8")
