-- The least per-task state, a field per task in its job's hash: start. ARGV: job id, batch id,
-- then id, token pairs. The batch's start time and worker are one record of the batch (its
-- tasks' states name it), not fields of each task. Returns 1 or 0 per task.
local job = 'floor:tasks:' .. ARGV[1]
local ids, tokens = {}, {}
for i = 3, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
  tokens[#tokens + 1] = ARGV[i + 1]
end
local states = redis.call('HMGET', job, unpack(ids))
local writes, out = {}, {}
for i, id in ipairs(ids) do
  local state, n, attempts, tag = string.match(states[i] or '', '^(%a+) (%d+) (%d+) (%S+)')
  if state == 'queued' and n == tokens[i] then
    writes[#writes + 1] = id
    writes[#writes + 1] = 'running ' .. n .. ' ' .. tostring(tonumber(attempts) + 1) .. ' ' .. tag
                          .. ' ' .. ARGV[2]
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if #writes > 0 then redis.call('HSET', job, unpack(writes)) end
local t = redis.call('TIME')
redis.call('HSET', 'floor:batch:' .. ARGV[2], 'started_at', t[1] .. '.' .. t[2],
           'worker', 'w@host:1', 'job_id', ARGV[1])
redis.call('EXPIRE', 'floor:batch:' .. ARGV[2], 3600)
local moved = #writes / 2
if moved > 0 then  -- (HINCRBY refuses "-0")
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'queued', -moved)
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'running', moved)
end
return out
