-- A field per task with vlmq's features kept: pull. The fixed lists first (the interactive
-- lane's and the prepared lanes': empty here, popped as vlmq's pull pops them), then fair share:
-- the least recently served tenant of the class, its least recently served job list, each sent
-- to the back of its zset once served (an empty list leaves its zset). Each message is checked
-- against its task's field (its tag, an ended task) and the leases (a live holder's copy is
-- dropped); each job's fields are read and written in one call each. Every held task gets its
-- in-flight copy, lease, origin list and origin zset; the reply is kept (its ids and tokens)
-- under the call's id. KEYS[1] in-flight hash, KEYS[2] leases zset, KEYS[3] origins hash,
-- KEYS[4] origin zsets hash, KEYS[5] depth hash, KEYS[6] class's active zset, KEYS[7] call
-- key, KEYS[8..] fixed lists. ARGV: count, lease seconds, state hash prefix. Returns per task:
-- id, message, token, origin list, state, attempts, job, queued_at.
local kept = redis.call('GET', KEYS[7])
if kept then  -- a retry: the rows again, from the in-flight hash (fields as they are now)
  local pairs_kept, out = cjson.decode(kept), {}
  for i = 1, #pairs_kept, 2 do
    local id = pairs_kept[i]
    local raw, origin = redis.call('HGET', KEYS[1], id), redis.call('HGET', KEYS[3], id)
    if raw then
      local o = #out
      out[o + 1], out[o + 2], out[o + 3], out[o + 4] = id, raw, pairs_kept[i + 1], origin
      out[o + 5], out[o + 6], out[o + 7], out[o + 8] = '', '', '', ''
    end
  end
  return out
end
local COUNTS = {'1', '2', '3', '4', '5', '6', '7', '8', '9'}  -- (no number formatted per task)
local limit = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1])
local deadline = tostring(now + tonumber(ARGV[2]))
local raws, lists, actives = {}, {}, {}
for i = 8, #KEYS do
  local got = redis.call('RPOP', KEYS[i], limit - #raws)
  if got then for _, raw in ipairs(got) do raws[#raws + 1], lists[#raws + 1] = raw, KEYS[i] end end
end
local function served(zset, member)
  local last = redis.call('ZRANGE', zset, -1, -1, 'WITHSCORES')
  redis.call('ZADD', zset, tonumber(last[2]) + 1, member)
end
while #raws < limit do
  local tenant = redis.call('ZRANGE', KEYS[6], 0, 0)[1]
  if not tenant then break end
  local list = redis.call('ZRANGE', tenant, 0, 0)[1]
  local got = list and redis.call('RPOP', list, limit - #raws)
  if got then
    for _, raw in ipairs(got) do
      raws[#raws + 1], lists[#raws + 1], actives[#raws + 1] = raw, list, tenant
    end
    redis.call('HINCRBY', KEYS[5], KEYS[6], -#got)
    served(tenant, list)
    served(KEYS[6], tenant)
  elseif list then
    redis.call('ZREM', tenant, list)
  else
    redis.call('ZREM', KEYS[6], tenant)
  end
end
if #raws == 0 then return {} end
local function header(raw, name)
  local _, e = string.find(raw, '"' .. name .. '":"', 1, true)
  return string.sub(raw, e + 1, string.find(raw, '"', e + 1, true) - 1)
end
local ids, tags, jobs, order = {}, {}, {}, {}
for i, raw in ipairs(raws) do
  ids[i], tags[i] = header(raw, 'id'), header(raw, 'delivery_tag')
  local job = header(raw, 'job')
  if not jobs[job] then jobs[job], order[#order + 1] = {}, job end
  table.insert(jobs[job], i)
end
local leased = redis.call('ZMSCORE', KEYS[2], unpack(ids))
local inflight, leases, origins, zsets, out, keep = {}, {}, {}, {}, {}, {}
for _, job in ipairs(order) do
  local at, names, writes = jobs[job], {}, {}
  for k, i in ipairs(at) do names[k] = ids[i] end
  local records = redis.call('HMGET', ARGV[3] .. job, unpack(names))
  for k, i in ipairs(at) do
    local state, n, attempts, rest = string.match(records[k] or '', '^(%a+) (%d+) (%d+) (.*)$')
    local tag, stamp = string.match(rest or '', '^(%S+) %S+ (%S+)')
    local held = tonumber(leased[i])
    if tag == tags[i] and (state == 'queued' or state == 'running') and not (held and held > now) then
      local token = COUNTS[tonumber(n) + 1] or tostring(n + 1)
      writes[#writes + 1] = ids[i]
      writes[#writes + 1] = state .. ' ' .. token .. ' ' .. attempts .. ' ' .. rest
      inflight[#inflight + 1], inflight[#inflight + 2] = ids[i], raws[i]
      leases[#leases + 1], leases[#leases + 2] = deadline, ids[i]
      origins[#origins + 1], origins[#origins + 2] = ids[i], lists[i]
      if actives[i] then zsets[#zsets + 1], zsets[#zsets + 2] = ids[i], actives[i] end
      local o = #out
      out[o + 1], out[o + 2], out[o + 3], out[o + 4] = ids[i], raws[i], token, lists[i]
      out[o + 5], out[o + 6], out[o + 7], out[o + 8] = state, attempts, job, stamp
      keep[#keep + 1], keep[#keep + 2] = ids[i], token
    end
  end
  if #writes > 0 then redis.call('HSET', ARGV[3] .. job, unpack(writes)) end
end
if #inflight > 0 then
  redis.call('HSET', KEYS[1], unpack(inflight))
  redis.call('ZADD', KEYS[2], unpack(leases))
  redis.call('HSET', KEYS[3], unpack(origins))
  if #zsets > 0 then redis.call('HSET', KEYS[4], unpack(zsets)) end
  -- (a retry's reply is rebuilt from the in-flight hash: only the ids and tokens are kept)
  redis.call('SET', KEYS[7], cjson.encode(keep), 'EX', 60)
end
return out
