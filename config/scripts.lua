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

local function task_id(raw)
  -- The body is base64, so the only "id" key in clear text is the header's (Celery writes
  -- headers before properties); decode fully only as a fallback.
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

-- One task's move: allowed from-states ("," separated, "-" = no state yet), the job's counters
-- and finish check in the same step; `m.stampf` (if not '') gets Redis's time. `h` is the
-- task hash's {state, deliveries, job_id, superseded}, read once by fenced_move.
-- Returns previous state, moved (1|0).
local function move(key, m, h, jobprefix, t, events)
  local current = h[1] or ''
  local ok = false
  for from in string.gmatch(m.allowed, '([^,]+)') do
    if (from == '-' and current == '') or from == current then ok = true end
  end
  if not ok then return current, 0 end
  local fields = m.fields
  if m.stampf ~= '' then fields[#fields + 1] = m.stampf; fields[#fields + 1] = stamp(t) end
  fields[#fields + 1] = 'state'
  fields[#fields + 1] = m.new
  redis.call('HSET', key, unpack(fields))
  local job = h[3]
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'job_id' then job = fields[i + 1] end  -- set by this very move
  end
  if job and job ~= '' and current ~= m.new and h[4] ~= '1' then
    local jobkey = jobprefix .. job
    if current ~= '' then redis.call('HINCRBY', jobkey, current, -1) end
    redis.call('HINCRBY', jobkey, m.new, 1)
    finish_check(jobkey, job, t, events)
  end
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
-- Returns previous state, moved (1|0), held (1|0).
local function fenced_move(key, m, jobprefix, t, events)
  local h = redis.call('HMGET', key, 'state', 'deliveries', 'job_id', 'superseded')
  if m.token ~= '' and h[2] ~= m.token then
    return h[1] or '', 0, 0
  end
  local previous, moved = move(key, m, h, jobprefix, t, events)
  if moved == 1 and m.attempt then redis.call('HINCRBY', key, 'attempts', 1) end
  return previous, moved, 1
end

-- in flight -----------------------------------------------------------------------------------
-- The bookkeeping of held messages, always KEYS[1..5] of these commands: inflight hash (id ->
-- raw message), leases zset (id -> deadline), origin-queue hash, origin-active hash (the
-- fair-share zset of a job list the message came from), job-list depth hash (fair-share zset
-- -> messages waiting in its job lists: a class's queue depth without visiting every job).

local function forget(id)
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[4], id)
end

-- Put a held message back at the head of its queue (RPUSH: the next one popped).
local function requeue(id)
  local raw = redis.call('HGET', KEYS[1], id)
  local queue = redis.call('HGET', KEYS[3], id)
  local moved = 0
  if raw and queue then
    redis.call('RPUSH', queue, raw)
    local active = redis.call('HGET', KEYS[4], id)
    if active then
      redis.call('ZADD', active, 'NX', 0, queue)
      redis.call('HINCRBY', KEYS[5], active, 1)
    end
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
  local t, replies, at = now(), {}, 3
  for i = 2, #KEYS do
    local m
    m, at = read_move(at)
    local previous, moved, held = fenced_move(KEYS[i], m, ARGV[2], t, KEYS[1])
    replies[i - 1] = {previous, moved, held}
  end
  return replies
end

-- settle: terminal transitions and acknowledgements of held tasks, one step (allow-oom).
-- KEYS[1..5] bookkeeping, KEYS[6] events list, KEYS[7..] task hashes. ARGV: job key prefix,
-- then per task its id and a move. Returns {previous, moved, held} per task: a holder that was
-- fenced out (held 0) changes nothing, and its result never becomes the task's.
function commands.settle()
  local t, replies, at = now(), {}, 3
  for i = 7, #KEYS do
    local id = ARGV[at]
    local m
    m, at = read_move(at + 1)
    local previous, moved, held = fenced_move(KEYS[i], m, ARGV[2], t, KEYS[6])
    if held == 1 then forget(id) end
    replies[i - 6] = {previous, moved, held}
  end
  return replies
end

-- pull: move up to N messages of one class into this worker's leases.
-- KEYS[1..5] bookkeeping, KEYS[6] the class's active-jobs zset, KEYS[7..] its fixed lists:
-- the interactive lane (priority order), then the plain bulk queue (priority order).
-- ARGV: max count, lease seconds, task key prefix, number of interactive lists, terminal
-- states (csv), task ttl seconds (a plain send_task's message gets its hash here, and the
-- hash its ttl). The interactive lane is drained first; the rest is shared round robin, one
-- message per member per round, between the plain bulk queue and the bulk jobs' own lists,
-- least recently served job first: a job served goes to the back of the zset (score: one
-- more than the last), so with J active jobs and batches of B every job is served within
-- ceil(J / B) pulls, and a pull costs O(B log J) whatever J is.
-- A copy of a task that is already terminal, or that a live holder has, is dropped (one run
-- per task while its holder lives); a holder whose lease ran out is fenced out by the new
-- delivery's token. Returns {now, dropped, rows}; a row is {id, raw, token, status fields}.
function commands.pull()
  local t = now()
  local limit, deadline = tonumber(ARGV[2]), t + tonumber(ARGV[3])
  local prefix, terminal, ttl = ARGV[4], csv_set(ARGV[6]), tonumber(ARGV[7])
  local out, dropped = {}, 0
  local function take(list, active)
    local raw = redis.call('RPOP', list)
    if not raw then return false end
    if active then redis.call('HINCRBY', KEYS[5], active, -1) end
    local id = task_id(raw)
    local key = prefix .. id
    -- The status fields the worker decides on, read here to save it a round trip.
    local status = redis.call('HMGET', key, 'state', 'attempts', 'job_id', 'queued_at',
                              'expires_at')
    local held_until = tonumber(redis.call('ZSCORE', KEYS[2], id))
    if terminal[status[1] or ''] or (held_until and held_until > t) then
      dropped = dropped + 1
      return true
    end
    redis.call('HSET', KEYS[1], id, raw)
    redis.call('ZADD', KEYS[2], deadline, id)
    redis.call('HSET', KEYS[3], id, list)
    -- (an origin-active entry never outlives its in-flight entry: forget() drops both)
    if active then redis.call('HSET', KEYS[4], id, active) end
    local n = redis.call('HINCRBY', key, 'deliveries', 1)
    redis.call('EXPIRE', key, ttl, 'NX')
    out[#out + 1] = {id, raw, n, status}
    return true
  end
  local first = 7 + tonumber(ARGV[5])
  for i = 7, first - 1 do
    while #out < limit and take(KEYS[i], false) do end
  end
  local plain_lists = {}
  for i = first, #KEYS do plain_lists[#plain_lists + 1] = KEYS[i] end
  local active = KEYS[6]
  local progress = true
  while #out < limit and progress do
    progress = false
    for _, list in ipairs(plain_lists) do
      if take(list, false) then progress = true break end
    end
    local jobs = redis.call('ZRANGE', active, 0, limit - #out - 1)
    for _, list in ipairs(jobs) do
      if #out >= limit then break end
      if take(list, active) then
        progress = true
        local last = redis.call('ZRANGE', active, -1, -1, 'WITHSCORES')
        redis.call('ZADD', active, tonumber(last[2]) + 1, list)
      else
        redis.call('ZREM', active, list)
      end
    end
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
-- lease). ARGV: job id, name, webhook url, completion window seconds ('' none), ttl seconds,
-- submission id, submitter lease seconds. The window starts at the first submission.
function commands.open_job()
  local t, key = now(), KEYS[1]
  redis.call('HSETNX', key, 'created_at', stamp(t))
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
  return 1
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

-- submit: one chunk of a bulk job, all or nothing: claim each line's custom_id, write its
-- status hash, push its message, count it. A custom_id names one live task per job: a line
-- whose custom_id is queued, running or succeeded is skipped, one that ended otherwise is
-- superseded (it leaves the job's counts, its new task joins them), one already claimed by
-- this same submission is a duplicate. Deciding and writing in one script is what makes any
-- number of concurrent submitters of one job enqueue each custom_id once, with exact counts.
-- KEYS[1] job hash, KEYS[2] custom-id claims (custom_id -> task id ':' submission), KEYS[3]
-- job task list, KEYS[4] submitting zset, KEYS[5] job-list depth hash, then per modality class
-- in the chunk its job list and active zset (pairs), then one task hash per line.
-- ARGV: job id, ttl seconds, submission id, submitter lease seconds, task key prefix, number
-- of class pairs, number of status fields F, the F field names; then per line: custom_id (''
-- for none: always a new task), class pair (1-based), the F field values ('' unset), message.
-- Returns one code per line: 'q' enqueued, 's' skipped, 'd' duplicate.
function commands.submit()
  local t = now()
  local jobkey, claims, tasks = KEYS[1], KEYS[2], KEYS[3]
  local job, ttl, sub = ARGV[2], tonumber(ARGV[3]), ARGV[4]
  local prefix, pairs_n, nf = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
  local names, at = {}, 9
  for i = 1, nf do names[i] = ARGV[at]; at = at + 1 end
  local first_task = 6 + 2 * pairs_n
  local live = {queued = true, running = true, succeeded = true}
  local codes, added, pushed = {}, 0, {}
  for i = first_task, #KEYS do
    local cid, pair = ARGV[at], tonumber(ARGV[at + 1])
    local values = {}
    for j = 1, nf do values[j] = ARGV[at + 1 + j] end
    local message = ARGV[at + 2 + nf]
    at = at + 3 + nf
    local key, code = KEYS[i], 'q'
    local id = string.sub(key, #prefix + 1)
    if cid ~= '' then
      local claim = redis.call('HGET', claims, cid)
      if claim then
        local old, by = string.match(claim, '^(.*):([^:]*)$')
        local state = redis.call('HMGET', prefix .. old, 'state', 'superseded')
        if by == sub then
          code = 'd'
        elseif live[state[1] or ''] then
          code = 's'
        elseif state[1] and state[2] ~= '1' then
          redis.call('HINCRBY', jobkey, 'total', -1)
          redis.call('HINCRBY', jobkey, state[1], -1)
          redis.call('HSET', prefix .. old, 'superseded', '1')
        end
      end
    end
    if code == 'q' then
      if cid ~= '' then
        redis.call('HSET', claims, cid, id .. ':' .. sub)
      end
      local fields = {'created_at', stamp(t), 'queued_at', stamp(t)}
      for j = 1, nf do
        if values[j] ~= '' then
          fields[#fields + 1] = names[j]
          fields[#fields + 1] = values[j]
        end
      end
      redis.call('HSET', key, 'state', 'queued', unpack(fields))
      redis.call('EXPIRE', key, ttl)
      redis.call('LPUSH', KEYS[4 + 2 * pair], message)
      pushed[pair] = (pushed[pair] or 0) + 1
      redis.call('RPUSH', tasks, id)
      added = added + 1
    end
    codes[#codes + 1] = code
  end
  for pair, n in pairs(pushed) do
    local active = KEYS[5 + 2 * pair]
    redis.call('ZADD', active, 'NX', 0, KEYS[4 + 2 * pair])
    redis.call('HINCRBY', KEYS[5], active, n)
  end
  if added > 0 then
    redis.call('HINCRBY', jobkey, 'total', added)
    redis.call('HINCRBY', jobkey, 'queued', added)
  end
  hold_submitter(jobkey, job, sub, t + tonumber(ARGV[5]), KEYS[4])
  for _, k in ipairs({jobkey, claims, tasks}) do redis.call('EXPIRE', k, ttl) end
  return codes
end

return commands[ARGV[1]]()
