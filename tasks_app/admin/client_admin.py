"""The client admin: create a client (its token shown once) and revoke clients; never edit or delete."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IS_POPUP_VAR
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from tasks_app.admin.access import post_only
from tasks_app.exceptions import InvalidRequest
from tasks_app.models import Client
from tasks_app.services.clients import MAX_NAME_LENGTH, SCOPES, client_create, client_revoke_by_id


class ClientCreateForm(forms.Form):
    name = forms.CharField(max_length=MAX_NAME_LENGTH, help_text="Unique among active clients.")
    scopes = forms.MultipleChoiceField(
        choices=[(scope, scope) for scope in SCOPES],
        widget=forms.CheckboxSelectMultiple,
        initial=["responses", "read"],
        help_text="responses: create and cancel its own tasks; read: read them; admin: every client's tasks.",
    )


class ClientStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("active", "active"), ("revoked", "revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet) -> QuerySet:
        if self.value() == "active":
            return queryset.filter(revoked_at__isnull=True)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        return queryset


@admin.register(Client)
class ClientAdmin(admin.ModelAdmin):
    """Create (the token is shown once, on the answer to the POST) and revoke; never edit or delete."""

    list_display = ("name", "scopes_column", "active", "created_at", "last_used_at", "revoked_at")
    list_filter = (ClientStateFilter,)
    search_fields = ("name",)
    ordering = ("-created_at", "-id")
    actions = ("revoke_clients",)
    # Never the token's hash.
    fields = ("name", "scopes_column", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Tasks and responses point at their client (PROTECT): revoke instead.
        return False

    def has_revoke_permission(self, request: HttpRequest, obj: Client | None = None) -> bool:
        """Revoking changes the client: Django's "Can change client" permission."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    @admin.display(description="scopes")
    def scopes_column(self, client: Client) -> str:
        return ", ".join(client.scopes)

    @admin.display(description="active", boolean=True)
    def active(self, client: Client) -> bool:
        return client.revoked_at is None

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: dict | None = None) -> HttpResponse:
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = ClientCreateForm(request.POST if request.method == "POST" else None)
        if request.method == "POST" and form.is_valid():
            try:
                client, token = client_create(name=form.cleaned_data["name"], scopes=form.cleaned_data["scopes"])
            except InvalidRequest as exc:
                form.add_error("name", exc.detail)
            else:
                self.log_addition(request, client, [{"added": {}}])
                # The token lives only in this answer: no redirect, no message
                # (messages are stored), and no copy in any cache.
                response = TemplateResponse(
                    request,
                    "admin/tasks_app/client/token_once.html",
                    {**self._page_context(request, f"Client {client.name} created"), "client": client, "token": token},
                )
                response["Cache-Control"] = "no-store"
                return response
        return TemplateResponse(
            request,
            "admin/tasks_app/client/add_form.html",
            {**self._page_context(request, "Add client"), "form": form},
        )

    def _page_context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "has_view_permission": self.has_view_permission(request),
            "is_popup": IS_POPUP_VAR in request.GET,
        }

    @admin.action(description="Revoke selected clients", permissions=["revoke"])
    def revoke_clients(self, request: HttpRequest, queryset: QuerySet[Client]) -> None:
        revoked = []
        for client in queryset:
            if client_revoke_by_id(client_id=client.pk) is not None:
                self.log_change(request, client, "Revoked")
                revoked.append(client.name)
        if revoked:
            self.message_user(request, f"Revoked: {', '.join(revoked)}.", messages.SUCCESS)
        else:
            self.message_user(request, "Nothing revoked: the selected clients were already revoked.", messages.WARNING)

    def revoke_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if (refusal := post_only(request)) is not None:
            return refusal
        client = self.get_object(request, unquote(object_id))
        if client is None:
            return self._get_obj_does_not_exist_redirect(request, self.opts, object_id)
        if not self.has_revoke_permission(request, client):
            raise PermissionDenied
        if client_revoke_by_id(client_id=client.pk) is None:
            self.message_user(request, f"Client {client.name} was already revoked.", messages.WARNING)
        else:
            self.log_change(request, client, "Revoked")
            self.message_user(request, f"Client {client.name} is revoked: its token no longer works.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:tasks_app_client_change", args=[client.pk]))

    def get_urls(self) -> list:
        return [
            path(
                "<path:object_id>/revoke/",
                self.admin_site.admin_view(self.revoke_view),
                name="tasks_app_client_revoke",
            ),
            *super().get_urls(),
        ]

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Client | None = None,
    ) -> HttpResponse:
        if obj is not None:
            context.update(
                {
                    "can_revoke": obj.revoked_at is None and self.has_revoke_permission(request, obj),
                    "revoke_url": reverse("admin:tasks_app_client_revoke", args=[obj.pk]),
                }
            )
        return super().render_change_form(request, context, add, change, form_url, obj)
