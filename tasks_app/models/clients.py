"""Paired clients, their pairing codes, and the service's own configuration rows."""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class ServiceConfig(models.Model):
    """Service identity and configuration, one row per key."""

    key = models.CharField(max_length=100, primary_key=True)
    value = models.JSONField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "service_config"

    def __str__(self) -> str:
        return self.key


class Client(models.Model):
    """A paired client: token hash (never the token) and scopes."""

    name = models.CharField(max_length=100)
    token_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the token, hex")
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "clients"
        constraints = [
            # Names identify clients in `lmsp_client revoke NAME`; a revoked
            # client's name may be reused.
            models.UniqueConstraint(
                fields=["name"], condition=Q(revoked_at__isnull=True), name="client_name_unique_when_active"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    # DRF treats the authenticated principal like a user.
    @property
    def is_authenticated(self) -> bool:
        return True

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


class PairingCode(models.Model):
    """A one-time code that a new client trades for a token."""

    code_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    client = models.ForeignKey(Client, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # A wrong code does not name the code it missed, so each one counts
    # against every pending code; a code that reached the limit is locked.
    failed_attempts = models.PositiveIntegerField(
        default=0, help_text="Wrong codes tried while this one was pending (it locks at LMSP_PAIRING_MAX_FAILURES)"
    )

    class Meta:
        db_table = "pairing_codes"

    def __str__(self) -> str:
        return f"pairing code {self.pk}"
