"""The models registered from disk (chapter 11.1): metadata and digests; the files stay on disk."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from tasks_app.fields import JSONTextField
from tasks_app.model_layouts import LAYOUT_GENAI, LAYOUT_ONNX_COMMUNITY, LAYOUT_OPTIMUM, LAYOUT_OPTIMUM_MERGED


class ModelLayout(models.TextChoices):
    """How a model folder is laid out (``tasks_app.model_layouts`` reads it from the file names)."""

    OPTIMUM = LAYOUT_OPTIMUM, "optimum"
    """``model.onnx`` (or ``model_<variant>.onnx``) beside the configs, as ``optimum-cli export onnx`` writes it."""
    ONNX_COMMUNITY = LAYOUT_ONNX_COMMUNITY, "onnx-community"
    """``onnx/model.onnx`` and its variants ``onnx/model_<variant>.onnx``; configs and tokenizer one folder up."""
    GENAI = LAYOUT_GENAI, "genai"
    """An onnxruntime-genai builder folder: ``genai_config.json`` names the decoder graph."""
    OPTIMUM_MERGED = LAYOUT_OPTIMUM_MERGED, "optimum-merged"
    """A legacy Optimum export: ``decoder_model_merged.onnx`` with its ``use_cache_branch`` input."""


class ModelRecord(models.Model):
    """Metadata and content digests of a model folder; files stay on disk."""

    name = models.CharField(max_length=200, unique=True, help_text="`name` or `name:tag`")
    path = models.CharField(max_length=1000, help_text="Folder relative to LMSP_MODELS_DIR (the side files)")
    graph = models.CharField(
        max_length=1000, default="model.onnx", help_text="The decoder graph's path relative to the folder"
    )
    layout = models.CharField(max_length=20, choices=ModelLayout.choices, default=ModelLayout.OPTIMUM)
    backend = models.CharField(max_length=50)
    size_bytes = models.BigIntegerField()
    digest = models.CharField(max_length=71, help_text="sha256:<hex> over the per-file digests")
    files = models.JSONField(default=dict, help_text="{path relative to the folder: {size, mtime_ns, sha256}}")
    capabilities = JSONTextField(default=dict)
    config = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "models"
        verbose_name = "model"
        constraints = [
            models.CheckConstraint(condition=Q(size_bytes__gte=0), name="model_size_non_negative"),
            models.CheckConstraint(condition=Q(layout__in=ModelLayout.values), name="model_layout_valid"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def resumable(self) -> bool:
        return bool(self.capabilities.get("resumable_snapshots"))
