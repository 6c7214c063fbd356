-- uses common.lua: call_many, csv_set, is_fed_id, now, plain, read_many, stamp, unanchor,
--      widen;
--      tenants.lua: queued_by, quota_add
-- intake and leases: pull, renew, acknowledge, give back, reap; workers' records ----------
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

-- A job list that got `n` messages is a member of its tenant's zset, and the tenant of its
-- class's. `depth`: the job-list depth hash.
local function activate(list, active, n, depth)
  local class = class_of(active)
  redis.call('ZADD', active, 'NX', 0, list)
  redis.call('ZADD', class, 'NX', 0, active)
  redis.call('HINCRBY', depth, class, n)
end

-- Put a held message back at the head of its queue (RPUSH: the next one popped). A prepare
-- worker's holding ends with it: the task is no longer 'preparing' (`prefix`: the task key
-- prefix). A prepared message goes back to its prepared list and stays 'prepared'.
local function requeue(id, prefix)
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
  if prefix and redis.call('HGET', prefix .. id, 'stage') == 'preparing' then
    redis.call('HDEL', prefix .. id, 'stage')
  end
  return moved
end

-- identity ------------------------------------------------------------------------------
-- A message is a delivery of task X when its header id is X and its tag is the one X was
-- created with. A message's tag is Celery's properties.delivery_tag, a random 128-bit id
-- every producer (kombu, vlmq's encoder) draws for each message it publishes, or the SHA-1 of
-- its bytes for one without (config/ids.py message_tag). Every vlmq producer records it in
-- its task's hash ('tag'); the first pull of a plain send_task message (no hash yet) records
-- it there. A message that names a task it is not (a copy with a victim's id made by a
-- producer that cannot read the victim's message, a nested "id" placed before its own, a
-- second message with an id already taken) is a task of its own, 'invalid-<sha1>', which
-- fails alone: a message never touches a task other than its own. (A process that can read
-- Redis can copy a message whole; such a copy is the task's duplicate, and runs at most
-- once. It could also rewrite any key: Redis's own access control is the boundary there.)
-- The worker takes the id from here and never reads another from the message.

-- The status fields a pull reads (the worker decides on the first six), then the tag; and
-- for a task delivered before, how its earlier deliveries ended (workers/fleet/work.py).
local STATUS_FIELDS = {'state', 'attempts', 'job_id', 'queued_at', 'expires_at', 'tenant', 'tag'}
local TAG = #STATUS_FIELDS
local REDELIVERY_FIELDS = {'alone', 'returns', 'outlived'}

-- The status fields of a row: the first six, and for a redelivery (token above 1) the
-- redelivery fields after them.
local function row_status(key, status, n)
  status[TAG] = nil
  if n > 1 then
    local again = redis.call('HMGET', key, unpack(REDELIVERY_FIELDS))
    status[TAG], status[TAG + 1], status[TAG + 2] = again[1], again[2], again[3]
  end
  return status
end

-- The first value of a JSON string key in the text (compact, or with ": "): the characters up
-- to the next quote, if 1-128 of them. (Plain finds: a pattern's character classes cost ~100
-- instructions a character.)
local ID_FORMS = {'"id":"', '"id": "'}
local TAG_FORMS = {'"delivery_tag":"', '"delivery_tag": "'}

local function first_value(raw, forms)
  local _, e = string.find(raw, forms[1], 1, true)
  if not e then _, e = string.find(raw, forms[2], 1, true) end
  if not e then return nil end
  local close = string.find(raw, '"', e + 1, true)
  if not close or close == e + 1 or close - e > 129 then return nil end
  return string.sub(raw, e + 1, close - 1)
end

local function tag_of(tag, raw)
  if type(tag) == 'string' and #tag <= 64 and string.match(tag, '^[%w%-]+$') then return tag end
  return 'sha1:' .. redis.sha1hex(raw)
end

-- The header id and tag as every JSON reader takes them (the last key of a name wins, in
-- cjson as in Python): read only when the fast path below did not prove the message.
local function parsed(raw)
  local ok, msg = pcall(cjson.decode, raw)
  if not ok or type(msg) ~= 'table' then return nil, tag_of(nil, raw) end
  local headers, properties = msg.headers, msg.properties
  local id = type(headers) == 'table' and headers.id or nil
  local tag = type(properties) == 'table' and properties.delivery_tag or nil
  return id, tag_of(tag, raw)
end

local function status_of(prefix, id)
  return redis.call('HMGET', prefix .. id, unpack(STATUS_FIELDS))
end

-- Returns the task id of `raw`, its status (STATUS_FIELDS) and the message's tag.
local function identify(raw, prefix)
  -- Fast path: the first id and tag in the text name a task created with that tag (a vlmq
  -- producer wrote exactly that pair; nobody else knows the tag). Only a task hash that some
  -- producer created names a plain id, so the id needs no check of its own here. A stored
  -- tag with a ':' is a digest of a message without one (tag_of), which a message's own
  -- tag must never stand for.
  local id = first_value(raw, ID_FORMS)
  local tag = id and first_value(raw, TAG_FORMS)
  if tag and not string.find(tag, ':', 1, true) then
    local status = status_of(prefix, id)
    if status[TAG] == tag then return id, status, tag end
  end
  id, tag = parsed(raw)
  if plain(id) then
    local status = status_of(prefix, id)
    if not status[TAG] or status[TAG] == tag then return id, status, tag end
  end
  id = 'invalid-' .. redis.sha1hex(raw)
  return id, status_of(prefix, id), tag
end

-- A fed task without a hash ended (it was folded into its job) when its job still has a
-- record for its claim: then the message is a stale copy. `refs`: Keys.job_ref_prefix,
-- `jobs`: Keys.job_prefix.
local function fed_and_ended(id, refs, jobs)
  if not is_fed_id(id) then return false end
  local number, claim = string.match(id, '^(%d+)%.([0-9a-f]+)%.')
  local job = redis.call('GET', refs .. number)
  return job ~= false and redis.call('HEXISTS', jobs .. job .. JOB_KEYS.claims, claim) == 1
end

-- Appends a pull's row to its flat reply (commands.pull).
local function add_row(out, id, raw, n, list, status)
  local at = #out
  out[at + 1], out[at + 2], out[at + 3], out[at + 4], out[at + 5] = id, raw, n, list, #status
  for i = 1, #status do out[at + 5 + i] = status[i] end
end

-- pull: move up to N messages of one class into this worker's leases.
-- KEYS[1..5] bookkeeping, KEYS[6] the class's active-tenants zset, KEYS[7..] its fixed lists:
-- the lists drained first (a GPU worker's: the interactive lane's prepared list, the
-- interactive lane in priority order, the bulk lane's prepared list; a prepare worker's: the
-- interactive lane), then the plain bulk queue (priority order).
-- ARGV: max count, lease seconds, task key prefix, number of lists drained first, terminal
-- states (csv), task ttl seconds (a plain send_task's message gets its hash here, and the
-- hash its ttl), job-ref key prefix, job key prefix, the stage a prepare worker's pull marks
-- its tasks with ('' for none), the suffix of prepared lists. The first lists are drained first;
-- the rest is shared round robin, first across tenants, then across each tenant's jobs: an
-- equal share per member per round (one each when there are more members than room), least
-- recently served first. The plain bulk queue (any Celery producer's messages) is one more
-- member at the tenant level. A member served goes to the back of its zset, so with T active
-- tenants and batches of B every tenant is served within ceil(T / B) pulls whatever its number
-- of jobs, and a pull costs O(B log J). Lists are popped several messages at a time and the
-- bookkeeping written once per pull: the per-message cost is what caps a Redis.
-- A copy of a task that ended (terminal, or folded), or that a live holder has, is dropped
-- (one run per task while its holder lives; a finished task never runs again); a holder
-- whose lease ran out is fenced out by the new delivery's token. A prepared list's message
-- always had a hash when it was handed on (hand_on): one without ended meanwhile. Returns one
-- flat list (tasks.lua, reply_row: a table per row costs Redis look-ups of its own to send):
-- now, dropped, the row count, then per row id, raw, token, origin list, the count k of its
-- status fields (row_status) and the k fields.
function commands.pull()
  local t = now()
  local limit, deadline = tonumber(ARGV[2]), stamp(t + tonumber(ARGV[3]))
  local prefix, terminal, ttl = ARGV[4], csv_set(ARGV[6]), ARGV[7]
  local refs, jobs, stage, prepared_suffix = ARGV[8], ARGV[9], ARGV[10], ARGV[11]
  local out, rows, dropped, taken = {stamp(t), 0, 0}, 0, 0, {}
  local inflight, leases, origins, actives = {}, {}, {}, {}
  local anchored  -- the bookkeeping is widened once a pull has messages (common.lua, widen)
  -- Pops up to n messages of one list into this holder's rows; returns how many it popped.
  local function take(list, active, n)
    local raws = redis.call('RPOP', list, n)
    if not raws then return 0 end
    if not anchored then
      anchored = widen({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, {'hash', 'zset', 'hash', 'hash'})
    end
    if active then redis.call('HINCRBY', KEYS[5], KEYS[6], -#raws) end
    local prepared = string.sub(list, -#prepared_suffix) == prepared_suffix
    local ids, statuses, tags = {}, {}, {}
    for i, raw in ipairs(raws) do ids[i], statuses[i], tags[i] = identify(raw, prefix) end
    -- Whether a live holder has each (its lease not yet run out), in one call.
    local leased = read_many('ZMSCORE', KEYS[2], ids)
    for i, raw in ipairs(raws) do
      local id, status, tag = ids[i], statuses[i], tags[i]
      local key = prefix .. id
      local held_until = tonumber(leased[i])
      local hashless = not status[TAG] and not status[1]
      -- A job list's task has a hash until it ends (then it is folded, or expired with its
      -- job); a fed task's likewise, on either lane.
      local ended = hashless and (active or prepared or fed_and_ended(id, refs, jobs))
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
        local n = redis.call('HINCRBY', key, 'deliveries', '1')
        if not status[TAG] then
          -- A plain message's first pull: its hash starts here, and records its tag.
          redis.call('HSET', key, 'tag', tag)
          redis.call('EXPIRE', key, ttl, 'NX')
        end
        if stage ~= '' then redis.call('HSET', key, 'stage', stage) end
        add_row(out, id, raw, n, list, row_status(key, status, n))
        rows = rows + 1
      end
    end
    return #raws
  end
  local first = 7 + tonumber(ARGV[5])
  for i = 7, first - 1 do
    while rows < limit and take(KEYS[i], false, limit - rows) > 0 do end
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
    local lists = redis.call('ZRANGE', active, 0, room - 1)
    local share = math.ceil(room / math.max(#lists, 1))
    for _, list in ipairs(lists) do
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
  while rows < limit and progress do
    progress = false
    local want = limit - rows
    local members = redis.call('ZRANGE', tenants, 0, want - 1)
    -- An equal share per tenant this round (the plain bulk queue, messages of any Celery
    -- producer, is one more while it has any): one each when there are more tenants than room.
    local share = math.ceil(want / (#members + 1))
    local plain = 0
    for _, list in ipairs(plain_lists) do
      plain = take(list, false, share)
      if plain > 0 then progress = true break end
    end
    -- An empty plain queue leaves its share to the tenants: one round fills the room, not
    -- half of it (then a quarter, ...: a pull of one tenant's job took six rounds).
    if plain == 0 and #members > 0 then share = math.ceil(want / #members) end
    for _, active in ipairs(members) do
      if rows >= limit then break end
      if take_tenant(active, math.min(share, limit - rows)) > 0 then
        progress = true
        served(tenants, active)
      elseif redis.call('EXISTS', active) == 0 then
        redis.call('ZREM', tenants, active)  -- none of its jobs has messages left
      end
    end
  end
  if rows > 0 then
    call_many('HSET', KEYS[1], inflight, 2)
    call_many('ZADD', KEYS[2], leases, 2)
    call_many('HSET', KEYS[3], origins, 2)
    if #actives > 0 then call_many('HSET', KEYS[4], actives, 2) end
  end
  if anchored then unanchor(anchored) end
  out[2], out[3] = dropped, rows
  return out
end

-- A pull is kept for a retry as its ids and tokens, not its messages (those are in the
-- in-flight hash, under this holder's lease, for as long as a retry may come). A pull that
-- took nothing and dropped nothing changed nothing: a retry may run it again, so nothing is
-- kept (an idle worker polls its queues many times a second).
replays.pull = {
  keep = function(reply)
    if reply[3] == 0 and reply[2] == 0 then return nil end
    local kept, at = {reply[1], reply[2]}, 4
    for _ = 1, reply[3] do
      kept[#kept + 1] = reply[at]
      kept[#kept + 1] = reply[at + 2]
      at = at + 5 + reply[at + 4]
    end
    return table.concat(kept, ' ')
  end,
  answer = function(kept)
    local words = {}
    for word in string.gmatch(kept, '%S+') do words[#words + 1] = word end
    local out, rows = {words[1], tonumber(words[2]), 0}, 0
    for i = 3, #words, 2 do
      local id = words[i]
      local raw = redis.call('HGET', KEYS[1], id)
      if raw then
        local n = tonumber(words[i + 1])
        local status = row_status(ARGV[4] .. id, status_of(ARGV[4], id), n)
        add_row(out, id, raw, n, redis.call('HGET', KEYS[3], id), status)
        rows = rows + 1
      end
    end
    out[3] = rows
    return out
  end,
}

-- renew: extend this holder's leases (allow-oom: renewing never needs memory). Safe to
-- repeat. KEYS[1] leases. ARGV: lease seconds, task key prefix, then id, token pairs.
-- Returns the ids this holder no longer holds (reaped, or delivered again elsewhere). The
-- leases are read and written in one call each; only the tokens are read one by one.
function commands.renew()
  local deadline, prefix, lost = stamp(now() + tonumber(ARGV[2])), ARGV[3], {}
  local ids, kept = {}, {}
  for i = 4, #ARGV, 2 do ids[#ids + 1] = ARGV[i] end
  local leased = read_many('ZMSCORE', KEYS[1], ids)
  for j, id in ipairs(ids) do
    if leased[j] and redis.call('HGET', prefix .. id, 'deliveries') == ARGV[3 + 2 * j] then
      kept[#kept + 1] = deadline
      kept[#kept + 1] = id
    else
      lost[#lost + 1] = id
    end
  end
  call_many('ZADD', KEYS[1], kept, 2, 'XX')
  return lost
end

-- Applies `fn` to each (id, token) of ARGV's pairs, from ARGV[3], that this holder still
-- holds (ARGV[2]: task key prefix); returns the sum of what it returns.
local function for_held(fn)
  local prefix, total = ARGV[2], 0
  for i = 3, #ARGV, 2 do
    if redis.call('HGET', prefix .. ARGV[i], 'deliveries') == ARGV[i + 1] then
      total = total + fn(ARGV[i], ARGV[i + 1])
    end
  end
  return total
end

-- ack: forget held messages that will not run (their task ended while they were held)
-- (allow-oom; safe to repeat). KEYS[1..5] bookkeeping. ARGV: task key prefix, then id, token
-- pairs.
function commands.ack()
  return for_held(function(id) forget(id) return 1 end)
end

-- A delivery its holder returned (gave back, handed on) did not die with it: counted on the
-- task ('returns'), so its next delivery is not one whose holder died before starting it; and
-- if it went alone (mark_alone, this very token), that is not counted against it either
-- ('alone' counts the deliveries alone whose holder died). Only deaths count toward the
-- poison verdict (workers/fleet/suspects.py). Called once per delivery: the message has just
-- left this holder's leases.
local function returned(key, token)
  redis.call('HINCRBY', key, 'returns', 1)
  if redis.call('HGET', key, 'alone_token') == token then
    redis.call('HINCRBY', key, 'alone', -1)
  end
end

-- give_back: return held messages to their queues now (shutdown, not started) (allow-oom;
-- safe to repeat: a message given back is no longer in flight), a return (returned).
-- KEYS[1..5] bookkeeping. ARGV: task key prefix, then id, token pairs (only this holder's).
function commands.give_back()
  return for_held(function(id, token)
    local moved = requeue(id, ARGV[2])
    if moved == 1 then returned(ARGV[2] .. id, token) end
    return moved
  end)
end

-- A started task's start undone (hand_back): its attempt taken back, 'queued' again, counted
-- as queued in its job (and in the quota it counts in) as before its start. `key`: its hash.
local function unstart(key, job_prefix)
  local h = redis.call('HMGET', key, 'state', 'attempts', 'job_id', 'quota', 'est')
  if tonumber(h[2] or '0') > 1 then
    redis.call('HINCRBY', key, 'attempts', -1)
  else
    redis.call('HDEL', key, 'attempts')
  end
  if h[1] ~= 'running' then return end
  redis.call('HSET', key, 'state', 'queued')
  redis.call('HDEL', key, 'started_at')
  if h[4] then quota_add(h[4], 1, tonumber(h[5] or '0') or 0) end  -- a quota of its own
  if h[3] and h[3] ~= '' then
    local jobkey = job_prefix .. h[3]
    redis.call('HINCRBY', jobkey, 'running', -1)
    queued_by(jobkey, 1, h[4] and 0 or 1)
  end
end

-- hand_back: a draining worker (preemption, SIGTERM: workers/fleet/drain.py) returns held
-- messages, started or not, to the head of their queues now, so other workers take them at
-- once instead of after lease plus reap (allow-oom; safe to repeat). Each is a return
-- (returned), and a started one's start is undone (unstart): it was abandoned, not killed,
-- so it neither counts toward max_deliveries nor becomes a suspect that runs alone, and it
-- reads 'queued' (a cancel stops it). The delivery is then void: its token is spent (the
-- count moves on, the spent token counted a return too), so a late renew, start, settle or
-- hand_on of this holder's is refused even before anyone pulls the task again.
-- KEYS[1..5] bookkeeping. ARGV: task key prefix, job key prefix, then id, token pairs.
-- Returns how many it returned.
function commands.hand_back()
  local prefix, job_prefix = ARGV[2], ARGV[3]
  local total = 0
  for i = 4, #ARGV, 2 do
    local id, token = ARGV[i], ARGV[i + 1]
    local key = prefix .. id
    local h = redis.call('HMGET', key, 'deliveries', 'started')
    if h[1] == token and redis.call('HEXISTS', KEYS[1], id) == 1 then
      requeue(id, prefix)
      returned(key, token)
      if h[2] == token then unstart(key, job_prefix) end
      redis.call('HINCRBY', key, 'deliveries', 1)
      redis.call('HINCRBY', key, 'returns', 1)
      total = total + 1
    end
  end
  return total
end

-- reap: put back messages whose holder stopped renewing (it died) (allow-oom; safe to
-- repeat). KEYS[1..5] bookkeeping. ARGV: most to move, task key prefix.
function commands.reap()
  local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now(), 'LIMIT', 0, tonumber(ARGV[2]))
  local moved = 0
  for _, id in ipairs(ids) do moved = moved + requeue(id, ARGV[3]) end
  return moved
end

-- hand_on: a prepare worker hands the tasks it prepared on to the GPU workers (allow-oom;
-- safe to repeat). The message moves from this holder's leases to a prepared list, whole and
-- unchanged: the same task, its delivery count going on (the GPU worker's pull is the next
-- delivery and fences this holder out), its stage 'prepared'. A task that ended meanwhile
-- (cancelled, expired by a sweep) is forgotten instead. The move is a return (returned).
-- KEYS[1..5] bookkeeping, KEYS[6] the prepared list. ARGV: task key prefix, terminal states
-- (csv), then id, token pairs. Returns one word per pair: 'on' (handed on, now or by an
-- earlier call), 'ended' (forgotten), 'lost' (this holder no longer holds it).
function commands.hand_on()
  local prefix, terminal, out = ARGV[2], csv_set(ARGV[3]), {}
  for i = 4, #ARGV, 2 do
    local id, token = ARGV[i], ARGV[i + 1]
    local key = prefix .. id
    local task = redis.call('HMGET', key, 'deliveries', 'state', 'stage')
    local held = redis.call('HEXISTS', KEYS[1], id) == 1
    if task[1] ~= token then
      out[#out + 1] = 'lost'
    elseif not held then
      out[#out + 1] = task[3] == 'prepared' and 'on' or 'lost'
    elseif terminal[task[2] or ''] then
      forget(id)
      out[#out + 1] = 'ended'
    else
      redis.call('LPUSH', KEYS[6], redis.call('HGET', KEYS[1], id))
      forget(id)
      redis.call('HSET', key, 'stage', 'prepared')
      returned(key, token)
      out[#out + 1] = 'on'
    end
  end
  return out
end

-- workers' records ---------------------------------------------------------------------------
-- KEYS[1] workers hash (name -> record), KEYS[2] workers' last-heard zset (name -> Redis's time).

-- announce: a worker's heartbeat record (safe to repeat). ARGV: name, record, seconds after
-- which a silent worker's record goes (a worker that died without a clean stop). Returns the
-- records pruned.
function commands.announce()
  local t = now()
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
  redis.call('ZADD', KEYS[2], t, ARGV[2])
  local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', t - tonumber(ARGV[4]), 'LIMIT', 0, 100)
  if #gone > 0 then
    call_many('HDEL', KEYS[1], gone, 1)
    call_many('ZREM', KEYS[2], gone, 1)
  end
  return #gone
end

-- retire: a worker stopping cleanly takes its record away. ARGV: name.
function commands.retire()
  redis.call('HDEL', KEYS[1], ARGV[2])
  return redis.call('ZREM', KEYS[2], ARGV[2])
end

-- named leases: one holder at a time of an activity (an API process feeding or finalizing a
-- batch), owner-checked. KEYS[1] the lease key. Taking one is ``SET NX`` plus a read of the
-- owner (vlmq/broker/state/intake.py ActivityLeases: a retried take finds its own token).

-- renew_named: extend the lease if the caller still owns it. ARGV: token, seconds.
-- Returns 1 if it did.
function commands.renew_named()
  if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
  return redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
end

-- release_named: drop the lease if the caller still owns it (safe to repeat). ARGV: token.
function commands.release_named()
  if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
  return redis.call('DEL', KEYS[1])
end
