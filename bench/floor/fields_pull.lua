-- The least per-task state, a field per task in its job's hash: pull. KEYS[1] queue, KEYS[2]
-- in-flight hash, KEYS[3] leases zset. ARGV: count, lease seconds. As hash_pull.lua, with each
-- job's task states read and written in one call each.
local raws = redis.call('RPOP', KEYS[1], ARGV[1])
if not raws then return {} end
local t = redis.call('TIME')
local deadline = tostring(tonumber(t[1]) + tonumber(ARGV[2]))
local function header(raw, name)
  local a = string.find(raw, '"' .. name .. '":"', 1, true) + #name + 4
  return string.sub(raw, a, string.find(raw, '"', a, true) - 1)
end
local jobs, order = {}, {}
for _, raw in ipairs(raws) do
  local job = header(raw, 'job')
  local of = jobs[job]
  if not of then
    of = {ids = {}, tags = {}, raws = {}}
    jobs[job] = of
    order[#order + 1] = job
  end
  of.ids[#of.ids + 1] = header(raw, 'id')
  of.tags[#of.tags + 1] = header(raw, 'delivery_tag')
  of.raws[#of.raws + 1] = raw
end
local inflight, leases, out = {}, {}, {}
for _, job in ipairs(order) do
  local of, writes = jobs[job], {}
  local states = redis.call('HMGET', 'floor:tasks:' .. job, unpack(of.ids))
  for i, id in ipairs(of.ids) do
    local state, n, attempts, tag = string.match(states[i] or '', '^(%a+) (%d+) (%d+) (%S+)$')
    if tag == of.tags[i] and state == 'queued' then
      local token = tostring(tonumber(n) + 1)
      writes[#writes + 1] = id
      writes[#writes + 1] = 'queued ' .. token .. ' ' .. attempts .. ' ' .. tag
      inflight[#inflight + 1] = id
      inflight[#inflight + 1] = of.raws[i]
      leases[#leases + 1] = deadline
      leases[#leases + 1] = id
      out[#out + 1] = id
      out[#out + 1] = token
    end
  end
  if #writes > 0 then redis.call('HSET', 'floor:tasks:' .. job, unpack(writes)) end
end
if #out > 0 then
  redis.call('HSET', KEYS[2], unpack(inflight))
  redis.call('ZADD', KEYS[3], unpack(leases))
end
return out
