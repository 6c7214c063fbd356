-- uses common.lua: now, stamp
-- tenants: quotas, usage and the API's rate buckets ----------------------------------------

-- A tenant's queued work is a hash (Keys.quota: 'tasks', 'tokens'), named by the 'quota' field
-- of what counts in it: a job (its queued count, fed or not, at 'est' estimated tokens a task)
-- or a task of its own (one task at its 'est'). Every change of a job's queued count goes
-- through admit/queued_by, so the tenant's counts follow the job's exactly.

local function quota_add(quota, tasks, tokens)
  redis.call('HINCRBY', quota, 'tasks', tasks)
  if tokens ~= 0 then redis.call('HINCRBY', quota, 'tokens', string.format('%d', tokens)) end
end

-- `n` more queued tasks in a job, `tokens` their estimate: the job's mean moves to include
-- them, and the tenant's tokens by what that changes.
local function admit(jobkey, n, tokens)
  local j = redis.call('HMGET', jobkey, 'queued', 'quota', 'est')
  local queued, est = tonumber(j[1] or '0') or 0, tonumber(j[3] or '0') or 0
  redis.call('HINCRBY', jobkey, 'queued', n)
  if not j[2] or n == 0 then return end
  local mean = est
  if queued + n > 0 then mean = math.floor((queued * est + tokens) / (queued + n) + 0.5) end
  redis.call('HSET', jobkey, 'est', mean)
  quota_add(j[2], n, (queued + n) * mean - queued * est)
end

-- A job's queued count changes by `n` (`mirror` of them count in its tenant's quota: a task
-- with a 'quota' of its own is counted there instead).
local function queued_by(jobkey, n, mirror)
  if n ~= 0 then redis.call('HINCRBY', jobkey, 'queued', n) end
  if mirror == 0 then return end
  local j = redis.call('HMGET', jobkey, 'quota', 'est')
  if j[1] then quota_add(j[1], mirror, mirror * (tonumber(j[2] or '0') or 0)) end
end

-- usage ----------------------------------------------------------------------------------
-- What settled tasks used, counted once per task in the step that settles it (a fenced-out
-- holder's result counts nothing): per tenant (Keys.usage, the tenants in Keys.usage_tenants)
-- and per job (Keys.job_usage, with the job's ttl), fields '<model>|<modality>|<metric>'.
local USAGE_METRICS = {'prompt_tokens', 'completion_tokens', 'requests', 'model_us', 'gpu_us',
                       'cost_ucents'}

-- A settle's usage (config/usage.py usage_argv): its tasks grouped by model, modality and
-- the job their worker read, each group's sums once; per task its group and its own values.
-- Reads the groups from ARGV at `at`: G, then per group its dims, task count and sums.
local function read_usage_groups(at)
  local groups, n = {}, tonumber(ARGV[at])
  at = at + 1
  for g = 1, n do
    local group = {dims = ARGV[at], n = tonumber(ARGV[at + 1]), values = {}, jobs = {},
                   tenants = {}, owns = {}}
    for j = 1, #USAGE_METRICS do group.values[j] = tonumber(ARGV[at + 1 + j]) or 0 end
    -- (found by its number's text too, as each task names it: no number parsed per task)
    groups[g], groups[tostring(g)] = group, group
    at = at + 2 + #USAGE_METRICS
  end
  return groups, at
end

-- A task of `group` that moved under this holder: its job and tenant as its hash had them,
-- and its own values (`own`, read only if its group is not counted whole).
local function note_usage(group, job, tenant, own)
  local k = #group.owns + 1
  group.jobs[k], group.tenants[k], group.owns[k] = job or false, tenant or false, own
  if k > 1 and (group.jobs[1] ~= group.jobs[k] or group.tenants[1] ~= group.tenants[k]) then
    group.mixed = true
  end
end

local function own_values(own)
  local values = {}
  for word in string.gmatch(own, '%S+') do values[#values + 1] = tonumber(word) or 0 end
  return values
end

-- A settle call's usage, summed per key and field and written once at its end: a batch of 64
-- tasks of one job and model costs 8 writes, not 512. `sums.keys` lists keys in first-seen
-- order; `sums.jobs` the job usage keys (they get the job's ttl).
local function new_sums() return {keys = {}, fields = {}, jobs = {}, tenants = {}, of = {}} end

-- The usage field names of one dims ('<model>|<modality>'), made once per script call (a
-- batch's tasks share a few).
local USAGE_FIELDS = {}

local function usage_fields(dims)
  local names = USAGE_FIELDS[dims]
  if not names then
    names = {}
    for j, metric in ipairs(USAGE_METRICS) do names[j] = dims .. '|' .. metric end
    USAGE_FIELDS[dims] = names
  end
  return names
end

local function add_usage(sums, key, u)
  local fields = sums.fields[key]
  if not fields then
    fields = {}
    sums.fields[key] = fields
    sums.keys[#sums.keys + 1] = key
  end
  for j, field in ipairs(usage_fields(u.dims)) do
    fields[field] = (fields[field] or 0) + u.values[j]
  end
end

-- `job`, `tenant`: the task's, as its hash had them before it settled (a fed task's hash has
-- no tenant: its job's is read once per call). `usage_prefix`: Keys.usage_prefix.
local function count_usage(sums, job, tenant, u, jobprefix, usage_prefix)
  if not tenant and job then
    tenant = sums.of[job] or redis.call('HGET', jobprefix .. job, 'tenant') or 'default'
    sums.of[job] = tenant
  end
  tenant = tenant or 'default'
  add_usage(sums, usage_prefix .. tenant, u)
  sums.tenants[tenant] = true
  if job and job ~= '' then
    local key = jobprefix .. job .. JOB_KEYS.usage
    add_usage(sums, key, u)
    sums.jobs[key] = true
  end
end

-- Counts each group's tasks that moved: its sums once when all of them moved under one job
-- and tenant (a batch of one job: no parsing per task), else each task's own values.
local function count_groups(sums, groups, jobprefix, usage_prefix)
  for _, group in ipairs(groups) do
    local moved = #group.owns
    if moved > 0 and moved == group.n and not group.mixed then
      local u = {dims = group.dims, values = group.values}
      count_usage(sums, group.jobs[1] or nil, group.tenants[1] or nil, u, jobprefix, usage_prefix)
    else
      for k = 1, moved do
        local u = {dims = group.dims, values = own_values(group.owns[k])}
        count_usage(sums, group.jobs[k] or nil, group.tenants[k] or nil, u, jobprefix, usage_prefix)
      end
    end
  end
end

local function write_sums(sums, usage_tenants, ttl)
  for _, key in ipairs(sums.keys) do
    for field, n in pairs(sums.fields[key]) do
      if n ~= 0 then redis.call('HINCRBY', key, field, string.format('%d', n)) end
    end
    if sums.jobs[key] then redis.call('EXPIRE', key, ttl) end
  end
  for tenant in pairs(sums.tenants) do redis.call('SADD', usage_tenants, tenant) end
end

-- rate: one request of a caller against its token bucket, shared by every API process.
-- KEYS[1] the caller's bucket (hash: tokens, at). ARGV: refill per second, burst. Returns the
-- seconds until a token is free ('0': allowed, and one was spent). An idle bucket is full:
-- it expires once it would have refilled. Called with a call id: a retry spends nothing more.
function commands.rate()
  local t, per_s, burst = now(), tonumber(ARGV[2]), tonumber(ARGV[3])
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  local tokens = tonumber(b[1] or '') or burst
  local at = tonumber(b[2] or '') or t
  tokens = math.min(burst, tokens + math.max(0, t - at) * per_s)
  local wait = 0
  if tokens >= 1 then
    tokens = tokens - 1
  elseif per_s > 0 then
    wait = (1 - tokens) / per_s
  else
    wait = 3600
  end
  redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'at', stamp(t))
  local idle = per_s > 0 and math.ceil(burst / per_s) + 1 or 3600
  redis.call('EXPIRE', KEYS[1], idle)
  return string.format('%.6f', wait)
end
