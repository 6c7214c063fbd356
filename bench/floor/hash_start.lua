-- The least per-task state, a hash per task: start. ARGV: job id, batch id, then id, token
-- pairs. A fenced move to running (refused for a holder whose token is no longer the
-- task's), one attempt each; the job's counters once. Returns 1 or 0 per task.
local t = redis.call('TIME')
local ts = t[1] .. '.' .. t[2]
local out, moved = {}, 0
for i = 3, #ARGV, 2 do
  local key = 'floor:task:' .. ARGV[i]
  local h = redis.call('HMGET', key, 'deliveries', 'state', 'attempts')
  if h[1] == ARGV[i + 1] and h[2] == 'queued' then
    redis.call('HSET', key, 'state', 'running', 'started_at', ts, 'worker', 'w@host:1',
               'batch_id', ARGV[2],
               'attempts', tostring((tonumber(h[3]) or 0) + 1))
    moved = moved + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if moved > 0 then  -- (HINCRBY refuses "-0")
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'queued', -moved)
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'running', moved)
end
return out
