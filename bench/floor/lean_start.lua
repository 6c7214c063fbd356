-- A field per task with vlmq's features kept: start. Each task's field moves to running with
-- an attempt and its batch's id, fenced by its delivery token; the batch's start time and worker
-- are one record of the batch. Safe to repeat (a retry finds the fields already moved): no
-- kept reply. KEYS[1] batch record, KEYS[2] job hash. ARGV: state hash prefix, job id, batch
-- id, worker, then id, token pairs. Returns 1 or 0 per task.
local COUNTS = {'1', '2', '3', '4', '5', '6', '7', '8', '9'}  -- (no number formatted per task)
local states = ARGV[1] .. ARGV[2]
local ids, tokens = {}, {}
for i = 5, #ARGV, 2 do ids[#ids + 1], tokens[#tokens + 1] = ARGV[i], ARGV[i + 1] end
local records = redis.call('HMGET', states, unpack(ids))
local writes, out = {}, {}
for i, id in ipairs(ids) do
  local state, n, attempts, tag, rest = string.match(records[i] or '', '^(%a+) (%d+) (%d+) (%S+) %S+ (.*)$')
  if (state == 'queued' or state == 'running') and n == tokens[i] then
    writes[#writes + 1] = id
    writes[#writes + 1] = 'running ' .. n .. ' ' .. (COUNTS[tonumber(attempts) + 1] or tostring(attempts + 1)) .. ' ' .. tag .. ' ' .. ARGV[3]
                          .. ' ' .. rest
    out[i] = 1
  else
    out[i] = 0
  end
end
local moved = #writes / 2
if moved > 0 then  -- (HINCRBY refuses "-0")
  redis.call('HSET', states, unpack(writes))
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'started_at', t[1] .. '.' .. t[2], 'worker', ARGV[4], 'job_id', ARGV[2])
  redis.call('EXPIRE', KEYS[1], 3600)
  redis.call('HINCRBY', KEYS[2], 'queued', -moved)
  redis.call('HINCRBY', KEYS[2], 'running', moved)
end
return out
