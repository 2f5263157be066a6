"""The demo models the tests' workers have (tests/conftest.py builds them, as scripts/prepare does)."""

from __future__ import annotations

# Ends by itself with EOS after some tens to a few hundred tokens (fixture_models.demo).
DEMO_MODEL = "demo"
# The same weights without the EOS head: runs until max_output_tokens or a cancel,
# for the tests that need a long generation.
ENDLESS_TAG = "endless"
ENDLESS_MODEL = f"{DEMO_MODEL}:{ENDLESS_TAG}"
