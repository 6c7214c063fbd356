-- uses common.lua: now
-- events: finished-job events for webhooks, taken under a lease so a sender that stops or
-- dies never loses one. KEYS[1] events list, KEYS[2] leased zset (job id -> deadline).

-- take_events: ARGV: most to take, lease seconds. Returns the job ids taken. Called with a
-- call id (a retry answers the events its first run leased).
function commands.take_events()
  local deadline, taken = now() + tonumber(ARGV[3]), {}
  for _ = 1, tonumber(ARGV[2]) do
    local job = redis.call('RPOP', KEYS[1])
    if not job then break end
    redis.call('ZADD', KEYS[2], deadline, job)
    taken[#taken + 1] = job
  end
  return taken
end

-- renew_event: ARGV: job id, lease seconds (allow-oom; safe to repeat).
function commands.renew_event()
  return redis.call('ZADD', KEYS[2], 'XX', 'CH', now() + tonumber(ARGV[3]), ARGV[2])
end

local function return_events(ids)
  local returned = 0
  for _, job in ipairs(ids) do
    if redis.call('ZREM', KEYS[2], job) == 1 then
      redis.call('RPUSH', KEYS[1], job)
      returned = returned + 1
    end
  end
  return returned
end

-- return_events: a sender shutting down gives back what it had not started (allow-oom; safe
-- to repeat: an event given back is no longer leased). ARGV[2..]: job ids.
function commands.return_events()
  local ids = {}
  for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
  return return_events(ids)
end

-- reap_events: put back events whose sender died (their lease ran out) (allow-oom; safe to
-- repeat).
function commands.reap_events()
  return return_events(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now(), 'LIMIT', 0, 1000))
end

-- done_event: the event was delivered or given up (safe to repeat). ARGV: job id.
function commands.done_event()
  return redis.call('ZREM', KEYS[2], ARGV[2])
end
