"""Everything that talks to Redis: the connection, the Lua behind one dispatch, the state per
concern, the queues, the feeds and the memory guard. Above ``vlmq.config`` (the contract, no
I/O), below the producers and the workers."""
