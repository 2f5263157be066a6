"""Mounts the library's own ``events`` view, one channel per URL (its DefaultChannelManager).

``probe/listener/`` is the probe's own window into the library's per-process
state: whether its RedisListener task is still running on this event loop.
"""

import asyncio
import gc

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django_eventstream.views import events, get_listener_manager


async def listener_state(request: HttpRequest) -> JsonResponse:
    # The library keeps no reference to its listener task (views.py:87), so
    # look for it among the loop's live tasks by its coroutine's name.
    tasks = [t for t in asyncio.all_tasks() if "start_redis_listener" in repr(t.get_coro())]
    # Collecting may finalize a dead task, which logs "Task exception was never retrieved".
    gc.collect()
    manager = get_listener_manager()
    return JsonResponse(
        {
            "redis_listener_started_flag": manager.redis_listener_started,
            "listener_task_running": bool(tasks),
        }
    )


urlpatterns = [
    path("events/<str:channel>/", events),
    path("probe/listener/", listener_state),
]
