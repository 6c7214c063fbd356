-- The least per-task state, kept as a hash per task: enqueue. KEYS[1] queue list.
-- ARGV: job id, task ttl seconds, then per task its id, tag and message. Creates each task's
-- status hash (what vlmq's status readers need: state, job, class, queue, expiry, tag,
-- custom_id, delivery count) with its ttl, pushes the messages in one call, counts the job.
local job, ttl = ARGV[1], ARGV[2]
local messages = {}
for i = 3, #ARGV, 3 do
  local key = 'floor:task:' .. ARGV[i]
  redis.call('HSET', key, 'state', 'queued', 'job_id', job, 'modality', 'text',
             'queue', 'vlmq.text', 'expires_at', '1999999999.000000', 'tag', ARGV[i + 1],
             'custom_id', 'c' .. ARGV[i], 'deliveries', '0')
  redis.call('EXPIRE', key, ttl)
  messages[#messages + 1] = ARGV[i + 2]
end
redis.call('LPUSH', KEYS[1], unpack(messages))
redis.call('HINCRBY', 'floor:job:' .. job, 'queued', #messages)
return #messages
