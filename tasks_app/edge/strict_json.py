"""The strict-JSON field kit of every input serializer.

Input serializers check shape and JSON types strictly (``"5"`` is not an
integer, ``1`` is not a boolean) and refuse unknown fields by name; they hold
no business rules. These are the fields and helpers they are built from,
whatever the protocol (LMSP's own, OpenAI's Responses and Chat Completions).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from tasks_app.exceptions import UnsupportedParameter


class StrictSerializer(serializers.Serializer):
    """Refuses fields it does not declare, naming each one.

    For a validation it builds only the fields the data names and those that act when absent
    (required, or with a default). DRF deep-copies every declared field into each serializer
    instance; the Responses request declares some fifty, nested, and copying them all was the
    largest single cost of an accept (bench/accept.py, issue 26's note). Anything that reads
    ``fields`` before validating (the schema, a caller adding a field) gets every field.
    """

    # The data keys the fields were built for; None: every declared field was built.
    _built_for: frozenset[str] | None = None

    def get_fields(self) -> dict[str, serializers.Field]:
        if self._built_for is None:
            return super().get_fields()
        wanted = {
            name: field
            for name, field in self._declared_fields.items()
            if name in self._built_for or field.required or field.default is not serializers.empty
        }
        return copy.deepcopy(wanted)

    def _build_fields_for(self, data: Mapping[str, Any]) -> None:
        keys = frozenset(data)
        if "fields" not in self.__dict__:
            self._built_for = keys
        elif self._built_for is not None and not keys <= self._built_for:
            # A list's child serializer validates every item with one instance: widen it for this one.
            self._built_for |= keys
            del self.__dict__["fields"]

    def to_internal_value(self, data: Any) -> Any:
        unknown: list[str] = []
        if isinstance(data, Mapping):
            self._build_fields_for(data)
            unknown = sorted(set(data) - set(self._declared_fields) - set(self.fields))
        errors: dict[str, Any] = {name: ["unknown field"] for name in unknown}
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as error:
            if not isinstance(error.detail, Mapping):
                raise
            errors.update(error.detail)
        if errors:
            raise serializers.ValidationError(errors)
        return value


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "A JSON integer is required."}

    def to_internal_value(self, data: Any) -> int:
        # JSON has one number type: 5.0 is the integer 5 (as JSON Schema's "integer" says), 5.5 is not.
        if isinstance(data, float) and data.is_integer():
            data = int(data)
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    default_error_messages = {"invalid": "A JSON number is required."}

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "A JSON boolean is required."}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictChoiceField(serializers.ChoiceField):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid_choice", input=data)
        return super().to_internal_value(data)


def parsed_list(data: Any, what: str, parse: Callable[[int, Any], Any]) -> list[Any]:
    """Each element of a non-empty list through ``parse``, the errors of all of them at their indexes."""
    if not isinstance(data, list) or not data:
        raise serializers.ValidationError(f"must be {what}")
    values, errors, failed = [], [], False
    for index, element in enumerate(data):
        try:
            values.append(parse(index, element))
            errors.append({})
        except serializers.ValidationError as error:
            failed = True
            errors.append(error.detail)
    if failed:
        raise serializers.ValidationError(errors)
    return values


def indexed(data: list[Any], parse: Callable[[int, Any], Any]) -> list[Any]:
    """Each element through ``parse``, the errors keyed by index (as DRF's ListField names them: ``tools.1``)."""
    values, errors = [], {}
    for index, element in enumerate(data):
        try:
            values.append(parse(index, element))
        except serializers.ValidationError as error:
            errors[index] = error.detail
    if errors:
        raise serializers.ValidationError(errors)
    return values


def validated_by(serializer_class: type[serializers.Serializer], data: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    if not serializer.is_valid():
        raise serializers.ValidationError(serializer.errors)
    return dict(serializer.validated_data)


def documented_as(field_class: type[serializers.Field], schema: dict[str, Any]) -> type[serializers.Field]:
    """``field_class`` documented as ``schema``: the values the service accepts, where the field lets
    more through so that the request's surface (``tasks_app/openai/surface.py``) can refuse them by name
    (``unsupported_parameter``)."""
    return extend_schema_field(schema)(type(f"Documented{field_class.__name__}", (field_class,), {}))


@extend_schema_field({"type": "object"})
class LooseObjectField(serializers.Field):
    """A JSON object taken as it is (a hint whose content nothing here reads)."""

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be an object")
        return data

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field({"enum": [None], "description": "Only null: any other value is `unsupported_parameter`."})
class NullOnlyField(serializers.Field):
    """An OpenAI field for a feature this service lacks: null is its absence, any value is refused by name."""

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        if data is None:
            return True, None
        return super().validate_empty_values(data)

    def to_internal_value(self, data: Any) -> None:
        raise UnsupportedParameter(f"{self.field_name}: {self.help_text or 'not supported'}", param=self.field_name)

    def to_representation(self, value: Any) -> Any:
        return value
