"""Task layouts: how this version lays a task out in Redis, and which layouts it reads.

A layout is everything a reader of a task must understand: its status hash's fields, what a
queue list holds, where a job keeps its tasks' states. Old and new versions of vlmq share a
Redis during a rolling update, each with its own Lua library (vlmq/broker/scripts.py), so a
layout cannot simply change under them: a worker of the old version would take a task it
cannot read. The fleet-wide switch (``lua/layouts.lua``, ``vlmq layout``) makes a change safe:

1. a version that reads the new layout (and every older one still in Redis) is rolled out
   everywhere; each worker's heartbeat record lists the layouts it reads;
2. an operator raises the layout in force (``vlmq layout --raise N``), which Redis refuses
   while any live worker's record does not list N;
3. from then on every library older than N refuses every call (``LayoutUnreadable``), so a
   process of an old version started later, or one that was cut off while the layout was
   raised, stops instead of misreading; writers write N.

A layout is never lowered: tasks of the newer layout may be in Redis. This version has one.
"""

from __future__ import annotations

__all__ = ["NEWEST", "READS"]

# The newest layout this version reads and writes (the Lua library's LAYOUT).
NEWEST = 1
# Every layout this version reads (a worker's record lists them).
READS = (1,)
