-- uses common.lua: call_many, field_index, now, read_many, read_names, stamp;
--      tenants.lua: admit, queued_by, quota_add; intake.lua: activate
-- jobs and feeds: opening, sealing and finishing jobs; enqueueing and feeding their tasks ----

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

-- A job's keys live while the job does: every script that writes one of them gives them all
-- their ttl again (a job draining for longer than the ttl keeps its state; none is re-created
-- without one). `refs`: Keys.job_ref_prefix.
local function keep_job(jobkey, ttl, refs)
  local seq = redis.call('HGET', jobkey, 'seq')
  local keys = {jobkey, jobkey .. JOB_KEYS.claims, jobkey .. JOB_KEYS.tasks,
                jobkey .. JOB_KEYS.finished}
  for _, key in ipairs(keys) do
    redis.call('EXPIRE', key, ttl)
  end
  if seq then redis.call('EXPIRE', refs .. seq, ttl) end
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
-- submitter is adding. Safe to repeat. KEYS[1] job hash, KEYS[2] events list. ARGV: job id,
-- lines, submission id, complete ('1' | '0'), invalid lines.
function commands.seal()
  redis.call('HDEL', KEYS[1], 'sub:' .. ARGV[4])
  if ARGV[5] == '1' then
    redis.call('HSET', KEYS[1], 'sealed', '1', 'lines', ARGV[3], 'line_errors', ARGV[6])
  end
  finish_check(KEYS[1], ARGV[2], now(), KEYS[2])
  return 1
end

-- reap_submitters: look again at jobs whose latest submitter lease lapsed (a submitter that
-- crashed before sealing must not keep a finished job open forever). Safe to repeat.
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
-- job lists (`job_lists`), counts them in each pair's tenant active-jobs zset
-- (KEYS[base + 2*pair + 1]).
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

-- A new queued task's hash: its status fields (values '' are left unset; 'tag' among them,
-- the message's: intake.lua, identity) on Redis's clock (created when queued: queued_at says
-- both, stamp(t) of the call; each field costs the listpack a scan), and its ttl, `ttl`
-- seconds from `t`. `shared`: the pairs every task of the call has (read_names).
-- A call's tasks share one argument table, their common part written once (task_args): a
-- table made and grown per task cost a feed ~10,000 instructions a task. The ttl is one
-- absolute time per call (PEXPIREAT, which the AOF copies as it is: it turns a relative
-- EXPIRE into one, per task).
local function task_args(t, ttl, shared)
  local args = {'state', 'queued', 'queued_at', stamp(t), unpack(shared)}
  return {args = args, fixed = #args, expire_at = string.format('%d', (t + ttl) * 1000)}
end

local function create_task(key, names, at, common)
  local args, n = common.args, common.fixed
  for j = 1, #names do
    local value = ARGV[at + j - 1]
    if value ~= '' then
      args[n + 1], args[n + 2], n = names[j], value, n + 2
    end
  end
  redis.call('HSET', key, unpack(args, 1, n))
  redis.call('PEXPIREAT', key, common.expire_at)
end

-- submit: tasks of a job whose ids are the caller's (Client.submit_many), all or nothing: each
-- gets its status hash, its message pushed, its id on the job's task list, and is counted.
-- KEYS[1] job hash, KEYS[2] job task list, KEYS[3] submitting zset, KEYS[4] job-list depth
-- hash, then per modality class its job list and its tenant's active-jobs zset (pairs), then
-- one task hash per task. ARGV: job id, ttl seconds, submission id, submitter lease seconds,
-- task key prefix, number of class pairs, job-ref key prefix, then F and the F status field
-- names; then per task: class pair (1-based), the F field values ('' unset), message. Returns
-- the number enqueued. Called with a call id.
function commands.submit()
  local t = now()
  local jobkey, tasks = KEYS[1], KEYS[2]
  local job, ttl, sub, prefix = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[6]
  local pairs_n = tonumber(ARGV[7])
  local names, shared, at = read_names(9)
  local first_task, pushed, ids, tokens = 5 + 2 * pairs_n, {}, {}, 0
  local common = task_args(t, ttl, shared)
  local est_at = field_index(names, 'est')
  for i = first_task, #KEYS do
    local pair = tonumber(ARGV[at])
    create_task(KEYS[i], names, at + 1, common)
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
  keep_job(jobkey, ttl, ARGV[8])
  return added
end

-- enqueue: tasks outside any job's own list (Client.submit, the interactive lane, and a plain
-- bulk queue's tasks), all or nothing: each gets its status hash (counted in its tenant's quota
-- itself: its 'quota' field), its message pushed; a task of a job is counted in the job and
-- listed on the job's task list. KEYS[1] the tenant's quota hash, then L lists, then J pairs of
-- (job hash, job task list), then one task hash per task. ARGV: ttl seconds, task key prefix,
-- job-ref key prefix, L, J, F and the F status field names; then per task: list (1-based),
-- job pair (0: none), the F values ('' unset), message. Returns the number enqueued. Called
-- with a call id.
function commands.enqueue()
  local t = now()
  local ttl, prefix, refs = tonumber(ARGV[2]), ARGV[3], ARGV[4]
  local lists_n, jobs_n = tonumber(ARGV[5]), tonumber(ARGV[6])
  local names, shared, at = read_names(7)
  local first_task = 2 + lists_n + 2 * jobs_n
  local est_at = field_index(names, 'est')
  local pushed, listed, counted, tokens = {}, {}, {}, 0
  local common = task_args(t, ttl, shared)
  for i = first_task, #KEYS do
    local list, pair = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
    create_task(KEYS[i], names, at + 2, common)
    if est_at then tokens = tokens + (tonumber(ARGV[at + 1 + est_at]) or 0) end
    local messages = pushed[list] or {}
    messages[#messages + 1] = ARGV[at + 2 + #names]
    pushed[list] = messages
    if pair > 0 then
      local ids = listed[pair] or {}
      ids[#ids + 1] = string.sub(KEYS[i], #prefix + 1)
      listed[pair] = ids
      counted[pair] = (counted[pair] or 0) + 1
    end
    at = at + 3 + #names
  end
  for list, messages in pairs(pushed) do call_many('LPUSH', KEYS[1 + list], messages, 1) end
  for pair, ids in pairs(listed) do
    local jobkey = KEYS[2 + lists_n + 2 * (pair - 1)]
    call_many('RPUSH', KEYS[3 + lists_n + 2 * (pair - 1)], ids, 1)
    redis.call('HINCRBY', jobkey, 'total', counted[pair])
    queued_by(jobkey, counted[pair], 0)  -- each counts in its own quota, below
    keep_job(jobkey, ttl, refs)
  end
  local added = #KEYS - first_task + 1
  quota_add(KEYS[1], added, tokens)
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
-- its lines (0: not estimated), the submission's lines read and invalid lines. The feed holds
-- the whole submission, so the job is sealed in the same step: a submitter interrupted or
-- killed from here on leaves a job that finishes once its lines have run. Called with a
-- call id.
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
  redis.call('HSET', KEYS[1], 'sealed', '1', 'lines', ARGV[11], 'line_errors', ARGV[12])
  redis.call('EXPIRE', KEYS[1], ttl)
  return lines
end

-- take_feeds: KEYS[1] feeds zset. ARGV: lease seconds, most to take. Feeds whose lease is free
-- or lapsed (a feeder that died) are leased to the caller. Returns their feed ids. Called with
-- a call id (a retry answers the same feeds, which its first run leased).
function commands.take_feeds()
  local t = now()
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', t, 'LIMIT', 0, tonumber(ARGV[3]))
  for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], 'XX', t + tonumber(ARGV[2]), id) end
  return ids
end

-- release_feed: KEYS[1] feeds zset. ARGV: feed id. The feeder is done with it for now (safe
-- to repeat).
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
-- ARGV: job id, feed id, state (cancelled | expired | failed). Returns the lines dropped.
-- Called with a call id (a retry answers the count its first run dropped).
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
-- job-list depth hash, KEYS[6] events list, then per modality class its list and its tenant's
-- active-jobs zset (pairs), then one task hash per line. ARGV: job id, ttl seconds, submission
-- id, feed id, task key prefix, expected cursor, new cursor, lines consumed (each was
-- counted), number of class pairs, whether the pairs' lists are job lists ('1') or the
-- interactive lane's ('0'), job-ref key prefix, F and the F status field names; then per line:
-- claim, class pair, F values, message. Returns {status, codes}: status 'fed' | 'stale' |
-- 'cancelled' | 'expired'; a code per line 'q' enqueued, 's' skipped, 'd' duplicate. Called
-- with a call id (a retry answers what its first run did, not 'stale').
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
  local names, shared, at = read_names(13)
  local first_task, codes, pushed, dropped = 7 + 2 * pairs_n, {}, {}, 0
  local claimed, new_claims = {}, {}  -- claims this chunk makes, written in one call
  local fed, fed_bytes = 0, 0  -- messages pushed and their bytes (the feeder's byte window)
  local common, wanted = task_args(t, ttl, shared), {}
  -- Every line's claim record as it was before this chunk, read in one call.
  for i = first_task, #KEYS do wanted[#wanted + 1] = ARGV[at + (i - first_task) * (3 + #names)] end
  local records = read_many('HMGET', claims, wanted)
  for i = first_task, #KEYS do
    local claim, pair = ARGV[at], tonumber(ARGV[at + 1])
    local code = 'q'
    local record = claimed[claim] and sub or records[i - first_task + 1]
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
      create_task(KEYS[i], names, at + 2, common)
      push(pair, ARGV[at + 2 + #names], pushed)
      fed, fed_bytes = fed + 1, fed_bytes + #ARGV[at + 2 + #names]
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
  if fed > 0 then
    redis.call('HINCRBY', jobkey, 'fed_lines', fed)
    redis.call('HINCRBY', jobkey, 'fed_bytes', fed_bytes)
  end
  local left = redis.call('HINCRBY', feedkey, 'left', -consumed)
  redis.call('HSET', feedkey, 'cursor', ARGV[8])
  if left <= 0 then forget_feed(jobkey, feedkey, KEYS[4], feed) end
  keep_job(jobkey, ttl, ARGV[12])
  finish_check(jobkey, job, t, KEYS[6])
  return {'fed', codes}
end
