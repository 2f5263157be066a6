"""Reading a model's function calls out of its text as it streams (PROFILE.md 10.4).

:class:`ToolCallParser` takes the generated text piece by piece, in the
family's format (``tool_calls.FORMATS``), and says what it holds: message
text, a call that starts (its name), a piece of the call's arguments, a
call that ends (its whole arguments). Text that could still be the start of
a call marker, and whitespace that could precede one, is held back until it
is decided, so nothing is sent and then taken back; markers never reach the
message text. The arguments stream as the model writes them once the name is
known (a name written after the arguments releases them at once).

Its reading depends only on the text, never on how it was cut into pieces:
a resumed run that feeds the same text gets the same calls, in the same state.

A call region that turns out not to be a call (no JSON object after the
marker) before any call in it opened is message text after all; one that
breaks after a call opened raises :class:`MalformedToolCall`.

The text can end before something held is decided (:meth:`ToolCallParser.finish`).
Cut by the token limit, what was held is dropped, never text: a marker's
start, a call's start whose name is not complete yet (a call whose name is
known stays open, for the caller to close as incomplete). Ended otherwise
(the end of sequence, a stop string), a marker's start is text, as is a
marker with nothing after it; a call that had begun is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tasks_app.generation.tool_calls import NAME_RE, ToolFormat

TEXT = "text"
CALL_START = "call_start"
CALL_ARGUMENTS = "call_arguments"
CALL_END = "call_end"

Op = tuple[str, str]
"""``(kind, value)``: ``text`` and its text, ``call_start`` and the name, ``call_arguments`` and a piece,
``call_end`` and the whole arguments."""

_WHITESPACE = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")
# A named call's name (and a call id after it) before its arguments' marker: longer is no call.
_CALL_ID = "[CALL_ID]"
_NAMED_HEAD_LIMIT = 64 + len(_CALL_ID) + 64


class MalformedToolCall(ValueError):
    """The model opened a call and then wrote something that is not one."""


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _may_be_named_head(head: str, marker: str) -> bool:
    """Whether ``head`` may begin a named call: a name, perhaps ``[CALL_ID]`` and an id, then the arguments'
    ``marker`` (not yet whole)."""
    name, bracket, tail = head.partition("[")
    if name and not NAME_RE.match(name):
        return False
    tail = bracket + tail
    if tail.startswith(_CALL_ID):
        _, bracket, after_id = tail[len(_CALL_ID) :].partition("[")
        tail = bracket + after_id
    return marker.startswith(tail) or _CALL_ID.startswith(tail)


@dataclass
class _JsonScan:
    """Where a character of streamed JSON falls: how deep, and whether inside a string."""

    depth: int = 0
    in_string: bool = False
    escape: bool = False
    done: bool = False
    broken: str = ""

    def string_char(self, ch: str) -> bool:
        """A character inside a string; True when it closes the string."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def nested_char(self, ch: str) -> bool:
        """A character outside strings below the top; True when it closes an object or a list."""
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return True
        return False


@dataclass
class _CallObject(_JsonScan):
    """One call's JSON object, read character by character (depth, strings, the top level's keys)."""

    raw: str = ""
    string_start: int = -1
    at_top: str = "key"
    """At depth 1: ``key``, ``colon``, ``value``, ``in_value`` or ``after``."""
    key: str | None = None
    name: str | None = None
    args_start: int = -1
    args_end: int = -1

    def push(self, ch: str) -> None:
        pos = len(self.raw)
        self.raw += ch
        if self.in_string:
            if self.string_char(ch) and self.depth == 1:
                self._string_ended(pos)
        elif self.depth == 0:
            if ch == "{":
                self.depth = 1
            elif ch not in _WHITESPACE:
                self.broken = f"a call must be a JSON object, not {ch!r}"
        elif self.depth == 1:
            self._top_level(ch, pos)
        elif self.nested_char(ch) and self.depth == 1:
            self._value_ended(pos + 1)

    def _top_level(self, ch: str, pos: int) -> None:
        """A character of the call object itself (depth 1, outside strings)."""
        if ch in _WHITESPACE:
            if self.at_top == "in_value":
                self._value_ended(pos)
        elif self.at_top == "in_value" and ch not in ",}":
            pass  # a number, true, false or null goes on
        elif ch == '"':
            self.in_string = True
            self.string_start = pos
            if self.at_top == "value":
                self._value_started(pos)
            elif self.at_top != "key":
                self.broken = "a string where the call object has none"
        elif ch in "{[":
            if self.at_top != "value":
                self.broken = "a value without a key in the call object"
                return
            self._value_started(pos)
            self.depth += 1
        else:
            self._top_punctuation(ch, pos)

    def _top_punctuation(self, ch: str, pos: int) -> None:
        if ch == ":":
            self.at_top = "value" if self.at_top == "colon" else self._broke("a stray ':' in the call object")
            return
        if self.at_top == "in_value" and ch in ",}":
            self._value_ended(pos)
        if ch == ",":
            self.at_top = "key" if self.at_top == "after" else self._broke("a stray ',' in the call object")
        elif ch == "}":
            if self.at_top not in ("after", "key"):
                self.broken = "the call object ends inside a member"
            self.depth = 0
            self.done = True
        elif self.at_top == "value":
            self._value_started(pos)
            self.at_top = "in_value"
        else:
            self.broken = f"{ch!r} where the call object has none"

    def _broke(self, why: str) -> str:
        self.broken = why
        return self.at_top

    def _string_ended(self, pos: int) -> None:
        text = self.raw[self.string_start : pos + 1]
        if self.at_top == "key":
            self.key = json.loads(text)
            self.at_top = "colon"
        else:
            if self.key == "name":
                self.name = json.loads(text)
            self._value_ended(pos + 1)

    def _value_started(self, pos: int) -> None:
        if self.key in _ARGUMENT_KEYS and self.args_start < 0:
            self.args_start = pos

    def _value_ended(self, end: int) -> None:
        if self.key in _ARGUMENT_KEYS and self.args_start >= 0 and self.args_end < 0:
            self.args_end = end
        self.at_top = "after"

    @property
    def streams_arguments(self) -> bool:
        """The arguments are an object or a list, whose text is the arguments as they grow."""
        return self.args_start >= 0 and self.raw[self.args_start] in "{["

    def arguments_so_far(self) -> str:
        if self.args_start < 0:
            return ""
        return self.raw[self.args_start : self.args_end if self.args_end >= 0 else len(self.raw)]

    def arguments(self) -> str:
        """The call's arguments as JSON text (a string value holding JSON is that JSON)."""
        text = self.arguments_so_far()
        if not text:
            return "{}"
        value = json.loads(text)
        if isinstance(value, str):
            json.loads(value)
            return value
        return text


@dataclass
class _JsonValue(_JsonScan):
    """The arguments' JSON after a named call's marker: an object or a list, read to its end."""

    text: str = ""

    def push(self, ch: str) -> None:
        if not self.text:
            if ch in _WHITESPACE:
                return
            if ch not in "{[":
                self.broken = f"the arguments must be a JSON object, not {ch!r}"
                return
        self.text += ch
        if self.in_string:
            self.string_char(ch)
        elif self.nested_char(ch):
            self.done = self.depth == 0


@dataclass
class ToolCallParser:
    """See the module docstring. ``max_calls``: the calls after which the rest of the text is ignored
    (``parallel_tool_calls: false`` makes it 1)."""

    fmt: ToolFormat
    max_calls: int | None = None
    _buffer: str = ""
    _mode: str = "text"
    """``text``; ``body`` (after a start marker); ``between`` (after a call block); ``done``."""
    _started: bool = False
    _region: str = ""
    _region_calls: int = 0
    _calls: int = 0
    _in_list: bool = False
    _list_state: str = ""
    _call: _CallObject | None = None
    _value: _JsonValue | None = None
    _sent_arguments: int = 0
    _opened: bool = False
    _out: list[Op] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def call_open(self) -> bool:
        """A call has started and not ended."""
        return self._opened

    def feed(self, text: str) -> list[Op]:
        self._out = []
        self._buffer += text
        self._advance(final=False)
        return self._out

    def finish(self, *, cut: bool = False) -> list[Op]:
        """The text ended (``cut``: by the token limit): what was held back is decided (see the module
        docstring). A call left open stays open (``call_open``)."""
        self._out = []
        self._advance(final=False)
        if self._mode == "between":
            # After a call block only whitespace and a marker's start are held: never text.
            self._buffer = ""
        elif self._mode == "body" and not self._opened and self._region_calls == 0:
            if not self._region_is_call(cut=cut):
                self._emit(TEXT, self._region + self._buffer)
            self._buffer = ""
        elif self._mode == "text" and cut and _held_suffix(self._buffer, self.fmt.start):
            self._buffer = ""  # a marker's start, and the whitespace held with it
        if not cut:
            self._advance(final=True)
        if self._mode == "text":
            self._emit(TEXT, self._buffer)
        self._buffer = ""
        return self._out

    def _region_is_call(self, *, cut: bool) -> bool:
        """Whether the undecided region at the end is a call's start, not text: cut by the limit, anything
        that may still be one; ended otherwise, one that got past its marker."""
        if self.fmt.args_marker:
            return _may_be_named_head(self._buffer, self.fmt.args_marker) and (cut or bool(self._buffer))
        after = self._region.lstrip(_WHITESPACE).removeprefix(self.fmt.start) + self._buffer
        # A JSON region breaks at the first character that cannot be a call's: what is held may be one.
        return cut or bool(after.strip(_WHITESPACE))

    def _emit(self, kind: str, value: str) -> None:
        if kind == TEXT and not value:
            return
        if kind in (TEXT, CALL_ARGUMENTS) and self._out and self._out[-1][0] == kind:
            self._out[-1] = (kind, self._out[-1][1] + value)
            return
        self._out.append((kind, value))

    def _advance(self, *, final: bool) -> None:
        while self._buffer and self._mode != "done":
            before = (self._mode, len(self._buffer))
            if self._mode == "text":
                self._in_text(final)
            elif self._mode == "body":
                self._in_body()
            elif self._mode == "between":
                self._between(final)
            if (self._mode, len(self._buffer)) == before:
                return
        if self._mode == "done":
            self._buffer = ""

    # -- free text ------------------------------------------------------------

    def _in_text(self, final: bool) -> None:
        fmt, buffer = self.fmt, self._buffer
        if fmt.bare_json and not self._started:
            stripped = buffer.lstrip(_WHITESPACE)
            if not stripped:
                if final:
                    self._emit(TEXT, buffer)
                    self._buffer = ""
                return
            self._started = True
            if stripped.startswith("{"):
                self._open_region("", stripped)
                return
        at = buffer.find(fmt.start)
        if at >= 0:
            self._started = True
            before = buffer[:at].rstrip(_WHITESPACE)
            self._emit(TEXT, before)
            # The whitespace before the marker goes with it: text again if the region is no call.
            self._open_region(buffer[len(before) : at + len(fmt.start)], buffer[at + len(fmt.start) :])
            return
        if final:
            return  # finish() releases the rest
        keep = _held_suffix(buffer, fmt.start)
        released = buffer[: len(buffer) - keep]
        # Whitespace right before a marker is not text: hold it until something else follows.
        trimmed = released.rstrip(_WHITESPACE)
        keep += len(released) - len(trimmed)
        if trimmed:
            self._started = True
        self._emit(TEXT, trimmed)
        self._buffer = buffer[len(buffer) - keep :] if keep else ""

    def _open_region(self, marker: str, rest: str) -> None:
        self._mode = "body"
        self._region = marker
        self._region_calls = 0
        self._in_list = False
        self._list_state = "open" if self.fmt.array else ""
        self._buffer = rest

    # -- a call region ----------------------------------------------------------

    def _in_body(self) -> None:
        if self.fmt.args_marker:
            self._in_named_call()
            return
        while self._buffer and self._mode == "body":
            ch, self._buffer = self._buffer[0], self._buffer[1:]
            self._region += ch
            if self._call is not None:
                self._call.push(ch)
                if self._call.broken:
                    self._not_a_call(self._call.broken)
                    return
                self._stream_call()
                if self._call is not None and self._call.done:
                    self._end_call()
                continue
            self._outside_object(ch)

    def _in_named_call(self) -> None:
        """A call written as its name, perhaps ``[CALL_ID]`` and an id, the arguments' marker, then the
        arguments' JSON (Mistral v11+): the name is held until the marker shows where it ends."""
        marker = self.fmt.args_marker
        if self._value is None:
            at = self._buffer.find(marker)
            head = self._buffer if at < 0 else self._buffer[:at]
            name = head.split("[CALL_ID]", 1)[0]
            if (at >= 0 and not NAME_RE.match(name)) or (at < 0 and len(head) > _NAMED_HEAD_LIMIT):
                self._region += self._buffer
                self._buffer = ""
                self._not_a_call("no function name before the arguments")
                return
            if at < 0:
                return
            self._region += self._buffer[: at + len(marker)]
            self._buffer = self._buffer[at + len(marker) :]
            if self.max_calls is not None and self._calls >= self.max_calls:
                self._mode, self._buffer = "done", ""
                return
            self._value, self._opened, self._sent_arguments = _JsonValue(), True, 0
            self._emit(CALL_START, name)
        while self._buffer and self._value is not None:
            ch, self._buffer = self._buffer[0], self._buffer[1:]
            self._region += ch
            self._value.push(ch)
            if self._value.broken:
                self._not_a_call(self._value.broken)
                return
            if self._value.done:
                self._end_named_call()
                return
        if self._value is not None:
            self._stream_value()

    def _stream_value(self) -> None:
        assert self._value is not None
        pending = self._value.text[self._sent_arguments :]
        if pending:
            self._emit(CALL_ARGUMENTS, pending)
            self._sent_arguments = len(self._value.text)

    def _end_named_call(self) -> None:
        assert self._value is not None
        self._stream_value()
        try:
            json.loads(self._value.text)
        except ValueError:
            self._not_a_call("the call's arguments are not JSON")
            return
        self._emit(CALL_END, self._value.text)
        self._value, self._opened = None, False
        self._calls += 1
        self._region_calls += 1
        self._region_done()

    def _outside_object(self, ch: str) -> None:
        """A character of the region between call objects (the list's brackets and commas)."""
        if ch in _WHITESPACE:
            return
        if self.fmt.array:
            if self._list_state == "open":
                if ch != "[":
                    self._not_a_call(f"the calls must be a JSON list, not {ch!r}")
                    return
                self._list_state = "object"
                return
            if self._list_state == "after":
                if ch == ",":
                    self._list_state = "object"
                elif ch == "]":
                    self._region_done()
                else:
                    self._not_a_call(f"{ch!r} between calls")
                return
        if ch != "{":
            self._not_a_call(f"a call must be a JSON object, not {ch!r}")
            return
        self._call = _CallObject()
        self._call.push(ch)
        self._sent_arguments = 0

    def _stream_call(self) -> None:
        call = self._call
        assert call is not None
        if call.name is None:
            return
        if not self._opened:
            if self.max_calls is not None and self._calls >= self.max_calls:
                self._mode, self._buffer = "done", ""
                return
            self._opened = True
            self._emit(CALL_START, call.name)
        if call.streams_arguments:
            so_far = call.arguments_so_far()
            if len(so_far) > self._sent_arguments:
                self._emit(CALL_ARGUMENTS, so_far[self._sent_arguments :])
                self._sent_arguments = len(so_far)

    def _end_call(self) -> None:
        call = self._call
        assert call is not None
        if call.name is None:
            self._not_a_call("the call has no name")
            return
        try:
            arguments = call.arguments()
        except ValueError:
            self._not_a_call("the call's arguments are not JSON")
            return
        if self._mode == "done":
            return
        self._emit(CALL_END, arguments)
        self._opened = False
        self._call = None
        self._calls += 1
        self._region_calls += 1
        if self.fmt.array:
            self._list_state = "after"
        else:
            self._region_done()

    def _region_done(self) -> None:
        """The call block is written: its end marker (if the family has one) may follow."""
        if self.fmt.single or (self.max_calls is not None and self._calls >= self.max_calls):
            self._mode, self._buffer = "done", ""
            return
        self._mode = "between"

    def _between(self, final: bool) -> None:
        """After a call block: its end marker, whitespace, another block, or text."""
        fmt = self.fmt
        stripped = self._buffer.lstrip(_WHITESPACE)
        if fmt.end and stripped.startswith(fmt.end):
            self._buffer = stripped[len(fmt.end) :]
            return
        if fmt.end and fmt.end.startswith(stripped) and not final:
            return  # the end marker may be on its way
        if stripped.startswith(fmt.start):
            self._open_region(fmt.start, stripped[len(fmt.start) :])
            return
        if not stripped or (fmt.start.startswith(stripped) and not final):
            if final:
                self._buffer = ""
            return
        # Text after the calls: a message of its own.
        self._mode = "text"
        self._buffer = stripped

    def _not_a_call(self, why: str) -> None:
        if self._opened or self._region_calls:
            raise MalformedToolCall(f"the model's tool call is malformed: {why}")
        # Nothing opened: the marker and what followed were text after all; the rest is read as text.
        self._call = None
        self._mode = "text"
        self._emit(TEXT, self._region)
        self._region = ""
