-- A field per task with vlmq's features kept: settle. Each task's field moves to succeeded,
-- fenced by its delivery token (its result object is named by its job, id and that token);
-- every lease, in-flight copy and origin is acknowledged; then once per call: the job's
-- counters, its completion list, the usage sums per job and tenant (tokens in and out, model
-- seconds), the tenant's quota, the job keys' ttls and a finish check; the reply kept under the
-- call's id. KEYS[1] in-flight hash, KEYS[2] leases, KEYS[3] origins hash, KEYS[4] origin zsets
-- hash, KEYS[5] job hash, KEYS[6] completion list, KEYS[7] job usage hash, KEYS[8] tenant
-- usage hash, KEYS[9] usage tenants set, KEYS[10] tenant quota hash, KEYS[11] call key,
-- KEYS[12] job state hash, KEYS[13] job list. ARGV: ttl seconds, tenant, usage group, then
-- per task id, token, tokens in, tokens out, model seconds. Returns 1 or 0 per task.
local kept = redis.call('GET', KEYS[11])
if kept then return cjson.decode(kept) end
local ids, tokens = {}, {}
for i = 4, #ARGV, 5 do ids[#ids + 1], tokens[#tokens + 1] = ARGV[i], ARGV[i + 1] end
local records = redis.call('HMGET', KEYS[12], unpack(ids))
local writes, out, finished = {}, {}, {}
local tokens_in, tokens_out, seconds = 0, 0, 0
for i, id in ipairs(ids) do
  local state, n, rest = string.match(records[i] or '', '^(%a+) (%d+) (.*)$')
  if state == 'running' and n == tokens[i] then
    writes[#writes + 1] = id
    writes[#writes + 1] = 'succeeded ' .. n .. ' ' .. rest
    finished[#finished + 1] = id
    local at = 4 + (i - 1) * 5
    tokens_in = tokens_in + ARGV[at + 2]
    tokens_out = tokens_out + ARGV[at + 3]
    seconds = seconds + ARGV[at + 4]
    out[i] = 1
  else
    out[i] = 0
  end
end
redis.call('HDEL', KEYS[1], unpack(ids))
redis.call('ZREM', KEYS[2], unpack(ids))
redis.call('HDEL', KEYS[3], unpack(ids))
redis.call('HDEL', KEYS[4], unpack(ids))
local moved = #finished
if moved > 0 then
  redis.call('HSET', KEYS[12], unpack(writes))
  redis.call('HINCRBY', KEYS[5], 'running', -moved)
  redis.call('HINCRBY', KEYS[5], 'succeeded', moved)
  redis.call('RPUSH', KEYS[6], unpack(finished))
  local group = ARGV[3]
  for _, usage in ipairs({KEYS[7], KEYS[8]}) do
    redis.call('HINCRBY', usage, group .. '|requests', moved)
    redis.call('HINCRBY', usage, group .. '|tokens_in', tokens_in)
    redis.call('HINCRBY', usage, group .. '|tokens_out', tokens_out)
    redis.call('HINCRBYFLOAT', usage, group .. '|model_s', seconds)
  end
  redis.call('SADD', KEYS[9], ARGV[2])
  redis.call('HINCRBY', KEYS[10], 'tasks', -moved)
end
for _, key in ipairs({KEYS[5], KEYS[6], KEYS[7], KEYS[12], KEYS[13]}) do
  redis.call('EXPIRE', key, ARGV[1])
end
local job = redis.call('HMGET', KEYS[5], 'total', 'succeeded', 'failed', 'cancelled', 'expired')
local ended = 0
for i = 2, 5 do ended = ended + (tonumber(job[i]) or 0) end
if ended >= (tonumber(job[1]) or 0) then
  local t = redis.call('TIME')
  redis.call('HSETNX', KEYS[5], 'finished_at', t[1] .. '.' .. t[2])
end
redis.call('SET', KEYS[11], cjson.encode(out), 'EX', 60)
return out
