-- uses nothing from the other files
-- layouts: the fleet-wide switch between task layouts (vlmq/broker/layouts.py). LAYOUT, the
-- newest layout this library reads and writes, is put before the files by
-- vlmq/broker/scripts.py. Old and new versions share a Redis during an update, each with its
-- own library: while a newer layout is in force (Keys.layout; absent: 1) this library refuses
-- every call (the dispatch asks layout_refusal first), so an older process never reads or
-- writes a task it cannot understand, and a layout is raised only once every live worker's
-- record lists it.

-- Why a call is refused (an error reply's text: its first word is the code
-- vlmq/broker/scripts.py knows it by), or nil when this library reads the layout in force.
local function layout_refusal(key)
  local raw = redis.call('GET', key) or '1'
  local in_force = tonumber(raw)
  if in_force and in_force <= LAYOUT then return nil end
  -- (a value that is not a number was not written by raise_layout: nothing is read by it)
  return 'UNREADABLE layout ' .. raw .. ' is in force and this version of vlmq reads '
    .. 'layouts up to ' .. LAYOUT .. ': update this process (docs/deploy.md, Upgrades)'
end

-- Whether a worker's record lists `layout`; a record without the list (a version older than
-- the switch) or one that cannot be read reads layout 1 only.
local function reads_layout(raw, layout)
  local ok, record = pcall(cjson.decode, raw)
  local reads = ok and type(record) == 'table' and record.layouts
  if type(reads) ~= 'table' then return layout == 1 end
  for _, each in ipairs(reads) do
    if tonumber(each) == layout then return true end
  end
  return false
end

-- raise_layout: put a newer layout in force (safe to repeat). KEYS[1] the layout key,
-- KEYS[2] the workers' records (name -> record). ARGV: the layout. Refused while a live
-- worker's record does not list it; never lowers (tasks of the newer layout may be in Redis,
-- and an older library cannot read them). Returns the layout in force after the call and the
-- names of the workers that kept it from being raised.
function commands.raise_layout()
  local wanted = tonumber(ARGV[2])
  local in_force = tonumber(redis.call('GET', KEYS[1]) or '1')  -- (a number: dispatch checked)
  if wanted <= in_force then return {in_force, {}} end
  if wanted > LAYOUT then
    return redis.error_reply('ERR this version of vlmq does not know layout ' .. wanted)
  end
  local records = redis.call('HGETALL', KEYS[2])
  local behind = {}
  for i = 1, #records, 2 do
    if not reads_layout(records[i + 1], wanted) then behind[#behind + 1] = records[i] end
  end
  if #behind > 0 then return {in_force, behind} end
  redis.call('SET', KEYS[1], wanted)
  return {wanted, {}}
end
