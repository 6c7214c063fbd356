-- The least per-task state, a hash per task: settle. KEYS[1] in-flight hash, KEYS[2] leases.
-- ARGV: job id, then id, token pairs. A fenced move to succeeded with its result's url, the
-- acknowledgements (in-flight entry, lease) and the job's counters once. Returns 1 or 0 per
-- task.
local t = redis.call('TIME')
local ts = t[1] .. '.' .. t[2]
local out, ids, moved = {}, {}, 0
for i = 2, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local key = 'floor:task:' .. id
  local h = redis.call('HMGET', key, 'deliveries', 'state')
  if h[1] == token and h[2] == 'running' then
    redis.call('HSET', key, 'state', 'succeeded', 'finished_at', ts,
               'result_url', 'file:///r/' .. id .. '.' .. token .. '.json')
    moved = moved + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  ids[#ids + 1] = id
end
redis.call('HDEL', KEYS[1], unpack(ids))
redis.call('ZREM', KEYS[2], unpack(ids))
if moved > 0 then  -- (HINCRBY refuses "-0")
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'running', -moved)
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'succeeded', moved)
end
return out
