"""List pages of large tables without a full ``COUNT(*)``."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import PAGE_VAR, ChangeList
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property


class BoundedCountPaginator(Paginator):
    """A paginator that counts at most ``count_limit + 1`` rows.

    ``COUNT(*)`` over a filtered queryset reads every matching row (SQLite
    has no other way, PostgreSQL's MVCC neither); on a table of millions of
    events that is seconds per page view. Counting ``LIMIT count_limit + 1``
    rows in a subquery costs no more than reading the pages up to there.
    ``capped`` tells the template to say "more than ``count_limit``".
    """

    def __init__(self, object_list: QuerySet, per_page: int, *, count_limit: int, **kwargs: Any) -> None:
        super().__init__(object_list, per_page, **kwargs)
        self.count_limit = count_limit

    @cached_property
    def count(self) -> int:
        # Only the primary keys: no annotation (a payload preview) is computed for counting.
        return self.object_list.values("pk")[: self.count_limit + 1].count()

    @property
    def capped(self) -> bool:
        return self.count > self.count_limit


class BoundedCountAdmin(admin.ModelAdmin):
    """List pages of a large table: bounded counts, no facet counts, no full total."""

    paginator = BoundedCountPaginator
    show_full_result_count = False
    # Facets would COUNT every filter choice over the whole table.
    show_facets = admin.ShowFacets.NEVER
    # The count window reaches ``pages_ahead`` pages past the one shown (at
    # least ``count_floor`` rows), so every later page stays one click away.
    count_floor = 1000
    pages_ahead = 10
    # Columns the list does not show and that may be large (JSON bodies).
    list_defer: tuple[str, ...] = ()

    def get_paginator(
        self,
        request: HttpRequest,
        queryset: QuerySet,
        per_page: int,
        orphans: int = 0,
        allow_empty_first_page: bool = True,
    ) -> BoundedCountPaginator:
        try:
            page = max(1, int(request.GET.get(PAGE_VAR, 1)))
        except ValueError:
            page = 1
        limit = max(self.count_floor, (page + self.pages_ahead) * per_page)
        return BoundedCountPaginator(
            queryset, per_page, orphans=orphans, allow_empty_first_page=allow_empty_first_page, count_limit=limit
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _DeferringChangeList


class _DeferringChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet:
        queryset = super().get_queryset(request, exclude_parameters)
        deferred = getattr(self.model_admin, "list_defer", ())
        return queryset.defer(*deferred) if deferred else queryset
