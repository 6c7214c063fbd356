-- A field per task with vlmq's features kept (a model of the redesign, docs/broker.md): enqueue,
-- as vlmq's feed. Each task's whole status is one field of its job's state hash (which is also
-- the job's claims: a live or succeeded task's field makes a line with its id a skip, a
-- failed, cancelled or expired one is queued again; the job's counts of the superseded task
-- are not modelled): 'state token attempts tag batch queued_at modality custom_id'. The message goes on the job's own
-- list, the list into its tenant's active zset and the tenant into the class's (fair share);
-- the job's and the tenant quota's counters, and the job keys' ttls, once per call; the reply
-- kept under the call's id for a lost reply's retry.
-- KEYS[1] job state hash, KEYS[2] job hash, KEYS[3] job list, KEYS[4] tenant's active zset,
-- KEYS[5] class's active zset, KEYS[6] depth hash, KEYS[7] tenant quota hash, KEYS[8] call key.
-- ARGV: ttl seconds, then per task its id, tag, custom_id and message. Returns the count queued.
local kept = redis.call('GET', KEYS[8])
if kept then return tonumber(kept) end
local t = redis.call('TIME')
local stamp = t[1] .. '.' .. string.sub(t[2], 1, 3)
local ids = {}
for i = 2, #ARGV, 4 do ids[#ids + 1] = ARGV[i] end
local records = redis.call('HMGET', KEYS[1], unpack(ids))
local fields, messages, bytes, seen = {}, {}, 0, {}
for n, id in ipairs(ids) do
  local at = 2 + (n - 1) * 4
  local state = records[n] and string.match(records[n], '^(%a+)')
  local free = not state or state == 'failed' or state == 'cancelled' or state == 'expired'
  if free and not seen[id] then  -- (a line whose id an earlier line of the chunk took is a skip)
    seen[id] = true
    fields[#fields + 1] = id
    fields[#fields + 1] = 'queued 0 0 ' .. ARGV[at + 1] .. ' - ' .. stamp .. ' text ' .. ARGV[at + 2]
    messages[#messages + 1] = ARGV[at + 3]
    bytes = bytes + #ARGV[at + 3]
  end
end
local queued = #messages
if queued > 0 then
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('LPUSH', KEYS[3], unpack(messages))
  redis.call('ZADD', KEYS[4], 'NX', 0, KEYS[3])
  redis.call('ZADD', KEYS[5], 'NX', 0, KEYS[4])
  redis.call('HINCRBY', KEYS[6], KEYS[5], queued)
  redis.call('HINCRBY', KEYS[2], 'total', queued)
  redis.call('HINCRBY', KEYS[2], 'queued', queued)
  redis.call('HINCRBY', KEYS[2], 'fed_lines', queued)
  redis.call('HINCRBY', KEYS[2], 'fed_bytes', bytes)
  redis.call('HINCRBY', KEYS[7], 'tasks', queued)
end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
redis.call('SET', KEYS[8], queued, 'EX', 60)
return queued
