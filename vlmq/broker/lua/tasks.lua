-- uses common.lua: call_many, is_fed_id, now, read_many, read_pairs, stamp;
--      tenants.lua: count_groups, new_sums, note_usage, queued_by, quota_add,
--      read_usage_groups, write_sums;
--      intake.lua: forget_all;
--      jobs.lua: finish_check, keep_job
-- tasks: state moves, fenced by delivery; settle (terminal moves and acknowledgements) -----

-- The job counter changes and finish checks of one script call, applied once per job at its
-- end: a batch of 64 tasks of one job costs a few counter writes, not 128.
local function new_tally() return {deltas = {}, mirror = {}, jobs = {}, finished = {}} end

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

-- A task of `job` reached a terminal state (from one that was not: states only go forward, so
-- once per task whatever retries or fenced settles follow): its id joins the job's completion
-- list (Keys.job_finished) in this same step, so a reader paging through the list by offset
-- sees each finished task once, in the order they finished.
local function count_finished(tally, job, id)
  local ids = tally.finished[job]
  if not ids then
    ids = {}
    tally.finished[job] = ids
  end
  ids[#ids + 1] = id
end

-- The job's completion list gets its new ids in one call; it lives as long as the job hash
-- (keep_job renews both; a call that does not renew them gives the list the hash's ttl, or
-- `ttl` seconds where the hash has none: never a list that outlives its job).
local function push_finished(jobkey, ids, keep, ttl)
  local list = jobkey .. JOB_KEYS.finished
  call_many('RPUSH', list, ids, 1)
  if not keep then
    local left = redis.call('PTTL', jobkey)
    if left > 0 then
      redis.call('PEXPIRE', list, left)
    else
      redis.call('EXPIRE', list, ttl)
    end
  end
end

-- `ctx`: {jobs = Keys.job_prefix, refs = Keys.job_ref_prefix, ttl = seconds, t = now, ts =
-- stamp(t), events = the events list, keep = whether the job's keys get their ttl again (a
-- settle does: every job that runs settles often; a start or a cancel need not)}.
local function apply_tally(tally, ctx)
  for _, job in ipairs(tally.jobs) do
    local jobkey = ctx.jobs .. job
    for state, n in pairs(tally.deltas[job]) do
      if state == 'queued' then
        queued_by(jobkey, n, tally.mirror[job])
      elseif n ~= 0 then
        redis.call('HINCRBY', jobkey, state, n)
      end
    end
    local finished = tally.finished[job]
    if finished then push_finished(jobkey, finished, ctx.keep, ctx.ttl) end
    if ctx.keep then keep_job(jobkey, ctx.ttl, ctx.refs) end
    finish_check(jobkey, job, ctx.t, ctx.events)
  end
end

-- A fed bulk task that ends is folded into its job's claims hash and its own hash deleted:
-- a finished task then costs one short hash field (its claim -> 'submission code[delivery]'),
-- not a key of its own (measured: >= 180 B per key with a TTL, ~90 B per field). The code is
-- the terminal state's letter; the delivery is there when a result object was written
-- (result_key names it), and a task that ended without one keeps its custom_id instead.
local FOLDED = {succeeded = 'S', failed = 'F', cancelled = 'C', expired = 'E'}
local FOLDED_STATE = {S = 'succeeded', F = 'failed', C = 'cancelled', E = 'expired'}

-- The task hash fields a move reads, once (fenced_move), and their places in what it read:
-- what every move needs, then what an end needs, then the quota, then what an attempt needs.
-- A call reads only what its moves need (fields_read): each field read costs a script
-- ~2,400 instructions (measured: an HMGET of 11 fields against one of 8). A call that ends no
-- task (a start) reads START_FIELDS, its quota and the attempt's two right after what every
-- move needs; where the quota and an attempt's fields are is the call's (ctx.quota_at,
-- ctx.attempts_at). A settle does not read the quota with the rest: only a move from or to
-- 'queued' needs it, and a settle's moves almost never are one (move reads it then). A
-- task's 'est' is read only when it counts in a quota of its own (move), its 'custom_id'
-- only when it is folded without a result object (fold).
local MOVE_FIELDS = {'state', 'deliveries', 'job_id', 'claim', 'tenant', 'notify', 'quota',
                     'attempts', 'started'}
local STATE, DELIVERIES, JOB, CLAIM, TENANT, NOTIFY = 1, 2, 3, 4, 5, 6
local START_FIELDS = {'state', 'deliveries', 'job_id', 'quota', 'attempts', 'started'}

-- A call's folds are written at its end (write_folds): per job one HMGET and one HSET of its
-- claims, and one DEL of the folded hashes, instead of three commands a task. `ctx.folds`:
-- claims key -> {claims, tails}, `order` (first-seen), `keys` (hashes to delete, a set too).
local function new_folds() return {of = {}, order = {}, keys = {}, deleting = {}} end

-- `claims`: the job's claims key (Keys.job_custom_ids: claims_key).
local function fold(key, h, m, claims, folds)
  local pending = folds.of[claims]
  if not pending then
    pending = {claims = {}, tails = {}}
    folds.of[claims] = pending
    folds.order[#folds.order + 1] = claims
  end
  local tail = FOLDED[m.tpl.new]
  if m.tpl.stored or m.stored then
    tail = tail .. h[DELIVERIES]
  else
    tail = tail .. ' ' .. (redis.call('HGET', key, 'custom_id') or '')
  end
  pending.claims[#pending.claims + 1] = h[CLAIM]
  pending.tails[#pending.tails + 1] = tail
  folds.keys[#folds.keys + 1] = key
  folds.deleting[key] = true
end

-- A claim still recorded (a job's record: its submission first) gets its fold's state and
-- delivery; a claim the job no longer records is left so.
local function write_folds(folds)
  for _, claims in ipairs(folds.order) do
    local pending = folds.of[claims]
    local live = read_many('HMGET', claims, pending.claims)
    local records = {}
    for i, claim in ipairs(pending.claims) do
      if live[i] then
        records[#records + 1] = claim
        local space = string.find(live[i], ' ', 1, true)  -- (its submission: the first word)
        local by = space and string.sub(live[i], 1, space - 1) or live[i]
        records[#records + 1] = by .. ' ' .. pending.tails[i]
      end
    end
    call_many('HSET', claims, records, 2)
  end
  for i = 1, #folds.keys, 960 do
    redis.call('DEL', unpack(folds.keys, i, math.min(i + 959, #folds.keys)))
  end
  folds.of, folds.order, folds.keys, folds.deleting = {}, {}, {}, {}
end

-- The from-states a move allows ("," separated, "-" = no state yet) as a set.
local function allowed_set(text)
  local set = {}
  for from in string.gmatch(text, '([^,]+)') do set[from == '-' and '' or from] = true end
  return set
end

-- Whether field/value pairs set a result object's url (a folded task then keeps its delivery).
local function stores(fields)
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'result_url' then return true end
  end
  return false
end

-- `k` field/value pairs from ARGV at `at` (a move never sets a task's job: only the producer
-- that created the task and counted it in its job does; a message cannot join a job).
local function read_fields(at, k) return read_pairs(at, k, 'job_id') end

-- The count after `text` (a counter field's value, nil for none) as text: a small one from
-- the table (tostring formats a number with sprintf, ~1,500 instructions: a start's attempt
-- count is written per task).
local COUNT_AFTER = {['0'] = '1', ['1'] = '2', ['2'] = '3', ['3'] = '4', ['4'] = '5', ['5'] = '6'}
local function count_after(text)
  return COUNT_AFTER[text or '0'] or tostring((tonumber(text) or 0) + 1)
end

-- A job's claims key, made once per call and job (ctx.claims).
local function claims_key(ctx, job)
  local claims = ctx.claims[job]
  if not claims then
    claims = ctx.jobs .. job .. JOB_KEYS.claims
    ctx.claims[job] = claims
  end
  return claims
end

-- The task's quota (its 'quota' field: it counts in a quota of its own), where the move needs
-- it: from what the call read, else read now (a settle's rare move from or to 'queued').
local function task_quota(key, h, ctx, current, new)
  if ctx.quota_at then return h[ctx.quota_at] end
  if current ~= 'queued' and new ~= 'queued' then return nil end
  return redis.call('HGET', key, 'quota')  -- (its hash is still there: folds come last)
end

-- One task's move (`m`: read_move): its template's allowed from-states; the template's
-- `stampf` (if not '') gets Redis's time (`ctx.ts`, formatted once per call); the job's
-- counters change in `tally`. `h`: the fields the call reads (fields_read), read once by
-- fenced_move. Returns previous state, moved (1|0).
local function move(key, id, m, h, ctx, tally)
  local tpl = m.tpl
  local current = h[STATE] or ''
  -- A start (it counts an attempt) this very delivery already made: it moved, once.
  if tpl.attempt and h[ctx.attempts_at + 1] == m.token and m.token ~= '' then
    return current, 1
  end
  if not tpl.allowed[current] then return current, 0 end
  local job, new = h[JOB], tpl.new
  local in_job = job and job ~= ''
  local quota = task_quota(key, h, ctx, current, new)
  if in_job and FOLDED[new] and h[CLAIM] then
    fold(key, h, m, claims_key(ctx, job), ctx.folds)  -- its hash goes: no point writing it
  else
    -- (the template's shared pairs are in its own argument table already: only the move's own
    -- pairs and what follows are written into it, per task)
    local args, own = tpl.args, m.fields
    local n = tpl.shared
    for j = 1, #own do args[n + j] = own[j] end
    n = n + #own
    if tpl.stampf ~= '' then args[n + 1], args[n + 2], n = tpl.stampf, ctx.ts, n + 2 end
    if tpl.attempt then
      args[n + 1], args[n + 2] = 'attempts', count_after(h[ctx.attempts_at])
      args[n + 3], args[n + 4], n = 'started', m.token, n + 4
    end
    args[n + 1], args[n + 2] = 'state', new
    redis.call('HSET', key, unpack(args, 1, n + 2))
  end
  if current == 'queued' and new ~= 'queued' and quota then
    local est = redis.call('HGET', key, 'est')  -- (its hash is still there: folds come last)
    quota_add(quota, -1, -(tonumber(est or '0') or 0))  -- it counted in a quota of its own
  end
  if in_job and current ~= new then
    count_move(tally, job, current, new, quota and true or false)
  end
  if in_job and FOLDED[new] and not FOLDED[current] then count_finished(tally, job, id) end
  return current, 1
end

-- Reads a call's move templates from ARGV at `at` (vlmq/broker/state/tasks.py encode_moves):
-- T, then per template its new state, allowed from-states, stamp field, whether it counts an
-- attempt ('1'), then a count of field/value pairs and the pairs its moves share. Returns
-- the templates and the next `at`.
local function read_templates(at)
  local templates, n = {}, tonumber(ARGV[at])
  at = at + 1
  for i = 1, n do
    local k = tonumber(ARGV[at + 4])
    local fields = read_fields(at + 5, k)
    -- (keyed by the number's text, as each move names it: no number parsed per move)
    -- (`args`: the HSET arguments of its moves, its shared pairs first, reused per task)
    templates[tostring(i)] = {new = ARGV[at], allowed = allowed_set(ARGV[at + 1]),
                              stampf = ARGV[at + 2], attempt = ARGV[at + 3] == '1',
                              args = {unpack(fields)}, shared = #fields,
                              stored = stores(fields)}
    at = at + 5 + 2 * k
  end
  return templates, at
end

-- The fields a call's moves read (`settle`: a settle's, which reads what an end needs whatever
-- the moves are, and the quota only where a move needs it), as the list, how many of it, and
-- where the attempt's fields and the quota are (nil: not read; in either list the attempt's
-- are the last two, the quota right before them).
local function fields_read(templates, settle)
  local ends, attempts = settle, false
  for _, tpl in pairs(templates) do
    ends = ends or FOLDED[tpl.new] ~= nil
    attempts = attempts or tpl.attempt
  end
  local all = #MOVE_FIELDS
  if not ends then return START_FIELDS, #START_FIELDS, #START_FIELDS - 1, #START_FIELDS - 2 end
  if attempts then return MOVE_FIELDS, all, all - 1, all - 2 end
  if settle then return MOVE_FIELDS, NOTIFY, nil, nil end
  return MOVE_FIELDS, all - 2, nil, all - 2
end

-- A move's own fields when it has none (shared, never written to).
local NO_FIELDS = {}

-- Reads one task's move from ARGV at `at` into `m` (one table a call, refilled per task: a
-- move is done with before the next is read): its template (its number, 1-based), token,
-- then a count of its own field/value pairs and the pairs. Returns the next `at`. (The common
-- case, no fields of its own, parses no number and makes no table: per task, each costs a
-- start about as much as a small command's look-up does.)
local function read_move(templates, at, m)
  m.tpl, m.token, m.fields, m.stored = templates[ARGV[at]], ARGV[at + 1], NO_FIELDS, false
  if ARGV[at + 2] == '0' then return at + 3 end
  local k = tonumber(ARGV[at + 2])
  m.fields = read_fields(at + 3, k)
  m.stored = stores(m.fields)
  return at + 3 + 2 * k
end

-- A fed task without a hash ended and was folded: its job's record says how, and which
-- delivery's result it kept. Returns its state and that delivery ('' none), or nil.
local function folded_record(id, ctx)
  if not is_fed_id(id) then return nil end
  local number, claim, sub = string.match(id, '^(%d+)%.([0-9a-f]+)%.([0-9a-f]+)$')
  local job = redis.call('GET', ctx.refs .. number)
  if not job then return nil end
  local record = redis.call('HGET', claims_key(ctx, job), claim)
  if not record then return nil end
  local by, code, delivery = string.match(record, '^(%S+) (%a)(%d*)')
  if by ~= sub or not code then return nil end
  return FOLDED_STATE[code], delivery
end

-- A fenced move: refused for a holder whose delivery `m.token` is no longer the task's (''
-- = unfenced: producers); counts an attempt when it moves. Returns previous state, moved
-- (1|0), held (1|0), the hash's fields the call reads before it, and what the task's
-- delivery count is now: the number, 'ended' (the task ended and was folded without this
-- delivery's result: nothing of this holder's is the task's) or '' (unknown). A task folded
-- by this very delivery (its own earlier settle) reads as held, never as someone else's.
local function fenced_move(key, id, m, ctx, tally)
  -- (a task twice in one call: its first move's fold is written before its second is read)
  if ctx.folds.deleting[key] then write_folds(ctx.folds) end
  local h = redis.call('HMGET', key, unpack(ctx.read, 1, ctx.reads))
  if m.token ~= '' and h[DELIVERIES] ~= m.token then
    if h[DELIVERIES] then return h[STATE] or '', 0, 0, h, h[DELIVERIES] end
    if #ctx.folds.keys > 0 then write_folds(ctx.folds) end  -- its record may be among them
    local state, delivery = folded_record(id, ctx)
    if not state then return '', 0, 0, h, '' end
    if delivery == m.token then return state, 0, 1, h, delivery end
    return state, 0, 0, h, 'ended'
  end
  local previous, moved = move(key, id, m, h, ctx, tally)
  -- Someone waits for this task's end (an API process answering a call synchronously).
  if moved == 1 and FOLDED[m.tpl.new] and h[NOTIFY] then redis.call('PUBLISH', h[NOTIFY], id) end
  return previous, moved, 1, h, h[DELIVERIES] or ''
end

-- A move's reply for one task, appended to a call's flat list of them. (Redis turns each table
-- of a script's reply into the client's protocol with seven look-ups of its own, for the reply
-- types a table may stand for: a table per task cost a 32-task call ~15 us.)
local function reply_row(replies, previous, moved, held, current)
  local n = #replies
  replies[n + 1], replies[n + 2], replies[n + 3], replies[n + 4] = previous, moved, held, current
end

-- transition: producers and the worker's start. KEYS[1] events list, KEYS[2..] task hashes.
-- ARGV: job key prefix, job-ref key prefix, ttl seconds, the move templates (read_templates),
-- then per task its id and its move (read_move). Returns previous, moved, held, current per
-- task (fenced_move), one flat list (reply_row); a fenced-out move is not applied. Called with
-- a call id (a retried start counts one attempt; a retried cancel answers what it did).
function commands.transition()
  local t = now()
  local ctx = {jobs = ARGV[2], refs = ARGV[3], ttl = tonumber(ARGV[4]), t = t, ts = stamp(t),
               events = KEYS[1], folds = new_folds(), claims = {}}
  local templates, at = read_templates(5)
  ctx.read, ctx.reads, ctx.attempts_at, ctx.quota_at = fields_read(templates, false)
  local replies, tally, m = {}, new_tally(), {}
  for i = 2, #KEYS do
    local id = ARGV[at]
    at = read_move(templates, at + 1, m)
    local previous, moved, held, _, current = fenced_move(KEYS[i], id, m, ctx, tally)
    reply_row(replies, previous, moved, held, current)
  end
  write_folds(ctx.folds)
  apply_tally(tally, ctx)
  return replies
end

-- start: the worker's move of held tasks to running right before its engine call, one
-- attempt each: transition's arguments and reply. Safe to repeat: a start this very delivery
-- made ('started' is its token) reads as moved and counts no second attempt.
commands.start = commands.transition

-- settle: terminal transitions and acknowledgements of held tasks, one step (allow-oom).
-- KEYS[1..5] bookkeeping, KEYS[6] events list, KEYS[7..] task hashes. ARGV: job key prefix,
-- job-ref key prefix, ttl seconds, usage key prefix, usage-tenants set, the usage groups
-- (read_usage_groups), the move templates (read_templates), then per task its id, its move
-- (read_move), its usage group (0: none) and its own usage values. Returns previous, moved,
-- held, current per task (one flat list, as transition's): a holder that was fenced out
-- (held 0) changes nothing, and its result never becomes the task's (nor counts in usage); a
-- task that ended meanwhile is forgotten from the in-flight set either way. Safe to repeat: a
-- task its first run ended reads as this holder's (its state terminal, or its fold record
-- naming this delivery), moved no further, counted once.
function commands.settle()
  local t = now()
  local ctx = {jobs = ARGV[2], refs = ARGV[3], ttl = tonumber(ARGV[4]), t = t, ts = stamp(t),
               events = KEYS[6], keep = true, folds = new_folds(), claims = {}}
  local groups, at = read_usage_groups(7)
  local templates
  templates, at = read_templates(at)
  -- (a settle reads what an end needs even for a move that is not one: its usage names the
  -- task's own tenant)
  ctx.read, ctx.reads, ctx.attempts_at, ctx.quota_at = fields_read(templates, true)
  local replies, tally, settled, m = {}, new_tally(), {}, {}
  for i = 7, #KEYS do
    local id = ARGV[at]
    at = read_move(templates, at + 1, m)
    local group, own = groups[ARGV[at]], ARGV[at + 1]
    at = at + 2
    local previous, moved, held, h, current = fenced_move(KEYS[i], id, m, ctx, tally)
    if held == 1 or current == 'ended' then settled[#settled + 1] = id end
    if group and held == 1 and moved == 1 then note_usage(group, h[JOB], h[TENANT], own) end
    reply_row(replies, previous, moved, held, current)
  end
  forget_all(settled)
  local sums = new_sums()
  count_groups(sums, groups, ctx.jobs, ARGV[5])
  write_sums(sums, ARGV[6], ctx.ttl)
  write_folds(ctx.folds)
  apply_tally(tally, ctx)
  return replies
end

-- mark_alone: a task delivered again without ever starting (its holder died before it ran,
-- perhaps because of it) is prepared alone, after its batch-mates are settled; this counts
-- the times it went alone, once per delivery (safe to repeat); a delivery alone that its holder
-- returned (gave back, handed on) is taken off again (intake.lua, returned). A task that killed
-- its worker each time it was alone is dead-lettered, and only it (workers/fleet/suspects.py).
-- KEYS[1] task hash. ARGV: token. Returns the count.
function commands.mark_alone()
  local h = redis.call('HMGET', KEYS[1], 'deliveries', 'alone_token', 'alone')
  if h[1] ~= ARGV[2] or h[2] == ARGV[2] then return tonumber(h[3] or '0') end
  redis.call('HSET', KEYS[1], 'alone_token', ARGV[2])
  return redis.call('HINCRBY', KEYS[1], 'alone', 1)
end

-- outlived: holders that ran a delivery and learned it was superseded while it ran (its lease
-- lapsed on a starved host, and the task went to another holder) did not die; they say so,
-- and that run is not counted toward the poison verdict (max_deliveries, workers/fleet/
-- triage.py: attempts less 'outlived'). Once per delivery, safe to repeat: 'outlived_at' is
-- the newest delivery counted, and an older one reported after it is not counted (the verdict
-- errs toward a death). A task that ended (no hash) is left alone. KEYS: task hashes.
-- ARGV: one token per key. Returns how many it counted.
function commands.outlived()
  local counted = 0
  for i = 1, #KEYS do
    local token = tonumber(ARGV[i + 1])
    local h = redis.call('HMGET', KEYS[i], 'deliveries', 'outlived_at')
    if h[1] and token < tonumber(h[1]) and token > (tonumber(h[2] or '0') or 0) then
      redis.call('HSET', KEYS[i], 'outlived_at', ARGV[i + 1])
      redis.call('HINCRBY', KEYS[i], 'outlived', 1)
      counted = counted + 1
    end
  end
  return counted
end

-- dead_letter: record why a task was given up (the dead-letter list keeps the newest `cap`).
-- KEYS[1] dead-letter list. ARGV: record, cap. Called with a call id.
function commands.dead_letter()
  redis.call('LPUSH', KEYS[1], ARGV[2])
  redis.call('LTRIM', KEYS[1], 0, math.max(0, tonumber(ARGV[3]) - 1))
  return 1
end
