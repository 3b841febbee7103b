/*
 * The Lua scripts behind publish, renew, unpublish and admin removal.
 *
 * Each touches only KEYS[1] (the segment hash, sx:NS:seg:{N}) and KEYS[2]
 * (the fence set, sx:NS:fence:{N}), which share the hash tag {N}, so a
 * script is atomic and valid in Redis Cluster.  The listing index lives in
 * another slot and is updated by the client with a separate command, after
 * every publish but after a renewal only when the renew script says the
 * entry is due (field ix, below): on a cluster that command goes to another
 * master, so writing it on every renewal doubled the commands per renewal.  So
 * does the event channel on a cluster (sharded pub/sub, another slot): there
 * the channel argument is empty, the scripts publish nothing, and unpublish
 * and removal hand the stored delete event back for the client to SPUBLISH.
 *
 * Times come from the server's TIME, so that lease ages do not depend on
 * client clocks.  Generations are compared as decimal strings (Lua numbers
 * are doubles and cannot hold every uint64).  Every reply is an array whose
 * first element is a status word the client checks before anything else.
 *
 * The events a script publishes are encoded by the client (protobuf); the
 * delete event of the current holder is stored with the segment (field xd)
 * at publish, so unpublish and admin removal can announce it without
 * decoding anything in Lua.
 */
#include "redis.h"

/* Server time in milliseconds as an exact decimal string. */
#define LUA_NOW                                                                \
  "local t = redis.call('TIME')\n"                                             \
  "local now = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))\n"

/* Publish: ARGV = inc_hex, generation, value, lease_ms, takeover(0|1),
 * put_event, delete_event, channel ('' = do not publish), fence_ttl_ms.
 * Replies: {OK, now} | {FENCED} | {HELD, inc, age_ms, ttl_ms} |
 * {GENERATION, current}. */
static const char publish_lua[] =
    LUA_NOW
    "if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {'FENCED'} end\n"
    "if redis.call('TYPE', KEYS[1]).ok == 'hash' then\n"
    "  local cur = redis.call('HMGET', KEYS[1], 'inc', 'gen', 'ren')\n"
    "  if cur[1] and cur[1] ~= ARGV[1] then\n"
    "    if ARGV[5] ~= '1' then\n"
    "      local age = tonumber(now) - (tonumber(cur[3] or now) or tonumber(now))\n"
    "      return {'HELD', cur[1], tostring(age), tostring(redis.call('PTTL', KEYS[1]))}\n"
    "    end\n"
    "    redis.call('SADD', KEYS[2], cur[1])\n"
    "    redis.call('PEXPIRE', KEYS[2], ARGV[9])\n"
    "  elseif cur[1] then\n"
    "    local g, h = ARGV[2], cur[2] or '0'\n"
    "    if #g < #h or (#g == #h and g <= h) then return {'GENERATION', h} end\n"
    "  end\n"
    "end\n"
    "redis.call('DEL', KEYS[1])\n"
    "redis.call('HSET', KEYS[1], 'd', ARGV[3], 'inc', ARGV[1], 'gen', ARGV[2],\n"
    "           'pub', now, 'ren', now, 'lease', ARGV[4], 'xd', ARGV[7], 'ix', now)\n"
    "redis.call('PEXPIRE', KEYS[1], ARGV[4])\n"
    "if ARGV[8] ~= '' then redis.call('PUBLISH', ARGV[8], ARGV[6]) end\n"
    "return {'OK', now}\n";

/* Renew: ARGV = inc_hex, lease_ms, refresh_ms (absent or 0: every renewal).
 * Replies: {OK, now, due} | {GONE} | {FENCED, holder_or_empty}.
 *
 * due is '1' when the client is to write the listing index entry: the
 * segment's field ix (server ms of the last renewal or publish that said
 * so) is missing (a value written before ix existed, or by an older
 * client), older than refresh_ms, or in the future (the server's clock went
 * back); and always when the lease is not shorter than refresh_ms (such
 * renewals are that far apart anyway).  A due renewal sets ix to now, in the
 * same atomic step that decides it.  Times are compared as numbers: ms
 * since the epoch are exact in a double until the year 287396. */
static const char renew_lua[] =
    LUA_NOW
    "if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {'FENCED', ''} end\n"
    "if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then\n"
    "  if redis.call('EXISTS', KEYS[1]) == 1 then return {'FENCED', ''} end\n"
    "  return {'GONE'}\n"
    "end\n"
    "local cur = redis.call('HMGET', KEYS[1], 'inc', 'ix')\n"
    "if cur[1] ~= ARGV[1] then return {'FENCED', cur[1] or ''} end\n"
    "redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
    "local every, due = tonumber(ARGV[3] or '0') or 0, '1'\n"
    "if every > 0 and (tonumber(ARGV[2]) or 0) < every then\n"
    "  local ix, t = tonumber(cur[2] or ''), tonumber(now)\n"
    "  if ix and ix <= t and t - ix < every then due = '0' end\n"
    "end\n"
    "if due == '1' then\n"
    "  redis.call('HSET', KEYS[1], 'ren', now, 'lease', ARGV[2], 'ix', now)\n"
    "else\n"
    "  redis.call('HSET', KEYS[1], 'ren', now, 'lease', ARGV[2])\n"
    "end\n"
    "return {'OK', now, due}\n";

/* Unpublish: ARGV = inc_hex, channel ('' = do not publish).
 * Replies: {OK, delete_event_or_empty} | {GONE} | {FENCED, holder_or_empty}. */
static const char unpublish_lua[] =
    "if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return {'FENCED', ''} end\n"
    "if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then\n"
    "  if redis.call('EXISTS', KEYS[1]) == 1 then return {'FENCED', ''} end\n"
    "  return {'GONE'}\n"
    "end\n"
    "local cur = redis.call('HMGET', KEYS[1], 'inc', 'xd')\n"
    "if cur[1] ~= ARGV[1] then return {'FENCED', cur[1] or ''} end\n"
    "redis.call('DEL', KEYS[1])\n"
    "if cur[2] and ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], cur[2]) end\n"
    "return {'OK', cur[2] or ''}\n";

/* Admin removal: ARGV = channel ('' = do not publish), fence_ttl_ms.
 * Deletes whatever is stored (also a value of the wrong type) and fences
 * the holder's incarnation.
 * Replies: {OK, holder_or_empty, delete_event_or_empty} | {NOENT}. */
static const char remove_lua[] =
    "local ty = redis.call('TYPE', KEYS[1]).ok\n"
    "if ty == 'none' then return {'NOENT'} end\n"
    "local inc, ev = false, false\n"
    "if ty == 'hash' then\n"
    "  local cur = redis.call('HMGET', KEYS[1], 'inc', 'xd')\n"
    "  inc, ev = cur[1], cur[2]\n"
    "end\n"
    "if inc then\n"
    "  redis.call('SADD', KEYS[2], inc)\n"
    "  redis.call('PEXPIRE', KEYS[2], ARGV[2])\n"
    "end\n"
    "redis.call('DEL', KEYS[1])\n"
    "if ev and ARGV[1] ~= '' then redis.call('PUBLISH', ARGV[1], ev) end\n"
    "return {'OK', inc or '', ev or ''}\n";

const char *const sx__redis_scripts[SX_SCRIPT_COUNT] = {
    [SX_SCRIPT_PUBLISH] = publish_lua,
    [SX_SCRIPT_RENEW] = renew_lua,
    [SX_SCRIPT_UNPUBLISH] = unpublish_lua,
    [SX_SCRIPT_REMOVE] = remove_lua,
};

const char *const sx__redis_script_names[SX_SCRIPT_COUNT] = {
    [SX_SCRIPT_PUBLISH] = "publish",
    [SX_SCRIPT_RENEW] = "renew",
    [SX_SCRIPT_UNPUBLISH] = "unpublish",
    [SX_SCRIPT_REMOVE] = "remove",
};
