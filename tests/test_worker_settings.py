"""The batched worker's settings, as ``lmsp_project/settings.py`` reads them from the environment.

The settings module is run afresh for each environment (``runpy``), as a new
worker process would read it; the settings of the running tests are left alone.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from tests.support.server import REPO

# No database of the pass here: the PostgreSQL pass of scripts/test leaves these out (tests/conftest.py).
pytestmark = pytest.mark.database_free

SETTINGS_FILE = REPO / "lmsp_project" / "settings.py"
ENGINE_SETTINGS = (
    "LMSP_MAX_BATCH",
    "LMSP_KV_CACHE_BYTES",
    "LMSP_KV_CACHE_SHARE",
    "LMSP_DRAIN_SECONDS",
    "LMSP_SAMPLING_THREADS",
    "LMSP_PREFILL_SHARE",
    "LMSP_START_FOLD_MS",
    "LMSP_GPU_MEM_LIMIT_BYTES",
    "LMSP_PREFIX_CACHE",
)


def read_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **env: str) -> dict[str, Any]:
    monkeypatch.setenv("LMSP_SECRET_KEY", "settings-test")
    monkeypatch.setenv("LMSP_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'unused.sqlite3'}")
    for name in ENGINE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    values = runpy.run_path(str(SETTINGS_FILE))
    return {name: values[name] for name in ENGINE_SETTINGS}


def test_the_defaults_size_the_batch_and_the_memory_automatically(monkeypatch, tmp_path):
    assert read_settings(monkeypatch, tmp_path) == {
        "LMSP_MAX_BATCH": 0,
        "LMSP_KV_CACHE_BYTES": 0,
        "LMSP_KV_CACHE_SHARE": 0.5,
        "LMSP_DRAIN_SECONDS": 0.0,
        "LMSP_SAMPLING_THREADS": 0,
        "LMSP_PREFILL_SHARE": 3.0,
        "LMSP_START_FOLD_MS": 25.0,
        "LMSP_GPU_MEM_LIMIT_BYTES": 0,
        "LMSP_PREFIX_CACHE": True,
    }
    # Set but empty (compose passes an unset variable so) is the default too.
    assert read_settings(monkeypatch, tmp_path, **dict.fromkeys(ENGINE_SETTINGS, "")) == read_settings(
        monkeypatch, tmp_path
    )


def test_what_the_environment_says_is_what_the_worker_gets(monkeypatch, tmp_path):
    assert read_settings(
        monkeypatch,
        tmp_path,
        LMSP_MAX_BATCH="1",
        LMSP_KV_CACHE_BYTES="2147483648",
        LMSP_KV_CACHE_SHARE="1",
        LMSP_DRAIN_SECONDS="2.5",
        LMSP_SAMPLING_THREADS="4",
        LMSP_PREFILL_SHARE="0.9",
        LMSP_START_FOLD_MS="0",
        LMSP_GPU_MEM_LIMIT_BYTES="8589934592",
        LMSP_PREFIX_CACHE="0",
    ) == {
        "LMSP_MAX_BATCH": 1,
        "LMSP_KV_CACHE_BYTES": 2147483648,
        "LMSP_KV_CACHE_SHARE": 1.0,
        "LMSP_DRAIN_SECONDS": 2.5,
        "LMSP_SAMPLING_THREADS": 4,
        "LMSP_PREFILL_SHARE": 0.9,
        "LMSP_START_FOLD_MS": 0.0,
        "LMSP_GPU_MEM_LIMIT_BYTES": 8589934592,
        "LMSP_PREFIX_CACHE": False,
    }


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "LMSP_MAX_BATCH",
            "-3",
            "LMSP_MAX_BATCH must be an integer >= 0 (0: automatic, from the KV cache budget), got -3",
        ),
        ("LMSP_MAX_BATCH", "eight", "LMSP_MAX_BATCH must be an integer, got 'eight'"),
        ("LMSP_KV_CACHE_BYTES", "-1", "LMSP_KV_CACHE_BYTES must be an integer >= 0 (0: automatic), got -1"),
        ("LMSP_KV_CACHE_BYTES", "2GB", "LMSP_KV_CACHE_BYTES must be an integer, got '2GB'"),
        ("LMSP_KV_CACHE_SHARE", "0", "LMSP_KV_CACHE_SHARE must be in (0, 1], got 0.0"),
        ("LMSP_KV_CACHE_SHARE", "1.5", "LMSP_KV_CACHE_SHARE must be in (0, 1], got 1.5"),
        ("LMSP_KV_CACHE_SHARE", "nan", "LMSP_KV_CACHE_SHARE must be a finite number, got 'nan'"),
        ("LMSP_KV_CACHE_SHARE", "half", "LMSP_KV_CACHE_SHARE must be a finite number, got 'half'"),
        ("LMSP_DRAIN_SECONDS", "-1", "LMSP_DRAIN_SECONDS must be >= 0, got -1.0"),
        ("LMSP_DRAIN_SECONDS", "inf", "LMSP_DRAIN_SECONDS must be a finite number, got 'inf'"),
        ("LMSP_SAMPLING_THREADS", "-1", "LMSP_SAMPLING_THREADS must be an integer >= 0 (0: automatic), got -1"),
        ("LMSP_PREFILL_SHARE", "0", "LMSP_PREFILL_SHARE must be in (0, 100], got 0.0"),
        ("LMSP_PREFILL_SHARE", "many", "LMSP_PREFILL_SHARE must be a finite number, got 'many'"),
        ("LMSP_START_FOLD_MS", "-5", "LMSP_START_FOLD_MS must be >= 0, got -5.0"),
        ("LMSP_GPU_MEM_LIMIT_BYTES", "-5", "LMSP_GPU_MEM_LIMIT_BYTES must be an integer >= 0 (0: no limit), got -5"),
    ],
)
def test_a_value_the_engine_cannot_use_stops_the_start_with_a_clear_message(
    monkeypatch, tmp_path, name, value, message
):
    with pytest.raises(ImproperlyConfigured) as raised:
        read_settings(monkeypatch, tmp_path, **{name: value})
    assert str(raised.value) == message
