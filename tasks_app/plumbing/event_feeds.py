"""Server-sent event streams of a task's event log (chapter 7.4, PROFILE.md section 4).

The database is the only source of events. Followers of one task share a
``TaskFeed``: one read per wake-up fetches the new events and encodes each
frame once, and every follower writes the same bytes. A follower whose cursor
lies before the feed's window (a late join, a resume from far back) reads its
own pages until it reaches the window. A frame is sent only after the commit
that wrote it, so a client never sees an event the database could lose.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from django.conf import settings

from tasks_app import events
from tasks_app.models import TaskEvent
from tasks_app.plumbing.database_outages import database_unavailable_noted
from tasks_app.plumbing.dbpool import run_db, run_db_through_outages
from tasks_app.plumbing.wakeups import Change, WakeHub, wake_hub

logger = logging.getLogger(__name__)

# A comment line alone, not a frame: the openai SDK (3.57) dispatches a blank line after a comment as an
# event with empty data once an id was seen (the spec says to dispatch nothing), and then fails to parse
# it as JSON, so a keepalive frame would break every SDK stream that waits. Bytes still flow, which is
# all a keepalive is for; the next frame's fields follow the comment line.
KEEPALIVE = b": keepalive\n"


@dataclass(frozen=True, slots=True)
class Frame:
    """One event, encoded as the SSE frame every follower sends."""

    sequence_number: int
    terminal: bool
    data: bytes


@dataclass(frozen=True, slots=True)
class Chunk:
    """Consecutive frames after ``after`` up to ``last``, joined into what one write sends."""

    after: int
    last: int
    terminal: bool
    data: bytes

    @classmethod
    def of(cls, frames: list[Frame]) -> Chunk:
        return cls(
            after=frames[0].sequence_number - 1,
            last=frames[-1].sequence_number,
            terminal=frames[-1].terminal,
            data=b"".join(frame.data for frame in frames),
        )


def sse_frame(sequence_number: int, event_type: str, payload: str) -> bytes:
    # The payload is compact JSON (no raw newline can occur), so one data line.
    return f"id: {sequence_number}\nevent: {event_type}\ndata: {payload}\n\n".encode()


def task_event_frames_after(*, task_id: str, after: int, limit: int) -> list[Frame]:
    """Up to ``limit`` events with ``sequence_number > after``, oldest first."""
    rows = (
        TaskEvent.objects.filter(task_id=task_id, sequence_number__gt=after)
        .order_by("sequence_number")
        .values_list("sequence_number", "type", "payload")[:limit]
    )
    return [Frame(seq, kind in events.TERMINAL, sse_frame(seq, kind, payload)) for seq, kind, payload in rows]


class TaskFeed:
    """The newest events of one task, read once for all of its followers in this process."""

    def __init__(self, hub: WakeHub, task_id: str, after: int) -> None:
        self.hub = hub
        self.task_id = task_id
        self.frames: deque[Frame] = deque(maxlen=settings.LMSP_STREAM_FEED_WINDOW)
        self.last_sequence = after  # the newest sequence number read (or the start)
        self.ended = False  # the terminal event was read: nothing more will come
        self.followers: set[asyncio.Event] = set()
        # The newest read, joined once: followers that were caught up (nearly
        # all of them) send it as is instead of each slicing the window.
        self.newest: Chunk | None = None
        self._dirty = False
        self._reader: asyncio.Task | None = None

    def window_start(self) -> int:
        return self.frames[0].sequence_number if self.frames else self.last_sequence + 1

    def frames_after(self, cursor: int) -> list[Frame] | None:
        """The held frames after ``cursor``; None when ``cursor`` is older than the window."""
        start = self.window_start()
        if cursor + 1 < start:
            return None
        if cursor >= self.last_sequence:
            return []
        # Index from the right: followers are nearly always at the newest end.
        return [self.frames[-k] for k in range(self.last_sequence - cursor, 0, -1)]

    def chunk_after(self, cursor: int) -> Chunk | None:
        """What follows ``cursor`` (``data`` empty when nothing does); None when it is older than the window."""
        newest = self.newest
        if newest is not None and newest.after == cursor:
            return newest
        frames = self.frames_after(cursor)
        if frames is None:
            return None
        return Chunk.of(frames) if frames else Chunk(cursor, cursor, False, b"")

    def poke(self, change: Change | None = None) -> None:
        """Something may have been committed: read again (coalesced while a read runs)."""
        if self.ended or (change is not None and change.last_sequence <= self.last_sequence):
            return
        self._dirty = True
        if self._reader is None or self._reader.done():
            self._reader = self.hub.loop.create_task(self._read(), name=f"lmsp-feed-{self.task_id}")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    def _extend(self, frames: list[Frame]) -> None:
        # The window must stay contiguous (``frames_after`` indexes it). A gap
        # means deleted events: keep only what follows it, so that a follower
        # before the gap reads the database, finds the gap, and ends.
        start, expected = 0, self.last_sequence + 1
        for index, frame in enumerate(frames):
            if frame.sequence_number != expected:
                start = index
                self.frames.clear()
            expected = frame.sequence_number + 1
        self.frames.extend(frames[start:])

    async def _read(self) -> None:
        page = settings.LMSP_STREAM_PAGE_EVENTS
        while self._dirty and not self.ended:
            self._dirty = False
            try:
                frames = await run_db(
                    task_event_frames_after, task_id=self.task_id, after=self.last_sequence, limit=page
                )
            except Exception as error:
                # The followers' next poll tries again: a database outage is logged once
                # (tasks_app.plumbing.database_outages), anything else here.
                if database_unavailable_noted(error) is None:
                    logger.exception("reading events of %s failed", self.task_id)
                return
            if frames:
                contiguous = frames[0].sequence_number == self.last_sequence + 1
                self._extend(frames)
                self.newest = Chunk.of(frames) if contiguous else None
                self.last_sequence = frames[-1].sequence_number
                self.ended = frames[-1].terminal
                if len(frames) == page:
                    self._dirty = True
                for follower in self.followers:
                    follower.set()


class Feeds:
    """The feeds of one event loop, one per followed task."""

    def __init__(self, hub: WakeHub) -> None:
        self.hub = hub
        self.by_task: dict[str, TaskFeed] = {}

    def attach(self, task_id: str, cursor: int, follower: asyncio.Event) -> TaskFeed:
        feed = self.by_task.get(task_id)
        if feed is None:
            feed = self.by_task[task_id] = TaskFeed(self.hub, task_id, cursor)
            # Watch before the first read, so no commit falls in between.
            self.hub.watch(task_id, feed.poke)
            feed.poke()
        feed.followers.add(follower)
        return feed

    def detach(self, feed: TaskFeed, follower: asyncio.Event) -> None:
        feed.followers.discard(follower)
        if not feed.followers and self.by_task.get(feed.task_id) is feed:
            del self.by_task[feed.task_id]
            self.hub.unwatch(feed.task_id, feed.poke)
            feed.close()

    @property
    def open_streams(self) -> int:
        return sum(len(feed.followers) for feed in self.by_task.values())


_feeds: weakref.WeakKeyDictionary[WakeHub, Feeds] = weakref.WeakKeyDictionary()


def feeds() -> Feeds:
    """The feeds of the running event loop."""
    hub = wake_hub()
    found = _feeds.get(hub)
    if found is None:
        found = _feeds[hub] = Feeds(hub)
    return found


async def follow(task_id: str, after: int, *, preamble: bytes = b"") -> AsyncGenerator[bytes, None]:
    """The SSE body: every event after ``after``, live, until the terminal event.

    Ends early, without an error frame, if the log has a gap (events were
    deleted under it); the client's reconnect then gets the 410 that explains.
    """
    registry = feeds()
    follower = asyncio.Event()
    feed = registry.attach(task_id, after, follower)
    loop = asyncio.get_running_loop()
    keepalive = settings.LMSP_STREAM_KEEPALIVE_SECONDS
    try:
        if preamble:
            yield preamble
        cursor = after
        quiet_since = loop.time()
        while True:
            chunk = feed.chunk_after(cursor)
            if chunk is None:
                # Behind the feed's window: page through the table ourselves.
                # Waits while the database is away (the task goes on meanwhile). Only a stream this far
                # behind waits here without keepalives; one at the newest end waits below, where they flow.
                frames = await run_db_through_outages(
                    task_event_frames_after,
                    task_id=task_id,
                    after=cursor,
                    limit=settings.LMSP_STREAM_PAGE_EVENTS,
                )
                if not frames or frames[0].sequence_number != cursor + 1:
                    return
                chunk = Chunk.of(frames)
            if chunk.data:
                yield chunk.data
                cursor = chunk.last
                if chunk.terminal:
                    return
                quiet_since = loop.time()
                continue
            follower.clear()
            until_keepalive = quiet_since + keepalive - loop.time()
            try:
                # asyncio.timeout, not wait_for: no extra task per stream per wake-up.
                async with asyncio.timeout(max(0.0, min(until_keepalive, registry.hub.poll_interval()))):
                    await follower.wait()
            except TimeoutError:
                # No wake-up: read anyway, in case one was lost.
                feed.poke()
                if loop.time() - quiet_since >= keepalive:
                    yield KEEPALIVE
                    quiet_since = loop.time()
    finally:
        registry.detach(feed, follower)
