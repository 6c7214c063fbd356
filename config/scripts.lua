-- vlmq's Redis scripts: one source, one dispatch. ARGV[1] names the command; the rest of
-- ARGV and KEYS are the command's own (documented above each one). Loaded twice by
-- config/scripts.py, once refused under maxmemory and once with allow-oom (the commands that
-- settle, give back or renew work must run when Redis is full, or a full fleet could never
-- drain); a script with a shebang is refused or run whole, never half-applied.
--
-- Rules: every key arrives in KEYS; a key learned while running (the hash of a task just
-- pulled, a task's job) is a prefix from Keys (ARGV) plus the id. Time is Redis's own (now()),
-- so a worker with a skewed clock neither takes live work nor keeps dead work. A delivery's
-- token is the task's delivery count at pull (the hash's 'deliveries'); a holder whose token
-- is no longer the count was superseded and every fenced write of it is refused.

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function stamp(t) return string.format('%.6f', t) end

local function csv_set(text)
  local set = {}
  for item in string.gmatch(text or '', '([^,]+)') do set[item] = true end
  return set
end

-- The task id of a raw message, as the worker's Python side will use it. A plain id only
-- (the pattern of config/schemas.py TASK_ID_PATTERN); anything else gets an id of its own
-- so the message still fails alone, with a status and a result.
local function plain(id)
  return type(id) == 'string' and #id >= 1 and #id <= 128
    and string.match(id, '^[%w_.%-]+$') ~= nil
end

-- The header's "id" as a JSON writer puts it (compact, or with Python's ", " separators).
local ID_KEYS = {'"id":"', '"id": "'}

local function task_id(raw)
  -- The body is base64, so the only "id" key in clear text is the header's (Celery writes
  -- headers before properties). A plain find first: the pattern below tries every position
  -- of the ~1 KB body before the headers (measured 9.6 us a message, a plain find ~0.3).
  local first
  for _, key in ipairs(ID_KEYS) do
    local _, e = string.find(raw, key, 1, true)
    if e and (not first or e < first) then first = e end
  end
  if first then
    local id = string.match(raw, '^([^"\\]*)"', first + 1)
    if plain(id) then return id end
  end
  local id = string.match(raw, '[{,]%s*"id"%s*:%s*"([^"\\]*)"')
  if plain(id) then return id end
  local ok, msg = pcall(cjson.decode, raw)
  if ok and type(msg) == 'table' and type(msg.headers) == 'table'
     and plain(msg.headers.id) then
    return msg.headers.id
  end
  return 'invalid-' .. redis.sha1hex(raw)
end

-- status -------------------------------------------------------------------------------------

-- The submitters still adding to a job are fields 'sub:<submission>' = lease deadline of its
-- hash (a crashed submitter's lapses). Drops the lapsed ones; returns the latest live deadline.
local function live_submitters(jobkey, t)
  local latest = nil
  local fields = redis.call('HGETALL', jobkey)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 4) == 'sub:' then
      local deadline = tonumber(fields[i + 1]) or 0
      if deadline <= t then
        redis.call('HDEL', jobkey, fields[i])
      elseif not latest or deadline > latest then
        latest = deadline
      end
    end
  end
  return latest
end

-- A sealed job (a submission completed) whose every task is terminal and that no submitter is
-- still adding to is finished once: finished_at is set and an event queued for its webhook.
-- (Every submitter's lease is also in the submitting zset, so a job whose last submitter
-- crashed is looked at again when that lease lapses: reap_submitters.)
local function finish_check(jobkey, job, t, events)
  local f = redis.call('HMGET', jobkey, 'sealed', 'total', 'succeeded', 'failed',
                       'cancelled', 'expired', 'finished_at')
  if f[1] ~= '1' or f[7] then return end
  local done = (tonumber(f[3]) or 0) + (tonumber(f[4]) or 0)
             + (tonumber(f[5]) or 0) + (tonumber(f[6]) or 0)
  if done < (tonumber(f[2]) or 0) then return end
  if live_submitters(jobkey, t) then return end
  redis.call('HSET', jobkey, 'finished_at', stamp(t))
  redis.call('LPUSH', events, job)
end

-- Calls `command key item...` over `items` in slices (Lua's stack bounds one call's
-- arguments): one call per slice instead of one per item.
local function call_many(command, key, items, width)
  local step = 960 * width
  for i = 1, #items, step do
    redis.call(command, key, unpack(items, i, math.min(i + step - 1, #items)))
  end
end

-- The job counter changes and finish checks of one script call, applied once per job at its
-- end: a batch of 64 tasks of one job costs a few counter writes, not 128.
-- quotas ---------------------------------------------------------------------------------
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

-- The job counter changes and finish checks of one script call, applied once per job at its
-- end: a batch of 64 tasks of one job costs a few counter writes, not 128.
local function new_tally() return {deltas = {}, mirror = {}, jobs = {}} end

-- `own`: the task counts in a quota of its own (not through its job's).
local function count_move(tally, job, from, to, own)
  local d = tally.deltas[job]
  if not d then
    d = {}
    tally.deltas[job] = d
    tally.mirror[job] = 0
    tally.jobs[#tally.jobs + 1] = job
  end
  if from ~= '' then d[from] = (d[from] or 0) - 1 end
  d[to] = (d[to] or 0) + 1
  if not own then
    if from == 'queued' then tally.mirror[job] = tally.mirror[job] - 1 end
    if to == 'queued' then tally.mirror[job] = tally.mirror[job] + 1 end
  end
end

local function apply_tally(tally, jobprefix, t, events)
  for _, job in ipairs(tally.jobs) do
    local jobkey = jobprefix .. job
    for state, n in pairs(tally.deltas[job]) do
      if state == 'queued' then
        queued_by(jobkey, n, tally.mirror[job])
      elseif n ~= 0 then
        redis.call('HINCRBY', jobkey, state, n)
      end
    end
    finish_check(jobkey, job, t, events)
  end
end

-- A fed bulk task that ends is folded into its job's claims hash and its own hash deleted:
-- a finished task then costs one short hash field (its claim -> 'submission code[delivery]'),
-- not a key of its own (measured: >= 180 B per key with a TTL, ~90 B per field). The code is
-- the terminal state's letter; the delivery is there when a result object was written
-- (result_key names it), and a task that ended without one keeps its custom_id instead.
local FOLDED = {succeeded = 'S', failed = 'F', cancelled = 'C', expired = 'E'}

-- The task hash fields a move reads, once (fenced_move): h[1..9].
local MOVE_FIELDS = {'state', 'deliveries', 'job_id', 'claim', 'custom_id', 'attempts',
                     'quota', 'est', 'tenant'}

local function fold(key, h, m, jobkey)
  local claims = jobkey .. ':custom_ids'
  local live = redis.call('HGET', claims, h[4])
  if live then
    local stored = false
    for i = 1, #m.fields - 1, 2 do
      if m.fields[i] == 'result_url' then stored = true end
    end
    local record = string.match(live, '^%S+') .. ' ' .. FOLDED[m.new]
    if stored then
      record = record .. h[2]
    else
      record = record .. ' ' .. (h[5] or '')
    end
    redis.call('HSET', claims, h[4], record)
  end
  redis.call('DEL', key)
end

-- One task's move: allowed from-states ("," separated, "-" = no state yet); `m.stampf` (if not
-- '') gets Redis's time; the job's counters change in `tally`. `h` is the task hash's
-- MOVE_FIELDS, read once by fenced_move. Returns previous state, moved (1|0).
local function move(key, m, h, jobprefix, t, tally)
  local current = h[1] or ''
  local ok = false
  for from in string.gmatch(m.allowed, '([^,]+)') do
    if (from == '-' and current == '') or from == current then ok = true end
  end
  if not ok then return current, 0 end
  local fields = m.fields
  local job = h[3]
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'job_id' then job = fields[i + 1] end  -- set by this very move
  end
  local in_job = job and job ~= ''
  if in_job and h[4] and FOLDED[m.new] then
    fold(key, h, m, jobprefix .. job)  -- its hash goes: no point writing it
  else
    if m.stampf ~= '' then fields[#fields + 1] = m.stampf; fields[#fields + 1] = stamp(t) end
    if m.attempt then
      fields[#fields + 1] = 'attempts'
      fields[#fields + 1] = tostring((tonumber(h[6]) or 0) + 1)
    end
    fields[#fields + 1] = 'state'
    fields[#fields + 1] = m.new
    redis.call('HSET', key, unpack(fields))
  end
  if current == 'queued' and m.new ~= 'queued' and h[7] then
    quota_add(h[7], -1, -(tonumber(h[8] or '0') or 0))  -- it counted in a quota of its own
  end
  if in_job and current ~= m.new then count_move(tally, job, current, m.new, h[7] and true or false) end
  return current, 1
end

-- Reads one task's move from ARGV at `at`: new state, allowed from-states, token, stamp
-- field, whether it counts an attempt ('1'), then a count of field/value pairs and the pairs.
-- Returns the move and the next `at`.
local function read_move(at)
  local m = {new = ARGV[at], allowed = ARGV[at + 1], token = ARGV[at + 2],
             stampf = ARGV[at + 3], attempt = ARGV[at + 4] == '1', fields = {}}
  local n = tonumber(ARGV[at + 5])
  for j = 1, 2 * n do m.fields[j] = ARGV[at + 5 + j] end
  return m, at + 6 + 2 * n
end

-- A fenced move: refused for a holder whose delivery `m.token` is no longer the task's (''
-- = unfenced: producers); counts an attempt when it moves.
-- Returns previous state, moved (1|0), held (1|0), and the hash's MOVE_FIELDS before it.
local function fenced_move(key, m, jobprefix, t, tally)
  local h = redis.call('HMGET', key, unpack(MOVE_FIELDS))
  if m.token ~= '' and h[2] ~= m.token then
    return h[1] or '', 0, 0, h
  end
  local previous, moved = move(key, m, h, jobprefix, t, tally)
  return previous, moved, 1, h
end

-- in flight -----------------------------------------------------------------------------------
-- The bookkeeping of held messages, always KEYS[1..5] of these commands: inflight hash (id ->
-- raw message), leases zset (id -> deadline), origin-queue hash, origin-active hash (the
-- tenant's fair-share zset of a job list the message came from), job-list depth hash (a
-- class's active-tenants zset -> messages waiting in its job lists: a class's queue depth
-- without visiting every job).

local function forget_all(ids)
  if #ids == 0 then return end
  call_many('HDEL', KEYS[1], ids, 1)
  call_many('ZREM', KEYS[2], ids, 1)
  call_many('HDEL', KEYS[3], ids, 1)
  call_many('HDEL', KEYS[4], ids, 1)
end

local function forget(id) forget_all({id}) end

-- Fair share is two-level: a class's active-tenants zset holds each tenant's active-jobs zset,
-- which holds that tenant's job lists. A tenant's zset is named the class's plus ':<tenant>'
-- (Keys.active_jobs), so the class's is found from it; the depth hash counts per class.
local function class_of(active) return string.match(active, '^(.*):[^:]+$') end

-- A job list that got messages is a member of its tenant's zset, and the tenant of its class's.
-- A fair-share set named before tenants (a class's own set, holding job lists) is read as
-- the default tenant's: a fleet upgraded with work in flight requeues it there.
local LEGACY_SUFFIX = ':active'
local function tenant_set(active)
  if string.sub(active, -#LEGACY_SUFFIX) == LEGACY_SUFFIX then return active .. ':default' end
  return active
end

-- `depth`: the job-list depth hash.
local function activate(list, active, n, depth)
  active = tenant_set(active)
  local class = class_of(active)
  redis.call('ZADD', active, 'NX', 0, list)
  redis.call('ZADD', class, 'NX', 0, active)
  redis.call('HINCRBY', depth, class, n)
end

-- Put a held message back at the head of its queue (RPUSH: the next one popped).
local function requeue(id)
  local raw = redis.call('HGET', KEYS[1], id)
  local queue = redis.call('HGET', KEYS[3], id)
  local moved = 0
  if raw and queue then
    redis.call('RPUSH', queue, raw)
    local active = redis.call('HGET', KEYS[4], id)
    if active then activate(queue, active, 1, KEYS[5]) end
    moved = 1
  end
  forget(id)
  return moved
end

local commands = {}

-- transition: producers and the worker's start. KEYS[1] events list, KEYS[2..] task hashes.
-- ARGV: job key prefix, then per task a move (read_move). Returns {previous, moved, held} per
-- task; a fenced-out move is not applied ({previous, 0, 0}).
function commands.transition()
  local t, replies, at, tally = now(), {}, 3, new_tally()
  for i = 2, #KEYS do
    local m
    m, at = read_move(at)
    local previous, moved, held = fenced_move(KEYS[i], m, ARGV[2], t, tally)
    replies[i - 1] = {previous, moved, held}
  end
  apply_tally(tally, ARGV[2], t, KEYS[1])
  return replies
end

-- usage ----------------------------------------------------------------------------------
-- What settled tasks used, counted once per task in the step that settles it (a fenced-out
-- holder's result counts nothing): per tenant (Keys.usage, the tenants in Keys.usage_tenants)
-- and per job (Keys.job_usage, with the job's ttl), fields '<model>|<modality>|<metric>'.
local USAGE_METRICS = {'prompt_tokens', 'completion_tokens', 'requests', 'model_us'}

-- Reads one task's usage from ARGV at `at`: '' (none) or dims then the four metrics.
local function read_usage(at)
  if ARGV[at] == '' then return nil, at + 1 end
  local u = {dims = ARGV[at], values = {}}
  for j = 1, #USAGE_METRICS do u.values[j] = tonumber(ARGV[at + j]) or 0 end
  return u, at + 1 + #USAGE_METRICS
end

-- A settle call's usage, summed per key and field and written once at its end: a batch of 64
-- tasks of one job and model costs 8 writes, not 512. `sums.keys` lists keys in first-seen
-- order; `sums.jobs` the job usage keys (they get the job's ttl).
local function new_sums() return {keys = {}, fields = {}, jobs = {}, tenants = {}, of = {}} end

local function add_usage(sums, key, u)
  local fields = sums.fields[key]
  if not fields then
    fields = {}
    sums.fields[key] = fields
    sums.keys[#sums.keys + 1] = key
  end
  for j, metric in ipairs(USAGE_METRICS) do
    local field = u.dims .. '|' .. metric
    fields[field] = (fields[field] or 0) + u.values[j]
  end
end

-- `h`: the task hash's MOVE_FIELDS as read before its move (the hash may be gone: folded).
-- ARGV[3] usage key prefix.
local function count_usage(sums, h, u, jobprefix)
  local job = h[3]
  local tenant = h[9]
  if not tenant and job then
    tenant = sums.of[job] or redis.call('HGET', jobprefix .. job, 'tenant') or 'default'
    sums.of[job] = tenant  -- a job's tenant, read once per call
  end
  tenant = tenant or 'default'
  add_usage(sums, ARGV[3] .. tenant, u)
  sums.tenants[tenant] = true
  if job and job ~= '' then
    local key = jobprefix .. job .. ':usage'
    add_usage(sums, key, u)
    sums.jobs[key] = true
  end
end

-- ARGV[4] usage-tenants set, ARGV[5] job ttl.
local function write_sums(sums)
  for _, key in ipairs(sums.keys) do
    for field, n in pairs(sums.fields[key]) do
      if n ~= 0 then redis.call('HINCRBY', key, field, string.format('%d', n)) end
    end
    if sums.jobs[key] then redis.call('EXPIRE', key, tonumber(ARGV[5])) end
  end
  for tenant in pairs(sums.tenants) do redis.call('SADD', ARGV[4], tenant) end
end

-- settle: terminal transitions and acknowledgements of held tasks, one step (allow-oom).
-- KEYS[1..5] bookkeeping, KEYS[6] events list, KEYS[7..] task hashes. ARGV: job key prefix,
-- usage key prefix, usage-tenants set, job ttl seconds, then per task its id, a move and its
-- usage (read_usage). Returns {previous, moved, held} per task: a holder that was fenced out
-- (held 0) changes nothing, and its result never becomes the task's (nor counts in usage).
function commands.settle()
  local t, replies, at, tally, settled = now(), {}, 6, new_tally(), {}
  local sums = new_sums()
  for i = 7, #KEYS do
    local id = ARGV[at]
    local m, u
    m, at = read_move(at + 1)
    u, at = read_usage(at)
    local previous, moved, held, h = fenced_move(KEYS[i], m, ARGV[2], t, tally)
    if held == 1 then settled[#settled + 1] = id end
    if u and held == 1 and moved == 1 then count_usage(sums, h, u, ARGV[2]) end
    replies[i - 6] = {previous, moved, held}
  end
  forget_all(settled)
  write_sums(sums)
  apply_tally(tally, ARGV[2], t, KEYS[6])
  return replies
end

-- pull: move up to N messages of one class into this worker's leases.
-- KEYS[1..5] bookkeeping, KEYS[6] the class's active-tenants zset, KEYS[7..] its fixed lists:
-- the interactive lane (priority order), then the plain bulk queue (priority order).
-- ARGV: max count, lease seconds, task key prefix, number of interactive lists, terminal
-- states (csv), task ttl seconds (a plain send_task's message gets its hash here, and the
-- hash its ttl). The interactive lane is drained first; the rest is shared round robin, first
-- across tenants, then across each tenant's jobs: an equal share per member per round (one
-- each when there are more members than room), least recently served first. The plain bulk
-- queue (any Celery producer's messages) is one more member at the tenant level. A member
-- served goes to the back of its zset, so with T active tenants and batches of B every
-- tenant is served within ceil(T / B) pulls whatever its number of jobs, and a pull costs
-- O(B log J). Lists are popped several messages at a time and the bookkeeping written once
-- per pull: the per-message cost is what caps a Redis.
-- A copy of a task that is already terminal, or that a live holder has, is dropped (one run
-- per task while its holder lives); a holder whose lease ran out is fenced out by the new
-- delivery's token. Returns {now, dropped, rows}; a row is {id, raw, token, status fields}.
function commands.pull()
  local t = now()
  local limit, deadline = tonumber(ARGV[2]), t + tonumber(ARGV[3])
  local prefix, terminal, ttl = ARGV[4], csv_set(ARGV[6]), tonumber(ARGV[7])
  local out, dropped, taken = {}, 0, {}
  local inflight, leases, origins, actives = {}, {}, {}, {}
  -- Pops up to n messages of one list into this holder's rows; returns how many it popped.
  local function take(list, active, n)
    local raws = redis.call('RPOP', list, n)
    if not raws then return 0 end
    if active then redis.call('HINCRBY', KEYS[5], KEYS[6], -#raws) end
    for _, raw in ipairs(raws) do
      local id = task_id(raw)
      local key = prefix .. id
      -- The status fields the worker decides on, read here to save it a round trip.
      local status = redis.call('HMGET', key, 'state', 'attempts', 'job_id', 'queued_at',
                                'expires_at', 'tenant')
      local held_until = tonumber(redis.call('ZSCORE', KEYS[2], id))
      -- A job list's task always has a hash until it ends (then it is folded, or expired
      -- with its job): a copy without one is of a task that already ended.
      local ended = active and not status[1]
      if ended or taken[id] or terminal[status[1] or ''] or (held_until and held_until > t) then
        dropped = dropped + 1
      else
        taken[id] = true
        inflight[#inflight + 1] = id
        inflight[#inflight + 1] = raw
        leases[#leases + 1] = deadline
        leases[#leases + 1] = id
        origins[#origins + 1] = id
        origins[#origins + 1] = list
        -- (an origin-active entry never outlives its in-flight entry: forget() drops both)
        if active then
          actives[#actives + 1] = id
          actives[#actives + 1] = active
        end
        local n = redis.call('HINCRBY', key, 'deliveries', 1)
        if not active then redis.call('EXPIRE', key, ttl, 'NX') end
        out[#out + 1] = {id, raw, n, status}
      end
    end
    return #raws
  end
  local first = 7 + tonumber(ARGV[5])
  for i = 7, first - 1 do
    while #out < limit and take(KEYS[i], false, limit - #out) > 0 do end
  end
  local plain_lists = {}
  for i = first, #KEYS do plain_lists[#plain_lists + 1] = KEYS[i] end
  -- A member served goes to the back of its zset (score: one more than the last).
  local function served(zset, member)
    local last = redis.call('ZRANGE', zset, -1, -1, 'WITHSCORES')
    redis.call('ZADD', zset, tonumber(last[2]) + 1, member)
  end
  -- One round over a tenant's jobs (least recently served first) with `room` to fill: an
  -- equal share each, one each when it has more jobs than room. Returns what it took.
  local function take_tenant(active, room)
    local got = 0
    local jobs = redis.call('ZRANGE', active, 0, room - 1)
    local share = math.ceil(room / math.max(#jobs, 1))
    for _, list in ipairs(jobs) do
      if got >= room then break end
      local n = take(list, active, math.min(share, room - got))
      if n > 0 then
        got = got + n
        served(active, list)
      else
        redis.call('ZREM', active, list)
      end
    end
    return got
  end
  local tenants = KEYS[6]
  local progress = true
  while #out < limit and progress do
    progress = false
    local want = limit - #out
    local members = redis.call('ZRANGE', tenants, 0, want - 1)
    -- An equal share per tenant this round (the plain bulk queue, messages of any Celery
    -- producer, is one more): one each when there are more tenants than room.
    local share = math.ceil(want / (#members + 1))
    for _, list in ipairs(plain_lists) do
      if take(list, false, share) > 0 then progress = true break end
    end
    for _, active in ipairs(members) do
      if #out >= limit then break end
      if redis.call('TYPE', active).ok == 'list' then
        -- A job list put here before tenants: it becomes the default tenant's.
        redis.call('ZREM', tenants, active)
        redis.call('ZADD', tenant_set(tenants), 'NX', 0, active)
        active = tenant_set(tenants)
        redis.call('ZADD', tenants, 'NX', 0, active)
      end
      if take_tenant(active, math.min(share, limit - #out)) > 0 then
        progress = true
        served(tenants, active)
      elseif redis.call('EXISTS', active) == 0 then
        redis.call('ZREM', tenants, active)  -- none of its jobs has messages left
      end
    end
  end
  if #out > 0 then
    call_many('HSET', KEYS[1], inflight, 2)
    call_many('ZADD', KEYS[2], leases, 2)
    call_many('HSET', KEYS[3], origins, 2)
    if #actives > 0 then call_many('HSET', KEYS[4], actives, 2) end
  end
  return {stamp(t), dropped, out}
end

-- renew: extend this holder's leases (allow-oom: renewing never needs memory).
-- KEYS[1] leases. ARGV: lease seconds, task key prefix, then id, token pairs.
-- Returns the ids this holder no longer holds (reaped, or delivered again elsewhere).
function commands.renew()
  local deadline, prefix, lost = now() + tonumber(ARGV[2]), ARGV[3], {}
  for i = 4, #ARGV, 2 do
    local id, token = ARGV[i], ARGV[i + 1]
    if redis.call('ZSCORE', KEYS[1], id)
       and redis.call('HGET', prefix .. id, 'deliveries') == token then
      redis.call('ZADD', KEYS[1], 'XX', deadline, id)
    else
      lost[#lost + 1] = id
    end
  end
  return lost
end

-- Applies `fn` to each id of ARGV's (id, token) pairs, from ARGV[3], that this holder still
-- holds (ARGV[2]: task key prefix); returns the sum of what it returns.
local function for_held(fn)
  local prefix, total = ARGV[2], 0
  for i = 3, #ARGV, 2 do
    if redis.call('HGET', prefix .. ARGV[i], 'deliveries') == ARGV[i + 1] then
      total = total + fn(ARGV[i])
    end
  end
  return total
end

-- ack: forget held messages that will not run (their task ended while they were held)
-- (allow-oom). KEYS[1..5] bookkeeping. ARGV: task key prefix, then id, token pairs.
function commands.ack()
  return for_held(function(id) forget(id) return 1 end)
end

-- give_back: return held messages to their queues now (shutdown, not started) (allow-oom).
-- KEYS[1..5] bookkeeping. ARGV: task key prefix, then id, token pairs (only this holder's).
function commands.give_back()
  return for_held(requeue)
end

-- reap: put back messages whose holder stopped renewing (it died) (allow-oom).
-- KEYS[1..5] bookkeeping. ARGV: most to move.
function commands.reap()
  local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now(), 'LIMIT', 0, tonumber(ARGV[2]))
  local moved = 0
  for _, id in ipairs(ids) do moved = moved + requeue(id) end
  return moved
end

-- events: finished-job events for webhooks, taken under a lease so a sender that stops or
-- dies never loses one. KEYS[1] events list, KEYS[2] leased zset (job id -> deadline).

-- take_events: ARGV: most to take, lease seconds. Returns the job ids taken.
function commands.take_events()
  local deadline, taken = now() + tonumber(ARGV[3]), {}
  for _ = 1, tonumber(ARGV[2]) do
    local job = redis.call('RPOP', KEYS[1])
    if not job then break end
    redis.call('ZADD', KEYS[2], deadline, job)
    taken[#taken + 1] = job
  end
  return taken
end

-- renew_event: ARGV: job id, lease seconds (allow-oom).
function commands.renew_event()
  return redis.call('ZADD', KEYS[2], 'XX', 'CH', now() + tonumber(ARGV[3]), ARGV[2])
end

local function return_events(ids)
  local returned = 0
  for _, job in ipairs(ids) do
    if redis.call('ZREM', KEYS[2], job) == 1 then
      redis.call('RPUSH', KEYS[1], job)
      returned = returned + 1
    end
  end
  return returned
end

-- return_events: a sender shutting down gives back what it had not started (allow-oom).
-- ARGV[2..]: job ids.
function commands.return_events()
  local ids = {}
  for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
  return return_events(ids)
end

-- reap_events: put back events whose sender died (their lease ran out) (allow-oom).
function commands.reap_events()
  return return_events(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now(), 'LIMIT', 0, 1000))
end

-- This submitter is adding to the job until `lease` (its field in the job hash), and the
-- submitting zset looks at the job again once its latest submitter's lease lapses.
local function hold_submitter(jobkey, job, sub, lease, submitting)
  redis.call('HSET', jobkey, 'sub:' .. sub, stamp(lease))
  redis.call('ZADD', submitting, 'GT', lease, job)
end

-- open_job: create (or reopen, for a resubmission) a job; unsealed until submitted, and not
-- finished while this submitter holds its lease (renewed by every chunk it submits).
-- KEYS[1] job hash, KEYS[2] expiry zset, KEYS[3] submitting zset (job id -> latest submitter
-- lease), KEYS[4] job number counter. ARGV: job id, name, webhook url, completion window
-- seconds ('' none), ttl seconds, submission id, submitter lease seconds, job-number key
-- prefix, tenant, the tenant's quota hash. The window starts at the first submission.
-- Returns the job's number; a job of another tenant is not reopened (an error reply 'OWNED').
function commands.open_job()
  local t, key = now(), KEYS[1]
  local owner = redis.call('HGET', key, 'tenant')
  if owner and owner ~= ARGV[10] then return redis.error_reply('OWNED') end
  if not owner then redis.call('HSET', key, 'tenant', ARGV[10], 'quota', ARGV[11]) end
  redis.call('HSETNX', key, 'created_at', stamp(t))
  -- The job's number: fed tasks are named '<number>.<claim>.<submission>', and the number's
  -- key names the job, so a folded task's status is found from its id alone.
  local seq = redis.call('HGET', key, 'seq')
  if not seq then
    seq = tostring(redis.call('INCR', KEYS[4]))
    redis.call('HSET', key, 'seq', seq)
  end
  redis.call('SET', ARGV[9] .. seq, ARGV[2], 'EX', tonumber(ARGV[6]))
  redis.call('HSET', key, 'job_id', ARGV[2], 'sealed', '0')
  hold_submitter(key, ARGV[2], ARGV[7], t + tonumber(ARGV[8]), KEYS[3])
  redis.call('HDEL', key, 'finished_at')
  if ARGV[3] ~= '' then redis.call('HSET', key, 'name', ARGV[3]) end
  if ARGV[4] ~= '' then redis.call('HSET', key, 'webhook_url', ARGV[4]) end
  if ARGV[5] ~= '' then
    local deadline = t + tonumber(ARGV[5])
    if redis.call('HSETNX', key, 'expires_at', stamp(deadline)) == 1 then
      redis.call('ZADD', KEYS[2], 'NX', deadline, ARGV[2])
    end
  end
  redis.call('EXPIRE', key, tonumber(ARGV[6]))
  return seq
end

-- seal: this submission is complete (or, complete '0', it stopped without completing: it no
-- longer holds the job open, and does not seal it); the job may now finish, once no other
-- submitter is adding. KEYS[1] job hash, KEYS[2] events list. ARGV: job id, lines, submission
-- id, complete ('1' | '0'), invalid lines.
function commands.seal()
  redis.call('HDEL', KEYS[1], 'sub:' .. ARGV[4])
  if ARGV[5] == '1' then
    redis.call('HSET', KEYS[1], 'sealed', '1', 'lines', ARGV[3], 'line_errors', ARGV[6])
  end
  finish_check(KEYS[1], ARGV[2], now(), KEYS[2])
  return 1
end

-- reap_submitters: look again at jobs whose latest submitter lease lapsed (a submitter that
-- crashed before sealing must not keep a finished job open forever).
-- KEYS[1] submitting zset, KEYS[2] events list. ARGV: job key prefix, most to look at.
function commands.reap_submitters()
  local t = now()
  local jobs = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t, 'LIMIT', 0, tonumber(ARGV[3]))
  for _, job in ipairs(jobs) do
    redis.call('ZREM', KEYS[1], job)
    local jobkey = ARGV[2] .. job
    if redis.call('EXISTS', jobkey) == 1 then
      live_submitters(jobkey, t)
      finish_check(jobkey, job, t, KEYS[2])
    end
  end
  return #jobs
end

-- Collects one message for a class pair's list (KEYS[base + 2*pair]); push_all pushes each
-- list's in one call (in order: the first collected is popped first) and, when the lists are
-- job lists (`job_lists`), counts them in each pair's tenant active-jobs zset (KEYS[base + 2*pair + 1]).
local function push(pair, message, pushed)
  local list = pushed[pair]
  if not list then
    list = {}
    pushed[pair] = list
  end
  list[#list + 1] = message
end

local function push_all(base, pushed, depth, job_lists)
  for pair, messages in pairs(pushed) do
    call_many('LPUSH', KEYS[base + 2 * pair], messages, 1)
    if job_lists then activate(KEYS[base + 2 * pair], KEYS[base + 2 * pair + 1], #messages, depth) end
  end
end

-- The position of `name` among the status field names (1-based), or nil.
local function field_index(names, name)
  for i, n in ipairs(names) do if n == name then return i end end
  return nil
end

-- Reads the status field names from ARGV at `at`: a count F, then F names.
local function read_names(at)
  local names, nf = {}, tonumber(ARGV[at])
  for i = 1, nf do names[i] = ARGV[at + i] end
  return names, at + nf + 1
end

-- A new queued task's hash: its status fields (values '' are left unset) on Redis's clock
-- (created when queued: queued_at says both; each field costs the listpack a scan).
local function create_task(key, names, at, t, ttl)
  local fields = {'queued_at', stamp(t)}
  for j = 1, #names do
    local value = ARGV[at + j - 1]
    if value ~= '' then
      fields[#fields + 1] = names[j]
      fields[#fields + 1] = value
    end
  end
  redis.call('HSET', key, 'state', 'queued', unpack(fields))
  redis.call('EXPIRE', key, ttl)
end

-- submit: tasks of a job whose ids are the caller's (Client.submit_many), all or nothing: each
-- gets its status hash, its message pushed, its id on the job's task list, and is counted.
-- KEYS[1] job hash, KEYS[2] job task list, KEYS[3] submitting zset, KEYS[4] job-list depth
-- hash, then per modality class its job list and its tenant's active-jobs zset (pairs), then one task hash per
-- task. ARGV: job id, ttl seconds, submission id, submitter lease seconds, task key prefix,
-- number of class pairs, then F and the F status field names; then per task: class pair
-- (1-based), the F field values ('' unset), message. Returns the number enqueued.
function commands.submit()
  local t = now()
  local jobkey, tasks = KEYS[1], KEYS[2]
  local job, ttl, sub, prefix = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[6]
  local pairs_n = tonumber(ARGV[7])
  local names, at = read_names(8)
  local first_task, pushed, ids, tokens = 5 + 2 * pairs_n, {}, {}, 0
  local est_at = field_index(names, 'est')
  for i = first_task, #KEYS do
    local pair = tonumber(ARGV[at])
    create_task(KEYS[i], names, at + 1, t, ttl)
    if est_at then tokens = tokens + (tonumber(ARGV[at + est_at]) or 0) end
    push(pair, ARGV[at + 1 + #names], pushed)
    ids[#ids + 1] = string.sub(KEYS[i], #prefix + 1)
    at = at + 2 + #names
  end
  push_all(3, pushed, KEYS[4], true)
  call_many('RPUSH', tasks, ids, 1)
  local added = #KEYS - first_task + 1
  redis.call('HINCRBY', jobkey, 'total', added)
  admit(jobkey, added, tokens)
  hold_submitter(jobkey, job, sub, t + tonumber(ARGV[5]), KEYS[3])
  for _, k in ipairs({jobkey, tasks}) do redis.call('EXPIRE', k, ttl) end
  return added
end

-- feeds: a bulk job's input lines, validated and staged as one object in the store, enter
-- Redis a window at a time. A feed (hash: job, input, cursor, left, lane) is counted in its job
-- from the start (total, queued and 'unfed' include every line not yet fed), so the job reads
-- the right counts and cannot finish before its last line ran; the feeds zset (feed id ->
-- lease deadline, 0 when free) is what feeders take work from. A feed id is the job's number
-- and the submission id ('<number>.<submission>'); the job hash lists its feeds ('feed:<id>').

-- register_feed: KEYS[1] job hash, KEYS[2] feed hash, KEYS[3] feeds zset. ARGV: job id,
-- feed id, input key, lines, lane, ttl seconds, input size (bytes), lease seconds (the feed
-- starts leased to the caller: the submitter feeds the first window), estimated tokens of
-- its lines (0: not estimated).
function commands.register_feed()
  local lines, ttl = tonumber(ARGV[5]), tonumber(ARGV[7])
  if lines == 0 then return 0 end
  redis.call('HSET', KEYS[2], 'job', ARGV[2], 'input', ARGV[4], 'cursor', '0', 'left', lines,
             'lane', ARGV[6], 'size', ARGV[8])
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('ZADD', KEYS[3], now() + tonumber(ARGV[9]), ARGV[3])
  redis.call('HSET', KEYS[1], 'feed:' .. ARGV[3], '1')
  for _, field in ipairs({'total', 'unfed'}) do redis.call('HINCRBY', KEYS[1], field, lines) end
  admit(KEYS[1], lines, tonumber(ARGV[10] or '0') or 0)
  return lines
end

-- take_feeds: KEYS[1] feeds zset. ARGV: lease seconds, most to take. Feeds whose lease is free
-- or lapsed (a feeder that died) are leased to the caller. Returns their feed ids.
function commands.take_feeds()
  local t = now()
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t, 'LIMIT', 0, tonumber(ARGV[3]))
  for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], 'XX', t + tonumber(ARGV[2]), id) end
  return ids
end

-- release_feed: KEYS[1] feeds zset. ARGV: feed id. The feeder is done with it for now.
function commands.release_feed()
  return redis.call('ZADD', KEYS[1], 'XX', 0, ARGV[2])
end

-- A feed that ended (fed to its end, or dropped) leaves its job and the feeds zset.
local function forget_feed(jobkey, feedkey, feeds, feed)
  redis.call('DEL', feedkey)
  redis.call('ZREM', feeds, feed)
  redis.call('HDEL', jobkey, 'feed:' .. feed)
end

-- The rest of a feed will not be fed (its job was cancelled or expired): its lines leave
-- queued and unfed for `state` in one step, and the feed is gone.
local function drop_feed(jobkey, feedkey, feeds, job, feed, state, t, events)
  local f = redis.call('HMGET', feedkey, 'left', 'input', 'cursor')
  local left = tonumber(f[1] or '0')
  if left > 0 then
    queued_by(jobkey, -left, -left)
    redis.call('HINCRBY', jobkey, 'unfed', -left)
    redis.call('HINCRBY', jobkey, state, left)
    -- Where the lines that never ran are (the job's error file lists them from there).
    redis.call('HSET', jobkey, 'dropped:' .. feed, f[2] .. ' ' .. f[3] .. ' ' .. state)
  end
  forget_feed(jobkey, feedkey, feeds, feed)
  finish_check(jobkey, job, t, events)
  return left
end

-- drop_feed: KEYS[1] job hash, KEYS[2] feed hash, KEYS[3] feeds zset, KEYS[4] events list.
-- ARGV: job id, feed id, state (cancelled | expired). Returns the lines dropped.
function commands.drop_feed()
  return drop_feed(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3], ARGV[4], now(), KEYS[4])
end

-- feed: one chunk of a feed's lines into Redis, exactly once: applied only if the feed's
-- cursor is still where the caller read from (another feeder that got there first, or a
-- crashed one's retry, changes nothing), and the cursor moves in the same step. A job that
-- was cancelled or is past its window drops the rest of the feed instead. Per line: a
-- custom_id names one live task per job (its claim, a digest of it, is a field of the claims
-- hash: 'submission' while its task lives, then its folded record); a claim whose task is
-- live or succeeded is skipped, one that ended otherwise is superseded (it leaves the job's
-- counts), one this same submission claimed is a duplicate. A line not enqueued leaves the
-- counts it was given when its feed was registered.
-- KEYS[1] job hash, KEYS[2] claims hash, KEYS[3] feed hash, KEYS[4] feeds zset, KEYS[5]
-- job-list depth hash, KEYS[6] events list, then per modality class its list and its tenant's active-jobs zset
-- (pairs), then one task hash per line. ARGV: job id, ttl seconds, submission id, feed id,
-- task key prefix, expected cursor, new cursor, lines consumed (each was counted), number of
-- class pairs, whether the pairs' lists are job lists ('1') or the interactive lane's ('0'),
-- F and the F status field names; then per line: claim, class pair, F values, message.
-- Returns {status, codes}: status 'fed' | 'stale' | 'cancelled' | 'expired'; a code per line
-- 'q' enqueued, 's' skipped, 'd' duplicate.
local SUPERSEDABLE = {F = 'failed', C = 'cancelled', E = 'expired'}

function commands.feed()
  local t = now()
  local jobkey, claims, feedkey = KEYS[1], KEYS[2], KEYS[3]
  local job, ttl, sub, feed = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
  if redis.call('HGET', feedkey, 'cursor') ~= ARGV[7] then return {'stale', {}} end
  local j = redis.call('HMGET', jobkey, 'cancel_requested', 'expires_at')
  if j[1] == '1' or (j[2] and tonumber(j[2]) <= t) then
    local state = j[1] == '1' and 'cancelled' or 'expired'
    drop_feed(jobkey, feedkey, KEYS[4], job, feed, state, t, KEYS[6])
    return {state, {}}
  end
  local consumed, pairs_n = tonumber(ARGV[9]), tonumber(ARGV[10])
  local job_lists = ARGV[11] == '1'
  local names, at = read_names(12)
  local first_task, codes, pushed, dropped = 7 + 2 * pairs_n, {}, {}, 0
  local claimed, new_claims = {}, {}  -- claims this chunk makes, written in one call
  for i = first_task, #KEYS do
    local claim, pair = ARGV[at], tonumber(ARGV[at + 1])
    local code = 'q'
    local record = claimed[claim] and sub or redis.call('HGET', claims, claim)
    if record then
      local by, state = string.match(record, '^(%S+)%s?(%a?)')
      if by == sub then
        code = 'd'
      elseif state == '' or state == 'S' then
        code = 's'
      elseif SUPERSEDABLE[state] then
        redis.call('HINCRBY', jobkey, 'total', -1)
        redis.call('HINCRBY', jobkey, SUPERSEDABLE[state], -1)
      end
    end
    if code == 'q' then
      claimed[claim] = true
      new_claims[#new_claims + 1] = claim
      new_claims[#new_claims + 1] = sub
      create_task(KEYS[i], names, at + 2, t, ttl)
      push(pair, ARGV[at + 2 + #names], pushed)
    else
      dropped = dropped + 1
    end
    codes[#codes + 1] = code
    at = at + 3 + #names
  end
  call_many('HSET', claims, new_claims, 2)
  push_all(5, pushed, KEYS[5], job_lists)
  -- Lines consumed without a task (unreadable in the stored input) leave the counts too.
  dropped = dropped + consumed - (#KEYS - first_task + 1)
  if dropped > 0 then
    redis.call('HINCRBY', jobkey, 'total', -dropped)
    queued_by(jobkey, -dropped, -dropped)
  end
  redis.call('HINCRBY', jobkey, 'unfed', -consumed)
  local left = redis.call('HINCRBY', feedkey, 'left', -consumed)
  redis.call('HSET', feedkey, 'cursor', ARGV[8])
  if left <= 0 then forget_feed(jobkey, feedkey, KEYS[4], feed) end
  for _, k in ipairs({jobkey, claims}) do redis.call('EXPIRE', k, ttl) end
  finish_check(jobkey, job, t, KEYS[6])
  return {'fed', codes}
end

-- rate: one request of a caller against its token bucket, shared by every API process.
-- KEYS[1] the caller's bucket (hash: tokens, at). ARGV: refill per second, burst. Returns the
-- seconds until a token is free ('0': allowed, and one was spent). An idle bucket is full:
-- it expires once it would have refilled.
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

return commands[ARGV[1]]()
