-- The least per-task state, a hash per task: pull. KEYS[1] queue, KEYS[2] in-flight hash,
-- KEYS[3] leases zset. ARGV: count, lease seconds. Pops up to count messages; each is named by
-- its header id and tag (the tag must be the one its task was created with), counted a
-- delivery (its fencing token) and leased; it stays queued until its start, as in vlmq.
-- Returns id, token pairs.
local raws = redis.call('RPOP', KEYS[1], ARGV[1])
if not raws then return {} end
local t = redis.call('TIME')
local deadline = tostring(tonumber(t[1]) + tonumber(ARGV[2]))
local inflight, leases, out = {}, {}, {}
for _, raw in ipairs(raws) do
  local a = string.find(raw, '"id":"', 1, true) + 6
  local id = string.sub(raw, a, string.find(raw, '"', a, true) - 1)
  local b = string.find(raw, '"delivery_tag":"', 1, true) + 16
  local tag = string.sub(raw, b, string.find(raw, '"', b, true) - 1)
  local key = 'floor:task:' .. id
  local status = redis.call('HMGET', key, 'tag', 'state')
  if status[1] == tag and status[2] == 'queued' then
    local token = redis.call('HINCRBY', key, 'deliveries', 1)
    inflight[#inflight + 1] = id
    inflight[#inflight + 1] = raw
    leases[#leases + 1] = deadline
    leases[#leases + 1] = id
    out[#out + 1] = id
    out[#out + 1] = token
  end
end
if #out > 0 then
  redis.call('HSET', KEYS[2], unpack(inflight))
  redis.call('ZADD', KEYS[3], unpack(leases))
end
return out
