-- uses layouts.lua: layout_refusal
-- dispatch: run the command ARGV[1] names. The last three ARGV belong to the dispatch and are
-- taken off (from the end: no shifting) before the command reads ARGV: the layout key
-- (Keys.layout: no call runs while a layout newer than this library's is in force), the
-- call's replay key (Keys.call: '' for a command that is safe to repeat) and how long it is
-- kept. A command that is not safe to repeat is called with a call id the caller chose, the
-- same for every retry of that call (redis-py resends a command whose reply a reset lost; a
-- caller's own retry reuses it too): the first run keeps its reply under the key, in the
-- same atomic step as its effect, and a retry answers that reply and changes nothing.

local function keep(name, reply)
  local replay = replays[name]
  if replay then return replay.keep(reply) end
  return cjson.encode(reply)
end

local function answer(name, kept)
  local replay = replays[name]
  if replay then return replay.answer(kept) end
  return cjson.decode(kept)
end

local function run()
  local replay_ttl = ARGV[#ARGV]  -- seconds, as ARGV has them
  ARGV[#ARGV] = nil
  local replay_key = ARGV[#ARGV]
  ARGV[#ARGV] = nil
  local refused = layout_refusal(ARGV[#ARGV])
  ARGV[#ARGV] = nil
  if refused then return redis.error_reply(refused) end
  local name = ARGV[1]
  if replay_key ~= '' then
    local kept = redis.call('GET', replay_key)
    if kept then return answer(name, kept) end
  end
  local reply = commands[name]()
  if replay_key ~= '' then
    local kept = keep(name, reply)
    -- (nil: the call changed nothing, and a retry may simply run it again)
    if kept then redis.call('SET', replay_key, kept, 'EX', replay_ttl) end
  end
  return reply
end

-- A call of either function: KEYS and ARGV (common.lua) are this call's while it runs, and
-- let go after it (a feed's ARGV holds its chunk of messages).
local function dispatch(keys, args)
  KEYS, ARGV = keys, args
  local reply = run()
  KEYS, ARGV = nil, nil
  return reply
end

-- The library's two functions (vlmq/broker/scripts.py `library` names them for the library's
-- text, so every version's functions are its own): `NAME`, refused whole while Redis is over
-- maxmemory, and `NAME_oom`, for the commands that must run then.
local function register(name)
  redis.register_function{function_name = name, callback = dispatch}
  redis.register_function{function_name = name .. '_oom', callback = dispatch,
                          flags = {'allow-oom'}}
end
