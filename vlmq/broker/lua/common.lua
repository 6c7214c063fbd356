-- uses nothing from the other files
-- vlmq's Redis scripts: one function library made of one file per concern, whose functions
-- run through one dispatch (vlmq/broker/scripts.py concatenates the files in this order:
-- common, layouts, tenants, intake, jobs, tasks, events, dispatch, and loads them with
-- FUNCTION LOAD).
-- ARGV[1] names the command; the rest of ARGV and KEYS are the command's own (documented above
-- each one). Registered twice, once refused under maxmemory and once with allow-oom (the
-- commands that settle, give back or renew work must run when Redis is full, or a full fleet
-- could never drain); a function is refused or run whole, never half-applied.
--
-- Rules: every key arrives in KEYS; a key learned while running (the hash of a task just
-- pulled, a task's job) is a prefix from Keys (ARGV) plus the id, and a job's own keys that
-- job's name plus a suffix of JOB_KEYS (config/keys.py JOB_SUFFIXES, put before this file by
-- vlmq/broker/scripts.py). Time is Redis's own (now()), so a worker with a skewed clock
-- neither takes live work nor keeps dead work. A delivery's token is the task's delivery
-- count at pull (the hash's 'deliveries'); a holder whose token is no longer the count was
-- superseded and every fenced write of it is refused. A command that is not safe to repeat
-- is called with a call id (dispatch.lua): a retry of the same call answers what the first
-- run answered and changes nothing.
--
-- A library, not a script: Redis runs a script's whole text at each EVALSHA (defining every
-- function and table below: ~177,000 instructions a call, measured), a library's once, at
-- FUNCTION LOAD. Its top level therefore runs where only `redis` is reachable (no string,
-- table or cjson: those are for the functions' bodies). KEYS and ARGV are the current call's
-- (dispatch.lua sets them), as they are a script's.
local KEYS, ARGV

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Redis's time as stored (microseconds). A script formats it once per call, not per task:
-- a float's formatting costs about as much as a small command; and any number handed to
-- redis.call is formatted on the way (%.17g), so what a call writes per task is a string.
local function stamp(t) return string.format('%.6f', t) end

local function csv_set(text)
  local set = {}
  for item in string.gmatch(text or '', '([^,]+)') do set[item] = true end
  return set
end

-- Calls `command key item...` over `items` in slices (Lua's stack bounds one call's
-- arguments): one call per slice instead of one per item. `option` (if given) goes before
-- the items (ZADD's XX).
local function call_many(command, key, items, width, option)
  local step = 960 * width
  for i = 1, #items, step do
    local last = math.min(i + step - 1, #items)
    if option then
      redis.call(command, key, option, unpack(items, i, last))
    else
      redis.call(command, key, unpack(items, i, last))
    end
  end
end

-- `command key item...` over `items` in slices, for a command that answers one value per
-- item (HMGET, ZMSCORE): the answers in the items' order. One call per slice: each
-- redis.call costs about as much again as a small command does.
local function read_many(command, key, items)
  local out = {}
  for i = 1, #items, 960 do
    local got = redis.call(command, key, unpack(items, i, math.min(i + 959, #items)))
    for j = 1, #got do out[i + j - 1] = got[j] end
  end
  return out
end

-- Redis keeps a small hash or zset (up to 128 entries, each up to 64 bytes: *-max-listpack-*)
-- as one listpack, where every field a write or read names is found by a linear scan, and a
-- zset's place for a new member by parsing each score back from its text. The in-flight
-- bookkeeping is written and read 32-64 entries at a time; at a fleet's usual size (a few
-- workers, ~100 leases) that made a pull's ZADD of 32 leases cost ~40x what it costs a
-- skiplist (measured: 883 us against 22; HSET of 32 fields 55 us against 8). So a key of it
-- is kept wide whatever its size: when it is compact (new, or reloaded small after a restart)
-- a long anchor entry is added, which converts it (Redis never converts it back while it
-- lives), and taken out again before the script ends (unanchor). No task id has a ':'.
-- (90 dashes, spelled out: string.rep is not reachable at a library's load)
local WIDE_ANCHOR = 'vlmq:wide:' .. '---------------------------------------------'
  .. '---------------------------------------------'
local COMPACT = {listpack = true, ziplist = true}

-- Widens each of `keys` (kind: 'hash' | 'zset') that is compact or absent; returns the
-- keys that got the anchor, for unanchor. (An ACL that denies OBJECT leaves them as they are:
-- slower, never wrong.)
local function widen(keys, kinds)
  local anchored = {}
  for i, key in ipairs(keys) do
    local encoding = redis.pcall('OBJECT', 'ENCODING', key)
    if type(encoding) == 'table' and encoding.err then return anchored end
    if not encoding or COMPACT[encoding] then
      if kinds[i] == 'zset' then
        redis.call('ZADD', key, 0, WIDE_ANCHOR)
      else
        redis.call('HSET', key, WIDE_ANCHOR, '1')
      end
      anchored[#anchored + 1] = {key, kinds[i]}
    end
  end
  return anchored
end

local function unanchor(anchored)
  for _, a in ipairs(anchored) do
    redis.call(a[2] == 'zset' and 'ZREM' or 'HDEL', a[1], WIDE_ANCHOR)
  end
end

-- A plain id: 1-128 of [A-Za-z0-9_.-], not made of dots only (config/ids.py ID_PATTERN: the
-- same rule on both sides; '..' would name a folder of the result store).
local function plain(id)
  return type(id) == 'string' and #id >= 1 and #id <= 128
    and string.match(id, '^[%w_.%-]+$') ~= nil and string.match(id, '^%.+$') == nil
end

-- A fed task's id: its job's number, the claim of its custom_id, its submission
-- (config/ids.py fed_task_id). Such a task has a hash from the moment it is fed until it
-- ends; then it is folded into its job: a copy of one without a hash has ended.
local function is_fed_id(id)
  return string.match(id, '^%d+%.[0-9a-f]+%.[0-9a-f]+$') ~= nil
end

-- The position of `name` among the status field names (1-based), or nil.
local function field_index(names, name)
  for i, n in ipairs(names) do if n == name then return i end end
  return nil
end

-- `k` name/value pairs from ARGV at `at`, as one flat list, less those named `except` (if
-- given).
local function read_pairs(at, k, except)
  local pairs_read = {}
  for j = at, at + 2 * k - 1, 2 do
    if ARGV[j] ~= except then
      pairs_read[#pairs_read + 1] = ARGV[j]
      pairs_read[#pairs_read + 1] = ARGV[j + 1]
    end
  end
  return pairs_read
end

-- Reads the status fields' layout from ARGV at `at` (vlmq/broker/state/jobs.py
-- status_layout): a count F, then the F names each task sends a value for, then a count S and
-- S name/value pairs every task of the call has (its job, class, expiry: sent once). Returns
-- the names, the shared pairs and the next `at`.
local function read_names(at)
  local names, nf = {}, tonumber(ARGV[at])
  for i = 1, nf do names[i] = ARGV[at + i] end
  at = at + nf + 1
  local ns = tonumber(ARGV[at])
  return names, read_pairs(at + 1, ns), at + 2 * ns + 1
end

local commands = {}
-- How a command's reply is kept for a retry of the same call and answered again
-- (dispatch.lua); a command without an entry keeps its reply as JSON; an entry's keep may
-- answer nil for a reply that need not be kept (the call changed nothing).
local replays = {}
