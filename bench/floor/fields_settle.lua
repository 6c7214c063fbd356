-- The least per-task state, a field per task in its job's hash: settle. KEYS[1] in-flight
-- hash, KEYS[2] leases. ARGV: job id, then id, token pairs. The task's field records its end
-- and the delivery whose result it kept; the acknowledgements and counters as hash_settle.lua.
local job = 'floor:tasks:' .. ARGV[1]
local ids, tokens = {}, {}
for i = 2, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
  tokens[#tokens + 1] = ARGV[i + 1]
end
local states = redis.call('HMGET', job, unpack(ids))
local writes, out = {}, {}
for i, id in ipairs(ids) do
  local state, n, attempts, tag = string.match(states[i] or '', '^(%a+) (%d+) (%d+) (%S+)')
  if state == 'running' and n == tokens[i] then
    writes[#writes + 1] = id
    writes[#writes + 1] = 'succeeded ' .. n .. ' ' .. attempts .. ' ' .. tag
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if #writes > 0 then redis.call('HSET', job, unpack(writes)) end
redis.call('HDEL', KEYS[1], unpack(ids))
redis.call('ZREM', KEYS[2], unpack(ids))
local moved = #writes / 2
if moved > 0 then  -- (HINCRBY refuses "-0")
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'running', -moved)
  redis.call('HINCRBY', 'floor:job:' .. ARGV[1], 'succeeded', moved)
end
return out
