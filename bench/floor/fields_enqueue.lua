-- The least per-task state, kept as one field per task in its job's hash (value: state,
-- delivery count, attempts, tag): enqueue. KEYS[1] queue list. ARGV: job id, then per task its
-- id, tag and message. Every write is one call for the whole chunk.
local job = ARGV[1]
local messages, fields = {}, {}
for i = 2, #ARGV, 3 do
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = 'queued 0 0 ' .. ARGV[i + 1]
  messages[#messages + 1] = ARGV[i + 2]
end
redis.call('HSET', 'floor:tasks:' .. job, unpack(fields))
redis.call('LPUSH', KEYS[1], unpack(messages))
redis.call('HINCRBY', 'floor:job:' .. job, 'queued', #messages)
return #messages
